"""Apache Kafka, Redis and PostgreSQL in containers, where a Docker engine exists.

Without one these tests skip, and the embedded broker (or EOSFLOW_KAFKA_BROKERS) covers the same
paths in the rest of the suite. --eosflow-servers=containers (or EOSFLOW_TESTCONTAINERS=1) runs
the whole suite on containers. The images are the official ones unless EOSFLOW_KAFKA_IMAGE,
EOSFLOW_REDIS_IMAGE and EOSFLOW_POSTGRES_IMAGE name others (scripts/docker_images.py builds them
where no registry is reachable; docs/containers.md).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from connectors import KafkaSettings, PartitionReader, TopicAdmin, create_producer, probe_broker
from connectors.config import producer_config
from processor.testing.containers import (
    OWNER_LABEL,
    _remove_orphans,
    container_image,
    docker_network,
    kafka_container,
    redis_container,
)
from processor.testing.servers import NO_DOCKER, docker_engine_available

pytestmark = pytest.mark.skipif(not docker_engine_available(), reason=NO_DOCKER)

ROOT = Path(__file__).resolve().parents[2]


def test_probe_and_round_trip_when_kafka_runs_in_a_container() -> None:
    with kafka_container() as bootstrap:
        settings = KafkaSettings(bootstrap)
        caps = probe_broker(settings)
        assert caps.exactly_once_transactions, caps.summary()
        TopicAdmin(settings).ensure_topic("tc-round-trip", 2)
        producer = create_producer(producer_config(settings))
        for i in range(100):
            producer.produce("tc-round-trip", str(i).encode(), partition=i % 2)
        assert producer.flush(30) == 0
        with PartitionReader(settings) as reader:
            reader.open({("tc-round-trip", 0): None, ("tc-round-trip", 1): None})
            values = []
            while not reader.reached_end():
                values.extend(m.value() for m in reader.poll(100, 0.2))
        assert sorted(values, key=int) == [str(i).encode() for i in range(100)]


def _listening(port: int) -> set[str]:
    """The local addresses (IPv4 and IPv6, as /proc/net shows them) a TCP socket listens on
    at ``port`` in this network namespace."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


