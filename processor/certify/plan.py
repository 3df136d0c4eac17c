"""What each certify run does: its faults, and the destinations it writes to.

Runs ``ref`` and ``det`` are fault-free: the first gives the reference output, the second tells
a deterministic pipeline from one whose output depends on chance or the clock. Fault runs take
the selected fault kinds in turn (``--runs 6`` with four kinds: each kind once, then ``kill``
and ``protocol-points`` again, with other workers and moments):

``protocol-points``
    one SIGKILL at each of the engine's named protocol points (:data:`POINT_CHAIN`), one per
    start of the job: the first start dies at the first point, the restarted job at the next...
    A point the pipeline never reaches (``mid-alignment`` needs a task with several input
    channels) ends the chain there; the report lists the points that fired.
``kill``
    ``--kills`` SIGKILLs of random workers at random moments, placed by the job's progress (a
    random share of the input read, 0-2 checkpoints into the generation).
``broker-partition``
    the broker cut off from every client for ``--outage`` seconds, once, at a random share of
    the input read (certify's own broker, behind its fault proxy).
``redis-restart``
    the Redis the pipeline uses stopped and started again with its data, once, at a random
    share of the input (certify's own Redis); the outage lasts ``--outage`` seconds.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from processor.runtime.job import Fault

__all__ = ["FAULT_KINDS", "POINT_CHAIN", "RunPlan", "plan_runs"]

FAULT_KINDS = ("kill", "protocol-points", "broker-partition", "redis-restart")

#: The protocol points in the order a chain visits them, with the visit that dies: each is
#: reachable in the start that follows the previous one (``mid-sink-recover`` needs the commit
#: that ``after-completion-before-commit`` left pending; ``during-recovery`` a checkpoint to
#: restore). ``mid-alignment`` comes last: only tasks with several input channels reach it.
POINT_CHAIN = (
    ("before-prepare", 3),
    ("after-snapshot-before-ack", 2),
    ("after-completion-before-commit", 2),
    ("mid-sink-recover", 1),
    ("during-recovery", 1),
    ("mid-sink-commit", 2),
    ("mid-alignment", 3),
)


@dataclass
class RunPlan:
    """One run: its name, fault kind (``None``: fault-free) and the faults' parameters."""

    name: str
    kind: str | None
    faults: list[Fault] = field(default_factory=list)
    kills: int = 0
    kill_plan: list[tuple[float, int]] = field(default_factory=list)
    outage_at: float = 0.0
    outage_s: float = 0.0

    def describe(self) -> str:
        if self.kind is None:
            return "none"
        if self.kind == "protocol-points":
            return f"SIGKILL at {len(self.faults)} protocol points"
        if self.kind == "kill":
            return f"{self.kills} random SIGKILLs"
        what = "broker partition" if self.kind == "broker-partition" else "Redis restart"
        return f"{what} {self.outage_s:g}s at {self.outage_at:.0%} of the input"


def plan_runs(
    kinds: list[str],
    runs: int,
    *,
    workers: int,
    kills: int,
    outage_s: float,
    rng: random.Random,
) -> list[RunPlan]:
    """The two fault-free runs, then ``runs`` fault runs taking ``kinds`` in turn."""
    plans = [RunPlan("ref", None), RunPlan("det", None)]
    for i in range(runs):
        kind = kinds[i % len(kinds)]
        plan = RunPlan(str(i + 1), kind)
        if kind == "protocol-points":
            first = rng.randrange(workers)
            plan.faults = [
                Fault(attempt, (first + attempt) % workers, point, nth)
                for attempt, (point, nth) in enumerate(POINT_CHAIN)
            ]
        elif kind == "kill":
            plan.kills = kills
            plan.kill_plan = [
                (share, rng.choice((0, 1, 2)))
                for share in sorted(rng.uniform(0.05, 0.95) for _ in range(kills))
            ]
        else:
            plan.outage_at = round(rng.uniform(0.1, 0.7), 2)
            plan.outage_s = outage_s
        plans.append(plan)
    return plans
