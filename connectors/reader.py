"""A batch reader over explicitly assigned partitions.

eosflow never lets a consumer group decide who reads what: a source subtask reads partitions
``p mod P == subtask`` and a channel consumer reads its ``U`` channel partitions. This reader does
exactly that: ``assign`` with explicit start offsets, batch ``consume``, ``seek``, ``pause`` and
``resume``, and it knows where every partition ended when it was opened, so a bounded run can tell
when it has read everything (``reached_end``). A bounded run also gives it ``stop_at``: no record
at or beyond a partition's stop offset is delivered, however much was appended since.

Positions are tracked by the reader itself (offset after the last delivered record, raised by EOF
events past transaction markers) because they are what a checkpoint records.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from connectors.config import KafkaSettings, consumer_config, create_consumer
from connectors.errors import ErrorClass, classify, error_class
from connectors.offsets import watermarks
from processor.errors import ConfigError, DataLossError

__all__ = ["DELETED_POLICIES", "PartitionReader"]

log = logging.getLogger(__name__)

TP = tuple[str, int]
_EOF = KafkaError._PARTITION_EOF
_OFFSET_RESET = KafkaError._AUTO_OFFSET_RESET
#: Records a partition may hold (:meth:`PartitionReader.hold`) before librdkafka is paused too.
HOLD_MAX = 20_000
#: What a reader does when records it must read were deleted (retention).
DELETED_POLICIES = ("fail", "skip")


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
        deleted: str = "fail",
    ) -> None:
        if deleted not in DELETED_POLICIES:
            raise ConfigError(
                f"deleted records policy {deleted!r}: choose one of {DELETED_POLICIES}"
            )
        # A position the broker no longer holds is an error event, never a silent jump to the
        # earliest record (retention deleted what this reader had not read yet: issue 17).
        self._config = consumer_config(
            settings,
            group_id=group_id,
            overrides={**(overrides or {}), "auto.offset.reset": "error"},
            allow_read_uncommitted=allow_read_uncommitted,
        )
        self._deleted = deleted
        #: records skipped because retention had deleted them (``deleted="skip"``), per partition
        self.skipped: dict[TP, int] = {}
        self._timeout = timeout
        self._consumer: Consumer | None = None
        self._next: dict[TP, int] = {}
        self._end_at_open: dict[TP, int] = {}
        self._paused: set[TP] = set()
        #: when each partition was last resumed (monotonic): librdkafka fetches a resumed
        #: partition again from its position, so its first records take a fetch round trip
        self.resumed_at: dict[TP, float] = {}
        self._stop_at: dict[TP, int] = {}
        #: records delivered and given back (:meth:`hold`), per paused partition, in offset
        #: order; and the highest position an end-of-partition event gave one meanwhile
        self._held: dict[TP, list[Message]] = {}
        self._held_end: dict[TP, int] = {}
        #: partitions holding records and not resumed since (librdkafka still fetches them)
        self._holding: set[TP] = set()

    # -- lifecycle -------------------------------------------------------------------------------

    def open(
        self,
        positions: Mapping[TP, int | None],
        *,
        start: str = "earliest",
        stop_at: Mapping[TP, int] | None = None,
    ) -> None:
        """Assign ``positions`` (``None``: the beginning, or the end with ``start="latest"``).

        Also records each partition's end offset at this moment (see :meth:`reached_end`).
        ``stop_at``: a bounded run's end offsets; a partition in it delivers no record at or
        beyond its offset, its position stops there, and it is paused once it got there. A
        position is never moved back: a start (or a skip over deleted records) past its stop
        raises the stop to it.
        """
        if start not in ("earliest", "latest"):
            raise ValueError(f"start must be 'earliest' or 'latest', got {start!r}")
        self.close()
        self._paused.clear()
        self._held.clear()
        self._held_end.clear()
        self._holding.clear()
        self._end_at_open = {}
        self._next = {}
        for tp, (low, high) in watermarks(self._config, positions, timeout=self._timeout).items():
            self._end_at_open[tp] = high
            wanted = positions[tp]
            if wanted is None:
                wanted = low if start == "earliest" else high
            elif wanted > high:
                raise DataLossError(
                    f"{tp[0]}[{tp[1]}]: the checkpoint's position {wanted} is beyond the "
                    f"partition's end {high}: the topic or the broker was recreated since the "
                    "checkpoint was taken, so what it recorded no longer exists. Reset the job "
                    "(delete its checkpoints: a new --snapshot-url or its state directory) to "
                    "start afresh, or point it at the broker the checkpoint came from",
                    topic=tp[0], partition=tp[1], wanted=wanted, first=low, end=high,
                )  # fmt: skip
            elif wanted < low:
                wanted = self._deleted_records(tp, wanted, low, high)
            self._next[tp] = wanted
        self._consumer = create_consumer(self._config)
        self._consumer.assign([TopicPartition(t, p, o) for (t, p), o in self._next.items()])
        # Never below where the partition starts: a stop only holds what comes after it.
        nxt = self._next
        self._stop_at = {tp: max(o, nxt[tp]) for tp, o in (stop_at or {}).items() if tp in nxt}
        done = [tp for tp, o in self._stop_at.items() if self._next[tp] >= o]
        if done:
            self.pause(done)
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
        if self._held:
            given = self._give_held(max_records)
            if given:  # alone: what librdkafka fetched of their partitions comes after them
                return self._bounded(given) if self._stop_at else given
        try:
            batch = consumer.consume(max_records, timeout)
        except KafkaException as exc:
            raise classify(exc, context="consuming") from exc
        records = self._data_only(batch)
        if records is None:
            records = self._sorted_out(batch)
        if self._held:
            records = self._keep_held(records)
        if self._stop_at:
            return self._bounded(records)
        return records

    def hold(self, tp: TP, records: list[Message]) -> None:
        """Gives back ``records``: the last ones the latest :meth:`poll` delivered of ``tp``, in
        offset order, not processed (watermark alignment: they are too far ahead in event
        time). ``tp`` counts as paused and its position goes back to the first of them; once
        it is resumed, they are delivered again before anything else of ``tp``, from memory.

        librdkafka is not paused: a resumed partition's first fetch waits for its broker
        thread's next wake-up, up to a second (measured: bench/RESULTS.md, "Issue 50"),
        which would make each hold a second's stall. What it fetches of ``tp`` meanwhile joins
        the held records, up to :data:`HOLD_MAX` of them; then ``tp`` is paused in librdkafka
        too (what is held covers the stall of its resume)."""
        if not records:
            return
        self._holding.add(tp)
        held = self._held.setdefault(tp, [])
        held[:0] = records
        self._next[tp] = int(held[0].offset() or 0)

    def _give_held(self, most: int) -> list[Message]:
        """Up to ``most`` held records of the partitions resumed since."""
        given: list[Message] = []
        for tp in [tp for tp in self._held if tp not in self._paused and tp not in self._holding]:
            held = self._held[tp]
            take, rest = held[: most - len(given)], held[most - len(given) :]
            given += take
            if rest:
                self._held[tp] = rest
                self._next[tp] = int(rest[0].offset() or 0)
                break
            del self._held[tp]
            done = int(take[-1].offset() or 0) + 1 if take else self._next[tp]
            self._next[tp] = max(done, self._held_end.pop(tp, done))
            if len(given) >= most:
                break
        return given

    def _keep_held(self, records: list[Message]) -> list[Message]:
        """``records`` without those of partitions holding records (delivered after the
        pause: they follow the held ones, so they join them), whose positions stay at their
        first held record."""
        held, nxt = self._held, self._next
        kept = []
        for m in records:
            tp = (m.topic(), m.partition())
            if tp in held:
                held[tp].append(m)
            else:
                kept.append(m)
        full = []
        for tp, msgs in held.items():  # an end-of-partition event may have moved it past them
            if nxt[tp] != msgs[0].offset():
                self._held_end[tp] = max(nxt[tp], self._held_end.get(tp, 0))
                nxt[tp] = int(msgs[0].offset() or 0)
            if len(msgs) >= HOLD_MAX and tp not in self._paused:
                full.append(tp)
        if full:
            self._require_open().pause([TopicPartition(t, p) for t, p in full])
            self._paused.update(full)
        return kept

    def _data_only(self, batch: list[Message]) -> list[Message] | None:
        """``batch`` itself when it holds only data records (the common case), with the
        positions moved past it; ``None`` when it holds an event or error (nothing moved).

        A partition's records come in offset order, in runs of the same partition: the last
        record of each run moves its position (2 calls per record, not a dict store each)."""
        for msg in batch:
            if msg.error() is not None:
                return None
        nxt: dict[Any, int] = self._next
        last: Any = None
        topic: Any = None
        partition: Any = None
        for msg in batch:
            p = msg.partition()
            if p != partition or msg.topic() != topic:
                if last is not None:
                    nxt[(topic, partition)] = last.offset() + 1
                topic, partition = msg.topic(), p
            last = msg
        if last is not None:
            nxt[(topic, partition)] = last.offset() + 1
        return batch

    def _sorted_out(self, batch: list[Message]) -> list[Message]:
        """The data records of a batch that holds events or errors, which are handled here:
        partition ends move the position, retention gaps are followed, retriable errors are
        logged and skipped, others raise."""
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
            if err.code() == _OFFSET_RESET:  # retention deleted records ahead of the position
                lost: TP = (str(msg.topic()), int(msg.partition() or 0))
                low, high = watermarks(self._config, [lost], timeout=self._timeout)[lost]
                self.seek(lost, self._deleted_records(lost, nxt[lost], low, high))
                continue
            if error_class(err) is ErrorClass.RETRIABLE:
                log.warning("%s: retriable error %s", where, err)
                continue
            raise classify(err, context=where)
        return records

    def _bounded(self, records: list[Message]) -> list[Message]:
        """``records`` without those at or beyond their partition's stop offset; a partition
        that reached it stops there and is paused (one pass over the partitions per batch, and
        over the records only when a partition went past its stop)."""
        nxt, stop_at = self._next, self._stop_at
        over = {tp: stop for tp, stop in stop_at.items() if nxt[tp] > stop}
        if over:
            records = [m for m in records if _before(m, over)]
            nxt.update(over)
        done = [tp for tp, stop in stop_at.items() if nxt[tp] >= stop and tp not in self._paused]
        if done:
            self.pause(done)
        return records

    def _deleted_records(self, tp: TP, wanted: int, low: int, high: int) -> int:
        """``tp``'s records from ``wanted`` up to ``low`` are gone: fail, or (``deleted="skip"``)
        count and log them and go on from ``low``."""
        gone = low - wanted
        if self._deleted == "fail":
            raise DataLossError(
                f"{tp[0]}[{tp[1]}]: records {wanted}..{low - 1} ({gone:,}) were deleted by the "
                f"topic's retention before this job read them (the partition now starts at "
                f"{low}). Raise the topic's retention.ms / retention.bytes above the job's "
                "worst lag and recovery time; or accept the loss with --on-deleted-records skip "
                "(counted and logged)",
                topic=tp[0], partition=tp[1], wanted=wanted, first=low, end=high,
            )  # fmt: skip
        self.skipped[tp] = self.skipped.get(tp, 0) + gone
        log.error(
            "records deleted by retention skipped topic=%s partition=%d from=%d to=%d count=%d "
            "(on-deleted-records=skip)",
            tp[0], tp[1], wanted, low - 1, gone,
        )  # fmt: skip
        return low

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
        self._held.pop(tp, None)
        self._held_end.pop(tp, None)
        self._holding.discard(tp)
        self._next[tp] = offset
        if offset > self._stop_at.get(tp, offset):  # skipped past its stop: stop there
            self._stop_at[tp] = offset

    def pause(self, tps: Iterable[TP]) -> None:
        """Stop delivering records of ``tps`` (barrier alignment); positions are kept."""
        tps = [tp for tp in tps if tp not in self._paused]
        if tps:
            self._require_open().pause([TopicPartition(t, p) for t, p in tps])
            self._paused.update(tps)

    def resume(self, tps: Iterable[TP]) -> None:
        tps = list(tps)
        self._holding.difference_update(tps)
        tps = [tp for tp in tps if tp in self._paused]
        if tps:
            self._require_open().resume([TopicPartition(t, p) for t, p in tps])
            self._paused.difference_update(tps)
            now = time.monotonic()
            self.resumed_at.update(dict.fromkeys(tps, now))

    # -- where are we ----------------------------------------------------------------------------

    @property
    def paused(self) -> frozenset[TP]:
        """Paused partitions, those holding records (:meth:`hold`) included."""
        return frozenset(self._paused | self._holding)

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

    def cached_lag(self) -> dict[TP, int]:
        """Records left per partition against the end offsets the last fetches reported (no
        request to the broker: cheap enough for every stats message). Partitions not fetched
        from yet are left out."""
        consumer = self._consumer
        if consumer is None:
            return {}
        lag = {}
        stop_at = self._stop_at  # a bounded run: nothing is left past the stop
        for (t, p), pos in self._next.items():
            _low, high = consumer.get_watermark_offsets(TopicPartition(t, p), cached=True)
            if high >= 0 and pos >= 0:
                lag[(t, p)] = max(0, min(high, stop_at.get((t, p), high)) - pos)
        return lag

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


def _before(m: Message, stops: Mapping[TP, int]) -> bool:
    """``m`` is before its partition's stop offset (or its partition has none)."""
    stop = stops.get((str(m.topic()), int(m.partition() or 0)))
    return stop is None or int(m.offset() or 0) < stop
