"""settle_old_shape with recording sinks: which writers it opens with which context, what it
hands them, and how it reports failures (the real sinks: tests/integration/test_settle.py)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from processor.contracts import SinkContext
from processor.dataflow import DEAD_LETTERS, Dataflow
from processor.errors import DefinitionError, EosflowError
from processor.runtime.shape.settle import settle_old_shape
from processor.runtime.shape.topology import record_parallelism, recorded_parallelism
from processor.snapshot.store import SnapshotStore


class Recorder:
    """A sink whose writers record (step, subtask, parallelism, generation, epoch, pending)."""

    def __init__(self, fail_subtask: int | None = None) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.closed = 0
        self.fail_subtask = fail_subtask
        self.lock = threading.Lock()

    def open(self, ctx: SinkContext) -> Any:
        return _Writer(self, ctx)


class _Writer:
    def __init__(self, sink: Recorder, ctx: SinkContext) -> None:
        self.sink, self.ctx = sink, ctx

    def recover(self, pending: list[tuple[int, Any]]) -> None:
        c = self.ctx
        with self.sink.lock:
            self.sink.calls.append(
                (c.step, c.subtask, c.parallelism, c.generation, c.epoch, list(pending))
            )
        if c.subtask == self.sink.fail_subtask:
            raise RuntimeError("broker said no")

    def close(self) -> None:
        with self.sink.lock:
            self.sink.closed += 1


def _flow(sink: Recorder, dead: Recorder | None = None) -> Dataflow:
    flow = Dataflow("job", dead_letters=dead)
    flow.source("src", "in").map("double", lambda v: v).sink("out", sink)
    return flow


def _settle(flow: Dataflow, states: dict[str, Any], **kw: Any) -> int:
    args: dict[str, Any] = dict(
        parallelism=2, stage_names=["src", "double"], epoch=4, generation=9,
        snapshot_url="file:///nowhere", checkpoint_interval=1.0,
    )  # fmt: skip
    return settle_old_shape(flow, states, **{**args, **kw})


STATES = {
    "src.0": {"checkpoint": 7, "sinks": {DEAD_LETTERS: [[7, "d0"]]}},
    "src.1": {"checkpoint": 7, "sinks": {}},
    "double.0": {"checkpoint": 7, "sinks": {"out": [[7, "b"], [6, "a"]]}},
    "double.1": {"checkpoint": 7, "sinks": {}},
}


def test_every_old_writer_is_settled_with_its_old_context_when_pending_or_not() -> None:
    out, dead = Recorder(), Recorder()
    assert _settle(_flow(out, dead), STATES) == 3
    assert sorted(out.calls) == [
        ("out", 0, 2, 9, 4, [(6, "a"), (7, "b")]),  # in checkpoint order
        ("out", 1, 2, 9, 4, []),  # nothing pending: recover([]) cleans its orphans
    ]
    # Dead letters: index stage_index * P + subtask of stages * P, as the tasks open them.
    assert sorted(dead.calls) == [
        (DEAD_LETTERS, 0, 4, 9, 4, [(7, "d0")]),
        (DEAD_LETTERS, 1, 4, 9, 4, []),
        (DEAD_LETTERS, 2, 4, 9, 4, []),
        (DEAD_LETTERS, 3, 4, 9, 4, []),
    ]
    assert (out.closed, dead.closed) == (2, 4)


def test_failure_names_sink_old_subtask_and_checkpoints_when_a_writer_fails() -> None:
    out = Recorder(fail_subtask=0)
    with pytest.raises(EosflowError) as err:
        _settle(_flow(out), STATES, workers=1)
    message = str(err.value)
    assert "sink 'out' old subtask 0 of 2 (task double.0, checkpoint 7, pending checkpoints " in (
        message
    )
    assert "[6, 7]): RuntimeError: broker said no" in message
    assert isinstance(err.value.__cause__, RuntimeError)
    assert len(out.calls) == 2 and out.closed == 2  # the others settled; every writer closed


def test_settle_refuses_when_a_task_is_not_of_the_old_shape_or_has_no_state() -> None:
    with pytest.raises(DefinitionError, match=r"task 'src\.2' is not a task of the old shape"):
        _settle(_flow(Recorder()), {**STATES, "src.2": {"checkpoint": 7, "sinks": {}}})
    partial = {k: v for k, v in STATES.items() if k != "double.1"}
    with pytest.raises(DefinitionError, match=r"no snapshot state for old task\(s\) double\.1 "):
        _settle(_flow(Recorder()), partial)


def test_recorded_parallelism_keeps_the_highest_when_recorded_again(tmp_path: Path) -> None:
    store = SnapshotStore(f"file://{tmp_path}")
    assert recorded_parallelism(store, "job") == 0
    assert record_parallelism(store, "job", 4) == 4
    assert record_parallelism(store, "job", 2) == 4
    assert recorded_parallelism(store, "job") == 4
