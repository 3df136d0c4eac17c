"""How a runner stops and when it gives up: stop signals with a bounded final checkpoint, and
the restart strategy.

Stopping (SIGINT / SIGTERM): the first signal asks for a final, aligned checkpoint and waits
for it to commit, at most ``--stop-timeout``; it says so, and says every 10 s what it waits
for. When the time is up (a worker keeps failing, a sink cannot commit), or on a second signal,
the runner stops without it: nothing is lost or duplicated, the output since the last completed
checkpoint is simply not committed, and the next run resumes from that checkpoint.

Restarts (Flink's failure-rate strategy): a job may restart at most ``max_restarts`` times
within any ``restart_window``; a streaming job that fails once a week runs for ever, one that
fails in a loop stops with the last cause. A job also stops after ``max_restarts`` restarts in a
row that completed no checkpoint in between, however slowly they came: a failure that takes
longer than ``restart_window / max_restarts`` to show (a broker answering NOT_COORDINATOR for
ever, each attempt retried for 30 s) kept a job restarting for 7 minutes, showing
``restart=11/10`` (issue 35). A user function that raised on a record (no
dead-letter destination), and data loss (records deleted by retention, a checkpoint's positions
beyond a recreated topic's end), are deterministic: when the same failure comes back right after
the restart (up to its numbers: which worker, partition or offset shows it first is a race
between the workers), restarting cannot fix it, so the job fails at once with the cause.
"""

from __future__ import annotations

import contextlib
import re
import signal
import time
from typing import Any

from processor.runtime.job import JobFailed
from processor.runtime.observe.reporting import RunnerReporting

__all__ = ["RunnerLifecycle"]

#: Worker numbers in a cause: "the same" failure whichever worker hit it first.
_WORKER_N = re.compile(r"\bworker[ =]\d+")
#: Failures that happen again the same way after a restart: a user function raising on a
#: record, records that are gone or positions that no longer exist on the broker.
_DETERMINISTIC = ("UserFunctionError", "DataLossError")


_NUMBER = re.compile(r"\d+")


def same_cause(a: str, b: str) -> bool:
    return _WORKER_N.sub("worker", a) == _WORKER_N.sub("worker", b)


def same_kind(a: str, b: str) -> bool:
    """The same failure up to its numbers: which worker, partition or offset hit it first
    varies from one generation to the next (the workers race), what failed does not."""
    return _NUMBER.sub("N", a) == _NUMBER.sub("N", b)


class RunnerLifecycle(RunnerReporting):
    """Stop signals and the restart strategy of a
    :class:`~processor.runtime.supervision.runner.Runner`."""

    stopping: str | None
    _stop_deadline: float
    _stop_next_say: float
    _restart_times: list[float]
    _stalled: tuple[int, int]

    # -- stopping --------------------------------------------------------------------------------

    def _install_signals(self) -> dict[int, Any]:
        def stop(signum: int, _frame: Any) -> None:
            name = signal.Signals(signum).name
            if self.stopping is None:
                self.stop_for(name, f"; {name} again stops at once without it")
            else:
                self._say(f"{name} again: {self._without_final()}")
                raise KeyboardInterrupt

        old: dict[int, Any] = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            # not the main thread (tests drive the runner from threads): no signal handling
            with contextlib.suppress(ValueError):
                old[sig] = signal.signal(sig, stop)
        return old

    def stop_for(self, reason: str, more: str = "") -> None:
        """Stop after a final, aligned checkpoint whose sinks committed (a stop signal, or
        ``eosflow savepoint --stop``), waiting at most ``--stop-timeout``."""
        if self.stopping is not None:
            return
        self.stopping = reason
        self._stop_deadline = time.monotonic() + self.options.stop_timeout
        self._stop_next_say = time.monotonic() + 10.0
        self._say(
            f"{reason}: stopping after a final checkpoint (waiting at most "
            f"{self.options.stop_timeout:g}s{more})"
        )

    def _restore_signals(self, old: dict[int, Any]) -> None:
        for sig, handler in old.items():
            signal.signal(sig, handler)

    def _without_final(self) -> str:
        last = self.coordinator.stats.last_completed if hasattr(self, "coordinator") else 0
        return (
            "stopping without the final checkpoint; nothing is lost or duplicated: the output "
            f"since checkpoint {last} is not committed, and the next run of this job resumes "
            f"from checkpoint {last}"
        )

    def _check_stop(self) -> None:
        """A stop whose final checkpoint cannot complete ends after ``stop_timeout``, saying
        why, instead of waiting for ever."""
        if self.stopping is None:
            return
        now = time.monotonic()
        if now >= self._stop_deadline:
            pending = self.coordinator.pending
            missing = sorted(self.coordinator.tasks - set(pending.acks)) if pending else []
            waiting = f"; no ack from {missing}" if missing else ""
            last = f" (last restart: {self.restart_causes[-1]})" if self.restart_causes else ""
            raise JobFailed(
                f"{self.stopping}: the final checkpoint did not complete within "
                f"--stop-timeout {self.options.stop_timeout:g}s{waiting}{last}: "
                f"{self._without_final()}"
            )
        if now >= self._stop_next_say:
            self._stop_next_say = now + 10.0
            self._say(
                f"{self.stopping}: still waiting for the final checkpoint "
                f"({self._stop_deadline - now:.0f}s left)"
            )

    # -- restarts --------------------------------------------------------------------------------

    def _check_budget(self, cause: str) -> None:
        """Raises :class:`JobFailed` when restarting cannot help or was tried too often."""
        now = time.monotonic()
        window = self.options.restart_window
        self._restart_times = [t for t in self._restart_times if now - t < window] + [now]
        causes = self.restart_causes
        deterministic = any(kind in cause for kind in _DETERMINISTIC)
        if deterministic and len(causes) >= 2 and same_kind(causes[-2], cause):
            raise JobFailed(
                f"job {self.job!r}: the same failure again after a restart, so restarting "
                f"cannot fix it: {cause}. Worker logs: {self.dir}/worker-*.log"
            )
        latest = self.store.latest_completed(self.job)
        done = latest.checkpoint_id if latest is not None else 0
        since = self._stalled[1] + 1 if self._stalled[0] == done and self.restarts > 1 else 1
        self._stalled = (done, since)
        if since > self.options.max_restarts:
            raise JobFailed(
                f"job {self.job!r} failed: {since} restarts in a row completed no checkpoint "
                f"(at most --max-restarts {self.options.max_restarts}); restarting does not "
                f"help: {cause}. Worker logs: {self.dir}/worker-*.log"
            )
        if len(self._restart_times) > self.options.max_restarts:
            raise JobFailed(
                f"job {self.job!r} failed: {len(self._restart_times)} restarts within "
                f"{window:g}s (at most --max-restarts {self.options.max_restarts} per "
                f"--restart-window {window:g}s); last cause: {cause}. "
                f"Worker logs: {self.dir}/worker-*.log"
            )

    def restart_count(self) -> str:
        """``n/max`` as the budget counts it: the larger of the restarts in the window and
        those in a row without a completed checkpoint (what the log line shows)."""
        counted = max(len(self._restart_times), self._stalled[1])
        return f"{counted}/{self.options.max_restarts}"

    def _backoff(self) -> float:
        """Exponential in the restarts of the current window, capped at ``max_backoff``."""
        recent = max(1, len(self._restart_times))
        return float(
            min(self.options.max_backoff, self.options.restart_backoff * 2 ** min(recent - 1, 8))
        )
