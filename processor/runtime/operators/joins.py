"""Joins (issue 23): two-input keyed operators.

A join step has two parents. The task hands each input its own :class:`JoinInput` (the
operator's :meth:`~processor.runtime.operators.core.Operator.input` for that parent), which tags the
batches with their side: 0 for the first parent, 1 for the second. Records are ``(key, value,
ts_ms)`` as everywhere; both inputs are partitioned by key, so one subtask sees every record of a
key on both sides.

* :class:`TemporalJoin`, ``stream.join(name, table)``: an event-time *temporal* join. A stream
  record at ``t`` joins the table's version of its key valid at ``t`` (the newest update with
  ``ts <= t``; a tombstone ends a row). The record waits until the watermark reaches ``t``, so
  the updates up to ``t`` have arrived whatever the interleaving of the inputs: the answer
  depends on the records only. A stream record behind the watermark joins at once (with the
  version valid at ``t`` if still held, else the oldest held).
* :class:`TableJoin`, ``table.join(name, other_table)``: the changelog of the joined table. When
  the watermark passes a timestamp at which either side changed for a key, the joined row at that
  timestamp is emitted (``None``: the row is gone; emitted once, after a row). A change behind
  the watermark emits the joined row as it is then, at the watermark plus 1 ms.
* :class:`IntervalJoin`, ``a.interval_join(name, b, lower=, upper=)``: every pair of a key's
  records with ``a.ts + lower <= b.ts <= a.ts + upper``, emitted when the second of the two
  arrives, at ``max(a.ts, b.ts)``; each side's records are held until the watermark shows that no
  record still to come can match them. A record behind the watermark is late: dropped and
  counted, as in Flink.

Versions of a table are pruned by the watermark: per key, the newest version at or before the
watermark and every newer one are kept (a version older than that can no longer be asked for).
Everything the operators hold is JSON-like and goes into snapshots.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Callable
from operator import itemgetter
from typing import Any

from processor.dataflow import Step
from processor.runtime.operators.core import MIN_WATERMARK, Operator, Record

__all__ = [
    "IntervalJoin",
    "JoinInput",
    "TableJoin",
    "TemporalJoin",
    "build_join",
    "joined_as_table_only",
]

Joiner = Callable[[Any, Any], Any]


def _pair(left: Any, right: Any) -> list[Any]:
    return [left, right]


class JoinInput(Operator):
    """One input of a two-input step: hands its batches to the join with their side. Shares
    the join's children; records in and out are counted on the join (metrics per step)."""

    keeps_index = False

    def __init__(self, join: _TwoInputs, side: int) -> None:
        self.name = join.name
        self.children = join.children
        self.late_dropped = 0
        self.join = join
        self.side = side

    def process(self, batch: list[Record]) -> list[Record]:
        join = self.join
        join.n_in += len(batch)
        out = join.process_side(self.side, batch)
        join.n_out += len(out)
        return out


class _TwoInputs(Operator):
    stateful = True
    keeps_index = False

    def __init__(self, step: Step) -> None:
        super().__init__(step)
        self.step = step
        self.parents = step.parents
        self.fn: Joiner = step.params.get("fn") or _pair
        self.how: str = step.params.get("how", "inner")
        self.watermark = MIN_WATERMARK
        self._inputs = (JoinInput(self, 0), JoinInput(self, 1))

    def input(self, parent: str) -> Operator:
        return self._inputs[self.parents.index(parent)]

    def process(self, batch: list[Record]) -> list[Record]:
        raise AssertionError(f"join {self.name!r} takes records through its inputs only")

    def process_side(self, side: int, batch: list[Record]) -> list[Record]:
        raise NotImplementedError


