"""Joins (issue 23, items 1 and 2) end to end, exactly once under SIGKILLs at the engine's
protocol points and at random.

* Every click joined with its user's plan *as of the click's time*, from a user table (rows,
  plan changes, deletions as tombstones) in its own topic: the expectation is
  ``examples/users.py``'s :class:`RowsAt` over the same generated rows, without the engine.
* Every (item view, cart click) pair of a user with the cart 0-30 s after the item (an interval
  join): the expectation is the pairs computed from the generated clicks.

The clicks of a partition are in time order (1 s of out-of-orderness allowed), the table's rows
are written in time order and the table holds the watermark back until it has caught up, so no
record is late and the answer does not depend on how the workers interleave. Each test prints
its seed; rerun one with ``EOSFLOW_CHAOS_SEED=<seed>``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.harness import (
    BURST_FAULTS,
    ChaosRun,
    RowsAt,
    assert_exactly_once,
    canonical,
    chaos_seed,
    click_events,
    killed_run,
    produce_clicks,
    produce_users,
    user_versions,
)

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

RECORDS = 40_000  # 1,000 users: 40 clicks each, 10 s apart on average
INTERVAL_MS = 30_000


def _killed_run(pipeline: str, brokers: str, tmp: Path, seed: int, **kw: Any) -> ChaosRun:
    return killed_run(pipeline, brokers, tmp, records=RECORDS, seed=seed, **kw)[0]


def _with_users(versions: list[Any], seed: int) -> Any:
    """Writes the clicks and, to ``<topic>-users``, the user table's ``versions``."""

    def produce(brokers: str, topic: str) -> None:
        produce_clicks(brokers, topic, RECORDS, seed=seed)
        produce_users(brokers, f"{topic}-users", versions)

    return produce


def _table_run(pipeline: str, brokers: str, tmp: Path) -> tuple[ChaosRun, int, list[Any]]:
    """``pipeline`` over the clicks and a user table, killed; outputs fired by the watermark
    reach the sinks in bursts (BURST_FAULTS)."""
    seed = chaos_seed()
    versions = user_versions(RECORDS, seed=seed)
    produce = _with_users(versions, seed)
    run = _killed_run(pipeline, brokers, tmp, seed, produce=produce, faults=BURST_FAULTS)
    return run, seed, versions


def expected_plans(events: Iterator[dict[str, Any]], rows: RowsAt) -> Counter[bytes]:
    out: Counter[bytes] = Counter()
    for e in events:
        user = str(e["user"])
        row = rows.at(user, int(e["ts_ms"]))
        plan = None if row is None else row["plan"]
        out[canonical([user, {"id": e["event_id"], "plan": plan}])] += 1
    return out


def test_clicks_join_their_users_plan_as_of_their_time_exactly_once_when_workers_are_killed(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    run, seed, versions = _table_run("join_users.py", kafka_endpoint[0], tmp_path)
    rows = RowsAt(versions)
    want = expected_plans(click_events(RECORDS, seed=seed), rows)
    # The table matters: clicks without a row (before the user's first row, or after its
    # deletion), and clicks whose plan is not the user's first plan, are in the expectation.
    first: dict[str, Any] = {}
    for user, row, _ts in versions:
        first.setdefault(user, row)
    without = changed = 0
    for e in click_events(RECORDS, seed=seed):
        row = rows.at(str(e["user"]), int(e["ts_ms"]))
        without += row is None
        changed += row is not None and row["plan"] != first[str(e["user"])]["plan"]
    assert without > 500 and changed > 1_000, (without, changed)
    assert_exactly_once(want, run.output, seed=seed)


def expected_table_join(events: Iterator[dict[str, Any]], versions: list[Any]) -> Counter[bytes]:
    """The changelog of users ⋈ last click (inner): at every time either changed for a user,
    the joined row; ``None`` once when the row goes (the user was deleted)."""
    changes: dict[str, list[tuple[int, int, Any]]] = {}  # user -> (ts, side, row)
    for user, row, ts in versions:
        changes.setdefault(user, []).append((ts, 0, row))
    for e in events:
        changes.setdefault(str(e["user"]), []).append((int(e["ts_ms"]), 1, e))
    out: Counter[bytes] = Counter()
    for user, timeline in changes.items():
        rows: list[Any] = [None, None]
        had = False
        for ts, side, row in sorted(timeline, key=lambda c: (c[0], c[1])):
            rows[side] = row
            if any(c[0] == ts for c in timeline if c is not None and (c[0], c[1]) > (ts, side)):
                continue  # the other side changes at the same time: one row for both
            if rows[0] is not None and rows[1] is not None:
                out[canonical([user, {"plan": rows[0]["plan"], "page": rows[1]["page"]}])] += 1
                had = True
            elif had:
                out[canonical([user, None])] += 1
                had = False
    return out


def test_table_join_changelog_is_exactly_once_when_workers_are_killed(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    run, seed, versions = _table_run("table_join.py", kafka_endpoint[0], tmp_path)
    want = expected_table_join(click_events(RECORDS, seed=seed), versions)
    assert sum(1 for line in want if line.endswith(b",null]")) > 10, "no deletion joined"
    assert_exactly_once(want, run.output, seed=seed)


def expected_pairs(events: Iterator[dict[str, Any]]) -> Counter[bytes]:
    items: dict[str, list[tuple[int, str]]] = {}
    carts: dict[str, list[tuple[int, str]]] = {}
    for e in events:
        side = items if e["page"] == "/item" else carts if e["page"] == "/cart" else None
        if side is not None:
            side.setdefault(str(e["user"]), []).append((int(e["ts_ms"]), str(e["event_id"])))
    out: Counter[bytes] = Counter()
    for user, views in items.items():
        for ta, a in views:
            for tb, b in carts.get(user, []):
                if ta <= tb <= ta + INTERVAL_MS:
                    out[canonical([user, [a, b]])] += 1
    return out


def test_interval_join_pairs_are_exactly_once_when_workers_are_killed(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    seed = chaos_seed()
    run = _killed_run("interval_pairs.py", kafka_endpoint[0], tmp_path, seed)
    want = expected_pairs(click_events(RECORDS, seed=seed))
    assert sum(want.values()) > 2_000, sum(want.values())
    assert_exactly_once(want, run.output, seed=seed)
