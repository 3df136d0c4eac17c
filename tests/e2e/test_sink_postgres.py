"""End-to-end exactly-once into PostgreSQL under crashes: SIGKILL at every protocol point of the
two-phase commit and at random moments.

One run checks both modes: the running total goes to an append table (one row per click,
compared as a multiset with :func:`expected_running_totals`) and to an upsert table (the last
totals per user, compared with :func:`expected_totals`). Both expectations come from the click
generator, never from the engine. Each test prints its seed; rerun one with
``EOSFLOW_CHAOS_SEED=<seed>``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from processor.runtime.supervision.local import Fault
from tests.e2e.harness import (
    RUNNERS,
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

#: Every point of the sink's protocol, one per start attempt (the killer waits for them all).
#: mid-sink-recover fires only when the restored snapshot holds a pending committable for the
#: worker's sinks: worker 1 was killed after checkpoint n completed with a commit due, so its
#: snapshot of n holds one, whatever the timing of the records (an epoch may be empty).
NAMED = [
    Fault(0, 1, "before-prepare", 3),
    Fault(1, 0, "after-snapshot-before-ack", 2),
    Fault(2, 1, "after-completion-before-commit", 2),
    Fault(3, 1, "mid-sink-recover", 1),
    Fault(4, 0, "during-recovery", 1),
]


def _expected_totals(records: int, seed: int) -> dict[str, tuple[int, int]]:
    from clicks import expected_totals  # examples/ is on sys.path through the harness

    return {
        u: (t.count, t.amount) for u, t in expected_totals(click_events(records, seed=seed)).items()
    }


@pytest.fixture
def tables(postgres_dsn: str) -> Iterator[tuple[str, str]]:
    """(append table, upsert table), unique to the test and dropped after it."""
    tag = uuid.uuid4().hex[:8]
    names = (f"rt_rows_{tag}", f"rt_latest_{tag}")
    yield names
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        for name in names:
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(name)))


def _select(dsn: str, table: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        query = sql.SQL("SELECT user_id, clicks, amount FROM {}").format(sql.Identifier(table))
        return conn.execute(query).fetchall()


def _prepared(dsn: str, job: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT gid FROM pg_prepared_xacts WHERE starts_with(gid, %s)", [f"eosflow:{job}:"]
        ).fetchall()
    return [r[0] for r in rows]


def _run(
    dsn: str,
    kafka: str,
    tmp: Path,
    tables: tuple[str, str],
    *,
    records: int,
    seed: int,
    mode: str,
    faults: list[Fault],
    random_kills: int,
    work_us: int,
    runner: str = "local",
) -> ChaosRun:
    append, upsert = tables
    run = run_chaos(
        "running_total_postgres.py",
        brokers=kafka,
        tmp=tmp,
        records=records,
        seed=seed,
        mode=mode,
        interval=0.5,
        faults=faults,
        random_kills=random_kills,
        env={
            "EOSFLOW_POSTGRES_DSN": dsn,
            "PG_APPEND_TABLE": append,
            "PG_UPSERT_TABLE": upsert,
            "WORK_US": str(work_us),
        },
        read_output=lambda _env: [[u, [c, a]] for u, c, a in _select(dsn, append)],
        runner=runner,
    )
    print(f"seed={seed} random kills (s after start, worker): {run.random_kills}")
    print(f"restarts={run.result.restarts} causes={run.result.restart_causes}")
    print(f"seconds={run.result.seconds:.1f} checkpoints={run.result.checkpoints}")
    return run


def _check(run: ChaosRun, dsn: str, tables: tuple[str, str], *, records: int, seed: int) -> None:
    assert_exactly_once(expected(expected_running_totals, records, seed), run.output, seed=seed)
    latest = {u: (c, a) for u, c, a in _select(dsn, tables[1])}
    want = _expected_totals(records, seed)
    wrong = {u: (latest.get(u), t) for u, t in want.items() if latest.get(u) != t}
    assert not wrong and len(latest) == len(want), (
        f"seed={seed}: upsert table differs for {len(wrong)} of {len(want)} users "
        f"(got, want), e.g. {list(wrong.items())[:5]}; {len(latest)} rows"
    )
    left = _prepared(dsn, run.result.job)
    assert left == [], f"seed={seed}: prepared transactions of the job left behind: {left}"


@pytest.mark.parametrize("runner", RUNNERS)
def test_postgres_output_is_exactly_once_when_workers_are_killed_at_every_protocol_point(
    postgres_dsn: str,
    kafka_endpoint: tuple[str, str],
    tmp_path: Path,
    tables: tuple[str, str],
    runner: str,
) -> None:
    seed = chaos_seed()
    records = 60_000
    run = _run(
        postgres_dsn,
        kafka_endpoint[0],
        tmp_path,
        tables,
        records=records,
        seed=seed,
        mode="aligned",
        faults=NAMED,
        random_kills=2,
        work_us=300,
        runner=runner,
    )
    assert_faults_fired(run, NAMED, 2, seed=seed)
    _check(run, postgres_dsn, tables, records=records, seed=seed)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["aligned", "unaligned"])
def test_postgres_output_is_exactly_once_when_workers_are_killed_often_in_a_long_run(
    postgres_dsn: str,
    kafka_endpoint: tuple[str, str],
    tmp_path: Path,
    tables: tuple[str, str],
    mode: str,
) -> None:
    seed = chaos_seed()
    records = 200_000
    run = _run(
        postgres_dsn,
        kafka_endpoint[0],
        tmp_path,
        tables,
        records=records,
        seed=seed,
        mode=mode,
        faults=NAMED,
        random_kills=8,
        work_us=150,
    )
    assert {point for _w, point in run.faults_fired} == {f.point for f in NAMED}
    assert len(run.random_kills) == 8, f"seed={seed}: the job ended before 8 random kills"
    _check(run, postgres_dsn, tables, records=records, seed=seed)
