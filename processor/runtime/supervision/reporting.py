"""What a running job tells its user: the progress line, ``status.json``, the snapshot the
metrics and the job page publish, and the :class:`~processor.runtime.job.RunResult`.

:class:`Reporter` is a collaborator of :class:`~processor.runtime.supervision.runner.Runner`: it
reads the counters the workers send on the control plane (their handles in the current
:class:`~processor.runtime.job.Generation`), the restart budget's counts and the coordinator's
statistics, and writes nothing anywhere else (supervision decides, reporting only tells).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from processor.compiler import Plan
from processor.runtime.checkpoints.coordinator import CheckpointCoordinator
from processor.runtime.job import Generation, RunOptions, RunResult
from processor.runtime.observe import archive, watermarks
from processor.runtime.observe.metrics import JobMetrics
from processor.runtime.observe.tally import Tally, describe_waits, waits
from processor.runtime.observe.webui import WebServer
from processor.runtime.supervision.lifecycle import RestartBudget
from processor.runtime.supervision.startup import StartTimes

__all__ = ["Reporter"]

#: The progress line's rate covers at least the last this many seconds: the workers send their
#: counters once a second, so a rate over one progress interval jumped by up to half of it.
_RATE_WINDOW_S = 5.0
#: ...and never less than this: the final report came 0.05 s after the previous one with the
#: workers' last second of counters, and a ``--max-rate 1500`` run showed ``(13,441/s)``.
_RATE_MIN_S = 0.5


class Reporter:
    """The progress line, ``status.json``, the published metrics snapshot and the run's result.

    Built with the runner (``runner``: its name; ``current``: the generation whose workers it
    counts; ``budget``: the restarts), it can :meth:`say` at once; :meth:`open` gives it what
    the run builds later: the compiled plan, the coordinator, the metrics and the job page.
    """

    def __init__(
        self,
        job: str,
        run_dir: Path,
        options: RunOptions,
        *,
        runner: str,
        current: Generation,
        budget: RestartBudget,
        snapshot_url: str,
        clock: Callable[[], float] = time.monotonic,
        start: StartTimes | None = None,
    ) -> None:
        self.job, self.dir, self.options, self.runner = job, run_dir, options, runner
        #: where the start went (``status.json``'s ``startup``; the runner marks it)
        self.start = start if start is not None else StartTimes(clock)
        self.current, self.budget, self.snapshot_url = current, budget, snapshot_url
        self._clock = clock
        self._started = clock()
        self._progress_next = 0.0
        self._rates: list[tuple[float, int]] = []  # (when, records in) of the recent reports
        self._rate = 0.0
        self._publish_next = 0.0
        #: Seconds from the start to every worker connected, and to the final checkpoint's
        #: trigger (``RunResult.ready_s``, ``final_trigger_s``).
        self.ready_s: float | None = None
        self.final_trigger_s: float | None = None
        self._plan: Plan | None = None
        self._coordinator: CheckpointCoordinator | None = None
        self.metrics: JobMetrics | None = None
        self.web: WebServer | None = None
        self._tally: Tally | None = None

    def open(
        self,
        plan: Plan,
        coordinator: CheckpointCoordinator,
        metrics: JobMetrics | None,
        web: WebServer | None,
        tally: Tally | None = None,
    ) -> None:
        """``tally``: the run's counters (default: the metrics', else a new one)."""
        self._plan, self._coordinator, self.metrics, self.web = plan, coordinator, metrics, web
        if tally is None:
            tally = metrics.tally if metrics is not None else Tally(plan)
        self._tally = tally

    @property
    def tally(self) -> Tally:
        assert self._tally is not None, "Reporter.open first"
        return self._tally

    @property
    def opened(self) -> bool:
        """:meth:`open` was called: the status can be written."""
        return self._coordinator is not None

    @property
    def plan(self) -> Plan:
        assert self._plan is not None, "Reporter.open first"
        return self._plan

    @property
    def coordinator(self) -> CheckpointCoordinator:
        assert self._coordinator is not None, "Reporter.open first"
        return self._coordinator

    def mark_ready(self) -> None:
        """Every worker of the generation connected (the first time counts)."""
        if self.ready_s is None:
            self.ready_s = self._clock() - self._started

    def mark_final_trigger(self) -> None:
        self.final_trigger_s = self._clock() - self._started

    def counters(self) -> tuple[int, int, int]:
        """Records read by source tasks (re-reads after restarts included) and handed to
        sinks (at least those committed) over every generation of the run, and the source lag
        now
        (:class:`~processor.runtime.observe.tally.Tally`)."""
        totals = self.tally.totals()
        # The counters come once a second (and a killed worker's last second never), the
        # committed records with each completed checkpoint: what was committed was handed to
        # the sinks, so that is the lower bound shown (never committed > to_sinks).
        sunk = max(totals["sunk"], self.coordinator.stats.committed_records)
        return totals["in"], sunk, self.tally.source_lag(self.current.workers)

    def _bad_counts(self) -> tuple[int, int, int, int, int]:
        """Dead letters routed, bad records skipped, duplicates dropped (``dedup`` steps),
        records dropped from loops over ``max_iterations`` and re-emitted copies local
        recovery's replay check dropped, over every worker process of the run."""
        t = self.tally.totals()
        return t["dead"], t["bad"], t["dups"], t["loop_limit"], t["replayed"]

    def waits(self) -> list[dict[str, Any]]:
        """What the workers wait on, the longest first (:func:`~.tally.waits`)."""
        return waits(self.current.workers, self._clock())

    def _rate_now(self, now: float, rin: int) -> float:
        """Records in per second over the last :data:`_RATE_WINDOW_S` (at least
        :data:`_RATE_MIN_S`: over a shorter span, the previous rate stands)."""
        rates = self._rates
        rates.append((now, rin))
        while len(rates) > 2 and now - rates[1][0] >= _RATE_WINDOW_S:
            rates.pop(0)
        then, before = rates[0]
        if now - then >= _RATE_MIN_S:
            self._rate = max(0, rin - before) / (now - then)
        return self._rate

    def average_rate(self, rin: int) -> float:
        """Records in per second since every worker connected (the run's average)."""
        began = self.ready_s if self.ready_s is not None else 0.0
        spent = self._clock() - self._started - began
        return rin / spent if spent >= _RATE_MIN_S else 0.0

    def say(self, text: str) -> None:
        if self.options.progress is not None:
            elapsed = self._clock() - self._started
            print(f"[{elapsed:7.1f}s] {self.job}: {text}", file=self.options.progress, flush=True)

    def report(self, force: bool = False, final: bool = False) -> None:
        """The progress line (every ``progress_every``; ``force``: now) and status.json. The
        rate is over the last few seconds; the ``final`` line gives the run's average."""
        now = self._clock()
        if not force and now < self._progress_next:
            return
        self._progress_next = now + self.options.progress_every
        rin, out, lag = self.counters()
        rate = self._rate_now(now, rin)
        rate_text = f"{self.average_rate(rin):,.0f}/s average" if final else f"{rate:,.0f}/s"
        st = self.coordinator.stats
        lag_text = f" lag={lag:,}" if self._lag_known() else " lag=?"
        dead, bad, dups, over, replayed = self._bad_counts()
        lag_text += (f" dead={dead:,}" if dead else "") + (f" skipped={bad:,}" if bad else "")
        lag_text += f" dups_dropped={dups:,}" if dups else ""
        lag_text += f" copies_dropped={replayed:,}" if replayed else ""
        lag_text += f" over_max_iterations={over:,}" if over else ""
        loop_text = f", loop log {st.last_loop_log:,}" if self.plan.cyclic else ""
        self.say(
            f"gen={self.current.number} read={rin:,} ({rate_text}) to_sinks={out:,} "
            f"committed={st.committed_records:,}{lag_text} "
            f"checkpoint={st.last_completed} ({st.last_duration_s * 1000:.0f} ms{loop_text}) "
            f"restarts={self.budget.restarts}{watermarks.progress_text(self._watermarks())}"
            f"{_waiting_text(self.waits())}{self._pending_text()}"
        )
        self.status("running")

    def _lag_known(self) -> bool:
        """Every worker of this generation reported its readers' lag: right after a start or
        a restart none did yet, and the lag is unknown, not 0."""
        return all(w.stats for w in self.current.workers)

    def _pending_text(self) -> str:
        """`` pending=7 for 12 s (no ack from totals.0, totals.1)`` when a checkpoint has been
        pending for :data:`_PENDING_SHOWN_S` or more (a barrier or a commit that does not get
        through: a stalled broker, an operator stuck in user code), else nothing."""
        pending = self._pending()
        if pending is None or pending[1] < _PENDING_SHOWN_S:
            return ""
        chk, age, missing = pending
        shown = ", ".join(missing[:4]) + (
            f" (+{len(missing) - 4} more)" if len(missing) > 4 else ""
        )
        return f" pending={chk} for {age:.0f} s (no ack from {shown})"

    def _pending(self) -> tuple[int, float, list[str]] | None:
        """The pending checkpoint: its id, seconds since its trigger, the tasks whose ack it
        lacks (``None``: none pending)."""
        coordinator = self.coordinator
        pending = coordinator.pending
        if pending is None:
            return None
        age = coordinator.clock() - pending.started
        return pending.checkpoint_id, age, sorted(coordinator.tasks - set(pending.acks))

    def publish(self, state: str = "running", force: bool = False) -> None:
        """The metrics' snapshot (at most every half second): what scrapes and the job page
        read (:mod:`processor.runtime.observe.metrics`)."""
        now = self._clock()
        if self.metrics is None or (not force and now < self._publish_next):
            return
        self._publish_next = now + 0.5
        self.metrics.update(self._status_dict(state), self.current.workers, state)

    def status(self, state: str) -> None:
        status = self._status_dict(state)
        if self.metrics is not None:  # the same snapshot: no _publish for the next half second
            self.metrics.update(status, self.current.workers, state)
            self._publish_next = self._clock() + 0.5
        path = self.dir / "status.json"
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".status-")
        with os.fdopen(fd, "w") as f:
            json.dump(status, f, indent=1)
        os.replace(tmp, path)
        if self.metrics is not None:  # the page of the run, kept for `eosflow status --web`
            archive.write_page(self.dir, self.metrics.snapshot.api)

    def _watermarks(self) -> dict[str, Any]:
        """The watermarks' summary (:mod:`processor.runtime.observe.watermarks`)."""
        tasks = {k: v for w in self.current.workers for k, v in w.stats.items()}
        return watermarks.summarize(self.plan, tasks)

    def _status_dict(self, state: str) -> dict[str, Any]:
        rin, out, lag = self.counters()
        dead, bad, dups, over, replayed = self._bad_counts()
        st = self.coordinator.stats
        pending = self._pending()
        status: dict[str, Any] = {
            "job": self.job,
            "state": state,
            "pid": os.getpid(),
            "updated_ms": int(time.time() * 1000),
            "uptime_s": round(self._clock() - self._started, 1),
            "startup": self.start.as_dict(),
            "generation": self.current.number,
            "restarts": self.budget.restarts,
            # each failure once, with its count and first/last time (not the same cause 10x)
            "restart_causes": self.budget.collapsed()[-10:],
            "mode": self.options.mode,
            "runner": self.runner,
            "workers": [
                {"worker": w.index, "pid": w.pid, "host": w.host, "connected": w.conn is not None}
                for w in self.current.workers
            ],
            "checkpoint": {
                "last_completed": st.last_completed,
                "last_duration_ms": int(st.last_duration_s * 1000),
                "completed": st.completed,
                "aborted": st.aborted,
                "failed": dict(st.failed),  # by kind: timeout, declined, restart
                # the pending one, how long it has been pending and whose ack it lacks (a
                # stall shows here)
                "pending": pending[0] if pending else None,
                "pending_s": round(pending[1], 1) if pending else None,
                "pending_missing": pending[2] if pending else [],
            },
            # read by the sources and handed to the sinks, re-reads and re-writes after
            # restarts included; committed: each epoch once, when its checkpoint completed
            "records_in": rin,
            "records_out": out,
            "records_committed": st.committed_records,
            "source_lag": lag,
            "waiting": self.waits(),
            "dead_letters": dead,
            "bad_records_skipped": bad,
            "duplicates_dropped": dups,
            # local recovery: a restarted worker's re-emitted copies its readers dropped
            "replay_copies_dropped": replayed,
            "over_max_iterations": over,
            "last_loop_log": st.last_loop_log,
            "tasks": {k: v for w in self.current.workers for k, v in w.stats.items()},
            "watermarks": self._watermarks(),
            "snapshot_url": self.snapshot_url,
            "web": self.web.url if self.web is not None else None,
        }
        return status

    def result(self) -> RunResult:
        rin, out, _ = self.counters()
        st = self.coordinator.stats
        return RunResult(
            job=self.job,
            generation=self.current.number,
            restarts=self.budget.restarts,
            checkpoints=st.completed,
            last_checkpoint=st.last_completed,
            records_in=rin,
            records_out=out,
            records_committed=st.committed_records,
            seconds=self._clock() - self._started,
            restart_causes=list(self.budget.causes),
            checkpoint_durations=list(st.durations),
            loop_logs=list(st.loop_logs),
            peak_checkpoint_bytes=st.peak_size_bytes,
            ready_s=self.ready_s if self.ready_s is not None else float("nan"),
            final_trigger_s=(
                self.final_trigger_s if self.final_trigger_s is not None else float("nan")
            ),
        )


#: A checkpoint pending longer than this is named on the progress line, with what it waits for.
_PENDING_SHOWN_S = 5.0


def _waiting_text(found: list[dict[str, Any]]) -> str:
    text = describe_waits(found)
    return f" {text}" if text else ""
