"""Reading the output of a staged :class:`sinks.kafka.KafkaSink` exactly once.

A staged sink publishes each epoch after its checkpoint completed, with the idempotent producer
and no transaction. If the worker dies while publishing, recovery publishes the whole epoch
again: a partition then holds a prefix of the epoch's records twice, same IDs, same order. That
is the only way a record repeats, so a reader needs no ID catalog: per (sink, subtask,
partition) it keeps the highest ``(generation, n, seq)`` seen and drops anything not above it.

- :class:`StagedDeduplicator`: the rule, on headers; its state is small (one entry per producing
  subtask and partition), JSON-encodable, and can be saved with the reader's own offsets.
- :class:`DedupConsumer`: wraps a ``confluent_kafka.Consumer``; on assignment it rebuilds the
  state by re-reading up to ``lookback`` records before the start position of each partition,
  so a restarted reader also drops repeats that straddle its restart.

Records without eosflow headers pass through (``foreign`` counts them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from confluent_kafka import OFFSET_END, Consumer, KafkaError, TopicPartition

__all__ = ["DedupConsumer", "StagedDeduplicator", "parse_record_id"]

log = logging.getLogger(__name__)

HEADER_SINK = "eosflow-sink"  # "<job>/<step>"
HEADER_ID = "eosflow-id"  # "<subtask>.<generation>.<n>.<seq>": unique per sink


def parse_record_id(record_id: bytes | str) -> tuple[str, tuple[int, int, int]]:
    """``(subtask, (generation, n, seq))`` of an ID ``<subtask>.<generation>.<n>.<seq>``."""
    text = record_id.decode() if isinstance(record_id, bytes) else record_id
    subtask, generation, n, seq = text.split(".")
    return subtask, (int(generation), int(n), int(seq))


class StagedDeduplicator:
    """Drops re-published repeats; see the module docstring.

    Invariants:
        A record is accepted iff its order key is above every key accepted before from the same
        (sink, subtask, topic, partition). Records of one producing subtask in one partition
        arrive in increasing order except for repeats, so nothing new is ever dropped.
    """

    def __init__(self, state: dict[str, list[int]] | None = None) -> None:
        self.high: dict[str, tuple[int, int, int]] = {
            k: (v[0], v[1], v[2]) for k, v in (state or {}).items()
        }
        self.dropped = 0
        self.foreign = 0

    def accept(self, topic: Any, partition: Any, headers: Any) -> bool:
        """Whether a record with these headers is new (and remember it)."""
        sink = record_id = None
        for name, value in headers or ():
            if name == HEADER_ID:
                record_id = value
            elif name == HEADER_SINK:
                sink = value
        if record_id is None or sink is None:
            self.foreign += 1
            return True
        subtask, order = parse_record_id(record_id)
        producer = f"{_text(sink)}|{subtask}|{topic}|{partition}"
        high = self.high.get(producer)
        if high is not None and order <= high:
            self.dropped += 1
            return False
        self.high[producer] = order
        return True

    def state(self) -> dict[str, list[int]]:
        """JSON-encodable state, for :meth:`__init__` after a restart."""
        return {k: list(v) for k, v in self.high.items()}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class DedupConsumer:
    """A ``confluent_kafka.Consumer`` whose ``consume``/``poll`` skip staged-sink repeats.

    Args:
        consumer: the consumer (its group, offsets and commits stay the caller's business).
        lookback: records re-read before each assigned start position to rebuild the state; it
            must exceed the records one epoch of the sink puts in one partition (default
            100,000). 0 disables the rebuild (use ``state=`` instead).
        state: a :meth:`StagedDeduplicator.state` saved by the caller.

    Use :meth:`assign` (explicit positions) or :meth:`subscribe` (the rebuild runs in the
    assignment callback).
    """

    def __init__(
        self,
        consumer: Consumer,
        *,
        lookback: int = 100_000,
        state: dict[str, list[int]] | None = None,
    ) -> None:
        self.consumer = consumer
        self.lookback = lookback
        self.dedup = StagedDeduplicator(state)

    def assign(self, partitions: list[TopicPartition]) -> None:
        starts = self._rebuild(partitions)
        self.consumer.assign(starts)

    def subscribe(self, topics: list[str], **kwargs: Any) -> None:
        user_assign: Callable[..., Any] | None = kwargs.pop("on_assign", None)

        def on_assign(consumer: Consumer, partitions: list[TopicPartition]) -> None:
            committed = consumer.committed(partitions, timeout=30)
            starts = self._rebuild(committed)
            consumer.assign(starts)
            if user_assign is not None:
                user_assign(consumer, starts)

        self.consumer.subscribe(topics, on_assign=on_assign, **kwargs)

    def _rebuild(self, partitions: list[TopicPartition]) -> list[TopicPartition]:
        """Read up to ``lookback`` records before each start offset into the state."""
        if self.lookback <= 0:
            return partitions
        starts = []
        for tp in partitions:
            low, high = self.consumer.get_watermark_offsets(
                TopicPartition(tp.topic, tp.partition), timeout=30, cached=False
            )
            if tp.offset is None or tp.offset < 0:
                # OFFSET_END reads from the end; beginning, stored or unset from the beginning
                start = high if tp.offset == OFFSET_END else low
            else:
                start = tp.offset
            begin = max(low, start - self.lookback)
            if begin < start:
                self._replay(tp.topic, tp.partition, begin, start)
            starts.append(TopicPartition(tp.topic, tp.partition, start))
        return starts

    def _replay(self, topic: str, partition: int, begin: int, end: int) -> None:
        self.consumer.assign([TopicPartition(topic, partition, begin)])
        try:
            position = begin
            while position < end:
                msgs = self.consumer.consume(1000, 1.0)
                if not msgs:
                    break
                for msg in msgs:
                    err = msg.error()
                    if err is not None:
                        if err.code() == KafkaError._PARTITION_EOF:
                            return
                        continue
                    offset = msg.offset() or 0
                    if offset >= end:
                        return
                    self.dedup.accept(topic, partition, msg.headers())
                    position = offset + 1
        finally:
            self.consumer.unassign()

    def consume(self, num_messages: int = 1, timeout: float = -1) -> list[Any]:
        """Like ``Consumer.consume``, without repeats (errors and EOF events pass through)."""
        out = []
        accept = self.dedup.accept
        for msg in self.consumer.consume(num_messages, timeout):
            if msg.error() is not None or accept(msg.topic(), msg.partition(), msg.headers()):
                out.append(msg)
        return out

    def poll(self, timeout: float = -1) -> Any:
        """Like ``Consumer.poll``; a repeat is skipped (returns ``None`` for it)."""
        msg = self.consumer.poll(timeout)
        if msg is None or msg.error() is not None:
            return msg
        return msg if self.dedup.accept(msg.topic(), msg.partition(), msg.headers()) else None

    def close(self) -> None:
        self.consumer.close()
