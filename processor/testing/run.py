"""Running a pipeline file bounded, as a test does: in this process, or as ``eosflow run``.

Both run the pipeline with ``--until-idle``: the job reads every source partition up to the end
offset it had at start, takes a final checkpoint, commits its sinks and exits. What it
committed is then what a reader with ``read_committed`` sees (:mod:`sinks` readers,
``processor.testing.read_output``).

A :class:`Job` is a test's job: a unique name, a state directory of its own (checkpoints,
status, worker logs) and the environment the pipeline file is loaded with. The pipeline reads
its name and topics from that environment, which is what makes it testable::

    flow = Dataflow(os.environ.get("JOB_NAME", "totals"))
    flow.source("clicks", os.environ.get("CLICKS_TOPIC", "clicks"), serde=JsonSerde())...

    job = new_job(tmp_path, brokers, "totals")
    job.env["CLICKS_TOPIC"] = topic
    result = job.run("pipeline.py")                 # in-process: a RunResult
    cli = job.run_subprocess("pipeline.py")         # `python -m processor.cli run ...`

A run that fails raises :class:`~processor.runtime.job.JobFailed` with the last lines of every
worker log (where the pipeline's own exceptions are), not only the runner's summary.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from processor.runtime.job import JobFailed, RunOptions, RunResult
from processor.testing.topics import unique_name

__all__ = ["CliRun", "Job", "logs_tail", "new_job", "run_pipeline", "run_pipeline_subprocess"]

#: Lines of each worker log a failure message shows.
TAIL_LINES = 30


@dataclass(frozen=True)
class CliRun:
    """What ``eosflow run`` did in a subprocess.

    Attributes:
        returncode: the command's exit status (0: the job finished; 1: it failed; 2: usage).
        stdout: its standard output (the ``job ... finished: ...`` line).
        stderr: its standard error (the plan, progress lines, errors).
    """

    returncode: int
    stdout: str
    stderr: str


def logs_tail(state_dir: str | Path, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of every worker log of every job under ``state_dir``, each
    under a ``--- <path> ---`` header (empty when there is none)."""
    parts = []
    for log in sorted(Path(state_dir).glob("jobs/*/worker-*.log")):
        text = log.read_text(errors="replace").rstrip("\n").splitlines()[-lines:]
        parts.append(f"--- {log} (last {len(text)} lines) ---\n" + "\n".join(text))
    return "\n".join(parts)


def _failure(what: str, state_dir: str | Path) -> str:
    tail = logs_tail(state_dir)
    return f"{what}\n{tail}" if tail else f"{what}\n(no worker log under {state_dir}/jobs)"


def _options(
    env: dict[str, str], state_dir: str | Path, workers: int, checkpoint_interval: float
) -> dict[str, Any]:
    return {
        "workers": workers,
        "checkpoint_interval": checkpoint_interval,
        "until_idle": True,
        "environ": dict(env),
        "state_dir": str(state_dir),
    }


def run_pipeline(
    pipeline: str | Path,
    *,
    env: dict[str, str],
    state_dir: str | Path,
    workers: int = 2,
    checkpoint_interval: float = 0.5,
    **options: Any,
) -> RunResult:
    """Run ``pipeline`` (a file) until idle on the local runner in this process.

    Args:
        env: variables the pipeline file and its workers see on top of ``os.environ``; must
            name the broker (``EOSFLOW_KAFKA_BROKERS``).
        state_dir: the job's checkpoints, status and worker logs (``<state_dir>/jobs/<job>``).
        workers: worker processes.
        checkpoint_interval: seconds between checkpoints (short: a test's job is small).
        options: more :class:`~processor.runtime.job.RunOptions` fields (``mode``, ``faults``,
            ``max_restarts``, ``recovery``...).

    Returns:
        The job's :class:`~processor.runtime.job.RunResult` (records in and out, checkpoints,
        restarts).

    Raises:
        JobFailed: the job failed; the message ends with the tail of every worker log.
        ConfigError, DefinitionError: the pipeline or the options are invalid (before any
            worker starts).
    """
    from processor.runtime.supervision.local import LocalRunner

    run = RunOptions(**{**_options(env, state_dir, workers, checkpoint_interval), **options})
    try:
        return LocalRunner(pipeline, run).run()
    except JobFailed as exc:
        raise JobFailed(_failure(f"{pipeline}: {exc}", state_dir)) from exc


