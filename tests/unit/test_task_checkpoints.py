"""The task's checkpoint coordinator alone (:class:`SubtaskCheckpoints`), without a task, a
reader or operators: a fake chain (one sink writer, one output) and fake inputs stand in for the
task's other collaborators (issue 36: each collaborator testable alone)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from processor.runtime.task.checkpoints import SubtaskCheckpoints
from processor.wire import Barrier

TP0 = ("ch", 0)


class Writer:
    def __init__(self) -> None:
        self.recovered: list[Any] = []
        self.commits: list[tuple[int, str]] = []

    def recover(self, committables: list[Any]) -> None:
        self.recovered.append(committables)

    def prepare(self, checkpoint_id: int) -> str:
        return f"epoch-{checkpoint_id}"

    def commit(self, checkpoint_id: int, committable: str) -> None:
        self.commits.append((checkpoint_id, committable))


class Store:
    url = "memory://"

    def __init__(self) -> None:
        self.written: dict[int, Any] = {}

    def write_task_snapshot(self, job: str, chk: int, task: str, state: Any, **_: Any) -> str:
        self.written[chk] = state
        return f"{job}/{chk}/{task}"


class Inputs:
    def __init__(self) -> None:
        self.pos = {TP0: 7}
        self.max_ts: dict[Any, int] = {}

    def restore(self, state: dict[str, Any]) -> None:
        pass

    def snapshot(self, checkpoint_id: int) -> dict[str, Any]:
        return {"barrier_seen": [TP0], "channel_wm": {TP0: 3}, "max_ts": {}, "recovering": {}}


def _coordinator(
    mode: str = "aligned",
) -> tuple[SubtaskCheckpoints, Writer, Store, list[str], list[Any]]:
    writer, store, faults, sent = Writer(), Store(), [], []
    env: Any = SimpleNamespace(
        plan=SimpleNamespace(job="j", flow=SimpleNamespace(steps={})),
        generation=2,
        mode=mode,
        fault=faults.append,
        stale_through=0,
        start_positions={},
        sink_generation=2,
        store=store,
        map_state={},
    )
    out = SimpleNamespace(control=sent.append)
    chain: Any = SimpleNamespace(
        committers=[("out", writer)],
        ops={},
        outputs=[out],
        dead=None,
        watermark=0,
        sinks=[SimpleNamespace(written=0)],
    )
    chain.flush = lambda: None
    checkpoints = SubtaskCheckpoints(env, "t.0", chain, is_source=False)
    checkpoints.restore(None, {TP0: None}, {"ch"}, Inputs())
    return checkpoints, writer, store, faults, sent


def test_a_snapshot_is_acked_only_when_its_alignment_is_done_when_uploaded_first() -> None:
    checkpoints, writer, store, faults, _sent = _coordinator(mode="sync")
    assert writer.recovered == [[]]  # a fresh start recovers the sinks with nothing
    checkpoints.snapshot(1, Inputs())
    assert faults == ["before-prepare"]
    assert store.written[1]["positions"] == {TP0: 7}
    assert store.written[1]["sinks"] == {"out": [(1, "epoch-1")]}
    assert checkpoints.ready_acks() == []  # uploaded, not aligned
    checkpoints.alignment_done(1)
    assert checkpoints.ready_acks() == [(1, "j/1/t.0")]
    assert checkpoints.ready_acks() == []  # once


def test_sinks_commit_only_the_epochs_up_to_the_completed_checkpoint_when_two_are_pending() -> None:
    checkpoints, writer, _store, faults, _sent = _coordinator(mode="sync")
    checkpoints.snapshot(1, Inputs())
    checkpoints.snapshot(2, Inputs())
    checkpoints.complete(1)
    assert writer.commits == [(1, "epoch-1")]
    assert faults[-1] == "after-completion-before-commit"
    checkpoints.complete(2)
    assert writer.commits == [(1, "epoch-1"), (2, "epoch-2")]


def test_a_forgotten_checkpoint_is_never_acked_when_its_alignment_completes_later() -> None:
    checkpoints, _writer, _store, _faults, _sent = _coordinator(mode="sync")
    checkpoints.snapshot(1, Inputs())
    checkpoints.forget(1)
    checkpoints.alignment_done(1)
    assert checkpoints.ready_acks() == []


def test_a_barrier_keeps_the_mode_its_first_copy_announced_when_forwarded() -> None:
    checkpoints, _writer, _store, _faults, sent = _coordinator()
    checkpoints.note_barrier(3, True)
    checkpoints.note_barrier(3, False)
    checkpoints.forward_barrier(3)
    assert sent == [Barrier(3, 2, True)]


def test_the_records_of_an_aborted_epoch_are_reported_with_the_next_checkpoint_once() -> None:
    """What the acks report for the committed-output figure (``committed=``): the records
    the sinks got per epoch; an aborted checkpoint's epoch commits with the next one, so it
    is reported again until a completion covers it, then never."""
    checkpoints, _writer, _store, _faults, _sent = _coordinator(mode="sync")
    sink = checkpoints.chain.sinks[0]
    sink.written = 5
    checkpoints.trigger(1, Inputs())
    assert checkpoints.sunk_through(1) == [[1, 5]]
    checkpoints.forget(1)  # aborted
    sink.written = 8
    checkpoints.trigger(2, Inputs())
    assert checkpoints.sunk_through(2) == [[1, 5], [2, 3]]
    checkpoints.complete(2)
    sink.written = 8  # nothing since
    checkpoints.trigger(3, Inputs())
    assert checkpoints.sunk_through(3) == []
