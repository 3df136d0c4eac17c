"""The test kit against real servers: topics filled from Python and from files, pipelines run
until idle in this process and as ``eosflow run``, failures with the workers' logs, the
servers' modes (the containers one where a Docker engine answers)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
import redis

from connectors import KafkaSettings, PartitionReader, TopicAdmin
from processor.errors import KafkaClientError
from processor.runtime.job import JobFailed
from processor.runtime.supervision.local import Fault
from processor.testing import (
    Job,
    SessionServers,
    assert_exactly_once,
    docker_engine_available,
    produce,
    produce_jsonl,
)
from processor.testing.servers import NO_DOCKER
from sinks import read_jsonl

PIPELINE = """\
import os

from connectors import JsonSerde
from processor import Dataflow
from sinks import FileSink


def check(order):
    if order["amount"] < 0:
        raise ValueError(f"negative amount in order {order['order']}")
    return order


flow = Dataflow(os.environ["JOB_NAME"])
(
    flow.source("orders", os.environ["ORDERS_TOPIC"], serde=JsonSerde())
    .map("check", check)
    .key_by("by-customer", lambda order: order["customer"])
    .aggregate("spent", init=lambda: 0, add=lambda total, order: total + order["amount"])
    .sink("out", FileSink(os.environ["OUTPUT_DIR"]))
)
"""


def _orders(n: int) -> list[dict[str, Any]]:
    return [{"order": i, "customer": f"c{i % 7}", "amount": i % 13} for i in range(n)]


def _running_totals(orders: list[dict[str, Any]]) -> list[list[Any]]:
    """The pipeline's answer, computed without the engine: per customer, its total after each
    of its orders."""
    totals: dict[str, int] = defaultdict(int)
    out = []
    for order in orders:
        totals[order["customer"]] += order["amount"]
        out.append([order["customer"], totals[order["customer"]]])
    return out


def _read(brokers: str, topic: str, partitions: int) -> dict[int, list[Any]]:
    """Every record of ``topic``, per partition in offset order: (key, value, timestamp)."""
    found: dict[int, list[Any]] = defaultdict(list)
    with PartitionReader(KafkaSettings(brokers)) as reader:
        reader.open({(topic, p): None for p in range(partitions)})
        while not reader.reached_end():
            for m in reader.poll(500, 0.2):
                found[m.partition()].append((m.key(), orjson.loads(m.value()), m.timestamp()[1]))
    return found


@pytest.fixture
def orders_job(eosflow_job: Job, eosflow_topic: Callable[..., str], tmp_path: Path) -> Job:
    """A job of the orders pipeline above, its input topic (3 partitions) still empty."""
    (tmp_path / "pipeline.py").write_text(PIPELINE)
    eosflow_job.env.update(ORDERS_TOPIC=eosflow_topic(3), OUTPUT_DIR=str(tmp_path / "out"))
    return eosflow_job


def test_produce_keeps_each_keys_order_in_one_partition_when_a_key_function_is_given(
    eosflow_kafka: str, eosflow_topic: Callable[..., str]
) -> None:
    topic = eosflow_topic(3)
    orders = _orders(300)
    assert produce(eosflow_kafka, topic, orders, key=lambda o: o["customer"]) == 300
    found = _read(eosflow_kafka, topic, 3)
    assert sum(len(records) for records in found.values()) == 300
    partition_of: dict[bytes, set[int]] = defaultdict(set)
    for partition, records in found.items():
        for key, _value, _ts in records:
            partition_of[key].add(partition)
    assert all(len(p) == 1 for p in partition_of.values()), partition_of
    assert sorted(partition_of) == [f"c{i}".encode() for i in range(7)]
    for records in found.values():
        numbers = [value["order"] for _key, value, _ts in records]
        assert numbers == sorted(numbers)  # each partition in the order of the input
    assert sorted(v["order"] for r in found.values() for _k, v, _t in r) == list(range(300))


def test_produce_places_and_stamps_records_when_partition_and_timestamp_are_given(
    eosflow_kafka: str, eosflow_topic: Callable[..., str]
) -> None:
    topic = eosflow_topic(2)
    produce(
        eosflow_kafka,
        topic,
        range(10),
        partition=lambda v: v % 2,
        timestamp_ms=lambda v: 1_700_000_000_000 + v,
    )
    found = _read(eosflow_kafka, topic, 2)
    assert [(v, ts) for _k, v, ts in found[0]] == [
        (v, 1_700_000_000_000 + v) for v in (0, 2, 4, 6, 8)
    ]
    assert [v for _k, v, _ts in found[1]] == [1, 3, 5, 7, 9]
    assert all(key is None for records in found.values() for key, _v, _ts in records)
    produce(eosflow_kafka, topic, ["x"], partition=1)
    assert [v for _k, v, _ts in _read(eosflow_kafka, topic, 2)[1]][-1] == "x"


def test_produce_fails_naming_the_topic_when_the_partition_does_not_exist(
    eosflow_kafka: str, eosflow_topic: Callable[..., str]
) -> None:
    topic = eosflow_topic(1)
    with pytest.raises(KafkaClientError, match=f"topic '{topic}'"):
        produce(eosflow_kafka, topic, [1, 2], partition=5)


def test_produce_jsonl_writes_each_line_when_given_a_file(
    eosflow_kafka: str, eosflow_topic: Callable[..., str], tmp_path: Path
) -> None:
    topic = eosflow_topic(1)
    path = tmp_path / "orders.jsonl"
    path.write_bytes(b"".join(orjson.dumps(o) + b"\n" for o in _orders(20)) + b"\n  \n")
    assert produce_jsonl(eosflow_kafka, topic, path, key=lambda o: o["customer"]) == 20
    assert [v for _k, v, _ts in _read(eosflow_kafka, topic, 1)[0]] == _orders(20)


def test_produce_jsonl_names_the_line_when_one_is_not_json(
    eosflow_kafka: str, eosflow_topic: Callable[..., str], tmp_path: Path
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"a": 1}\n{"a": \n')
    with pytest.raises(ValueError, match=rf"{path}:2: not JSON"):
        produce_jsonl(eosflow_kafka, eosflow_topic(1), path)


def test_eosflow_topic_creates_a_topic_of_the_tests_own_with_the_partitions_asked(
    eosflow_kafka: str, eosflow_topic: Callable[..., str]
) -> None:
    first, second = eosflow_topic(4), eosflow_topic(2, hint="other")
    assert first != second
    assert first.startswith("t-test-eosflow-topic-creates-") and second.startswith("t-other-")
    admin = TopicAdmin(KafkaSettings(eosflow_kafka))
    assert (admin.describe(first).partitions, admin.describe(second).partitions) == (4, 2)


def test_eosflow_job_points_the_pipeline_at_the_sessions_servers_when_it_runs(
    eosflow_redis: str, eosflow_job: Job, eosflow_kafka: str, tmp_path: Path
) -> None:
    assert eosflow_job.env["EOSFLOW_KAFKA_BROKERS"] == eosflow_kafka
    assert eosflow_job.env["EOSFLOW_REDIS_URL"] == eosflow_redis  # asked for: resolved first
    assert eosflow_job.env["JOB_NAME"] == eosflow_job.name
    assert eosflow_job.name.startswith("job-test-eosflow-job-points-")
    assert eosflow_job.state_dir.is_dir() and eosflow_job.state_dir.is_relative_to(tmp_path)


def test_a_pipeline_run_in_process_commits_each_record_once_when_its_input_is_bounded(
    orders_job: Job, eosflow_kafka: str
) -> None:
    orders = _orders(500)
    produce(eosflow_kafka, orders_job.env["ORDERS_TOPIC"], orders, key=lambda o: o["customer"])
    result = orders_job.run(Path(orders_job.env["OUTPUT_DIR"]).parent / "pipeline.py")
    assert result.job == orders_job.name
    assert (result.records_in, result.restarts) == (500, 0)
    assert_exactly_once(read_jsonl(orders_job.env["OUTPUT_DIR"]), _running_totals(orders))


def test_a_pipeline_killed_at_a_protocol_point_commits_each_record_once_when_run_with_faults(
    orders_job: Job, eosflow_kafka: str
) -> None:
    """The documented way to test under a crash: RunOptions' faults through ``Job.run``."""
    orders = _orders(500)
    produce(eosflow_kafka, orders_job.env["ORDERS_TOPIC"], orders, key=lambda o: o["customer"])
    result = orders_job.run(
        Path(orders_job.env["OUTPUT_DIR"]).parent / "pipeline.py",
        faults=[Fault(0, 1, "after-snapshot-before-ack")],
        restart_backoff=0.05,
    )
    assert result.restarts == 1, result.restart_causes
    assert_exactly_once(read_jsonl(orders_job.env["OUTPUT_DIR"]), _running_totals(orders))