def run_pipeline_subprocess(
    pipeline: str | Path,
    *args: str,
    env: dict[str, str],
    state_dir: str | Path,
    workers: int = 2,
    checkpoint_interval: float = 0.5,
    timeout: float = 600.0,
    check: bool = True,
) -> CliRun:
    """Run ``python -m processor.cli run PIPELINE --until-idle ...`` (what ``eosflow run``
    does) with this interpreter, and wait for it.

    Args:
        args: more ``eosflow run`` arguments (``--mode``, ``--fault``, ``--runner spark``...).
        env: variables on top of ``os.environ`` (the broker, the pipeline's own).
        state_dir: the command's ``EOSFLOW_STATE_DIR``.
        timeout: seconds before the command is killed (and :class:`JobFailed` raised).
        check: raise :class:`JobFailed` when the command exits non-zero; ``False`` returns the
            :class:`CliRun` whatever the exit status (to test a failure).

    Raises:
        JobFailed: the command failed (``check``) or timed out; the message holds the end of
            its standard error and of every worker log.
    """
    command = [
        sys.executable, "-m", "processor.cli", "run", str(pipeline), "--until-idle",
        "--workers", str(workers), "--checkpoint-interval", f"{checkpoint_interval}s", *args,
    ]  # fmt: skip
    environ = {**os.environ, **env, "EOSFLOW_STATE_DIR": str(state_dir)}
    try:
        done = subprocess.run(
            command, env=environ, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise JobFailed(
            _failure(f"{' '.join(command)} still running after {timeout:g}s", state_dir)
        ) from exc
    run = CliRun(done.returncode, done.stdout, done.stderr)
    if check and run.returncode != 0:
        stderr = "\n".join(run.stderr.rstrip("\n").splitlines()[-TAIL_LINES:])
        raise JobFailed(
            _failure(
                f"{' '.join(command)} exited with {run.returncode}; its stderr ends:\n{stderr}",
                state_dir,
            )
        )
    return run


@dataclass
class Job:
    """A test's job: a unique name, a state directory and the pipeline's environment.

    Attributes:
        name: unique per test; also in ``env["JOB_NAME"]`` for the pipeline to use.
        state_dir: checkpoints, status and worker logs of the job (and its
            ``EOSFLOW_STATE_DIR`` when run as a subprocess).
        env: what the pipeline file sees on top of ``os.environ``: ``JOB_NAME``,
            ``EOSFLOW_STATE_DIR`` and the servers' ``EOSFLOW_*`` variables; add the pipeline's
            own (topics, output directory) before a run.
    """

    name: str
    state_dir: Path
    env: dict[str, str] = field(default_factory=dict)

    def run(self, pipeline: str | Path, **options: Any) -> RunResult:
        """:func:`run_pipeline` with this job's environment and state directory."""
        return run_pipeline(pipeline, env=self.env, state_dir=self.state_dir, **options)

    def run_subprocess(self, pipeline: str | Path, *args: str, **options: Any) -> CliRun:
        """:func:`run_pipeline_subprocess` with this job's environment and state directory."""
        return run_pipeline_subprocess(
            pipeline, *args, env=self.env, state_dir=self.state_dir, **options
        )

    def logs_tail(self, lines: int = TAIL_LINES) -> str:
        """:func:`logs_tail` of this job's state directory."""
        return logs_tail(self.state_dir, lines)


def new_job(tmp: str | Path, servers: dict[str, str] | str, hint: str = "job", **env: str) -> Job:
    """A :class:`Job` with a unique name and its state under ``tmp``.

    Args:
        tmp: a directory of the test's own (pytest's ``tmp_path``).
        servers: the ``EOSFLOW_*`` variables of the servers (``SessionServers.as_env()``), or
            just the Kafka bootstrap servers.
        hint: readable part of the name (e.g. the test's name).
        env: more variables for the pipeline.
    """
    name = unique_name(hint, prefix="job")
    state_dir = Path(tmp) / f"eosflow-{name}"
    state_dir.mkdir(parents=True, exist_ok=True)
    found = {"EOSFLOW_KAFKA_BROKERS": servers} if isinstance(servers, str) else dict(servers)
    environ = {**found, "JOB_NAME": name, "EOSFLOW_STATE_DIR": str(state_dir), **env}
    return Job(name, state_dir, environ)
