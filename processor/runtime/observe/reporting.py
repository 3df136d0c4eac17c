"""What a running job tells its user: the progress line, ``status.json`` and the
:class:`~processor.runtime.job.RunResult`.

:class:`RunnerReporting` is the reporting half of
:class:`~processor.runtime.supervision.runner.Runner`: it reads the counters the workers send on the
control plane and the coordinator's statistics, and writes nothing anywhere else (supervision
decides, reporting only tells).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from processor.compiler import Plan
from processor.runtime.checkpoints.coordinator import CheckpointCoordinator
from processor.runtime.job import RunOptions, RunResult, WorkerHandle
from processor.runtime.observe.metrics import JobMetrics
from processor.runtime.observe.webui import WebServer
from processor.snapshot.store import SnapshotStore

__all__ = ["RunnerReporting"]


class RunnerReporting:
    """The progress line, ``status.json`` and the run's result, for a runner."""

    runner: str
    job: str
    dir: Path
    plan: Plan
    options: RunOptions
    store: SnapshotStore
    coordinator: CheckpointCoordinator
    workers: list[WorkerHandle]
    generation: int
    restarts: int
    restart_causes: list[str]
    ready_s: float | None
    final_trigger_s: float | None
    _started: float
    _progress_next: float
    _last_in: tuple[float, int]
    _publish_next: float
    metrics: JobMetrics | None
    web: WebServer | None

    def _counters(self) -> tuple[int, int, int]:
        """Records read by source tasks, handed to sinks, source lag."""
        sources = {s.name for s in self.plan.stages if s.sources}
        rin = out = lag = 0
        for w in self.workers:
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
            sum(int(st.get(k, 0)) for w in self.workers for st in w.stats.values()) for k in keys
        ]
        return totals[0], totals[1], totals[2], totals[3]

    def _say(self, text: str) -> None:
        if self.options.progress is not None:
            elapsed = time.monotonic() - self._started
            print(f"[{elapsed:7.1f}s] {self.job}: {text}", file=self.options.progress, flush=True)

    def _report(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now < self._progress_next:
            return
        self._progress_next = now + self.options.progress_every
        rin, out, lag = self._counters()
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
        self._say(
            f"gen={self.generation} in={rin:,} ({rate:,.0f}/s) out={out:,}{lag_text} "
            f"checkpoint={st.last_completed} ({st.last_duration_s * 1000:.0f} ms{loop_text}) "
            f"restarts={self.restarts}"
        )
        self._status("running")

    def _publish(self, state: str = "running", force: bool = False) -> None:
        """The metrics' snapshot (at most every half second): what scrapes and the job page
        read (:mod:`processor.runtime.observe.metrics`)."""
        now = time.monotonic()
        if self.metrics is None or (not force and now < self._publish_next):
            return
        self._publish_next = now + 0.5
        self.metrics.update(self._status_dict(state), self.workers, state)

    def _status(self, state: str) -> None:
        status = self._status_dict(state)
        if self.metrics is not None:  # the same snapshot: no _publish for the next half second
            self.metrics.update(status, self.workers, state)
            self._publish_next = time.monotonic() + 0.5
        path = self.dir / "status.json"
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".status-")
        with os.fdopen(fd, "w") as f:
            json.dump(status, f, indent=1)
        os.replace(tmp, path)

    def _status_dict(self, state: str) -> dict[str, Any]:
        rin, out, lag = self._counters()
        dead, bad, dups, over = self._bad_counts()
        st = self.coordinator.stats
        status: dict[str, Any] = {
            "job": self.job,
            "state": state,
            "pid": os.getpid(),
            "updated_ms": int(time.time() * 1000),
            "uptime_s": round(time.monotonic() - self._started, 1),
            "generation": self.generation,
            "restarts": self.restarts,
            "restart_causes": self.restart_causes[-10:],
            "mode": self.options.mode,
            "runner": self.runner,
            "workers": [
                {"worker": w.index, "pid": w.pid, "host": w.host, "connected": w.conn is not None}
                for w in self.workers
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
            "tasks": {k: v for w in self.workers for k, v in w.stats.items()},
            "snapshot_url": self.store.url,
            "web": self.web.url if self.web is not None else None,
        }
        return status

    def _result(self) -> RunResult:
        rin, out, _ = self._counters()
        st = self.coordinator.stats
        return RunResult(
            job=self.job,
            generation=self.generation,
            restarts=self.restarts,
            checkpoints=st.completed,
            last_checkpoint=st.last_completed,
            records_in=rin,
            records_out=out,
            seconds=time.monotonic() - self._started,
            restart_causes=list(self.restart_causes),
            checkpoint_durations=list(st.durations),
            loop_logs=list(st.loop_logs),
            ready_s=self.ready_s if self.ready_s is not None else float("nan"),
            final_trigger_s=(
                self.final_trigger_s if self.final_trigger_s is not None else float("nan")
            ),
        )