@pytest.mark.skipif(
    docker_engine_available() and docker_network() != "host",
    reason="the engine has a bridge network: containers publish their ports instead",
)
def test_servers_listen_on_loopback_only_when_containers_share_the_host_network() -> None:
    # 127.0.0.1 as /proc/net shows it: IPv4, and IPv4-mapped IPv6 (a JVM's sockets)
    loopback = {"0100007F", "0000000000000000FFFF00000100007F"}
    owner = f"{socket.gethostname()}:{os.getpid()}"  # this process (xdist: this worker)
    with kafka_container() as bootstrap, redis_container() as url:
        kafka_port = int(bootstrap.rsplit(":", 1)[1])
        redis_port = int(url.rsplit(":", 1)[1].split("/")[0])
        assert _listening(kafka_port) and _listening(kafka_port) <= loopback, bootstrap
        assert _listening(redis_port) and _listening(redis_port) <= loopback, url
        labelled = subprocess.run(
            ["docker", "ps", "--filter", f"label={OWNER_LABEL}", "--format", "{{.Label \""
             + OWNER_LABEL + "\"}}"],
            capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
        assert labelled.count(owner) == 2, labelled
    gone = subprocess.run(
        ["docker", "ps", "-a", "--filter", f"label={OWNER_LABEL}={owner}", "-q"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert gone == [], f"containers left behind: {gone}"


def test_containers_of_an_ended_process_are_removed_when_a_session_prepares_the_engine() -> None:
    """Without Ryuk, what a killed test session left behind goes at the next session's start;
    a live process's containers stay."""
    import docker

    image = container_image("redis")
    ended = subprocess.Popen(["true"])
    ended.wait()
    host = socket.gethostname()

    def leave(owner: str) -> str:
        return subprocess.run(
            ["docker", "create", "--network", "none", "--label", f"{OWNER_LABEL}={owner}", image],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip

    orphan, alive = leave(f"{host}:{ended.pid}"), leave(f"{host}:{os.getpid()}")
    client = docker.from_env()
    try:
        _remove_orphans(client)
        # Another xdist worker's session may be removing the orphan at this moment (our own
        # call then gets "removal already in progress"): what counts is that it goes.
        deadline = time.monotonic() + 30
        while True:
            listed = client.api.containers(all=True, filters={"label": OWNER_LABEL})
            left = {c["Id"] for c in listed}
            if orphan not in left or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert orphan not in left and alive in left
    finally:
        subprocess.run(["docker", "rm", "-f", orphan, alive], capture_output=True)
        client.close()


# A user's project: a pipeline with a slow step (so that a kill lands while output is still
# uncommitted), and a test that kills the running job with SIGKILL and runs it again.
USER_PIPELINE = """\
import os
import time

from connectors import JsonSerde
from processor import Dataflow
from sinks import FileSink


def enrich(order):
    time.sleep(0.004)  # a lookup
    return order


flow = Dataflow(os.environ.get("JOB_NAME", "order-totals"))
(
    flow.source("orders", os.environ.get("ORDERS_TOPIC", "orders"), serde=JsonSerde())
    .map("enrich", enrich)
    .key_by("by-customer", lambda order: order["customer"])
    .aggregate("spent", init=lambda: 0, add=lambda total, order: total + order["amount"])
    .sink("out", FileSink(os.environ.get("OUTPUT_DIR", "out/order-totals")))
)
"""

USER_TEST = """\
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from processor.testing import assert_exactly_once, produce
from sinks import read_jsonl

PIPELINE = Path(__file__).parent / "order_totals.py"


def orders(first, n):
    return [
        {"order": i, "customer": f"c{i % 7}", "amount": i % 13} for i in range(first, first + n)
    ]


def expected_totals(orders):
    totals = defaultdict(int)
    for order in orders:
        totals[order["customer"]] += order["amount"]
        yield [order["customer"], totals[order["customer"]]]


def eosflow(*args):
    return [sys.executable, "-m", "processor.cli", *args]


def wait_for(job, proc, log, ok, timeout=180):
    \"\"\"`eosflow status --json` of the running job, once `ok` holds for it.\"\"\"
    deadline, found = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the job exited ({proc.returncode}):\\n{log.read_text()}")
        done = subprocess.run(
            eosflow("status", job.name, "--json"),
            env={**os.environ, **job.env}, capture_output=True, text=True,
        )
        found = json.loads(done.stdout) if done.returncode == 0 else {}
        if found.get("pid") == proc.pid and ok(found):
            return found
        time.sleep(0.2)
    raise AssertionError(f"the job did not get there in {timeout}s: {found}")


def test_order_totals_are_exactly_once_when_the_job_is_killed_and_restarted(
    eosflow_servers, eosflow_kafka, eosflow_topic, eosflow_job, tmp_path
):
    assert eosflow_servers.origin("kafka") == "container"
    topic = eosflow_topic(partitions=3)
    first, second = orders(0, 600), orders(600, 3000)  # the second takes ~8 s
    produce(eosflow_kafka, topic, first, key=lambda order: order["customer"])
    eosflow_job.env.update(ORDERS_TOPIC=topic, OUTPUT_DIR=str(tmp_path / "out"))

    # The job runs unbounded, as in production, until it is killed.
    log = tmp_path / "first-run.log"
    with log.open("w") as sink:
        job = subprocess.Popen(
            eosflow("run", str(PIPELINE), "--workers", "2", "--checkpoint-interval", "1s"),
            env={**os.environ, **eosflow_job.env}, stdout=sink, stderr=subprocess.STDOUT,
        )
    found = {}
    try:
        wait_for(eosflow_job, job, log, lambda s: s["checkpoint"]["completed"] >= 1)
        found = wait_for(eosflow_job, job, log, lambda s: s["records_in"] >= 600)
        produce(eosflow_kafka, topic, second, key=lambda order: order["customer"])
        found = wait_for(eosflow_job, job, log, lambda s: s["records_in"] > 600)
    finally:
        # SIGKILL, no clean-up: the runner and its workers at once.
        for pid in [job.pid] + [w["pid"] for w in found.get("workers", []) if w.get("pid")]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        job.wait(30)
    assert job.returncode == -signal.SIGKILL
    committed = len(read_jsonl(tmp_path / "out"))
    assert 0 < committed < 3600, f"the kill landed after the job was done ({committed} out)"

    # Run again until idle: it restores the last completed checkpoint and finishes.
    run = eosflow_job.run_subprocess(PIPELINE)
    assert f"job {eosflow_job.name} finished" in run.stdout, run.stdout
    assert_exactly_once(read_jsonl(tmp_path / "out"), list(expected_totals(first + second)))
"""


def test_a_users_pipeline_is_exactly_once_when_killed_and_restarted_against_a_kafka_container(
    tmp_path: Path,
) -> None:
    """A user's pipeline test in a fresh directory outside the repository, run by ``python -m
    pytest --eosflow-servers=containers`` there: Kafka in a container from the plugin's
    fixtures, the job (``eosflow run``) SIGKILLed while running and run again; every output
    record committed exactly once."""
    user = tmp_path / "user"
    assert not user.resolve().is_relative_to(ROOT)
    user.mkdir()
    (user / "order_totals.py").write_text(USER_PIPELINE)
    (user / "test_order_totals.py").write_text(USER_TEST)
    (user / "pyproject.toml").write_text('[tool.pytest.ini_options]\naddopts = "-ra"\n')
    # The image and network variables pass through; servers named for the outer suite do not.
    named = ("PYTEST_ADDOPTS", "EOSFLOW_KAFKA_BROKERS", "EOSFLOW_REDIS_URL", "EOSFLOW_POSTGRES_DSN")
    env = {k: v for k, v in os.environ.items() if k not in named}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "--eosflow-servers=containers", str(user)],
        cwd=user, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    output = run.stdout + run.stderr
    assert run.returncode == 0, f"the user's test failed (exit {run.returncode}):\n{output}"
    assert "killed_and_restarted PASSED" in output, output
