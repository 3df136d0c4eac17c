"""The local runner: the coordinator in this process, one OS process per worker.

Workers are started as ``python -m processor.runtime.supervision.worker SPEC.json`` in their own
process groups, with output in ``<job dir>/worker-N.log``. Stopping a generation SIGKILLs every
worker and reaps it, so no zombie producer can write after the new generation's markers.

**Spare workers** (issue 51): a worker's Python start and the engine's imports take about 0.4 s,
on the way of every start and every restart. So the runner starts one spare per worker
(``worker --spare``) before its own checks, while it runs them, takes the job's lease and
claim (a refused start stops them); a spare imports the engine and waits for the path of
its spec on stdin. A launch hands each worker's spec to a spare (and starts one the usual way
when none is left), and the spares used are replaced 2 s later, once the new workers run (not
at once: on a small machine their imports would slow the start they are meant to speed up). A spare
holds no state, no client and no connection until it gets a spec: it exits when its stdin
closes (the runner stopped or died) and is killed with the runner's other processes. Spares,
and workers started when no spare is left (a restart within 2 s of a launch), are started
without a ``preexec_fn`` (no parent-death signal): they start from the runner's loop, among its
threads (librdkafka's, the group commit's), where one hung the runner in ``Popen`` in CI; a
worker exits when its coordinator connection closes, or fails to connect when the runner is
gone.
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
import time
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

#: Spares used by a launch are replaced this long after it (see the module docstring).
_SPARE_AFTER_S = 2.0


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
        self.spares: list[ServerProcess] = []
        self._wanted = 0  # spares to keep (prepare)
        self._spare_log: Path | None = None
        self._preload = ("", "")
        self._launched = 0.0  # monotonic: when workers were last handed out

    def prepare(self, workers: int, directory: Path, preload: tuple[str, str]) -> None:
        """Start ``workers`` spare workers (see the module docstring) that import ``preload``
        (the transport object's path and the pipeline file) ahead; their own output, until
        they get a spec, goes to ``directory/spare-workers.log``."""
        self._preload = preload
        self._wanted, self._spare_log = workers, directory / "spare-workers.log"
        while len(self.spares) < workers:
            self.spares.append(self._start_spare())

    def _start_spare(self) -> ServerProcess:
        assert self._spare_log is not None
        return spawn(
            "spare-worker",
            [
                sys.executable,
                "-m",
                "processor.runtime.supervision.worker",
                "--spare",
                *self._preload,
            ],
            log_path=self._spare_log,
            owned=True,
            env=self._env(),
            stdin=subprocess.PIPE,
            # Started from the runner's loop among its threads: no preexec_fn (it can deadlock
            # the child, and Popen with it). A spare exits when its stdin closes; once a
            # worker, when its coordinator connection does.
            fork_safe=True,
        )

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.environ)
        return env

    def open(self, job: str, pipeline: str, say: Callable[[str], None]) -> ControlAddress:
        return ControlAddress()  # loopback: the workers run here

    def close(self) -> None:
        spares, self.spares, self._wanted = self.spares, [], 0
        for proc in spares:
            _kill(proc)
        for proc in spares:
            _reap(proc)

    def launch(self, specs: list[dict[str, Any]], current: Generation) -> None:
        self.procs = [self._spawn(spec, current) for spec in specs]

    def relaunch(self, spec: dict[str, Any], current: Generation) -> None:
        self.procs[spec["worker"]] = self._spawn(spec, current)

    def _spawn(self, spec: dict[str, Any], current: Generation) -> ServerProcess:
        i = spec["worker"]
        spec_path = current.dir / f"worker-{i}.spec.json"
        spec_path.write_text(json.dumps(spec))
        self._launched = time.monotonic()
        proc = self._hand_to_spare(spec_path)
        if proc is None:
            proc = spawn(
                f"worker-{i}",
                [sys.executable, "-m", "processor.runtime.supervision.worker", str(spec_path)],
                log_path=Path(spec["log_path"]),
                owned=True,
                env=self._env(),
                fork_safe=True,  # from the runner's loop too (the module docstring)
            )
        current.workers[i].pid = proc.pid
        current.workers[i].started = time.monotonic()  # its hello is due (observe.tally.waits)
        return proc

    def _hand_to_spare(self, spec_path: Path) -> ServerProcess | None:
        """A spare that took ``spec_path``, or ``None`` (none left alive)."""
        while self.spares:
            proc = self.spares.pop(0)
            stdin = proc.popen.stdin if proc.popen is not None else None
            if stdin is None or proc.popen is None or proc.popen.poll() is not None:
                _reap(proc)
                continue
            try:
                stdin.write(f"{spec_path}\n".encode())
                stdin.close()
            except OSError:  # it died meanwhile
                _kill(proc)
                _reap(proc)
                continue
            log.info("worker spec %s handed to spare worker pid=%d", spec_path.name, proc.pid)
            return proc
        return None

    def _replenish(self) -> None:
        """One spare more, once the workers launched last have run a few seconds."""
        if len(self.spares) < self._wanted and time.monotonic() - self._launched > _SPARE_AFTER_S:
            self.spares.append(self._start_spare())

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
        self._replenish()  # called on every turn of the runner's loop
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
