"""The rescue's decision whether an epoch committed (sinks.kafka.rescue), with the broker
reads replaced: which isolation level may decide, on which broker."""

from __future__ import annotations

from typing import Any

import pytest

from connectors import KafkaSettings
from processor.errors import KafkaClientError
from sinks.kafka import rescue
from sinks.kafka.broker import _StalledRead

COMMITTABLE = {"marker": ["eosflow.job.out.txn-markers", 0, 41], "epoch": "1.3"}


def _reads(monkeypatch: pytest.MonkeyPatch, *, hides: bool, answers: list[Any]) -> list[bool]:
    """Replaces the marker reads by ``answers`` (a bool, or an exception to raise) and the
    broker probe by ``hides``; returns the isolation levels asked for (True: read_committed)."""
    asked: list[bool] = []

    def marker_in(*_a: Any, read_committed: bool, **_kw: Any) -> bool:
        asked.append(read_committed)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return bool(answer)

    monkeypatch.setattr(rescue, "_marker_in", marker_in)
    monkeypatch.setattr(rescue, "hides_aborted_records", lambda _settings: hides)
    return asked


def _committed() -> bool:
    settings = KafkaSettings(brokers="127.0.0.1:9")
    return rescue.epoch_committed(settings, COMMITTABLE, b"job/out", b"0", "sink=out subtask=0")


def test_a_stalled_read_is_never_decided_by_read_uncommitted_when_the_broker_hides_aborts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression (issue 17): after a stalled read_committed read the rescue fell back to
    read_uncommitted on every broker. On Apache Kafka that reads the epoch's *aborted* marker
    and calls the epoch committed: it was lost with only a warning."""
    asked = _reads(monkeypatch, hides=True, answers=[_StalledRead("stalled"), False])
    assert _committed() is False  # decided by read_committed, after the open transaction ended
    assert asked == [True, True]


def test_a_read_that_stays_stalled_fails_the_task_with_the_reason_when_the_broker_hides_aborts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked = _reads(
        monkeypatch, hides=True, answers=[_StalledRead("stalled"), _StalledRead("stalled")]
    )
    with pytest.raises(KafkaClientError, match=r"cannot tell whether epoch 1\.3 committed") as err:
        _committed()
    assert err.value.retriable and "eosflow txn" in str(err.value)
    assert False not in asked


def test_a_stalled_read_falls_back_to_read_uncommitted_only_where_the_probe_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tansu: read_committed shows aborted records anyway, so read_uncommitted answers what
    its readers see; the probe, not a timeout, switches this on."""
    asked = _reads(monkeypatch, hides=False, answers=[_StalledRead("stalled"), True])
    assert _committed() is True
    assert asked == [True, False]


