"""A batch reader over explicitly assigned partitions.

eosflow never lets a consumer group decide who reads what: a source subtask reads partitions
``p mod P == subtask`` and a channel consumer reads its ``U`` channel partitions. This reader does
exactly that: ``assign`` with explicit start offsets, batch ``consume``, ``seek``, ``pause`` and
``resume``, and it knows where every partition ended when it was opened, so a bounded run can tell
when it has read everything (``reached_end``).

Positions are tracked by the reader itself (offset after the last delivered record, raised by EOF
events past transaction markers) because they are what a checkpoint records.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from connectors.config import KafkaSettings, consumer_config, create_consumer
from connectors.errors import ErrorClass, classify, error_class
from connectors.offsets import watermarks

__all__ = ["PartitionReader"]

log = logging.getLogger(__name__)

TP = tuple[str, int]
_EOF = KafkaError._PARTITION_EOF


class PartitionReader:
    """Reads a fixed set of partitions in batches.

    Args:
        settings: the cluster.
        group_id: reported to the broker for lag monitoring only.
        overrides: librdkafka consumer overrides (validated, see :mod:`connectors.config`).
        allow_read_uncommitted: see :func:`connectors.config.consumer_config`.

    Invariants:
        ``position(tp)`` is the offset of the next record this reader will deliver for ``tp``;
        a checkpoint that stores it and later ``open``s at it neither skips nor repeats a record.
    """

    def __init__(
        self,
        settings: KafkaSettings,
        *,
        group_id: str = "eosflow-reader",
        overrides: Mapping[str, Any] | None = None,
        allow_read_uncommitted: bool = False,
        timeout: float = 30.0,
    ) -> None:
        self._config = consumer_config(
            settings,
            group_id=group_id,
            overrides=overrides,
            allow_read_uncommitted=allow_read_uncommitted,
        )
        self._timeout = timeout
        self._consumer: Consumer | None = None
        self._next: dict[TP, int] = {}
        self._end_at_open: dict[TP, int] = {}
        self._paused: set[TP] = set()

    # -- lifecycle -------------------------------------------------------------------------------

    def open(self, positions: Mapping[TP, int | None], *, start: str = "earliest") -> None:
        """Assign ``positions`` (``None``: the beginning, or the end with ``start="latest"``).

        Also records each partition's end offset at this moment (see :meth:`reached_end`).
        """
        if start not in ("earliest", "latest"):
            raise ValueError(f"start must be 'earliest' or 'latest', got {start!r}")
        self.close()
        self._paused.clear()
        self._end_at_open = {}
        self._next = {}
        for tp, (low, high) in watermarks(self._config, positions, timeout=self._timeout).items():
            self._end_at_open[tp] = high
            wanted = positions[tp]
            if wanted is None:
                wanted = low if start == "earliest" else high
            self._next[tp] = wanted
        self._consumer = create_consumer(self._config)
        self._consumer.assign([TopicPartition(t, p, o) for (t, p), o in self._next.items()])
        log.debug("assigned partitions=%s ends=%s", self._next, self._end_at_open)

    def close(self) -> None:
        if self._consumer is not None:
            consumer, self._consumer = self._consumer, None
            consumer.close()

    def __enter__(self) -> PartitionReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading ---------------------------------------------------------------------------------

    def poll(self, max_records: int = 10_000, timeout: float = 0.1) -> list[Message]:
        """Up to ``max_records`` data records (never control events or errors).

        Raises:
            KafkaClientError: a non-retriable error (retriable ones are logged and skipped).
        """
        consumer = self._require_open()
        try:
            batch = consumer.consume(max_records, timeout)
        except KafkaException as exc:
            raise classify(exc, context="consuming") from exc
        records: list[Message] = []
        # Message getters are Optional-typed; data records always have topic, partition, offset.
        nxt: dict[Any, int] = self._next
        offset: Any
        for msg in batch:
            err = msg.error()
            if err is None:
                records.append(msg)
                offset = msg.offset()
                nxt[(msg.topic(), msg.partition())] = offset + 1  # FIFO: the last one wins
                continue
            if err.code() == _EOF:
                end: Any = msg.offset()
                tp = (msg.topic(), msg.partition())
                if end > nxt.get(tp, -1):
                    nxt[tp] = end
                continue
            where = f"consuming {msg.topic()}[{msg.partition()}]"
            if error_class(err) is ErrorClass.RETRIABLE:
                log.warning("%s: retriable error %s", where, err)
                continue
            raise classify(err, context=where)
        return records

    def seek(self, tp: TP, offset: int) -> None:
        """Continue ``tp`` from ``offset``; records fetched before the seek are discarded."""
        consumer = self._require_open()
        target = TopicPartition(tp[0], tp[1], offset)
        try:
            consumer.seek(target)
        except KafkaException as exc:
            # Seeking a partition whose fetcher has not started yet fails with an erroneous-state
            # error: re-assigning it at the target offset has the same effect.
            log.debug("seek %s failed (%s); re-assigning at offset %d", tp, exc, offset)
            consumer.incremental_unassign([TopicPartition(tp[0], tp[1])])
            consumer.incremental_assign([target])
            if tp in self._paused:
                consumer.pause([TopicPartition(tp[0], tp[1])])
        self._next[tp] = offset

    def pause(self, tps: Iterable[TP]) -> None:
        """Stop delivering records of ``tps`` (barrier alignment); positions are kept."""
        tps = [tp for tp in tps if tp not in self._paused]
        if tps:
            self._require_open().pause([TopicPartition(t, p) for t, p in tps])
            self._paused.update(tps)

    def resume(self, tps: Iterable[TP]) -> None:
        tps = [tp for tp in tps if tp in self._paused]
        if tps:
            self._require_open().resume([TopicPartition(t, p) for t, p in tps])
            self._paused.difference_update(tps)

    # -- where are we ----------------------------------------------------------------------------

    @property
    def paused(self) -> frozenset[TP]:
        return frozenset(self._paused)

    def position(self, tp: TP) -> int:
        return self._next[tp]

    def positions(self) -> dict[TP, int]:
        return dict(self._next)

    @property
    def end_offsets_at_open(self) -> dict[TP, int]:
        return dict(self._end_at_open)

    def reached_end(self) -> bool:
        """True when every partition was read up to the end offset it had at :meth:`open`."""
        return all(self._next[tp] >= end for tp, end in self._end_at_open.items())

    def lag(self) -> dict[TP, int]:
        """Records left per partition, against the current end offsets (one fetch each)."""
        ends = watermarks(self._config, self._next, timeout=self._timeout)
        return {tp: max(0, ends[tp][1] - self._next[tp]) for tp in self._next}

    def commit_for_monitoring(self) -> None:
        """Commit current positions to the consumer group, for lag dashboards only.

        These offsets are never read back by eosflow: checkpoints hold the offsets of record.
        """
        offsets = [TopicPartition(t, p, o) for (t, p), o in self._next.items() if o >= 0]
        if offsets:
            self._require_open().commit(offsets=offsets, asynchronous=True)

    def _require_open(self) -> Consumer:
        if self._consumer is None:
            raise RuntimeError("PartitionReader is not open; call open(positions) first")
        return self._consumer
