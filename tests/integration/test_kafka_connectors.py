"""Produce and consume through the connectors against a real broker.

The broker is the embedded Tansu, or the one named by EOSFLOW_KAFKA_BROKERS: the tests are the same.
"""

from __future__ import annotations

import collections
import time
from typing import Any

import pytest

from connectors import (
    KafkaSettings,
    PartitionReader,
    TopicAdmin,
    TopicSpec,
    create_producer,
    producer_config,
)
from connectors.probe import _read_committed_hides_aborted, write_aborted_then_committed
from connectors.serde import ConfluentAvroSerde, JsonSerde
from processor.errors import ConfigError, DeserializationError, KafkaClientError
from tests.features import skip_unless_broker_has

PARTITIONS = 3


def _produce(
    settings: KafkaSettings, topic: str, values: list[bytes], *, partitions: int = PARTITIONS
) -> None:
    producer = create_producer(producer_config(settings))
    failures: list[Any] = []
    for i, value in enumerate(values):
        producer.produce(
            topic,
            value,
            key=str(i).encode(),
            partition=i % partitions,
            headers=[("eosflow-id", str(i).encode())],
            on_delivery=lambda err, _m: err and failures.append(err),
        )
    assert producer.flush(30) == 0
    assert not failures


def _drain(reader: PartitionReader, *, limit_s: float = 30.0) -> list[Any]:
    out: list[Any] = []
    deadline = time.monotonic() + limit_s
    while not reader.reached_end():
        assert time.monotonic() < deadline, (
            f"reader stuck at {reader.positions()} of {reader.end_offsets_at_open}"
        )
        out.extend(reader.poll(1000, 0.2))
    return out


def test_ensure_topic_is_idempotent_when_called_twice(
    kafka_settings: KafkaSettings, topic_name: str
) -> None:
    admin = TopicAdmin(kafka_settings)
    assert admin.ensure_topic(topic_name, PARTITIONS) is True
    assert admin.ensure_topic(topic_name, PARTITIONS) is False
    assert admin.describe(topic_name).partitions == PARTITIONS
    assert admin.exists(topic_name)


def test_ensure_topic_refuses_when_the_partition_count_differs(
    kafka_settings: KafkaSettings, topic_name: str
) -> None:
    admin = TopicAdmin(kafka_settings)
    admin.ensure_topics([TopicSpec(topic_name, 2)])
    with pytest.raises(ConfigError, match="exists with 2 partitions, expected 4"):
        admin.ensure_topics([TopicSpec(topic_name, 4)])


def test_reader_delivers_every_record_once_when_reading_to_the_end(
    kafka_settings: KafkaSettings, topic_name: str
) -> None:
    serde = JsonSerde()
    events = [{"user": f"u{i % 17}", "amount": i, "note": "é"} for i in range(3000)]
    TopicAdmin(kafka_settings).ensure_topic(topic_name, PARTITIONS)
    _produce(kafka_settings, topic_name, [serde.serialize(e) for e in events])
    with PartitionReader(kafka_settings) as reader:
        reader.open({(topic_name, p): None for p in range(PARTITIONS)})
        records = _drain(reader)
        got = [
            serde.deserialize(
                m.value(), topic=m.topic(), partition=m.partition(), offset=m.offset()
            )
            for m in records
        ]
        assert collections.Counter(e["amount"] for e in got) == collections.Counter(range(3000))
        assert all(dict(m.headers())["eosflow-id"] == m.key() for m in records)
        assert reader.positions() == {(topic_name, p): 1000 for p in range(PARTITIONS)}
        assert TopicAdmin(kafka_settings).end_offsets(reader.positions()) == reader.positions()


