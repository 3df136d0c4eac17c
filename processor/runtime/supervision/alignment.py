"""Watermark alignment across source tasks (Flink's FLIP-182): the coordinator's part.

Each source task reports, with its counters every second, the lowest watermark among its
partitions that still have records to read (``align_wm``; ``None`` when all are idle). The
runner tells every worker the lowest of them, the group's watermark; each source task pauses
the partitions more than ``--watermark-alignment`` ahead of it (:mod:`processor.runtime.task
.sources`). The value sent is at most a stats interval old, so a task may briefly run ahead or
wait: alignment bounds how unevenly event time advances, it never decides what is read.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["SourceAlignment"]

#: A group watermark unchanged is sent again this often: a restarted worker learns it too.
_RESEND_S = 1.0


class SourceAlignment:
    """Computes the group's watermark from the workers' stats and sends it on change."""

    def __init__(
        self,
        broadcast: Callable[[dict[str, Any]], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._broadcast = broadcast
        self._clock = clock
        self._sent: tuple[int | None, float] | None = None

    @staticmethod
    def group_watermark(task_stats: Iterable[dict[str, Any]]) -> int | None:
        """The lowest ``align_wm`` of the source tasks (``None``: every partition idle)."""
        marks = [int(st["align_wm"]) for st in task_stats if st.get("align_wm") is not None]
        return min(marks) if marks else None

    def on_stats(self, task_stats: Iterable[dict[str, Any]]) -> None:
        wm = self.group_watermark(task_stats)
        now = self._clock()
        if self._sent is not None and self._sent[0] == wm and now - self._sent[1] < _RESEND_S:
            return
        self._sent = (wm, now)
        self._broadcast({"t": "align", "wm": wm})
