"""The supervisor (processor.runtime.supervision.recovery) alone: generations, failed workers,
global and local recovery, over a real snapshot store, checkpoint coordinator and control server.
The launcher is the seam the runner plugs local processes or Spark into; here it records what it
is asked to do."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from processor.compiler import compile_flow
from processor.dataflow import Dataflow
from processor.runtime.checkpoints.coordinator import CheckpointCoordinator
from processor.runtime.control import ControlServer
from processor.runtime.job import Generation, RunOptions
from processor.runtime.supervision.identity import JobIdentity
from processor.runtime.supervision.lifecycle import RestartBudget, StopController
from processor.runtime.supervision.recovery import ControlAddress, Failure, Supervisor
from processor.snapshot.store import SnapshotStore
from sinks import ConsoleSink

JOB = "supervised"


class RecordingLauncher:
    """A :class:`~processor.runtime.supervision.recovery.WorkerLauncher` that starts nothing."""

    name = "test"

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.dead: Failure | None = None

    def open(self, job: str, pipeline: str, say: Callable[[str], None]) -> ControlAddress:
        return ControlAddress()

    def close(self) -> None:
        pass

    def launch(self, specs: list[dict[str, Any]], current: Generation) -> None:
        self.calls.append(("launch", current.number, [s["worker"] for s in specs]))

    def relaunch(self, spec: dict[str, Any], current: Generation) -> None:
        self.calls.append(("relaunch", current.number, spec))

    def dead_worker(self, current: Generation) -> Failure | None:
        return self.dead

    def stop_worker(self, index: int) -> None:
        self.calls.append(("stop_worker", index))

    def stop_all(self, current: Generation) -> None:
        self.calls.append(("stop_all", current.number))

    def await_exit(self, timeout: float) -> None:
        pass


@pytest.fixture
def server() -> Iterator[ControlServer]:
    s = ControlServer()
    yield s
    s.close()


def _supervisor(
    tmp_path: Path, server: ControlServer, recovery: str = "global"
) -> tuple[Supervisor, RecordingLauncher]:
    flow = Dataflow(JOB)
    flow.source("clicks", "clicks").map("upper", str.upper).sink("out", ConsoleSink())
    plan = compile_flow(flow, 2)
    options = RunOptions(
        workers=2, recovery=recovery, restart_backoff=0.01, max_backoff=0.01, max_restarts=5
    )
    store = SnapshotStore(tmp_path.as_uri())
    launcher = RecordingLauncher()
    said: list[str] = []
    stop = StopController(JOB, options, say=said.append, last_completed=lambda: 0)

    def spec(
        worker: int, restore: int, stale_through: int = 0, sink_generation: int | None = None
    ) -> dict[str, Any]:
        return {
            "worker": worker,
            "restore": restore,
            "stale_through": stale_through,
            "sink_generation": sink_generation,
        }

    supervisor = Supervisor(
        job=JOB,
        plan=plan,
        options=options,
        store=store,
        current=Generation(tmp_path, options.workers),
        launcher=launcher,
        server=server,
        coordinator=CheckpointCoordinator(store, JOB, plan.task_names(), interval_s=1.0),
        budget=RestartBudget(JOB, options, tmp_path),
        stop=stop,
        identity=JobIdentity(JOB, None),  # no claim: a pass-through
        metrics=None,
        spec=spec,
        pump=lambda _timeout: None,
        say=said.append,
    )
    return supervisor, launcher


def test_a_dead_worker_under_global_recovery_restarts_every_worker_in_a_new_generation(
    tmp_path: Path, server: ControlServer
) -> None:
    supervisor, launcher = _supervisor(tmp_path, server)
    supervisor.start_generation()
    assert launcher.calls == [("launch", 1, [0, 1])]
    first = list(supervisor.current.workers)
    assert supervisor.failed() is None
    supervisor.stop.final_triggered(3)
    launcher.dead = ("worker 1 exit code 1", 1)
    failure = supervisor.failed()
    assert failure == ("worker 1 exit code 1", 1)
    supervisor.recover(*failure)
    assert launcher.calls[1:] == [("stop_all", 1), ("launch", 2, [0, 1])]
    assert supervisor.current.number == 2 and supervisor.coordinator.generation == 2
    assert all(a is not b for a, b in zip(first, supervisor.current.workers, strict=True))
    assert supervisor.budget.restarts == 1 and supervisor.budget.causes == ["worker 1 exit code 1"]
    assert supervisor.stop.final is None  # the new generation takes its own final checkpoint


def test_a_dead_worker_under_local_recovery_restarts_alone_past_the_pending_checkpoint(
    tmp_path: Path, server: ControlServer
) -> None:
    supervisor, launcher = _supervisor(tmp_path, server, recovery="local")
    supervisor.start_generation()
    survivor = supervisor.current.workers[0]
    pending = supervisor.coordinator.trigger_now()
    supervisor.recover("worker 1 exit code 1", 1)
    assert supervisor.coordinator.pending is None  # the dead worker cannot ack it: aborted
    assert launcher.calls[1] == ("stop_worker", 1)
    assert launcher.calls[2] == (
        "relaunch",
        1,  # the same generation
        {"worker": 1, "restore": 0, "stale_through": pending, "sink_generation": 2},
    )
    assert supervisor.current.workers[0] is survivor
    assert supervisor.current.workers[1] is not survivor and supervisor.budget.restarts == 1


def test_the_first_checkpoint_after_a_global_recovery_waits_until_every_restarted_worker_reads(
    tmp_path: Path, server: ControlServer
) -> None:
    """Regression (issue 38): the first checkpoint of a new generation fell due one interval
    after it started, before its workers had opened their tasks; they injected its barrier
    before reading anything, so it committed no new output and the first new output came a
    checkpoint later, behind the replayed backlog (10 s after a SIGKILL on Apache Kafka)."""
    supervisor, _launcher = _supervisor(tmp_path, server)
    supervisor.start_generation()
    supervisor.recover("worker 1 exit code 1", 1)
    workers = supervisor.current.workers
    assert supervisor.first_checkpoint() == "hold"  # still restoring and opening
    workers[0].stats = {"clicks.0": {"in": 5000}}  # its first counters
    assert supervisor.first_checkpoint() == "hold"
    workers[1].stats = {"clicks.1": {"in": 5000}}
    assert supervisor.first_checkpoint() == "now"  # once
    assert supervisor.first_checkpoint() == "periodic"


def test_the_first_checkpoint_of_a_job_is_triggered_as_soon_as_every_worker_reads(
    tmp_path: Path, server: ControlServer
) -> None:
    """Issue 51: a job's first output came one checkpoint interval after its workers read (1 s
    by default: most of the 1.7-2.2 s from launch to the first committed output)."""
    supervisor, _launcher = _supervisor(tmp_path, server)
    supervisor.start_generation()
    workers = supervisor.current.workers
    assert supervisor.first_checkpoint() == "hold"  # opening their tasks
    workers[0].stats = {"clicks.0": {"in": 12}}
    workers[1].stats = {"clicks.1": {"in": 0}}
    assert supervisor.first_checkpoint() == "now"
    assert supervisor.first_checkpoint() == "periodic"


def test_checkpoints_stay_periodic_under_local_recovery_while_the_survivors_run(
    tmp_path: Path, server: ControlServer
) -> None:
    """Holding the survivors' barriers until the restarted worker reads grew its backlog."""
    supervisor, _launcher = _supervisor(tmp_path, server, recovery="local")
    supervisor.start_generation()
    supervisor.recover("worker 1 exit code 1", 1)
    assert supervisor.first_checkpoint() == "periodic"


