"""The Spark runner under crashes: worker tasks' Python processes are SIGKILLed, the driver
re-submits the barrier job by itself, and the committed output is exactly the expectation.

Each test prints its seed; rerun one with ``EOSFLOW_CHAOS_SEED=<seed>``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import generate_latest

from processor.runtime.supervision.local import Fault
from tests.e2e.harness import (
    assert_exactly_once,
    chaos_seed,
    expected,
    expected_running_totals,
    run_chaos,
)
from tests.e2e.scrape import Scraper, assert_monotonic, samples, value

# One Spark at a time (xdist group): two at once took the suite's load to 12 on 2 cores.
pytestmark = [
    pytest.mark.integration,
    pytest.mark.chaos,
    pytest.mark.spark,
    pytest.mark.xdist_group("spark"),
]


def test_spark_job_recovers_by_itself_from_two_sigkilled_workers_exactly_once(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    """100,000 clicks on ``local[2]``: one named fault (a worker dies between a completed
    checkpoint and its commit), then two SIGKILLs of a worker task's Python process at random
    moments. Every restart is a new barrier job and a new generation. The driver serves the
    metrics throughout (issue 25): they are scraped during the run and checked at the end."""
    seed = chaos_seed()
    records = 100_000
    scraper = Scraper()
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
        run_options={"metrics": "127.0.0.1:0"},
        during=scraper,
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
    assert len(scraper.metrics) >= 3, f"only {len(scraper.metrics)} scrapes of the driver"
    assert scraper.runner is not None and scraper.runner.metrics is not None
    final = samples(generate_latest(scraper.runner.metrics.registry).decode())
    assert_monotonic([*scraper.metrics, final])
    assert value(final, "eosflow_restarts_total", cause="killed") == 3
    assert value(final, "eosflow_generation") == run.result.generation
    assert value(final, "eosflow_job_info", runner="spark") == 1
    # The killed generations' reads stay counted, in the metrics and in the result alike (one
    # tally: processor/runtime/observe/tally.py), beyond what the last generation read. (Not
    # beyond the input: a killed worker's last second of counts never came.)
    last = sum(
        int(st["in"])
        for w in scraper.runner.current.workers
        for task, st in w.stats.items()
        if task.startswith("clicks.")
    )
    assert value(final, "eosflow_records_in_total") == run.result.records_in > last
    assert value(final, "eosflow_checkpoints_completed_total") == run.result.checkpoints
