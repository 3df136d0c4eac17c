"""Windowed aggregation: keyed event-time windows (tumbling and sliding) and the partial
combining before a shuffle that feeds them (session windows: :mod:`.sessions`).

The operator contract (batches, ``on_error``, ``snapshot``/``restore``) is
:mod:`processor.runtime.operators.core`'s; a window applies each record atomically: all of its
windows or none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from processor.dataflow import Sliding, Step
from processor.runtime.operators.core import MIN_WATERMARK, Operator, Record

__all__ = ["Combiner", "WindowedAggregate"]


def _windows(ts: int, window: Sliding) -> range:
    """Start times of the windows containing ``ts``."""
    size, slide = window.size_ms, window.slide_ms
    last = ts - ts % slide
    return range(last, last - size, -slide)


class WindowedAggregate(Operator):
    """Keyed event-time windows; one result per key and window when the watermark passes.

    A window ``[start, end)`` fires when the watermark reaches ``end - 1 + allowed_lateness``.
    With ``merged_input`` the input values are ``[start, partial]`` pairs from an upstream
    :class:`Combiner` and are merged instead of added.

    ``emit="update"`` (Kafka Streams without ``suppress``): every record emits, per window it
    changed, ``(key, {"start_ms", "end_ms", "value"}, record's ts)`` with the new accumulator;
    the watermark then only closes the windows (drops their state), emitting nothing.
    """

    stateful = True
    keeps_index = False

    def __init__(self, step: Step, *, merged_input: bool = False) -> None:
        super().__init__(step)
        p = step.params
        self.window: Sliding = p["window"]
        self.lateness: int = p["allowed_lateness_ms"]
        self.init: Callable[[], Any] = p["init"]
        self.add: Callable[[Any, Any], Any] = p["add"]
        self.merge: Callable[[Any, Any], Any] | None = p["merge"]
        self.merged_input = merged_input
        self.update = p.get("emit") == "update"
        assert not (self.update and merged_input), "no combiner feeds an update-mode window"
        self.size = self.window.size_ms
        # window end -> key -> accumulator
        self.state: dict[int, dict[Any, Any]] = {}
        self.watermark = MIN_WATERMARK

    def _open(self, start: int) -> dict[Any, Any] | None:
        end = start + self.size
        if end - 1 + self.lateness <= self.watermark:
            self.late_dropped += 1
            return None
        bucket = self.state.get(end)
        if bucket is None:
            bucket = self.state[end] = {}
        return bucket

    def process(self, batch: list[Record]) -> list[Record]:
        if self.update:  # every record emits: per record, all of its windows or none
            return self._each(batch, self._apply)
        i = 0  # the record being applied (read by the except clause: where to resume)
        try:
            if self.merged_input:
                merge = self.merge
                assert merge is not None
                for i, (k, (start, partial), _t) in enumerate(batch):  # noqa: B007
                    bucket = self._open(start)
                    if bucket is not None:
                        bucket[k] = merge(bucket[k], partial) if k in bucket else partial
            elif self.size == self.window.slide_ms:  # tumbling: one window, atomic per record
                add, init, size = self.add, self.init, self.size
                for i, (k, v, t) in enumerate(batch):
                    bucket = self._open(t - t % size)
                    if bucket is not None:
                        bucket[k] = add(bucket[k] if k in bucket else init(), v)
                    elif self.on_late is not None:
                        self.on_late(self.name, batch[i], self.watermark, self.lateness)
            else:
                apply = self._apply
                for i, record in enumerate(batch):  # noqa: B007
                    apply(record)
            return []
        except Exception as exc:
            if self.on_error is None:
                raise
            self.on_error(self, batch, i, exc)  # batch[:i] are applied: resume after i
        self._per_record(batch, self._apply, i + 1)
        return []

    def _apply(self, record: Record) -> list[Record]:
        """One record, all of its windows or none (an ``add`` may fail for one window only)."""
        k, v, t = record
        if self.merged_input:
            merge = self.merge
            assert merge is not None
            start, partial = v
            bucket = self._open(start)
            if bucket is not None:
                bucket[k] = merge(bucket[k], partial) if k in bucket else partial
            return []
        add, init = self.add, self.init
        updates = []
        for start in _windows(t, self.window):
            bucket = self._open(start)
            if bucket is not None:
                updates.append((start, bucket, add(bucket[k] if k in bucket else init(), v)))
        for _start, bucket, acc in updates:
            bucket[k] = acc
        if not updates and self.on_late is not None:  # every window of it closed
            self.on_late(self.name, record, self.watermark, self.lateness)
        if not self.update:
            return []
        size = self.size
        # oldest window first (``_windows`` counts down)
        return [
            (k, {"start_ms": start, "end_ms": start + size, "value": acc}, t)
            for start, _bucket, acc in reversed(updates)
        ]

    def on_watermark(self, watermark: int) -> list[Record]:
        if watermark <= self.watermark:
            return []
        self.watermark = watermark
        due = sorted(end for end in self.state if end - 1 + self.lateness <= watermark)
        out: list[Record] = []
        if self.update:  # every change was emitted already: closing only drops the state
            for end in due:
                del self.state[end]
            return out
        for end in due:
            start = end - self.size
            for k, acc in self.state.pop(end).items():
                out.append((k, {"start_ms": start, "end_ms": end, "value": acc}, end - 1))
        return out

    def snapshot(self) -> Any:
        return {"watermark": self.watermark, "windows": {e: dict(b) for e, b in self.state.items()}}

    def restore(self, state: Any) -> None:
        if not state:
            self.state, self.watermark = {}, MIN_WATERMARK
            return
        self.watermark = state["watermark"]
        self.state = {e: dict(b) for e, b in state["windows"].items()}


class Combiner(Operator):
    """Partial combining before a shuffle: one ``(key, [start, partial])`` per key, window, batch.

    Holds nothing across a barrier (the task flushes it before forwarding barriers and
    watermarks), so it has no state to snapshot.
    """

    keeps_index = False

    def __init__(self, step: Step) -> None:
        super().__init__(step)
        p = step.params
        self.window: Sliding = p["window"]
        self.init: Callable[[], Any] = p["init"]
        self.add: Callable[[Any, Any], Any] = p["add"]
        self.partials: dict[tuple[Any, int], Any] = {}

    def process(self, batch: list[Record]) -> list[Record]:
        partials, add, init, window = self.partials, self.add, self.init, self.window
        i = 0  # the record being applied (read by the except clause: where to resume)
        try:
            if window.size_ms == window.slide_ms:  # tumbling: one window, atomic per record
                size = window.size_ms
                for i, (k, v, t) in enumerate(batch):  # noqa: B007
                    pk = (k, t - t % size)
                    partials[pk] = add(partials[pk] if pk in partials else init(), v)
            else:
                apply = self._apply
                for i, record in enumerate(batch):  # noqa: B007
                    apply(record)
            return []
        except Exception as exc:
            if self.on_error is None:
                raise
            self.on_error(self, batch, i, exc)
        self._per_record(batch, self._apply, i + 1)
        return []

    def _apply(self, record: Record) -> list[Record]:
        k, v, t = record
        partials, add, init = self.partials, self.add, self.init
        updates = []
        for start in _windows(t, self.window):
            pk = (k, start)
            updates.append((pk, add(partials[pk] if pk in partials else init(), v)))
        for pk, acc in updates:
            partials[pk] = acc
        return []

    def flush(self) -> list[Record]:
        if not self.partials:
            return []
        out = [(k, [start, acc], start) for (k, start), acc in self.partials.items()]
        self.partials = {}
        return out