def test_reader_resumes_without_loss_or_duplicate_when_reopened_at_saved_positions(
    kafka_settings: KafkaSettings, topic_name: str
) -> None:
    """The checkpoint contract: positions saved mid-stream and reopened cover each record once."""
    TopicAdmin(kafka_settings).ensure_topic(topic_name, PARTITIONS)
    _produce(kafka_settings, topic_name, [str(i).encode() for i in range(900)])
    tps = {(topic_name, p): None for p in range(PARTITIONS)}
    first: list[bytes] = []
    with PartitionReader(kafka_settings) as reader:
        reader.open(tps)
        while len(first) < 400:
            first.extend(m.value() for m in reader.poll(50, 0.2))
        saved = reader.positions()
    with PartitionReader(kafka_settings) as reader:
        reader.open(saved)
        rest = [m.value() for m in _drain(reader)]
    assert sorted(first + rest, key=int) == [str(i).encode() for i in range(900)]


def test_seek_redelivers_from_the_offset_when_rewound(
    kafka_settings: KafkaSettings, topic_name: str
) -> None:
    TopicAdmin(kafka_settings).ensure_topic(topic_name, 1)
    _produce(kafka_settings, topic_name, [str(i).encode() for i in range(100)], partitions=1)
    tp = (topic_name, 0)
    with PartitionReader(kafka_settings) as reader:
        reader.open({tp: 0})
        assert len(_drain(reader)) == 100
        reader.seek(tp, 90)
        assert reader.position(tp) == 90
        again = []
        deadline = time.monotonic() + 20
        while len(again) < 10 and time.monotonic() < deadline:
            again.extend(reader.poll(100, 0.2))
        assert [m.offset() for m in again] == list(range(90, 100))


def test_paused_partition_delivers_nothing_until_resumed(
    kafka_settings: KafkaSettings, topic_name: str
) -> None:
    TopicAdmin(kafka_settings).ensure_topic(topic_name, 2)
    _produce(kafka_settings, topic_name, [str(i).encode() for i in range(200)], partitions=2)
    with PartitionReader(kafka_settings) as reader:
        reader.open({(topic_name, 0): 0, (topic_name, 1): 0})
        reader.pause([(topic_name, 1)])
        assert reader.paused == {(topic_name, 1)}
        seen: list[Any] = []
        deadline = time.monotonic() + 20
        while reader.position((topic_name, 0)) < 100 and time.monotonic() < deadline:
            seen.extend(reader.poll(100, 0.2))
        for _ in range(5):
            seen.extend(reader.poll(100, 0.1))
        assert {m.partition() for m in seen} == {0}
        reader.resume([(topic_name, 1)])
        seen.extend(_drain(reader))
        assert collections.Counter(m.partition() for m in seen) == {0: 100, 1: 100}


def test_held_records_come_again_in_order_once_resumed_with_positions_at_the_first_held(
    kafka_settings: KafkaSettings, topic_name: str
) -> None:
    """Watermark alignment gives back the tail of a batch (``hold``): the partition's position
    goes back to the first held record (what a checkpoint then stores), nothing of it comes
    while it is paused, and once resumed every record comes once, in offset order; a bounded
    run still stops at its stop offset."""
    TopicAdmin(kafka_settings).ensure_topic(topic_name, 2)
    _produce(kafka_settings, topic_name, [str(i).encode() for i in range(400)], partitions=2)
    tp0, tp1 = (topic_name, 0), (topic_name, 1)
    with PartitionReader(kafka_settings) as reader:
        reader.open({tp0: 0, tp1: 0}, stop_at={tp0: 190, tp1: 200})
        seen: dict[tuple[str, int], list[int]] = {tp0: [], tp1: []}
        deadline = time.monotonic() + 20
        batch: list[Any] = []
        while not [m for m in batch if m.partition() == 1] and time.monotonic() < deadline:
            batch = reader.poll(1000, 0.2)
            for m in batch:
                if m.partition() == 0:
                    seen[tp0].append(m.offset())
        ones = [m for m in batch if m.partition() == 1]
        keep = len(ones) // 2
        seen[tp1] += [m.offset() for m in ones[:keep]]
        reader.hold(tp1, ones[keep:])
        assert tp1 in reader.paused
        assert reader.position(tp1) == ones[keep].offset()
        for _ in range(5):
            assert [m for m in reader.poll(1000, 0.1) if m.partition() == 1] == []
        reader.resume([tp1])
        again = reader.poll(3, 0.1)  # held ones first, from memory, as many as asked
        assert [(m.partition(), m.offset()) for m in again] == [
            (1, m.offset()) for m in ones[keep : keep + 3]
        ]
        rest: list[Any] = []
        while reader.position(tp0) < 190 or reader.position(tp1) < 200:
            assert time.monotonic() < deadline + 20, f"stuck at {reader.positions()}"
            rest += reader.poll(1000, 0.2)
        for m in again + rest + reader.poll(1000, 0.5):
            seen[(topic_name, m.partition())].append(m.offset())
    assert seen[tp1] == list(range(200)), "every record of the held partition once, in order"
    assert seen[tp0] == list(range(190))
    assert reader.position(tp1) == 200 and reader.position(tp0) == 190


