"""The lakehouse sinks under crashes: the running total sunk into a Delta table and an Iceberg
table (one job, both sinks) while workers are SIGKILLed at every protocol point of the sinks and
at random moments.

Both tables are read back by the formats' own readers (``deltalake`` to pyarrow, a
``pyiceberg`` scan) and compared, as multisets, with the running totals computed from the click
generator alone: nothing lost, nothing twice. Each checkpoint must be at most one table commit
per sink (subtask 0 commits every subtask's files). Each test prints its seed; rerun one with
``EOSFLOW_CHAOS_SEED=<seed>``.
"""

from __future__ import annotations

import os
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest

pytest.importorskip("deltalake")
pytest.importorskip("pyiceberg")

from processor.runtime.supervision.local import Fault
from processor.testing.compare import canonical
from sinks.files import read_jsonl
from sinks.lake import read_delta, read_iceberg
from tests.e2e.harness import (
    ChaosRun,
    assert_exactly_once,
    assert_faults_fired,
    chaos_seed,
    expected,
    expected_running_totals,
    run_chaos,
)
from tests.integration.s3_server import ACCESS, S3Server, s3_server
from tests.integration.test_sinks_lake_s3 import delta_options, iceberg_catalog

__all__ = ["s3_server"]  # the fixture, imported to be used here

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

#: One kill per start, at each point the lakehouse sinks go through. Worker 0 runs subtask 0,
#: the committer: mid-sink-commit (the table commit done, the staging not yet cleaned) and
#: after-completion-before-commit on it are the windows that matter. A point kills at the
#: first sink step that reaches it: Iceberg in the CI test (its idempotency is all eosflow's
#: check; Delta's txn is also guarded by delta-rs), Delta in the crash-tier one.
NAMED = [
    Fault(0, 1, "before-prepare", 3),
    Fault(1, 0, "after-snapshot-before-ack", 2),
    Fault(2, 0, "after-completion-before-commit", 2),
    Fault(3, 0, "mid-sink-commit", 2),
    Fault(4, 1, "mid-sink-recover", 1),
    Fault(5, 0, "during-recovery", 1),
]


def _rows(table: Any) -> list[list[Any]]:
    return [[r["user"], [r["count"], r["amount"]]] for r in table.to_pylist()]


def _catalog(lake: Path, s3: S3Server | None = None, bucket: str = "") -> dict[str, str]:
    if s3 is not None:
        return {**iceberg_catalog(s3, bucket, lake), "uri": f"sqlite:///{lake}/catalog.db"}
    return {
        "type": "sql",
        "uri": f"sqlite:///{lake}/catalog.db",
        "warehouse": f"file://{lake}/warehouse",
    }


def _run(
    tmp: Path,
    brokers: str,
    *,
    records: int,
    seed: int,
    kills: int,
    faults: list[Fault],
    workers: int = 2,
    mode: str = "aligned",
    work_us: int = 300,
    order: str = "iceberg,delta",
    s3: S3Server | None = None,
    misfit_every: int = 0,
) -> ChaosRun:
    lake = tmp / "lake"
    lake.mkdir()
    env = {"WORK_US": str(work_us), "LAKE_DIR": str(lake), "LAKE_ORDER": order}
    if misfit_every:
        env.update(LAKE_MISFIT_EVERY=str(misfit_every), DEAD_DIR=str(tmp / "dead"))
    delta_uri, options, bucket = str(lake / "delta"), None, ""
    if s3 is not None:
        bucket = s3.bucket()
        delta_uri, options = f"s3://{bucket}/delta", delta_options(s3)
        env.update(
            LAKE_S3=bucket,
            AWS_ENDPOINT_URL=s3.endpoint,
            AWS_ACCESS_KEY_ID=ACCESS["key"],
            AWS_SECRET_ACCESS_KEY=ACCESS["secret"],
        )
    run = run_chaos(
        "running_total_lake.py",
        brokers=brokers,
        tmp=tmp,
        records=records,
        seed=seed,
        mode=mode,
        interval=0.4,
        faults=faults,
        random_kills=kills,
        workers=workers,
        env=env,
        read_output=lambda _env: _rows(read_delta(delta_uri, storage_options=options)),
    )
    print(f"seed={seed} random kills (s after start, worker): {run.random_kills}")
    print(f"restarts={run.result.restarts} checkpoints={run.result.checkpoints}")
    print(f"faults fired: {run.faults_fired}")
    assert_faults_fired(run, faults, kills, seed=seed)
    want = expected(expected_running_totals, records, seed)
    if misfit_every:
        want, misfits = _split_misfits(want, misfit_every)
        dead = Counter(
            (d["step"], canonical([d["key"], d["value"]])) for d in read_jsonl(str(tmp / "dead"))
        )
        want_dead = Counter(
            {(step, item): n for item, n in misfits.items() for step in ("delta", "iceberg")}
        )
        assert dead == want_dead, (
            f"seed={seed}: dead letters differ: {sum((want_dead - dead).values())} missing, "
            f"{sum((dead - want_dead).values())} extra"
        )
    assert_exactly_once(want, run.output, seed=seed)  # Delta
    iceberg = Counter(
        canonical(r) for r in _rows(read_iceberg("lake.totals", catalog=_catalog(lake, s3, bucket)))
    )
    assert_exactly_once(want, iceberg, seed=seed)
    _check_commits(lake, run, seed=seed, delta_uri=delta_uri, options=options, s3=s3, bucket=bucket)
    return run


