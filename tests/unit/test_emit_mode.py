"""Emit mode of windowed aggregations (issue 23, item 5b): ``emit="close"`` (one result per key
and window when it closes) or ``"update"`` (every change at once, nothing at close); and
``--recovery local`` refusing ``process`` steps and update-mode windows whose output crosses a
channel."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from processor.compiler import compile_flow
from processor.dataflow import Dataflow, Session, Sliding, Tumbling
from processor.errors import ConfigError, DefinitionError
from processor.runtime.operators.core import MAX_WATERMARK, Record
from processor.runtime.operators.windows import WindowedAggregate
from processor.runtime.supervision.local import LocalRunner, RunOptions
from processor.snapshot import codec
from sinks import ConsoleSink

SIZE = 10


def _op(window: Any = None, kind: str = "count", emit: str = "update") -> WindowedAggregate:
    flow = Dataflow("job")
    keyed = flow.source("s", "t").key_by("k", lambda v: v)
    window = window or Tumbling(timedelta(milliseconds=SIZE))
    if kind == "count":
        keyed.count("agg", window=window, emit=emit)
    else:
        keyed.reduce("agg", lambda a, b: a + b, window=window, emit=emit)
    return WindowedAggregate(flow.steps["agg"])


def _w(start: int, value: Any, size: int = SIZE) -> dict[str, Any]:
    return {"start_ms": start, "end_ms": start + size, "value": value}


def test_update_mode_emits_every_change_at_the_records_time_and_nothing_at_close() -> None:
    op = _op()
    out = op.process([("a", None, 1), ("b", None, 2), ("a", None, 9), ("a", None, 12)])
    assert out == [("a", _w(0, 1), 1), ("b", _w(0, 1), 2), ("a", _w(0, 2), 9), ("a", _w(10, 1), 12)]
    assert op.on_watermark(9) == [] and sorted(op.state) == [20]  # window [0, 10) closed
    assert op.process([("a", None, 5)]) == [] and op.late_dropped == 1  # late: no update
    assert op.on_watermark(MAX_WATERMARK) == [] and op.state == {}


def test_close_mode_is_the_default_and_emits_once_per_window() -> None:
    flow = Dataflow("job")
    flow.source("s", "t").key_by("k", lambda v: v).count(
        "agg", window=Tumbling(timedelta(milliseconds=SIZE))
    )
    assert flow.steps["agg"].params["emit"] == "close"
    op = _op(emit="close")
    assert op.process([("a", None, 1), ("a", None, 2)]) == []
    assert op.on_watermark(MAX_WATERMARK) == [("a", _w(0, 2), 9)]


def test_update_mode_on_sliding_windows_emits_one_update_per_window_oldest_first() -> None:
    op = _op(Sliding(timedelta(milliseconds=20), timedelta(milliseconds=10)), "reduce")
    assert op.process([("a", 5, 15)]) == [("a", _w(0, 5, 20), 15), ("a", _w(10, 5, 20), 15)]
    assert op.process([("a", 1, 25)]) == [("a", _w(10, 6, 20), 25), ("a", _w(20, 1, 20), 25)]


def test_a_record_whose_add_raises_emits_no_update_and_changes_no_window() -> None:
    op = _op(Sliding(timedelta(milliseconds=20), timedelta(milliseconds=10)), "reduce")
    failed: list[Record] = []
    op.on_error = lambda _op, batch, i, exc: failed.append(batch[i])
    op.process([("a", 1, 5)])  # windows [-10, 10) and [0, 20)
    out = op.process([("a", "x", 15), ("a", 2, 16)])  # 1 + "x" raises in [0, 20)
    assert failed == [("a", "x", 15)]
    assert out == [("a", _w(0, 3, 20), 16), ("a", _w(10, 2, 20), 16)]


def test_emit_is_checked_when_the_step_is_defined() -> None:
    keyed = Dataflow("job").source("s", "t").key_by("k", lambda v: v)
    with pytest.raises(DefinitionError, match="emit must be one of"):
        keyed.count("a", window=Tumbling(timedelta(seconds=1)), emit="final")
    with pytest.raises(DefinitionError, match="without a window emits its running result"):
        keyed.count("b", emit="update")
    with pytest.raises(DefinitionError, match="not supported with session windows"):
        keyed.count("c", window=Session(timedelta(seconds=1)), emit="update")


def _flow(emit: str, *, crossing: bool = False) -> Dataflow:
    flow = Dataflow("job")
    counts = (
        flow.source("s", "t")
        .key_by("k", str)
        .count("count", window=Tumbling(timedelta(seconds=1)), emit=emit)
    )
    if crossing:  # the updates cross a second shuffle
        counts = counts.key_by("again", lambda v: v["value"]).count("per-value")
    counts.sink("out", ConsoleSink())
    return flow


def test_update_mode_has_no_combiner_and_depends_on_the_channels_interleaving() -> None:
    assert [e.combine for e in compile_flow(_flow("close"), 2).edges] == [True]
    assert [e.combine for e in compile_flow(_flow("update"), 2).edges] == [False]
    dependent = compile_flow(_flow("update", crossing=True), 2, combine=False)
    assert [s for s, _e in dependent.interleaving_dependent()] == ["count"]
    closing = compile_flow(_flow("close", crossing=True), 2, combine=False)
    assert closing.interleaving_dependent() == []  # a window fires on the watermark


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (
            "flow.source('s', 't').key_by('k', str).process('proc', lambda c, v: None)"
            ".sink('out', ConsoleSink())",
            r"--recovery local cannot keep step\(s\) \['proc'\] \(process\)",
        ),
        (
            "flow.source('s', 't').key_by('k', str).count('count', "
            "window=Tumbling(timedelta(seconds=1)), emit='update')"
            ".key_by('again', str).count('c2').sink('out', ConsoleSink())",
            "--recovery local cannot keep step 'count' exactly",
        ),
    ],
    ids=["process", "update-mode-crossing-a-channel"],
)
def test_local_recovery_is_refused_at_start_up(tmp_path: Path, body: str, match: str) -> None:
    pipeline = tmp_path / "job.py"
    pipeline.write_text(
        "from datetime import timedelta\n"
        "from processor.dataflow import Dataflow, Tumbling\n"
        "from sinks import ConsoleSink\n"
        f"flow = Dataflow('job')\n{body}\n"
    )
    with pytest.raises(ConfigError, match=match):
        LocalRunner(pipeline, RunOptions(recovery="local", state_dir=str(tmp_path / "state")))
    LocalRunner(pipeline, RunOptions(state_dir=str(tmp_path / "state")))  # global: fine


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from("ab"), st.integers(0, 60)), min_size=1, max_size=60),
    st.randoms(use_true_random=False),
    st.integers(1, 7),
    st.integers(0, 10),
)
def test_a_windows_updates_are_its_running_count_and_the_last_is_the_closed_result(
    records: list[tuple[str, int]], rng: Any, batch: int, cut: int
) -> None:
    """Any order and batching (the watermark held back, nothing late), a snapshot and restore
    at any batch: per key and window, the updates are exactly 1..n, and the greatest is what
    emit='close' fires for that window."""
    shuffled = list(records)
    rng.shuffle(shuffled)
    window = Sliding(timedelta(milliseconds=20), timedelta(milliseconds=10))
    op, closing = _op(window), _op(window, emit="close")
    updates: Counter[tuple[str, int, int]] = Counter()
    for i in range(0, len(shuffled), batch):
        if i // batch == cut:
            fresh = _op(window)
            fresh.restore(codec.loads(codec.dumps(op.snapshot())))
            op = fresh
        chunk = [(k, None, t) for k, t in shuffled[i : i + batch]]
        closing.process(chunk)
        for k, v, _t in op.process(chunk):
            updates[(k, v["start_ms"], v["value"])] += 1
    assert op.on_watermark(MAX_WATERMARK) == []
    final = {(k, v["start_ms"]): v["value"] for k, v, _t in closing.on_watermark(MAX_WATERMARK)}
    want = Counter((k, s, n) for (k, s), total in final.items() for n in range(1, total + 1))
    assert updates == want
