"""Spare workers (issue 51): the local runner starts one per worker while it runs its checks;
a launch hands each worker's spec to a spare, whose output then goes to the worker's log, and
the spares left are stopped with the runner."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from processor.runtime.job import Generation
from processor.runtime.supervision.local import LocalWorkers

PIPELINE = """
from processor import Dataflow
from sinks import ConsoleSink

flow = Dataflow("spare-test")
flow.source("clicks", "clicks").sink("out", ConsoleSink())
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def _wait(condition, timeout: float = 30.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def test_a_launch_hands_the_spec_to_a_spare_whose_output_goes_to_the_workers_log(
    tmp_path: Path,
) -> None:
    pipeline = tmp_path / "pipeline.py"
    pipeline.write_text(PIPELINE)
    workers = LocalWorkers({})
    workers.prepare(2, tmp_path, ("connectors.transport:KafkaTransport", str(pipeline)))
    spares = [p.pid for p in workers.spares]
    try:
        assert len(spares) == 2 and all(_alive(pid) for pid in spares)
        current = Generation(tmp_path, 2)
        current.begin()
        log_path = current.log_path(0)
        # A spec the worker refuses at once (no coordinator to talk to): what it says about it
        # must land in the worker's log, as for a worker started with its spec.
        spec = {"worker": 0, "workers": 2, "pipeline": str(pipeline), "log_path": str(log_path)}
        workers.launch([spec], current)
        assert current.workers[0].pid == spares[0]  # the first spare took it
        assert workers.procs[0].popen is not None
        assert workers.procs[0].popen.wait(30) == 1  # it failed on the spec, as it should
        assert "worker=0 failed" in log_path.read_text(), log_path.read_text()
        assert [p.pid for p in workers.spares] == spares[1:]
    finally:
        workers.close()
    assert workers.spares == []
    assert _wait(lambda: not _alive(spares[1])), "the spare left was not stopped"


def test_a_spare_exits_when_its_runner_goes_away(tmp_path: Path) -> None:
    pipeline = tmp_path / "pipeline.py"
    pipeline.write_text(PIPELINE)
    workers = LocalWorkers({})
    workers.prepare(1, tmp_path, ("connectors.transport:KafkaTransport", str(pipeline)))
    spare = workers.spares[0]
    assert spare.popen is not None and spare.popen.stdin is not None
    spare.popen.stdin.close()  # what a runner's death does to the pipe
    assert spare.popen.wait(30) == 0
    workers.close()


def test_a_worker_started_without_a_spare_runs_no_python_between_fork_and_exec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A launch with no spare left (a restart within 2 s of the last launch) starts the worker
    from the runner's loop, among librdkafka's threads: a ``preexec_fn`` there can deadlock the
    child on a lock another thread held at the fork, and ``Popen`` waits for it for ever (the
    spares' hang of issue 51). It is started as the spares are: its own session, nothing of
    Python's in the child before exec."""
    pipeline = tmp_path / "pipeline.py"
    pipeline.write_text(PIPELINE)
    started: list[dict[str, object]] = []
    real = subprocess.Popen

    def popen(*args: object, **kwargs: object) -> subprocess.Popen[bytes]:
        started.append(kwargs)
        return real(*args, **kwargs)  # type: ignore[call-overload, no-any-return]

    monkeypatch.setattr(subprocess, "Popen", popen)
    workers = LocalWorkers({})  # no prepare: no spare
    current = Generation(tmp_path, 1)
    current.begin()
    log_path = current.log_path(0)
    spec = {"worker": 0, "workers": 1, "pipeline": str(pipeline), "log_path": str(log_path)}
    try:
        workers.launch([spec], current)
        assert workers.procs[0].popen is not None
        assert workers.procs[0].popen.wait(30) == 1  # a real worker: it failed on the spec
        assert "worker=0 failed" in log_path.read_text(), log_path.read_text()
    finally:
        workers.close()
    assert len(started) == 1
    assert started[0]["preexec_fn"] is None and started[0]["start_new_session"] is True
