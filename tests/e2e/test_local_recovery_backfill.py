"""Local recovery whatever the event time does (issue 49): the replay check forgets a record's
ID only when a completed checkpoint makes its copy impossible, never by event time.

Before, the check forgot IDs ten minutes of event time behind the watermark and passed older
copies unchecked ("record older than the horizon passed unchecked"). A backfill reads hours of
event time per second, so a restarted worker's copies were that old: a running aggregate took
them twice. Here the clicks are one second of event time apart, so the job reads hours of event
time per second, and the committed output is compared with the answer computed from the click
generator alone.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from processor.runtime.supervision.runner import Fault
from tests.e2e.harness import (
    Attempts,
    assert_exactly_once,
    assert_faults_fired,
    chaos_seed,
    click_events,
    expected_running_totals,
    expected_two_level_counts,
    read_two_level_output,
    run_chaos,
)

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

SPACING_MS = 1000  # one click per second of event time
#: What the replay check logged when it passed a copy it could not check any more (before
#: issue 49), and any line saying a record went through unchecked.
UNCHECKED = re.compile(r"passed unchecked|older than the horizon")


def spaced_clicks(records: int, seed: int) -> Iterator[dict[str, Any]]:
    """The generator's clicks, one second of event time apart (a backfill of history)."""
    for i, event in enumerate(click_events(records, seed=seed)):
        yield {**event, "ts_ms": 1_700_000_000_000 + i * SPACING_MS}


def _produce(records: int, seed: int) -> Any:
    from tests.e2e.harness import produce_json

    def produce(brokers: str, topic: str) -> object:
        return produce_json(
            brokers, topic, spaced_clicks(records, seed), key=lambda e: str(e["user"]),
            total=records,
        )  # fmt: skip

    return produce


def _copies_dropped(tmp_path: Path, job: str) -> int:
    """The copies the replay checks dropped over the run: every worker process's (a task's own
    ``replayed`` starts again at 0 when its worker is killed, which the random kills do)."""
    status = json.loads((tmp_path / "state" / "jobs" / job / "status.json").read_text())
    return int(status["replay_copies_dropped"])


def _assert_none_unchecked(logs: dict[str, str], seed: int) -> None:
    lines = [ln for text in logs.values() for ln in text.splitlines() if UNCHECKED.search(ln)]
    assert not lines, f"seed={seed}: {len(lines)} lines of records passed unchecked: {lines[:3]}"


