"""A job's lifecycle as operators live it (issue 18): inputs written by transactional producers,
fresh starts over an earlier run's topics, two runs of one job, restarts before the first
checkpoint, stop signals. Each test runs ``eosflow run`` as a user does (a subprocess on a real
broker) and compares the committed output with an expectation computed without the engine."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import orjson
import pytest

from connectors import KafkaSettings, TopicAdmin, create_producer, producer_config
from sinks import read_jsonl
from tests.e2e.harness import canonical, click_events, expected_running_totals

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
RUNNING_TOTAL = str(ROOT / "examples" / "running_total.py")


def job_env(brokers: str, tmp: Path, **extra: str) -> dict[str, str]:
    run_id = uuid.uuid4().hex[:8]
    env = {k: v for k, v in os.environ.items() if not k.startswith("EOSFLOW_")}
    env.update(
        EOSFLOW_KAFKA_BROKERS=brokers,
        EOSFLOW_STATE_DIR=str(tmp / "state"),
        JOB_NAME=f"life-{run_id}",
        CLICKS_TOPIC=f"life-clicks-{run_id}",
        OUTPUT_DIR=str(tmp / "out"),
    )
    env.update(extra)
    return env


def eosflow(*args: str) -> list[str]:
    return [sys.executable, "-m", "processor.cli", *args]


def committed_output(env: dict[str, str]) -> Counter[bytes]:
    return Counter(canonical(x) for x in read_jsonl(env["OUTPUT_DIR"]))


def produce_in_transactions(
    brokers: str,
    topic: str,
    events: list[dict[str, object]],
    *,
    per_transaction: int = 2_000,
    aborted_tail: int = 0,
) -> None:
    """Write ``events`` keyed by user in committed transactions of ``per_transaction``; then,
    with ``aborted_tail``, one more transaction of that many junk records that is aborted.

    Every partition then ends in a transaction marker (a control record that takes an offset
    and is never delivered), as the output of any exactly-once job does."""
    settings = KafkaSettings.from_env(brokers=brokers)
    TopicAdmin(settings).ensure_topic(topic, 8)
    config = {**producer_config(settings), "transactional.id": f"{topic}-writer"}
    producer = create_producer(config)
    producer.init_transactions(30)
    for start in range(0, len(events), per_transaction):
        producer.begin_transaction()
        for event in events[start : start + per_transaction]:
            producer.produce(topic, orjson.dumps(event), key=str(event["user"]).encode())
        producer.commit_transaction(60)
    if aborted_tail:
        producer.begin_transaction()
        for i in range(aborted_tail):
            producer.produce(topic, b"not json: aborted", key=f"user-{i:05d}".encode())
        producer.flush(30)
        producer.abort_transaction(60)


@pytest.mark.parametrize("aborted", [False, True], ids=["last-committed", "last-aborted"])
def test_until_idle_ends_on_an_input_written_in_transactions(
    kafka_endpoint: tuple[str, str], broker_caps, tmp_path: Path, aborted: bool
) -> None:
    """The main use of eosflow is reading another exactly-once job's output: its partitions end
    in commit or abort markers. ``--until-idle`` must end there (the end offsets are the last
    stable offsets, the position moves over control records) with every committed record once
    and no aborted one."""
    if aborted and not broker_caps.read_committed_hides_aborted:
        pytest.skip(
            "this broker's read_committed delivers aborted records (Tansu), so an aborted tail "
            "is input here; the committed-tail case runs on it, this one on Apache Kafka"
        )
    records = 6_000
    env = job_env(kafka_endpoint[0], tmp_path)
    events = list(click_events(records))
    produce_in_transactions(
        kafka_endpoint[0], env["CLICKS_TOPIC"], events, aborted_tail=40 if aborted else 0
    )
    started = time.monotonic()
    result = subprocess.run(
        eosflow("run", RUNNING_TOTAL, "--workers", "2", "--checkpoint-interval", "300ms",
                "--until-idle"),
        env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"finished: {records:,} records in" in result.stdout, result.stdout
    assert committed_output(env) == expected_running_totals(events)
    assert time.monotonic() - started < 120
