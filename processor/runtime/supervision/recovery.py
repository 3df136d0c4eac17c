"""How a runner supervises its workers: :class:`Supervisor` starts each generation, finds a
worker that died or is stuck, and recovers: global (a new generation of every worker) or local
(the failed worker alone, in the same generation).

How workers are started, watched and stopped is a :class:`WorkerLauncher`'s business: OS
processes (:class:`processor.runtime.supervision.local.LocalWorkers`) or one Spark barrier job per
generation (:class:`processor.runtime.supervision.spark.SparkWorkers`). The supervisor talks to it
only through that protocol, and to the workers only through the control plane.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, Protocol

from processor.compiler import Plan
from processor.runtime.checkpoints.coordinator import CheckpointCoordinator
from processor.runtime.control import ControlServer
from processor.runtime.job import Generation, RunOptions
from processor.runtime.observe.metrics import JobMetrics
from processor.runtime.shape.topology import check_shape
from processor.runtime.supervision.health import stuck_worker
from processor.runtime.supervision.identity import JobIdentity
from processor.runtime.supervision.lifecycle import RestartBudget, StopController
from processor.snapshot.store import SnapshotStore

__all__ = ["ControlAddress", "Failure", "SpecFactory", "Supervisor", "WorkerLauncher"]

log = logging.getLogger(__name__)

#: Why a worker failed, and its index when the launcher knows which (local recovery needs it).
Failure = tuple[str, int | None]


class ControlAddress(NamedTuple):
    """Where the control plane listens (``bind``) and the host workers connect to
    (``advertise``; ``None``: the bind host)."""

    bind: tuple[str, int] = ("127.0.0.1", 0)
    advertise: str | None = None


class WorkerLauncher(Protocol):
    """Starts, watches and stops the workers of a generation (what differs between runners)."""

    #: The runner's name in logs, ``status.json`` and metrics: ``local``, ``spark``.
    name: str

    def open(self, job: str, pipeline: str, say: Callable[[str], None]) -> ControlAddress:
        """Acquire the launcher's resources (before the first generation); where the control
        plane must listen for its workers to reach it."""

    def close(self) -> None:
        """Release them (after the last generation)."""

    def launch(self, specs: list[dict[str, Any]], current: Generation) -> None:
        """Start one worker per spec (JSON-able dicts); ``current.workers`` is already set."""

    def relaunch(self, spec: dict[str, Any], current: Generation) -> None:
        """Start one worker again (local recovery), after :meth:`stop_worker` of it."""

    def dead_worker(self, current: Generation) -> Failure | None:
        """The cause, if a worker of the current generation died or lost its connection, with
        its index when the launcher can restart it alone."""

    def stop_worker(self, index: int) -> None:
        """Stop worker ``index`` alone and wait until it cannot write any more."""

    def stop_all(self, current: Generation) -> None:
        """Stop every worker of the current generation and wait until none can write."""

    def await_exit(self, timeout: float) -> None:
        """Wait for the workers to exit after they were told to stop."""


class SpecFactory(Protocol):
    """Worker ``worker``'s start-up spec for the current generation (the runner's)."""

    def __call__(
        self, worker: int, restore: int, stale_through: int = 0, sink_generation: int | None = None
    ) -> dict[str, Any]: ...


class Supervisor:
    """Starts generations of workers, finds failed ones, and recovers.

    Built by the runner once its control plane and coordinator exist; it owns nothing but
    decisions: the workers' handles are the shared :class:`Generation`, their processes the
    ``launcher``'s, the restart counts the ``budget``'s. ``spec`` builds a worker's start-up
    spec; ``identity`` is the job's claim in the broker (a runner fenced by another stops
    instead of restarting); ``pump(timeout)`` handles the workers' messages (the survivors of
    a local recovery keep talking while one restarts); ``say`` writes a progress line.
    """

    def __init__(
        self,
        *,
        job: str,
        plan: Plan,
        options: RunOptions,
        store: SnapshotStore,
        current: Generation,
        launcher: WorkerLauncher,
        server: ControlServer,
        coordinator: CheckpointCoordinator,
        budget: RestartBudget,
        stop: StopController,
        identity: JobIdentity,
        metrics: JobMetrics | None,
        spec: SpecFactory,
        pump: Callable[[float], None],
        say: Callable[[str], None],
    ) -> None:
        self.job, self.plan, self.options, self.store = job, plan, options, store
        self.current, self.launcher, self.server = current, launcher, server
        self.coordinator, self.budget, self.stop, self.metrics = coordinator, budget, stop, metrics
        self.identity = identity
        self._spec, self._pump, self._say = spec, pump, say
        #: Workers the last start or recovery started that have not sent their first counters
        #: yet (their tasks are still restoring, recovering their sinks, opening their inputs),
        #: and since when (monotonic): see :meth:`first_checkpoint`.
        self.recovering: set[int] = set()
        self._recovering_since = 0.0
        self._clock = time.monotonic

    def start_generation(self) -> None:
        """A new generation of every worker, from the latest completed checkpoint."""
        current = self.current
        current.number = self.store.next_generation(self.job)
        self.identity.announce(current.number)  # before any of its channel records
        self.coordinator.start_generation(current.number)
        latest = self.store.latest_completed(self.job)
        check_shape(self.plan, self.store, latest)
        restore = latest.checkpoint_id if latest else 0
        specs = [self._spec(i, restore) for i in range(self.options.workers)]
        current.begin()
        self.launcher.launch(specs, current)
        self._recovering(range(self.options.workers))
        log.info(
            "started runner=%s generation=%d workers=%d restore_checkpoint=%d",
            self.launcher.name, current.number, len(current.workers), restore,
        )  # fmt: skip

    def failed(self) -> Failure | None:
        """A worker that died (:meth:`WorkerLauncher.dead_worker`) or is stuck
        (:func:`~processor.runtime.supervision.health.stuck_worker`); it is restarted either way."""
        dead = self.launcher.dead_worker(self.current)
        if dead is not None:
            return dead
        coordinator = self.coordinator
        found = stuck_worker(
            self.current.workers, self.options, coordinator.timed_out, time.monotonic()
        )
        if found is not None:
            coordinator.timed_out = []  # this restart answers them
        return found

    def stop_all(self) -> None:
        """Stop every worker of the generation and close their connections."""
        self.launcher.stop_all(self.current)
        self.server.drop_all()

    def recover(self, cause: str, worker: int | None) -> None:
        """Restart after a failure: worker ``worker`` alone under ``--recovery local`` when
        the launcher knows which, else a new generation of every worker, after the backoff.

        Raises:
            JobFailed: the restart budget says restarting cannot help (:class:`RestartBudget`).
            JobFencedError: another runner took the job (:meth:`JobIdentity.verify`).
        """
        self.identity.verify(cause)  # fenced by another runner of the job: stop, not restart
        budget = self.budget
        budget.count(cause)
        if self.metrics is not None:
            self.metrics.on_restart(cause)
        # A task whose replay check reached --recovery-max-ids (ReplayBoundExceeded, quoted
        # in the cause from the worker's last error line) cannot protect its inputs any more:
        # the whole job restores instead, which needs no replay check.
        if self.options.recovery == "local" and worker is not None:
            if "ReplayBoundExceeded" not in cause:
                self._recover_local(worker, cause)
                return
            log.warning("a replay check reached --recovery-max-ids: global recovery")
        started = self.current.connected()
        self.stop_all()
        budget.check_start(cause, started)
        budget.check(cause, self._latest_id())
        backoff = budget.backoff()
        log.warning(
            "restart=%s total=%d runner=%s cause=%r backoff_s=%.1f recovery=global",
            budget.restart_count(), budget.restarts, self.launcher.name, cause, backoff,
        )  # fmt: skip
        self._say(
            f"restart {budget.restarts}: {budget.said(cause)}; global recovery in {backoff:.1f}s"
        )
        time.sleep(backoff)
        self.stop.restarted()
        self.start_generation()

    def _recover_local(self, index: int, cause: str) -> None:
        """Local recovery: worker ``index`` alone restarts from the latest completed checkpoint,
        in the same generation; the others keep running. The pending checkpoint (which the dead
        worker can no longer acknowledge) is aborted; the restarted worker treats every
        checkpoint triggered so far as stale, and downstream tasks drop the records it re-emits
        by ID (docs/local-recovery.md)."""
        budget, current = self.budget, self.current
        budget.check(cause, self._latest_id())
        self.launcher.stop_worker(index)
        old = current.workers[index]
        if old.conn is not None:
            self.server.drop(old.conn)
        survivors = [w.index for w in current.workers if w.index != index]
        aborted = self.coordinator.abort_pending(f"worker {index} failed")
        if aborted is not None:
            self.server.broadcast({"t": "abort", "chk": aborted, "reason": f"worker {index} died"})
        restore = self._latest_id()
        stale = self.coordinator.next_id - 1
        backoff = budget.backoff()
        log.warning(
            "restart=%s total=%d runner=%s cause=%r backoff_s=%.1f recovery=local worker=%d "
            "restore_checkpoint=%d stale_through=%d survivors=%s",
            budget.restart_count(), budget.restarts, self.launcher.name, cause, backoff, index,
            restore, stale, survivors,
        )  # fmt: skip
        self._say(
            f"restart {budget.restarts}: {budget.said(cause)}; local recovery of worker {index} "
            f"from checkpoint {restore} in {backoff:.1f}s (workers {survivors} keep running)"
        )
        deadline = time.monotonic() + backoff
        while time.monotonic() < deadline:  # the survivors' messages keep flowing
            self._pump(min(0.05, max(0.0, deadline - time.monotonic())))
        self.stop.restarted()
        self.recovering = set()  # periodic: the survivors' barriers are not held (first_checkpoint)
        current.restart(index)
        # A new number for its sink writers (their in-progress names and transaction tags must
        # not collide with an earlier start's); the channels keep the job's generation.
        sink_generation = self.store.next_generation(self.job)
        self.identity.announce(sink_generation)  # its channel records' incarnation
        self.launcher.relaunch(self._spec(index, restore, stale, sink_generation), current)

    def _recovering(self, workers: Iterable[int]) -> None:
        self.recovering = set(workers)
        self._recovering_since = self._clock()

    def first_checkpoint(self) -> str:
        """When the next checkpoint may be triggered, after a job's start or a recovery:
        ``"hold"`` while a started worker has not sent its first counters, ``"now"`` once,
        when the last one did, else ``"periodic"`` (the coordinator's interval).

        Why: the new generation's first checkpoint used to fall due one interval after the
        generation started, before its workers had opened their tasks (a Kafka sink's
        ``init_transactions`` alone takes about 0.6 s on Apache Kafka). The trigger waited in
        their inboxes and they injected its barrier before reading anything, so it committed
        no new output; the next one came an interval later, behind the whole replayed backlog
        (bench/RESULTS.md, "Recovery on Apache Kafka (issue 38)"). Triggered as soon as every
        restarted worker reads, its barrier follows the first batches: it completes quickly
        and its commit is the first new output. A worker stuck while opening holds
        checkpoints at most ``checkpoint_timeout``, then they go periodic again (and time
        out, which restarts it: :func:`~processor.runtime.supervision.health.stuck_worker`).

        The same at a job's start (issue 51): its first output came an interval after the
        workers read (1 s by default), now with the commit of their first batches: launch to
        first committed output 2.09 s before, 1.23 s after (bench/RESULTS.md, "Latency,
        start-up and recovery").

        Global recovery and starts only: under local recovery the survivors keep writing into the
        restarted worker's channels while it opens, and holding their barriers back only
        grew the backlog it must read before its first checkpoint completes (measured: 7.3 s
        to the first new output held, 5.4 s on the interval).
        """
        if not self.recovering:
            return "periodic"
        workers = self.current.workers
        self.recovering = {i for i in self.recovering if not workers[i].stats}
        if not self.recovering:
            return "now"
        if self._clock() - self._recovering_since > self.options.checkpoint_timeout:
            self.recovering = set()
            return "periodic"
        return "hold"

    def _latest_id(self) -> int:
        latest = self.store.latest_completed(self.job)
        return latest.checkpoint_id if latest is not None else 0
