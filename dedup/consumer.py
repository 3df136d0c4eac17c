"""Exactly-once reading for services downstream of eosflow, without the engine.

:class:`IdDedupConsumer` wraps a ``confluent_kafka.Consumer``: ``consume``/``poll`` skip records
whose ID the service already processed, across restarts and rebalances, with the same Bloom
filters and Redis ID store as the ``dedup`` step (:mod:`dedup.core`).

The contract is the one of any Kafka consumer that commits after processing, plus the IDs:

1. records come out of ``consume``/``poll`` once per ID (copies are skipped and counted);
2. the service processes them;
3. it calls :meth:`IdDedupConsumer.commit`: the IDs delivered since the last commit go to
   Redis (one round trip), then the offsets are committed.

A crash before step 3 redelivers the records, as plain Kafka would (their IDs were not stored).
A crash between storing the IDs and committing the offsets redelivers records that are then
skipped, because their IDs are stored: that is the exactly-once part, and it also covers copies
of a record written again at later offsets (a re-publishing producer, a staged sink's
re-publication, an at-least-once hop). Leave ``enable.auto.commit`` off.

IDs are kept per partition (prefix ``eosflow:consumer:<scope>:<topic>:<partition>``) and the
filters of a partition are rebuilt from Redis when it is assigned, so a rebalance moves them
along. A copy written to *another* partition is not recognised: producers that key their records
send copies to the same partition. IDs are bucketed by the time this reader received them and
forgotten ``within`` later (by this process's clock), so a reader catching up on an old backlog
still recognises copies. To retry records by seeking back, call :meth:`IdDedupConsumer.rollback`
first: it forgets the IDs delivered since the last commit.

The ID of a message is ``id_of(message)``; the default reads the headers eosflow's Kafka sink
writes (``eosflow-sink`` and ``eosflow-id``). Messages without an ID pass and are counted as
``foreign``.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from dedup.core import Deduplicator
from dedup.ids import value_id
from dedup.staged import HEADER_ID, HEADER_SINK
from dedup.store import RedisIdStore, redis_client

__all__ = ["IdDedupConsumer", "sink_record_id"]

log = logging.getLogger(__name__)

#: Every incarnation shares one run: stored IDs always count (there are no snapshots to agree
#: with; IDs are stored only when the application commits).
_CONSUMER_RUN = 0


def sink_record_id(message: Any) -> Any:
    """The ID eosflow's Kafka sink put in a message's headers, or ``None``."""
    sink = record_id = None
    for name, value in message.headers() or ():
        if name == HEADER_ID:
            record_id = value
        elif name == HEADER_SINK:
            sink = value
    if record_id is None or sink is None:
        return None
    return bytes(sink) + b"\x00" + bytes(record_id)


class IdDedupConsumer:
    """A consumer whose ``consume``/``poll`` skip records already processed. See the module
    docstring.

    Args:
        consumer: the consumer (``enable.auto.commit=false``).
        scope: names this reader's IDs in Redis (usually its ``group.id``).
        within: how long IDs are remembered, counted from the record timestamps.
        id_of: the ID of a message (any JSON-like value), or ``None`` for "no ID".
        redis_url: default ``EOSFLOW_REDIS_URL``.
        expected_ids, fp_rate: Bloom filter sizing per partition and time bucket.
        clock: seconds since the epoch (tests pass a fake).
    """

    def __init__(
        self,
        consumer: Consumer,
        *,
        scope: str,
        within: timedelta = timedelta(hours=1),
        id_of: Callable[[Any], Any] = sink_record_id,
        redis_url: str | None = None,
        expected_ids: int = 100_000,
        fp_rate: float = 0.001,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.consumer = consumer
        self.scope = scope
        self.within_ms = within // timedelta(milliseconds=1)
        self.id_of = id_of
        self.expected_ids = expected_ids
        self.fp_rate = fp_rate
        self.clock = clock
        self.client = redis_client(redis_url, name="eosflow-consumer")
        self.partitions: dict[tuple[str, int], Deduplicator] = {}
        self.foreign = 0
        self._commits = 0

    # -- assignment ------------------------------------------------------------------------------

    def _open(self, topic: str, partition: int) -> Deduplicator:
        store = RedisIdStore(self.client, f"eosflow:consumer:{self.scope}:{topic}:{partition}")
        dedup = Deduplicator(
            store,
            within_ms=self.within_ms,
            expected_ids=self.expected_ids,
            fp_rate=self.fp_rate,
            late="pass",  # receive-time buckets: nothing is older than the horizon
            flush_ids=sys.maxsize,  # IDs reach Redis only in commit()
            name=f"{self.scope}:{topic}:{partition}",
            run=_CONSUMER_RUN,
        )
        dedup.advance(int(self.clock() * 1000))
        loaded = dedup.rebuild()
        log.info(
            "dedup consumer assigned scope=%s topic=%s partition=%d ids_loaded=%d",
            self.scope, topic, partition, loaded,
        )  # fmt: skip
        return dedup

    def _assigned(self, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            key = (tp.topic, tp.partition)
            if key not in self.partitions:
                self.partitions[key] = self._open(tp.topic, tp.partition)

    def _revoked(self, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            self.partitions.pop((tp.topic, tp.partition), None)

    def assign(self, partitions: list[TopicPartition]) -> None:
        self._assigned(partitions)
        self.consumer.assign(partitions)

    def subscribe(self, topics: list[str], **kwargs: Any) -> None:
        """Like ``Consumer.subscribe``; commit before a rebalance takes partitions away (the
        revoke callback drops their uncommitted IDs, as Kafka drops their uncommitted offsets).
        """
        user_assign = kwargs.pop("on_assign", None)
        user_revoke = kwargs.pop("on_revoke", None)

        def on_assign(consumer: Consumer, partitions: list[TopicPartition]) -> None:
            self._assigned(partitions)
            if user_assign is not None:
                user_assign(consumer, partitions)

        def on_revoke(consumer: Consumer, partitions: list[TopicPartition]) -> None:
            if user_revoke is not None:
                user_revoke(consumer, partitions)
            self._revoked(partitions)

        self.consumer.subscribe(topics, on_assign=on_assign, on_revoke=on_revoke, **kwargs)

    # -- reading ---------------------------------------------------------------------------------

    def consume(self, num_messages: int = 1, timeout: float = -1) -> list[Any]:
        """Like ``Consumer.consume``, without records already delivered (errors pass through)."""
        msgs = self.consumer.consume(num_messages, timeout)
        if not msgs:
            return msgs
        now_ms = int(self.clock() * 1000)
        keep = [True] * len(msgs)
        groups: dict[tuple[str, int], list[int]] = {}
        for i, msg in enumerate(msgs):
            if msg.error() is not None:
                continue
            key: Any = (msg.topic(), msg.partition())
            groups.setdefault(key, []).append(i)
        for key, indexes in groups.items():
            dedup = self.partitions.get(key)
            if dedup is None:  # assigned behind our back (consumer.assign called directly)
                dedup = self.partitions[key] = self._open(*key)
            dedup.advance(now_ms)
            ids, where = [], []
            for i in indexes:
                record_id = self.id_of(msgs[i])
                if record_id is None:
                    self.foreign += 1
                    continue
                ids.append(value_id(record_id))
                where.append(i)
            # Buckets by receive time: a reader catching up on a backlog older than ``within``
            # must still recognise copies (record timestamps would make them all "late").
            stamps = [now_ms] * len(ids)
            for i, new in zip(where, dedup.check(ids, stamps), strict=True):
                keep[i] = new
        return [m for m, k in zip(msgs, keep, strict=True) if k]

    def poll(self, timeout: float = -1) -> Any:
        """Like ``Consumer.poll``; a skipped copy returns ``None``."""
        msgs = self.consume(1, timeout)
        return msgs[0] if msgs else None

    def commit(self) -> None:
        """Stores the IDs delivered since the last commit (one round trip per partition with
        new IDs), then commits the consumer's offsets synchronously."""
        self._commits += 1
        for dedup in self.partitions.values():
            dedup.prepare(self._commits)
            dedup.commit(self._commits)  # deletes buckets past the horizon
        try:
            self.consumer.commit(asynchronous=False)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError._NO_OFFSET:  # nothing consumed since the last
                raise

    def rollback(self) -> None:
        """Forgets the IDs delivered since the last :meth:`commit` (call it before seeking back
        to retry records: otherwise they would be skipped as already delivered)."""
        for key in list(self.partitions):
            self.partitions[key] = self._open(*key)

    @property
    def duplicates(self) -> int:
        return sum(d.stats.duplicates for d in self.partitions.values())

    def close(self) -> None:
        """Closes the consumer (uncommitted work is redelivered to the next reader)."""
        self.consumer.close()
        self.client.close()
