"""Session windows (issue 23, item 3) and state TTL (item 5) end to end: clicks per user
session, and a running count per user whose state expires, exactly once under SIGKILLs at the
engine's protocol points and at random.

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

from processor.runtime.job import Fault
from tests.e2e.harness import (
    BURST_FAULTS,
    ENGINE_FAULTS,
    ChaosRun,
    assert_exactly_once,
    canonical,
    click_events,
    expected,
    killed_run,
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


RECORDS = 40_000  # 1,000 users: 40 clicks each, 10 s apart on average
RANDOM_KILLS = 2


SESSION_FAULTS = BURST_FAULTS  # sessions fire in bursts (see harness.BURST_FAULTS)


def _killed_run(
    pipeline: str, brokers: str, tmp: Path, faults: list[Fault] = ENGINE_FAULTS
) -> tuple[ChaosRun, int]:
    return killed_run(pipeline, brokers, tmp, records=RECORDS, faults=faults)


def check_sessions(run: ChaosRun, seed: int) -> None:
    """The run's output is the clicks' sessions, exactly once; the sessions both merge (about
    4 gaps in 10 are under GAP_MS) and split."""
    want = expected(expected_sessions, RECORDS, seed)
    sizes = Counter(orjson.loads(line)[1]["value"] for line in want)
    assert sum(sizes.values()) > 10_000 and sum(n for s, n in sizes.items() if s > 1) > 3_000, sizes
    assert_exactly_once(want, run.output, seed=seed)


def test_sessions_per_user_are_exactly_once_when_workers_are_killed(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    run, seed = _killed_run("session_count.py", kafka_endpoint[0], tmp_path, SESSION_FAULTS)
    check_sessions(run, seed)


TTL_MS = 5_000


def expected_ttl_counts(events: Iterator[dict[str, Any]]) -> Counter[bytes]:
    """One ``[user, count]`` per click: the user's clicks since the last gap of TTL_MS."""
    last: dict[str, int] = {}
    count: dict[str, int] = {}
    out: Counter[bytes] = Counter()
    for e in sorted(events, key=lambda e: int(e["ts_ms"])):
        user, t = str(e["user"]), int(e["ts_ms"])
        if user in last and t - last[user] >= TTL_MS:
            count[user] = 0
        count[user] = count.get(user, 0) + 1
        last[user] = t
        out[canonical([user, count[user]])] += 1
    return out


def test_running_counts_with_state_ttl_are_exactly_once_when_workers_are_killed(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    """State TTL (issue 23, item 5): expiry is decided by the records' event times, so the
    counts, restarts from a checkpoint included, are those computed from the clicks."""
    run, seed = _killed_run("ttl_count.py", kafka_endpoint[0], tmp_path)
    want = expected(expected_ttl_counts, RECORDS, seed)
    without_ttl = Counter(canonical([u, n]) for u, n in _plain_counts(RECORDS, seed))
    assert want != without_ttl, "the TTL never expired a state: the test proves nothing"
    assert_exactly_once(want, run.output, seed=seed)


def _plain_counts(records: int, seed: int) -> Iterator[tuple[str, int]]:
    seen: Counter[str] = Counter()
    for e in click_events(records, seed=seed):
        seen[str(e["user"])] += 1
        yield str(e["user"]), seen[str(e["user"])]
