"""Build-time validation of the Dataflow API and its compilation to stages."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest

from processor.compiler import compile_flow
from processor.contracts import SinkContext
from processor.dataflow import Dataflow, Sliding, Tumbling
from processor.errors import DefinitionError


class _Sink:
    def open(self, ctx: SinkContext) -> Any:
        raise AssertionError("not opened in these tests")


def _flow() -> Dataflow:
    return Dataflow("job")


def test_step_names_must_be_kebab_case_when_added() -> None:
    flow = _flow()
    with pytest.raises(DefinitionError, match="kebab-case"):
        flow.source("Clicks", "t")
    with pytest.raises(DefinitionError, match="not valid"):
        Dataflow("My Job")


def test_duplicate_step_name_is_refused_when_added() -> None:
    flow = _flow()
    s = flow.source("clicks", "t")
    with pytest.raises(DefinitionError, match="used twice"):
        s.map("clicks", lambda v: v)


def test_validate_names_dangling_steps_when_a_stream_has_no_sink() -> None:
    flow = _flow()
    flow.source("clicks", "t").map("parse", lambda v: v)
    with pytest.raises(DefinitionError, match=r"\['parse'\] goes nowhere"):
        flow.validate()


def test_validation_refuses_bad_arguments_when_building() -> None:
    flow = _flow()
    s = flow.source("clicks", "t")
    with pytest.raises(DefinitionError, match="callable"):
        s.map("m", 3)  # type: ignore[arg-type]
    with pytest.raises(DefinitionError, match=r"processor\.contracts\.Sink"):
        s.sink("out", object())  # type: ignore[arg-type]
    with pytest.raises(DefinitionError, match="both read topic"):
        flow.source("again", "t")
    with pytest.raises(DefinitionError, match="multiple of the slide"):
        Sliding(timedelta(seconds=10), timedelta(seconds=3))
    with pytest.raises(DefinitionError, match="timedelta"):
        Tumbling(10)  # type: ignore[arg-type]
    with pytest.raises(DefinitionError, match="positive int"):
        compile_flow(flow, 0)


def test_forward_steps_fuse_and_aggregation_shuffles_when_compiled() -> None:
    flow = _flow()
    (
        flow.source("clicks", "t")
        .map("parse", lambda v: v)
        .filter("valid", bool)
        .key_by("by-user", lambda v: v["user"])
        .count("count")
        .map("fmt", str)
        .sink("out", _Sink())
    )
    plan = compile_flow(flow, 2)
    assert [s.steps for s in plan.stages] == [
        ("clicks", "parse", "valid", "by-user"),
        ("count", "fmt", "out"),
    ]
    (edge,) = plan.edges
    assert edge.shuffle and not edge.combine
    assert edge.topic == "eosflow.job.by-user.count"
    assert plan.task_names() == ["clicks.0", "clicks.1", "count.0", "count.1"]


def test_windowed_count_gets_a_combiner_when_it_has_a_merge() -> None:
    flow = _flow()
    keyed = flow.source("clicks", "t").key_by("by-page", lambda v: v["page"])
    keyed.count("per-window", window=Tumbling(timedelta(seconds=10))).sink("out", _Sink())
    keyed.aggregate(
        "no-merge", init=list, add=lambda a, v: [*a, v], window=Tumbling(timedelta(seconds=1))
    ).sink("out2", _Sink())
    combine = {e.dst_step: e.combine for e in compile_flow(flow, 2).edges}
    assert combine == {"per-window": True, "no-merge": False}
    # local recovery: partials depend on batch boundaries, so a restarted worker could not
    # re-emit them with the same IDs
    assert not any(e.combine for e in compile_flow(flow, 2, combine=False).edges)


def test_aggregation_of_an_aggregation_needs_no_shuffle_when_the_key_is_unchanged() -> None:
    flow = _flow()
    counts = flow.source("clicks", "t").key_by("k", lambda v: v).count("count")
    counts.reduce("max", max).sink("out", _Sink())
    plan = compile_flow(flow, 3)
    assert len(plan.edges) == 1
    assert plan.stage_of("max").name == "count"


def test_union_of_sources_merges_stages_and_union_after_shuffle_uses_forward_channels() -> None:
    flow = _flow()
    a = flow.source("a", "ta")
    b = flow.source("b", "tb")
    a.union("both", b).sink("out", _Sink())
    plan = compile_flow(flow, 2)
    assert len(plan.stages) == 1 and plan.stages[0].sources == ("a", "b")

    flow = _flow()
    src = flow.source("a", "ta")
    counted = src.key_by("k", lambda v: v).count("count")
    counted.union("mixed", src.key_by("k2", lambda v: v)).sink("out", _Sink())
    plan = compile_flow(flow, 2)
    forward = [e for e in plan.edges if not e.shuffle]
    assert {e.src_step for e in forward} == {"count", "k2"}
    assert set(plan.stage_of("mixed").inputs) == set(forward)
    assert "forward" in plan.describe()


def test_dead_letter_destination_is_validated_like_a_sink_when_given() -> None:
    with pytest.raises(DefinitionError, match=r"dead-letter destination .* processor\.contracts"):
        Dataflow("job", dead_letters=object())  # type: ignore[arg-type]
    sink = _Sink()
    flow = Dataflow("job", dead_letters=sink)
    assert flow.dead_letter_sink is sink
    with pytest.raises(DefinitionError, match="already sends dead letters"):
        flow.dead_letters(_Sink())
    later = _flow()
    assert later.dead_letter_sink is None
    later.dead_letters(sink)
    assert later.dead_letter_sink is sink


def test_step_name_dead_letters_is_reserved_when_added() -> None:
    flow = _flow()
    with pytest.raises(DefinitionError, match="reserved for the dataflow's dead-letter"):
        flow.source("clicks", "t").sink("dead-letters", _Sink())


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"recovery": "partial"}, "recovery 'partial': choose one of"),
        ({"recovery": "local", "mode": "sync"}, "--recovery local needs checkpoints"),
        ({"recovery": "local", "recovery_max_ids": 10}, "--recovery-max-ids 10"),
    ],
)
def test_recovery_options_are_checked_at_start_up(options: dict[str, Any], message: str) -> None:
    from processor.errors import ConfigError
    from processor.runtime.supervision.runner import RunOptions

    with pytest.raises(ConfigError, match=re.escape(message)):
        RunOptions(**options).validate()


def _two_shuffles(window: Any = None, *, sink_after: bool = False) -> Dataflow:
    """clicks -> by-user -> total (running or windowed) -> [by-region -> sum] or a sink."""
    flow = Dataflow("two-shuffles")
    totals = (
        flow.source("clicks", "t")
        .key_by("by-user", lambda c: c["user"])
        .aggregate("total", init=lambda: 0, add=lambda n, c: n + c["amount"], window=window)
    )
    if sink_after:
        totals.sink("out", _Sink())
    else:
        totals.key_by("by-region", lambda r: r[0][:1]).count("per-region").sink("out", _Sink())
    return flow


def test_local_recovery_is_refused_when_a_running_total_crosses_a_second_shuffle(
    tmp_path: Any,
) -> None:
    """Regression (issue 19): under --recovery local, a running aggregate whose output crosses a
    second shuffle re-emitted, after a restart, values that depend on how its two input
    channels interleaved this time, under the IDs of the first emissions; a surviving
    downstream task kept the first copy of each ID and the output mixed old and new totals
    (the final total possibly never emitted). Such a job is refused at start-up with the
    reason; global recovery runs it."""
    from processor.compiler import compile_flow
    from processor.errors import ConfigError
    from processor.runtime.supervision.local import LocalRunner, RunOptions

    plan = compile_flow(_two_shuffles(), 2, combine=False)
    assert [(step, e.dst_step) for step, e in plan.interleaving_dependent()] == [
        ("total", "per-region")
    ]
    pipeline = tmp_path / "two_shuffles.py"
    pipeline.write_text(
        "from tests.unit.test_dataflow import _two_shuffles\nflow = _two_shuffles()\n"
    )
    options = RunOptions(recovery="local", state_dir=str(tmp_path / "state"))
    with pytest.raises(ConfigError, match=r"--recovery local cannot keep step 'total' exactly"):
        LocalRunner(pipeline, options)
    LocalRunner(pipeline, RunOptions(state_dir=str(tmp_path / "state")))  # global recovery: fine


@pytest.mark.parametrize(
    "flow",
    [
        _two_shuffles(Tumbling(timedelta(seconds=10))),  # a window fires on the watermark
        _two_shuffles(sink_after=True),  # written from the aggregate's own stage
    ],
    ids=["windowed", "sink-in-the-same-stage"],
)
def test_local_recovery_is_allowed_when_no_interleaving_dependent_output_crosses_a_channel(
    flow: Dataflow,
) -> None:
    from processor.compiler import compile_flow

    assert compile_flow(flow, 2, combine=False).interleaving_dependent() == []
    assert compile_flow(flow, 1, combine=False).interleaving_dependent() == []
