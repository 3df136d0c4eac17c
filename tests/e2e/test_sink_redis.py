"""End-to-end exactly-once into Redis under crashes: SIGKILL at every protocol point of the sink
and at random moments; the committed Redis state must equal what the click generator implies.

Each test prints its seed; rerun one with ``EOSFLOW_CHAOS_SEED=<seed>``. The pipeline
(``pipelines/running_total_redis.py``) sinks the running totals three ways: RPUSH of every output
(compared as a multiset), HSET of the latest total per user and HINCRBY of every click's amount
per user (a replayed epoch would count twice).
"""

from __future__ import annotations

import importlib
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from processor.runtime.supervision.local import Fault
from tests.e2e.harness import (
    ChaosRun,
    assert_exactly_once,
    assert_faults_fired,
    chaos_seed,
    click_events,
    expected,
    expected_running_totals,
    run_chaos,
)

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

clicks = importlib.import_module("clicks")  # examples/clicks.py, on sys.path via the harness

#: Every protocol point a Redis sink subtask passes, one fault per start of the job.
NAMED = [
    Fault(0, 1, "before-prepare", 3),
    Fault(1, 0, "after-snapshot-before-ack", 2),
    Fault(2, 1, "after-completion-before-commit", 2),
    Fault(3, 0, "during-recovery", 1),
    Fault(4, 1, "mid-sink-recover", 1),
]


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    conn = redis.Redis.from_url(redis_url)
    yield conn
    conn.close()


def _run(
    redis_url: str,
    client: redis.Redis,
    kafka: str,
    tmp: Path,
    *,
    records: int,
    seed: int,
    mode: str,
    faults: list[Fault],
    random_kills: int,
    self_kills: int,
) -> tuple[ChaosRun, str]:
    # run_chaos allows len(faults) + random_kills + 5 restarts; self kills use the spare ones.
    assert self_kills <= 4
    prefix = f"test:sink-redis:{uuid.uuid4().hex[:8]}"
    kills = tmp / "self-kills"
    kills.mkdir()

    def read_list(_env: dict[str, str]) -> list[Any]:
        return [orjson.loads(item) for item in client.lrange(f"{prefix}:out", 0, -1)]

    run = run_chaos(
        "running_total_redis.py",
        brokers=kafka,
        tmp=tmp,
        records=records,
        seed=seed,
        mode=mode,
        interval=0.5,
        faults=faults,
        random_kills=random_kills,
        env={
            "EOSFLOW_REDIS_URL": redis_url,
            "REDIS_PREFIX": prefix,
            "SELF_KILLS": str(self_kills),
            "SELF_KILL_DIR": str(kills),
            "SELF_KILL_SEED": str(seed),
            # The runner's import, then two workers per start that a named fault ends.
            "SELF_KILL_AFTER_STARTS": str(1 + 2 * len(faults)),
        },
        read_output=read_list,
    )
    fired = len(list(kills.glob("kill-*")))
    print(f"seed={seed} random kills (s after start, worker): {run.random_kills}")
    print(f"seed={seed} kills in the middle of an epoch: {fired}")
    assert fired == self_kills, f"seed={seed}: {fired} of {self_kills} mid-epoch kills fired"
    print(f"restarts={run.result.restarts} causes={run.result.restart_causes}")
    return run, prefix


def _assert_redis_state(
    client: redis.Redis, run: ChaosRun, prefix: str, *, records: int, seed: int
) -> None:
    assert_exactly_once(expected(expected_running_totals, records, seed), run.output, seed=seed)
    totals = clicks.expected_totals(click_events(records, seed=seed))
    latest = {k.decode(): orjson.loads(v) for k, v in client.hgetall(f"{prefix}:latest").items()}
    assert latest == {u: [t.count, t.amount] for u, t in totals.items()}, f"seed={seed}: HSET"
    amounts = {k.decode(): int(v) for k, v in client.hgetall(f"{prefix}:amount").items()}
    want = {u: t.amount for u, t in totals.items()}
    wrong = {
        u: (amounts.get(u), want.get(u)) for u in {*want, *amounts} if amounts.get(u) != want.get(u)
    }
    assert not wrong, f"seed={seed}: HINCRBY (got, want) for {len(wrong)} users: {wrong}"
    # The paths the faults must reach: commits of epochs already committed before the crash
    # (the guard), and staged epochs of checkpoints that never completed (orphans).
    text = "".join(run.logs.values())
    repeated = text.count("INFO sinks.redis.writer: already committed")
    orphans = sum(
        int(n) for n in re.findall(r"redis\.writer: recovered .* orphans_deleted=(\d+)", text)
    )
    print(f"seed={seed} commits found already done={repeated} orphans deleted={orphans}")
    assert repeated > 0 and orphans > 0, f"seed={seed}: recovery paths not exercised"
    # Every epoch was committed or cleaned up: no staged epoch is left behind.
    pattern = f"eosflow:sink:{run.result.job}:*:stage:*"
    left = list(client.scan_iter(match=pattern, count=1000))
    assert not left, f"seed={seed}: staged epochs left behind: {left[:5]}"


def test_redis_state_is_exactly_once_when_workers_are_killed_at_every_protocol_point(
    kafka_endpoint: tuple[str, str], redis_url: str, client: redis.Redis, tmp_path: Path
) -> None:
    seed, records = chaos_seed(), 100_000
    run, prefix = _run(
        redis_url, client, kafka_endpoint[0], tmp_path,
        records=records, seed=seed, mode="aligned", faults=NAMED, random_kills=2, self_kills=2,
    )  # fmt: skip
    assert_faults_fired(run, NAMED, 2, seed=seed)  # and 2 self-kills of the pipeline
    _assert_redis_state(client, run, prefix, records=records, seed=seed)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["aligned", "unaligned"])
def test_redis_state_is_exactly_once_when_workers_are_killed_often(
    kafka_endpoint: tuple[str, str], redis_url: str, client: redis.Redis, tmp_path: Path, mode: str
) -> None:
    seed, records = chaos_seed(), 300_000
    run, prefix = _run(
        redis_url, client, kafka_endpoint[0], tmp_path,
        records=records, seed=seed, mode=mode, faults=NAMED, random_kills=6, self_kills=4,
    )  # fmt: skip
    fired = {point for _w, point in run.faults_fired}
    assert fired == {f.point for f in NAMED}, f"seed={seed}: named faults fired: {fired}"
    assert len(run.random_kills) == 6, f"seed={seed}: the job ended before 6 random kills"
    _assert_redis_state(client, run, prefix, records=records, seed=seed)
