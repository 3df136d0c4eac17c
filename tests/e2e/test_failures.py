"""Failures that restarting cannot fix end the job with a message that names the cause."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest

from processor.compiler import Plan
from processor.runtime.supervision.local import JobFailed, LocalRunner, RunOptions
from tests.e2e.harness import PIPELINES, produce_clicks

pytestmark = pytest.mark.integration


def _failing_map_runner(
    brokers: str, tmp: Path, name: str, records: int, *, max_restarts: int
) -> LocalRunner:
    """``failing_map.py`` over ``records`` fresh clicks, restarting quickly."""
    run_id = uuid.uuid4().hex[:8]
    env = {
        "JOB_NAME": f"{name}-{run_id}",
        "CLICKS_TOPIC": f"{name}-{run_id}",
        "OUTPUT_DIR": str(tmp / "out"),
        "EOSFLOW_KAFKA_BROKERS": brokers,
    }
    produce_clicks(brokers, env["CLICKS_TOPIC"], records)
    options = RunOptions(
        until_idle=True,
        environ=env,
        state_dir=str(tmp / "state"),
        max_restarts=max_restarts,
        restart_backoff=0.05,
    )
    return LocalRunner(str(PIPELINES / "failing_map.py"), options)


def test_a_function_that_fails_on_the_same_record_again_fails_the_job_at_once(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    """A deterministic user error (no dead-letter destination): one restart shows the same
    record fails again, so the job fails then, naming the step, the record and the exception,
    instead of using up its restarts."""
    runner = _failing_map_runner(kafka_endpoint[0], tmp_path, "failing", 2_000, max_restarts=10)
    started = time.monotonic()
    with pytest.raises(
        JobFailed,
        match=r"the same failure again after a restart, so restarting cannot fix it: .*"
        r"UserFunctionError: step 'check' \(task clicks\.\d\) raised ValueError: cannot "
        r"handle c-7-777 on the record from failing-\w+\[\d\] at offset \d+",
    ):
        runner.run()
    assert len(runner.restart_causes) == 2 and runner.restarts == 2
    assert time.monotonic() - started < 30


def test_missing_source_topic_is_refused_at_start_up_with_a_fix(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    env = {
        "JOB_NAME": "missing-topic",
        "CLICKS_TOPIC": f"no-such-topic-{uuid.uuid4().hex[:8]}",
        "OUTPUT_DIR": str(tmp_path / "out"),
        "EOSFLOW_KAFKA_BROKERS": kafka_endpoint[0],
    }
    options = RunOptions(until_idle=True, environ=env, state_dir=str(tmp_path / "state"))
    runner = LocalRunner(str(PIPELINES / "failing_map.py"), options)
    with pytest.raises(ValueError, match=r"does not exist.*create it"):
        runner.run()
    from connectors import KafkaSettings, TopicAdmin

    admin = TopicAdmin(KafkaSettings.from_env(brokers=kafka_endpoint[0]))
    assert not admin.exists(env["CLICKS_TOPIC"]), "checking must not create the topic"


def test_workers_that_cannot_start_fail_the_job_fast_with_the_reason(
    kafka_endpoint: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that compiles another plan than its runner (e.g. a Spark executor without the
    environment variables the pipeline reads) refuses to start; the same start-up failure three
    times in a row fails the job instead of using up the restart budget."""
    runner = _failing_map_runner(kafka_endpoint[0], tmp_path, "unstartable", 100, max_restarts=10)
    # The runner's view differs from what the worker processes compile.
    monkeypatch.setattr(Plan, "fingerprint", lambda _self: "0" * 16)
    with pytest.raises(JobFailed, match=r"failed 3 times in a row before they all started"):
        runner.run()
    assert runner.restarts == 3
    assert "compiled differently in worker" in runner.restart_causes[-1]
    # status.json (eosflow status, the saved job page) says so: not "running" with no runner
    status = json.loads((runner.dir / "status.json").read_text())
    assert status["state"] == "failed", status["state"]
