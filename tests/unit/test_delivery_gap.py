"""The delivery-gap rule of channel writers (issue 17), with a real librdkafka producer.

A channel is one partition written by one idempotent producer. If a record of it failed and a
later barrier still reached the log, a checkpoint could complete over the hole and the record
would be lost for good. The rule: a barrier is never written, and a snapshot never acked (the
worker polls its writer before it sends acks), after an earlier record of the writer failed;
and the producer is gapless with no local message timeout, so a failure after the barrier was
queued takes the barrier down with it.

The producer points at a loopback port nothing listens on: nothing is ever delivered, and
``purge()`` fails the queued records through librdkafka's own delivery-report path, the way a
real failure arrives (reported, but not served until the next poll).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from connectors.config import KafkaSettings
from connectors.outage import OutageLog
from connectors.transport import CHANNEL_PRODUCER_OVERRIDES, KafkaWriter, channel_producer_config
from processor.embedded._process import free_port
from processor.errors import KafkaClientError

BARRIER_HEADERS = [("eosflow-ctl", b"barrier")]


@pytest.fixture
def writer() -> KafkaWriter:
    return KafkaWriter(KafkaSettings(f"127.0.0.1:{free_port()}"), client_id="gap-test")


def _fail_queued(writer: KafkaWriter) -> None:
    """librdkafka fails every queued record; the reports wait for the next poll."""
    writer._producer.purge(in_queue=True, in_flight=True, blocking=True)


def test_a_barrier_is_refused_when_an_earlier_record_failed_but_was_not_reported_yet(
    writer: KafkaWriter,
) -> None:
    """Regression: the writer checked for failures only as of its last poll, so a barrier
    written right after an unserved failure went out behind the hole."""
    writer.write("chan", 0, b"r1")
    _fail_queued(writer)
    spy = writer._producer = _Produced(writer._producer)
    with pytest.raises(KafkaClientError, match=r"delivering to chan\[0\].*Purged"):
        writer.write("chan", 0, b"barrier", headers=BARRIER_HEADERS)
    # The barrier was never queued. (Not ``len(producer) == 0``: that also counts the client's
    # own requests, such as its connection attempts to the absent broker, and was flaky.)
    assert spy.values == []


class _Produced:
    """A producer that records the values given to ``produce``, and is the real one otherwise."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.values: list[bytes] = []

    def produce(self, topic: str, value: bytes, *args: Any, **kw: Any) -> None:
        self.values.append(value)
        self.inner.produce(topic, value, *args, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)


def test_poll_raises_a_failed_delivery_so_the_worker_never_acks_over_it(
    writer: KafkaWriter,
) -> None:
    """Regression: ``poll`` only stored the failure (raised at the next write), so an idle
    task went on acking snapshots whose epoch had lost a record."""
    writer.write("chan", 1, b"r1")
    _fail_queued(writer)
    with pytest.raises(KafkaClientError, match="Purged"):
        writer.poll()
    with pytest.raises(KafkaClientError):  # and it stays failed
        writer.write("chan", 1, b"r2")


def test_data_records_do_not_poll_on_the_hot_path(writer: KafkaWriter) -> None:
    """Only control records serve reports before writing: a data record costs no poll (the
    failure then surfaces at the next poll or barrier, before any ack)."""
    writer.write("chan", 2, b"r1")
    _fail_queued(writer)
    writer.write("chan", 2, b"r2")  # not refused: the failure is not served yet
    with pytest.raises(KafkaClientError):
        writer.poll()


def test_a_batch_written_at_once_reports_its_failures_like_single_records(
    writer: KafkaWriter,
) -> None:
    """``write_many`` (the channels' hot path) passes no callback per record: the producer's
    own reports its failures, so a failed batch record still stops polls, barriers and writes."""
    writer.write_many("chan", [(3, b"r1"), (3, b"r2"), (4, b"r3")])
    assert len(writer._producer) >= 3  # queued (with the client's own requests)
    _fail_queued(writer)
    with pytest.raises(KafkaClientError, match=r"delivering to chan\[[34]\].*Purged"):
        writer.write("chan", 3, b"barrier", headers=BARRIER_HEADERS)
    with pytest.raises(KafkaClientError):
        writer.write_many("chan", [(3, b"r4")])
    with pytest.raises(KafkaClientError):
        writer.poll()


def test_channel_producers_are_gapless_without_a_local_timeout_whatever_the_user_sets() -> None:
    settings = KafkaSettings("127.0.0.1:1", {"message.timeout.ms": 3000})
    config = channel_producer_config(settings, client_id="c")
    assert config["enable.gapless.guarantee"] is True
    assert config["message.timeout.ms"] == 0  # 0: infinite, an outage only delays records
    assert config["enable.idempotence"] is True
    assert CHANNEL_PRODUCER_OVERRIDES.items() <= config.items()


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_outage_is_logged_once_then_once_per_period_with_a_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = _Clock()
    outages = OutageLog(logging.getLogger("test.outage"), period_s=30, clock=clock)
    with caplog.at_level(logging.INFO, logger="test.outage"):
        for _ in range(300):  # librdkafka retries every ~100 ms: 30 s of them
            outages.log(logging.ERROR, "%s [%s] %s", "FAIL", "producer-1", "Connect failed")
            clock.now += 0.1
        outages.log(logging.ERROR, "%s [%s] %s", "FAIL", "producer-1", "Connect failed")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("Kafka broker unreachable: Connect failed")
    assert "still unreachable after 30s: 300 connection errors" in lines[1]
    clock.now += 31  # a whole period without an error: the outage is over
    with caplog.at_level(logging.INFO, logger="test.outage"):
        outages.log(logging.ERROR, "%s [%s] %s", "FAIL", "producer-1", "Connect failed again")
    assert caplog.records[-1].getMessage().startswith("Kafka broker unreachable: Connect failed")


def test_other_client_log_lines_pass_through_and_the_gapless_warning_is_quiet(
    caplog: pytest.LogCaptureFixture,
) -> None:
    outages = OutageLog(logging.getLogger("test.outage2"), clock=_Clock())
    with caplog.at_level(logging.INFO, logger="test.outage2"):
        outages.log(logging.WARNING, "%s [%s] %s", "CONFWARN", "p", "Configuration property "
                    "enable.gapless.guarantee is experimental: ...")  # fmt: skip
        outages.log(logging.WARNING, "%s [%s] %s", "CONFWARN", "p", "something else")
    assert [r.getMessage() for r in caplog.records] == ["CONFWARN [p] something else"]
