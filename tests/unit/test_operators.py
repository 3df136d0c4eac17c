"""Operators: windows, lateness, combiner equivalence, snapshot/restore."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from processor.dataflow import Dataflow, Sliding, Tumbling
from processor.runtime.operators import (
    MAX_WATERMARK,
    Aggregate,
    Combiner,
    WindowedAggregate,
)
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
