"""Killing a running job's workers at random moments, placed by the job's progress.

:class:`Killer` SIGKILLs workers of a :class:`~processor.runtime.supervision.runner.Runner` running
in this process (a test's or ``eosflow certify``'s); it reads the runner's live state (workers,
restarts, checkpoints, source lag), so it needs the runner in-process, not ``eosflow run`` as a
subprocess.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from processor.runtime.supervision.runner import Runner

__all__ = [
    "Killer",
    "Outage",
    "RecoveryClock",
    "hold_final",
    "input_read",
    "on_driver_thread",
]


def _live(workers: list[Any]) -> bool:
    return bool(workers) and all(w.conn is not None and not w.conn.closed for w in workers)


def input_read(runner: Runner, records: int) -> float | None:
    """The share of the input (``records`` in all) the job's sources have read, by their
    positions (which survive restarts): 1.0 once every worker drained its sources; ``None``
    while the current generation has not reported yet."""
    workers = list(getattr(runner, "workers", []))
    if not _live(workers) or not all(w.stats for w in workers):
        return None
    if all(w.drained for w in workers):
        return 1.0
    # A bounded run's lag against its end offsets (the sources' own ``lag``), unfetched
    # partitions included: the reporter's lag is what the readers last saw, which leaves out a
    # partition not fetched from yet.
    sources = {s.name for s in runner.plan.stages if s.sources}
    lag = sum(
        int(st.get("lag", 0))
        for w in workers
        for task, st in w.stats.items()
        if task.rsplit(".", 1)[0] in sources
    )
    return max(0.0, records - lag) / max(records, 1)


def hold_final(runner: Runner, pending: Callable[[], bool], hold_s: float = 120.0) -> None:
    """Wraps the runner's coordinator step: while ``pending()`` holds (faults remain to be
    injected), an ``until_idle`` job whose sources drained takes no final checkpoint yet, so a
    job that read its input quickly keeps running until the faults land; the hold ends after
    ``hold_s`` seconds regardless."""
    drive = runner._drive
    deadline = time.monotonic() + hold_s

    def drive_holding_final() -> None:
        hold = pending() and runner.options.until_idle and time.monotonic() < deadline
        if hold:
            runner.options.until_idle = False  # drained sources do not end the job yet
        try:
            drive()
        finally:
            if hold:
                runner.options.until_idle = True

    runner._drive = drive_holding_final  # type: ignore[method-assign]


def on_driver_thread(runner: Runner, fn: Callable[[], None], timeout: float = 60.0) -> None:
    """Runs ``fn`` on the thread that runs the job (between two coordinator steps) and waits
    for it; what ``fn`` raises is raised here. For what must outlive a fault thread: a server
    started with ``owned=True`` dies with the thread that started it.

    Raises:
        TimeoutError: the job's thread did not run it within ``timeout`` seconds.
    """
    done = threading.Event()
    failed: list[BaseException] = []
    drive = runner._drive

    def drive_once_more() -> None:
        runner._drive = drive  # type: ignore[method-assign]
        try:
            fn()
        except BaseException as exc:
            failed.append(exc)
        finally:
            done.set()
        drive()

    runner._drive = drive_once_more  # type: ignore[method-assign]
    if not done.wait(timeout):
        raise TimeoutError(f"the job's thread did not run {fn!r} within {timeout:g}s")
    if failed:
        raise failed[0]


class Outage(threading.Thread):
    """Breaks something the job depends on once, when the job has read ``at`` (a share) of its
    ``records``: calls ``begin()``, waits ``seconds``, calls ``end()``. ``began``/``ended``
    are the times (``time.monotonic()``) it did; ``error`` what ``begin``/``end`` raised."""

    def __init__(
        self,
        runner: Runner,
        *,
        records: int,
        at: float,
        seconds: float,
        begin: Callable[[], None],
        end: Callable[[], None],
        name: str = "outage",
    ) -> None:
        super().__init__(name=name, daemon=True)
        self.runner, self.records, self.at, self.seconds = runner, records, at, seconds
        self.begin, self.end = begin, end
        self.began: float | None = None
        self.ended: float | None = None
        self.error: BaseException | None = None
        self.stop = threading.Event()

    def pending(self) -> bool:
        return self.ended is None and self.error is None and not self.stop.is_set()

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                read = input_read(self.runner, self.records)
                if read is not None and read >= self.at and self.runner.final_chk is None:
                    break
                time.sleep(0.01)
            else:
                return
            self.began = time.monotonic()
            self.begin()
            self.stop.wait(self.seconds)
            self.end()
            self.ended = time.monotonic()
        except BaseException as exc:  # reported by the caller, with the run
            self.error = exc


class RecoveryClock(threading.Thread):
    """Measures each recovery of a job running in this process: from the moment a restart is
    seen (``runner.restarts`` grew) to the first checkpoint completed after it, in seconds
    (``times``); a recovery still open when the job ends is not counted."""

    def __init__(self, runner: Runner) -> None:
        super().__init__(name="recovery-clock", daemon=True)
        self.runner = runner
        self.times: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        restarts = self.runner.restarts
        since: float | None = None
        completed = 0
        while not self.stop.wait(0.02):
            coordinator = getattr(self.runner, "coordinator", None)
            if coordinator is None:
                continue
            if self.runner.restarts != restarts:
                restarts = self.runner.restarts
                if since is None:
                    since = time.monotonic()
                completed = coordinator.stats.completed
            elif since is not None and coordinator.stats.completed > completed:
                self.times.append(round(time.monotonic() - since, 2))
                since = None


class Killer(threading.Thread):
    """SIGKILLs a random worker (of ``victims``, default any) at random points of the job's
    progress, once ``start_after`` restarts happened.

    Kills are placed by progress, not by the clock, so that a test means the same on a fast
    broker and a slow one (the release check on Apache Kafka finished jobs before wall-clock
    kills landed): kill ``k`` waits until the sources have read a random share of the input
    (their position, which survives restarts, from the workers' ``lag``; or every source
    drained) and the generation it hits has completed a random 0-2 checkpoints. While kills
    remain, the final checkpoint of ``until_idle`` is held back (:meth:`hold_final`), so a
    job that drained its input quickly keeps taking checkpoints (records may still circulate
    in loops) until every kill landed; the hold ends after ``hold_s`` regardless, and the
    test's own count of kills then fails instead of hanging.
    """

    def __init__(
        self,
        runner: Runner,
        *,
        kills: int,
        start_after: int,
        rng: random.Random,
        records: int,
        victims: list[int] | None = None,
        plan: list[tuple[float, int]] | None = None,
        hold_s: float = 120.0,
        target: Callable[[int], int | None] | None = None,
    ) -> None:
        super().__init__(name="chaos-killer", daemon=True)
        #: what a kill hits, from the victim worker's PID (default: that process itself; e.g.
        #: the Spark executor JVM running it, :meth:`SparkCluster.executor_of`)
        self.target = target
        self.runner, self.kills, self.start_after, self.rng = runner, kills, start_after, rng
        self.victims = victims
        self.records = records
        self.hold_s = hold_s
        #: (share of the input read, checkpoints the generation completed) before kill k
        self.plan = plan or [
            (share, rng.choice((0, 1, 2)))
            for share in sorted(rng.uniform(0.05, 1.0) for _ in range(kills))
        ]
        assert len(self.plan) == kills
        self.done: list[tuple[float, int]] = []
        self.stop = threading.Event()

    def holding(self) -> bool:
        return len(self.done) < self.kills and not self.stop.is_set()

    def hold_final(self) -> None:
        """No final checkpoint while kills remain (see :func:`hold_final`)."""
        hold_final(self.runner, self.holding, self.hold_s)

    def _due(self, workers: list[Any], completed_at_start: int) -> bool:
        """Whether the job progressed to the point of the next kill."""
        share, checkpoints = self.plan[len(self.done)]
        if self.runner.coordinator.stats.completed - completed_at_start < checkpoints:
            return False
        read = input_read(self.runner, self.records)
        return read is not None and read >= share

    def run(self) -> None:
        started = time.monotonic()
        generation, completed_at_start = -1, 0
        while len(self.done) < self.kills and not self.stop.is_set():
            runner = self.runner
            workers = list(getattr(runner, "workers", []))
            attempt = runner.restarts
            if (
                attempt < self.start_after + len(self.done)
                or not _live(workers)
                or runner.final_chk is not None
            ):
                time.sleep(0.01)
                continue
            if runner.generation != generation:
                generation = runner.generation
                completed_at_start = runner.coordinator.stats.completed
            if not self._due(workers, completed_at_start):
                time.sleep(0.01)
                continue
            if self.stop.wait(self.rng.uniform(0.0, 0.2)):  # not always right at a report
                return
            # Still the same generation, every worker connected: not one being torn down (the
            # Spark runner keeps the old handles while it cancels the old job).
            if (
                runner.restarts != attempt
                or runner.final_chk is not None
                or [id(w) for w in workers] != [id(w) for w in runner.workers]
                or not _live(workers)
            ):
                continue
            victim = self.rng.choice(self.victims or range(len(workers)))
            pid = workers[victim].pid
            if pid is not None and self.target is not None:
                pid = self.target(pid)
            if pid is None:
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            self.done.append((round(time.monotonic() - started, 2), victim))