class _Versions:
    """Per key, a table's versions ``(ts, row)`` in time order (``row`` ``None``: deleted).
    Versions are immutable tuples, so a snapshot copies each key's list, not its versions."""

    def __init__(self) -> None:
        self.rows: dict[Any, list[tuple[int, Any]]] = {}
        self._dirty: set[Any] = set()  # keys with something to prune, now or later
        self.pruned_at = MIN_WATERMARK

    def put(self, key: Any, ts: int, row: Any) -> None:
        versions = self.rows.get(key)
        if versions is None:
            if row is not None or ts > self.pruned_at:
                # A tombstone too: a row at an earlier time may still arrive (from another
                # channel), and the deletion must win after it whatever the arrival order.
                self.rows[key] = [(ts, row)]
                self._dirty.add(key)  # pruned when its time passes
            return
        i = bisect_right(versions, ts, key=_ts)
        if i and versions[i - 1][0] == ts:
            versions[i - 1] = (ts, row)  # one timestamp, one version: the later update wins
        else:
            versions.insert(i, (ts, row))
        self._dirty.add(key)

    def at(self, key: Any, ts: int) -> Any:
        """The row valid at ``ts`` (``None``: none); before the oldest version held, that one
        if it is a row (a record behind the watermark, whose version was pruned)."""
        versions = self.rows.get(key)
        if not versions:
            return None
        i = bisect_right(versions, ts, key=_ts)
        if i:
            return versions[i - 1][1]
        # Before the oldest version held: when that one is the newest at or before the last
        # prune's watermark, the versions before it were pruned and it is the nearest left.
        return versions[0][1] if versions[0][0] <= self.pruned_at else None

    def prune(self, watermark: int) -> None:
        self.pruned_at = watermark
        rows, done = self.rows, []
        for key in self._dirty:
            versions = rows.get(key)
            if versions is None:
                done.append(key)
                continue
            i = bisect_right(versions, watermark, key=_ts)  # versions[:i] are at or before
            if i > 1:
                del versions[: i - 1]
            if versions[0][0] <= watermark and versions[0][1] is None:
                del versions[0]  # deleted before the watermark: nothing can ask for it
            if not versions:
                del rows[key]
                done.append(key)
            elif len(versions) == 1 and versions[0][0] <= watermark:
                done.append(key)
        self._dirty.difference_update(done)

    def snapshot(self) -> list[Any]:
        return [self.pruned_at, [[k, list(vs)] for k, vs in self.rows.items()]]

    def restore(self, state: list[Any]) -> None:
        self.pruned_at, rows = state
        self.rows = {k: [tuple(v) for v in vs] for k, vs in rows}
        self._dirty = set(self.rows)


#: A version's time, for ``bisect``: a C-level getter, not a Python function called at every
#: step of every search (profile of bench/operators.py's temporal join).
_ts = itemgetter(0)


class TemporalJoin(_TwoInputs):
    """Stream (side 0) joined with a table (side 1) as of each record's event time."""

    def __init__(self, step: Step) -> None:
        super().__init__(step)
        self.table = _Versions()
        self._waiting: list[tuple[int, int, Any, Any]] = []  # (ts, seq, key, value) heap
        self._seq = 0

    def process_side(self, side: int, batch: list[Record]) -> list[Record]:
        if side == 1:
            put = self.table.put
            for k, row, t in batch:
                put(k, t, row)
            return []
        return self._each(batch, self._arrive)

    def _arrive(self, record: Record) -> list[Record]:
        k, v, t = record
        if t <= self.watermark:  # behind the watermark: the versions it needs have come
            return self._joined(k, v, t)
        self._seq += 1
        heapq.heappush(self._waiting, (t, self._seq, k, v))
        return []

    def _joined(self, k: Any, v: Any, t: int) -> list[Record]:
        row = self.table.at(k, t)
        if row is None and self.how == "inner":
            return []
        return [(k, self.fn(v, row), t)]

    def on_watermark(self, watermark: int) -> list[Record]:
        if watermark <= self.watermark:
            return []
        self.watermark = watermark
        out: list[Record] = []
        # _joined inlined: this loop runs once per stream record (profile of
        # bench/operators.py: a method call and a one-record list each)
        waiting, at, fn, inner = self._waiting, self.table.at, self.fn, self.how == "inner"
        pop = heapq.heappop
        while waiting and waiting[0][0] <= watermark:
            t, _seq, k, v = waiting[0]
            try:
                row = at(k, t)
                if row is not None or not inner:
                    out.append((k, fn(v, row), t))
            except Exception as exc:
                if self.on_error is None:
                    raise
                self.on_error(self, [(k, v, t)], 0, exc)
            pop(waiting)
        self.table.prune(watermark)
        return out

    def snapshot(self) -> Any:
        # The heap as it is (immutable entries: a copy of the list, no sort; the codec keeps
        # tuples): restored, it is still a heap, and the sequence numbers keep arrival order.
        return {
            "watermark": self.watermark,
            "table": self.table.snapshot(),
            "waiting": self._waiting.copy(),
            "seq": self._seq,
        }

    def restore(self, state: Any) -> None:
        self.table, self._waiting, self._seq = _Versions(), [], 0
        self.watermark = MIN_WATERMARK
        if not state:
            return
        self.watermark = state["watermark"]
        self.table.restore(state["table"])
        self._waiting, self._seq = state["waiting"], state["seq"]


