"""Dead letters are exactly-once under crashes: malformed records mixed into the clicks each land
in the dead-letter destination once, and the good records' output is what it would be without them.

The expectation is computed from what this test produced (the broker's delivery reports give each
malformed record's partition and offset) and from ``examples/clicks.py``, never by the engine.
Each test prints its seed; rerun one with ``EOSFLOW_CHAOS_SEED=<seed>``.
"""

from __future__ import annotations

import base64
import random
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest

from connectors import KafkaSettings, TopicAdmin, create_producer, producer_config
from connectors.transport import produce_waiting
from processor.runtime.supervision.local import Fault
from sinks import read_jsonl
from tests.e2e.harness import (
    assert_exactly_once,
    chaos_seed,
    click_events,
    expected,
    expected_running_totals,
    run_chaos,
)

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

PARTITIONS = 8
NAMED = [
    Fault(0, 1, "before-prepare", 3),
    Fault(1, 0, "after-snapshot-before-ack", 2),
    Fault(2, 1, "after-completion-before-commit", 2),
    Fault(3, 0, "during-recovery", 1),
]
#: kind -> (the step that fails, the exception type)
KINDS = {
    "garbage": ("clicks", "DeserializationError"),
    "not-utf8": ("clicks", "DeserializationError"),
    "no-ts": ("clicks", "KeyError"),
    "poison": ("check", "ValueError"),
    "no-user": ("by-user", "KeyError"),
    "no-amount": ("totals", "KeyError"),
}


def _malformed(kind: str, bad_id: str, click: dict[str, Any]) -> bytes:
    if kind == "garbage":
        return b"{this is not json " + bad_id.encode()
    if kind == "not-utf8":
        return b"\xff\xfe" + bad_id.encode()
    record = {**click, "bad_id": bad_id}
    if kind == "poison":
        record["poison"] = True
    else:
        del record[{"no-ts": "ts_ms", "no-user": "user", "no-amount": "amount"}[kind]]
    return orjson.dumps(record)


def produce_with_malformed(
    brokers: str, topic: str, records: int, bad: int, *, seed: int
) -> dict[str, tuple[str, int, int]]:
    """The clicks of ``click_events(records, seed=seed)`` (keyed by user, as ``produce_clicks``
    writes them) with ``bad`` malformed records spread among them, on random partitions.

    Returns ``bad_id -> (kind, partition, offset)`` from the broker's delivery reports.
    """
    settings = KafkaSettings.from_env(brokers=brokers)
    TopicAdmin(settings).ensure_topic(topic, PARTITIONS)
    producer = create_producer(producer_config(settings))
    rng = random.Random(seed)
    every = max(1, records // bad)
    where: dict[str, tuple[str, int, int]] = {}
    failures: list[Any] = []

    def report(kind: str, bad_id: str) -> Any:
        def delivered(err: Any, msg: Any) -> None:
            if err is not None:
                failures.append(err)
            else:
                where[bad_id] = (kind, msg.partition(), msg.offset())

        return delivered

    def send(value: bytes, **kw: Any) -> None:
        produce_waiting(producer, topic, value, **kw)

    made = 0
    for i, click in enumerate(click_events(records, seed=seed)):
        send(orjson.dumps(click), key=str(click["user"]).encode())
        if i % every == every // 2 and made < bad:
            kind = list(KINDS)[made % len(KINDS)]
            bad_id = f"bad-{seed}-{made}"
            send(
                _malformed(kind, bad_id, click),
                partition=rng.randrange(PARTITIONS),
                key=None if made % 2 else bad_id.encode(),
                on_delivery=report(kind, bad_id),
            )
            made += 1
        if i % 10_000 == 0:
            producer.poll(0)
    left = producer.flush(60)
    assert not left and not failures, f"{left} undelivered, failures: {failures[:3]}"
    assert len(where) == bad
    return where


def _bad_id(entry: dict[str, Any]) -> str:
    """The malformed record an entry is about, read from the entry's value or raw bytes."""
    if entry["value"] is not None:
        return str(entry["value"]["bad_id"])
    raw = entry.get("value_utf8")
    if raw is None:
        raw = base64.b64decode(entry["value_b64"])[2:].decode()
    return str(raw.rsplit(" ", 1)[-1])


@pytest.mark.parametrize("mode", ["aligned", pytest.param("unaligned", marks=pytest.mark.slow)])
def test_every_malformed_record_is_dead_lettered_exactly_once_when_workers_are_killed(
    kafka_endpoint: tuple[str, str], tmp_path: Path, mode: str
) -> None:
    seed = chaos_seed()
    records, bad = 60_000, 600
    topic = f"dead-letters-{uuid.uuid4().hex[:8]}"
    where = produce_with_malformed(kafka_endpoint[0], topic, records, bad, seed=seed)
    dead_dir = tmp_path / "dead-letters"
    run = run_chaos(
        "dead_letters_work.py",
        brokers=kafka_endpoint[0],
        tmp=tmp_path,
        records=0,  # the topic is already filled
        seed=seed,
        mode=mode,
        interval=0.5,
        faults=NAMED,
        random_kills=3,
        env={"CLICKS_TOPIC": topic, "DEAD_LETTER_DIR": str(dead_dir)},
    )
    print(f"seed={seed} random kills (s after start, worker): {run.random_kills}")
    print(f"restarts={run.result.restarts} causes={run.result.restart_causes}")
    fired = {point for _w, point in run.faults_fired}
    assert fired == {f.point for f in NAMED}, f"seed={seed}: named faults fired: {fired}"
    assert len(run.random_kills) == 3, f"seed={seed}: the job ended before 3 random kills"

    # the good records: exactly the running totals of the clicks alone
    assert_exactly_once(expected(expected_running_totals, records, seed), run.output, seed=seed)

    entries = read_jsonl(dead_dir)
    by_id = Counter(_bad_id(e) for e in entries)
    repeated = {k: n for k, n in by_id.items() if n != 1}
    missing = set(where) - set(by_id)
    unexpected = set(by_id) - set(where)
    assert not (repeated or missing or unexpected), (
        f"seed={seed}: {len(entries)} dead letters for {bad} malformed records; repeated "
        f"{list(repeated.items())[:5]}, missing {sorted(missing)[:5]}, unexpected "
        f"{sorted(unexpected)[:5]}"
    )
    # where each came from: the exact source record, or the channel record after the shuffle
    for entry in entries:
        bad_id = _bad_id(entry)
        kind, partition, offset = where[bad_id]
        assert (entry["step"], entry["error_type"]) == KINDS[kind], (bad_id, entry)
        if kind == "no-amount":
            assert entry["topic"].startswith("eosflow.") and entry["offset"] is not None, entry
            assert entry["value"]["user"] and entry["key"] == entry["value"]["user"]
        else:
            assert (entry["topic"], entry["partition"], entry["offset"]) == (
                topic,
                partition,
                offset,
            ), (bad_id, entry)
