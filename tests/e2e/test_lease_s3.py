"""A runner on an S3 snapshot store that loses its job's lease stops, saying so (issue 35, item 7).

``eosflow run --snapshot-url s3://...`` against moto's S3 server on loopback (the runner and
its workers reach it over HTTP through s3fs, configured by the standard AWS variables). The
runner is frozen (SIGSTOP) past the lease's 30 s; another runner takes the stale lease over;
the frozen one, resumed, must learn it at its next renewal and stop with a message that names
the new holder: never go on, never report success.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from processor.snapshot.lease import JobLease, lease_holder
from processor.snapshot.store import SnapshotStore
from tests.e2e.cli import eosflow, job_env, wait_status
from tests.e2e.harness import produce_clicks
from tests.integration.s3_server import ACCESS, S3Server, s3_server

__all__ = ["s3_server"]  # the fixture, imported to be used here

ROOT = Path(__file__).resolve().parents[2]
RUNNING_TOTAL = str(ROOT / "examples" / "running_total.py")
TTL = 30.0  # the runner's lease TTL (JobLease's default)


def test_a_frozen_runner_whose_lease_was_taken_over_stops_at_its_next_renewal(
    kafka_endpoint: tuple[str, str], tmp_path: Path, s3_server: S3Server
) -> None:
    url = f"s3://{s3_server.bucket()}/eosflow"
    env = job_env(
        kafka_endpoint[0],
        tmp_path,
        prefix="lease",
        AWS_ENDPOINT_URL=s3_server.endpoint,
        AWS_ACCESS_KEY_ID=ACCESS["key"],
        AWS_SECRET_ACCESS_KEY=ACCESS["secret"],
        AWS_DEFAULT_REGION="us-east-1",
    )
    job = env["JOB_NAME"]
    produce_clicks(kafka_endpoint[0], env["CLICKS_TOPIC"], 200)
    runner = subprocess.Popen(
        eosflow("run", RUNNING_TOTAL, "--snapshot-url", url, "--checkpoint-interval", "2s"),
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    store = SnapshotStore(url, **s3_server.storage_options())
    other = JobLease(store, job)
    try:
        wait_status(env, lambda s: s.get("state") == "running", timeout=240)
        frozen = lease_holder(store, job)
        assert frozen is not None and frozen["pid"] == runner.pid
        os.kill(runner.pid, signal.SIGSTOP)
        time.sleep(max(0.0, frozen["renewed_ms"] / 1000 + TTL + 1 - time.time()))
        other.acquire()  # the lease went stale: another runner takes the job over
        os.kill(runner.pid, signal.SIGCONT)
        _out, err = runner.communicate(timeout=120)
    finally:
        if runner.poll() is None:
            os.killpg(runner.pid, signal.SIGKILL)
            runner.wait(30)
    assert runner.returncode == 2, err[-3000:]
    assert f"eosflow: error: job '{job}': this runner (token {frozen['token']}) lost the " in err
    assert f"lease to runner pid {os.getpid()} " in err and f"token {other.token}" in err
    assert "finished" not in err
    holder = lease_holder(store, job)  # the frozen runner's release left the new one's alone
    assert holder is not None and holder["token"] == other.token and not holder.get("released")
    other.release()
