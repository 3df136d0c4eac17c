"""A savepoint restores after ``eosflow reset`` (issue 35, item 3), as the refusal of a restore
over newer checkpoints advises: ``eosflow savepoint JOB --stop``, ``eosflow reset JOB --yes
--pipeline P``, more input, ``eosflow run P --from-savepoint PATH --until-idle``.

Reset deleted everything the job had outside the savepoint: its checkpoints, its channel topic
(recreated empty by the restore) and its dedup IDs in Redis. The new input holds copies of
clicks read before the savepoint: only IDs the savepoint brought back can drop them. The
committed output must be every distinct click's running total exactly once, computed from the
click generator without the engine. Before the fix, the restore restarted 11 times on
``RedisDataLost`` (reset had deleted the IDs), and past that took channel positions in the
deleted topic (``DataLossError`` "reset the job").

A savepoint that needs records in flight in channels that are gone cannot be restored, whatever
a restart does: that refusal comes before any worker starts, not after ``--max-restarts``.
"""

from __future__ import annotations

import random
import re
import subprocess
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest

from connectors import KafkaSettings, TopicAdmin
from processor.runtime.shape.savepoints import _MARKER
from processor.snapshot.store import decode_snapshot, encode_snapshot
from sinks import read_jsonl
from tests.e2e.cli import eosflow, job_env, run_eosflow
from tests.e2e.harness import (
    PIPELINES,
    assert_exactly_once,
    canonical,
    chaos_seed,
    click_events,
    expected_running_totals,
    produce_json,
    with_duplicates,
)

pytestmark = pytest.mark.integration

PIPELINE = str(PIPELINES / "dedup_running_total.py")
FIRST, LATER = 4_000, 6_000
RESTARTED = re.compile(r"restart \d+:")


def _key(event: dict[str, Any]) -> str:
    return str(event["user"])


