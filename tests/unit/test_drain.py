"""Drained checkpoints (``processor.runtime.checkpoints.drain``): what a checkpoint records when a
bounded run drained its watermark, and which later starts are refused."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from connectors.serde import JsonSerde
from processor.compiler import compile_flow
from processor.dataflow import Dataflow, Session, Tumbling
from processor.errors import ConfigError
from processor.runtime.checkpoints.coordinator import CheckpointCoordinator
from processor.runtime.checkpoints.drain import check_drained, drained_metadata, event_time_steps
from processor.runtime.operators.core import MAX_WATERMARK
from processor.runtime.operators.registry import build_operator
from processor.runtime.task import Task
from processor.snapshot.store import Manifest, SnapshotStore
from tests.unit.test_task import ListSink, Log, _env


class Ends:
    """A transport that only knows partition counts and end offsets."""

    def __init__(self, ends: dict[tuple[str, int], int]) -> None:
        self.ends = ends

    def partition_count(self, topic: str) -> int:
        return len([tp for tp in self.ends if tp[0] == topic])

    def end_offsets(self, tps: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
        return {tp: self.ends[tp] for tp in tps}


def _manifest(metadata: dict[str, Any]) -> Manifest:
    return Manifest(job="job", checkpoint_id=7, created_ms=0, tasks={}, metadata=metadata)


def _plan(windowed: bool = True) -> Any:
    flow = Dataflow("job")
    keyed = flow.source("s", "in").key_by("k", lambda v: v)
    window = Tumbling(timedelta(seconds=10)) if windowed else None
    keyed.count("n", window=window).sink("out", ListSink())
    return compile_flow(flow, 1)


DRAINED = {"drained": [["in", 0, 100], ["in", 1, 80]], "drained_all": True}
SAME = {("in", 0): 100, ("in", 1): 80}


class Settle:
    calls = 0

    def __call__(self) -> None:
        self.calls += 1


def test_the_manifest_records_the_drained_sources_and_whether_all_of_them_drained() -> None:
    assert drained_metadata([["in", 1, 5], ["in", 0, 9]], every=False) == {
        "drained": [["in", 0, 9], ["in", 1, 5]],
        "drained_all": False,
    }
    assert drained_metadata([], every=True) == {"drained": [], "drained_all": True}
    assert drained_metadata(None, every=True) == {}


def test_a_drained_checkpoint_is_settled_then_refused_to_an_unbounded_run_with_the_ways_on() -> (
    None
):
    settle = Settle()
    with pytest.raises(ConfigError) as err:
        check_drained(_plan(), _manifest(DRAINED), Ends(SAME), until_idle=False, settle=settle)
    text = str(err.value)
    assert "checkpoint 7" in text and "drained the watermark" in text and "['n']" in text
    assert "A run without --until-idle takes new input" in text
    assert "eosflow reset job" in text and "--until-idle --no-drain" in text
    assert settle.calls == 1, "the pending output is committed before the refusal"


def test_a_bounded_run_continues_a_drained_checkpoint_only_when_no_drained_partition_grew() -> None:
    plan, settle = _plan(), Settle()
    check_drained(plan, _manifest(DRAINED), Ends(SAME), until_idle=True, settle=settle)
    grown = Ends({("in", 0): 100, ("in", 1): 95})
    with pytest.raises(ConfigError, match=r"New input arrived since \(in\[1\] \+15 offsets"):
        check_drained(plan, _manifest(DRAINED), grown, until_idle=True, settle=settle)
    assert settle.calls == 1


def test_partitions_added_after_a_full_drain_are_new_input_and_after_a_partial_one_not() -> None:
    added = Ends({**SAME, ("in", 2): 30, ("in", 3): 0})
    with pytest.raises(ConfigError, match=r"in\[2\] \+30 offsets"):
        check_drained(_plan(), _manifest(DRAINED), added, until_idle=True)
    # A crash while one source task had drained and another not: the other's partitions are
    # still being read, not new input.
    partial = {"drained": [["in", 0, 100]], "drained_all": False}
    check_drained(_plan(), _manifest(partial), added, until_idle=True)


def test_a_job_without_event_time_steps_continues_a_drained_checkpoint_whatever_comes() -> None:
    grown = Ends({("in", 0): 500, ("in", 1): 500})
    check_drained(_plan(windowed=False), _manifest(DRAINED), grown, until_idle=False)
    assert event_time_steps(_plan(windowed=False)) == []
    assert event_time_steps(_plan()) == ["n"]  # a window added to a drained total: refused
    # --recovery local: the copy check forgot every ID at the drained watermark.
    with pytest.raises(ConfigError, match="local recovery copy check"):
        check_drained(
            _plan(windowed=False), _manifest(DRAINED), grown, until_idle=False, local_recovery=True
        )


def test_checkpoints_that_did_not_drain_are_never_refused() -> None:
    plan = _plan()
    check_drained(plan, None, Ends({}), until_idle=False)
    check_drained(plan, _manifest({"aligned": True}), Ends({}), until_idle=False)


def test_the_manifest_says_drained_when_source_tasks_acked_at_the_drained_watermark(
    tmp_path: Path,
) -> None:
    store = SnapshotStore(tmp_path.as_uri())
    c = CheckpointCoordinator(store, "job", ["s.0", "s.1", "w.0"], interval_s=None, timeout_s=5)
    c.start_generation(1)
    cases: list[tuple[Any, Any, dict[str, Any]]] = [
        (None, None, {}),
        ([["in", 0, 10]], None, {"drained": [["in", 0, 10]], "drained_all": False}),
        ([["in", 0, 10]], [], {"drained": [["in", 0, 10]], "drained_all": True}),
    ]
    for chk, (first, second, want) in enumerate(cases, start=1):
        assert c.trigger_now() == chk
        for task, drained in (("s.0", first), ("s.1", second), ("w.0", False)):
            c.on_ack(chk, task, store.write_task_snapshot("job", chk, task, {}), drained=drained)
        manifest = store.latest_completed("job")
        assert manifest is not None and manifest.checkpoint_id == chk
        got = {k: v for k, v in manifest.metadata.items() if k.startswith("drained")}
        assert got == want


@pytest.mark.parametrize(
    ("build", "event_time"),
    [
        (lambda k: k.count("op"), False),
        (lambda k: k.count("op", ttl=timedelta(minutes=1)), True),
        (lambda k: k.count("op", window=Tumbling(timedelta(seconds=10))), True),
        (lambda k: k.count("op", window=Session(timedelta(seconds=10))), True),
        (lambda k: k.process("op", lambda ctx, v: None), True),
    ],
    ids=["running", "ttl", "window", "session", "process"],
)
def test_operators_that_depend_on_the_watermark_say_so(build: Any, event_time: bool) -> None:
    flow = Dataflow("job")
    build(flow.source("s", "in").key_by("k", lambda v: v)).sink("out", ListSink())
    assert build_operator(flow.steps["op"]).event_time is event_time


def test_dedup_and_stateless_steps_say_whether_they_depend_on_the_watermark() -> None:
    flow = Dataflow("job")
    flow.source("s", "in").map("m", lambda v: v).dedup(
        "d", id=lambda v: v, within=timedelta(minutes=1)
    ).sink("out", ListSink())
    assert build_operator(flow.steps["d"]).event_time is True
    assert build_operator(flow.steps["m"]).event_time is False


@pytest.mark.parametrize("drain", [True, False])
def test_a_source_at_its_end_offsets_drains_the_watermark_unless_told_not_to(
    tmp_path: Path, drain: bool
) -> None:
    log = Log()
    for i in range(6):
        log.data(("in", i % 2), f"k{i}", i)
    flow = Dataflow("job")
    source = flow.source("s", "in", serde=JsonSerde(), timestamp=lambda v: v[2])
    source.key_by("k", lambda v: v[0]).count("n").sink("out", ListSink())
    plan = compile_flow(flow, 1)
    ends = {("in", 0): 3, ("in", 1): 3}
    env = _env(tmp_path, log, plan, end_offsets=ends, drain=drain)
    task = Task(env, plan.stage_of("s"), 0)
    task.open(None, {"in": 2})
    task.step(0.0, 100)
    assert task.drained, "both partitions are at their end offsets"
    assert (task.watermark == MAX_WATERMARK) is drain
    task.trigger(1)
    assert task.drained_at.get(1) == ([["in", 0, 3], ["in", 1, 3]] if drain else None)
