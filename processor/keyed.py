"""Keyed streams: the aggregations that keep one state per key (and window).

Split from :mod:`processor.dataflow` (which re-exports :class:`KeyedStream`); the rest of the
public API is there.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from processor.dataflow import Step, Stream, _callable
from processor.errors import DefinitionError
from processor.windows import Session, Sliding, duration_ms

__all__ = ["JOINS", "LATE", "KeyedStream", "Table"]

#: What a join keeps of a record without a partner: ``inner`` drops it, ``left`` keeps it.
JOINS = ("inner", "left")

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
        answer depends on the records' timestamps, not on how the two inputs interleaved, and a
        replay after a restart gives the same. ``how="inner"`` drops a record whose key has no
        row then; ``"left"`` emits ``fn(value, None)``. The output keeps the record's key and
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

        A pair is emitted as soon as its second record arrives. Each side's records are held
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
            bounds[f"{what}_ms"] = int(bound.total_seconds() * 1000)
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