def test_reader_reaches_the_end_when_transaction_markers_follow_the_last_record(
    kafka_settings: KafkaSettings, topic_name: str
) -> None:
    TopicAdmin(kafka_settings).ensure_topic(topic_name, 1)
    producer = create_producer(producer_config(kafka_settings, transactional_id=f"{topic_name}-tx"))
    producer.init_transactions(30)
    for batch in range(3):
        producer.begin_transaction()
        for i in range(10):
            producer.produce(topic_name, f"{batch}-{i}".encode(), partition=0)
        producer.commit_transaction(30)
    with PartitionReader(kafka_settings) as reader:
        reader.open({(topic_name, 0): None})
        values = [m.value() for m in _drain(reader)]
    assert len(values) == 30
    # 30 records plus 3 commit markers: the position is past the last marker.
    assert reader.position((topic_name, 0)) == reader.end_offsets_at_open[(topic_name, 0)] >= 33


def test_a_bounded_reader_delivers_nothing_at_or_past_its_stop_offsets_however_much_follows(
    kafka_settings: KafkaSettings, topic_name: str
) -> None:
    """A bounded run reads up to the end offsets it had at start (``stop_at``): records
    appended meanwhile are left for the next run, whichever batch they arrive in."""
    TopicAdmin(kafka_settings).ensure_topic(topic_name, PARTITIONS)
    _produce(kafka_settings, topic_name, [b"old-%d" % i for i in range(300)])
    tps = [(topic_name, p) for p in range(PARTITIONS)]
    ends = TopicAdmin(kafka_settings).end_offsets(tps)
    stop = {**ends, (topic_name, 2): 40}  # a stop inside the data, too
    _produce(kafka_settings, topic_name, [b"new-%d" % i for i in range(300)])
    with PartitionReader(kafka_settings) as reader:
        reader.open(dict.fromkeys(tps), stop_at=stop)
        seen: list[Any] = []
        deadline = time.monotonic() + 30
        while reader.paused != set(tps):
            assert time.monotonic() < deadline, f"never stopped: {reader.positions()}"
            seen.extend(reader.poll(1000, 0.2))
        seen.extend(reader.poll(1000, 0.5))  # nothing more, paused
        assert reader.positions() == stop
    got = collections.Counter(m.partition() for m in seen)
    assert got == {0: 100, 1: 100, 2: 40}
    assert all(m.value().startswith(b"old-") for m in seen)
    assert all(m.offset() < stop[(m.topic(), m.partition())] for m in seen)
    # A start past its stop (a "latest" source whose end moved on before its start was taken)
    # reads nothing and keeps its position: a stop never moves a position back.
    with PartitionReader(kafka_settings) as reader:
        reader.open({(topic_name, 0): 150}, stop_at={(topic_name, 0): 100})
        assert reader.poll(1000, 0.5) == []
        assert reader.positions() == {(topic_name, 0): 150}
        assert reader.paused == {(topic_name, 0)}


def test_read_committed_reader_never_sees_aborted_records_when_the_broker_supports_it(
    kafka_settings: KafkaSettings, broker_caps: Any, topic_name: str
) -> None:
    skip_unless_broker_has(
        broker_caps,
        "read_committed hides aborted records",
        broker_caps.read_committed_hides_aborted,
        f"cluster {broker_caps.cluster_id} shows aborted records to read_committed consumers "
        "(Tansu does); this test runs fully on Apache Kafka",
    )
    TopicAdmin(kafka_settings).ensure_topic(topic_name, 1)
    write_aborted_then_committed(
        kafka_settings, topic_name, aborted=b"aborted", committed=b"committed"
    )
    with PartitionReader(kafka_settings) as reader:
        reader.open({(topic_name, 0): None})
        assert [m.value() for m in _drain(reader)] == [b"committed"]


