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
from processor.runtime.observe.webui import WebServer
from processor.runtime.supervision.lifecycle import RestartBudget

__all__ = ["Reporter"]


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
    ) -> None:
        self.job, self.dir, self.options, self.runner = job, run_dir, options, runner
        self.current, self.budget, self.snapshot_url = current, budget, snapshot_url
        self._clock = clock
        self._started = clock()
        self._progress_next = 0.0
        self._last_in = (0.0, 0)
        self._publish_next = 0.0
        #: Seconds from the start to every worker connected, and to the final checkpoint's
        #: trigger (``RunResult.ready_s``, ``final_trigger_s``).
        self.ready_s: float | None = None
        self.final_trigger_s: float | None = None
        self._plan: Plan | None = None
        self._coordinator: CheckpointCoordinator | None = None
        self.metrics: JobMetrics | None = None
        self.web: WebServer | None = None

    def open(
        self,
        plan: Plan,
        coordinator: CheckpointCoordinator,
        metrics: JobMetrics | None,
        web: WebServer | None,
    ) -> None:
        self._plan, self._coordinator, self.metrics, self.web = plan, coordinator, metrics, web

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
        """Records read by source tasks, handed to sinks, source lag."""
        sources = {s.name for s in self.plan.stages if s.sources}
        rin = out = lag = 0
        for w in self.current.workers:
            for task, st in w.stats.items():
                stage = task.rsplit(".", 1)[0]
                if stage in sources:
                    rin += int(st["in"])
                    lag += int(st["lag"])
                out += int(st["sunk"])
        return rin, out, lag

    def _bad_counts(self) -> tuple[int, int, int, int]:
        """Dead letters routed, bad records skipped, duplicates dropped (``dedup`` steps) and
        records dropped from loops over ``max_iterations``, over every task of this generation."""
        keys = ("dead", "bad", "dups", "loop_limit")
        totals = [
            sum(int(st.get(k, 0)) for w in self.current.workers for st in w.stats.values())
            for k in keys
        ]
        return totals[0], totals[1], totals[2], totals[3]

    def say(self, text: str) -> None:
        if self.options.progress is not None:
            elapsed = self._clock() - self._started
            print(f"[{elapsed:7.1f}s] {self.job}: {text}", file=self.options.progress, flush=True)

    def report(self, force: bool = False) -> None:
        now = self._clock()
        if not force and now < self._progress_next:
            return
        self._progress_next = now + self.options.progress_every
        rin, out, lag = self.counters()
        then, before = self._last_in
        rate = (rin - before) / (now - then) if now > then and rin >= before else 0.0
        self._last_in = (now, rin)
        st = self.coordinator.stats
        lag_text = f" lag={lag:,}" if self.options.until_idle else ""
        dead, bad, dups, over = self._bad_counts()
        lag_text += (f" dead={dead:,}" if dead else "") + (f" skipped={bad:,}" if bad else "")
        lag_text += f" duplicates={dups:,}" if dups else ""
        lag_text += f" over_max_iterations={over:,}" if over else ""
        loop_text = f", loop log {st.last_loop_log:,}" if self.plan.cyclic else ""
        self.say(
            f"gen={self.current.number} in={rin:,} ({rate:,.0f}/s) out={out:,}{lag_text} "
            f"checkpoint={st.last_completed} ({st.last_duration_s * 1000:.0f} ms{loop_text}) "
            f"restarts={self.budget.restarts}{watermarks.progress_text(self._watermarks())}"
        )
        self.status("running")

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
        dead, bad, dups, over = self._bad_counts()
        st = self.coordinator.stats
        status: dict[str, Any] = {
            "job": self.job,
            "state": state,
            "pid": os.getpid(),
            "updated_ms": int(time.time() * 1000),
            "uptime_s": round(self._clock() - self._started, 1),
            "generation": self.current.number,
            "restarts": self.budget.restarts,
            "restart_causes": self.budget.causes[-10:],
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
                "pending": self.coordinator.pending.checkpoint_id
                if self.coordinator.pending
                else None,
            },
            "records_in": rin,
            "records_out": out,
            "source_lag": lag,
            "dead_letters": dead,
            "bad_records_skipped": bad,
            "duplicates_dropped": dups,
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
            seconds=self._clock() - self._started,
            restart_causes=list(self.budget.causes),
            checkpoint_durations=list(st.durations),
            loop_logs=list(st.loop_logs),
            ready_s=self.ready_s if self.ready_s is not None else float("nan"),
            final_trigger_s=(
                self.final_trigger_s if self.final_trigger_s is not None else float("nan")
            ),
        )
