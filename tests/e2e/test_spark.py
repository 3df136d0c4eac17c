"""The Spark runner under crashes: worker tasks' Python processes are SIGKILLed, the driver
re-submits the barrier job by itself, and the committed output is exactly the expectation.

Each test prints its seed; rerun one with ``EOSFLOW_CHAOS_SEED=<seed>``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from processor.runtime.local import Fault
from tests.e2e.harness import (
    assert_exactly_once,
    chaos_seed,
    expected,
    expected_running_totals,
    run_chaos,
)

pytestmark = [pytest.mark.integration, pytest.mark.chaos, pytest.mark.spark]


def test_spark_job_recovers_by_itself_from_two_sigkilled_workers_exactly_once(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    """100,000 clicks on ``local[2]``: one named fault (a worker dies between a completed
    checkpoint and its commit), then two SIGKILLs of a worker task's Python process at random
    moments. Every restart is a new barrier job and a new generation."""
    seed = chaos_seed()
    records = 100_000
    run = run_chaos(
        "running_total_work.py",
        brokers=kafka_endpoint[0],
        tmp=tmp_path,
        records=records,
        seed=seed,
        mode="aligned",
        interval=0.5,
        faults=[Fault(0, 1, "after-completion-before-commit", 1)],
        random_kills=2,
        env={"WORK_US": "200"},
        runner="spark",
    )
    print(f"seed={seed} random kills (s after start, worker): {run.random_kills}")
    print(f"restarts={run.result.restarts} causes={run.result.restart_causes}")
    assert run.faults_fired == [(1, "after-completion-before-commit")], run.faults_fired
    assert len(run.random_kills) == 2, f"seed={seed}: the job ended before 2 random kills"
    assert run.result.restarts == 3, run.result.restart_causes
    assert all("Python process died" in c for c in run.result.restart_causes), (
        run.result.restart_causes
    )
    assert run.result.generation == run.result.restarts + 1  # a fresh job: generations 1..4
    assert_exactly_once(expected(expected_running_totals, records, seed), run.output, seed=seed)
