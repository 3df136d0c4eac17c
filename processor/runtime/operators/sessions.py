"""Session windows (issue 23): per key, gap-based windows that merge.

A record at ``t`` opens ``[t, t + gap)``; the key's sessions that overlap it merge into one
(their accumulators folded with the step's ``merge``, in time order). A session fires once, when
the watermark reaches ``end - 1 + allowed_lateness``, as ``(key, {"start_ms", "end_ms",
"value"}, end - 1)``: the same shape as the other windows, so sinks and emission IDs
(``(step, key, end - 1)``: a key's sessions never share an end) are the same. A record is late
when the session it would belong to, merged, has closed: it is dropped and counted, or handed to
``on_late`` (``late="dead_letters"``), like Flink's merging windows.

Firing does not scan every key: a heap of ``(end, seq, key)`` holds a candidate per session
extension; an entry whose session grew or fired since is skipped when popped.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections.abc import Callable
from typing import Any

from processor.dataflow import Step
from processor.runtime.operators.core import MIN_WATERMARK, Operator, Record

__all__ = ["SessionAggregate"]


class SessionAggregate(Operator):
    """Keyed session windows. See the module docstring."""

    stateful = True
    keeps_index = False

    def __init__(self, step: Step) -> None:
        super().__init__(step)
        p = step.params
        self.gap: int = p["window"].gap_ms
        self.lateness: int = p["allowed_lateness_ms"]
        self.init: Callable[[], Any] = p["init"]
        self.add: Callable[[Any, Any], Any] = p["add"]
        self.merge: Callable[[Any, Any], Any] = p["merge"]
        #: key -> its open sessions ``[start, end, acc]``, disjoint, in start order
        self.state: dict[Any, list[list[Any]]] = {}
        self.watermark = MIN_WATERMARK
        self._ends: list[tuple[int, int, Any]] = []  # (end, seq, key): firing candidates
        self._seq = 0

    def process(self, batch: list[Record]) -> list[Record]:
        return self._each(batch, self._apply)  # emits nothing: sessions fire on the watermark

    def _apply(self, record: Record) -> list[Record]:
        """One record: its session, merged with those it overlaps; the state changes only once
        every user function returned (a raise leaves it as it was)."""
        k, v, t = record
        start, end = t, t + self.gap
        sessions = self.state.get(k)
        if sessions is None:
            sessions = []
        # Disjoint and in start order, so in end order too: the sessions [t, t + gap) overlaps
        # are the run just before the first that starts at or after its end (a key can hold
        # many open sessions while the watermark waits for a slow partition).
        hi = bisect_left(sessions, end, key=_start)
        lo = hi
        while lo > 0 and sessions[lo - 1][1] > t:
            lo -= 1
        merged = sessions[lo:hi]
        for s in merged:
            start, end = min(start, s[0]), max(end, s[1])
        if end - 1 + self.lateness <= self.watermark:  # the session it belongs to closed
            self.late_dropped += 1
            if self.on_late is not None:
                self.on_late(self.name, record, self.watermark, self.lateness)
            return []
        parts = [*((s[0], s[2]) for s in merged), (t, self.add(self.init(), v))]
        parts.sort(key=lambda p: p[0])  # by start only: accumulators need not compare
        acc = parts[0][1]
        for _at, part in parts[1:]:
            acc = self.merge(acc, part)
        sessions[lo:hi] = [[start, end, acc]]
        self.state[k] = sessions
        self._candidate(end, k)
        return []

    def _candidate(self, end: int, key: Any) -> None:
        self._seq += 1
        heapq.heappush(self._ends, (end, self._seq, key))

    def on_watermark(self, watermark: int) -> list[Record]:
        if watermark <= self.watermark:
            return []
        self.watermark = watermark
        out: list[Record] = []
        ends, state, lateness = self._ends, self.state, self.lateness
        while ends and ends[0][0] - 1 + lateness <= watermark:
            end, _seq, k = heapq.heappop(ends)
            sessions = state.get(k)
            if not sessions:
                continue
            i = bisect_left(sessions, end, key=_end)
            if i == len(sessions) or sessions[i][1] != end:
                continue  # the session grew (a later candidate) or fired already
            s = sessions.pop(i)
            if not sessions:
                del state[k]
            out.append((k, {"start_ms": s[0], "end_ms": s[1], "value": s[2]}, s[1] - 1))
        return out

    def snapshot(self) -> Any:
        return {
            "watermark": self.watermark,
            "sessions": [[k, [list(s) for s in ss]] for k, ss in self.state.items()],
        }

    def restore(self, state: Any) -> None:
        self.state, self._ends, self.watermark = {}, [], MIN_WATERMARK
        if not state:
            return
        self.watermark = state["watermark"]
        for k, sessions in state["sessions"]:
            self.state[k] = [list(s) for s in sessions]
            for s in sessions:
                self._candidate(s[1], k)


def _start(session: list[Any]) -> int:
    return int(session[0])


def _end(session: list[Any]) -> int:
    return int(session[1])
