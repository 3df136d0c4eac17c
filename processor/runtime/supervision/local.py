"""The local runner: the coordinator in this process, one OS process per worker.

Workers are started as ``python -m processor.runtime.supervision.worker SPEC.json`` in their own
process groups, with output in ``<job dir>/worker-N.log``. Stopping a generation SIGKILLs every
worker and reaps it, so no zombie producer can write after the new generation's markers. The rest
(coordinator loop, supervision, reporting) is :class:`processor.runtime.supervision.runner.Runner`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from processor.embedded._process import ServerProcess, spawn
from processor.runtime.supervision.runner import (
    Fault,
    JobFailed,
    Runner,
    RunOptions,
    RunResult,
    default_snapshot_url,
    job_dir,
    jobs_dir,
)

__all__ = [
    "Fault",
    "JobFailed",
    "LocalRunner",
    "RunOptions",
    "RunResult",
    "default_snapshot_url",
    "job_dir",
    "jobs_dir",
    "run_local",
]

log = logging.getLogger(__name__)


class LocalRunner(Runner):
    """Runs ``pipeline`` (a file path) with :class:`RunOptions`, one OS process per worker."""

    runner = "local"

    def __init__(self, pipeline: str | Path, options: RunOptions) -> None:
        super().__init__(pipeline, options)
        self.procs: list[ServerProcess] = []

    def _launch(self, specs: list[dict[str, Any]]) -> None:
        self.procs = [self._spawn(spec) for spec in specs]

    def _relaunch(self, spec: dict[str, Any]) -> None:
        self.procs[spec["worker"]] = self._spawn(spec)

    def _spawn(self, spec: dict[str, Any]) -> ServerProcess:
        i = spec["worker"]
        spec_path = self.dir / f"worker-{i}.spec.json"
        spec_path.write_text(json.dumps(spec))
        proc = spawn(
            f"worker-{i}",
            [sys.executable, "-m", "processor.runtime.supervision.worker", str(spec_path)],
            log_path=Path(spec["log_path"]),
            owned=True,
            env=self._worker_env(),
        )
        self.workers[i].pid = proc.pid
        return proc

    def _stop_workers(self) -> None:
        for proc in self.procs:
            _kill(proc)
        for proc in self.procs:
            _reap(proc)

    def _stop_worker(self, index: int) -> None:
        _kill(self.procs[index])
        _reap(self.procs[index])

    def _await_exit(self, timeout: float) -> None:
        for proc in self.procs:
            if proc.popen is not None:
                try:
                    proc.popen.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    log.error("%s did not stop; killing", proc.name)

    def _dead_worker(self) -> str | None:
        for w, proc in zip(self.workers, self.procs, strict=True):
            code = proc.popen.poll() if proc.popen is not None else None
            if code is not None:
                self.failed_worker = w.index
                return self._cause(w.index, code)
            if w.conn is not None and w.conn.closed:
                # A failing worker closes its connection before it logs the error and exits:
                # give it a moment, so that the cause names its exit status and error line.
                code = None
                if proc.popen is not None:
                    try:
                        code = proc.popen.wait(timeout=2.0)
                    except subprocess.TimeoutExpired:
                        code = None
                self.failed_worker = w.index
                return self._cause(w.index, code)
        return None

    def _cause(self, index: int, code: int | None) -> str:
        status = (
            f"killed by signal {signal.Signals(-code).name}"
            if code is not None and code < 0
            else f"exit code {code}"
            if code is not None
            else "lost its coordinator connection"
        )
        return f"worker {index} {status}" + self._last_error(index)


def _kill(proc: ServerProcess) -> None:
    if proc.popen is not None and proc.popen.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def _reap(proc: ServerProcess) -> None:
    if proc.popen is not None:
        try:
            proc.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            log.error("%s pid=%d did not die", proc.name, proc.pid)


def run_local(pipeline: str | Path, **options: Any) -> RunResult:
    """Convenience: ``LocalRunner(pipeline, RunOptions(**options)).run()``."""
    return LocalRunner(pipeline, RunOptions(**options)).run()
