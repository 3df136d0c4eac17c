"""The Spark runner on a standalone cluster, as users run it (issue 39): a master and two worker
JVMs started from the ``pyspark`` package (the ``eosflow_spark_cluster`` fixture), the driver
in this process or in ``eosflow run``, and what a cluster can lose: an executor JVM, a whole
worker JVM (its executors die with it), the driver.

Each kill is SIGKILL, placed by the job's progress (:class:`processor.testing.Killer`), on
the JVM that runs a worker task's Python process; the output is compared with the answer
computed from the generated input. Each test prints its seed; rerun one with
``EOSFLOW_CHAOS_SEED=<seed>``.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from processor.embedded.spark_cluster import SparkCluster
from processor.runtime.job import job_dir
from processor.runtime.supervision.spark import SparkOptions
from tests.e2e.cli import committed_output, eosflow, job_env, status, wait_status
from tests.e2e.harness import (
    PIPELINES,
    ChaosRun,
    assert_exactly_once,
    chaos_seed,
    expected,
    expected_running_totals,
    expected_window_counts,
    produce_clicks,
    run_chaos,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.chaos,
    pytest.mark.spark,
    pytest.mark.xdist_group("spark"),
]


RECORDS = 60_000


@pytest.fixture(autouse=True)
def _loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARK_LOCAL_IP", "127.0.0.1")  # the driver binds loopback


def _options(cluster: SparkCluster) -> SparkOptions:
    return SparkOptions(
        master=cluster.master_url,
        control_host="127.0.0.1",
        conf={"spark.pyspark.python": sys.executable},
    )


def _chaos_on(
    cluster: SparkCluster,
    pipeline: str,
    brokers: str,
    tmp: Path,
    kills: int,
    target: Callable[[int], int | None],
) -> tuple[ChaosRun, int, list[int]]:
    """60,000 clicks through ``pipeline`` on ``cluster`` with ``kills`` SIGKILLs of what
    ``target(worker pid)`` names; returns the run, its seed and the PIDs killed."""
    seed = chaos_seed()
    hit: list[int] = []

    def recorded(pid: int) -> int | None:
        found = target(pid)
        if found is not None:
            hit.append(found)
        return found

    run = run_chaos(
        pipeline, brokers=brokers, tmp=tmp, records=RECORDS, seed=seed, mode="aligned",
        random_kills=kills, env={"WORK_US": "150"}, runner="spark", spark=_options(cluster),
        kill_target=recorded,
    )  # fmt: skip
    print(f"seed={seed} kills={run.random_kills} JVMs killed={hit}")
    print(f"restarts={run.result.restarts} causes={run.result.restart_causes}")
    assert len(run.random_kills) == kills, f"seed={seed}: the job ended before {kills} kills"
    assert run.result.restarts >= kills, run.result.restart_causes
    return run, seed, hit


@pytest.mark.crash  # README command 2 keeps Spark under SIGKILLs on local[2] (test_spark.py)
def test_running_total_on_a_cluster_is_exactly_once_when_executor_jvms_are_sigkilled(
    kafka_endpoint: tuple[str, str], tmp_path: Path, eosflow_spark_cluster: SparkCluster
) -> None:
    """Two SIGKILLs of the executor JVM that runs a worker task: Spark fails the job with the
    executor lost, the master starts a new executor on that worker, and the driver submits
    the next generation, which restores the last completed checkpoint."""
    cluster = eosflow_spark_cluster
    run, seed, killed = _chaos_on(
        cluster, "running_total_work.py", kafka_endpoint[0], tmp_path, 2, cluster.executor_of
    )
    assert len(set(killed)) == 2, killed  # two distinct executor JVMs, each SIGKILLed
    want = expected(expected_running_totals, RECORDS, seed)
    assert_exactly_once(want, run.output, seed=seed)


@pytest.mark.crash
def test_windowed_count_on_a_cluster_is_exactly_once_when_a_worker_jvm_is_sigkilled(
    kafka_endpoint: tuple[str, str], tmp_path: Path, eosflow_spark_cluster: SparkCluster
) -> None:
    """The whole worker JVM of the host running a worker task is SIGKILLed: its executors
    see their worker gone and exit, the master drops the worker, and the next generation
    runs on the worker left (2 cores: both tasks fit)."""
    cluster = eosflow_spark_cluster

    def worker_jvm(pid: int) -> int | None:
        worker = cluster.worker_of(pid)
        return worker.process.pid if worker is not None else None

    run, seed, killed = _chaos_on(
        cluster, "windowed_count_work.py", kafka_endpoint[0], tmp_path, 1, worker_jvm
    )
    assert killed[0] in [w.process.pid for w in cluster.workers]
    assert cluster.alive_workers() == 1  # the killed worker stayed dead: the job ran on one
    want = expected(expected_window_counts, RECORDS, seed)
    assert_exactly_once(want, run.output, seed=seed)


@pytest.mark.crash
def test_a_sigkilled_driver_resumes_on_the_next_eosflow_run(
    kafka_endpoint: tuple[str, str], tmp_path: Path, eosflow_spark_cluster: SparkCluster
) -> None:
    """``eosflow run --master spark://…`` is SIGKILLed after two completed checkpoints (its
    Spark application ends with it; the tasks lose their coordinator and exit); the next
    ``eosflow run --until-idle`` restores the last checkpoint and finishes exactly once."""
    cluster = eosflow_spark_cluster
    records = 40_000
    env = job_env(kafka_endpoint[0], tmp_path, "sparkdrv", WORK_US="150")
    env["SPARK_LOCAL_IP"] = "127.0.0.1"
    seed = chaos_seed()
    produce_clicks(env["EOSFLOW_KAFKA_BROKERS"], env["CLICKS_TOPIC"], records, seed=seed)
    argv = eosflow(
        "run", str(PIPELINES / "running_total_work.py"), "--runner", "spark",
        "--master", cluster.master_url, "--control-host", "127.0.0.1",
        "--conf", f"spark.pyspark.python={sys.executable}", "--workers", "2",
        "--checkpoint-interval", "500ms",
        "--env", "JOB_NAME", "--env", "CLICKS_TOPIC", "--env", "OUTPUT_DIR", "--env", "WORK_US",
    )  # fmt: skip
    log = tmp_path / "driver-1.log"
    with log.open("w") as out:
        driver = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        found = wait_status(
            env, lambda s: s.get("checkpoint", {}).get("completed", 0) >= 2, timeout=180
        )
    except AssertionError:
        driver.kill()
        raise AssertionError(log.read_text()[-3000:]) from None
    driver.kill()  # SIGKILL: no final checkpoint, no goodbye to the cluster
    driver.wait(30)
    print(f"driver SIGKILLed at {found['checkpoint']}, read {found.get('records_in')}")
    assert status(env).get("state") != "finished"
    # The Spark application of the dead driver goes away with it (its JVM exits when the
    # Python driver's pipe closes); its executors with it.
    deadline = time.monotonic() + 60
    while cluster.state().get("activeapps") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not cluster.state().get("activeapps"), cluster.state().get("activeapps")
    again = subprocess.run(
        [*argv, "--until-idle"], env=env, capture_output=True, text=True, timeout=300
    )
    print(again.stderr[-2000:])
    assert again.returncode == 0, again.stderr[-3000:]
    logs = " ".join(
        p.read_text()
        for p in job_dir(env["JOB_NAME"], env["EOSFLOW_STATE_DIR"]).glob("worker-*.log")
    )
    restored = [int(n) for n in re.findall(r"restored_checkpoint=(\d+)", logs)]
    assert restored and max(restored) >= found["checkpoint"]["last_completed"], restored
    assert_exactly_once(
        expected(expected_running_totals, records, seed), committed_output(env), seed=seed
    )


@pytest.mark.crash  # a misconfigured cluster: with the other cluster faults
def test_a_cluster_that_starts_no_executor_fails_the_run_with_the_causes(
    kafka_endpoint: tuple[str, str], tmp_path: Path, eosflow_spark_cluster: SparkCluster
) -> None:
    """Regression: executors that never start (here: more memory asked than any worker has;
    on separate hosts, a host that could not resolve its own name) left the run waiting for
    ever in the first-task check ("Initial job has not accepted any resources")."""
    cluster = eosflow_spark_cluster
    env = job_env(kafka_endpoint[0], tmp_path, "sparknone", EOSFLOW_SPARK_CHECK_TIMEOUT="8")
    env["SPARK_LOCAL_IP"] = "127.0.0.1"
    produce_clicks(env["EOSFLOW_KAFKA_BROKERS"], env["CLICKS_TOPIC"], 100)
    argv = eosflow(
        "run", str(PIPELINES / "running_total_work.py"), "--runner", "spark",
        "--master", cluster.master_url, "--control-host", "127.0.0.1",
        "--conf", f"spark.pyspark.python={sys.executable}", "--conf", "spark.executor.memory=64g",
        "--workers", "2", "--until-idle", "--env", "JOB_NAME", "--env", "CLICKS_TOPIC",
        "--env", "OUTPUT_DIR",
    )  # fmt: skip
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("eosflow: error:")]
    assert "no executor ran the first-task check within 8s (0 executor(s) registered)" in line
    assert "spark.driver.host" in line and "EOSFLOW_SPARK_CHECK_TIMEOUT" in line, line
