"""Keyed process functions with timers (issue 23, item 4): ``KeyedStream.process``.

``fn(ctx, value)`` runs per record; ``on_timer(ctx, timer_ms, kind)`` when a timer of the key
fires: an event-time timer when the watermark reaches it, a processing-time timer when the task's
clock does (:meth:`ProcessOperator.on_processing_time`, called by the task loop). The context
(:class:`~processor.contracts.ProcessContext`, a protocol the public API names; ``_Context``
here) gives the key, the time, the key's state, ``emit`` and the key's timers.

A call is atomic: state changes, timer changes and emitted records are buffered in the context
and applied only when the user function returns. A call that raises changes nothing (the record,
or the timer, goes to the dead-letter destination), so ``Operator._each`` may resume after it.

Timers are per ``(key, time, kind)``: registering one twice keeps one (Flink's rule), deleting
one that does not exist does nothing. They fire in time order, ties in registration order; a
fired timer is gone. Each kind keeps a dict ``(time, key) -> seq`` (the live timers) and a heap of
``(time, seq, key)``; a heap entry whose ``seq`` is no longer the live one (deleted, or deleted
and registered again) is skipped when popped, and the heap is rebuilt when stale entries
outnumber the live ones.

Snapshots hold the watermark, every key's state and the live timers in firing order: JSON-like
values, restored by the safe codec (no pickle). State values are copied into the snapshot (a user
function may change a dict or list value in place after the snapshot was taken, while it is being
serialized on another thread).
"""

from __future__ import annotations

import copy
import heapq
import time
from collections.abc import Callable
from typing import Any

from processor.contracts import ProcessContext, Timers
from processor.dataflow import Step
from processor.errors import DefinitionError
from processor.runtime.operators.core import MIN_WATERMARK, Operator, Record

__all__ = ["EVENT_TIME", "PROCESSING_TIME", "ProcessContext", "ProcessOperator", "Timers"]

#: The ``kind`` argument of ``on_timer`` for timers fired by the watermark ...
EVENT_TIME = "event_time"
#: ... and for timers fired by the task's clock.
PROCESSING_TIME = "processing_time"
_KINDS = (EVENT_TIME, PROCESSING_TIME)
_UNCHANGED, _DELETED = object(), object()
_SCALARS = (str, int, float, bool, type(None))


def wall_clock_ms() -> int:
    """Processing time: the epoch milliseconds of the wall clock."""
    return time.time_ns() // 1_000_000


class _KeyState:
    """``ctx.state`` (:class:`processor.contracts.KeyState`): reads and writes go to the call's
    buffer in the context."""

    __slots__ = ("_ctx",)

    def __init__(self, ctx: _Context) -> None:
        self._ctx = ctx

    def get(self, default: Any = None) -> Any:
        ctx = self._ctx
        value = ctx._state
        if value is _UNCHANGED:
            return ctx._op.state.get(ctx.key, default)
        return default if value is _DELETED else value

    def set(self, value: Any) -> None:
        self._ctx._state = value

    def delete(self) -> None:
        self._ctx._state = _DELETED


class _Timers:
    """``ctx.timers`` (:class:`processor.contracts.Timers`): changes go to the call's buffer in
    the context."""

    __slots__ = ("_ctx",)

    def __init__(self, ctx: _Context) -> None:
        self._ctx = ctx

    def register_event_time(self, ts_ms: int) -> None:
        self._ctx._timer(EVENT_TIME, ts_ms, True)

    def delete_event_time(self, ts_ms: int) -> None:
        self._ctx._timer(EVENT_TIME, ts_ms, False)

    def register_processing_time(self, ts_ms: int) -> None:
        self._ctx._timer(PROCESSING_TIME, ts_ms, True)

    def delete_processing_time(self, ts_ms: int) -> None:
        self._ctx._timer(PROCESSING_TIME, ts_ms, False)


class _Context:
    """The :class:`processor.contracts.ProcessContext` of one call: it buffers what the call
    changes (state, timers, emitted records) until :meth:`ProcessOperator._commit`."""

    __slots__ = ("_emitted", "_op", "_state", "_timers", "key", "state", "timers", "timestamp_ms")

    def __init__(self, op: ProcessOperator, key: Any, timestamp_ms: int) -> None:
        self._op = op
        self.key = key
        self.timestamp_ms = timestamp_ms
        self._state: Any = _UNCHANGED
        self._timers: list[tuple[str, int, bool]] = []
        self._emitted: list[Record] = []
        self.state = _KeyState(self)
        self.timers = _Timers(self)

    @property
    def watermark_ms(self) -> int:
        return self._op.watermark

    @property
    def processing_time_ms(self) -> int:
        return self._op.clock()

    def emit(self, value: Any) -> None:
        self._emitted.append((self.key, value, self.timestamp_ms))

    def _timer(self, kind: str, ts_ms: int, register: bool) -> None:
        if isinstance(ts_ms, bool) or not isinstance(ts_ms, int):
            raise TypeError(f"a timer's time must be an int of epoch milliseconds, got {ts_ms!r}")
        op = self._op
        if register and op.on_timer is None:
            raise DefinitionError(
                f"step {op.name!r} registers {kind.replace('_', '-')} timers and has no on_timer "
                "function to call when they fire: give process(..., on_timer=fn) with "
                "fn(ctx, timer_ms, kind)"
            )
        self._timers.append((kind, ts_ms, register))


