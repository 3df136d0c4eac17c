"""``eosflow run`` and ``eosflow status`` as a user runs them: subprocesses, real broker."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from processor.runtime.supervision.startup import PHASES
from tests.e2e.cli import committed_output, eosflow, job_env, status, wait_status
from tests.e2e.harness import (
    RUNNERS,
    click_events,
    expected_running_totals,
    produce_clicks,
)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
RECORDS = 20_000


def _env(brokers: str, tmp: Path) -> dict[str, str]:
    env = job_env(brokers, tmp, prefix="cli")
    produce_clicks(brokers, env["CLICKS_TOPIC"], RECORDS)
    return env


@pytest.mark.parametrize("runner", RUNNERS)
def test_run_until_idle_commits_everything_and_status_reports_it(
    kafka_endpoint: tuple[str, str], tmp_path: Path, runner: str
) -> None:
    env = _env(kafka_endpoint[0], tmp_path)
    pipeline = str(ROOT / "examples" / "running_total.py")
    result = subprocess.run(
        eosflow("run", pipeline, "--workers", "2", "--checkpoint-interval", "300ms",
                 "--until-idle", "--runner", runner),
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"job {env['JOB_NAME']} finished: {RECORDS:,} records read" in result.stdout
    assert "stage 'clicks'" in result.stderr and "checkpoint=" in result.stderr
    assert committed_output(env) == expected_running_totals(click_events(RECORDS))
    text = subprocess.run(
        eosflow("status", env["JOB_NAME"]), env=env, capture_output=True, text=True
    ).stdout
    assert "finished" in text and f"read {RECORDS:,}" in text
    assert f"runner {runner}" in text
    # Where the start went (issue 51): every mark, in the order a start passes them.
    startup = status(env)["startup"]
    marks = [startup[f"{phase}_s"] for phase in PHASES]
    assert marks == sorted(marks) and marks[0] > 0, startup
    assert startup["process_s"] > 0, startup  # the interpreter and imports before the runner
    (line,) = [ln for ln in text.splitlines() if ln.startswith("start ")]
    assert "before the runner; then compiled" in line and "first_committed" in line, line


@pytest.mark.parametrize("runner", RUNNERS)
def test_sigint_stops_a_streaming_job_after_a_final_checkpoint(
    kafka_endpoint: tuple[str, str], tmp_path: Path, runner: str
) -> None:
    """Ctrl-C in a terminal: SIGINT to the whole process group (on Spark, the JVM and its
    Python workers too), and still a final checkpoint is committed before everything exits."""
    env = _env(kafka_endpoint[0], tmp_path)
    pipeline = str(ROOT / "examples" / "running_total.py")
    proc = subprocess.Popen(
        eosflow("run", pipeline, "--checkpoint-interval", "5s", "--runner", runner),
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        found = wait_status(
            env, lambda s: s.get("records_out") == RECORDS and s.get("state") == "running"
        )
        assert found["alive"] is True
        # The runner (the driver on Spark) serves its metrics on the default range, and
        # `eosflow status` names the page.
        assert found["web"].startswith("http://127.0.0.1:92"), found["web"]
        # The workers' counters come every second; status.json's records_out is at least the
        # committed count, which a checkpoint's acks bring at once (the job's first checkpoint
        # follows its first reads), so the metrics may lag it by a second.
        deadline = time.monotonic() + 10
        while True:
            with urllib.request.urlopen(found["web"] + "metrics", timeout=10) as r:
                exposition = r.read().decode()
            out = [
                s.value
                for f in text_string_to_metric_families(exposition)
                for s in f.samples
                if s.name == "eosflow_records_out_total"
            ]
            if out == [RECORDS] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert out == [RECORDS], exposition[:2000]
        text = subprocess.run(
            eosflow("status", env["JOB_NAME"]), env=env, capture_output=True, text=True
        ).stdout
        assert f"job page   {found['web']}" in text, text
        # Every record was processed, but with a 5 s interval most are not committed yet:
        # the stop must take a final checkpoint and commit it before the workers exit.
        os.killpg(proc.pid, signal.SIGINT)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    assert "SIGINT: stopping after a final checkpoint" in err
    assert committed_output(env) == expected_running_totals(click_events(RECORDS))
    for worker in found["workers"]:
        assert (
            not Path(f"/proc/{worker['pid']}").exists()
            or "Z" in Path(f"/proc/{worker['pid']}/stat").read_text().rsplit(")", 1)[1].split()[0]
        )


def test_run_fails_in_seconds_with_one_clear_error_when_the_broker_is_unreachable(
    tmp_path: Path,
) -> None:
    """Regression (issue 17): with EOSFLOW_KAFKA_BROKERS naming a dead address, ``eosflow run``
    printed about 580 librdkafka error lines over 30 s, then a raw traceback."""
    import socket

    with socket.socket() as s:  # a free port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EOSFLOW_")}
    env.update(
        EOSFLOW_KAFKA_BROKERS=dead,
        EOSFLOW_STATE_DIR=str(tmp_path / "state"),
        JOB_NAME="unreachable",
        CLICKS_TOPIC="clicks",
        OUTPUT_DIR=str(tmp_path / "out"),
    )
    started = time.monotonic()
    result = subprocess.run(
        eosflow("run", str(ROOT / "examples" / "running_total.py"), "--until-idle"),
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    took = time.monotonic() - started
    print(f"exit {result.returncode} after {took:.1f}s; stderr:\n{result.stderr}")
    assert result.returncode == 2
    assert f"eosflow: error: cannot reach Kafka at {dead} (EOSFLOW_KAFKA_BROKERS)" in result.stderr
    assert "Traceback" not in result.stderr
    assert "rdkafka" not in result.stderr  # no client's connection errors, one message
    assert took < 20


def test_run_fails_in_seconds_with_one_clear_error_when_the_dedup_redis_is_unreachable(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    """Regression (issue 18): a ``dedup`` step with Redis down started, timed its checkpoints
    out for minutes, and named Redis only when the ID store gave up after 5 minutes."""
    import socket

    with socket.socket() as s:  # a free port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"redis://127.0.0.1:{s.getsockname()[1]}/0"
    env = _env(kafka_endpoint[0], tmp_path)  # a live broker with the input: only Redis is down
    env["EOSFLOW_REDIS_URL"] = dead
    pipeline = ROOT / "tests" / "e2e" / "pipelines" / "dedup_window_count.py"
    started = time.monotonic()
    result = subprocess.run(
        eosflow("run", str(pipeline), "--until-idle"),
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    took = time.monotonic() - started
    print(f"exit {result.returncode} after {took:.1f}s; stderr:\n{result.stderr}")
    assert result.returncode == 2
    assert (
        "eosflow: error: dedup step 'unique' keeps record IDs in Redis, which did not answer at "
        f"{dead} (EOSFLOW_REDIS_URL) within 5s" in result.stderr
    )
    assert "Traceback" not in result.stderr
    assert took < 20


def test_run_refuses_local_recovery_of_a_running_total_that_crosses_a_second_shuffle(
    tmp_path: Path,
) -> None:
    """Issue 19: under --recovery local this pipeline's re-emitted totals would depend on the
    replay's interleaving (a mix of old and new values downstream). It is refused before
    anything starts, with the reason and the alternatives; no server is needed to say so."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EOSFLOW_")}
    env.update(EOSFLOW_STATE_DIR=str(tmp_path / "state"), EOSFLOW_KAFKA_BROKERS="127.0.0.1:9")
    pipeline = ROOT / "tests" / "e2e" / "pipelines" / "two_shuffle_total.py"
    result = subprocess.run(
        eosflow("run", str(pipeline), "--recovery", "local", "--until-idle"),
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "--recovery local cannot keep step 'totals' exactly once" in result.stderr
    assert "Use --recovery global" in result.stderr