def test_the_marker_read_with_read_committed_decides_when_it_does_not_stall(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for hides in (True, False):
        asked = _reads(monkeypatch, hides=hides, answers=[False])
        assert _committed() is False
        assert asked == [True]


def test_a_rescue_matches_the_subtask_of_the_committable_when_another_writer_settles_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Settling an old shape (issue 24): the marker and the records of an epoch carry the
    subtask that wrote it; the rescue matched them against the rescuing writer's subtask."""
    from processor.contracts import SinkContext
    from processor.errors import EosflowError
    from sinks.kafka import transactional

    asked: dict[str, Any] = {}

    def committed(_s: Any, _c: Any, _sink: bytes, subtask: bytes, where: str) -> bool:
        asked["marker"], asked["where"] = subtask, where
        return False

    def read(_s: Any, _c: Any, subtask: int, _sink: bytes) -> list[Any]:
        asked["records"] = subtask
        return []

    monkeypatch.setattr(transactional, "epoch_committed", committed)
    monkeypatch.setattr(transactional, "read_epoch", read)
    writer = object.__new__(transactional.KafkaSinkWriter)
    writer.ctx = SinkContext("job", "out", 0, 1, 1)
    writer.settings = KafkaSettings(brokers="127.0.0.1:9")
    writer.sink_id = b"job/out"
    monkeypatch.setattr(writer, "_producer", lambda slot, fresh=False: None)
    committable = {**COMMITTABLE, "tid": "p-out-2-1", "slot": 1, "count": 3, "ranges": []}
    with pytest.raises(EosflowError, match=r"sink out\[2\]: epoch 1\.3 held 3 records"):
        writer._rescue(committable, fresh=False)
    assert asked == {"marker": b"2", "where": "sink=out subtask=2", "records": 2}
    assert transactional.committable_subtask({**committable, "subtask": 5}) == 5
    assert transactional.committable_subtask({"tid": "my-job-p-sink-step-12-3"}) == 12


def test_recover_decides_an_epoch_once_its_own_id_is_fenced_while_the_others_still_init(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An id whose transaction a crash left open takes librdkafka's 0.5 s PID timer to
    initialize; a pending epoch on another id is decided meanwhile, never before its own id
    is fenced (its transaction could still change until then)."""
    import threading
    import time

    from processor.contracts import SinkContext
    from sinks.kafka import transactional

    fenced: set[int] = set()
    lock = threading.Lock()

    def new_producer(slot: int) -> object:
        time.sleep(0.5 if slot == 5 else 0.01)  # slot 5: an open transaction to abort
        with lock:
            fenced.add(slot)
        return object()

    asked: list[tuple[int, set[int]]] = []

    def committed(_s: Any, c: Any, _sink: bytes, _subtask: bytes, _where: str) -> bool:
        with lock:
            asked.append((c["slot"], set(fenced)))
        return True

    monkeypatch.setattr(transactional, "epoch_committed", committed)
    writer = object.__new__(transactional.KafkaSinkWriter)
    writer.ctx = SinkContext("job", "out", 0, 1, 1)
    writer.settings = KafkaSettings(brokers="127.0.0.1:9")
    writer.sink_id = b"job/out"
    writer.sink = type("Sink", (), {"pool_size": 2})()  # type: ignore[assignment]
    writer.producers, writer.busy = {}, {}
    writer.marker_partition = 0  # what __init__'s marker topic setup found
    monkeypatch.setattr(writer, "_new_producer", new_producer)
    writer.recover([(7, {**COMMITTABLE, "tid": "p-out-0-1", "slot": 1, "subtask": 0})])
    ((slot, fenced_then),) = asked
    assert slot == 1 and 1 in fenced_then  # its own id first
    assert 5 not in fenced_then  # not after the slow one
    assert sorted(writer.producers) == [0, 1]  # the pool kept, every id initialized
    assert fenced == set(range(8))


def test_the_marker_topic_is_set_up_beside_the_producers_and_its_failure_fails_the_open(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A writer's construction does not wait for its marker topic (created on a job's first
    start: 0.1 s); ``recover`` (a task's open) does, after the producers' init, so a topic
    that cannot be created still fails the open, and a marker is never produced before."""
    import threading

    from processor.contracts import SinkContext
    from processor.errors import ConfigError
    from sinks import KafkaSink
    from sinks.kafka import transactional

    release, inits = threading.Event(), []

    def slow_refusal(*_args: Any) -> int:
        release.wait(5)
        raise ConfigError("not allowed to create the marker topic")

    monkeypatch.setattr(transactional, "_marker_partition", slow_refusal)
    sink = KafkaSink("out", transactional_id_prefix="p", settings=KafkaSettings("127.0.0.1:9"))
    writer = sink.open(SinkContext("job", "out", 0, 1, 1))  # returns with the setup pending
    assert writer.marker_partition == -1
    monkeypatch.setattr(writer, "_new_producer", lambda slot: inits.append(slot) or object())
    release.set()
    with pytest.raises(ConfigError, match="marker topic"):
        writer.recover([])
    assert len(inits) == transactional._MAX_SLOTS  # the producers were initialized meanwhile
