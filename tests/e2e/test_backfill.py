"""A rate-limited backfill fires its windows as it goes (issue 37): watermark alignment.

The backlog is the clicks of ``examples/clicks.py`` over 8 partitions (every partition's event
time spans the whole backlog), read by 2 workers at ``--max-rate`` into 10-second tumbling
windows. A reader left to itself reads the partitions unevenly (librdkafka hands out one
partition's fetched records before the next one's), so the minimum watermark stays at its
start until every partition was touched, and a backfill fires nothing for most of its run.
With ``--watermark-alignment`` a partition more than the drift ahead of the slowest one
(in any worker) waits, so windows are committed while most of the input is still unread.

The measure is read progress when the first window is committed: ``1 - lag / backlog`` from
the source tasks' lag (their positions against the bounded run's end offsets, restored with a
checkpoint after a restart), sampled while the job runs. The same check holds with the
alignment on, with a worker SIGKILLed, and fails with it off (the second test shows the check
can fail). Either way every window is committed exactly once, compared with the counts
computed from the generator.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from processor.runtime.supervision.runner import Runner
from processor.testing.chaos import input_read
from sinks import read_jsonl
from tests.e2e.harness import chaos_seed, expected, expected_window_counts, run_chaos

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

RECORDS = 32_000  # 320 s of event time over 8 partitions: 32 windows per page
RATE = 2_000.0  # records per second per worker: an 8-second backfill


class FirstWindow:
    """Samples, while the job runs, how much of the backlog was read when the first window was
    committed (``None``: no window was committed before the job ended)."""

    def __init__(self, output: Path, backlog: int) -> None:
        self.output, self.backlog = output, backlog
        self.read_share: float | None = None
        self.samples = 0
        self.done = threading.Event()

    def __call__(self, runner: Runner) -> None:
        while not self.done.is_set() and self.read_share is None:
            share = input_read(runner, self.backlog)
            if share is not None:
                self.samples += 1
                if read_jsonl(self.output) if self.output.exists() else []:
                    self.read_share = share
                    return
            time.sleep(0.1)


def _backfill(
    kafka_endpoint: tuple[str, str], tmp_path: Path, *, alignment: str | None, kills: int
) -> tuple[FirstWindow, Any, int]:
    seed = chaos_seed()
    first = FirstWindow(tmp_path / "output", RECORDS)
    run = run_chaos(
        "windowed_count_work.py",
        brokers=kafka_endpoint[0],
        tmp=tmp_path,
        records=RECORDS,
        seed=seed,
        mode="aligned",
        interval=0.5,
        random_kills=kills,
        env={"WORK_US": "0"},
        run_options={"max_rate": RATE, "watermark_alignment": alignment},
        during=first,
    )
    first.done.set()
    print(
        f"seed={seed} alignment={alignment} restarts={run.result.restarts} "
        f"first window committed at {first.read_share} of the backlog read "
        f"({first.samples} samples)"
    )
    # The sampler stops at the first committed window, which alignment can bring within a
    # second (10 samples in CI, at 0.07 of the backlog): a found window proves it saw progress;
    # without one, it must have watched most of the run.
    assert first.samples > 0, "the sampler never saw the job's progress"
    assert first.read_share is not None or first.samples > 10, (
        f"the sampler saw the job's progress only {first.samples} times and no window"
    )
    return first, run, seed


#: The share of the backlog read before which the first window counts as committed while reading.
EARLY = 0.5


def test_a_rate_limited_backfill_commits_windows_while_it_reads_each_exactly_once(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    first, run, seed = _backfill(kafka_endpoint, tmp_path, alignment="auto", kills=1)
    assert len(run.random_kills) == 1
    # 30 s of drift over 320 s of event time: the first window (10 s) can fire once the
    # slowest partition passed ~40 s, an eighth of the backlog; the checkpoint that commits it
    # follows within a second (a sixteenth of it). A SIGKILL's restart and a loaded machine
    # push it later (0.41 in CI, 2026-11-28; issue 50 is about that); without alignment it
    # comes after 0.75-0.88 (docs/engine.md), the test below.
    assert first.read_share is not None and first.read_share < EARLY, (
        f"the first window was committed only after {first.read_share} of the backlog was read"
    )
    assert run.output == expected(expected_window_counts, RECORDS, seed)


def test_without_alignment_the_same_backfill_fires_nothing_until_most_is_read(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    """The check above fails with ``--watermark-alignment off``: the reader drains one
    partition after another, and the minimum watermark waits for the last one."""
    first, run, seed = _backfill(kafka_endpoint, tmp_path, alignment=None, kills=0)
    assert first.read_share is None or first.read_share >= EARLY, (
        "without alignment a window was committed early: this backlog does not show the "
        "uneven reading the test above is about"
    )
    assert run.output == expected(expected_window_counts, RECORDS, seed)


def test_a_healthy_paced_backfill_registers_no_wait_on_the_broker(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    """Issue 50: a healthy backfill under watermark alignment showed ``waiting: worker 1 on the
    broker: backfill[3] has 19,057 records to read and none comes (a stalled broker...)``: a
    partition alignment had just resumed is fetched again from scratch, and its first empty
    polls counted as a stalled broker. Reproduced before the fix in 3 of 3 runs at 2,500/s
    and 20,000/s (once in two at 20,000/s); here at 2,500/s per worker."""
    import subprocess

    from tests.e2e.cli import eosflow, job_env
    from tests.e2e.harness import click_events, produce_json

    records = 100_000  # 36 ms of event time apart: an hour over 8 partitions
    env = job_env(kafka_endpoint[0], tmp_path, prefix="healthy")
    events = (
        {**e, "ts_ms": 1_700_000_000_000 + i * 36} for i, e in enumerate(click_events(records))
    )
    produce_json(kafka_endpoint[0], env["CLICKS_TOPIC"], events, key=lambda e: str(e["user"]))
    pipeline = Path(__file__).resolve().parents[2] / "bench" / "pipelines" / "backfill_window.py"
    run = subprocess.run(
        eosflow("run", str(pipeline), "--until-idle", "--max-rate", "2500", "--workers", "2"),
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stderr.splitlines()
    # alignment paused partitions (so they were resumed): else this proves nothing
    assert any("ahead paused" in ln for ln in lines), run.stderr[-3000:]
    # A wait before the job read its first record is the start's first fetches, no resumed
    # partition (alignment pauses only what it read ahead): on a loaded CI machine Tansu took
    # over 2 s to answer them once (`read=0 ... none comes ... for 2 s` at 2.7 s).
    waits = [ln for ln in lines if "on the broker" in ln and " read=0 " not in ln]
    assert not waits, f"{len(waits)} progress lines wait on a healthy broker: {waits[:2]}"
