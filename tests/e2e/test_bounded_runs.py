"""Bounded runs (``--until-idle``) on a live input, and jobs continued after one.

The job deduplicates clicks by ``event_id`` and counts them per page and 10 s event-time window
(``pipelines/dedup_window_count.py``): both depend on the watermark, which a drained bounded
run moves to the end of time. Each test runs ``eosflow run`` as a user does and compares the
committed windows with the counts of the distinct clicks it should have read, computed from the
generator without the engine.

- A bounded run reads up to the end offsets it had at start. Clicks appended while it runs are
  not read (before the fix they were: some counted in this run's windows, the rest read after
  the drain and dropped as late). Continuing that drained job is then refused, with the way on.
- A job SIGKILLed whole after its drained final checkpoint completed and before a worker
  committed it: the refused start commits that output first (no later start restores the
  checkpoint to commit it).
- ``--until-idle --no-drain`` runs one after the other (a nightly batch), each with a worker
  SIGKILLed, continue one job exactly: windows open at the end of a run stay open, and copies
  of a click that come in a later run are still recognised.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from processor.runtime.job import job_dir
from tests.e2e.cli import committed_output, eosflow, held_then_killed, job_env
from tests.e2e.harness import (
    PIPELINES,
    assert_exactly_once,
    chaos_seed,
    click_events,
    expected_window_counts,
    produce_json,
    with_duplicates,
)

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

PIPELINE = str(PIPELINES / "dedup_window_count.py")


def _run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    argv = eosflow("run", PIPELINE, "--checkpoint-interval", "0.3", *args)
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)


def _produce(env: dict[str, str], events: list[dict[str, Any]]) -> None:
    produce_json(
        env["EOSFLOW_KAFKA_BROKERS"],
        env["CLICKS_TOPIC"],
        events,
        key=lambda e: str(e["user"]),
        partitions=4,
    )


def _append_while_running(env: dict[str, str], events: list[dict[str, Any]]) -> threading.Thread:
    """Writes ``events`` once the next bounded run recorded its end offsets (so they are all
    past them), while the run is still reading."""
    ends = job_dir(env["JOB_NAME"], env["EOSFLOW_STATE_DIR"]) / "end_offsets.json"
    ends.unlink(missing_ok=True)

    def append() -> None:
        deadline = time.monotonic() + 120
        while not ends.exists():
            assert time.monotonic() < deadline, "the run never recorded its end offsets"
            time.sleep(0.01)
        _produce(env, events)

    thread = threading.Thread(target=append, daemon=True)
    thread.start()
    return thread


def _env(kafka: str, redis_url: str, tmp: Path) -> dict[str, str]:
    return job_env(
        kafka,
        tmp,
        prefix="bounded",
        EOSFLOW_REDIS_URL=redis_url,
        WORK_US="200",  # a run takes seconds: the appender writes while it reads
        DEDUP_FP_RATE="0.4",  # many Bloom hits: Redis decides, across runs too
        DEDUP_EXPECTED_IDS="2000",
        DEDUP_BUCKET_S="60",
    )


def _distinct(events: Iterator[dict[str, Any]]) -> list[dict[str, Any]]:
    seen: dict[str, dict[str, Any]] = {}
    for e in events:
        seen.setdefault(str(e["event_id"]), e)
    return list(seen.values())


def test_a_bounded_run_leaves_what_is_appended_while_it_runs_and_a_drained_job_refuses_more(
    kafka_endpoint: tuple[str, str], redis_url: str, tmp_path: Path
) -> None:
    seed = chaos_seed()
    env = _env(kafka_endpoint[0], redis_url, tmp_path)
    first = list(with_duplicates(click_events(6_000, seed=seed), 0.1, seed=seed))
    # later clicks of the same time range (another seed: other IDs), written during the run
    later = [e | {"event_id": f"later-{i}"} for i, e in enumerate(click_events(3_000, seed=seed))]
    _produce(env, first)

    appender = _append_while_running(env, later)
    run = _run(env, "--until-idle")
    appender.join(60)
    assert run.returncode == 0, run.stderr[-3000:]
    want = expected_window_counts(iter(_distinct(iter(first))))
    assert_exactly_once(want, committed_output(env), seed=seed)
    listed = subprocess.run(eosflow("jobs", "--json"), env=env, capture_output=True, text=True)
    mine = [j for j in json.loads(listed.stdout) if j["job"] == env["JOB_NAME"]]
    assert mine and mine[0]["drained"] is True and mine[0]["state"] == "finished", mine

    # The run drained its watermark: every later click would be late, and the dedup step
    # forgot its IDs. Continuing is refused, bounded or not, and nothing is written.
    for args, why in ((("--until-idle",), "New input arrived since"),
                      ((), "A run without --until-idle takes new input")):  # fmt: skip
        again = _run(env, *args)
        assert again.returncode == 2, (args, again.returncode, again.stderr[-3000:])
        assert "drained the watermark" in again.stderr and why in again.stderr, again.stderr
        assert "--no-drain" in again.stderr and "eosflow reset" in again.stderr
    assert_exactly_once(want, committed_output(env), seed=seed)


def test_the_output_of_a_drained_checkpoint_killed_before_its_commit_survives_the_refusal(
    kafka_endpoint: tuple[str, str], redis_url: str, tmp_path: Path
) -> None:
    seed = chaos_seed()
    env = _env(kafka_endpoint[0], redis_url, tmp_path)
    clicks = list(with_duplicates(click_events(4_000, seed=seed), 0.1, seed=seed))
    _produce(env, clicks)
    # No periodic checkpoint: the final one carries all the output. Worker 1 is held after it
    # completed and before its commit, and then the runner and every worker are SIGKILLed.
    holds = tmp_path / "holds"
    argv = eosflow("run", PIPELINE, "--until-idle", "--mode", "none",
                   "--checkpoint-timeout", "2m",
                   "--fault", "0:1:after-completion-before-commit:1:hold")  # fmt: skip
    held_then_killed(argv, env, holds, "after-completion-before-commit", 1)

    _produce(env, [e | {"event_id": f"next-{i}"} for i, e in enumerate(clicks[:500])])
    refused = _run(env, "--until-idle")
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "New input arrived since" in refused.stderr, refused.stderr[-3000:]
    want = expected_window_counts(iter(_distinct(iter(clicks))))
    assert_exactly_once(want, committed_output(env), seed=seed)


def test_no_drain_bounded_runs_continue_one_job_exactly_with_copies_across_runs_and_kills(
    kafka_endpoint: tuple[str, str], redis_url: str, tmp_path: Path
) -> None:
    """Three nights: two ``--until-idle --no-drain`` runs and a last one that drains, each
    with a worker SIGKILLed at a protocol point; the third night's input is written while the
    second run reads. Copies of a click may come up to 2,000 clicks later, so in the next
    night's input."""
    seed = chaos_seed()
    env = _env(kafka_endpoint[0], redis_url, tmp_path)
    stream = list(with_duplicates(click_events(12_000, seed=seed), 0.1, seed=seed))
    nights = [stream[:5_000], stream[5_000:9_000], stream[9_000:]]
    _produce(env, nights[0])
    first = _run(env, "--until-idle", "--no-drain", "--fault", "0:1:after-snapshot-before-ack:2")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "restart" in first.stdout + first.stderr

    _produce(env, nights[1])
    appender = _append_while_running(env, nights[2])
    second = _run(env, "--until-idle", "--no-drain", "--fault", "0:0:mid-alignment:2")
    appender.join(60)
    assert second.returncode == 0, second.stderr[-3000:]
    read = nights[0] + nights[1]  # the second run stopped where the input ended at its start
    got = committed_output(env)
    # Only windows the watermark closed are out, each with its final count.
    closed = expected_window_counts(iter(_distinct(iter(read))))
    assert not got - closed, f"windows not in the input read so far: {list(got - closed)[:5]}"
    # ... and every window the watermark closed is out: those ending 40 s of event time before
    # the newest click read (30 s allowed lateness, 1 s out of order, partitions' skew).
    newest = max(int(e["ts_ms"]) for e in read)
    due = Counter(
        {w: n for w, n in closed.items() if orjson.loads(w)[1]["end_ms"] <= newest - 40_000}
    )
    assert due and not due - got, f"closed windows missing: {list(due - got)[:5]}"

    third = _run(env, "--until-idle", "--fault", "0:1:after-completion-before-commit:1")
    assert third.returncode == 0, third.stderr[-3000:]
    want = expected_window_counts(iter(_distinct(iter(stream))))
    assert_exactly_once(want, committed_output(env), seed=seed)

    # A drained job run again with no new input is a no-op, not a refusal.
    fourth = _run(env, "--until-idle")
    assert fourth.returncode == 0, fourth.stderr[-3000:]
    assert_exactly_once(want, committed_output(env), seed=seed)
