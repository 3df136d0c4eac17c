"""Broker calls around the produce path: librdkafka calls retried while they fail
retriably, a partition range read back (recovery re-reads epochs and markers with it), and
the ``eosflow txn`` commands (list the commit markers, abort lingering transactions)."""

from __future__ import annotations

import os
import time
from typing import Any

import orjson
from confluent_kafka import KafkaError, TopicPartition

from connectors.admin import TopicAdmin
from connectors.config import (
    KafkaSettings,
    consumer_config,
    create_consumer,
    create_producer,
    producer_config,
)
from connectors.errors import classify, retrying
from processor.errors import KafkaClientError
from sinks.kafka.records import _MAX_SLOTS, marker_topic, transactional_ids

__all__ = ["abort_lingering", "read_transaction_markers"]


class _StalledRead(KafkaClientError):
    """A read to the end delivered nothing, not even the end of the partition, for a while."""


def _read_range(
    settings: KafkaSettings,
    topic: str,
    partition: int,
    start: int,
    end: int | None,
    *,
    read_committed: bool,
    timeout: float = 30.0,
    stall_s: float = 5.0,
) -> list[Any]:
    """Records of ``topic[partition]`` from ``start`` to ``end`` (exclusive; ``None``: to the
    end a reader of that isolation level can reach)."""
    conf = consumer_config(
        settings,
        group_id=f"eosflow-sink-recovery-{os.getpid()}",
        overrides={"isolation.level": "read_committed" if read_committed else "read_uncommitted"},
        allow_read_uncommitted=not read_committed,
    )
    consumer = create_consumer(conf)
    out: list[Any] = []
    try:
        consumer.assign([TopicPartition(topic, partition, start)])
        deadline = time.monotonic() + timeout
        last_progress = time.monotonic()
        while time.monotonic() < deadline:
            msgs = consumer.consume(1000, 0.2)
            if msgs:
                last_progress = time.monotonic()
            elif end is None and time.monotonic() - last_progress > stall_s:
                raise _StalledRead(
                    f"reading {topic}[{partition}] from {start}: no record and no end of "
                    f"partition for {stall_s}s",
                    retriable=True,
                )
            for msg in msgs:
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        if end is None or (msg.offset() or 0) >= end:
                            return out
                        continue
                    raise classify(err, context=f"reading {topic}[{partition}] from {start}")
                offset: int = msg.offset() or 0
                if end is not None and offset >= end:
                    return out
                out.append(msg)
                if end is not None and offset == end - 1:
                    return out
        raise KafkaClientError(
            f"reading {topic}[{partition}] from {start} to {end}: not done within {timeout}s",
            retriable=True,
        )
    finally:
        consumer.close()


def read_transaction_markers(
    settings: KafkaSettings, job: str, step: str, *, read_committed: bool = True
) -> list[dict[str, Any]]:
    """Every commit marker of a sink step (``eosflow txn list``)."""
    topic = marker_topic(job, step)
    admin = TopicAdmin(settings)
    if not admin.exists(topic):
        return []
    out = []
    for partition in range(len(admin.partitions(topic))):
        for msg in _read_range(settings, topic, partition, 0, None, read_committed=read_committed):
            entry = orjson.loads(msg.value())
            entry["offset"], entry["partition"] = msg.offset(), partition
            out.append(entry)
    return out


def abort_lingering(settings: KafkaSettings, prefix: str, step: str, subtasks: int) -> list[str]:
    """Fence every transactional id of a sink step's pool (``eosflow txn abort``).

    ``init_transactions`` on an id aborts its open transaction. Never run this while the job
    runs: it fences the live producers (the job restarts and recovers).
    """
    done = []
    for subtask in range(subtasks):
        for tid in transactional_ids(prefix, step, subtask, _MAX_SLOTS):
            producer = create_producer(producer_config(settings, transactional_id=tid))
            retrying(producer.init_transactions, f"init_transactions {tid}")
            producer.flush(5)
            done.append(tid)
    return done
