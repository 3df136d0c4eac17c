"""Input with 10 % duplicated clicks (same ``event_id``, later offsets), deduplicated by the
``dedup`` step while workers are SIGKILLed: the windowed counts are those of the distinct clicks,
each exactly once.

Without the dedup step every copy would be counted (the tests check that copies were really
produced and really dropped); with an ID store that disagreed with the restored checkpoint,
clicks would be lost after a restart.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from tests.e2e.harness import (
    ENGINE_FAULTS,
    assert_exactly_once,
    assert_faults_fired,
    chaos_seed,
    click_events,
    expected,
    expected_window_counts,
    run_chaos,
    with_duplicates,
)

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

NAMED = ENGINE_FAULTS


def _dedup_keys(url: str, job: str) -> int:
    client = redis.Redis.from_url(url)
    try:
        # the GC marks (``...:gc``) and write markers (``...:written``) stay: they say what
        # was deleted and what was written (a restore checks them)
        keys = client.scan_iter(f"eosflow:{job}:dedup:*")
        return sum(1 for k in keys if not k.endswith((b":gc", b":written")))
    finally:
        client.close()


@pytest.mark.parametrize(
    ("scope", "fp_rate"),
    # 0.4 with filters of 2,000 IDs (a 60 s bucket holds 3,000 per subtask): many fresh IDs hit
    # the filters, so the Redis store and its run/epoch tags decide them (at 0.001 the
    # restored filters alone would hide the store's mistakes).
    # The per-key variant is slow-marked (26 s in CI, which must stay under 30 minutes):
    # tests/e2e/test_rescale.py runs a per-key dedup at fp rate 0.4 under kills in CI.
    [("global", "0.4"), pytest.param("user", "0.001", marks=pytest.mark.slow)],
)
def test_each_distinct_click_is_counted_once_when_10_percent_are_duplicated_and_workers_die(
    kafka_endpoint: tuple[str, str], redis_url: str, tmp_path: Path, scope: str, fp_rate: str
) -> None:
    seed = chaos_seed()
    records = 150_000
    random_kills = 3
    run = run_chaos(
        "dedup_window_count.py",
        brokers=kafka_endpoint[0],
        tmp=tmp_path,
        records=records,
        seed=seed,
        mode="aligned",
        interval=0.5,
        faults=NAMED,
        random_kills=random_kills,
        duplicates=0.10,
        env={
            "EOSFLOW_REDIS_URL": redis_url,
            "DEDUP_SCOPE": scope,
            "DEDUP_FP_RATE": fp_rate,
            "DEDUP_EXPECTED_IDS": "2000" if fp_rate == "0.4" else "100000",
            "DEDUP_BUCKET_S": "60" if fp_rate == "0.4" else "15",
        },
    )
    print(f"seed={seed} scope={scope} random kills (s after start, worker): {run.random_kills}")
    print(f"restarts={run.result.restarts} causes={run.result.restart_causes}")
    assert_faults_fired(run, NAMED, random_kills, seed=seed)
    want = expected(expected_window_counts, records, seed)
    copies = list(with_duplicates(click_events(records, seed=seed), 0.10, seed=seed))
    assert len(copies) > records * 1.08, "the input should hold ~10% copies"
    assert expected_window_counts(iter(copies)) != want, "copies would change the answer"
    assert_exactly_once(want, run.output, seed=seed)
    # The drained input moved the watermark to the end of time: the last completed checkpoint
    # garbage-collected every bucket, in Redis too.
    assert _dedup_keys(redis_url, run.result.job) == 0, "ID buckets left in Redis after the drain"
