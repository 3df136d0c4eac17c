"""Keyed streams: the aggregations that keep one state per key (and window).

Split from :mod:`processor.dataflow` (which re-exports :class:`KeyedStream`); the rest of the
public API is there.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from processor.dataflow import Stream, _callable
from processor.errors import DefinitionError
from processor.windows import Session, Sliding, duration_ms

if TYPE_CHECKING:
    from processor.runtime.process import ProcessContext

__all__ = ["EMIT", "LATE", "KeyedStream"]

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