def test_a_restarted_worker_that_never_reads_holds_checkpoints_at_most_the_checkpoint_timeout(
    tmp_path: Path, server: ControlServer
) -> None:
    supervisor, _launcher = _supervisor(tmp_path, server)
    clock = [100.0]
    supervisor._clock = lambda: clock[0]
    supervisor.start_generation()
    supervisor.recover("worker 1 exit code 1", 1)
    assert supervisor.first_checkpoint() == "hold"
    clock[0] += supervisor.options.checkpoint_timeout + 1
    # periodic again: those checkpoints time out, and a stuck worker is restarted
    assert supervisor.first_checkpoint() == "periodic"


def test_a_dead_worker_the_launcher_cannot_name_restarts_globally_even_under_local_recovery(
    tmp_path: Path, server: ControlServer
) -> None:
    supervisor, launcher = _supervisor(tmp_path, server, recovery="local")
    supervisor.start_generation()
    supervisor.recover("the worker job ended", None)
    assert launcher.calls[1:] == [("stop_all", 1), ("launch", 2, [0, 1])]


def test_checkpoints_timing_out_in_a_row_make_a_stuck_worker_and_the_restart_answers_them(
    tmp_path: Path, server: ControlServer
) -> None:
    supervisor, _launcher = _supervisor(tmp_path, server)
    supervisor.start_generation()
    reason = "timed out after 60s; no ack from ['clicks.1']"
    supervisor.coordinator.timed_out = [reason] * 4  # tolerable: 3
    failure = supervisor.failed()
    assert failure is not None and failure[1] == 1 and "4 checkpoints in a row" in failure[0]
    assert supervisor.coordinator.timed_out == []
