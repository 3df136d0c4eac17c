"""Operators: windows, lateness, combiners, snapshot/restore, the dead-letter fallback."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from processor.dataflow import Dataflow, Sliding, Tumbling
from processor.runtime.operators.core import MAX_WATERMARK, Aggregate
from processor.runtime.operators.registry import build_operator
from processor.runtime.operators.windows import Combiner, WindowedAggregate
from processor.snapshot import codec


def _count_step(window: Sliding | None, lateness_ms: int = 0) -> Any:
    flow = Dataflow("job")
    flow.source("s", "t").key_by("k", lambda v: v).count(
        "count", window=window, allowed_lateness=timedelta(milliseconds=lateness_ms)
    )
    return flow.steps["count"]


def test_running_aggregate_emits_every_update_when_records_arrive() -> None:
    op = Aggregate(_count_step(None))
    out = op.process([("a", 1, 0), ("b", 1, 0), ("a", 1, 5)])
    assert out == [("a", 1, 0), ("b", 1, 0), ("a", 2, 5)]
    restored = Aggregate(_count_step(None))
    restored.restore(codec.loads(codec.dumps(op.snapshot())))
    assert restored.process([("a", 1, 9)]) == [("a", 3, 9)]


def test_tumbling_window_fires_once_when_watermark_passes_end() -> None:
    op = WindowedAggregate(_count_step(Tumbling(timedelta(milliseconds=10))))
    op.process([("a", None, 1), ("a", None, 9), ("a", None, 10)])
    assert op.on_watermark(8) == []
    assert op.on_watermark(9) == [("a", {"start_ms": 0, "end_ms": 10, "value": 2}, 9)]
    assert op.on_watermark(9) == []
    op.process([("a", None, 3)])  # its window already fired: late
    assert op.late_dropped == 1
    assert op.on_watermark(MAX_WATERMARK) == [("a", {"start_ms": 10, "end_ms": 20, "value": 1}, 19)]


def test_allowed_lateness_delays_firing_when_set() -> None:
    op = WindowedAggregate(_count_step(Tumbling(timedelta(milliseconds=10)), lateness_ms=5))
    op.process([("a", None, 1)])
    assert op.on_watermark(12) == []
    op.process([("a", None, 2)])  # late but within the allowed lateness
    assert op.on_watermark(14) == [("a", {"start_ms": 0, "end_ms": 10, "value": 2}, 9)]
    assert op.late_dropped == 0


def test_sliding_window_counts_a_record_in_every_window_when_windows_overlap() -> None:
    window = Sliding(timedelta(milliseconds=30), timedelta(milliseconds=10))
    op = WindowedAggregate(_count_step(window))
    op.process([("a", None, 25)])
    fired = op.on_watermark(MAX_WATERMARK)
    assert sorted(v["start_ms"] for _k, v, _t in fired) == [0, 10, 20]


events = st.lists(
    st.tuples(st.sampled_from("abc"), st.integers(min_value=0, max_value=200)), max_size=60
)


@settings(max_examples=100, deadline=None)
@given(events, st.integers(min_value=1, max_value=8), st.sampled_from([(20, 20), (40, 10)]))
def test_combiner_then_merge_equals_direct_aggregation_when_batches_vary(
    records: list[tuple[str, int]], batch: int, window_ms: tuple[int, int]
) -> None:
    window = Sliding(timedelta(milliseconds=window_ms[0]), timedelta(milliseconds=window_ms[1]))
    step = _count_step(window)
    direct = WindowedAggregate(step)
    combiner = Combiner(step)
    merged = WindowedAggregate(step, merged_input=True)
    rows = [(k, None, t) for k, t in records]
    direct.process(rows)
    for i in range(0, len(rows), batch):
        combiner.process(rows[i : i + batch])
        merged.process(combiner.flush())

    def result(op: WindowedAggregate) -> Counter[Any]:
        return Counter(
            (k, v["start_ms"], v["value"]) for k, v, _t in op.on_watermark(MAX_WATERMARK)
        )

    assert result(direct) == result(merged)


def test_windowed_state_survives_a_snapshot_round_trip_when_restored() -> None:
    step = _count_step(Tumbling(timedelta(milliseconds=10)))
    op = WindowedAggregate(step)
    op.process([("a", None, 1), ("b", None, 12)])
    op.on_watermark(9)
    restored = WindowedAggregate(step)
    restored.restore(codec.loads(codec.dumps(op.snapshot())))
    assert restored.watermark == 9
    restored.process([("b", None, 15)])
    assert restored.on_watermark(MAX_WATERMARK) == [
        ("b", {"start_ms": 10, "end_ms": 20, "value": 2}, 19)
    ]


# -- dead letters: the per-record fallback when a user function raises ---------------------------


class _Handler:
    """Collects ``(operator name, index, record, error type)`` as the task's handler would."""

    def __init__(self) -> None:
        self.failed: list[tuple[str, int, Any, str]] = []

    def __call__(self, op: Any, batch: list[Any], index: int, exc: Exception) -> None:
        self.failed.append((op.name, index, batch[index], type(exc).__name__))