def _split_misfits(want: Counter[bytes], every: int) -> tuple[Counter[bytes], Counter[bytes]]:
    """(the rows that fit, the misfits): a running total whose count is a multiple of
    ``every`` does not fit the tables (``LAKE_MISFIT_EVERY``)."""
    fit: Counter[bytes] = Counter()
    misfit: Counter[bytes] = Counter()
    for item, n in want.items():
        count = orjson.loads(item)[1][0]
        (misfit if count % every == 0 else fit)[item] += n
    return fit, misfit


def _delta_checkpoints(uri: str, s3: S3Server | None) -> list[int]:
    """The checkpoint of each commit in the Delta log (its ``commitInfo``), read with fsspec:
    delta-rs's ``history()`` hung against moto's server (a listing with ``start-after``)."""
    import fsspec
    import orjson

    options = {} if s3 is None else {**ACCESS, "endpoint_url": s3.endpoint}
    fs, root = fsspec.core.url_to_fs(uri, skip_instance_cache=True, **options)
    found = []
    for path in sorted(fs.glob(f"{root}/_delta_log/*.json")):
        for line in fs.cat_file(path).splitlines():
            info = orjson.loads(line).get("commitInfo")
            if info is not None and "eosflow.checkpoint" in info:
                found.append(int(info["eosflow.checkpoint"]))
    return found


def _check_commits(
    lake: Path,
    run: ChaosRun,
    *,
    seed: int,
    delta_uri: str,
    options: dict[str, str] | None,
    s3: S3Server | None,
    bucket: str,
) -> None:
    """At most one table commit per checkpoint and sink, each naming its checkpoint."""
    from pyiceberg.catalog import load_catalog

    chk = _delta_checkpoints(delta_uri, s3)
    assert len(chk) == len(set(chk)), f"seed={seed}: a checkpoint committed twice: {sorted(chk)}"
    table = load_catalog("default", **_catalog(lake, s3, bucket)).load_table("lake.totals")
    snaps = [s.summary.additional_properties.get("eosflow.checkpoint") for s in table.snapshots()]
    ice = [int(c) for c in snaps if c is not None]
    assert len(ice) == len(set(ice)), f"seed={seed}: a checkpoint committed twice: {sorted(ice)}"
    assert len(ice) == len(snaps), f"seed={seed}: a snapshot without a checkpoint: {snaps}"
    assert len(ice) <= run.result.checkpoints + 1
    print(f"delta commits={len(chk)} iceberg snapshots={len(ice)}")