def test_a_pipeline_run_as_eosflow_run_commits_each_record_once_when_its_input_is_bounded(
    orders_job: Job, eosflow_kafka: str
) -> None:
    orders = _orders(200)
    produce(eosflow_kafka, orders_job.env["ORDERS_TOPIC"], orders, key=lambda o: o["customer"])
    run = orders_job.run_subprocess(
        Path(orders_job.env["OUTPUT_DIR"]).parent / "pipeline.py", "--mode", "unaligned"
    )
    assert run.returncode == 0
    assert f"job {orders_job.name} finished: 200 records read" in run.stdout
    assert_exactly_once(read_jsonl(orders_job.env["OUTPUT_DIR"]), _running_totals(orders))


def test_a_failed_run_shows_the_workers_error_when_the_pipeline_raises(
    orders_job: Job, eosflow_kafka: str
) -> None:
    produce(
        eosflow_kafka, orders_job.env["ORDERS_TOPIC"], [*_orders(5), {"order": 5, "amount": -1}]
    )
    pipeline = Path(orders_job.env["OUTPUT_DIR"]).parent / "pipeline.py"
    with pytest.raises(JobFailed) as failed:
        orders_job.run(pipeline, max_restarts=1, restart_backoff=0.05)
    message = str(failed.value)
    assert f"--- {orders_job.state_dir}/jobs/{orders_job.name}/worker-" in message
    assert "ValueError: negative amount in order 5" in message

    run = orders_job.run_subprocess(pipeline, "--max-restarts", "1", check=False)
    assert run.returncode == 1
    assert "eosflow: job failed" in run.stderr
    with pytest.raises(JobFailed, match=r"exited with 1; its stderr ends:\n(.|\n)*negative amount"):
        orders_job.run_subprocess(pipeline, "--max-restarts", "1")