def _fails_on(bad: int) -> Any:
    def fn(v: Any) -> Any:
        if v == bad:
            raise ValueError(f"bad {v}")
        return v * 10

    return fn


def _stateless(kind: str, fn: Any) -> Any:
    flow = Dataflow("job")
    s = flow.source("s", "t")
    getattr(s, kind)("op", fn)
    return build_operator(flow.steps["op"])


BATCH = [(None, 1, 0), (None, 2, 1), (None, 3, 2), (None, 2, 3)]


@pytest.mark.parametrize(
    ("kind", "fn", "want"),
    [
        ("map", _fails_on(2), [(None, 10, 0), (None, 30, 2)]),
        ("filter", lambda v: 1 / (v - 2) > 0, [(None, 3, 2)]),
        ("key_by", _fails_on(2), [(10, 1, 0), (30, 3, 2)]),
        ("flat_map", lambda v: [v, v] if v != 2 else iter([v, 1 / 0]), [(None, 1, 0)] * 2
         + [(None, 3, 2)] * 2),
    ],
)  # fmt: skip
def test_stateless_operator_keeps_the_other_records_when_a_function_raises(
    kind: str, fn: Any, want: list[Any]
) -> None:
    op = _stateless(kind, fn)
    op.on_error = handler = _Handler()
    assert op.process(list(BATCH)) == want
    assert [(i, r) for _n, i, r, _e in handler.failed] == [(1, BATCH[1]), (3, BATCH[3])]
    assert {name for name, *_ in handler.failed} == {"op"}


def test_flat_map_emits_nothing_of_a_record_whose_generator_raises_half_way() -> None:
    """A generator that yields, then raises: its earlier outputs must not be kept."""

    def gen(v: int) -> Any:
        yield v
        if v == 2:
            raise ValueError("half-way")
        yield v + 100

    op = _stateless("flat_map", gen)
    op.on_error = _Handler()
    assert op.process([(None, 1, 0), (None, 2, 1)]) == [(None, 1, 0), (None, 101, 0)]


def test_operator_raises_the_users_error_when_no_handler_is_set() -> None:
    op = _stateless("map", _fails_on(2))
    with pytest.raises(ValueError, match="bad 2"):
        op.process(list(BATCH))
    agg = Aggregate(_agg_step(None))
    with pytest.raises(KeyError):
        agg.process([("a", {"n": 1}, 0), ("a", {}, 1)])
    assert agg.state == {"a": 1}  # as before dead letters existed: the batch fails the task


def _agg_step(window: Sliding | None) -> Any:
    """Sums ``v["n"]``: a value without ``n`` makes ``add`` raise."""
    flow = Dataflow("job")
    flow.source("s", "t").key_by("k", lambda v: v).aggregate(
        "sum", init=lambda: 0, add=lambda acc, v: acc + v["n"], merge=lambda a, b: a + b,
        window=window,
    )  # fmt: skip
    return flow.steps["sum"]


