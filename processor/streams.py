"""Streams: the output of a step, whose methods add the steps that follow it.

:class:`Stream` (map, filter, flat_map, key_by, dedup, union, iterate, sink),
:class:`KeyedStream` (its records have keys: aggregations, process functions, joins) and
:class:`Table` (a keyed changelog). A :class:`~processor.dataflow.Dataflow` starts them at its
sources; they add steps to it through :class:`~processor.steps.StepGraph`. Re-exported by
:mod:`processor.dataflow` and :mod:`processor`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

from processor.contracts import ProcessContext, Sink
from processor.errors import DefinitionError
from processor.steps import (
    JOINS,
    LATE,
    Reducer,
    Step,
    StepGraph,
    descends,
    emit_mode,
    plus_one,
    sum_counts,
    unset,
    user_fn,
    zero,
)
from processor.windows import Session, Sliding, duration_ms

__all__ = ["KeyedStream", "Stream", "Table"]


class Stream:
    """The output of a step; methods add steps and return their output streams."""

    keyed = False

    def __init__(self, flow: StepGraph, step: Step) -> None:
        self.flow = flow
        self.step = step

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.flow.name!r}, step={self.step.name!r})"

    def _then(self, name: str, kind: str, keyed: bool, **params: Any) -> Step:
        return self.flow._add(Step(name, kind, (self.step.name,), keyed, params))

    def _same(self, step: Step) -> Stream:
        return KeyedStream(self.flow, step) if step.keyed else Stream(self.flow, step)

    def map(self, name: str, fn: Callable[[Any], Any]) -> Stream:
        """``fn(value)`` for every value (the key, if any, is kept)."""
        return self._same(self._then(name, "map", self.keyed, fn=user_fn(name, "fn", fn)))

    def filter(self, name: str, fn: Callable[[Any], bool]) -> Stream:
        """Keep the values for which ``fn(value)`` is true."""
        return self._same(self._then(name, "filter", self.keyed, fn=user_fn(name, "fn", fn)))

    def flat_map(self, name: str, fn: Callable[[Any], Iterable[Any]]) -> Stream:
        """Every element of ``fn(value)``, in order."""
        return self._same(self._then(name, "flat_map", self.keyed, fn=user_fn(name, "fn", fn)))

    def key_by(self, name: str, fn: Callable[[Any], Any]) -> KeyedStream:
        """Key every value by ``fn(value)`` (a str, int or other JSON-like value)."""
        return KeyedStream(self.flow, self._then(name, "key_by", True, fn=user_fn(name, "fn", fn)))

    def dedup(
        self,
        name: str,
        id: Callable[[Any], Any],
        *,
        within: timedelta,
        late: str = "drop",
        bucket: timedelta | None = None,
        expected_ids: int = 100_000,
        fp_rate: float = 0.001,
        redis_url: str | None = None,
    ) -> Stream:
        """Drop every record whose ``id(value)`` was already seen within ``within``.

        On an unkeyed stream the IDs are global (records are shuffled by ID, so copies meet);
        on a keyed stream they are per key (``(key, id(value))``) and the stream stays keyed.
        Seen IDs are kept in Bloom filters per time bucket of the records' timestamps, in front
        of a Redis ID store (``redis_url``, default ``EOSFLOW_REDIS_URL``), and forgotten when
        the watermark passes them by ``within``. Exactly once across restarts: the store agrees
        with the restored checkpoint (docs/dedup.md).

        Args:
            id: the business ID of a value (a str, bytes, int or JSON-like value).
            within: the horizon: a copy is recognised if its timestamp is at least the
                watermark minus ``within``.
            late: a record older than the horizon cannot be checked: ``"drop"`` (default) or
                ``"pass"`` it; either is counted and logged.
            bucket: length of a Bloom time bucket (default ``within / 4``, at least 1 s).
            expected_ids: IDs per bucket and subtask that one filter holds at ``fp_rate``.
            fp_rate: target false-positive rate of the filters (costs lookups, never
                correctness).
        """
        within_ms = duration_ms("within", within)
        bucket_ms = None if bucket is None else duration_ms("bucket", bucket)
        if within_ms <= 0:
            raise DefinitionError(f"dedup {name!r}: within must be positive, got {within}")
        if bucket_ms is not None and not 0 < bucket_ms <= within_ms:
            raise DefinitionError(
                f"dedup {name!r}: bucket must be positive and at most within ({within}), "
                f"got {bucket}"
            )
        if bucket_ms is not None and within_ms // bucket_ms > 1000:
            raise DefinitionError(
                f"dedup {name!r}: within / bucket is over 1,000 ({within} / {bucket}): every "
                "live bucket costs one Bloom probe per record; use a larger bucket"
            )
        if late not in ("drop", "pass"):
            raise DefinitionError(f"dedup {name!r}: late must be 'drop' or 'pass', got {late!r}")
        if isinstance(expected_ids, bool) or not isinstance(expected_ids, int) or expected_ids < 1:
            raise DefinitionError(
                f"dedup {name!r}: expected_ids must be a positive int, got {expected_ids!r}"
            )
        if not isinstance(fp_rate, float) or not 0 < fp_rate < 0.5:
            raise DefinitionError(f"dedup {name!r}: fp_rate must be in (0, 0.5), got {fp_rate!r}")
        step = self._then(
            name,
            "dedup",
            self.keyed,
            id=user_fn(name, "id", id),
            within_ms=within_ms,
            bucket_ms=bucket_ms,
            late=late,
            expected_ids=expected_ids,
            fp_rate=fp_rate,
            redis_url=redis_url,
        )
        return self._same(step)

    def union(self, name: str, *others: Stream) -> Stream:
        """The records of this stream and of ``others``, interleaved."""
        streams = (self, *others)
        if not others:
            raise DefinitionError(f"union {name!r} needs at least one other stream")
        for s in streams:
            if s.flow is not self.flow:
                raise DefinitionError(f"union {name!r}: streams of different dataflows")
        keyed = all(s.keyed for s in streams)
        step = self.flow._add(Step(name, "union", tuple(s.step.name for s in streams), keyed))
        return self._same(step)

    def iterate(
        self,
        name: str,
        body: Callable[[Stream], tuple[Stream, Stream]],
        *,
        max_iterations: int | None = None,
    ) -> Stream:
        """A loop: ``body(loop)`` builds steps on ``loop`` and returns ``(feedback, output)``.

        ``loop`` carries this stream's records and every record of ``feedback``, which goes back
        to the loop's head through an internal channel topic (a back-edge); ``output`` is what
        the loop emits (this method returns it). Records circulate until the body stops feeding
        them back: a streaming iteration, e.g. label propagation over a stream of graph edges
        (``examples/connected_components.py``).

        Exactly once, loops included: checkpoints follow Algorithm 2 of Carbone et al. (2015),
        the records in flight on the back-edge are part of the snapshot, and ``--until-idle``
        ends only when a checkpoint finds no record in the loop (docs/iterations.md).

        Args:
            body: builds the loop body. ``loop`` is unkeyed; key it inside the body.
            max_iterations: a record fed back more than this many times is dropped from the
                loop (counted, logged, and sent to the dead-letter destination if the dataflow
                has one). ``None``: no limit (the body must end every loop itself).

        Raises:
            DefinitionError: ``body`` does not return two streams of this dataflow, the
                feedback stream does not come from ``loop``, or loops are nested.
        """
        flow = self.flow
        if flow._open_loops:
            raise DefinitionError(
                f"iterate {name!r} is inside the body of iterate {flow._open_loops[-1]!r}: "
                "nested loops are not supported; give the inner loop's body to the outer one"
            )
        if max_iterations is not None and (
            isinstance(max_iterations, bool)
            or not isinstance(max_iterations, int)
            or max_iterations < 1
        ):
            raise DefinitionError(
                f"iterate {name!r}: max_iterations must be a positive int or None, "
                f"got {max_iterations!r}"
            )
        if not callable(body):
            raise DefinitionError(f"iterate {name!r}: body must be callable, got {body!r}")
        before = set(flow.steps)
        head = self._then(name, "iterate", False, max_iterations=max_iterations, feedback=None)
        flow._open_loops.append(name)
        try:
            feedback, output = _loop_result(name, flow, head, body(Stream(flow, head)))
        except BaseException:
            for step in set(flow.steps) - before:  # no half-built loop stays in the flow
                del flow.steps[step]
            raise
        finally:
            flow._open_loops.pop()
        head.params["feedback"] = feedback.step.name
        return output

    def sink(self, name: str, sink: Sink) -> None:
        """Write the values to ``sink`` (committed when a checkpoint completes).

        Keyed streams write ``(key, value)`` pairs (JSON arrays in a file sink).
        """
        if not isinstance(sink, Sink):
            raise DefinitionError(
                f"sink step {name!r}: {sink!r} does not implement processor.contracts.Sink "
                "(use one of eosflow's sinks, e.g. sinks.FileSink or sinks.ConsoleSink)"
            )
        self._then(name, "sink", False, sink=sink)


def _loop_result(name: str, flow: StepGraph, head: Step, result: Any) -> tuple[Stream, Stream]:
    """Checks what an ``iterate`` body returned: ``(feedback, output)``."""
    if (
        not isinstance(result, tuple)
        or len(result) != 2
        or not all(isinstance(s, Stream) and s.flow is flow for s in result)
    ):
        raise DefinitionError(
            f"iterate {name!r}: body must return (feedback, output), two streams built "
            f"from its argument, got {result!r}"
        )
    feedback, output = result
    if feedback.step is head:
        raise DefinitionError(
            f"iterate {name!r}: the feedback stream is the loop itself (every record would "
            "circulate forever); feed back the output of a step of the body"
        )
    if not descends(flow, feedback.step.name, head.name):
        raise DefinitionError(
            f"iterate {name!r}: the feedback stream (step {feedback.step.name!r}) does not "
            "come from the loop's stream: build it from body's argument"
        )
    return feedback, output


class KeyedStream(Stream):
    """A stream whose records have keys: aggregations keep one state per key (and window)."""

    keyed = True

    def _aggregate(
        self,
        name: str,
        *,
        init: Callable[[], Any],
        add: Callable[[Any, Any], Any],
        merge: Callable[[Any, Any], Any] | None,
        window: Sliding | Session | None,
        allowed_lateness: timedelta,
        late: str = "drop",
        ttl: timedelta | None = None,
        emit: str | None = None,
    ) -> KeyedStream:
        if window is not None and not isinstance(window, Sliding | Session):
            raise DefinitionError(
                f"step {name!r}: window must be Tumbling(...), Sliding(...) or Session(...)"
            )
        if ttl is not None and (window is not None or duration_ms("ttl", ttl) <= 0):
            raise DefinitionError(
                f"step {name!r}: ttl must be positive and applies to an aggregation without a "
                "window (a window's state ends when it fires)"
            )
        if isinstance(window, Session) and merge is None:
            raise DefinitionError(
                f"step {name!r}: session windows merge when a record bridges two sessions, so "
                "aggregate(..., window=Session(...)) needs merge=(acc1, acc2) -> acc "
                "(count and reduce have one)"
            )
        if late not in LATE:
            raise DefinitionError(f"step {name!r}: late must be one of {LATE}, got {late!r}")
        if late != "drop" and window is None:
            raise DefinitionError(
                f"step {name!r}: late={late!r} needs a window; an aggregation without a window "
                "takes every record, so none is late"
            )
        emit = emit_mode(name, emit, window)
        params = {
            "init": user_fn(name, "init", init),
            "add": user_fn(name, "add", add),
            "merge": user_fn(name, "merge", merge, optional=True),
            "window": window,
            "allowed_lateness_ms": duration_ms("allowed_lateness", allowed_lateness),
            "late": late,
            "ttl_ms": None if ttl is None else duration_ms("ttl", ttl),
            "emit": emit,
        }
        return KeyedStream(self.flow, self._then(name, "aggregate", True, **params))

    def count(
        self,
        name: str,
        *,
        window: Sliding | Session | None = None,
        allowed_lateness: timedelta = timedelta(0),
        late: str = "drop",
        ttl: timedelta | None = None,
        emit: str | None = None,
    ) -> KeyedStream:
        """Number of records per key (and window). ``late``, ``ttl``, ``emit``: see
        :meth:`aggregate`."""
        return self._aggregate(
            name,
            init=zero,
            add=plus_one,
            merge=sum_counts,
            window=window,
            allowed_lateness=allowed_lateness,
            late=late,
            ttl=ttl,
            emit=emit,
        )

    def reduce(
        self,
        name: str,
        fn: Callable[[Any, Any], Any],
        *,
        window: Sliding | Session | None = None,
        allowed_lateness: timedelta = timedelta(0),
        late: str = "drop",
        ttl: timedelta | None = None,
        emit: str | None = None,
    ) -> KeyedStream:
        """``fn(accumulated, value)`` per key; the first value starts the accumulation.

        ``fn`` must be associative (it is also used to combine partial results before the
        shuffle when the reduction is windowed).
        """
        fn = user_fn(name, "fn", fn)
        return self._aggregate(
            name,
            init=unset,
            add=Reducer(fn),
            merge=Reducer(fn),
            window=window,
            allowed_lateness=allowed_lateness,
            late=late,
            ttl=ttl,
            emit=emit,
        )

    def aggregate(
        self,
        name: str,
        *,
        init: Callable[[], Any],
        add: Callable[[Any, Any], Any],
        merge: Callable[[Any, Any], Any] | None = None,
        window: Sliding | Session | None = None,
        allowed_lateness: timedelta = timedelta(0),
        late: str = "drop",
        ttl: timedelta | None = None,
        emit: str | None = None,
    ) -> KeyedStream:
        """``acc = add(acc, value)`` per key, starting from ``init()``.

        Give ``merge(acc1, acc2)`` (associative and commutative) to let eosflow combine partial
        accumulators before the shuffle of a windowed aggregation (Dataflow's partial combining).
        Accumulators go into snapshots: keep them to JSON-like values.

        ``late``: a record whose every window has closed (its end plus ``allowed_lateness`` is
        behind the watermark) is ``"drop"``ped, counted and logged (default), or sent to the
        dataflow's ``"dead_letters"`` destination with its event time and the watermark, in the
        same epoch as the windows' output (exactly once). ``"dead_letters"`` sends every record
        to the window unmerged (no partial combining before the shuffle).

        ``ttl`` (no window): a key's state expires after ``ttl`` of event time without a record
        of that key. A record at least ``ttl`` newer than the key's last record starts from
        ``init()`` again; state older than ``ttl`` behind the watermark is deleted (kept out of
        snapshots). Decided by the records' own event times, so replays decide the same.

        ``emit`` (tumbling and sliding windows): ``"close"`` (default) emits one
        ``(key, {"start_ms", "end_ms", "value"})`` per key and window when the window closes;
        ``"update"`` emits that record, with the new value, for every record that changes a
        window (Kafka Streams' default, without ``suppress``), at the record's timestamp, and
        nothing more when the window closes. Update mode has no partial combining before the
        shuffle, and its sequence of updates depends on how input channels interleave
        (``--recovery local`` refuses it when several channels feed it). Session windows
        merge, which would need retractions of the merged sessions' updates: refused.
        """
        return self._aggregate(
            name, init=init, add=add, merge=merge, window=window,
            allowed_lateness=allowed_lateness, late=late, ttl=ttl, emit=emit,
        )  # fmt: skip

    def process(
        self,
        name: str,
        fn: Callable[[ProcessContext, Any], None],
        *,
        on_timer: Callable[[ProcessContext, int, str], None] | None = None,
    ) -> KeyedStream:
        """A low-level keyed operator: ``fn(ctx, value)`` per record, with the key's state
        and timers (Flink's ``KeyedProcessFunction``, Kafka Streams' processor API).

        ``ctx`` (a :class:`~processor.contracts.ProcessContext`, valid during the
        call) has ``key``, ``timestamp_ms`` (the record's event
        time), ``watermark_ms``, ``processing_time_ms``, ``state`` (``get(default=None)``,
        ``set(value)``, ``delete()`` of the key's JSON-like value), ``emit(value)`` (a record
        of the same key at ``timestamp_ms``) and ``timers``: ``register_event_time(ts_ms)``,
        ``delete_event_time(ts_ms)``, ``register_processing_time(ts_ms)``,
        ``delete_processing_time(ts_ms)``. Timers are per key, time and kind: registering one
        twice keeps one.

        ``on_timer(ctx, timer_ms, kind)`` runs when a timer of ``ctx.key`` fires, ``kind``
        being ``"event_time"`` (the watermark reached ``timer_ms``) or ``"processing_time"``
        (the task's wall clock did); ``ctx.timestamp_ms`` is ``timer_ms``, so what it emits is
        stamped with the timer's time. Timers fire in time order, each once. A function that
        registers a timer without ``on_timer`` fails the job, naming the step.

        Exactly once: the states and pending timers are in the snapshots, outputs go through
        the sinks' two-phase commit. Each call is atomic: if ``fn`` or ``on_timer`` raises,
        nothing it did is kept and the record (or ``{"timer_ms", "kind"}``) goes to the
        dead-letter destination. Processing-time timers fire when the wall clock says, so a
        run restored from a checkpoint may fire them at other points of the input than the
        run that crashed (its output is still that of one run). Not under ``--recovery
        local`` (emissions are not tied to deterministic record IDs).
        """
        params = {
            "fn": user_fn(name, "fn", fn),
            "on_timer": user_fn(name, "on_timer", on_timer, optional=True),
        }
        return KeyedStream(self.flow, self._then(name, "process", True, **params))

    # -- joins (docs/engine.md, "Tables and joins") ----------------------------------------------

    def join(
        self,
        name: str,
        table: Table,
        fn: Callable[[Any, Any], Any] | None = None,
        *,
        how: str = "inner",
    ) -> KeyedStream:
        """Enrich every record with ``table``'s row for its key *as of the record's event time*
        (an event-time temporal join): ``fn(value, row)`` (default ``[value, row]``).

        The row is the table's newest update for the key at or before the record's timestamp
        (a ``None`` update, a tombstone, ends the row). A record waits in the join's state until
        the watermark reaches its timestamp, so every table update up to then has arrived: the
        answer depends on the records' timestamps, not on how the two inputs interleaved (an
        update that arrives after its table had caught up is the exception: docs/engine.md,
        "Tables and joins"). ``fn`` must not modify ``row`` (the table keeps it).
        ``how="inner"`` drops a record whose key has no row then; ``"left"`` emits
        ``fn(value, None)``. The output keeps the record's key and
        timestamp. A record behind the join's watermark joins at once.

        Both inputs are shuffled by key to the join (or joined in place when both are keyed
        sources partitioned alike). ``--recovery local`` refuses joins.
        """
        if not isinstance(table, Table):
            raise DefinitionError(
                f"join {name!r}: the second input must be a Table (Dataflow.table(...) or "
                f"keyed_stream.to_table(...)), got {table!r}; join two streams with "
                "interval_join"
            )
        return KeyedStream(self.flow, self._join(name, table, "temporal", fn, how=how))

    def interval_join(
        self,
        name: str,
        other: KeyedStream,
        fn: Callable[[Any, Any], Any] | None = None,
        *,
        lower: timedelta,
        upper: timedelta,
    ) -> KeyedStream:
        """Every pair of this stream's record ``a`` and ``other``'s record ``b`` of the same key
        with ``a.ts + lower <= b.ts <= a.ts + upper``: ``fn(a, b)`` (default ``[a, b]``) at
        ``max(a.ts, b.ts)`` (Flink's interval join; ``lower`` may be negative:
        ``timedelta(seconds=-5)``).

        A pair is emitted as soon as its second record arrives; ``fn`` must not modify its
        arguments (each is held for other pairs). Each side's records are held
        until the watermark shows that no record still to come can match them; a record behind
        the watermark is late: dropped and counted. ``--recovery local`` refuses joins.
        """
        if not isinstance(other, KeyedStream) or isinstance(other, Table):
            raise DefinitionError(
                f"interval_join {name!r}: the second input must be a keyed stream (key_by(...) "
                f"or a keyed source), got {other!r}"
            )
        bounds = {}
        for what, bound in (("lower", lower), ("upper", upper)):
            if not isinstance(bound, timedelta):
                raise DefinitionError(
                    f"interval_join {name!r}: {what} must be a datetime.timedelta, got {bound!r}"
                )
            bounds[f"{what}_ms"] = bound // timedelta(milliseconds=1)  # exact, may be < 0
        if bounds["lower_ms"] > bounds["upper_ms"]:
            raise DefinitionError(
                f"interval_join {name!r}: lower ({lower}) is after upper ({upper}): no pair "
                "could match"
            )
        return KeyedStream(self.flow, self._join(name, other, "interval", fn, **bounds))

    def to_table(self, name: str) -> Table:
        """This stream read as a table's changelog: each record is the new row of its key
        (``None``: the key's row is deleted), valid from the record's timestamp on."""
        return Table(self.flow, self._then(name, "to_table", True))

    def _join(self, name: str, other: KeyedStream, mode: str, fn: Any, **params: Any) -> Step:
        if other.flow is not self.flow:
            raise DefinitionError(f"join {name!r}: streams of different dataflows")
        if other.step is self.step:
            raise DefinitionError(
                f"join {name!r}: a stream joined with itself; use a map or an aggregation"
            )
        if not other.keyed:
            raise DefinitionError(f"join {name!r}: the second input is not keyed; key_by it")
        how = params.get("how", "inner")
        if how not in JOINS:
            raise DefinitionError(f"join {name!r}: how must be one of {JOINS}, got {how!r}")
        params |= {"mode": mode, "fn": user_fn(name, "fn", fn, optional=True)}
        return self.flow._add(Step(name, "join", (self.step.name, other.step.name), True, params))


class Table(KeyedStream):
    """A keyed table: a changelog of rows by key, each valid from its timestamp until the
    key's next update (``None``, a tombstone, deletes the row). Made by
    :meth:`~processor.dataflow.Dataflow.table` from a (compacted) topic or by
    :meth:`KeyedStream.to_table`; join a stream with it (:meth:`KeyedStream.join`) or another
    table. Stream methods (``map``, ``sink``...) apply to the changelog."""

    def join(
        self,
        name: str,
        table: Table,
        fn: Callable[[Any, Any], Any] | None = None,
        *,
        how: str = "inner",
    ) -> Table:
        """The two tables joined by key, as a table: for every timestamp at which either
        changed a key, ``fn(row, other_row)`` (default ``[row, other_row]``) once the
        watermark passes it. ``how="inner"``: a key needs a row on both sides; ``"left"``: on
        this side (``other_row`` may be ``None``). When the joined row disappears, ``None``
        (a tombstone) is emitted.
        """
        if not isinstance(table, Table):
            raise DefinitionError(
                f"join {name!r}: a table joins another Table, got {table!r}; to enrich a stream, "
                "stream.join(name, table)"
            )
        return Table(self.flow, self._join(name, table, "table", fn, how=how))
