"""How a run ends: :class:`StopController` (stop signals, the final checkpoint and its bounded
wait) and :class:`RestartBudget` (the restart strategy: when the runner gives up). Each is a
collaborator of :class:`~processor.runtime.supervision.runner.Runner` with its own state, built from
the run's options and testable alone (a manual ``clock``).

Stopping (SIGINT / SIGTERM): the first signal asks for a final, aligned checkpoint and waits
for it to commit, at most ``--stop-timeout``; it says so, and says every 10 s what it waits
for. When the time is up (a worker keeps failing, a sink cannot commit), or on a second signal,
the runner stops without it: nothing is lost or duplicated, the output since the last completed
checkpoint is simply not committed, and the next run resumes from that checkpoint. A bounded
run (``--until-idle``) takes the same final checkpoint once every worker drained its sources;
a run ends when every task reported its sinks' commit of it, or fails after ``--stop-timeout``
naming the tasks that did not.

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
from collections.abc import Callable, Set
from pathlib import Path
from typing import Any

from processor.runtime.job import JobFailed, RunOptions

__all__ = ["RestartBudget", "StopController", "collapse_causes", "same_cause", "same_kind"]

#: Worker numbers in a cause: "the same" failure whichever worker hit it first.
_WORKER_N = re.compile(r"\bworker[ =]\d+")
#: Failures that happen again the same way after a restart: a user function raising on a
#: record, records that are gone or positions that no longer exist on the broker.
_DETERMINISTIC = ("UserFunctionError", "DataLossError")
#: And a configuration that workers which all started refuse (a sink's output directory holding
#: another run's part files: it restarted 10 times over 60 s with backoff before failing).
#: Before the workers all started, :data:`MAX_UNSTARTED` applies instead.
_REFUSED = "ConfigError"
#: The same failure this many times in a row before the workers all started is a configuration
#: or environment problem, not bad luck: fail instead of spending the restart budget on it.
MAX_UNSTARTED = 3

_NUMBER = re.compile(r"\d+")


def same_cause(a: str, b: str) -> bool:
    return _WORKER_N.sub("worker", a) == _WORKER_N.sub("worker", b)


def same_kind(a: str, b: str) -> bool:
    """The same failure up to its numbers: which worker, partition or offset hit it first
    varies from one generation to the next (the workers race), what failed does not."""
    return _NUMBER.sub("N", a) == _NUMBER.sub("N", b)


def collapse_causes(causes: list[str], times_ms: list[int]) -> list[dict[str, Any]]:
    """Restart causes with the same failure (:func:`same_kind`) shown once: ``{"cause": the
    latest text, "count", "first_ms", "last_ms"}``, in the order each first came. A job that
    failed after 11 restarts showed the same 900-character cause 10 times (issue 37)."""
    found: list[dict[str, Any]] = []
    for cause, at in zip(causes, times_ms, strict=True):
        same = next((f for f in found if same_kind(f["cause"], cause)), None)
        if same is None:
            found.append({"cause": cause, "count": 1, "first_ms": at, "last_ms": at})
        else:
            same.update(cause=cause, count=same["count"] + 1, last_ms=at)
    return found


def _clock_time(ms: int) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ms / 1000))


def describe_cause(entry: dict[str, Any]) -> str:
    """One collapsed cause as a line: ``10 times (12:00:01 to 12:04:09): CAUSE``."""
    if entry["count"] == 1:
        return f"{_clock_time(entry['first_ms'])}: {entry['cause']}"
    span = f"{_clock_time(entry['first_ms'])} to {_clock_time(entry['last_ms'])}"
    return f"{entry['count']} times ({span}): {entry['cause']}"


class StopController:
    """A stop request and the final checkpoint that ends a run.

    ``options`` is read as the run goes (``stop_timeout``, ``until_idle``); ``say`` writes a
    progress line; ``last_completed()`` is the latest completed checkpoint (0 before the
    coordinator exists), named when the run stops without its final checkpoint.

    The runner's loop asks :meth:`wants_final` whether to trigger the final checkpoint, records
    it with :meth:`final_triggered`, reports each task's commit to :meth:`on_committed`, and
    ends when :meth:`final_committed`; :meth:`check_deadline` bounds a stop's wait. A restart
    forgets the final checkpoint (:meth:`restarted`): the new generation takes another.
    """

    def __init__(
        self,
        job: str,
        options: RunOptions,
        *,
        say: Callable[[str], None],
        last_completed: Callable[[], int],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.job = job
        self.options = options
        self._say = say
        self._last_completed = last_completed
        self._clock = clock
        #: Why the run stops (a signal's name, ``savepoint --stop``); ``None``: not stopping.
        self.stopping: str | None = None
        self._deadline = self._next_say = 0.0
        #: The final checkpoint's id once triggered.
        self.final: int | None = None
        self._final_completed_at: float | None = None
        #: The tasks that reported their sinks' commit, by checkpoint.
        self.committed: dict[int, set[str]] = {}
        self._signalled = False  # a stop signal came (a second one stops at once)
        #: The run ended (its clean-up runs): a stop signal now changes nothing (Kubernetes
        #: sends SIGTERM to a runner that ``--takeover`` stopped, often as it exits).
        self.ended = False

    # -- stop requests ---------------------------------------------------------------------------

    def install_signals(self) -> dict[int, Any]:
        """SIGINT/SIGTERM: the first stops after a final checkpoint (a stop for a savepoint
        already does), a second at once; once the run :attr:`ended`, none changes anything.
        Returns the handlers replaced, for :meth:`restore_signals`."""

        def stop(signum: int, _frame: Any) -> None:
            name = signal.Signals(signum).name
            if self.ended:
                self._say(f"{name}: the job has stopped; its runner exits")
            elif self.stopping is None:
                self._signalled = True
                self.stop_for(name, f"; {name} again stops at once without it")
            elif not self._signalled:  # stopping for a savepoint: the same final checkpoint
                self._signalled = True
                self._say(
                    f"{name}: stopping already ({self.stopping}) after a final checkpoint; "
                    f"{name} again stops at once without it"
                )
            else:
                self._say(f"{name} again: {self.without_final()}")
                raise KeyboardInterrupt

        old: dict[int, Any] = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            # not the main thread (tests drive the runner from threads): no signal handling
            with contextlib.suppress(ValueError):
                old[sig] = signal.signal(sig, stop)
        return old

    @staticmethod
    def restore_signals(old: dict[int, Any]) -> None:
        for sig, handler in old.items():
            signal.signal(sig, handler)

    def stop_for(self, reason: str, more: str = "") -> None:
        """Stop after a final, aligned checkpoint whose sinks committed (a stop signal, or
        ``eosflow savepoint --stop``), waiting at most ``--stop-timeout``."""
        if self.stopping is not None:
            return
        self.stopping = reason
        now = self._clock()
        self._deadline = now + self.options.stop_timeout
        self._next_say = now + 10.0
        self._say(
            f"{reason}: stopping after a final checkpoint (waiting at most "
            f"{self.options.stop_timeout:g}s{more})"
        )

    def without_final(self) -> str:
        last = self._last_completed()
        return (
            "stopping without the final checkpoint; nothing is lost or duplicated: the output "
            f"since checkpoint {last} is not committed, and the next run of this job resumes "
            f"from checkpoint {last}"
        )

    def check_deadline(self, unacked: list[str], last_cause: str | None) -> None:
        """A stop whose final checkpoint cannot complete ends after ``stop_timeout``, saying
        why (``unacked``: the tasks the pending checkpoint waits for; ``last_cause``: of the
        last restart), instead of waiting for ever; every 10 s it says what it waits for."""
        if self.stopping is None:
            return
        now = self._clock()
        if now >= self._deadline:
            waiting = f"; no ack from {unacked}" if unacked else ""
            last = f" (last restart: {last_cause})" if last_cause is not None else ""
            raise JobFailed(
                f"{self.stopping}: the final checkpoint did not complete within "
                f"--stop-timeout {self.options.stop_timeout:g}s{waiting}{last}: "
                f"{self.without_final()}"
            )
        if now >= self._next_say:
            self._next_say = now + 10.0
            self._say(
                f"{self.stopping}: still waiting for the final checkpoint "
                f"({self._deadline - now:.0f}s left)"
            )

    # -- the final checkpoint --------------------------------------------------------------------

    def wants_final(self, drained: bool) -> bool:
        """A final checkpoint is due: a stop was asked for, or a bounded run's workers all
        ``drained`` their sources."""
        return self.stopping is not None or (self.options.until_idle and drained)

    def final_triggered(self, checkpoint_id: int | None) -> None:
        self.final = checkpoint_id

    def retry_final(self) -> None:
        """The final checkpoint was aborted, or did not prove the job idle: take another."""
        self.final = None

    def restarted(self) -> None:
        """A new generation (or a restarted worker) takes a new final checkpoint."""
        self.final = None
        self.committed.clear()

    def on_committed(self, checkpoint_id: int, task: str) -> None:
        self.committed.setdefault(checkpoint_id, set()).add(task)

    def final_committed(self, tasks: Set[str], last_completed: int) -> bool:
        """Every task of ``tasks`` reported its sinks' commit of the final checkpoint.

        Raises:
            JobFailed: the final checkpoint completed (``last_completed``), but a task did not
                report its commit within ``stop_timeout``.
        """
        if self.final is None:
            return False
        done = self.committed.get(self.final, set())
        if len(done) < len(tasks):
            self._check_final_commit(done, tasks, last_completed)
            return False
        self._final_completed_at = None
        return True

    def _check_final_commit(self, done: set[str], tasks: Set[str], last_completed: int) -> None:
        """The final checkpoint completed, but not every task reported its sinks' commit:
        wait at most ``stop_timeout``, then fail saying which tasks, instead of hanging while
        heartbeats keep flowing (issue 35: a PostgreSQL ``COMMIT PREPARED`` stuck for ever
        held ``--until-idle`` with no message). Nothing is lost: the checkpoint completed, and
        the next run commits what it left pending."""
        if last_completed != self.final:
            self._final_completed_at = None
            return
        now = self._clock()
        if self._final_completed_at is None:
            self._final_completed_at = now
        elif now - self._final_completed_at > self.options.stop_timeout:
            missing = sorted(set(tasks) - done)
            raise JobFailed(
                f"job {self.job!r}: final checkpoint {self.final} completed, but tasks "
                f"{missing} did not report their sinks' commit within --stop-timeout "
                f"{self.options.stop_timeout:g}s (a sink's database or broker does not "
                "answer; see worker-*.log). Nothing is lost: the next run commits it"
            )


class RestartBudget:
    """The restart strategy: counts the restarts and their causes, decides when restarting
    cannot help or was tried too often (:class:`JobFailed`), and how long to back off.

    ``options``: ``max_restarts``, ``restart_window``, ``restart_backoff``, ``max_backoff``;
    ``logs``: the job's directory, named in the messages (its ``worker-*.log``).
    """

    def __init__(
        self,
        job: str,
        options: RunOptions,
        logs: Path,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.job = job
        self.options = options
        self.logs = logs
        self._clock = clock
        self.restarts = 0
        self.causes: list[str] = []
        #: When each cause came (epoch ms), for :meth:`collapsed`.
        self.times_ms: list[int] = []
        self._wall = time.time
        self._times: list[float] = []  # of the restarts within the window
        self._stalled = (0, 0)  # (latest completed checkpoint at the last restart, restarts since)
        self._unstarted = 0  # consecutive generations that failed before every worker connected

    @property
    def last_cause(self) -> str | None:
        return self.causes[-1] if self.causes else None

    def count(self, cause: str) -> None:
        """A restart for ``cause`` begins."""
        self.restarts += 1
        self.causes.append(cause)
        self.times_ms.append(int(self._wall() * 1000))

    def collapsed(self) -> list[dict[str, Any]]:
        """The causes so far, each failure once with its count (:func:`collapse_causes`)."""
        return collapse_causes(self.causes, self.times_ms)

    def repeats(self, cause: str) -> int:
        """How many times in a row, up to ``cause`` (the latest), the same failure came."""
        n = 0
        for earlier in reversed(self.causes):
            if not same_kind(earlier, cause):
                break
            n += 1
        return n

    def said(self, cause: str) -> str:
        """``cause`` as the progress line says it: once, then ``the same failure again (N in
        a row)`` while it repeats (the full text is in status.json and the worker logs)."""
        n = self.repeats(cause)
        if n <= 1:
            return cause
        short = cause if len(cause) <= 120 else cause[:120] + "…"
        return f"the same failure again ({n} in a row): {short}"

    def _history(self, cause: str) -> str:
        """What a failure message adds after the last ``cause``: how often it came, and the
        other failures of the run, each once (not the same text ten times)."""
        entries = self.collapsed()
        text = ""
        last = next((e for e in entries if same_kind(e["cause"], cause)), None)
        if last is not None and last["count"] > 1:
            span = f"{_clock_time(last['first_ms'])} to {_clock_time(last['last_ms'])}"
            text += f" [this failure {last['count']} times, {span}]"
        others = [e for e in entries if e is not last]
        if others:
            shown = "; ".join(
                f"{e['count']} times: {e['cause'][:200]}{'…' if len(e['cause']) > 200 else ''}"
                for e in others[-3:]
            )
            text += f" [other restart causes: {shown}]"
        return text

    def check_start(self, cause: str, started: bool) -> None:
        """Raises :class:`JobFailed` when the same failure came :data:`MAX_UNSTARTED` times in a
        row before the generation's workers all ``started`` (said hello)."""
        self._unstarted = 0 if started else self._unstarted + 1
        # "The same" failure whichever worker hit it first.
        recent = self.causes[-MAX_UNSTARTED:]
        if self._unstarted >= MAX_UNSTARTED and all(same_cause(c, cause) for c in recent):
            raise JobFailed(
                f"job {self.job!r}: the workers failed {MAX_UNSTARTED} times in a row before "
                f"they all started, each time with: {cause}. Worker logs: {self.logs}/worker-*.log"
            )

    def check(self, cause: str, completed: int) -> None:
        """Raises :class:`JobFailed` when restarting cannot help or was tried too often;
        ``completed``: the latest completed checkpoint (0: none)."""
        now = self._clock()
        window = self.options.restart_window
        self._times = [t for t in self._times if now - t < window] + [now]
        causes = self.causes
        deterministic = any(kind in cause for kind in _DETERMINISTIC) or (
            _REFUSED in cause and self._unstarted == 0
        )
        if deterministic and len(causes) >= 2 and same_kind(causes[-2], cause):
            raise JobFailed(
                f"job {self.job!r}: the same failure again after a restart, so restarting "
                f"cannot fix it: {cause}{self._history(cause)}. "
                f"Worker logs: {self.logs}/worker-*.log"
            )
        since = self._stalled[1] + 1 if self._stalled[0] == completed and self.restarts > 1 else 1
        self._stalled = (completed, since)
        if since > self.options.max_restarts:
            raise JobFailed(
                f"job {self.job!r} failed: {since} restarts in a row completed no checkpoint "
                f"(at most --max-restarts {self.options.max_restarts}); restarting does not "
                f"help: {cause}{self._history(cause)}. Worker logs: {self.logs}/worker-*.log"
            )
        if len(self._times) > self.options.max_restarts:
            raise JobFailed(
                f"job {self.job!r} failed: {len(self._times)} restarts within "
                f"{window:g}s (at most --max-restarts {self.options.max_restarts} per "
                f"--restart-window {window:g}s); last cause: {cause}{self._history(cause)}. "
                f"Worker logs: {self.logs}/worker-*.log"
            )

    def restart_count(self) -> str:
        """``n/max`` as the budget counts it: the larger of the restarts in the window and
        those in a row without a completed checkpoint (what the log line shows)."""
        counted = max(len(self._times), self._stalled[1])
        return f"{counted}/{self.options.max_restarts}"

    def backoff(self) -> float:
        """How long to wait before the restart just counted: none for the first one in the
        window, then ``restart_backoff`` doubling with each further one, capped at
        ``max_backoff``.

        A single failure (a worker killed by the OOM killer, a lost machine) restarts at once:
        the stopped workers were reaped, so nothing of theirs can write, and the wait was all
        of the 0.5 s between a worker's death and its replacement's spawn (bench/RESULTS.md,
        "Recovery on Apache Kafka (issue 38)"). Failures that keep coming back off as before,
        one restart later.
        """
        recent = len(self._times)
        if recent <= 1:
            return 0.0
        return float(
            min(self.options.max_backoff, self.options.restart_backoff * 2 ** min(recent - 2, 8))
        )
