"""The file sink under crashes: the running total sunk into Avro container files while workers are
SIGKILLed at every protocol point of the sink and at random moments.

The committed part files are read back (``read_avro``) and compared, as a multiset, with the
running totals computed from the click generator alone. The run must also leave no in-progress
file behind: orphans of killed epochs are deleted by the next generation's ``recover``.

Each test prints its seed; rerun one with ``EOSFLOW_CHAOS_SEED=<seed>``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from processor.runtime.supervision.local import Fault
from sinks.files import read_avro
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

#: One kill per start (attempt), alternating workers, at each point a file sink goes through.
NAMED = [
    Fault(0, 1, "before-prepare", 3),
    Fault(1, 0, "after-snapshot-before-ack", 2),
    Fault(2, 1, "after-completion-before-commit", 2),
    Fault(3, 0, "during-recovery", 1),
    Fault(4, 1, "mid-sink-recover", 1),
    Fault(5, 0, "mid-sink-commit", 3),  # the sink calls it after the first part's rename
]


def read_output(job_env: dict[str, str]) -> Iterable[Any]:
    """The committed Avro records as the running-total example's output items."""
    return [[r["user"], [r["count"], r["amount"]]] for r in read_avro(job_env["OUTPUT_DIR"])]


def _run(
    tmp: Path, brokers: str, *, records: int, seed: int, kills: int, env: dict[str, str]
) -> ChaosRun:
    run = run_chaos(
        "running_total_avro.py",
        brokers=brokers,
        tmp=tmp,
        records=records,
        seed=seed,
        mode="aligned",
        interval=0.3,
        faults=NAMED,
        random_kills=kills,
        env=env,
        read_output=read_output,
    )
    print(f"seed={seed} random kills (s after start, worker): {run.random_kills}")
    print(f"restarts={run.result.restarts} checkpoints={run.result.checkpoints}")
    print(f"faults fired: {run.faults_fired}")
    assert_faults_fired(run, NAMED, kills, seed=seed)
    output_dir = Path(tmp / "output")
    left = sorted(p.name for p in output_dir.glob(".part-*.inprogress"))
    assert left == [], f"seed={seed}: in-progress files left behind: {left}"
    assert_exactly_once(expected(expected_running_totals, records, seed), run.output, seed=seed)
    return run


def test_avro_output_is_exactly_once_when_workers_are_killed_at_every_sink_point_and_randomly(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    seed = chaos_seed()
    run = _run(
        tmp_path, kafka_endpoint[0], records=60_000, seed=seed, kills=2, env={"WORK_US": "300"}
    )
    parts = sorted((tmp_path / "output").glob("part-*.avro"))
    assert parts, "no part file was committed"
    assert run.result.checkpoints >= 5


@pytest.mark.slow
def test_rotated_avro_parts_are_exactly_once_when_workers_are_killed_many_times(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    """Bigger run: part files rotated at 64 KiB (committables naming several files), null
    codec, eight random kills on top of the named ones."""
    seed = chaos_seed()
    _run(
        tmp_path,
        kafka_endpoint[0],
        records=300_000,
        seed=seed,
        kills=8,
        env={"WORK_US": "60", "MAX_PART_BYTES": str(64 * 1024), "AVRO_CODEC": "null"},
    )
    rotated = list((tmp_path / "output").glob("part-*-*-0001.avro"))
    assert rotated, "no epoch filled more than one part file"