def test_probe_matches_what_a_read_committed_reader_observes(
    kafka_settings: KafkaSettings, broker_caps: Any, topic_name: str
) -> None:
    """The probe's verdict is the truth about this broker, whichever broker it is."""
    assert broker_caps.idempotent_producer and broker_caps.transactions
    TopicAdmin(kafka_settings).ensure_topic(topic_name, 1)
    write_aborted_then_committed(
        kafka_settings, topic_name, aborted=b"aborted", committed=b"committed"
    )
    with PartitionReader(kafka_settings) as reader:
        reader.open({(topic_name, 0): None})
        values = [m.value() for m in _drain(reader)]
    assert (b"aborted" not in values) == broker_caps.read_committed_hides_aborted
    assert b"committed" in values


def test_the_read_committed_probe_gives_no_answer_when_its_own_record_does_not_arrive(
    kafka_settings: KafkaSettings, topic_name: str
) -> None:
    """Broke (issue 35, item 4): a probe whose committed record was not read in time answered
    "read_committed shows aborted records", and the Kafka sink's rescue then decided an
    epoch's fate from ``read_uncommitted`` on Apache Kafka, counting an aborted epoch's marker
    as committed. A slow read is no answer: the probe raises (retriable) and caches nothing."""
    TopicAdmin(kafka_settings).ensure_topic(topic_name, 1)  # the committed record never comes
    with pytest.raises(KafkaClientError, match="could not tell") as caught:
        _read_committed_hides_aborted(kafka_settings, topic_name, 1.0)
    assert caught.value.retriable


def test_the_probe_reports_the_release_and_transaction_version_when_the_broker_is_kafka(
    broker_caps: Any,
) -> None:
    """What ``eosflow probe`` prints: Apache Kafka says which release its cluster runs
    (``metadata.version`` on KRaft, ``inter.broker.protocol.version`` on ZooKeeper); Tansu
    says neither."""
    if broker_caps.read_committed_hides_aborted:  # Apache Kafka
        assert broker_caps.release and broker_caps.release[0].isdigit(), broker_caps
        if "KRaft" in broker_caps.release and broker_caps.release >= "4":
            assert broker_caps.transaction_version is not None
    else:
        assert broker_caps.release is None
    assert "Kafka release:" in broker_caps.summary()


def test_malformed_record_names_its_topic_partition_and_offset_when_decoded(
    kafka_settings: KafkaSettings, topic_name: str
) -> None:
    schema = {
        "type": "record",
        "name": "Click",
        "fields": [{"name": "user", "type": "string"}, {"name": "ts_ms", "type": "long"}],
    }
    serde = ConfluentAvroSerde(schema, schema_id=7)
    good = [serde.serialize({"user": f"u{i}", "ts_ms": i}) for i in range(5)]
    TopicAdmin(kafka_settings).ensure_topic(topic_name, 1)
    _produce(kafka_settings, topic_name, [*good[:3], b'{"user": "json?"}', *good[3:]], partitions=1)
    decoded, bad = [], []
    with PartitionReader(kafka_settings) as reader:
        reader.open({(topic_name, 0): None})
        for m in _drain(reader):
            try:
                decoded.append(
                    serde.deserialize(
                        m.value(), topic=m.topic(), partition=m.partition(), offset=m.offset()
                    )
                )
            except DeserializationError as exc:
                bad.append(exc)
    assert [d["ts_ms"] for d in decoded] == [0, 1, 2, 3, 4]
    assert len(bad) == 1
    assert (bad[0].topic, bad[0].partition, bad[0].offset) == (topic_name, 0, 3)
    assert f"topic={topic_name!r} partition=0 offset=3" in str(bad[0])