class TableJoin(_TwoInputs):
    """Two tables (changelogs) joined by key: the changelog of the joined table."""

    def __init__(self, step: Step) -> None:
        super().__init__(step)
        self.sides = (_Versions(), _Versions())
        self.last: dict[Any, bool] = {}  # key -> its last emitted value was a row
        self._changes: list[tuple[int, int, Any]] = []  # (ts, seq, key) heap
        self._seq = 0

    def process_side(self, side: int, batch: list[Record]) -> list[Record]:
        return self._each(batch, lambda record: self._change(side, record))

    def _change(self, side: int, record: Record) -> list[Record]:
        k, row, t = record
        # The row is a fact even when the joiner raises on it (the joined row then goes to
        # the dead letters, and the table keeps the row).
        self.sides[side].put(k, t, row)
        if t <= self.watermark:
            # A late change: the rows emitted for the times it covers stand (the versions
            # they were joined from are pruned); the joined row as it is now is emitted just
            # after the watermark, "from now on" (review: emitting it at its own time joined
            # it with versions that were not valid then).
            now = self.watermark + 1
            return self._emit(k, now)
        self._seq += 1
        heapq.heappush(self._changes, (t, self._seq, k))
        return []

    def _emit(self, k: Any, t: int) -> list[Record]:
        left, right = self.sides[0].at(k, t), self.sides[1].at(k, t)
        present = left is not None and (right is not None or self.how == "left")
        if present:
            joined = self.fn(left, right)  # before `last`: a raise emits nothing
            self.last[k] = True
            return [(k, joined, t)]
        if self.last.pop(k, False):
            return [(k, None, t)]  # the joined row is gone
        return []

    def on_watermark(self, watermark: int) -> list[Record]:
        if watermark <= self.watermark:
            return []
        self.watermark = watermark
        out: list[Record] = []
        changes, done = self._changes, set()
        while changes and changes[0][0] <= watermark:
            t, _seq, k = heapq.heappop(changes)
            if (t, k) in done:
                continue  # both sides (or one twice) changed the key at t: one row
            done.add((t, k))
            try:
                out += self._emit(k, t)
            except Exception as exc:
                if self.on_error is None:
                    raise
                self.on_error(self, [(k, None, t)], 0, exc)
        for versions in self.sides:
            versions.prune(watermark)
        return out

    def snapshot(self) -> Any:
        return {
            "watermark": self.watermark,
            "sides": [s.snapshot() for s in self.sides],
            "last": [k for k, row in self.last.items() if row],
            "changes": self._changes.copy(),  # a heap of immutable entries
            "seq": self._seq,
        }

    def restore(self, state: Any) -> None:
        self.sides, self.last, self._changes, self._seq = (_Versions(), _Versions()), {}, [], 0
        self.watermark = MIN_WATERMARK
        if not state:
            return
        self.watermark = state["watermark"]
        for versions, saved in zip(self.sides, state["sides"], strict=True):
            versions.restore(saved)
        self.last = dict.fromkeys(state["last"], True)
        self._changes, self._seq = state["changes"], state["seq"]


