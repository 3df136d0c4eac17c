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

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("deltalake")
pytest.importorskip("pyiceberg")

from processor.runtime.supervision.local import Fault
from processor.testing.compare import canonical
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


def _catalog(lake: Path) -> dict[str, str]:
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
) -> ChaosRun:
    lake = tmp / "lake"
    lake.mkdir()
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
        env={"WORK_US": str(work_us), "LAKE_DIR": str(lake), "LAKE_ORDER": order},
        read_output=lambda _env: _rows(read_delta(str(lake / "delta"))),
    )
    print(f"seed={seed} random kills (s after start, worker): {run.random_kills}")
    print(f"restarts={run.result.restarts} checkpoints={run.result.checkpoints}")
    print(f"faults fired: {run.faults_fired}")
    assert_faults_fired(run, faults, kills, seed=seed)
    want = expected(expected_running_totals, records, seed)
    assert_exactly_once(want, run.output, seed=seed)  # Delta
    iceberg = Counter(
        canonical(r) for r in _rows(read_iceberg("lake.totals", catalog=_catalog(lake)))
    )
    assert_exactly_once(want, iceberg, seed=seed)
    _check_commits(lake, run, seed=seed)
    return run


def _check_commits(lake: Path, run: ChaosRun, *, seed: int) -> None:
    """At most one table commit per checkpoint and sink, each naming its checkpoint."""
    import deltalake
    from pyiceberg.catalog import load_catalog

    history = deltalake.DeltaTable(str(lake / "delta")).history()
    delta = [h for h in history if h.get("operation") == "WRITE"]
    chk = [int(h["eosflow.checkpoint"]) for h in delta]
    assert len(chk) == len(set(chk)), f"seed={seed}: a checkpoint committed twice: {sorted(chk)}"
    table = load_catalog("eosflow", **_catalog(lake)).load_table("lake.totals")
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
    """--workers 3: three subtasks' files per commit, kills on every worker."""
    seed = chaos_seed()
    _run(
        tmp_path, kafka_endpoint[0], records=60_000, seed=seed, kills=3, faults=NAMED,
        workers=3, order="delta,iceberg",
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
