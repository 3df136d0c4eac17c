"""Late records to dead letters (issue 23, item 6), exactly once under SIGKILLs.

The input is the clicks of ``examples/clicks.py`` followed, at the end of every partition, by
stragglers: copies (new ``event_id``) of early clicks, whose windows closed long before they
are read. Which straggler is late depends on how the workers' watermarks interleaved, so the
test does not predict it; it checks what must hold whatever happened: for every page and
window, the committed window count plus the late records of that page and window in the dead
letters equals the input's count, computed without the engine. A click counted twice (in a
window and as a dead letter, or in two dead letters) or not at all breaks that. Each test
prints its seed; rerun one with ``EOSFLOW_CHAOS_SEED=<seed>``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sinks import read_jsonl
from tests.e2e.harness import (
    ENGINE_FAULTS,
    assert_faults_fired,
    chaos_seed,
    click_events,
    produce_json,
    run_chaos,
)

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

WINDOW_MS = 10_000
RECORDS = 40_000
STRAGGLERS = 400  # copies of every 10th of the first 4,000 clicks (their first 40 s)


def _input(seed: int) -> Iterator[dict[str, Any]]:
    yield from click_events(RECORDS, seed=seed)
    for i, c in enumerate(click_events(STRAGGLERS * 10, seed=seed)):
        if i % 10 == 0:
            yield c | {"event_id": f"late-{i}"}


def _per_window(pages_ts: Iterator[tuple[str, int]]) -> Counter[tuple[str, int]]:
    return Counter((page, ts - ts % WINDOW_MS) for page, ts in pages_ts)


def test_every_click_is_in_one_window_count_or_one_dead_letter_when_workers_are_killed(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    seed = chaos_seed()
    random_kills = 2
    dead_dir = tmp_path / "dead-letters"
    run = run_chaos(
        "late_window_count.py",
        brokers=kafka_endpoint[0],
        tmp=tmp_path,
        records=RECORDS,
        seed=seed,
        mode="aligned",
        interval=0.5,
        faults=ENGINE_FAULTS,
        random_kills=random_kills,
        env={"DEAD_LETTER_DIR": str(dead_dir)},
        # Two partitions, one per source task: a task reading several partitions may read one
        # to its end (stragglers included) before it starts another, while its watermark, the
        # minimum over its partitions, is still unset; the stragglers would not be late.
        produce=lambda brokers, topic: produce_json(
            brokers, topic, _input(seed), key=lambda e: str(e["user"]), partitions=2
        ),
    )
    print(f"seed={seed} restarts={run.result.restarts} random kills={run.random_kills}")
    assert_faults_fired(run, ENGINE_FAULTS, random_kills, seed=seed)
    want = _per_window((str(c["page"]), int(c["ts_ms"])) for c in _input(seed))

    windows = [item for item in read_jsonl(tmp_path / "output")]
    emitted = Counter((page, w["start_ms"]) for page, w in windows)
    assert max(emitted.values()) == 1, "a window was emitted twice"
    counted = Counter({(page, w["start_ms"]): w["value"] for page, w in windows})

    dead = read_jsonl(dead_dir)
    assert {d["error_type"] for d in dead} <= {"LateRecord"}, dead[:3]
    ids = Counter(d["value"]["event_id"] for d in dead)
    assert not [i for i, n in ids.items() if n > 1], "a late record was dead-lettered twice"
    late = _per_window((d["key"], d["ts_ms"]) for d in dead)
    got = counted + late
    missing = {k: want[k] - got[k] for k in want if got[k] < want[k]}
    extra = {k: got[k] - want[k] for k in got if got[k] > want[k]}
    assert not missing and not extra, f"seed={seed}: missing {missing}, extra {extra}"
    # The stragglers are minutes of event time behind both source tasks' watermarks: nearly
    # all are late (one may meet a window task whose watermark lags after a restart).
    assert len(dead) >= STRAGGLERS * 0.9, f"seed={seed}: only {len(dead)} late records"
