"""Session windows (issue 23, item 3) end to end: clicks per user session, exactly once under
SIGKILLs at the engine's protocol points and at random.

The expectation is computed from ``examples/clicks.py`` without the engine: each user's clicks
in time order, a new session wherever two clicks are ``GAP`` or more apart, the session being
``[first, last + GAP)`` with its click count. Every user's clicks are in one partition in time
order and the sources hold the watermark ``max_out_of_orderness`` behind, so no click is late
and the answer does not depend on how the workers interleave. Each test prints its seed; rerun
one with ``EOSFLOW_CHAOS_SEED=<seed>``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.e2e.harness import (
    ENGINE_FAULTS,
    assert_exactly_once,
    assert_faults_fired,
    canonical,
    chaos_seed,
    expected,
    run_chaos,
)

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

GAP_MS = 5_000


def expected_sessions(events: Iterator[dict[str, Any]]) -> Counter[bytes]:
    times: dict[str, list[int]] = {}
    for e in events:
        times.setdefault(str(e["user"]), []).append(int(e["ts_ms"]))
    out: Counter[bytes] = Counter()
    for user, ts in times.items():
        ts.sort()
        first = last = ts[0]
        n = 0
        for t in ts:
            if t - last >= GAP_MS:
                out[
                    canonical([user, {"start_ms": first, "end_ms": last + GAP_MS, "value": n}])
                ] += 1
                first, n = t, 0
            last, n = t, n + 1
        out[canonical([user, {"start_ms": first, "end_ms": last + GAP_MS, "value": n}])] += 1
    return out


def test_sessions_per_user_are_exactly_once_when_workers_are_killed(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    seed = chaos_seed()
    records, random_kills = 40_000, 2
    run = run_chaos(
        "session_count.py",
        brokers=kafka_endpoint[0],
        tmp=tmp_path,
        records=records,
        seed=seed,
        mode="aligned",
        interval=0.5,
        faults=ENGINE_FAULTS,
        random_kills=random_kills,
        # 1,000 users: 40 clicks each, 10 s apart on average, so that sessions both merge
        # (about 4 gaps in 10 are under GAP_MS) and split
        env={"WORK_US": "100"},
    )
    print(f"seed={seed} restarts={run.result.restarts} random kills={run.random_kills}")
    assert_faults_fired(run, ENGINE_FAULTS, random_kills, seed=seed)
    want = expected(expected_sessions, records, seed)
    sizes = Counter(orjson.loads(line)[1]["value"] for line in want)
    assert sum(sizes.values()) > 10_000 and sum(n for s, n in sizes.items() if s > 1) > 3_000, sizes
    assert_exactly_once(want, run.output, seed=seed)
