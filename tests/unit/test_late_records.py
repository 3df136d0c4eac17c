"""``late="dead_letters"`` on windowed aggregations (issue 23, item 6): which records are late,
what the definition refuses, the combiner it turns off, and local recovery's refusal."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from processor.compiler import compile_flow
from processor.dataflow import Dataflow, Sliding, Tumbling
from processor.errors import ConfigError, DefinitionError
from processor.runtime.operators.windows import WindowedAggregate
from processor.runtime.supervision.local import LocalRunner, RunOptions
from sinks import ConsoleSink

Late = list[tuple[str, tuple[Any, Any, int], int, int]]


def _flow(late: str = "dead_letters", window: Any = None, dead: bool = True) -> Dataflow:
    flow = Dataflow("late-job", dead_letters=ConsoleSink() if dead else None)
    (
        flow.source("s", "t")
        .key_by("k", lambda v: v)
        .count(
            "count",
            window=window or Tumbling(timedelta(milliseconds=10)),
            allowed_lateness=timedelta(milliseconds=2),
            late=late,
        )
        .sink("out", ConsoleSink())
    )
    return flow


def _op(window: Any) -> tuple[WindowedAggregate, Late]:
    op = WindowedAggregate(_flow(window=window).steps["count"])
    routed: Late = []
    op.on_late = lambda step, record, wm, lateness: routed.append((step, record, wm, lateness))
    return op, routed


def test_a_record_whose_window_closed_is_handed_on_with_the_watermark() -> None:
    op, routed = _op(Tumbling(timedelta(milliseconds=10)))
    op.process([("a", "x", 1)])
    assert op.on_watermark(11) == [("a", {"start_ms": 0, "end_ms": 10, "value": 1}, 9)]
    op.process([("a", "y", 3), ("a", "z", 12)])  # [0, 10) closed at 11; [10, 20) open
    assert routed == [("count", ("a", "y", 3), 11, 2)]
    assert op.late_dropped == 1  # still counted
    assert op.on_watermark(21) == [("a", {"start_ms": 10, "end_ms": 20, "value": 1}, 19)]


def test_a_sliding_record_is_late_only_when_all_its_windows_closed() -> None:
    op, routed = _op(Sliding(timedelta(milliseconds=20), timedelta(milliseconds=10)))
    op.process([("a", "x", 25)])  # windows [10, 30) and [20, 40)
    op.on_watermark(31)  # closes [10, 30) (end 30 - 1 + 2 <= 31)
    op.process([("a", "partly", 25)])  # [20, 40) still takes it: not late
    assert routed == []
    op.process([("a", "wholly", 15)])  # [0, 20) and [10, 30): both closed
    assert [r[1] for r in routed] == [("a", "wholly", 15)]


def test_without_a_handler_late_records_are_dropped_and_counted() -> None:
    op = WindowedAggregate(_flow(late="drop").steps["count"])
    op.on_watermark(100)
    op.process([("a", "x", 1)])
    assert op.late_dropped == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"late": "keep"}, "late must be one of"),
        ({"window": False}, "needs a window"),
    ],
)
def test_the_definition_refuses_a_late_option_that_cannot_work(
    kwargs: dict[str, Any], message: str
) -> None:
    flow = Dataflow("late-job", dead_letters=ConsoleSink())
    keyed = flow.source("s", "t").key_by("k", lambda v: v)
    window = None if kwargs.get("window") is False else Tumbling(timedelta(seconds=1))
    with pytest.raises(DefinitionError, match=message):
        keyed.count("count", window=window, late=kwargs.get("late", "dead_letters"))


def test_dead_letters_for_late_records_need_a_dead_letter_destination() -> None:
    with pytest.raises(DefinitionError, match="no dead-letter destination"):
        _flow(dead=False).validate()
    _flow().validate()


def test_late_dead_letters_turn_the_combiner_off_so_the_window_sees_each_record() -> None:
    window = Tumbling(timedelta(seconds=1))
    routed = compile_flow(_flow(window=window), 2)
    dropped = compile_flow(_flow(late="drop", window=window), 2)
    assert [e.combine for e in routed.edges] == [False]
    assert [e.combine for e in dropped.edges] == [True]


def test_local_recovery_is_refused_for_late_dead_letters(tmp_path: Path) -> None:
    pipeline = tmp_path / "late.py"
    pipeline.write_text(
        "from datetime import timedelta\n"
        "from processor.dataflow import Dataflow, Tumbling\n"
        "from sinks import ConsoleSink\n"
        "flow = Dataflow('late-job', dead_letters=ConsoleSink())\n"
        "flow.source('s', 't').key_by('k', str).count('count', "
        "window=Tumbling(timedelta(seconds=1)), late='dead_letters').sink('out', ConsoleSink())\n"
    )
    options = RunOptions(recovery="local", state_dir=str(tmp_path / "state"))
    with pytest.raises(ConfigError, match="--recovery local cannot keep late records"):
        LocalRunner(pipeline, options)