class _TimerQueue:
    """One kind's timers: live ``(time, key) -> seq``, and a heap with stale entries."""

    def __init__(self) -> None:
        self.live: dict[tuple[int, Any], int] = {}
        self.heap: list[tuple[int, int, Any]] = []

    def add(self, ts: int, key: Any, seq: int) -> None:
        if (ts, key) not in self.live:
            self.live[ts, key] = seq
            heapq.heappush(self.heap, (ts, seq, key))

    def delete(self, ts: int, key: Any) -> None:
        if self.live.pop((ts, key), None) is not None and len(self.heap) > 2 * len(self.live) + 64:
            self.heap = [(t, s, k) for (t, k), s in self.live.items()]
            heapq.heapify(self.heap)

    def pop_due(self, until: int) -> tuple[int, Any] | None:
        """The next live timer at or before ``until``, removed; ``None`` if there is none."""
        heap, live = self.heap, self.live
        while heap and heap[0][0] <= until:
            ts, seq, key = heapq.heappop(heap)
            if live.get((ts, key)) == seq:
                del live[ts, key]
                return ts, key
        return None

    def ordered(self) -> list[tuple[int, Any]]:
        """The live timers in firing order."""
        return [(t, k) for (t, k), _s in sorted(self.live.items(), key=lambda e: (e[0][0], e[1]))]


class ProcessOperator(Operator):
    """``KeyedStream.process``: see the module docstring."""

    stateful = True
    keeps_index = False
    timed = True

    def __init__(self, step: Step) -> None:
        super().__init__(step)
        self.fn: Callable[[ProcessContext, Any], Any] = step.params["fn"]
        self.on_timer: Callable[[ProcessContext, int, str], Any] | None = step.params["on_timer"]
        self.clock: Callable[[], int] = wall_clock_ms
        self.state: dict[Any, Any] = {}
        self.timers = {EVENT_TIME: _TimerQueue(), PROCESSING_TIME: _TimerQueue()}
        self.watermark = MIN_WATERMARK
        self._seq = 0
        self.fired = 0  # timers fired (metrics, tests)

    # -- records ---------------------------------------------------------------------------------

    def process(self, batch: list[Record]) -> list[Record]:
        return self._each(batch, self._apply)

    def _apply(self, record: Record) -> list[Record]:
        k, v, t = record
        ctx = _Context(self, k, t)
        self.fn(ctx, v)
        return self._commit(ctx)

    def _commit(self, ctx: _Context) -> list[Record]:
        """Applies what a call that returned buffered in ``ctx``."""
        value = ctx._state
        if value is _DELETED:
            self.state.pop(ctx.key, None)
        elif value is not _UNCHANGED:
            self.state[ctx.key] = value
        for kind, ts, register in ctx._timers:
            queue = self.timers[kind]
            if register:
                self._seq += 1
                queue.add(ts, ctx.key, self._seq)
            else:
                queue.delete(ts, ctx.key)
        return ctx._emitted

    # -- timers ----------------------------------------------------------------------------------

    def on_watermark(self, watermark: int) -> list[Record]:
        if watermark <= self.watermark:
            return []
        self.watermark = watermark
        return self._fire(EVENT_TIME, watermark)

    def on_processing_time(self, now_ms: int) -> list[Record]:
        heap = self.timers[PROCESSING_TIME].heap
        if not heap or heap[0][0] > now_ms:  # the task calls this every loop: cheap when idle
            return []
        return self._fire(PROCESSING_TIME, now_ms)

    def next_processing_time(self) -> int | None:
        """The earliest pending processing-time timer (stale entries included), or ``None``."""
        heap = self.timers[PROCESSING_TIME].heap
        return heap[0][0] if heap else None

    def _fire(self, kind: str, until: int) -> list[Record]:
        """Every timer of ``kind`` due at ``until``, in time order; a timer that ``on_timer``
        registers at or before ``until`` fires in the same call (as in Flink)."""
        queue = self.timers[kind]
        out: list[Record] = []
        while (due := queue.pop_due(until)) is not None:
            ts, key = due
            self.fired += 1
            try:
                out += self._timer(key, ts, kind)
            except DefinitionError:
                raise
            except Exception as exc:
                if self.on_error is None:
                    raise
                # The timer is consumed; what its call did is discarded (the context's buffer).
                self.on_error(self, [(key, {"timer_ms": ts, "kind": kind}, ts)], 0, exc)
        return out

    def _timer(self, key: Any, ts: int, kind: str) -> list[Record]:
        on_timer = self.on_timer
        assert on_timer is not None  # registering without one raised
        ctx = _Context(self, key, ts)
        on_timer(ctx, ts, kind)
        return self._commit(ctx)

    # -- snapshots -------------------------------------------------------------------------------

    def snapshot(self) -> Any:
        return {
            "watermark": self.watermark,
            "state": [[k, v if isinstance(v, _SCALARS) else copy.deepcopy(v)]
                      for k, v in self.state.items()],
            "timers": {kind: [[t, k] for t, k in q.ordered()] for kind, q in self.timers.items()},
        }  # fmt: skip

    def restore(self, state: Any) -> None:
        self.state, self.watermark, self._seq = {}, MIN_WATERMARK, 0
        self.timers = {EVENT_TIME: _TimerQueue(), PROCESSING_TIME: _TimerQueue()}
        if not state:
            return
        self.watermark = state["watermark"]
        self.state = {k: v for k, v in state["state"]}
        for kind in _KINDS:
            for t, k in state["timers"].get(kind, []):
                self._seq += 1
                self.timers[kind].add(t, k, self._seq)
