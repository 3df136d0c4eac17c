"""End-to-end exactly-once under crashes: SIGKILL at named protocol points and at random moments.

Each test prints its seed; rerun one with ``EOSFLOW_CHAOS_SEED=<seed>``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.harness import (
    ENGINE_FAULTS,
    RUNNERS,
    Attempts,
    assert_exactly_once,
    assert_faults_fired,
    chaos_seed,
    expected,
    expected_running_totals,
    expected_window_counts,
    run_chaos,
)

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

NAMED = ENGINE_FAULTS


# Unaligned under kills stays in README command 2 through the crash loop below, the loops of
# tests/e2e/test_iterate.py and the processing-time flushes; this repeat runs in CI's crash tier.
@pytest.mark.parametrize("mode", ["aligned", pytest.param("unaligned", marks=pytest.mark.crash)])
def test_output_is_exactly_once_when_workers_are_killed_at_every_protocol_point_and_randomly(
    kafka_endpoint: tuple[str, str], tmp_path: Path, mode: str
) -> None:
    seed = chaos_seed()
    records = 200_000
    run = run_chaos(
        "running_total_work.py",
        brokers=kafka_endpoint[0],
        tmp=tmp_path,
        records=records,
        seed=seed,
        mode=mode,
        interval=0.5,
        faults=NAMED,
        random_kills=5,
    )
    print(f"seed={seed} random kills (s after start, worker): {run.random_kills}")
    print(f"restarts={run.result.restarts} causes={run.result.restart_causes}")
    assert_faults_fired(run, NAMED, 5, seed=seed)
    want = expected(expected_running_totals, records, seed)
    assert_exactly_once(want, run.output, seed=seed)
    # The committed-output figure counts each epoch once, whatever the kills re-wrote.
    assert run.result.records_committed == sum(want.values()), (seed, run.result)


@pytest.mark.parametrize("runner", RUNNERS)
def test_windowed_count_is_exactly_once_when_workers_are_killed_randomly(
    kafka_endpoint: tuple[str, str], tmp_path: Path, runner: str
) -> None:
    """Windows, watermarks and the pre-shuffle combiner survive restarts."""
    seed = chaos_seed()
    records = 100_000
    run = run_chaos(
        "windowed_count_work.py",
        brokers=kafka_endpoint[0],
        tmp=tmp_path,
        records=records,
        seed=seed,
        mode="aligned",
        random_kills=3,
        runner=runner,
    )
    print(f"seed={seed} random kills: {run.random_kills}")
    assert len(run.random_kills) == 3
    assert_exactly_once(expected(expected_window_counts, records, seed), run.output, seed=seed)


# slow (run by release checks, not by README command 2): its precondition (a snapshot taken
# while a channel recovers) depends on the machine's load. Under CI's load on a machine twice
# as slow as the earlier ones it missed 8 seeds of 8 (two runs; each exactly once), on the
# code before the group-request change as well (a local A/B under two busy loops: 1 seed of
# 3 met it in each tree). tests/unit/test_task.py pins the restore it is for
# (..._unaligned_snapshot_of_a_recovering_channel_restores_its_remaining_phases...).
@pytest.mark.slow
def test_unaligned_crash_loop_with_a_channel_backlog_is_exactly_once(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    """Regression (issue 19, unaligned crash loops): a worker killed right after each restart's
    first checkpoint, while the channels still hold a dead generation's backlog. Unaligned
    snapshots are then taken while channels are still recovering; restoring one must go
    through the channel's remaining phases, not replay the dead generation's records as
    in-flight state (which counted clicks twice)."""
    records, kills = 60_000, 4
    # Whether a restart's first checkpoint still finds the dead generation's backlog depends on
    # timing (CI once took none on Apache Kafka 4.3.1): a run without one is checked as well
    # and another seed tries again, so the case this test is for is always exercised. Five
    # seeds: on a CI machine twice as slow as the earlier ones, three seeds in a row found none
    # (each run exactly once all the same).
    attempts = Attempts(tmp_path, tries=5)
    for seed, tmp in attempts:
        run = run_chaos(
            "backlog_total.py",
            brokers=kafka_endpoint[0],
            tmp=tmp,
            records=records,
            seed=seed,
            mode="unaligned",
            interval=0.2,
            random_kills=kills,
            env={"WORK_US": "60"},
            kill_plan=[(0.0, 1)] * kills,  # at the first checkpoint of every generation
        )
        logs = run.logs.values()
        recovering = sum(text.count("snapshot with recovering channels") for text in logs)
        print(f"seed={seed} kills={run.random_kills} recovering snapshots={recovering}")
        assert len(run.random_kills) == kills, f"seed={seed}: {run.random_kills}"
        assert_exactly_once(expected(expected_running_totals, records, seed), run.output, seed=seed)
        if recovering:
            return
    pytest.fail(f"seeds {attempts.seeds}: no snapshot was taken while a channel recovered")