def _inputs(seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The clicks before the savepoint and after the reset, each with copies (10 %); the
    second part also re-sends a fifth of the first part's clicks (an upstream producer that
    retried across the operator's maintenance)."""
    events = list(click_events(FIRST + LATER, seed=seed))
    before = list(with_duplicates(iter(events[:FIRST]), 0.1, seed=seed))
    again = random.Random(seed).sample(events[:FIRST], FIRST // 5)
    after = list(with_duplicates(iter(events[FIRST:]), 0.1, seed=seed + 1))
    mixed = random.Random(seed + 2)
    for event in again:  # old copies anywhere among the new clicks (a user's order is kept)
        after.insert(mixed.randrange(len(after) + 1), event)
    return before, after


def _output(env: dict[str, str], settings: KafkaSettings, committed: bool) -> Counter[bytes]:
    if env.get("SINK") != "kafka":
        out = Path(env["OUTPUT_DIR"])
        return Counter(canonical(x) for x in read_jsonl(str(out))) if out.exists() else Counter()
    from tests.integration.test_sinks_kafka import read_topic

    msgs = read_topic(settings, env["OUTPUT_TOPIC"], committed=committed)
    return Counter(canonical([m.key().decode(), orjson.loads(m.value())]) for m in msgs)


def _run(env: dict[str, str], *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return run_eosflow(env, *args, timeout=timeout)


def _stopped_with_savepoint(env: dict[str, str], want: int, read: Any) -> str:
    """Runs the job until ``want`` lines are committed, then ``eosflow savepoint JOB --stop``;
    returns the savepoint's path."""
    log = Path(env["EOSFLOW_STATE_DIR"]).parent / "first-run.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(
            eosflow("run", PIPELINE, "--workers", "2", "--checkpoint-interval", "300ms"),
            env=env, stdout=sink, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while sum(read().values()) < want and proc.poll() is None:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.3)
        assert proc.poll() is None, log.read_text()[-3000:]
        saved = _run(env, "savepoint", env["JOB_NAME"], "--stop", "--timeout", "120")
        assert saved.returncode == 0, saved.stderr
        proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 0, log.read_text()[-3000:]
    return saved.stdout.strip().splitlines()[-1]


def _env(
    brokers: str, tmp: Path, redis_url: str, sink: str, settings: KafkaSettings
) -> dict[str, str]:
    env = job_env(brokers, tmp, "spreset", EOSFLOW_REDIS_URL=redis_url, SINK=sink)
    if sink == "kafka":
        run_id = uuid.uuid4().hex[:8]
        env.update(OUTPUT_TOPIC=f"spreset-out-{run_id}", TXN_PREFIX=f"spreset-{run_id}")
        TopicAdmin(settings).ensure_topic(env["OUTPUT_TOPIC"], 3)
    return env


def _savepoint_of_a_stopped_job(env: dict[str, str]) -> str:
    """Runs the job to the end of its input (a clean stop: its final checkpoint committed by
    every sink), then ``eosflow savepoint JOB`` copies that checkpoint; returns its path."""
    first = _run(env, "run", PIPELINE, "--workers", "2", "--checkpoint-interval", "300ms",
                 "--until-idle", "--no-drain")  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    saved = _run(env, "savepoint", env["JOB_NAME"])
    assert saved.returncode == 0, saved.stdout + saved.stderr
    assert "is not running: savepoint of its checkpoint" in saved.stdout, saved.stdout
    return saved.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("taken", ["running-stop", "stopped"])
@pytest.mark.parametrize("sink", ["file", "kafka"])
def test_a_savepoint_restores_exactly_once_after_reset_when_new_input_repeats_old_clicks(
    kafka_endpoint: tuple[str, str],
    kafka_settings: KafkaSettings,
    broker_caps: Any,
    redis_url: str,
    tmp_path: Path,
    sink: str,
    taken: str,
) -> None:
    """``running-stop``: ``eosflow savepoint JOB --stop`` of the running job. ``stopped``
    (issue 48 item 5): the copy of a job that had stopped cleanly recorded its checkpoint as
    not committed by the sinks; restored after the reset (which deleted the Kafka sink's commit
    markers) the Kafka sink published its last epoch again. The runner now records the final
    checkpoint its sinks committed, and the copy says ``committed``."""
    seed = chaos_seed()
    brokers = kafka_endpoint[0]
    env = _env(brokers, tmp_path, redis_url, sink, kafka_settings)
    # On Tansu read_committed shows aborted records anyway (docs/sinks.md): read everything.
    committed = broker_caps.read_committed_hides_aborted

    def read() -> Counter[bytes]:
        return _output(env, kafka_settings, committed)

    before, after = _inputs(seed)
    produce_json(brokers, env["CLICKS_TOPIC"], before, key=_key)
    if taken == "stopped":
        path = _savepoint_of_a_stopped_job(env)
    else:
        path = _stopped_with_savepoint(env, FIRST, read)
    first = expected_running_totals(click_events(FIRST, seed=seed))
    assert_exactly_once(first, read(), seed=seed)

    pipeline = ["--pipeline", PIPELINE]
    reset = _run(env, "reset", env["JOB_NAME"], "--yes", *pipeline)
    assert reset.returncode == 0, reset.stderr
    assert not TopicAdmin(kafka_settings).list_topics(f"eosflow.{env['JOB_NAME']}.")

    produce_json(brokers, env["CLICKS_TOPIC"], after, key=_key)
    began = time.monotonic()
    restored = _run(
        env, "run", PIPELINE, "--workers", "2", "--checkpoint-interval", "300ms",
        "--from-savepoint", path, "--until-idle",
    )  # fmt: skip
    assert restored.returncode == 0, (
        f"seed={seed} rc={restored.returncode} after {time.monotonic() - began:.0f}s: "
        f"{restored.stderr[-4000:]}"
    )
    assert not RESTARTED.search(restored.stderr), restored.stderr[-4000:]
    want = expected_running_totals(click_events(FIRST + LATER, seed=seed))
    assert_exactly_once(want, read(), seed=seed)


def test_a_savepoint_whose_in_flight_channel_records_are_gone_is_refused_before_any_worker_starts(
    kafka_endpoint: tuple[str, str],
    kafka_settings: KafkaSettings,
    redis_url: str,
    tmp_path: Path,
) -> None:
    """A savepoint whose tasks still had channel records to replay (here: a snapshot with a
    channel still recovering, as an unaligned checkpoint taken during a recovery leaves it, and
    an aligned final checkpoint can inherit) after a reset deleted that channel: no restart can
    bring those records back. The run fails at once, before any worker starts, saying what is
    missing and what to do; before the fix it restarted until --max-restarts."""
    seed = chaos_seed()
    brokers = kafka_endpoint[0]
    env = _env(brokers, tmp_path, redis_url, "file", kafka_settings)

    def read() -> Counter[bytes]:
        return _output(env, kafka_settings, True)

    before, _after = _inputs(seed)
    produce_json(brokers, env["CLICKS_TOPIC"], before, key=_key)
    path = _stopped_with_savepoint(env, FIRST, read)
    # The savepoint's keyed task still replays its first channel from an offset before its
    # position (what an unaligned snapshot during a recovery records).
    root = Path(path.removeprefix("file://"))
    manifest = orjson.loads((root / "_MANIFEST").read_bytes())
    task = next(t for t in sorted(manifest["tasks"]) if not t.startswith("clicks"))
    entry = manifest["tasks"][task]
    state = decode_snapshot((root / entry["file"]).read_bytes(), entry["file"])
    channel = sorted(tp for tp in state["positions"] if tp[0].startswith("eosflow."))[0]
    state["recovering"] = {channel: [[0, int(state["checkpoint"]) + 1]]}
    data, checksum = encode_snapshot(state)
    (root / entry["file"]).write_bytes(data)
    entry.update(size=len(data), checksum=checksum)
    (root / "_MANIFEST").write_bytes(orjson.dumps(manifest))
    assert (root / _MARKER).exists()

    reset = _run(env, "reset", env["JOB_NAME"], "--yes", "--pipeline", PIPELINE)
    assert reset.returncode == 0, reset.stderr
    began = time.monotonic()
    refused = _run(
        env, "run", PIPELINE, "--workers", "2", "--checkpoint-interval", "300ms",
        "--from-savepoint", path, "--until-idle", "--max-restarts", "10",
    )  # fmt: skip
    took = time.monotonic() - began
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert not RESTARTED.search(refused.stderr), refused.stderr[-3000:]
    assert f"savepoint {path}" in refused.stderr and "in flight" in refused.stderr, refused.stderr[
        -3000:
    ]
    assert took < 30, f"refused after {took:.0f}s"
    assert sum(read().values()) == FIRST  # nothing more was written
