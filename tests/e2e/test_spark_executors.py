"""What reaches the Spark executors (issue 39): the first-task check turns an executor Python
without eosflow, or a variable set on the driver only, into a one-line fix within 15 s of its
start; ``--env NAME`` forwards the variable, and the job then runs exactly once.

Local mode stands in for a cluster: the executors' Python is chosen with
``--conf spark.pyspark.python`` (the system Python, without eosflow's dependencies), or is a
wrapper that starts the driver's interpreter without a variable (an executor host whose
environment lacks it).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.cli import committed_output, eosflow, job_env
from tests.e2e.harness import PIPELINES, click_events, expected_running_totals, produce_clicks

pytestmark = [pytest.mark.integration, pytest.mark.spark, pytest.mark.xdist_group("spark")]

PIPELINE = str(PIPELINES / "running_total_work.py")  # reads os.environ["JOB_NAME"]
SYSTEM_PYTHON = "/usr/bin/python3"
FAIL_WITHIN_S = 15.0
#: Spark's own start on an idle 2-core machine (7-9 s). On a loaded one everything is slower
#: (Spark took 17-26 s at load 6-9): the 15 s are scaled by Spark's own start in the same run.
SPARK_START_S = 9.0
READY = re.compile(r"\[\s*([\d.]+)s\] .*: Spark \S+ on \S+ ready in ([\d.]+)s")
FAILED = re.compile(r"\[\s*([\d.]+)s\] .*: executor check failed in ([\d.]+)s")


# The local[2] stand-ins for a cluster run in the crash tier; the cluster is the real case.
@pytest.fixture(params=[pytest.param("local", marks=pytest.mark.crash), "cluster"])
def where(request: pytest.FixtureRequest) -> tuple[str, ...]:
    """The master: ``local[2]``, or the session's standalone cluster (``--master spark://…``),
    whose executors are JVMs of their own with the environment their worker started with."""
    if request.param == "local":
        return ()
    cluster = request.getfixturevalue("eosflow_spark_cluster")
    return ("--master", cluster.master_url, "--control-host", "127.0.0.1")


def _run(env: dict[str, str], *extra: str) -> tuple[subprocess.CompletedProcess[str], float]:
    if "--master" in extra:
        env = {**env, "SPARK_LOCAL_IP": "127.0.0.1"}
    argv = eosflow(
        "run", PIPELINE, "--runner", "spark", "--workers", "2", "--checkpoint-interval", "300ms",
        "--until-idle", *extra,
    )  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180)
    took = time.monotonic() - started
    print(f"took {took:.1f}s\n{done.stderr[-3000:]}")
    return done, took


def _assert_fast(done: subprocess.CompletedProcess[str], took: float) -> None:
    """The first-task check (it runs before the first barrier job) reported the fix, not the
    barrier job's restarts (about 50 s before the fix), within :data:`FAIL_WITHIN_S` of the
    check's own start, scaled on a loaded machine by Spark's own start in the same run
    (:data:`SPARK_START_S`). Spark's start is not eosflow's and is not bounded: under load it
    alone took 14.5 s of a 29.3 s report (CI, 2026-11-28)."""
    ready, failed = READY.search(done.stderr), FAILED.search(done.stderr)
    assert ready is not None and failed is not None, done.stderr[-3000:]
    # Spark's start measures the load of its own moment; the machine's load average (per core)
    # covers a check that ran later, when the crash tier's other jobs had started (CI failed
    # on it once with Spark's start fast and the check slow).
    per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    load = max(1.0, float(ready.group(2)) / SPARK_START_S, per_core)
    check = float(failed.group(2))
    print(
        f"fix reported {float(failed.group(1)):.1f}s after the start (exit {took:.1f}s), Spark "
        f"started in {ready.group(2)}s, load {per_core:.1f} per core, the check failed in "
        f"{check:.1f}s; "
        f"allowed {FAIL_WITHIN_S * load:.1f}s for the check"
    )
    assert check < FAIL_WITHIN_S * load, f"the executor check took {check:.1f}s to fail"


def _without(tmp: Path, name: str) -> str:
    """An executor Python: the driver's interpreter started without ``name``."""
    wrapper = tmp / "python-without-env"
    wrapper.write_text(f'#!/bin/sh\nunset {name}\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def test_an_executor_python_without_eosflow_fails_in_seconds_naming_pyspark_python(
    kafka_endpoint: tuple[str, str], tmp_path: Path, where: tuple[str, ...]
) -> None:
    """Regression: executors that ran ``python3`` without eosflow failed the barrier job with
    ``ModuleNotFoundError`` after about 50 s of restarts, with no hint of the fix (seen on a
    standalone cluster)."""
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.skip(f"no {SYSTEM_PYTHON} to stand for an executor Python without eosflow")
    lacks = subprocess.run([SYSTEM_PYTHON, "-c", "import confluent_kafka"], capture_output=True)
    if lacks.returncode == 0:
        pytest.skip(f"{SYSTEM_PYTHON} has eosflow's dependencies: it cannot stand for one without")
    env = job_env(kafka_endpoint[0], tmp_path, prefix="sparkpy")
    produce_clicks(kafka_endpoint[0], env["CLICKS_TOPIC"], 100)
    done, took = _run(env, "--conf", f"spark.pyspark.python={SYSTEM_PYTHON}", *where)
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("eosflow: error:")]
    assert SYSTEM_PYTHON in line and "cannot import eosflow" in line, line
    assert "set PYSPARK_PYTHON (or --conf spark.pyspark.python=PATH)" in line, line
    assert "--archives" in line, line
    _assert_fast(done, took)
    assert not Path(env["OUTPUT_DIR"]).exists()  # no worker ran


def test_a_variable_set_on_the_driver_only_fails_in_seconds_naming_env(
    kafka_endpoint: tuple[str, str], tmp_path: Path, where: tuple[str, ...]
) -> None:
    """Regression: a pipeline reading a variable the executors lacked failed with
    ``DefinitionError: loading pipeline ... KeyError`` after restarts, without naming the fix.
    On the cluster the executors lack it for real (their worker JVMs never had it); on
    ``local[2]`` their Python is started without it."""
    env = job_env(kafka_endpoint[0], tmp_path, prefix="sparkenv")
    env["PYSPARK_PYTHON"] = _without(tmp_path, "JOB_NAME") if not where else sys.executable
    produce_clicks(kafka_endpoint[0], env["CLICKS_TOPIC"], 100)
    done, took = _run(env, *where)
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("eosflow: error:")]
    assert "KeyError: 'JOB_NAME'" in line and "forward it with --env JOB_NAME" in line, line
    _assert_fast(done, took)


def test_env_forwards_a_variable_to_the_executors_and_the_job_runs_exactly_once(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    """``--env JOB_NAME``: the same executors as above now load the pipeline."""
    records = 3_000
    env = job_env(kafka_endpoint[0], tmp_path, prefix="sparkenv", WORK_US="0")
    env["PYSPARK_PYTHON"] = _without(tmp_path, "JOB_NAME")
    produce_clicks(kafka_endpoint[0], env["CLICKS_TOPIC"], records)
    done, _ = _run(env, "--env", "JOB_NAME")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "executors checked in" in done.stderr
    assert committed_output(env) == expected_running_totals(click_events(records))
