"""Session windows (:mod:`processor.runtime.operators.sessions`): merging, firing, lateness,
snapshots, and a property: the same clicks give the same sessions in any order when none is late."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from processor.dataflow import Dataflow, Session
from processor.errors import DefinitionError
from processor.runtime.operators.core import MAX_WATERMARK
from processor.runtime.operators.registry import build_operator
from processor.runtime.operators.sessions import SessionAggregate
from processor.snapshot import codec
from sinks import ConsoleSink

GAP = 10


def _op(kind: str = "count", lateness_ms: int = 0, **kw: Any) -> SessionAggregate:
    flow = Dataflow("job", dead_letters=ConsoleSink())
    keyed = flow.source("s", "t").key_by("k", lambda v: v)
    window = Session(timedelta(milliseconds=GAP))
    late = timedelta(milliseconds=lateness_ms)
    if kind == "count":
        keyed.count("agg", window=window, allowed_lateness=late, **kw)
    else:
        keyed.reduce("agg", lambda a, b: a + b, window=window, allowed_lateness=late, **kw)
    op = build_operator(flow.steps["agg"])
    assert isinstance(op, SessionAggregate)
    return op


def _fire(op: SessionAggregate, wm: int = MAX_WATERMARK) -> list[tuple[Any, int, int, Any]]:
    return sorted((k, v["start_ms"], v["end_ms"], v["value"]) for k, v, _t in op.on_watermark(wm))


def test_a_record_that_bridges_two_sessions_merges_them() -> None:
    op = _op()
    op.process([("a", None, 0), ("a", None, 15), ("b", None, 3)])
    assert op.state["a"] == [[0, 10, 1], [15, 25, 1]]
    op.process([("a", None, 8)])  # [8, 18) overlaps both
    assert op.state["a"] == [[0, 25, 3]]
    assert _fire(op) == [("a", 0, 25, 3), ("b", 3, 13, 1)]
    assert op.state == {}


def test_a_session_fires_once_when_the_watermark_passes_its_end_plus_lateness() -> None:
    op = _op(lateness_ms=5)
    op.process([("a", None, 0), ("a", None, 5)])  # [0, 15)
    assert _fire(op, 18) == []  # 15 - 1 + 5 = 19
    assert _fire(op, 19) == [("a", 0, 15, 2)]
    assert _fire(op, 40) == []
    # the output record's timestamp is the session's last millisecond
    op.process([("a", None, 50)])
    assert op.on_watermark(100) == [("a", {"start_ms": 50, "end_ms": 60, "value": 1}, 59)]


def test_a_record_of_a_closed_session_is_late_and_one_that_joins_an_open_one_is_not() -> None:
    op = _op()
    routed: list[Any] = []
    op.on_late = lambda step, record, wm, lateness: routed.append(record)
    op.process([("a", None, 100)])  # [100, 110)
    op.on_watermark(95)
    op.process([("a", None, 80)])  # [80, 90): closed (89 <= 95)
    op.process([("a", None, 92)])  # [92, 102) merges with the open [100, 110)
    assert routed == [("a", None, 80)] and op.late_dropped == 1
    assert _fire(op) == [("a", 92, 110, 2)]


def test_stale_firing_candidates_are_skipped_after_a_session_grew() -> None:
    op = _op()
    op.process([("a", None, 0)])  # candidate end 10
    op.process([("a", None, 9)])  # grows to [0, 19): candidate end 19
    assert _fire(op, 12) == []  # the end-10 candidate is stale
    assert _fire(op, 18) == [("a", 0, 19, 2)]


def test_sessions_survive_a_snapshot_and_restore_with_their_firing_candidates() -> None:
    op = _op("reduce")
    op.process([((1, "k"), 2, 0), ((1, "k"), 3, 4), ("b", 7, 50)])
    op.on_watermark(20)  # fires (1, "k")'s [0, 14)
    restored = _op("reduce")
    restored.restore(codec.loads(codec.dumps(op.snapshot())))
    assert restored.watermark == 20
    restored.process([("b", 1, 55)])
    assert _fire(restored) == [("b", 50, 65, 8)]


def test_a_raising_merge_leaves_the_sessions_as_they_were() -> None:
    op = _op("reduce")
    op.process([("a", 1, 0), ("a", 2, 15)])
    before = [list(s) for s in op.state["a"]]
    with pytest.raises(TypeError):
        op.process([("a", "x", 8)])  # 1 + "x" while merging
    assert op.state["a"] == before


def test_aggregate_with_sessions_needs_a_merge_function() -> None:
    flow = Dataflow("job")
    keyed = flow.source("s", "t").key_by("k", lambda v: v)
    with pytest.raises(DefinitionError, match="needs merge="):
        keyed.aggregate(
            "agg", init=list, add=lambda a, v: [*a, v], window=Session(timedelta(seconds=1))
        )
    with pytest.raises(DefinitionError, match="gap must be positive"):
        Session(timedelta(0))


def _reference(ts: list[int]) -> list[tuple[int, int, int]]:
    """Sessions of one key from its timestamps: split where two are GAP or more apart."""
    out, ts = [], sorted(ts)
    first = last = ts[0]
    n = 0
    for t in ts:
        if t - last >= GAP:
            out.append((first, last + GAP, n))
            first, n = t, 0
        last, n = t, n + 1
    out.append((first, last + GAP, n))
    return out


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 200)), min_size=1, max_size=60),
    st.randoms(use_true_random=False),
    st.integers(1, 7),
)
def test_sessions_do_not_depend_on_the_order_or_the_batches_of_records(
    records: list[tuple[str, int]], rng: Any, batch: int
) -> None:
    """With the watermark held back (nothing late), any order and any batching of the same
    records gives the reference's sessions, counts included."""
    shuffled = list(records)
    rng.shuffle(shuffled)
    op = _op()
    batch_records = [(k, None, t) for k, t in shuffled]
    for i in range(0, len(batch_records), batch):
        op.process(batch_records[i : i + batch])
    want = sorted(
        (k, s, e, n)
        for k in {k for k, _t in records}
        for s, e, n in _reference([t for kk, t in records if kk == k])
    )
    assert _fire(op) == want
