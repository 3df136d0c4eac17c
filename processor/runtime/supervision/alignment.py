"""Watermark alignment across source tasks (Flink's FLIP-182): the coordinator's part.

Every source task's worker reports, at most every 20 ms when it changed (and every second
anyway), the task's lowest watermark among its partitions that still have records to read
(``None`` when all are idle): ``{"t": "align_wm", "tasks": {task: watermark}}``. The runner keeps
the latest of each task and sends every worker the whole map when it changed (at most every
20 ms, and every second anyway, so a restarted worker learns it too). Each source task aligns
on the lowest watermark of the *other* source tasks and its own current one (its own reported
value is older than what it knows), pausing the partitions more than ``--watermark-alignment``
ahead (:mod:`processor.runtime.task.sources`). The others' values are a few hundred ms old, so
a task may briefly run ahead or wait: alignment bounds how unevenly event time advances, it
never decides what is read.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["SourceAlignment", "others_watermark"]

#: The map unchanged is sent again this often; a changed one at most this often.
_RESEND_S = 1.0
_MIN_GAP_S = 0.02


def others_watermark(marks: Mapping[str, int | None], task: str) -> int | None:
    """The lowest watermark of the source tasks other than ``task`` (``None``: none known)."""
    values = [wm for name, wm in marks.items() if name != task and wm is not None]
    return min(values) if values else None


class SourceAlignment:
    """The source tasks' latest watermarks, sent to every worker when they change."""

    def __init__(
        self,
        broadcast: Callable[[dict[str, Any]], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._broadcast = broadcast
        self._clock = clock
        self.marks: dict[str, int | None] = {}
        self._changed = False
        self._sent_at = float("-inf")

    def on_report(self, tasks: Mapping[str, Any]) -> None:
        """A worker's ``align_wm`` message."""
        for name, wm in tasks.items():
            value = None if wm is None else int(wm)
            if self.marks.get(name, 0) != value or name not in self.marks:
                self.marks[name] = value
                self._changed = True
        self.send()

    def send(self) -> None:
        """The map to every worker, if it changed (and the last send is 20 ms old) or a
        second passed; called on each report and by the runner's loop."""
        now = self._clock()
        gap = now - self._sent_at
        if (self._changed and gap >= _MIN_GAP_S) or gap >= _RESEND_S:
            self._sent_at, self._changed = now, False
            self._broadcast({"t": "align", "wm": dict(self.marks)})