def test_the_reproduction_two_shuffles_clicks_a_second_apart_killed_mid_alignment(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    """The issue's reproduction: the two-shuffle pipeline, clicks 1 s of event time apart,
    0.5 s checkpoints, worker 1 SIGKILLed mid-alignment of checkpoint 4. Before, the survivor
    logged ``record older than the horizon passed unchecked`` 20-21 times."""
    seed = chaos_seed()
    records = 60_000
    faults = [Fault(0, 1, "mid-alignment", 4)]
    run = run_chaos(
        "two_level_count.py",
        brokers=kafka_endpoint[0],
        tmp=tmp_path,
        records=records,
        seed=seed,
        mode="aligned",
        interval=0.5,
        faults=faults,
        recovery="local",
        produce=_produce(records, seed),
        read_output=lambda job_env: read_two_level_output(job_env["OUTPUT_DIR"]),
    )
    assert_faults_fired(run, faults, 0, seed=seed)
    want = expected_two_level_counts(spaced_clicks(records, seed))
    assert_exactly_once(want, run.output, seed=seed)
    _assert_none_unchecked(run.logs, seed)
    dropped = _copies_dropped(tmp_path, run.result.job)
    print(f"seed={seed}: copies dropped={dropped} restarts={run.result.restarts}")
    assert dropped > 0, f"seed={seed}: no copy reached a replay check: the test proved nothing"


@pytest.mark.parametrize("mode", ["aligned", pytest.param("unaligned", marks=pytest.mark.crash)])
def test_a_backfills_running_aggregate_after_a_shuffle_is_exactly_once_under_local_recovery(
    kafka_endpoint: tuple[str, str], tmp_path: Path, mode: str
) -> None:
    """A running aggregate after a shuffle, no windows (nothing drops a late copy), reading
    hours of event time per second, under five random SIGKILLs of either worker and two at
    named points (mid-alignment, after-completion-before-commit)."""
    # Whether a killed worker's copies reach a survivor's replay check is timing (CI's crash
    # tier once had none, unaligned): such a run is checked all the same, then another seed.
    attempts = Attempts(tmp_path)
    for seed, tmp in attempts:
        # 80,000 drained once (CI, loaded) 5 s after the first fault's restart, before the
        # restarted worker reached its second commit with data: the second named fault only
        # fires on a commit that has an epoch to commit, so the input must outlast it.
        records = 120_000
        random_kills = 5
        faults = [
            Fault(0, 1, "mid-alignment", 3),
            Fault(1, 1, "after-completion-before-commit", 2),
        ]
        run = run_chaos(
            "backlog_total.py",
            brokers=kafka_endpoint[0],
            tmp=tmp,
            records=records,
            seed=seed,
            mode=mode,
            interval=0.5,
            faults=faults,
            random_kills=random_kills,
            recovery="local",
            victims=[0, 1],
            env={"WORK_US": "50"},
            produce=_produce(records, seed),
            # Paced, so that the kills land while the input is read (unpaced, the source stage read
            # it all in a second, before any kill): still hours of event time per second. Watermark
            # alignment off (--max-rate turns it on): it holds each source task within 30 s of event
            # time of the others, one exchange of watermarks per 30 s (under the suite's load and
            # a killed worker's restart, 0.16 hours per second: no backfill's pace).
            run_options={"max_rate": 8_000, "watermark_alignment": None},
        )
        print(f"seed={seed} random kills (s after start, worker): {run.random_kills}")
        print(f"restarts={run.result.restarts} causes={run.result.restart_causes}")
        assert_faults_fired(run, faults, random_kills, seed=seed)
        hours_per_s = records * SPACING_MS / 3_600_000 / run.result.seconds
        print(f"event time read: {hours_per_s:.1f} hours per second of the run")
        # The precondition, not a speed goal: copies re-emitted after a kill must be far older
        # than the 10 minutes of event time the replay check used to keep (issue 49), so the
        # run must read well over 10 minutes of event time per second of a recovery. It was
        # asserted at 1 hour per second, which a CI run on a machine twice as slow as the
        # earlier ones missed (0.89): a speed, not this test's subject.
        assert hours_per_s >= 0.25, f"not a backfill's pace: {hours_per_s:.2f} hours per second"
        assert_exactly_once(
            expected_running_totals(spaced_clicks(records, seed)), run.output, seed=seed
        )
        _assert_none_unchecked(run.logs, seed)
        assert not any("ReplayBoundExceeded" in c for c in run.result.restart_causes)
        dropped = _copies_dropped(tmp, run.result.job)
        print(f"copies dropped by the replay checks: {dropped}")
        if dropped > 0:
            return
    pytest.fail(f"seeds {attempts.seeds}: no copy reached a replay check: the test proved nothing")


def test_a_replay_check_past_its_bound_recovers_the_job_globally_and_stays_exactly_once(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    """Worker 0 is held before it acknowledges checkpoint 2, so no checkpoint completes while
    worker 1 keeps reading (unaligned: its barriers do not hold its inputs back): its replay
    check's IDs grow past ``--recovery-max-ids``. The task
    fails naming the bound, the runner recovers every worker from the latest completed
    checkpoint (a new generation: the held worker goes too), and the output stays exact."""
    seed = chaos_seed()
    records = 30_000
    run = run_chaos(
        "backlog_total.py",
        brokers=kafka_endpoint[0],
        tmp=tmp_path,
        records=records,
        seed=seed,
        mode="unaligned",
        interval=0.3,
        faults=[Fault(0, 0, "after-snapshot-before-ack", 2, "hold")],
        recovery="local",
        env={"WORK_US": "0"},
        produce=_produce(records, seed),
        # Watermark alignment off: it would pause worker 1's source behind the held one.
        run_options={"max_rate": 1_000, "recovery_max_ids": 3_000, "watermark_alignment": None},
    )
    causes = run.result.restart_causes
    print(f"restarts={run.result.restarts} generation={run.result.generation} causes={causes}")
    assert causes and "ReplayBoundExceeded" in causes[0], causes
    assert "--recovery-max-ids 3,000" in causes[0] and "recovers globally" in causes[0]
    assert run.result.generation >= 2, "the bound's failure was answered by a local recovery"
    want = expected_running_totals(spaced_clicks(records, seed))
    assert_exactly_once(want, run.output, seed=seed)