class IntervalJoin(_TwoInputs):
    """``a`` (side 0) and ``b`` (side 1) pairs with ``a.ts + lower <= b.ts <= a.ts + upper``."""

    def __init__(self, step: Step) -> None:
        super().__init__(step)
        self.lower: int = step.params["lower_ms"]
        self.upper: int = step.params["upper_ms"]
        # per side: key -> its records (ts, value) held for matching
        self.held: tuple[dict[Any, list[tuple[int, Any]]], dict[Any, list[tuple[int, Any]]]] = (
            {},
            {},
        )
        self._expiry: tuple[list[tuple[int, int, Any]], list[tuple[int, int, Any]]] = ([], [])
        self._seq = 0

    def process_side(self, side: int, batch: list[Record]) -> list[Record]:
        apply = self._from_a if side == 0 else self._from_b
        return self._each(batch, apply)

    def _from_a(self, record: Record) -> list[Record]:
        k, v, t = record
        if t <= self.watermark:
            self.late_dropped += 1
            return []
        lo, hi, fn = t + self.lower, t + self.upper, self.fn
        out = [(k, fn(v, bv), max(t, bt)) for bt, bv in self.held[1].get(k, ()) if lo <= bt <= hi]
        self._hold(0, k, t, v, t + self.upper)
        return out

    def _from_b(self, record: Record) -> list[Record]:
        k, v, t = record
        if t <= self.watermark:
            self.late_dropped += 1
            return []
        lo, hi, fn = t - self.upper, t - self.lower, self.fn
        out = [(k, fn(av, v), max(at, t)) for at, av in self.held[0].get(k, ()) if lo <= at <= hi]
        self._hold(1, k, t, v, t - self.lower)
        return out

    def _hold(self, side: int, k: Any, t: int, v: Any, until: int) -> None:
        """Keep ``(t, v)`` while the watermark is before ``until`` (afterwards no record still
        to come on the other side can match it)."""
        held = self.held[side]
        if k not in held:
            held[k] = []
        held[k].append((t, v))
        self._seq += 1
        heapq.heappush(self._expiry[side], (until, self._seq, k))

    def on_watermark(self, watermark: int) -> list[Record]:
        if watermark <= self.watermark:
            return []
        self.watermark = watermark
        for side, bound in ((0, self.upper), (1, -self.lower)):
            held, expiry = self.held[side], self._expiry[side]
            while expiry and expiry[0][0] <= watermark:
                _until, _seq, k = heapq.heappop(expiry)
                records = held.get(k)
                if records is None:
                    continue
                kept = [r for r in records if r[0] + bound > watermark]
                if kept:
                    held[k] = kept
                else:
                    del held[k]
        return []

    def snapshot(self) -> Any:
        return {
            "watermark": self.watermark,
            "held": [[[k, list(rs)] for k, rs in h.items()] for h in self.held],
        }

    def restore(self, state: Any) -> None:
        self.held, self._expiry, self._seq = ({}, {}), ([], []), 0
        self.watermark = MIN_WATERMARK
        if not state:
            return
        self.watermark = state["watermark"]
        for side, bound in ((0, self.upper), (1, -self.lower)):
            for k, records in state["held"][side]:
                self.held[side][k] = [tuple(r) for r in records]
                for t, _v in records:
                    self._seq += 1
                    self._expiry[side].append((t + bound, self._seq, k))
            heapq.heapify(self._expiry[side])


def joined_as_table_only(steps: dict[str, Step], source: str) -> bool:
    """Whether every record of table source ``source`` ends, through stateless steps, in the
    table side of temporal joins (``stream.join(name, table)``). Only then may its caught-up
    partitions leave the watermark (the task emits the highest watermark when all have): the
    temporal join takes its watermark from the stream side; a window, a table-table join or a
    sink of the changelog would see every later record as late."""
    children: dict[str, list[Step]] = {}
    for step in steps.values():
        for parent in step.parents:
            children.setdefault(parent, []).append(step)
    todo, seen = [source], set()
    while todo:
        name = todo.pop()
        for child in children.get(name, []):
            if child.kind == "join":
                if child.params["mode"] != "temporal" or child.parents.index(name) != 1:
                    return False
            elif child.kind in ("map", "filter", "flat_map", "to_table"):
                if child.name not in seen:
                    seen.add(child.name)
                    todo.append(child.name)
            else:
                return False
    return True


def build_join(step: Step) -> Operator:
    """The operator of a ``join`` step (``params["mode"]``: temporal, table or interval)."""
    mode = step.params["mode"]
    if mode == "temporal":
        return TemporalJoin(step)
    if mode == "table":
        return TableJoin(step)
    if mode == "interval":
        return IntervalJoin(step)
    raise ValueError(f"no join of mode {mode!r}")
