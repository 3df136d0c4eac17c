"""A worker alive but stuck is restarted, and the output stays exactly once (issue 17).

* A worker process SIGSTOPped (frozen, or an executor cut off from the coordinator) falls
  silent: no heartbeat for longer than ``heartbeat_timeout``, and the runner restarts it.
* A user function that blocks keeps the process's heartbeat going but never lets its task
  acknowledge: checkpoints time out, and more than ``tolerable_failed_checkpoints`` of them in a
  row restart the job.

Before, neither was ever restarted: checkpoints timed out forever and ``--until-idle`` never
ended. The committed output is compared with the answer computed without the engine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

from processor.runtime.supervision.runner import Runner, default_snapshot_url
from processor.snapshot.store import SnapshotStore
from tests.e2e.harness import (
    RUNNERS,
    assert_exactly_once,
    chaos_seed,
    expected,
    expected_running_totals,
    run_chaos,
)

pytestmark = [pytest.mark.integration, pytest.mark.chaos]


def _stop_a_worker(stopped: list[int]) -> object:
    """SIGSTOPs worker 1 once a checkpoint completed (progress, not a timer); SIGCONTs it once
    the next generation runs (a zombie waking up), or after a minute, so that a runner
    without heartbeats fails the test instead of hanging it."""

    def during(runner: Runner) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            workers = list(getattr(runner, "workers", []))
            coordinator = getattr(runner, "coordinator", None)
            ready = len(workers) == 2 and all(w.conn is not None and w.pid for w in workers)
            if ready and coordinator is not None and coordinator.stats.completed >= 1:
                break
            time.sleep(0.05)
        else:
            return
        generation, pid = runner.generation, workers[1].pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)
        wake = time.monotonic() + 60
        while time.monotonic() < wake:
            if runner.generation > generation and all(
                w.conn is not None for w in list(runner.workers)
            ):
                break
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)

    return during


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_sigstopped_worker_is_restarted_after_the_heartbeat_timeout_exactly_once(
    kafka_endpoint: tuple[str, str], tmp_path: Path, runner: str
) -> None:
    """On Spark this is the zombie of issue 19: the stopped Python worker of a cancelled
    generation is woken up once the next generation runs. Whatever it still does must not be
    visible: the output is compared exactly, and every checkpoint's manifest names only
    snapshots written by the generation that acknowledged them."""
    seed = chaos_seed()
    records = 60_000
    stopped: list[int] = []
    try:
        run = run_chaos(
            "running_total_work.py",
            brokers=kafka_endpoint[0],
            tmp=tmp_path,
            records=records,
            seed=seed,
            mode="aligned",
            interval=0.5,
            runner=runner,
            run_options={"heartbeat_timeout": 3.0},
            during=_stop_a_worker(stopped),  # type: ignore[arg-type]
        )
    finally:
        for pid in stopped:  # never leave a stopped process behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    assert stopped, f"seed={seed}: the job ended before a worker could be stopped"
    causes = run.result.restart_causes
    assert any("sent nothing" in c and "heartbeat timeout 3s" in c for c in causes), causes
    assert_exactly_once(expected(expected_running_totals, records, seed), run.output, seed=seed)
    time.sleep(1.0)
    with pytest.raises(ProcessLookupError):  # the runner killed the stopped worker
        os.kill(stopped[0], 0)
    store = SnapshotStore(default_snapshot_url(run.result.job, str(tmp_path / "state")))
    for chk in store.completed_ids(run.result.job):
        manifest = store.load(run.result.job, chk)
        names = [h.path.rsplit("/", 1)[-1] for h in manifest.tasks.values()]
        incarnations = {n.rsplit(".g", 1)[-1] for n in names}
        assert len(incarnations) == 1, f"checkpoint {chk} mixes generations: {names}"


def test_a_blocked_user_function_restarts_after_tolerable_failed_checkpoints_exactly_once(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    seed = chaos_seed()
    records = 20_000
    block_file = tmp_path / "blocked-once"
    run = run_chaos(
        "blocking_total.py",
        brokers=kafka_endpoint[0],
        tmp=tmp_path,
        records=records,
        seed=seed,
        mode="aligned",
        interval=0.3,
        env={"BLOCK_FILE": str(block_file), "BLOCK_AT": "5000"},
        run_options={"checkpoint_timeout": 2.0, "tolerable_failed_checkpoints": 1},
    )
    assert block_file.exists(), f"seed={seed}: no worker reached the blocking record"
    causes = run.result.restart_causes
    assert any("2 checkpoints in a row timed out (tolerable: 1)" in c for c in causes), causes
    assert_exactly_once(expected(expected_running_totals, records, seed), run.output, seed=seed)
