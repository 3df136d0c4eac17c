"""Keyed sources end to end: a running total keyed by the message key, with no shuffle.

``pipelines/keyed_source_total.py`` is ``running_total_work.py`` with ``keyed=True`` instead of
``key_by``: its only stage reads the clicks and keeps each user's total in the subtask that
reads the user's partition. These tests check that it is exactly once under SIGKILLs, that a
record without a key is a dead letter, and that a restart that would move keys or their state
to other subtasks (more partitions, another ``--workers``, ``keyed=`` toggled) is refused
before any worker starts.

The expectation is computed from ``examples/clicks.py``, never by the engine. Each test prints
its seed; rerun one with ``EOSFLOW_CHAOS_SEED=<seed>``.
"""

from __future__ import annotations

import random
import sys
import time
import uuid
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewPartitions

from connectors import KafkaSettings, TopicAdmin, create_producer, probe_broker, producer_config
from connectors.claim import claim_topic
from connectors.transport import produce_waiting
from processor.compiler import Plan
from processor.errors import ConfigError
from processor.runtime.supervision.local import LocalRunner, RunOptions
from processor.runtime.supervision.runner import Runner
from sinks import read_jsonl
from tests.e2e.harness import (
    ENGINE_FAULTS,
    PIPELINES,
    assert_exactly_once,
    assert_faults_fired,
    canonical,
    chaos_seed,
    click_events,
    expected,
    expected_running_totals,
    produce_clicks,
    run_chaos,
)
from tests.features import skip_unless_broker_has

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

PIPELINE = "keyed_source_total.py"
PARTITIONS = 8  # produce_clicks' default
#: The engine's protocol points, one SIGKILL per start. ``mid-alignment`` is reached only by a
#: task with several input channels, and this job has no channel at all: its place in the
#: chain (the first start) goes to ``before-prepare``, which a task with a sink reaches.
NAMED = [
    replace(f, point="before-prepare") if f.point == "mid-alignment" else f for f in ENGINE_FAULTS
]


def _assert_unshuffled(plan: Plan, brokers: str) -> None:
    """The job ran as one stage, without a channel topic: the path under test (its only
    internal topic is the job's claim, connectors.claim)."""
    assert [s.steps for s in plan.stages] == [("clicks", "work", "totals", "out")], plan.describe()
    topic = plan.flow.steps["clicks"].params["topic"]
    assert plan.edges == () and plan.copartitioned == ((topic,),)
    admin = TopicAdmin(KafkaSettings.from_env(brokers=brokers))
    assert admin.list_topics(prefix=f"eosflow.{plan.job}.") == [claim_topic(plan.job)]


