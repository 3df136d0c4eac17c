"""Keyed streams: the aggregations that keep one state per key (and window).

Split from :mod:`processor.dataflow` (which re-exports :class:`KeyedStream`); the rest of the
public API is there.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from processor.dataflow import Step, Stream, _callable
from processor.errors import DefinitionError
from processor.windows import Session, Sliding, duration_ms

if TYPE_CHECKING:
    from processor.runtime.process import ProcessContext

__all__ = ["EMIT", "JOINS", "LATE", "KeyedStream", "Table"]

#: What a join keeps of a record without a partner: ``inner`` drops it, ``left`` keeps it.
JOINS = ("inner", "left")

#: What a windowed aggregation does with a record all of whose windows have closed.
LATE = ("drop", "dead_letters")
#: When a windowed aggregation emits: once per window when it closes, or on every update.
EMIT = ("close", "update")


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
        emit = _emit_mode(name, emit, window)
        params = {
            "init": _callable(name, "init", init),
            "add": _callable(name, "add", add),
            "merge": _callable(name, "merge", merge, optional=True),
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
            init=_zero,
            add=_plus_one,
            merge=_sum,
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
        fn = _callable(name, "fn", fn)
        return self._aggregate(
            name,
            init=_unset,
            add=_Reducer(fn),
            merge=_Reducer(fn),
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

        ``ctx`` (a :class:`~processor.runtime.process.ProcessContext`, valid during the
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
            "fn": _callable(name, "fn", fn),
            "on_timer": _callable(name, "on_timer", on_timer, optional=True),
        }
        return KeyedStream(self.flow, self._then(name, "process", True, **params))

    # -- joins (docs/engine.md, "Joins") ---------------------------------------------------------

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
        params |= {"mode": mode, "fn": _callable(name, "fn", fn, optional=True)}
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


def _emit_mode(name: str, emit: str | None, window: Sliding | Session | None) -> str:
    """``emit`` checked; what the step emits: ``close`` or ``update``."""
    if emit is None:
        return "close" if window is not None else "update"
    if emit not in EMIT:
        raise DefinitionError(f"step {name!r}: emit must be one of {EMIT}, got {emit!r}")
    if window is None:
        raise DefinitionError(
            f"step {name!r}: emit={emit!r} chooses when a windowed aggregation emits; an "
            "aggregation without a window emits its running result after every record: drop "
            "emit or give a window"
        )
    if emit == "update" and isinstance(window, Session):
        raise DefinitionError(
            f"step {name!r}: emit='update' is not supported with session windows: merging two "
            "sessions would need to retract the updates emitted for each; use emit='close' "
            "(one result per session) or a Tumbling/Sliding window"
        )
    return emit


_UNSET = "__eosflow_unset__"


def _zero() -> int:
    return 0


def _plus_one(acc: int, _value: Any) -> int:
    return acc + 1


def _sum(a: int, b: int) -> int:
    return a + b


def _unset() -> str:
    return _UNSET


class _Reducer:
    """``reduce`` as an aggregation: the first value replaces the unset accumulator."""

    def __init__(self, fn: Callable[[Any, Any], Any]) -> None:
        self.fn = fn

    def __call__(self, acc: Any, value: Any) -> Any:
        if isinstance(acc, str) and acc == _UNSET:
            return value
        if isinstance(value, str) and value == _UNSET:
            return acc
        return self.fn(acc, value)
