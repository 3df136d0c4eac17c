"""Local recovery (``--recovery local``): worker 1 is SIGKILLed again and again, at every named
protocol point and at random moments, while worker 0 keeps running; only worker 1 restarts.

The pipeline has two shuffles (``pipelines/two_level_count.py``): records derived from source
offsets cross the first, window results cross the second. A restarted worker re-emits what it
had emitted since the checkpoint it restored; worker 0's tasks must drop exactly those copies by
ID and keep everything else. The committed output of both levels is compared with the answer
computed from the click generator alone.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from processor.runtime.supervision.runner import Fault
from tests.e2e.harness import (
    assert_exactly_once,
    assert_faults_fired,
    chaos_seed,
    click_events,
    expected_two_level_counts,
    read_two_level_output,
    run_chaos,
)

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

#: Every named protocol point, always on worker 1 (the one restarted alone).
WORKER_1_FAULTS = [
    Fault(0, 1, "mid-alignment", 3),
    Fault(1, 1, "after-snapshot-before-ack", 2),
    Fault(2, 1, "after-completion-before-commit", 2),
    Fault(3, 1, "during-recovery", 1),
]
WORKER_START = re.compile(r"worker=(\d) generation=(\d+) pid=(\d+) .* recovery=(\w+)")


@pytest.mark.parametrize("mode", ["aligned", pytest.param("unaligned", marks=pytest.mark.crash)])
def test_only_the_killed_worker_restarts_and_the_output_is_exactly_once(
    kafka_endpoint: tuple[str, str], tmp_path: Path, mode: str
) -> None:
    seed = chaos_seed()
    records = 120_000
    random_kills = 3
    run = run_chaos(
        "two_level_count.py",
        brokers=kafka_endpoint[0],
        tmp=tmp_path,
        records=records,
        seed=seed,
        mode=mode,
        interval=0.5,
        faults=WORKER_1_FAULTS,
        random_kills=random_kills,
        recovery="local",
        victims=[1],
        # no Redis: the replay checks keep their IDs in the tasks (issue 49)
        read_output=lambda job_env: read_two_level_output(job_env["OUTPUT_DIR"]),
    )
    print(f"seed={seed} random kills (s after start, worker): {run.random_kills}")
    print(f"restarts={run.result.restarts} causes={run.result.restart_causes}")
    assert_faults_fired(run, WORKER_1_FAULTS, random_kills, seed=seed)
    assert all(c.startswith("worker 1 ") for c in run.result.restart_causes), (
        run.result.restart_causes
    )

    want = expected_two_level_counts(click_events(records, seed=seed))
    assert_exactly_once(want, run.output, seed=seed)

    # Worker 0 started once and ran through every restart of worker 1, in one generation.
    starts = {
        name: [m.groups() for m in WORKER_START.finditer(text)] for name, text in run.logs.items()
    }
    assert len(starts["worker-0.log"]) == 1, f"seed={seed}: worker 0 restarted: {starts}"
    # worker 1: its first start and every restart (one died in recovery, before this line)
    assert len(starts["worker-1.log"]) == run.result.restarts, starts
    assert {g for _w, g, _p, _r in starts["worker-1.log"]} == {starts["worker-0.log"][0][1]}
    # ...and its tasks dropped the copies worker 1 re-emitted (else the test proves nothing).
    status = json.loads((tmp_path / "state" / "jobs" / run.result.job / "status.json").read_text())
    replayed = {t: s["replayed"] for t, s in status["tasks"].items() if t.endswith(".0")}
    print(f"copies dropped by worker 0's tasks: {replayed}")
    assert sum(replayed.values()) > 0, f"seed={seed}: no re-emitted copy reached worker 0"
