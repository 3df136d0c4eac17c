"""The compose deployment built and run here: docker/compose.local.yaml brings up Apache Kafka
and Redis from the local images (docker/images/, a Debian base from debootstrap), and the eosflow
app container runs a job next to them to completion, every output record exactly once.

Needs a Docker engine and Docker Compose (``docker compose`` v2 or Debian's ``docker-compose``);
without them it skips. The images come from scripts/docker_images.py (cached: built once).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from processor.testing.servers import NO_DOCKER, docker_engine_available

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker" / "compose.local.yaml"
RECORDS = 20_000


def _compose_command() -> list[str] | None:
    """``docker compose`` (v2) if the CLI has it, else ``docker-compose`` (v1), else None."""
    if shutil.which("docker") is not None:
        done = subprocess.run(["docker", "compose", "version"], capture_output=True)
        if done.returncode == 0:
            return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") is not None else None


COMPOSE = _compose_command()

pytestmark = [
    pytest.mark.skipif(not docker_engine_available(), reason=NO_DOCKER),
    pytest.mark.skipif(
        COMPOSE is None,
        reason="no Docker Compose: neither 'docker compose' (v2) nor 'docker-compose' (v1)",
    ),
]


def _images() -> dict[str, str]:
    """The local images, built by scripts/docker_images.py when missing or outdated."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "docker_images.py"), "build",
         "--only", "kafka,redis,app"],
        capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    if done.returncode != 0 and "no Kafka distribution" in done.stderr:
        pytest.skip(done.stderr.strip())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return dict(
        line.removeprefix("export ").split("=", 1)
        for line in done.stdout.splitlines()
        if line.startswith("export EOSFLOW_")
    )


def _free_port_pair() -> int:
    """A port p on 127.0.0.1 such that p and p + 1 are free (Kafka and its controller)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise AssertionError("no two consecutive free ports on 127.0.0.1")


def _healthy(compose: list[str], env: dict[str, str], services: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        for service in services:
            cid = subprocess.run(
                [*compose, "ps", "-q", service], env=env, capture_output=True, text=True
            ).stdout.strip()
            inspect = subprocess.run(
                ["docker", "inspect", "--format", "{{json .State}}", cid],
                capture_output=True, text=True,
            )  # fmt: skip
            state = json.loads(inspect.stdout) if inspect.returncode == 0 else {}
            states[service] = state.get("Health", {}).get("Status") or state.get("Status", "?")
            assert state.get("Status") != "exited", f"{service} exited: {state}"
        if all(s == "healthy" for s in states.values()):
            return
        time.sleep(1)
    raise AssertionError(f"not healthy after {timeout:g}s: {states}")


def test_a_job_runs_to_completion_exactly_once_when_deployed_next_to_kafka_with_compose() -> None:
    assert COMPOSE is not None
    images = _images()
    kafka_port, redis_port = _free_port_pair(), _free_port_pair()
    project = f"eosflow-test-{uuid.uuid4().hex[:8]}"
    compose = [*COMPOSE, "-f", str(COMPOSE_FILE), "-p", project]
    env = {
        **os.environ,
        **images,
        "EOSFLOW_COMPOSE_KAFKA_PORT": str(kafka_port),
        "EOSFLOW_COMPOSE_REDIS_PORT": str(redis_port),
    }
    try:
        up = subprocess.run(
            [*compose, "up", "-d", "kafka", "redis"], env=env, capture_output=True, text=True
        )
        assert up.returncode == 0, up.stdout + up.stderr
        _healthy(compose, env, ["kafka", "redis"], timeout=120)
        job = subprocess.run(
            [*compose, "run", "--rm", "app", "python", "/opt/eosflow/src/examples/running_total.py",
             "--records", str(RECORDS), "--recovery", "local"],
            env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        output = job.stdout + job.stderr
        assert job.returncode == 0, output[-5000:]
        # The app used the compose deployment's servers, from the environment the file gives it.
        assert f"kafka: 127.0.0.1:{kafka_port} (env)" in job.stdout, output[-5000:]
        assert f"OK: every output record exactly once ({RECORDS:,} expected)" in job.stdout, output[
            -5000:
        ]
        # The deployment's Redis answers for dedup steps (local recovery keeps its record IDs
        # in the tasks since issue 49, and writes none there).
        ping = subprocess.run(
            [*compose, "exec", "-T", "redis", "redis-cli", "-p", str(redis_port), "ping"],
            env=env, capture_output=True, text=True,
        )  # fmt: skip
        assert ping.returncode == 0 and ping.stdout.strip() == "PONG", ping.stdout + ping.stderr
    finally:
        down = subprocess.run(
            [*compose, "down", "-v", "--remove-orphans"], env=env, capture_output=True, text=True
        )
        assert down.returncode == 0, down.stdout + down.stderr
