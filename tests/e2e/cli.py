"""``eosflow`` as a user runs it, for tests: a job's environment, the command line, its status
and its committed file output."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from processor.runtime.job import job_dir
from sinks import read_jsonl
from tests.e2e.harness import canonical

__all__ = [
    "committed_output",
    "eosflow",
    "held_then_killed",
    "job_env",
    "kill_job",
    "run_eosflow",
    "status",
    "wait_status",
]


def job_env(brokers: str, tmp: Path, prefix: str = "life", **extra: str) -> dict[str, str]:
    """The environment of a job with a name and a click topic of its own (no ``EOSFLOW_*``
    from the test's environment but the broker and a state directory under ``tmp``)."""
    run_id = uuid.uuid4().hex[:8]
    env = {k: v for k, v in os.environ.items() if not k.startswith("EOSFLOW_")}
    env.update(
        EOSFLOW_KAFKA_BROKERS=brokers,
        EOSFLOW_STATE_DIR=str(tmp / "state"),
        JOB_NAME=f"{prefix}-{run_id}",
        CLICKS_TOPIC=f"{prefix}-clicks-{run_id}",
        OUTPUT_DIR=str(tmp / "out"),
    )
    env.update(extra)
    return env


def elsewhere(env: dict[str, str], tmp: Path) -> dict[str, str]:
    """The same job (name, input, broker) as ``env`` with a state directory and an output
    directory of its own under ``tmp``: a second runner on another host or volume."""
    return {**env, "EOSFLOW_STATE_DIR": str(tmp / "state"), "OUTPUT_DIR": str(tmp / "out")}


def eosflow(*args: str) -> list[str]:
    return [sys.executable, "-m", "processor.cli", *args]


def run_eosflow(
    env: dict[str, str], *args: str, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    """``eosflow ARGS`` to its end. One still running after ``timeout`` seconds fails the test
    with what it printed, its job's last status and its workers' last log lines: a hang says
    where it hung."""
    try:
        return subprocess.run(
            eosflow(*args), env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
        where = job_dir(env["JOB_NAME"], env.get("EOSFLOW_STATE_DIR"))
        found = [f"eosflow {' '.join(args)} still ran after {timeout:.0f}s", (err or "")[-5000:]]
        with contextlib.suppress(OSError, ValueError):
            found.append(f"status.json: {(where / 'status.json').read_text()[-3000:]}")
        for log in sorted(where.glob("worker-*.log")):
            found.append(f"{log.name}: {log.read_text(errors='replace')[-2000:]}")
        raise AssertionError("\n".join(found)) from None


def committed_output(env: dict[str, str]) -> Counter[bytes]:
    return Counter(canonical(x) for x in read_jsonl(env["OUTPUT_DIR"]))


def status(env: dict[str, str]) -> dict[str, Any]:
    """``eosflow status JOB --json`` (``{}`` while there is none)."""
    out = subprocess.run(
        eosflow("status", env["JOB_NAME"], "--json"), env=env, capture_output=True, text=True
    )
    return json.loads(out.stdout) if out.returncode == 0 else {}


def wait_status(
    env: dict[str, str], ok: Callable[[dict[str, Any]], bool], timeout: float = 120
) -> dict[str, Any]:
    """Polls :func:`status` until ``ok`` holds; fails the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    found: dict[str, Any] = {}
    while time.monotonic() < deadline:
        found = status(env)
        if found and ok(found):
            return found
        time.sleep(0.3)
    raise AssertionError(f"status never matched within {timeout}s: {found}")


def kill_job(proc: subprocess.Popen[Any], env: dict[str, str], pids: list[int]) -> None:
    """SIGKILLs the whole job at once: the runner ``proc``, then every worker (``pids`` and
    those its status file names)."""
    status = json.loads(
        (job_dir(env["JOB_NAME"], env["EOSFLOW_STATE_DIR"]) / "status.json").read_text()
    )
    pids = pids + [w["pid"] for w in status.get("workers", []) if w.get("pid")]
    proc.kill()
    for pid in set(pids):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(30)
    if proc.stderr is not None:
        proc.stderr.close()


def held_then_killed(
    argv: list[str],
    env: dict[str, str],
    holds: Path,
    point: str,
    worker: int,
    *,
    feed: tuple[int, Callable[[], None]] | None = None,
) -> None:
    """Runs ``argv`` (an ``eosflow run`` with a ``...:hold`` fault at ``point`` in ``worker``)
    until that worker is held there, then SIGKILLs the whole job (:func:`kill_job`).

    ``feed=(restarts, produce)``: calls ``produce`` once the job has restarted that many times,
    so that the start holding at a commit point has new input to commit whatever the machine's
    load did to the earlier starts (which may have read everything before); or once the job
    has had nothing to read for 5 s before that (the earlier starts' commit points need new
    output too). If the worker is held before either, ``produce`` is called after the kill:
    the input is always written once."""
    from processor.runtime.supervision.worker import hold_paths

    holds.mkdir(parents=True, exist_ok=True)
    # stderr to a file, not a pipe: reading a pipe of a job still running blocks until it
    # exits (the test hung for ever here on a loaded machine instead of failing).
    stderr = holds / "runner.stderr"
    with stderr.open("w") as sink:
        proc = subprocess.Popen(
            argv, env={**env, "EOSFLOW_FAULT_DIR": str(holds)}, stdout=subprocess.DEVNULL,
            stderr=sink, text=True,
        )  # fmt: skip
    reached, _release = hold_paths(holds, point, worker)
    deadline = time.monotonic() + 180
    checked = 0.0
    idle_since: float | None = None
    while not reached.exists() and proc.poll() is None and time.monotonic() < deadline:
        if feed is not None and time.monotonic() - checked > 0.5:
            checked = time.monotonic()
            now = status(env)  # this run's (a finished run's status.json may linger)
            ours = now.get("pid") == proc.pid
            # Idle before the earlier faults fired (a loaded machine read everything first:
            # their commit points wait for output that never comes; seen in CI): feed now.
            idle = ours and now.get("source_lag") == 0 and now.get("records_in", 0) > 0
            idle_since = (idle_since or checked) if idle else None
            if ours and (
                now.get("restarts", 0) >= feed[0]
                or (idle_since is not None and checked - idle_since > 5.0)
            ):
                feed[1]()
                feed = None
        time.sleep(0.05)
    if not reached.exists():
        code = proc.poll()
        kill_job(proc, env, [])
        raise AssertionError(
            f"never held at {point} in worker {worker} (exit {code}): {stderr.read_text()[-3000:]}"
        )
    kill_job(proc, env, [json.loads(p.read_text())["pid"] for p in holds.glob("*.reached")])
    if feed is not None:
        # Held before the feed was due (that start had unread input left): the input is
        # still written, for the next start. Without this the test expected output of input
        # it never wrote: 2,600 "missing" running totals and 7,400 shifted ones, once in CI.
        feed[1]()
