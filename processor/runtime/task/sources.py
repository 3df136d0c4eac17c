"""Source inputs of a task: decoding, timestamps, bad records and the source watermark.

Source tasks read input partitions ``p % P == i`` (:func:`processor.wire.source_partitions_for`);
the records that fail to decode, or whose ``timestamp`` function raises, are dead letters with
the cause, or (without a dead-letter destination) counted and logged, never dropped silently.

:class:`SourceInputs` owns the decoding of each source topic, the positions read, the event-time
progress of each partition (``max_ts``) and whether the inputs are drained (a bounded run at its
end offsets); it pushes records into the task's :class:`~.chain.OperatorChain` and advances the
chain's watermark.

Watermark alignment (Flink's FLIP-182 across source tasks, FLIP-217 across the partitions of
one; docs/engine.md, "Watermark alignment"): a partition whose watermark runs more than
``--watermark-alignment`` (event time) ahead of the slowest partition that still has records
to read, in this task or (as the coordinator last told, :attr:`SourceInputs.others_wm`) in
any other source task of the job, is paused until the others catch up. A caught-up partition
(nothing to read now, or a bounded run's end reached) is idle: it neither holds the others
back nor is paused. Pausing only changes which partition is read next, never what is read or
a partition's watermark: it changes when windows fire and how much state the job holds
meanwhile (a backfill of partitions read unevenly fires nothing until its end); like any
interleaving, it may change which records arrive behind the watermark (late).

Invariants:
    ``pos`` is the reader's position after each batch (it also moves over what the reader never
    delivers: transaction markers, aborted records). The source watermark is the minimum of
    ``max_ts`` (minus the out-of-orderness allowed), except for caught-up quiet tables.
    The partition with the lowest watermark among those with records to read is never paused
    for alignment by its own task's view (the other tasks' may be older: they catch up within a
    few hundred ms), so alignment never stalls a job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from itertools import groupby, repeat
from operator import itemgetter
from typing import Any

from dedup.ids import source_id
from processor.compiler import Stage
from processor.contracts import Message, Reader
from processor.errors import DeserializationError
from processor.runtime.operators.core import (
    MAX_WATERMARK,
    MIN_WATERMARK,
    Record,
)
from processor.runtime.task.chain import TP, OperatorChain
from processor.runtime.task.channels import TaskEnv
from processor.runtime.task.dead_letters import source_origins
from processor.runtime.waits import WAITS

log = logging.getLogger(__name__)

_WATERMARK_EVERY_S = 0.2
#: Watermark alignment: a partition over the limit this long is paused (see _align).
_AHEAD_FOR_S = 1.0
#: Partitions holding records back are checked this often (after polls) for going on.
_HELD_EVERY_S = 0.02
#: After a resume, how long an empty poll of the partition is not a wait on the broker.
_REFETCH_S = 2.0
#: Without a dead-letter destination, these source failures are skipped (counted and logged).
_SKIPPABLE = (DeserializationError, KeyError, TypeError, ValueError)


class SourceInputs:
    """How a source task reads, decodes and timestamps its input partitions."""

    def __init__(
        self, env: TaskEnv, stage: Stage, name: str, chain: OperatorChain, reader: Reader
    ) -> None:
        self.env = env
        self.stage = stage
        self.name = name
        self.chain = chain
        self.reader = reader
        self.records_in = 0
        self.bad_records = 0
        self.pos: dict[TP, int] = {}
        self.max_ts: dict[TP, int] = {}
        #: the channels' watermarks: only what a restored snapshot had, kept as it was
        self.channel_wm: dict[TP, int] = {}
        self.drained = False
        self._last_wm_emit = 0.0
        #: watermark alignment: the largest lead (event time, ms) of a partition over the
        #: slowest one with records to read (``None``: off); the lowest watermark of the other
        #: source tasks as the coordinator last told it; the partitions paused for being ahead
        self.drift = env.watermark_drift_ms
        self.others_wm: int | None = None
        self.ahead: set[TP] = set()
        #: partitions whose next records were given back to the reader unprocessed (over the
        #: limit in the middle of a batch): the event time the first of them gives
        self.held_next: dict[TP, int] = {}
        self._held_checked = 0.0
        self._over_since: dict[TP, float] = {}  # over the limit since (not paused yet)
        #: a wait on the broker (:mod:`processor.runtime.waits`): polls give nothing while a
        #: partition being read has records, as the last fetches said (a stalled broker)
        self._starved: object | None = None
        steps = env.plan.flow.steps
        # topic -> (the value serde's ``deserialize`` or None, timestamp function, lag, message
        # key decoder or None)
        self.source_params: dict[str, tuple[Any, Any, int, Any]] = {}
        self.table_topics: set[str] = set()  # sources read as tables (Dataflow.table)
        #: the tables that only feed temporal joins' table side: caught up, they leave the
        #: watermark (runtime.operators.joins.joined_as_table_only)
        self.quiet_tables: set[str] = set()
        for source in stage.sources:
            p = steps[source].params
            decode = p["serde"].deserialize if p["serde"] is not None else None
            if p.get("table"):  # a tombstone (null value) deletes the row: not decoded
                decode = _table_decode(decode)
                self.table_topics.add(p["topic"])
                from processor.runtime.operators.joins import joined_as_table_only

                if joined_as_table_only(steps, source):  # may leave the watermark when quiet
                    self.quiet_tables.add(p["topic"])
            self.source_params[p["topic"]] = (
                decode,
                p["timestamp"],
                p["max_out_of_orderness_ms"],
                message_key_decoder(source, p["key_serde"]) if p.get("keyed") else None,
            )
        #: one source topic, not a table: batches take :meth:`_fast_batch`
        self._fast: tuple[str, Any, Any, int, Any] | None = None
        if len(stage.sources) == 1 and not self.table_topics:
            p = steps[stage.sources[0]].params
            serde = p["serde"]
            decode_many = None if serde is None else getattr(serde, "deserialize_many", None)
            if serde is None or decode_many is not None:
                topic = p["topic"]
                key_many = _key_decoder_many(p["key_serde"]) if p.get("keyed") else None
                if not p.get("keyed") or key_many is not None:
                    self._fast = (
                        topic,
                        decode_many,
                        p["timestamp"],
                        p["max_out_of_orderness_ms"],
                        key_many,
                    )

    # -- lifecycle -------------------------------------------------------------------------------

    def open(self, tps: list[TP], positions: dict[TP, int | None]) -> None:
        """Starts reading at ``positions`` (where the source's ``start`` says when none)."""
        for tp in tps:
            self.max_ts.setdefault(tp, MIN_WATERMARK)
        steps = self.env.plan.flow.steps
        starts = {steps[s].params["start"] for s in self.stage.sources}
        start = "latest" if starts == {"latest"} else "earliest"
        # A bounded run reads its sources up to the end offsets it had at start, never past
        # them: what is appended meanwhile is left for the next run (docs/engine.md, "Bounded
        # runs"), not read after the drain as late records.
        ends = self.env.end_offsets
        stop_at = {tp: ends[tp] for tp in tps if tp in ends} if ends is not None else None
        self.reader.open(positions, start=start, stop_at=stop_at)
        self.pos = {tp: o for tp, o in self.reader.positions().items()}

    def restore(self, state: dict[str, Any]) -> None:
        self.channel_wm = dict(state["channel_wm"])
        self.max_ts = dict(state["max_ts"])

    def read(self, msgs: list[Message]) -> None:
        """Decodes, timestamps and pushes a polled batch."""
        self._source_batch(msgs)

    def polled(self, msgs: list[Message]) -> None:
        """After each poll (``msgs``, maybe none): positions, the source watermark."""
        if not msgs:
            # The reader's position also moves over what it never delivers: transaction
            # markers and aborted records. Without this a partition that ends in a
            # marker (the output of any exactly-once job) never counts as read.
            self.pos = self.reader.positions()
            self._starving()
        elif self._starved is not None:
            WAITS.end(self._starved)
            self._starved = None
        if self.held_next and self.env.clock() - self._held_checked >= _HELD_EVERY_S:
            # held partitions go on as soon as the slowest caught up, not at the next tick
            self._held_checked = self.env.clock()
            self._align(self.reader.cached_lag())
        self._source_watermark()
        if self.chain.dead is not None:
            self.chain.dead.flush()

    def snapshot(self, checkpoint_id: int) -> dict[str, Any]:
        """The sources' part of the snapshot (see :class:`~.checkpoints.InputState`)."""
        return {
            "barrier_seen": [],
            "channel_wm": dict(self.channel_wm),
            "max_ts": dict(self.max_ts),
            "recovering": {},
        }

    def lag(self) -> int:
        """Records between the positions and the end offsets of a bounded run (0: unbounded)."""
        ends = self.env.end_offsets
        if ends is None:
            return 0
        return sum(max(0, ends.get(tp, 0) - o) for tp, o in self.pos.items())

    # -- the data path ---------------------------------------------------------------------------

    def _source_batch(self, msgs: list[Message]) -> None:
        if self._fast is not None and self.chain.lineage is None and self._fast_batch(msgs):
            return
        params = self.source_params
        by_topic: dict[str, list[Record]] = {}
        single: list[tuple[Message, Record]] = []  # local recovery: pushed one at a time
        lineage = self.chain.lineage
        max_ts = self.max_ts
        tables = self.table_topics
        failed: set[int] = set()  # id() of the messages that did not enter the operators
        decoded: list[Any] = []  # (key, value, ts) or the exception, per message
        for m in msgs:
            topic = m.topic()
            decode, ts_fn, lag_ms, key_of = params[topic]
            try:
                key = None if key_of is None else key_of(m)
                value = m.value()
                if decode is not None:  # given the bytes only: the place is added on failure
                    value = decode(value)
                if ts_fn is None or (value is None and topic in tables):  # a table's tombstone
                    ts = m.timestamp()[1]
                else:
                    ts = int(ts_fn(value))
            except Exception as exc:
                if isinstance(exc, DeserializationError):
                    exc = exc.located(topic, m.partition(), m.offset())
                if self.chain.dead is None and not isinstance(exc, _SKIPPABLE):
                    raise
                decoded.append(exc)
                continue
            decoded.append((key, value, ts))
        if self.drift is not None:
            kept = self._cut(
                [(m.topic(), m.partition()) for m in msgs],
                [None if isinstance(d, Exception) else d[2] for d in decoded],
                msgs,
                None,
            )
            if kept is not None:
                msgs, decoded = _pick(msgs, kept), _pick(decoded, kept)
        for m, outcome in zip(msgs, decoded, strict=True):
            topic = m.topic()
            if isinstance(outcome, Exception):
                failed.add(id(m))
                self.chain.entry[topic].n_in += 1  # read, and not emitted (metrics)
                self._bad_record(m, outcome)
                continue
            key, value, ts = outcome
            tp = (topic, m.partition())
            lag_ms = params[topic][2]
            if ts - lag_ms > max_ts[tp]:
                max_ts[tp] = ts - lag_ms
            if lineage is not None:
                single.append((m, (key, value, ts)))
                continue
            batch = by_topic.get(topic)
            if batch is None:
                batch = by_topic[topic] = []
            batch.append((key, value, ts))
        self.records_in += len(msgs)
        for topic, batch in by_topic.items():
            self.chain.origins = source_origins(msgs, topic, failed)
            source = self.chain.entry[topic]
            source.n_in += len(batch)
            source.n_out += len(batch)
            for child in source.children:
                self.chain.push(child, batch, True)
        if single:
            assert lineage is not None
            self.chain.origins = self.chain.pushing
        for m, record in single:
            topic = m.topic()
            lineage.set(source_id(topic, m.partition(), m.offset()))  # type: ignore[union-attr]
            self.chain.message = m
            source = self.chain.entry[topic]
            source.n_in += 1
            source.n_out += 1
            for child in source.children:
                self.chain.push(child, [record], True)
        self.chain.origins = None
        self.pos = self.reader.positions()

    def _fast_batch(self, msgs: list[Message]) -> bool:
        """One source topic's batch as columns: the values decoded by the serde's batch form,
        the timestamps, the keys, then the records zipped from them; ``False`` (nothing done)
        when any record fails to decode or to give a timestamp: :meth:`_source_batch` then
        takes it record by record, with dead letters and located errors."""
        assert self._fast is not None
        topic, decode_many, ts_fn, lag_ms, key_many = self._fast
        try:
            values: list[Any] = [m.value() for m in msgs]
            if decode_many is not None:
                values = decode_many(values)
            if ts_fn is None:
                stamps = [m.timestamp()[1] for m in msgs]
            else:
                stamps = list(map(ts_fn, values))
                if set(map(type, stamps)) != _INT:  # int() only where needed (floats, bools)
                    stamps = list(map(int, stamps))
            keys: list[Any] | None = None
            if key_many is not None:
                keys = [m.key() for m in msgs]
                if None in keys:  # a keyed source's record without a key: a bad record
                    return False
                keys = key_many(keys)
        except Exception:
            return False
        if self.drift is not None:
            kept = self._cut([(topic, m.partition()) for m in msgs], stamps, msgs, lag_ms)
            if kept is not None:
                msgs, values, stamps = _pick(msgs, kept), _pick(values, kept), _pick(stamps, kept)
                keys = None if keys is None else _pick(keys, kept)
                if not msgs:
                    self.pos = self.reader.positions()
                    return True
        max_ts = self.max_ts
        for partition, run in groupby(
            zip([m.partition() for m in msgs], stamps, strict=True), _first
        ):
            top = max(map(_second, run)) - lag_ms
            tp = (topic, partition)
            if top > max_ts[tp]:
                max_ts[tp] = top
        batch: list[Record]
        if keys is None:
            batch = list(zip(repeat(None), values, stamps, strict=False))  # repeat: endless
        else:
            batch = list(zip(keys, values, stamps, strict=True))
        self.records_in += len(msgs)
        self.chain.origins = source_origins(msgs, topic, set())
        source = self.chain.entry[topic]
        source.n_in += len(batch)
        source.n_out += len(batch)
        for child in source.children:
            self.chain.push(child, batch, True)
        self.chain.origins = None
        self.pos = self.reader.positions()
        return True

    def _lead(self, tp: TP) -> int:
        """How far ``tp`` is in event time, for watermark alignment: its watermark, or what the
        first of its held records would make it (they are read next)."""
        held = self.held_next.get(tp)
        return self.max_ts[tp] if held is None else held

    def _cut(
        self, tps: list[TP], stamps: Sequence[int | None], msgs: list[Message], lag_ms: int | None
    ) -> list[int] | None:
        """Watermark alignment inside a polled batch (librdkafka hands out a partition's whole
        fetch, thousands of records, hours of a backfill's event time): the indices of the
        records to process now, ``None`` for all. The limit is the slowest busy partition's
        lead after the batch (this task's, or the other source tasks') plus the drift; from
        its first record over the limit, the rest of a partition's records go back to the
        reader (:meth:`Reader.hold`), which gives them again once :meth:`_align` resumes it.
        The slowest partition is never cut: all its records are at or below its lead.
        ``stamps``: event times (``None``: a bad record); ``lag_ms``: the topic's, ``None``
        when the batch mixes topics."""
        hold = getattr(self.reader, "hold", None)
        if hold is None:
            return None
        params = self.source_params
        # each record's watermark (its event time less its topic's out-of-orderness)
        wms = [
            None if ts is None else ts - (params[tp[0]][2] if lag_ms is None else lag_ms)
            for tp, ts in zip(tps, stamps, strict=True)
        ]
        top: dict[TP, int] = {}
        for tp, wm in zip(tps, wms, strict=True):
            if wm is not None and wm > top.get(tp, MIN_WATERMARK):
                top[tp] = wm
        busy = self._busy(self.reader.cached_lag())
        if not busy:
            return None
        lead = {tp: max(self._lead(tp), top.get(tp, MIN_WATERMARK)) for tp in busy}
        slowest = min(lead.values())
        if self.others_wm is not None:
            slowest = min(slowest, self.others_wm)
        # A busy partition that gave nothing yet (this task's, or another task's as reported)
        # may be far behind: nothing goes on until it gave its first record.
        limit = slowest + self.drift  # type: ignore[operator]
        if all(wm <= limit for wm in top.values()):
            return None
        kept: list[int] = []
        held: dict[TP, list[Message]] = {}  # partition -> its records from the first over
        for i, (tp, wm) in enumerate(zip(tps, wms, strict=True)):
            back = held.get(tp)
            if back is None and wm is not None and wm > limit:
                self.held_next[tp] = wm
                back = held[tp] = []
            if back is None:
                kept.append(i)
            else:
                back.append(msgs[i])
        for tp, records in held.items():
            self.ahead.add(tp)
            hold(tp, records)
        return kept

    def _bad_record(self, m: Message, exc: Exception) -> None:
        """A source record that did not decode, or whose ``timestamp`` function raised."""
        topic: Any = m.topic()
        if self.chain.dead is not None:
            decode = self.source_params[topic][0]
            value: Any = m.value()
            decoded = not isinstance(exc, DeserializationError)
            if decoded and decode is not None:  # the timestamp function raised: decode again
                try:
                    value = decode(value)
                except Exception:
                    decoded = False
            self.chain.dead.source_record(
                self.chain.entry[topic].name, m, exc, value, decoded=decoded
            )
            return
        # No dead-letter destination: counted and logged with its location, never dropped
        # silently and never a crash loop.
        self.bad_records += 1
        if self.bad_records <= 20 or self.bad_records % 10_000 == 0:
            log.error(
                "bad record skipped (no dead-letter destination: Dataflow(..., dead_letters=)) "
                "task=%s topic=%s partition=%s offset=%s count=%d error=%r",
                self.name, topic, m.partition(), m.offset(), self.bad_records, str(exc),
            )  # fmt: skip

    def _source_watermark(self) -> None:
        if self.drained:
            return
        now = self.env.clock()
        if self.env.end_offsets is not None and all(
            self.pos.get(tp, 0) >= self.env.end_offsets.get(tp, 0) for tp in self.max_ts
        ):
            self.drained = True  # at the end: the runner takes the final checkpoint
            if self.env.drain:
                self.chain.advance_watermark(MAX_WATERMARK)
                return
            # --no-drain: the watermark the data put, now, not at the next tick: what the
            # input closed fires in this run (the final checkpoint follows).
        elif now - self._last_wm_emit < _WATERMARK_EVERY_S:
            return
        if not self.max_ts:
            return
        self._last_wm_emit = now
        if self.drift is not None:  # at most every tick: each pause drops what was fetched
            self._align(self.reader.cached_lag())
        if not self.quiet_tables:
            self.chain.advance_watermark(min(self.max_ts.values()))
            return
        # A table's partition that caught up with its end does not hold the watermark back:
        # tables are often idle for hours (docs/engine.md, "Tables and joins"). While loading, the
        # watermark waits for it, so stream records join the rows their time had.
        lag = self.reader.cached_lag()
        live = [
            ts
            for tp, ts in self.max_ts.items()
            if tp[0] not in self.quiet_tables or lag.get(tp, 1) > 0
        ]
        self.chain.advance_watermark(min(live) if live else MAX_WATERMARK - 1)

    def _starving(self) -> None:
        """An empty poll: a wait on the broker starts if a partition being read (not paused)
        has records to read as the last fetches saw them; it ends with the next records, or
        when no such partition is left (paused meanwhile). The progress line shows it once it
        lasted half a second: a stalled or frozen broker."""
        paused = self.reader.paused
        # A partition resumed a moment ago (watermark alignment) is fetched again from
        # scratch: its first records take a fetch round trip, which is no stalled broker
        # (issue 50: a healthy paced backfill showed "none comes" on the progress line).
        resumed = getattr(self.reader, "resumed_at", {})
        fresh = time.monotonic() - _REFETCH_S
        behind = [
            (tp, n)
            for tp, n in self.reader.cached_lag().items()
            if n > 0 and tp not in paused and resumed.get(tp, fresh) <= fresh
        ]
        if not behind:
            self.close()
        elif self._starved is None:
            (topic, partition), n = max(behind, key=_second)
            self._starved = WAITS.begin(
                f"the broker: {topic}[{partition}] has {n:,} records to read and none comes "
                "(a stalled broker, or a transaction open in the input)"
            )

    def close(self) -> None:
        if self._starved is not None:
            WAITS.end(self._starved)
            self._starved = None

    # -- watermark alignment ---------------------------------------------------------------------

    def _done(self, tp: TP) -> bool:
        """``tp`` reached a bounded run's end."""
        ends = self.env.end_offsets
        return ends is not None and self.pos.get(tp, 0) >= ends.get(tp, 0)

    def _busy(self, lag: dict[TP, int]) -> list[TP]:
        """The partitions with records to read (not idle): lag unknown (never fetched yet) or
        above 0, and a bounded run's end not reached."""
        return [tp for tp in self.max_ts if lag.get(tp, 1) > 0 and not self._done(tp)]

    def local_watermark(self, lag: dict[TP, int] | None = None) -> int | None:
        """The lowest watermark among this task's partitions with records to read (``None``:
        all idle): what the coordinator aligns the source tasks on."""
        busy = self._busy(self.reader.cached_lag() if lag is None else lag)
        return min(self._lead(tp) for tp in busy) if busy else None

    def align(self, others: int | None) -> None:
        """The coordinator's latest lowest watermark of the other source tasks: partitions
        waiting on them go on at once (a backfill's pace under alignment is one exchange of
        watermarks per drift of event time)."""
        changed = others != self.others_wm
        self.others_wm = others
        if changed and self.drift is not None and self.ahead:
            self._align(self.reader.cached_lag())

    def _align(self, lag: dict[TP, int]) -> None:
        """Pauses the partitions more than :attr:`drift` ahead of the slowest one (this task's
        or the other source tasks'), resumes those no longer ahead."""
        assert self.drift is not None
        busy = self._busy(lag)
        over: set[TP] = set()
        slowest = MIN_WATERMARK  # all idle: nothing is over
        if busy:
            local = min(self._lead(tp) for tp in busy)
            slowest = local if self.others_wm is None else min(local, self.others_wm)
            limit = slowest + self.drift
            over = {tp for tp in busy if self._lead(tp) > limit}
        # Paused once over the limit for _AHEAD_FOR_S: reading as fast as it can, a task
        # evens out its partitions within a few fetches (librdkafka hands out one partition's
        # fetched records, then the next one's), and a pause drops what was fetched. At once
        # while a partition with records to read has given none yet (its lead is unknown).
        now = self.env.clock()
        since = self._over_since
        for tp in list(since):
            if tp not in over:
                del since[tp]
        wait = 0.0 if slowest == MIN_WATERMARK else _AHEAD_FOR_S
        ahead = {tp for tp in over if now - since.setdefault(tp, now) >= wait}
        ahead |= self.ahead & over  # paused: until no longer over
        if ahead == self.ahead:
            return
        resumed, paused = self.ahead - ahead, ahead - self.ahead
        self.ahead = ahead
        if paused:  # librdkafka drops what it fetched of them, and fetches it again on resume
            self.reader.pause(paused)
        if resumed:  # a bounded partition at its stop stays paused (PartitionReader._bounded)
            self.reader.resume(resumed)  # held records come first, from memory
            for tp in resumed:
                self.held_next.pop(tp, None)
        log.debug(
            "watermark alignment task=%s paused=%s resumed=%s others=%s",
            self.name, sorted(paused), sorted(resumed), self.others_wm,
        )  # fmt: skip

    def watermark_parts(self, lag: dict[TP, int]) -> list[list[Any]]:
        """``[topic, partition, watermark, newest event time, state]`` per partition (the
        metrics and the job page): state ``reading``, ``ahead`` (paused by alignment), ``idle``
        (caught up) or ``done`` (a bounded run's end reached)."""
        parts = []
        for tp, wm in self.max_ts.items():
            newest = None if wm == MIN_WATERMARK else wm + self.source_params[tp[0]][2]
            if self._done(tp):
                state = "done"
            elif tp in self.ahead:
                state = "ahead"
            elif lag.get(tp, 1) == 0:
                state = "idle"
            else:
                state = "reading"
            parts.append([tp[0], tp[1], None if wm == MIN_WATERMARK else wm, newest, state])
        return parts


def _table_decode(decode: Callable[[Any], Any] | None) -> Callable[[Any], Any]:
    """A table's row decoder: a tombstone (null value) stays ``None``."""

    def row(data: Any) -> Any:
        return None if data is None else data if decode is None else decode(data)

    return row


def message_key_decoder(step: str, serde: Any) -> Callable[[Message], Any]:
    """The key of a keyed source's record: its message key, decoded by ``serde`` (default
    UTF-8 text). A record without a key is a bad record: it cannot be given to a key's state.
    """
    decode = serde.deserialize if serde is not None else _utf8

    def key_of(m: Message) -> Any:
        raw = m.key()
        if raw is not None:
            try:
                return decode(raw)  # the bytes only: the place is added on failure
            except DeserializationError as exc:
                where: Any = (m.topic(), m.partition(), m.offset())
                raise exc.located(*where) from exc.__cause__
        raise DeserializationError(
            f"source {step!r} is keyed by the message key (keyed=True) and this record has no "
            "key; produce it with a key, or read the topic unkeyed and key_by(...) a field of "
            "the value",
            topic=m.topic(), partition=m.partition(), offset=m.offset(), serde="key",
        )  # fmt: skip

    return key_of


def _key_decoder_many(serde: Any) -> Callable[[list[Any]], list[Any]] | None:
    """The batch form of a keyed source's key decoding (raises on a missing or bad key, for
    the per-record path to report), or ``None`` when the key serde has none."""
    if serde is None:
        return _utf8_many
    return getattr(serde, "deserialize_many", None)


def _utf8_many(keys: list[bytes]) -> list[str]:
    return list(map(bytes.decode, keys))  # UTF-8, strict: raises on a malformed key


_first = itemgetter(0)
_second = itemgetter(1)
_INT = {int}


def _pick(items: list[Any], indices: list[int]) -> list[Any]:
    return [items[i] for i in indices]


def _utf8(data: bytes) -> str:
    try:
        return str(data, "utf-8")
    except UnicodeDecodeError as exc:
        raise DeserializationError(
            f"message key is not UTF-8 text ({exc}); give the keyed source a key_serde",
            serde="key",
            data=data,
        ) from exc