def test_keyed_source_total_is_exactly_once_when_workers_are_killed_at_protocol_points_and_randomly(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    seed = chaos_seed()
    records, kills = 60_000, 3
    plans: list[Plan] = []
    run = run_chaos(
        PIPELINE,
        brokers=kafka_endpoint[0],
        tmp=tmp_path,
        records=records,
        seed=seed,
        mode="aligned",
        faults=NAMED,
        random_kills=kills,
        during=lambda job: plans.append(job.plan),
    )
    print(f"seed={seed} random kills (share read, worker): {run.random_kills}")
    print(f"restarts={run.result.restarts} causes={run.result.restart_causes}")
    _assert_unshuffled(plans[0], kafka_endpoint[0])
    assert_faults_fired(run, NAMED, kills, seed=seed)
    assert_exactly_once(expected(expected_running_totals, records, seed), run.output, seed=seed)


# -- records without a key -----------------------------------------------------------------------


def _produce_with_keyless(
    brokers: str, topic: str, records: int, keyless: int, *, seed: int
) -> dict[str, tuple[int, int]]:
    """The clicks of ``click_events(records, seed=seed)`` keyed by user, with ``keyless``
    copies of clicks (each with a ``bad_id``) written without a key to random partitions.

    Returns ``bad_id -> (partition, offset)`` from the broker's delivery reports.
    """
    settings = KafkaSettings.from_env(brokers=brokers)
    TopicAdmin(settings).ensure_topic(topic, PARTITIONS)
    producer = create_producer(producer_config(settings))
    rng = random.Random(seed)
    every = max(1, records // keyless)
    where: dict[str, tuple[int, int]] = {}
    failures: list[Any] = []

    def report(bad_id: str) -> Any:
        def delivered(err: Any, msg: Any) -> None:
            if err is not None:
                failures.append(err)
            else:
                where[bad_id] = (msg.partition(), msg.offset())

        return delivered

    def send(value: bytes, **kw: Any) -> None:
        produce_waiting(producer, topic, value, **kw)

    made = 0
    for i, click in enumerate(click_events(records, seed=seed)):
        send(orjson.dumps(click), key=str(click["user"]).encode())
        if i % every == every // 2 and made < keyless:
            bad_id = f"keyless-{seed}-{made}"
            # a whole click: counted by mistake, it would change its user's totals
            send(
                orjson.dumps({**click, "bad_id": bad_id}),
                partition=rng.randrange(PARTITIONS),
                on_delivery=report(bad_id),
            )
            made += 1
        if i % 10_000 == 0:
            producer.poll(0)
    left = producer.flush(60)
    assert not left and not failures, f"{left} undelivered, failures: {failures[:3]}"
    assert len(where) == keyless
    return where


def test_record_without_a_key_is_dead_lettered_once_when_workers_are_killed(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    seed = chaos_seed()
    records, keyless, kills = 20_000, 100, 2
    topic = f"keyed-keyless-{uuid.uuid4().hex[:8]}"
    dead_dir = tmp_path / "dead-letters"
    where: dict[str, tuple[int, int]] = {}
    run = run_chaos(
        PIPELINE,
        brokers=kafka_endpoint[0],
        tmp=tmp_path,
        records=records,
        seed=seed,
        mode="aligned",
        random_kills=kills,
        env={"CLICKS_TOPIC": topic, "DEAD_LETTER_DIR": str(dead_dir)},
        produce=lambda brokers, t: where.update(
            _produce_with_keyless(brokers, t, records, keyless, seed=seed)
        ),
    )
    print(f"seed={seed} random kills: {run.random_kills} causes={run.result.restart_causes}")
    assert len(run.random_kills) == kills, f"seed={seed}: the job ended early"
    # the keyed records: the running totals of the clicks alone (no copy counted)
    assert_exactly_once(expected(expected_running_totals, records, seed), run.output, seed=seed)

    entries = read_jsonl(dead_dir)
    by_id = Counter(str(orjson.loads(e["value_utf8"])["bad_id"]) for e in entries)
    assert by_id == Counter(set(where)), (
        f"seed={seed}: {len(entries)} dead letters for {keyless} records without a key; "
        f"repeated {[k for k, n in by_id.items() if n > 1][:5]}, missing "
        f"{sorted(set(where) - set(by_id))[:5]}, unexpected {sorted(set(by_id) - set(where))[:5]}"
    )
    for entry in entries:
        bad_id = orjson.loads(entry["value_utf8"])["bad_id"]
        assert (entry["topic"], entry["partition"], entry["offset"]) == (topic, *where[bad_id])
        assert (entry["step"], entry["error_type"]) == ("clicks", "DeserializationError"), entry
        assert "source 'clicks' is keyed by the message key" in entry["cause"], entry
        assert "has no key" in entry["cause"] and entry["key"] is None, entry


# -- restarts that would move keys between subtasks ----------------------------------------------


def _job(tmp_path: Path, brokers: str) -> dict[str, str]:
    run_id = uuid.uuid4().hex[:8]
    return {
        "JOB_NAME": f"keyed-restart-{run_id}",
        "CLICKS_TOPIC": f"keyed-restart-{run_id}",
        "OUTPUT_DIR": str(tmp_path / "output"),
        "EOSFLOW_KAFKA_BROKERS": brokers,
        "WORK_US": "0",
    }


def _runner(tmp_path: Path, env: dict[str, str], workers: int) -> Runner:
    options = RunOptions(
        workers=workers,
        checkpoint_interval=0.5,
        until_idle=True,
        environ=env,
        state_dir=str(tmp_path / "state"),
        max_restarts=0,
        progress=sys.stderr,
    )
    return LocalRunner(str(PIPELINES / PIPELINE), options)


def _run_to_completion(
    tmp_path: Path, env: dict[str, str], records: int, seed: int
) -> Counter[bytes]:
    """Produces ``records`` clicks, runs the job with 2 workers until idle; returns its output
    (checked) once a completed checkpoint exists."""
    produce_clicks(env["EOSFLOW_KAFKA_BROKERS"], env["CLICKS_TOPIC"], records, seed=seed)
    runner = _runner(tmp_path, env, workers=2)
    result = runner.run()
    assert result.restarts == 0, result.restart_causes
    assert runner.store.latest_completed(env["JOB_NAME"]) is not None
    output = Counter(canonical(item) for item in read_jsonl(env["OUTPUT_DIR"]))
    assert_exactly_once(expected(expected_running_totals, records, seed), output, seed=seed)
    return output


def _add_partitions(brokers: str, topic: str, total: int) -> None:
    """``topic`` grown to ``total`` partitions (skips where the broker cannot: Tansu)."""
    admin = AdminClient({"bootstrap.servers": brokers})
    try:
        admin.create_partitions([NewPartitions(topic, total)])[topic].result(30)
    except KafkaException as exc:
        if exc.args[0].code() != KafkaError._UNSUPPORTED_FEATURE:
            raise
        skip_unless_broker_has(
            probe_broker(KafkaSettings.from_env(brokers=brokers)),
            "CreatePartitions",
            False,
            f"{exc}; the recreated-topic case and tests/unit/test_keyed_sources.py cover the "
            "refusal",
        )


def _recreate(brokers: str, topic: str, total: int) -> None:
    """``topic`` deleted and created again with ``total`` partitions."""
    admin = TopicAdmin(KafkaSettings.from_env(brokers=brokers))
    admin.delete_topics([topic])
    deadline = time.monotonic() + 30
    while admin.exists(topic):
        assert time.monotonic() < deadline, f"topic {topic} still exists 30 s after deletion"
        time.sleep(0.1)
    assert admin.ensure_topic(topic, total)


@pytest.mark.parametrize("how", ["add-partitions", "recreate"])
def test_restart_is_refused_when_the_keyed_source_topic_has_more_partitions(
    kafka_endpoint: tuple[str, str], tmp_path: Path, how: str
) -> None:
    """Kafka's partitioner puts some keys in other partitions once there are 12, read by other
    subtasks: their totals would be split. The job must not start."""
    brokers = kafka_endpoint[0]
    if how == "add-partitions":  # before the first run: skip early where it cannot work
        probe = f"keyed-probe-{uuid.uuid4().hex[:8]}"
        TopicAdmin(KafkaSettings.from_env(brokers=brokers)).ensure_topic(probe, 1)
        _add_partitions(brokers, probe, 2)
    seed = chaos_seed()
    env = _job(tmp_path, brokers)
    before = _run_to_completion(tmp_path, env, 4_000, seed)
    topic = env["CLICKS_TOPIC"]
    (_add_partitions if how == "add-partitions" else _recreate)(brokers, topic, 12)
    assert TopicAdmin(KafkaSettings.from_env(brokers=brokers)).describe(topic).partitions == 12
    runner = _runner(tmp_path, env, workers=2)
    with pytest.raises(ConfigError, match=rf"'{topic}' from {PARTITIONS} to 12\)"):
        runner.run()
    assert runner.generation == 0  # refused before any worker started
    after = Counter(canonical(item) for item in read_jsonl(env["OUTPUT_DIR"]))
    assert after == before  # nothing ran


@pytest.mark.parametrize("workers", [1, 3])
def test_restart_is_refused_when_workers_differ_from_the_checkpoint_without_channels(
    kafka_endpoint: tuple[str, str], tmp_path: Path, workers: int
) -> None:
    """Regression: a job without channel topics (whose partition counts refuse another
    parallelism) restarted after a checkpoint of 2 workers. With 1, its only subtask restored
    subtask 0's snapshot, read the partitions of subtask 1 from the start again, and counted
    every user in them twice, from zero; with 3, the workers failed on a task missing from the
    checkpoint (KeyError: 'clicks.2')."""
    seed = chaos_seed()
    env = _job(tmp_path, kafka_endpoint[0])
    before = _run_to_completion(tmp_path, env, 4_000, seed)
    runner = _runner(tmp_path, env, workers=workers)
    with pytest.raises(ConfigError, match=r"keyed steps read keyed sources") as info:
        runner.run()
    assert "--workers 2" in str(info.value)  # their state sits by Kafka partition, not key group
    assert runner.generation == 0  # refused before any worker started
    after = Counter(canonical(item) for item in read_jsonl(env["OUTPUT_DIR"]))
    assert after == before


@pytest.mark.parametrize(
    ("first", "then", "refusal"),
    [
        ("0", "1", r"stages no longer there: none; new stages: \['totals'\]"),
        ("1", "0", r"stages no longer there: \['totals'\]; new stages: none"),
    ],
    ids=["keyed-then-key-by", "key-by-then-keyed"],
)
def test_restart_is_refused_when_keyed_is_toggled_after_a_checkpoint(
    kafka_endpoint: tuple[str, str], tmp_path: Path, first: str, then: str, refusal: str
) -> None:
    """Toggling ``keyed=`` adds or removes the shuffle before ``totals``, which moves the
    totals to other tasks. Regression (keyed-then-key-by): no task of the checkpoint was gone,
    so the runner started the workers, which failed on ``KeyError: 'totals.0'`` (a task the
    checkpoint lacks) until the restart budget ran out, instead of a refusal saying why."""
    seed = chaos_seed()
    env = _job(tmp_path, kafka_endpoint[0])
    before = _run_to_completion(tmp_path, {**env, "KEY_BY": first}, 4_000, seed)
    runner = _runner(tmp_path, {**env, "KEY_BY": then}, workers=2)
    with pytest.raises(ConfigError, match=refusal):
        runner.run()
    assert runner.generation == 0
    after = Counter(canonical(item) for item in read_jsonl(env["OUTPUT_DIR"]))
    assert after == before


def test_restart_with_a_stage_added_is_refused_before_any_worker_starts(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    """A branch added to a job that has a checkpoint has no snapshot and no start positions:
    the workers failed on ``KeyError: 'per-page.0'`` until the restart budget ran out. Now the
    runner refuses, naming the new stage, and nothing is written."""
    seed = chaos_seed()
    env = _job(tmp_path, kafka_endpoint[0])
    before = _run_to_completion(tmp_path, env, 4_000, seed)
    runner = _runner(tmp_path, {**env, "PAGES_DIR": str(tmp_path / "pages")}, workers=2)
    assert sorted(runner.plan.task_names()) == [
        "clicks.0", "clicks.1", "per-page.0", "per-page.1"
    ]  # fmt: skip
    with pytest.raises(ConfigError, match=r"new stages: \['per-page'\]"):
        runner.run()
    assert runner.generation == 0
    after = Counter(canonical(item) for item in read_jsonl(env["OUTPUT_DIR"]))
    assert after == before
