"""Keyed streams: the aggregations that keep one state per key (and window).

Split from :mod:`processor.dataflow` (which re-exports :class:`KeyedStream`); the rest of the
public API is there.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from processor.dataflow import Stream, _callable
from processor.errors import DefinitionError
from processor.windows import Session, Sliding, duration_ms

__all__ = ["LATE", "KeyedStream"]

#: What a windowed aggregation does with a record all of whose windows have closed.
LATE = ("drop", "dead_letters")


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
        params = {
            "init": _callable(name, "init", init),
            "add": _callable(name, "add", add),
            "merge": _callable(name, "merge", merge, optional=True),
            "window": window,
            "allowed_lateness_ms": duration_ms("allowed_lateness", allowed_lateness),
            "late": late,
            "ttl_ms": None if ttl is None else duration_ms("ttl", ttl),
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
    ) -> KeyedStream:
        """Number of records per key (and window). ``late``: see :meth:`aggregate`."""
        return self._aggregate(
            name,
            init=_zero,
            add=_plus_one,
            merge=_sum,
            window=window,
            allowed_lateness=allowed_lateness,
            late=late,
            ttl=ttl,
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
        """
        return self._aggregate(
            name, init=init, add=add, merge=merge, window=window,
            allowed_lateness=allowed_lateness, late=late, ttl=ttl,
        )  # fmt: skip


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
