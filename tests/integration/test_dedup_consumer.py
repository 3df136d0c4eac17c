"""The consumer-side library on a real broker and Redis: a service reading a topic that holds
copies of records (same eosflow ID, later offsets) processes each ID once across a crash."""

from __future__ import annotations

import random
import time
import uuid
from typing import Any

import pytest
from confluent_kafka import TopicPartition

from connectors import KafkaSettings, TopicAdmin
from connectors.config import consumer_config, create_consumer, create_producer, producer_config
from dedup import IdDedupConsumer
from dedup.staged import HEADER_ID, HEADER_SINK

pytestmark = pytest.mark.integration


def _produce(settings: KafkaSettings, topic: str, n: int, copies: float) -> int:
    """``n`` records with eosflow sink headers; a share ``copies`` written again later."""
    TopicAdmin(settings).ensure_topic(topic, 2)
    producer = create_producer(producer_config(settings))
    rng = random.Random(3)
    written = 0
    later: list[int] = []
    for i in range(n):
        for j in [i, *([later.pop(0)] if later and rng.random() < 0.5 else [])]:
            producer.produce(
                topic,
                str(j).encode(),
                key=str(j % 7).encode(),
                headers=[(HEADER_SINK, b"job/out"), (HEADER_ID, f"0.1.1.{j}".encode())],
            )
            written += 1
        if rng.random() < copies:
            later.append(i)
    producer.flush(30)
    return written


def _reader(settings: KafkaSettings, topic: str, group: str, redis_url: str) -> IdDedupConsumer:
    consumer: Any = create_consumer(consumer_config(settings, group_id=group))
    reader = IdDedupConsumer(consumer, scope=group, redis_url=redis_url)
    reader.assign([TopicPartition(topic, p) for p in range(2)])  # from the committed offsets
    return reader


def _read(reader: IdDedupConsumer, limit: int | None = None) -> list[int]:
    """What ``consume`` delivers, until both partitions reached their end or, after a whole
    batch, at least ``limit`` records (a delivered record is processed, as a service would)."""
    out: list[int] = []
    eof: set[int] = set()
    deadline = time.monotonic() + 30
    while len(eof) < 2 and time.monotonic() < deadline:
        for msg in reader.consume(100, 0.2):
            if msg.error() is not None:
                eof.add(msg.partition())
                continue
            out.append(int(msg.value()))
        if limit is not None and len(out) >= limit:
            return out
    return out


def test_each_id_is_processed_once_across_copies_and_a_crash(
    kafka_settings: KafkaSettings, topic_name: str, redis_url: str
) -> None:
    n = 3000
    written = _produce(kafka_settings, topic_name, n, copies=0.2)
    assert written > n * 1.1
    group = f"svc-{uuid.uuid4().hex[:8]}"

    first = _reader(kafka_settings, topic_name, group, redis_url)
    done = _read(first, limit=1000)
    first.commit()  # 1000 processed and committed
    stored_not_committed = _read(first, limit=500)
    first.consumer = _CommitCrashes(first.consumer)
    with pytest.raises(RuntimeError, match="crash"):
        first.commit()  # IDs stored, then the process dies before the offsets are committed
    _read(first, limit=300)  # delivered, never committed: must come again
    first.close()

    second = _reader(kafka_settings, topic_name, group, redis_url)
    rest = _read(second)
    second.commit()
    second.close()

    processed = done + stored_not_committed + rest
    assert sorted(processed) == list(range(n)), (
        f"{len(processed) - len(set(processed))} processed twice, "
        f"{n - len(set(processed))} never processed"
    )
    assert second.duplicates > 0


class _CommitCrashes:
    """The process dies in ``Consumer.commit``: the offsets are never committed."""

    def __init__(self, consumer: Any) -> None:
        self._consumer = consumer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._consumer, name)

    def commit(self, *_args: Any, **_kwargs: Any) -> None:
        raise RuntimeError("crash before the offset commit")
