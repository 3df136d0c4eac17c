"""Savepoints (issue 24, item 2) end to end: a running job stops with a savepoint, its
checkpoints are deleted, and a changed version of the pipeline (same stateful step names)
restores the savepoint and carries on, SIGKILLed at a protocol point and at random: the
committed output is every click's running total exactly once, the first part by version 1,
the rest by version 2 (tagged), computed from the clicks without the engine."""

from __future__ import annotations

import shutil
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from processor.errors import ConfigError
from processor.runtime.shape.savepoints import request_savepoint
from processor.runtime.supervision.local import Fault, JobFailed, LocalRunner, RunOptions
from processor.snapshot.store import SnapshotStore
from sinks import read_jsonl
from tests.e2e.harness import (
    PIPELINES,
    assert_exactly_once,
    canonical,
    chaos_seed,
    click_events,
    produce_json,
)

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

FIRST, LATER = 6_000, 15_000


def _expected(seed: int, version_2_from: int = FIRST) -> Counter[bytes]:
    """Every click's running total, tagged ``"v2"`` from click ``version_2_from`` on."""
    acc: dict[str, tuple[int, int]] = {}
    out: Counter[bytes] = Counter()
    for i, e in enumerate(click_events(FIRST + LATER, seed=seed)):
        user = str(e["user"])
        count, amount = acc.get(user, (0, 0))
        acc[user] = (count + 1, amount + int(e["amount"]))
        line = list(acc[user]) if i < version_2_from else [*acc[user], "v2"]
        out[canonical([user, line])] += 1
    return out


def _job(
    brokers: str, tmp: Path, name: str, *, work_us: int
) -> tuple[int, dict[str, str], list[dict[str, Any]]]:
    """A seed, the job's environment (its own job name, topic and output), and the clicks."""
    seed = chaos_seed()
    run_id = uuid.uuid4().hex[:8]
    env = {
        "JOB_NAME": f"{name}-{run_id}",
        "CLICKS_TOPIC": f"{name}-clicks-{run_id}",
        "OUTPUT_DIR": str(tmp / "output"),
        "EOSFLOW_KAFKA_BROKERS": brokers,
        "WORK_US": str(work_us),
    }
    return seed, env, list(click_events(FIRST + LATER, seed=seed))


def _key(event: dict[str, Any]) -> str:
    return str(event["user"])


def _committed(env: dict[str, str]) -> int:
    return len(read_jsonl(env["OUTPUT_DIR"])) if Path(env["OUTPUT_DIR"]).exists() else 0


def _options(tmp: Path, env: dict[str, str], **kw: Any) -> RunOptions:
    return RunOptions(
        workers=2,
        checkpoint_interval=0.3,
        environ=env,
        state_dir=str(tmp / "state"),
        restart_backoff=0.1,
        max_backoff=0.5,
        metrics="off",
        **kw,
    )


def test_a_savepoint_restores_into_changed_code_after_its_checkpoints_are_deleted(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    seed, env, events = _job(kafka_endpoint[0], tmp_path, "savepoint", work_us=100)
    produce_json(kafka_endpoint[0], env["CLICKS_TOPIC"], events[:FIRST], key=_key)
    pipeline = str(PIPELINES / "versioned_total.py")

    # Version 1 runs until stopped: a savepoint with --stop once every click is committed.
    first = LocalRunner(pipeline, _options(tmp_path, env))
    thread = threading.Thread(target=first.run)
    thread.start()
    deadline = time.monotonic() + 120
    while _committed(env) < FIRST and time.monotonic() < deadline:
        time.sleep(0.2)
    store = SnapshotStore(first.store.url)
    path = request_savepoint(store, env["JOB_NAME"], stop=True, path=None, timeout=60)
    thread.join(60)
    assert not thread.is_alive()
    assert len(read_jsonl(env["OUTPUT_DIR"])) == FIRST

    # The checkpoints go (retention, a lost disk): the savepoint is kept apart.
    job_dir = Path(first.store.url.removeprefix("file://")) / env["JOB_NAME"]
    for chk in job_dir.glob("chk-*"):
        shutil.rmtree(chk)
    assert SnapshotStore(first.store.url).latest_completed(env["JOB_NAME"]) is None

    # Version 2 restores it, reads the clicks written since, and is killed on the way.
    produce_json(kafka_endpoint[0], env["CLICKS_TOPIC"], events[FIRST:], key=_key)
    faults = [Fault(0, 1, "after-completion-before-commit", 1), Fault(1, 0, "mid-alignment", 1)]
    second = LocalRunner(
        pipeline,
        _options(
            tmp_path,
            {**env, "PIPELINE_VERSION": "2"},
            until_idle=True,
            from_savepoint=path,
            faults=faults,
            max_restarts=5,
        ),
    )
    result = second.run()
    assert result.restarts == len(faults), result.restart_causes
    got = Counter(canonical(line) for line in read_jsonl(env["OUTPUT_DIR"]))
    assert_exactly_once(_expected(seed), got, seed=seed)


def test_a_savepoint_of_a_running_job_restores_after_later_checkpoints_are_deleted(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    """A savepoint taken while the job runs on (an aligned checkpoint it triggers for it), the
    job's later checkpoints deleted: restoring it would be a rewind (the output since would be
    committed again), refused without --allow-rewind; with it, the state is restored and the
    file sink refuses to repeat the output of the later checkpoints. Either way the committed
    output stays every click's running total exactly once."""
    seed, env, events = _job(kafka_endpoint[0], tmp_path, "savepoint-run", work_us=200)
    produce_json(kafka_endpoint[0], env["CLICKS_TOPIC"], events, key=_key)
    pipeline = str(PIPELINES / "versioned_total.py")
    # Paced, so that the job commits output after the savepoint (3,000 clicks/s per worker).
    first = LocalRunner(pipeline, _options(tmp_path, env, max_rate=3000.0))
    thread = threading.Thread(target=first.run)
    thread.start()
    deadline = time.monotonic() + 120
    while _committed(env) < 2_000 and time.monotonic() < deadline:
        time.sleep(0.05)
    store = SnapshotStore(first.store.url)
    path = request_savepoint(store, env["JOB_NAME"], stop=False, path=None, timeout=60)
    while _committed(env) < FIRST + LATER and time.monotonic() < deadline:
        time.sleep(0.2)  # it runs on past the savepoint, to the end of the input
    first.stop_for("test")
    thread.join(60)
    assert not thread.is_alive()
    saved = int(path.rsplit("sp-", 1)[1])
    assert store.completed_ids(env["JOB_NAME"])[-1] > saved  # later checkpoints...
    job_dir = Path(first.store.url.removeprefix("file://")) / env["JOB_NAME"]
    for chk in job_dir.glob("chk-*"):
        shutil.rmtree(chk)  # ... deleted

    def second(**kw: Any) -> LocalRunner:
        options = _options(tmp_path, env, until_idle=True, from_savepoint=path, **kw)
        return LocalRunner(pipeline, options)

    with pytest.raises(ConfigError, match="--allow-rewind"):
        second().run()
    before = Counter(canonical(line) for line in read_jsonl(env["OUTPUT_DIR"]))
    assert_exactly_once(_expected(seed, version_2_from=FIRST + LATER), before, seed=seed)
    # Allowed, the job restores the savepoint's state; its file sink then refuses to write next
    # to output of later checkpoints (it would commit it again), and nothing is written twice.
    with pytest.raises(JobFailed, match="holds part files up to checkpoint"):
        second(allow_rewind=True, max_restarts=1).run()
    after = Counter(canonical(line) for line in read_jsonl(env["OUTPUT_DIR"]))
    assert after == before
