"""How a runner supervises its workers: what a runner implements to start, watch and stop
them (:class:`processor.runtime.supervision.runner.Runner`'s subclasses), and recovery when one dies
or is stuck: global (a new generation of every worker) or local (the failed worker alone)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from processor.runtime.control import ControlServer
from processor.runtime.job import JobFailed, WorkerHandle
from processor.runtime.supervision.health import stuck_worker
from processor.runtime.supervision.identity import JobIdentity
from processor.runtime.supervision.lifecycle import RunnerLifecycle, same_cause

__all__ = ["RunnerRecovery"]

log = logging.getLogger(__name__)

# The same failure this many times in a row before the workers all started is a configuration
# or environment problem, not bad luck: fail instead of spending the restart budget on it.
_MAX_UNSTARTED = 3


class RunnerRecovery(RunnerLifecycle):
    """Worker supervision and recovery of a
    :class:`~processor.runtime.supervision.runner.Runner`."""

    server: ControlServer
    identity: JobIdentity
    failed_worker: int | None
    final_chk: int | None
    committed: dict[int, set[str]]
    log_offsets: list[int]
    _unstarted: int

    # -- what the runner defines -----------------------------------------------------------------

    def _spawn_all(self, counts: dict[str, int], ends: list[list[Any]] | None) -> None:
        raise NotImplementedError

    def _spec(
        self,
        i: int,
        restore: int,
        counts: dict[str, int],
        ends: list[list[Any]] | None,
        stale_through: int = 0,
        sink_generation: int | None = None,
    ) -> dict[str, Any]:
        raise NotImplementedError

    def _pump(self, timeout: float = 0.05) -> None:
        raise NotImplementedError

    def _log_path(self, worker: int) -> Path:
        raise NotImplementedError

    # -- what a runner implements ----------------------------------------------------------------

    def _start(self) -> None:
        """Acquire the runner's resources (before the first generation)."""

    def _close(self) -> None:
        """Release them (after the last)."""

    def _launch(self, specs: list[dict[str, Any]]) -> None:
        """Start one worker per spec (JSON-able dicts); ``self.workers`` is already set."""
        raise NotImplementedError

    def _dead_worker(self) -> str | None:
        """The cause, if a worker of the current generation died or lost its connection (and
        :attr:`failed_worker` set to its index, when the runner can restart it alone)."""
        raise NotImplementedError

    def _relaunch(self, spec: dict[str, Any]) -> None:
        """Start one worker again (local recovery), after :meth:`_stop_worker` of it."""
        raise NotImplementedError

    def _stop_worker(self, index: int) -> None:
        """Stop worker ``index`` alone and wait until it cannot write any more."""
        raise NotImplementedError

    def _stop_workers(self) -> None:
        """Stop every worker of the current generation and wait until none can write."""
        raise NotImplementedError

    def _await_exit(self, timeout: float) -> None:
        """Wait for the workers to exit after they were told to stop."""
        raise NotImplementedError

    def _kill_all(self) -> None:
        self._stop_workers()
        self.server.drop_all()

    def _recover(self, cause: str, counts: dict[str, int], ends: list[list[Any]] | None) -> None:
        self.identity.verify(cause)  # fenced by another runner of the job: stop, not restart
        self.restarts += 1
        self.restart_causes.append(cause)
        if self.metrics is not None:
            self.metrics.on_restart(cause)
        failed, self.failed_worker = self.failed_worker, None
        if self.options.recovery == "local" and failed is not None:
            self._recover_local(failed, cause, counts, ends)
            return
        started = all(w.conn is not None for w in self.workers)
        self._unstarted = 0 if started else self._unstarted + 1
        self._kill_all()
        # "The same" failure whichever worker hit it first.
        recent = self.restart_causes[-_MAX_UNSTARTED:]
        if self._unstarted >= _MAX_UNSTARTED and all(same_cause(c, cause) for c in recent):
            raise JobFailed(
                f"job {self.job!r}: the workers failed {_MAX_UNSTARTED} times in a row before "
                f"they all started, each time with: {cause}. Worker logs: {self.dir}/worker-*.log"
            )
        self._check_budget(cause)
        backoff = self._backoff()
        log.warning(
            "restart=%s total=%d runner=%s cause=%r backoff_s=%.1f recovery=global",
            self.restart_count(), self.restarts, self.runner, cause, backoff,
        )  # fmt: skip
        self._say(f"restart {self.restarts}: {cause}; global recovery in {backoff:.1f}s")
        time.sleep(backoff)
        self.final_chk = None
        self.committed.clear()
        self._spawn_all(counts, ends)

    def _recover_local(
        self, index: int, cause: str, counts: dict[str, int], ends: list[list[Any]] | None
    ) -> None:
        """Local recovery: worker ``index`` alone restarts from the latest completed checkpoint,
        in the same generation; the others keep running. The pending checkpoint (which the dead
        worker can no longer acknowledge) is aborted; the restarted worker treats every
        checkpoint triggered so far as stale, and downstream tasks drop the records it re-emits
        by ID (docs/local-recovery.md)."""
        self._check_budget(cause)
        self._stop_worker(index)
        old = self.workers[index]
        if old.conn is not None:
            self.server.drop(old.conn)
        survivors = [w.index for w in self.workers if w.index != index]
        aborted = self.coordinator.abort_pending(f"worker {index} failed")
        if aborted is not None:
            self.server.broadcast({"t": "abort", "chk": aborted, "reason": f"worker {index} died"})
        latest = self.store.latest_completed(self.job)
        restore = latest.checkpoint_id if latest else 0
        stale = self.coordinator.next_id - 1
        backoff = self._backoff()
        log.warning(
            "restart=%s total=%d runner=%s cause=%r backoff_s=%.1f recovery=local worker=%d "
            "restore_checkpoint=%d stale_through=%d survivors=%s",
            self.restart_count(), self.restarts, self.runner, cause, backoff, index,
            restore, stale, survivors,
        )  # fmt: skip
        self._say(
            f"restart {self.restarts}: {cause}; local recovery of worker {index} from "
            f"checkpoint {restore} in {backoff:.1f}s (workers {survivors} keep running)"
        )
        deadline = time.monotonic() + backoff
        while time.monotonic() < deadline:  # the survivors' messages keep flowing
            self._pump(min(0.05, max(0.0, deadline - time.monotonic())))
        self.final_chk = None
        self.committed.clear()
        self.workers[index] = WorkerHandle(index)
        path = self._log_path(index)
        self.log_offsets[index] = path.stat().st_size if path.exists() else 0
        # A new number for its sink writers (their in-progress names and transaction tags must
        # not collide with an earlier start's); the channels keep the job's generation.
        sink_generation = self.store.next_generation(self.job)
        spec = self._spec(index, restore, counts, ends, stale, sink_generation)
        self._relaunch(spec)

    def _stuck_worker(self) -> str | None:
        """The cause, if a connected worker is stuck (:func:`stuck_worker`); it is restarted
        like a dead one."""
        coordinator = self.coordinator
        found = stuck_worker(self.workers, self.options, coordinator.timed_out, time.monotonic())
        if found is None:
            return None
        cause, self.failed_worker = found
        coordinator.timed_out = []  # this restart answers them
        return cause