def test_running_aggregate_applies_every_good_record_once_when_one_fails() -> None:
    op = Aggregate(_agg_step(None))
    op.on_error = handler = _Handler()
    batch = [("a", {"n": 1}, 0), ("b", {"n": 5}, 1), ("a", {}, 2), ("a", {"n": 2}, 3),
             ("b", {"x": 0}, 4), ("b", {"n": 1}, 5)]  # fmt: skip
    assert op.process(batch) == [("a", 1, 0), ("b", 5, 1), ("a", 3, 3), ("b", 6, 5)]
    assert op.state == {"a": 3, "b": 6}  # records before the failure are not applied twice
    assert [i for _n, i, _r, _e in handler.failed] == [2, 4]
    assert handler.failed[0][3] == "KeyError"


@pytest.mark.parametrize(
    "window",
    [
        Tumbling(timedelta(milliseconds=10)),
        Sliding(timedelta(milliseconds=20), timedelta(milliseconds=10)),
    ],
)
def test_windowed_aggregate_equals_the_good_records_alone_when_some_fail(window: Sliding) -> None:
    good = [("a", {"n": 1}, 1), ("a", {"n": 2}, 12), ("b", {"n": 4}, 15), ("a", {"n": 8}, 25)]
    bad = [("a", {}, 3), ("b", {"m": 1}, 14)]
    mixed = [good[0], bad[0], good[1], good[2], bad[1], good[3]]
    expected = WindowedAggregate(_agg_step(window))
    expected.process(good)
    op = WindowedAggregate(_agg_step(window))
    op.on_error = handler = _Handler()
    op.process(mixed)
    assert [i for _n, i, _r, _e in handler.failed] == [1, 4]
    assert op.on_watermark(MAX_WATERMARK) == expected.on_watermark(MAX_WATERMARK)


def test_sliding_aggregate_applies_a_record_to_all_its_windows_or_none() -> None:
    """``add`` raises for one of a record's two windows only: no window may keep the record."""
    flow = Dataflow("job")
    flow.source("s", "t").key_by("k", lambda v: v).aggregate(
        "sum", init=lambda: 0, add=lambda acc, v: acc + v if acc < 5 else 1 / 0,
        window=Sliding(timedelta(milliseconds=20), timedelta(milliseconds=10)),
    )  # fmt: skip
    op = WindowedAggregate(flow.steps["sum"])
    op.on_error = handler = _Handler()
    # window [0, 20) reaches 5 with the first record; the second record (ts 15) is in
    # [0, 20) -> raises, and in [10, 30) -> would succeed.
    op.process([("a", 5, 5), ("a", 1, 15)])
    assert [i for _n, i, _r, _e in handler.failed] == [1]
    fired = {v["start_ms"]: v["value"] for _k, v, _t in op.on_watermark(MAX_WATERMARK)}
    assert fired == {-10: 5, 0: 5}  # nothing of the failed record, in any window


def test_merging_aggregate_and_combiner_route_failing_partials_and_records() -> None:
    step = _agg_step(Tumbling(timedelta(milliseconds=10)))
    combiner = Combiner(step)
    combiner.on_error = handler = _Handler()
    assert combiner.process([("a", {"n": 1}, 1), ("a", {}, 2), ("a", {"n": 2}, 3)]) == []
    assert combiner.flush() == [("a", [0, 3], 0)]
    assert [i for _n, i, _r, _e in handler.failed] == [1]
    merged = WindowedAggregate(step, merged_input=True)
    merged.merge = lambda a, b: a + b if b != 99 else 1 / 0
    merged.on_error = handler = _Handler()
    merged.process([("a", [0, 3], 0), ("a", [0, 99], 0), ("a", [0, 4], 0)])
    assert [i for _n, i, _r, _e in handler.failed] == [1]
    assert merged.on_watermark(MAX_WATERMARK) == [
        ("a", {"start_ms": 0, "end_ms": 10, "value": 7}, 9)
    ]
