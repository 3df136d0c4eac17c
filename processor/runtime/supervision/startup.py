"""Where a run's start went (issue 51): the runner's clock at each step from its construction
to the first checkpoint every sink committed, in ``status.json`` (``startup``) and one INFO
line of the runner's log.

A slow start is otherwise a guess: the interpreter and the imports, the pipeline's compile, the
start-up checks (broker, lease, state), the topics, the job's claim in the broker, the workers'
own start, the first checkpoint and its commit each take their share, and which one grew
depends on the machine and the cluster. ``bench/launch.py`` reads these marks to split its
launch-to-first-output time.

Marks are seconds since the runner was built, each taken once (a recovery later does not move
them); ``process_s`` is how long this process had run before (interpreter start and imports;
Linux only, else absent).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping

__all__ = ["PHASES", "StartTimes", "describe", "process_age"]

log = logging.getLogger(__name__)

#: The marks, in the order a start passes them.
PHASES = (
    "compiled",  # the pipeline loaded and compiled
    "checked",  # preflight, the job's lease (or --takeover)
    "topics",  # state checks, the shape, the job's topics prepared
    "claimed",  # the job's claim in the broker taken (every earlier runner fenced)
    "launched",  # the workers' specs handed out
    "connected",  # every worker said hello
    "first_trigger",  # the first checkpoint triggered
    "first_completed",  # ...every task acknowledged it
    "first_committed",  # ...and every sink committed it: the first output is visible
)


def process_age() -> float | None:
    """Seconds since this process started (``/proc``: its start in clock ticks after boot, and
    the uptime), or ``None`` where ``/proc`` does not say."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class StartTimes:
    """The marks of one run's start (see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.job = ""  # known once the pipeline compiled
        self._clock = clock
        self._t0 = clock()
        self.process_s = process_age()
        self.marks: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        """``phase`` (one of :data:`PHASES`) is reached now, unless it was before; the last one
        logs the whole start."""
        assert phase in PHASES, phase
        if phase in self.marks:
            return
        self.marks[phase] = round(self._clock() - self._t0, 3)
        if phase == PHASES[-1]:
            log.info("job=%s start: %s", self.job, self.describe())

    def as_dict(self) -> dict[str, float]:
        """``status.json``'s ``startup``: ``process_s`` and each mark reached so far."""
        out = {f"{p}_s": self.marks[p] for p in PHASES if p in self.marks}
        if self.process_s is not None:
            out = {"process_s": round(self.process_s, 2), **out}
        return out

    def describe(self) -> str:
        return describe(self.as_dict())


def describe(startup: Mapping[str, float]) -> str:
    """``status.json``'s ``startup`` in one line (the runner's log, ``eosflow status``):
    ``process 0.30 s before the runner; then compiled 0.11 s, checked 0.19 s, ...``."""
    marks = ", ".join(f"{p} {startup[f'{p}_s']:.2f} s" for p in PHASES if f"{p}_s" in startup)
    if "process_s" not in startup:
        return marks
    return f"process {startup['process_s']:.2f} s before the runner; then {marks}"