def test_embedded_mode_starts_a_broker_of_its_own_when_the_environment_names_another() -> None:
    with SessionServers("embedded", {"EOSFLOW_KAFKA_BROKERS": "nowhere.invalid:9092"}) as found:
        brokers = found.url("kafka")
        assert found.origin("kafka") == "embedded" and brokers != "nowhere.invalid:9092"
        assert TopicAdmin(KafkaSettings(brokers)).broker_count() == 1


@pytest.mark.skipif(not docker_engine_available(), reason=NO_DOCKER)
def test_containers_give_kafka_redis_and_postgres_when_a_docker_engine_answers() -> None:
    with SessionServers("containers", {}) as found:
        brokers = found.url("kafka")
        assert found.origin("kafka") == "container"
        TopicAdmin(KafkaSettings(brokers)).ensure_topic("kit-containers", 1)
        produce(brokers, "kit-containers", range(10))
        assert [v for _k, v, _t in _read(brokers, "kit-containers", 1)[0]] == list(range(10))
        client = redis.Redis.from_url(found.url("redis"))
        assert client.ping()
        client.close()
        with psycopg.connect(found.url("postgres")) as conn:
            row = conn.execute("SHOW max_prepared_transactions").fetchone()
            assert row is not None and int(row[0]) > 0  # the PostgreSQL sink's 2PC needs it
