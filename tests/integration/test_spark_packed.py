"""The packed-virtualenv route to a Spark cluster, as docs/spark.md tells users to take it.

It builds a wheel of this repository, installs it into a fresh virtualenv, packs that with
``venv-pack``, and runs the README example's pipeline on the session's Spark standalone cluster
(the ``eosflow_spark_cluster`` fixture) through ``spark-submit --archives env.tar.gz#environment``
with ``PYSPARK_PYTHON=./environment/bin/python``. The committed output
must equal the expectation, and the workers' logs must show they ran on the unpacked
environment's Python.

This is also the test of the runner on a non-``local`` master: the pipeline is shipped with
``addFile``, and the job's variables reach the executors through ``spark.executorEnv.*``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

import pytest

import processor.cli
from processor.embedded.spark_cluster import SparkCluster
from sinks import read_jsonl
from tests.e2e.harness import canonical, click_events, expected_running_totals, produce_clicks

pytestmark = [pytest.mark.integration, pytest.mark.spark, pytest.mark.xdist_group("spark")]

ROOT = Path(__file__).resolve().parents[2]
RECORDS = 20_000


def _spark_bin(name: str) -> str:
    import pyspark

    return str(Path(pyspark.__file__).parent / "bin" / name)


@pytest.fixture(scope="module")
def packed_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """eosflow (a wheel of this checkout, not editable) in a fresh virtualenv, venv-packed."""
    venv_pack = shutil.which("venv-pack") or str(Path(sys.executable).parent / "venv-pack")
    if not Path(venv_pack).exists():
        pytest.fail("venv-pack is missing: it is in the dev extra (pip install -e '.[dev]')")
    work = tmp_path_factory.mktemp("packed")

    def run(*argv: str) -> None:
        out = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=900)
        assert out.returncode == 0, f"{' '.join(argv)}:\n{out.stdout[-2000:]}{out.stderr[-2000:]}"

    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(work / "wheels"),
        str(ROOT))  # fmt: skip
    wheel = next((work / "wheels").glob("eosflow-*.whl"))
    run(sys.executable, "-m", "venv", str(work / "env"))
    run(str(work / "env" / "bin" / "pip"), "install", "-q", str(wheel))
    archive = work / "eosflow-env.tar.gz"
    run(venv_pack, "-q", "-p", str(work / "env"), "-o", str(archive))
    return archive


@pytest.mark.slow  # 60 s with its packing: CI keeps under 30 minutes (the Spark runner stays
# covered in CI by test_spark.py, the Spark sink crash tests and test_cli_run.py)
def test_example_runs_on_a_standalone_cluster_from_a_packed_virtualenv(
    kafka_endpoint: tuple[str, str],
    tmp_path: Path,
    eosflow_spark_cluster: SparkCluster,
    packed_env: Path,
) -> None:
    standalone = eosflow_spark_cluster.master_url
    run_id = uuid.uuid4().hex[:8]
    job_env = {
        "JOB_NAME": f"packed-{run_id}",
        "CLICKS_TOPIC": f"packed-clicks-{run_id}",
        "OUTPUT_DIR": str(tmp_path / "out"),
    }
    produce_clicks(kafka_endpoint[0], job_env["CLICKS_TOPIC"], RECORDS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EOSFLOW_")}
    env.update(
        job_env,
        EOSFLOW_KAFKA_BROKERS=kafka_endpoint[0],
        EOSFLOW_STATE_DIR=str(tmp_path / "state"),
        SPARK_LOCAL_IP="127.0.0.1",
        PYSPARK_DRIVER_PYTHON=sys.executable,
        PYSPARK_PYTHON="./environment/bin/python",
    )
    executor_env = [f"--conf=spark.executorEnv.{k}={v}" for k, v in job_env.items()]
    argv = [
        _spark_bin("spark-submit"), "--master", standalone,
        "--archives", f"{packed_env}#environment", *executor_env,
        processor.cli.__file__,
        "run", str(ROOT / "examples" / "running_total.py"), "--runner", "spark",
        "--until-idle", "--checkpoint-interval", "500ms", "--control-host", "127.0.0.1",
        "--max-restarts", "2",
    ]  # fmt: skip
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-4000:]
    assert f"job {job_env['JOB_NAME']} finished: {RECORDS:,} records in" in out.stdout
    got = Counter(canonical(x) for x in read_jsonl(job_env["OUTPUT_DIR"]))
    assert got == expected_running_totals(click_events(RECORDS))
    logs = (tmp_path / "state" / "jobs" / job_env["JOB_NAME"]).glob("worker-*.log")
    pythons = {
        line.split("python=", 1)[1].split()[0]
        for path in logs
        for line in path.read_text().splitlines()
        if "python=" in line
    }
    assert pythons and all(p.endswith("/environment/bin/python") for p in pythons), pythons
    assert not any(p.startswith(sys.prefix) for p in pythons), pythons
