"""The local runner: the coordinator in this process, one OS process per worker.

Workers are started as ``python -m processor.runtime.supervision.worker SPEC.json`` in their own
process groups, with output in ``<job dir>/worker-N.log``. Stopping a generation SIGKILLs every
worker and reaps it, so no zombie producer can write after the new generation's markers.
:class:`LocalWorkers` is that :class:`~processor.runtime.supervision.recovery.WorkerLauncher`;
:class:`LocalRunner` is a :class:`~processor.runtime.supervision.runner.Runner` that uses it (the
coordinator loop, supervision and reporting are the runner's collaborators).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from processor.embedded._process import ServerProcess, spawn
from processor.runtime.job import Generation
from processor.runtime.supervision.recovery import ControlAddress, Failure
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
    "LocalWorkers",
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

    def __init__(self, pipeline: str | Path, options: RunOptions) -> None:
        super().__init__(pipeline, options, LocalWorkers(options.environ))


class LocalWorkers:
    """Workers as OS processes of this host (a
    :class:`~processor.runtime.supervision.recovery.WorkerLauncher`); ``environ``: what they see
    besides this process's environment."""

    name = "local"

    def __init__(self, environ: dict[str, str]) -> None:
        self.environ = environ
        self.procs: list[ServerProcess] = []

    def open(self, job: str, pipeline: str, say: Callable[[str], None]) -> ControlAddress:
        return ControlAddress()  # loopback: the workers run here

    def close(self) -> None:
        pass

    def launch(self, specs: list[dict[str, Any]], current: Generation) -> None:
        self.procs = [self._spawn(spec, current) for spec in specs]

    def relaunch(self, spec: dict[str, Any], current: Generation) -> None:
        self.procs[spec["worker"]] = self._spawn(spec, current)

    def _spawn(self, spec: dict[str, Any], current: Generation) -> ServerProcess:
        i = spec["worker"]
        spec_path = current.dir / f"worker-{i}.spec.json"
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ)
        env.update(self.environ)
        proc = spawn(
            f"worker-{i}",
            [sys.executable, "-m", "processor.runtime.supervision.worker", str(spec_path)],
            log_path=Path(spec["log_path"]),
            owned=True,
            env=env,
        )
        current.workers[i].pid = proc.pid
        return proc

    def stop_all(self, current: Generation) -> None:
        for proc in self.procs:
            _kill(proc)
        for proc in self.procs:
            _reap(proc)

    def stop_worker(self, index: int) -> None:
        _kill(self.procs[index])
        _reap(self.procs[index])

    def await_exit(self, timeout: float) -> None:
        for proc in self.procs:
            if proc.popen is not None:
                try:
                    proc.popen.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    log.error("%s did not stop; killing", proc.name)

    def dead_worker(self, current: Generation) -> Failure | None:
        for w, proc in zip(current.workers, self.procs, strict=True):
            code = proc.popen.poll() if proc.popen is not None else None
            if code is not None:
                return self._cause(current, w.index, code), w.index
            if w.conn is not None and w.conn.closed:
                # A failing worker closes its connection before it logs the error and exits:
                # give it a moment, so that the cause names its exit status and error line.
                code = None
                if proc.popen is not None:
                    try:
                        code = proc.popen.wait(timeout=2.0)
                    except subprocess.TimeoutExpired:
                        code = None
                return self._cause(current, w.index, code), w.index
        return None

    @staticmethod
    def _cause(current: Generation, index: int, code: int | None) -> str:
        status = (
            f"killed by signal {signal.Signals(-code).name}"
            if code is not None and code < 0
            else f"exit code {code}"
            if code is not None
            else "lost its coordinator connection"
        )
        return f"worker {index} {status}" + current.last_error(index)


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
