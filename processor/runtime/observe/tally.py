"""The run's counters, lag and waits: one source of truth for the progress line, ``status.json``
(``eosflow status``, ``eosflow jobs``), ``/metrics`` and the job page's ``/api/job``.

Before (issue 37), each computed its own: ``status`` said ``source lag 0`` while ``/metrics``
showed about 36,000 (the progress line and ``status.json`` counted lag only in a bounded run,
against its end offsets), and after a restart the final line read ``0 records in, 0 out``
although 44,140 records were read and 1,050 written (it counted the current generation's
workers only).

:class:`Tally` keeps the last ``stats`` message of every worker process the run had (keyed by
generation, worker and pid: a restarted worker's final counts stay in the totals), so counters
never go down while the runner lives. ``in`` counts every record the source tasks read,
re-reads after a restart included (a restart resumes from the last checkpoint and reads what
came after it again); ``out`` counts the records handed to sinks, the ones of epochs a restart
rolled back included (the sinks committed them once: see the guarantees in the README).

Lag is what the readers last saw per source partition (``parts`` in the task stats: the end
offset from the last fetch minus the position, no broker request), for bounded and unbounded
runs alike; only the current generation's workers count (a dead worker's partitions belong to
its successor).

:func:`waits` is what the workers' heartbeats said they wait on
(:mod:`processor.runtime.waits`), the longest first.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from processor.compiler import Plan

if TYPE_CHECKING:
    from processor.runtime.job import WorkerHandle

__all__ = ["COUNTERS", "Tally", "describe_waits", "waits"]

#: The task-stats counters the tally adds up (``in``: source tasks only).
COUNTERS = (
    "in", "sunk", "dead", "bad", "late", "dups", "loop_limit", "lookups", "round_trips", "replayed"
)  # fmt: skip


class Tally:
    """The counters of one run over every worker process it had, and its source lag.

    Args:
        plan: the compiled job: which stages read sources, which topics are channels.
    """

    def __init__(self, plan: Plan) -> None:
        self.plan(plan)
        self._incarnations: dict[tuple[int, int, Any], dict[str, dict[str, Any]]] = {}

    def plan(self, plan: Plan) -> None:
        """The job's plan (again, after a rescale compiled it anew)."""
        self._sources = {s.name for s in plan.stages if s.sources}
        self._channels = {e.topic for e in plan.edges}

    def on_stats(
        self, generation: int, worker: int, pid: Any, tasks: dict[str, dict[str, Any]]
    ) -> None:
        """A worker's ``stats`` message: its tasks' counters, cumulative for its process."""
        self._incarnations[(generation, worker, pid)] = tasks

    def incarnations(self) -> Iterator[dict[str, dict[str, Any]]]:
        """The last stats of every worker process the run had."""
        return iter(list(self._incarnations.values()))

    def totals(self) -> dict[str, int]:
        """Each of :data:`COUNTERS` over every task of every worker process of the run."""
        totals = dict.fromkeys(COUNTERS, 0)
        sources = self._sources
        for tasks in self._incarnations.values():
            for task, st in tasks.items():
                source = task.rsplit(".", 1)[0] in sources
                for key in COUNTERS:
                    if key != "in" or source:
                        totals[key] += int(st.get(key, 0))
        return totals

    def parts(self, workers: Iterable[WorkerHandle]) -> list[tuple[str, int, int]]:
        """``(topic, partition, records left)`` of every partition the ``workers`` (the
        current generation's) read, channels included, sorted."""
        found = [
            (str(t), int(p), int(n))
            for w in workers
            for st in w.stats.values()
            for t, p, n in st.get("parts", ())
        ]
        return sorted(found)

    def source_lag(self, workers: Iterable[WorkerHandle]) -> int:
        """Records left in the source partitions, as the readers last saw them."""
        return sum(n for t, _p, n in self.parts(workers) if t not in self._channels)

    def is_channel(self, topic: str) -> bool:
        return topic in self._channels


#: A local worker that has not said hello this long after its process started is shown waiting
#: on its start (a usual start takes 0.1-2 s: the interpreter, the pipeline's imports).
NO_HELLO_SHOWN_S = 5.0


def waits(workers: Iterable[WorkerHandle], now: float | None = None) -> list[dict[str, Any]]:
    """What the ``workers`` wait on, the longest first: ``{"worker", "on", "since_ms",
    "for_s"}``; ``for_s`` grows with the time since the heartbeat that said it (``now``:
    monotonic)."""
    now = time.monotonic() if now is None else now
    found = []
    for w in workers:
        if w.conn is None:
            # no hello yet: its interpreter, the pipeline file's imports and top level (a model
            # loaded there), a restore's manifest read; shown once past a usual start
            if w.started is not None and now - w.started >= NO_HELLO_SHOWN_S:
                found.append(
                    {
                        "worker": w.index,
                        "on": f"its start (no hello yet; see worker-{w.index}.log)",
                        "since_ms": int((time.time() - (now - w.started)) * 1000),
                        "for_s": round(now - w.started, 1),
                    }
                )
            continue
        for wait in w.waits:
            later = max(0.0, now - w.waits_at)
            found.append(
                {
                    "worker": w.index,
                    "on": str(wait["on"]),
                    "since_ms": int(wait["since_ms"]),
                    "for_s": round(float(wait["for_s"]) + later, 1),
                }
            )
    return sorted(found, key=lambda x: -x["for_s"])


def describe_waits(found: list[dict[str, Any]]) -> str:
    """The progress line's ``waiting: worker 1 on the dedup store (...) for 12 s`` ("" if
    none), the longest wait first."""
    if not found:
        return ""
    w = found[0]
    more = f" (+{len(found) - 1} more)" if len(found) > 1 else ""
    return f"waiting: worker {w['worker']} on {w['on']} for {w['for_s']:.0f} s{more}"