def test_lake_tables_are_exactly_once_when_workers_are_killed_at_every_sink_point_and_randomly(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    seed = chaos_seed()
    run = _run(tmp_path, kafka_endpoint[0], records=40_000, seed=seed, kills=2, faults=NAMED)
    assert run.result.checkpoints >= 5


@pytest.mark.crash
def test_lake_tables_are_exactly_once_with_three_workers_when_killed_randomly(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    """--workers 3: three subtasks' files per commit, kills on every worker; every 20th total
    of a user does not fit the tables and must be a dead letter once per sink step."""
    seed = chaos_seed()
    _run(
        tmp_path, kafka_endpoint[0], records=60_000, seed=seed, kills=3, faults=NAMED,
        workers=3, order="delta,iceberg", misfit_every=20,
    )  # fmt: skip


@pytest.mark.slow
def test_lake_tables_are_exactly_once_when_killed_many_times_unaligned(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    seed = chaos_seed()
    _run(
        tmp_path, kafka_endpoint[0], records=200_000, seed=seed, kills=8, faults=NAMED,
        mode="unaligned", work_us=60,
    )  # fmt: skip


@pytest.mark.crash
def test_lake_tables_on_s3_are_exactly_once_when_workers_are_killed_at_every_sink_point(
    kafka_endpoint: tuple[str, str], tmp_path: Path, s3_server: S3Server
) -> None:
    """The same on object storage: the Delta table and the Iceberg warehouse on moto's S3
    server (delta-rs with conditional PUT, pyiceberg's FileIO)."""
    seed = chaos_seed()
    _run(
        tmp_path, kafka_endpoint[0], records=30_000, seed=seed, kills=1, faults=NAMED, s3=s3_server
    )


@pytest.mark.crash
def test_lake_tables_are_exactly_once_when_the_job_dies_before_commit_and_restarts_rescaled(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    """3 workers; the whole job (runner and workers) is SIGKILLed while checkpoint n is
    complete and its commit not done (the committer, worker 0, held there). The next start
    has 2 workers: settling the old shape commits epoch n (old subtask 0 commits every old
    subtask's files), the new shape's subtask 0 commits from then on; a worker is killed
    before a prepare on the way to the end."""
    import subprocess
    import sys

    from examples.clicks import click_events, produce_json
    from tests.e2e.cli import held_then_killed
    from tests.e2e.harness import PIPELINES

    seed = chaos_seed()
    records = 24_000
    run_id = uuid.uuid4().hex[:8]
    lake = tmp_path / "lake"
    lake.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EOSFLOW_")}
    env.update(
        JOB_NAME=f"lake-rescale-{run_id}",
        CLICKS_TOPIC=f"lake-rescale-clicks-{run_id}",
        EOSFLOW_KAFKA_BROKERS=kafka_endpoint[0],
        EOSFLOW_STATE_DIR=str(tmp_path / "state"),
        LAKE_DIR=str(lake),
        WORK_US="200",
    )
    events = list(click_events(records, seed=seed))

    def produce(part: list[dict[str, Any]]) -> None:
        produce_json(kafka_endpoint[0], env["CLICKS_TOPIC"], part, key=lambda e: str(e["user"]))

    pipeline = str(PIPELINES / "running_total_lake.py")
    run = [sys.executable, "-m", "processor.cli", "run", pipeline, "--checkpoint-interval", "0.4"]
    produce(events[: records // 2])
    held_then_killed(
        [*run, "--workers", "3", "--fault", "0:0:after-completion-before-commit:3:hold"],
        env,
        tmp_path / "holds",
        "after-completion-before-commit",
        0,
    )
    produce(events[records // 2 :])
    done = subprocess.run(
        [*run, "--workers", "2", "--until-idle", "--fault", "0:1:before-prepare:2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    want = expected(expected_running_totals, records, seed)
    got = Counter(canonical(r) for r in _rows(read_delta(str(lake / "delta"))))
    assert_exactly_once(want, got, seed=seed)
    got = Counter(canonical(r) for r in _rows(read_iceberg("lake.totals", catalog=_catalog(lake))))
    assert_exactly_once(want, got, seed=seed)


def test_a_reset_job_runs_again_into_its_lake_tables_and_each_row_is_there_once(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    """Issue 48 item 4: ``eosflow reset`` left the tables' records of the job's last checkpoint
    (Iceberg property, Delta ``txn``), and the next run failed on the Delta table ("holds job
    ... commit of checkpoint N"). Given the pipeline, reset's plan lists them and ``--yes``
    clears them: the next run (new input, checkpoint ids from 1 again) starts, and each table
    holds both runs' rows once."""
    import subprocess
    import sys

    from examples.clicks import click_events, produce_json
    from tests.e2e.cli import job_env
    from tests.e2e.harness import PIPELINES

    seed, records = chaos_seed(), 3_000
    lake = tmp_path / "lake"
    lake.mkdir()
    env = job_env(kafka_endpoint[0], tmp_path, prefix="lake-reset", LAKE_DIR=str(lake), WORK_US="0")
    topic = env["CLICKS_TOPIC"]
    pipeline = str(PIPELINES / "running_total_lake.py")
    cli = [sys.executable, "-m", "processor.cli"]
    want: Counter[bytes] = Counter()
    for run, run_seed in enumerate((seed, seed + 1)):
        env["CLICKS_TOPIC"] = f"{topic}-{run}"
        produce_json(kafka_endpoint[0], env["CLICKS_TOPIC"],
                     list(click_events(records, seed=run_seed)),
                     key=lambda e: str(e["user"]))  # fmt: skip
        done = subprocess.run(
            [*cli, "run", pipeline, "--workers", "2", "--checkpoint-interval", "0.3",
             "--until-idle"],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-8000:]
        want += expected(expected_running_totals, records, run_seed)
        if run == 0:
            reset = subprocess.run(
                [*cli, "reset", env["JOB_NAME"], "--pipeline", pipeline, "--yes"],
                env=env, capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            assert reset.returncode == 0, reset.stdout + reset.stderr[-3000:]
            plan = [line for line in reset.stdout.splitlines() if "and clears" in line]
            assert any("Delta table" in line for line in plan), reset.stdout
            assert any("Iceberg table lake.totals" in line for line in plan), reset.stdout
            assert sum(line.startswith("cleared ") for line in reset.stdout.splitlines()) == 2, (
                reset.stdout
            )
    got = Counter(canonical(r) for r in _rows(read_delta(str(lake / "delta"))))
    assert_exactly_once(want, got, seed=seed)
    got = Counter(canonical(r) for r in _rows(read_iceberg("lake.totals", catalog=_catalog(lake))))
    assert_exactly_once(want, got, seed=seed)
