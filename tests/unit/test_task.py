"""The task runtime against an in-memory transport: alignment, stash order, recovery modes."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson
import pytest

from processor.compiler import compile_flow
from processor.contracts import SinkContext
from processor.dataflow import Dataflow
from processor.runtime.task import Task, TaskEnv
from processor.snapshot.store import SnapshotStore
from processor.wire import (
    Barrier,
    GenerationStart,
    Watermark,
    channel_key,
    decode_control,
    encode_control,
)

TOPIC = "eosflow.job.k.count"
P0, P2 = (TOPIC, 0), (TOPIC, 2)  # subtask 0's channels from upstream 0 and 1 (P = 2)


class Msg:
    def __init__(
        self, tp: tuple[str, int], offset: int, value: bytes, headers: Any, key: Any = None
    ) -> None:
        self._tp, self._offset, self._value, self._headers = tp, offset, value, headers
        self._key = key

    def topic(self) -> str:
        return self._tp[0]

    def partition(self) -> int:
        return self._tp[1]

    def offset(self) -> int:
        return self._offset

    def key(self) -> Any:
        return self._key

    def value(self) -> bytes:
        return self._value

    def headers(self) -> Any:
        return self._headers

    def timestamp(self) -> tuple[int, int]:
        return (1, 0)


class Log:
    """Partitions as lists; ``deliver`` says which partitions the next poll returns, in order.

    Records are keyed as a channel writer keys them: with the incarnation of the partition's
    last ``GenerationStart`` (``writer``), unless ``incarnation`` says otherwise (a zombie)."""

    def __init__(self) -> None:
        self.parts: dict[tuple[str, int], list[Msg]] = {}
        self.written: list[tuple[str, int, bytes, Any]] = []
        self.writer: dict[tuple[str, int], int] = {}

    def data(self, tp: tuple[str, int], key: str, ts: int = 0, incarnation: int = 0) -> None:
        self._append(tp, orjson.dumps([key, {"k": key}, ts]), None, incarnation)

    def ctl(self, tp: tuple[str, int], ctl: Any, incarnation: int = 0) -> None:
        if isinstance(ctl, GenerationStart) and not incarnation:
            self.writer[tp] = ctl.incarnation
        value, headers = encode_control(ctl)
        self._append(tp, value, headers, incarnation)

    def _append(
        self, tp: tuple[str, int], value: bytes, headers: Any, incarnation: int = 0
    ) -> None:
        part = self.parts.setdefault(tp, [])
        key = channel_key(incarnation or self.writer.get(tp, 1))
        part.append(Msg(tp, len(part), value, headers, key))


class Reader:
    def __init__(self, log: Log) -> None:
        self.log = log
        self.next: dict[tuple[str, int], int] = {}
        self.paused: set[tuple[str, int]] = set()
        self.stop_at: dict[tuple[str, int], int] = {}

    def open(
        self,
        positions: Mapping[tuple[str, int], int | None],
        *,
        start: str = "",
        stop_at: Mapping[tuple[str, int], int] | None = None,
    ) -> None:
        self.next = {tp: (o or 0) for tp, o in positions.items()}
        self.stop_at = dict(stop_at or {})

    def poll(self, max_records: int = 10_000, timeout: float = 0.0) -> list[Any]:
        out: list[Any] = []
        for tp in sorted(self.next):
            if tp in self.paused:
                continue
            part = self.log.parts.get(tp, [])
            end = min(len(part), self.stop_at.get(tp, len(part)))
            out += part[self.next[tp] : end]
            self.next[tp] = max(self.next[tp], end)
        return out

    def pause(self, tps: Iterable[tuple[str, int]]) -> None:
        self.paused |= set(tps)

    def resume(self, tps: Iterable[tuple[str, int]]) -> None:
        self.paused -= set(tps)

    def positions(self) -> dict[tuple[str, int], int]:
        return dict(self.next)

    def cached_lag(self) -> dict[tuple[str, int], int]:
        return {}

    def close(self) -> None:
        pass


class Writer:
    def __init__(self, log: Log) -> None:
        self.log = log

    def write(self, topic: str, partition: int, value: bytes, *, key: Any = None,
              headers: Any = None) -> None:  # fmt: skip
        self.log.written.append((topic, partition, value, headers))

    def poll(self) -> None:
        pass

    def flush(self, timeout: float = 30.0) -> None:
        pass

    def close(self) -> None:
        pass


class ListSink:
    committed: list[Any] = []

    def open(self, ctx: SinkContext) -> Any:
        return self

    def write(self, values: Sequence[Any]) -> None:
        self.epoch = [*getattr(self, "epoch", []), *values]

    def prepare(self, checkpoint_id: int) -> Any:
        epoch, self.epoch = getattr(self, "epoch", []), []
        return epoch or None

    def commit(self, checkpoint_id: int, committable: Any) -> None:
        ListSink.committed += committable

    def recover(self, pending: Sequence[tuple[int, Any]]) -> None:
        for chk, c in pending:
            self.commit(chk, c)

    def close(self) -> None:
        pass


def _env(tmp_path: Path, log: Log, plan: Any, reader: Reader | None = None, **kw: Any) -> TaskEnv:
    return TaskEnv(
        plan=plan,
        writer=Writer(log),
        reader_factory=lambda _group: reader or Reader(log),
        store=SnapshotStore(tmp_path.as_uri()),
        uploads=ThreadPoolExecutor(1),
        fault=lambda _point: None,
        **{"generation": 1, "mode": "aligned", "end_offsets": None, **kw},
    )


def _task(tmp_path: Path, log: Log, mode: str, generation: int = 1) -> Task:
    flow = Dataflow("job")
    (flow.source("s", "in").key_by("k", lambda v: v).count("count").sink("out", ListSink()))
    plan = compile_flow(flow, 2)
    env = _env(tmp_path, log, plan, generation=generation, mode=mode)
    ListSink.committed = []
    return Task(env, plan.stage_of("count"), 0)


def _acks(task: Task) -> list[int]:
    deadline = time.monotonic() + 5
    while task.checkpoints.uploading and time.monotonic() < deadline:
        time.sleep(0.01)
    return [chk for chk, _h in task.ready_acks()]


def _counts(task: Task) -> dict[str, int]:
    return dict(task.chain.ops["count"].snapshot())


def test_aligned_task_holds_back_records_after_a_barrier_until_every_channel_delivered_it(
    tmp_path: Path,
) -> None:
    log = Log()
    for tp in (P0, P2):
        log.ctl(tp, GenerationStart(1))
    log.data(P0, "a")
    log.ctl(P0, Barrier(1, 1))
    log.data(P0, "a")  # after the barrier: must wait for alignment
    log.data(P2, "b")
    task = _task(tmp_path, log, "aligned")
    task.open(None, {"in": 2})
    task.step(0.0, 100)
    assert _counts(task) == {"a": 1, "b": 1}
    assert task.inputs.blocked == {P0}
    assert _acks(task) == []
    log.ctl(P2, Barrier(1, 1))
    log.data(P2, "b")
    task.step(0.0, 100)
    assert _acks(task) == [1]
    snap = task.env.store.read_task_snapshot(str(tmp_path / "job/chk-0000000001/count.0.g1.snap"))
    assert snap["operators"]["count"] == {"a": 1, "b": 1}
    assert snap["positions"] == {P0: 3, P2: 3}
    assert snap["barrier_seen"] == [P0, P2]
    assert _counts(task) == {"a": 2, "b": 2}  # the stash was replayed after the snapshot


def test_unaligned_task_snapshots_at_the_first_barrier_and_never_pauses(tmp_path: Path) -> None:
    log = Log()
    for tp in (P0, P2):
        log.ctl(tp, GenerationStart(1))
    log.ctl(P0, Barrier(1, 1, unaligned=True))
    log.data(P0, "a")
    log.data(P2, "b")
    task = _task(tmp_path, log, "unaligned")
    task.open(None, {"in": 2})
    task.step(0.0, 100)
    assert not task.inputs.blocked and _counts(task) == {"a": 1, "b": 1}
    assert _acks(task) == []  # snapshot taken, but P2 has not delivered the barrier yet
    log.ctl(P2, Barrier(1, 1, unaligned=True))
    task.step(0.0, 100)
    assert _acks(task) == [1]
    snap = task.env.store.read_task_snapshot(str(tmp_path / "job/chk-0000000001/count.0.g1.snap"))
    assert snap["operators"]["count"] == {}
    assert snap["positions"] == {P0: 2, P2: 0}  # P2's marker and record are channel state
    assert snap["barrier_seen"] == [P0]


@pytest.mark.parametrize("seen", [[P0], [P0, P2]])
def test_restored_channels_replay_up_to_the_barrier_then_drop_until_the_new_generation(
    tmp_path: Path, seen: list[tuple[str, int]]
) -> None:
    log = Log()
    for tp in (P0, P2):
        log.ctl(tp, GenerationStart(1))
    log.data(P2, "b")  # offset 1: in flight when the unaligned snapshot was taken
    log.ctl(P2, Barrier(1, 1))
    log.data(P2, "b")  # old generation, after the barrier: regenerated by upstream, drop
    log.ctl(P2, GenerationStart(2))
    log.data(P2, "b")
    log.ctl(P0, Barrier(1, 1))
    log.data(P0, "a")  # old generation: drop
    log.ctl(P0, Barrier(2, 1))  # a checkpoint that never completed: ignored
    log.ctl(P0, GenerationStart(2))
    log.data(P0, "a")
    state = {
        "checkpoint": 1,
        "positions": {P0: 2, P2: 1 if seen == [P0] else 3},
        "barrier_seen": seen,
        "channel_wm": {P0: 5, P2: 5},
        "max_ts": {},
        "watermark": 5,
        "operators": {"count": {"a": 10, "b": 20}},
        "sinks": {"out": [(1, ["pending"])]},
    }
    task = _task(tmp_path, log, "unaligned", generation=2)
    task.open(state, {"in": 2})
    assert ListSink.committed == ["pending"]  # recover committed the restored epoch
    task.step(0.0, 100)
    replayed = 1 if seen == [P0] else 0
    assert _counts(task) == {"a": 11, "b": 21 + replayed}
    assert task.inputs.stale_dropped == 2
    assert not task.inputs.modes  # every channel is live again


def _state(checkpoint: int, positions: dict[Any, int], seen: list[Any]) -> dict[str, Any]:
    """A restored count task's snapshot with nothing counted yet."""
    return {
        "checkpoint": checkpoint,
        "positions": positions,
        "barrier_seen": seen,
        "channel_wm": {P0: 0, P2: 0},
        "max_ts": {},
        "watermark": 0,
        "operators": {"count": {}},
        "sinks": {},
    }


@pytest.mark.parametrize("p2_at_snapshot", ["dropping", "replaying"])
def test_an_unaligned_snapshot_of_a_recovering_channel_restores_its_remaining_phases_when_restored(
    tmp_path: Path, p2_at_snapshot: str
) -> None:
    """Regression (issue 19, unaligned crash loops): generation 2 restored checkpoint 1 while
    channel P2 still held generation 1 records; barrier 2 arrived on P0 first, so the unaligned
    snapshot 2 recorded P2's position inside them, without its mode. Restoring 2 in generation
    3 replayed P2 from there as in-flight state of checkpoint 2 and counted a dead
    generation's records (5 or 6 where 2 or 3 is right)."""
    log = Log()
    log.ctl(P0, GenerationStart(1))
    log.ctl(P0, Barrier(1, 1, unaligned=True))
    log.ctl(P0, GenerationStart(2))
    log.data(P0, "a")  # generation 2: in snapshot 2
    log.ctl(P0, Barrier(2, 2, unaligned=True))
    log.ctl(P2, GenerationStart(1))
    log.data(P2, "b")  # offset 1: generation 1, in flight at the unaligned checkpoint 1
    log.ctl(P2, Barrier(1, 1, unaligned=True))
    for _ in range(3):
        log.data(P2, "b")  # generation 1 after barrier 1: dead, regenerated by generation 2
    log.ctl(P2, GenerationStart(2))
    log.data(P2, "b")  # generation 2, in flight at the unaligned checkpoint 2
    log.ctl(P2, Barrier(2, 2, unaligned=True))
    log.data(P2, "b")  # generation 2 after barrier 2: dead, regenerated by generation 3
    # Checkpoint 1: P2 had delivered its barrier (dropping) or not yet (replaying offset 1).
    replaying = p2_at_snapshot == "replaying"
    chk1 = _state(1, {P0: 2, P2: 1 if replaying else 3}, [P0] if replaying else [P0, P2])
    gen2 = _task(tmp_path, log, "unaligned", generation=2)
    gen2.open(chk1, {"in": 2})
    gen2.step(0.0, 100)  # P0 first: barrier 2 there, snapshot 2, then P2 recovers
    assert _acks(gen2) == [2]
    chk2 = gen2.env.store.read_task_snapshot(str(tmp_path / "job/chk-0000000002/count.0.g2.snap"))
    assert chk2["positions"][P2] == chk1["positions"][P2]  # inside generation 1's records
    for tp in (P0, P2):  # generation 2 failed; generation 3 starts
        log.ctl(tp, GenerationStart(3))
        log.data(tp, "a" if tp == P0 else "b")
    gen3 = _task(tmp_path, log, "unaligned", generation=3)
    gen3.open(chk2, {"in": 2})
    gen3.step(0.0, 100)
    # a: generation 2's (in the snapshot) and 3's; b: generation 1's in flight at checkpoint 1
    # (only when replaying), generation 2's in flight at checkpoint 2, generation 3's.
    assert _counts(gen3) == {"a": 2, "b": 3 if replaying else 2}
    assert not gen3.inputs.modes and not gen3.inputs.phases


def test_watermark_is_the_minimum_over_channels_when_channels_disagree(tmp_path: Path) -> None:
    log = Log()
    for tp in (P0, P2):
        log.ctl(tp, GenerationStart(1))
    log.ctl(P0, Watermark(100))
    task = _task(tmp_path, log, "aligned")
    task.open(None, {"in": 2})
    task.step(0.0, 100)
    assert task.watermark < 0
    log.ctl(P2, Watermark(40))
    task.step(0.0, 100)
    assert task.watermark == 40


def test_zombie_generation_is_refused_when_a_newer_marker_arrives(tmp_path: Path) -> None:
    log = Log()
    log.ctl(P0, GenerationStart(3))
    task = _task(tmp_path, log, "aligned")
    task.open(None, {"in": 2})
    with pytest.raises(Exception, match="zombie"):
        task.step(0.0, 100)


def test_records_of_an_older_generation_are_dropped_when_a_zombie_writes_after_the_marker(
    tmp_path: Path,
) -> None:
    """Regression (issue 35, item 6): a frozen writer of generation 1 that woke up after
    generation 2's marker had its records (data, a watermark, a barrier, an end of stream)
    taken for generation 2's: counted twice, a watermark ahead of time, a barrier of another
    worker's checkpoint. They carry incarnation 1 now, below the channel's floor of 2."""
    log = Log()
    for tp in (P0, P2):
        log.ctl(tp, GenerationStart(1))
        log.data(tp, "old")  # generation 1, dropped until the marker by the recovery phases
        log.ctl(tp, GenerationStart(2))
        log.data(tp, "a")
    log.ctl(P0, Watermark(10_000))
    log.data(P2, "a", incarnation=1)  # the zombie's queued records land after the marker
    log.ctl(P2, Watermark(10_000), incarnation=1)
    log.ctl(P2, Barrier(2, 2), incarnation=1)
    log.data(P2, "a")
    task = _task(tmp_path, log, "aligned", generation=2)
    task.open(_state(1, {P0: 0, P2: 0}, [P0, P2]), {"in": 2})
    task.step(0.0, 100)
    assert _counts(task) == {"a": 3}
    assert task.inputs.fence.fenced == 3 and task.stats()["fenced"] == 3
    assert task.watermark == 0 and not task.inputs.blocked  # no zombie watermark, no barrier
    assert task.inputs.fence.floor == {P0: 2, P2: 2}


def test_records_of_a_worker_restarted_alone_fence_its_old_incarnation_when_it_wakes_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Local recovery keeps the job's generation: upstream 1 restarted alone writes
    ``GenerationStart(1, 5)`` (its fresh incarnation); its old incarnation, frozen instead of
    dead, must not be read after that, even by a task restored from a later snapshot."""
    log = Log()
    for tp in (P0, P2):
        log.ctl(tp, GenerationStart(1))
    _with_id(log, P2, "b", 1)  # the old incarnation, before it froze: live
    log.ctl(P2, GenerationStart(1, 5))  # restarted alone
    _with_id(log, P2, "b", 2)
    _with_id(log, P2, "b", 3, incarnation=1)  # the old incarnation wakes up: fenced
    log.ctl(P2, Watermark(10_000), incarnation=1)
    _with_id(log, P2, "b", 4)
    survivor = _local_task(tmp_path, log, monkeypatch)
    survivor.open(None, {"in": 2})
    survivor.step(0.0, 100)
    assert _counts(survivor) == {"b": 3}
    assert survivor.inputs.fence.fenced == 2 and survivor.watermark < 0
    # Restored alone from a snapshot taken after the marker: the floor comes with it.
    state = {**_state(1, {P0: 1, P2: 4}, [P0, P2]), "generation": 1, "floors": {P2: 5}}
    state["operators"] = {"count": {"b": 2}}
    alone = _local_task(tmp_path, log, monkeypatch)
    alone.open(state, {"in": 2})
    alone.step(0.0, 100)
    assert _counts(alone) == {"b": 3} and alone.inputs.fence.fenced == 2


def test_in_flight_records_of_the_old_generation_are_replayed_when_restored_unaligned(
    tmp_path: Path,
) -> None:
    """The fence never drops channel state: the unaligned snapshot's in-flight records were
    written by the failed generation, at the floor the snapshot recorded; a zombie's record
    among them (below that floor) is still dropped."""
    log = Log()
    log.ctl(P0, GenerationStart(2))
    log.ctl(P0, Barrier(3, 2, unaligned=True))
    log.ctl(P0, GenerationStart(3))
    log.ctl(P2, GenerationStart(2))
    log.data(P2, "b")  # offset 1: in flight at checkpoint 3, generation 2's: replayed
    log.data(P2, "b", incarnation=1)  # a generation 1 zombie woke up: fenced here too
    log.ctl(P2, Barrier(3, 2, unaligned=True))
    log.data(P2, "b")  # generation 2 after the barrier: dropped by its phase
    log.ctl(P2, GenerationStart(3))
    log.data(P2, "b")
    state = {**_state(3, {P0: 2, P2: 1}, [P0]), "floors": {P0: 2, P2: 2}}
    task = _task(tmp_path, log, "unaligned", generation=3)
    task.open(state, {"in": 2})
    task.step(0.0, 100)
    assert _counts(task) == {"b": 2}
    assert task.inputs.fence.fenced == 1 and task.inputs.stale_dropped == 1
    assert not task.inputs.modes and task.inputs.fence.floor == {P0: 3, P2: 3}


def test_an_aligned_barrier_is_aligned_when_the_task_runs_unaligned(tmp_path: Path) -> None:
    """Regression: the final checkpoint of a bounded run was unaligned in unaligned mode, so the
    records in flight behind its barrier fell into an epoch that never committed (bench runs
    left up to 127,765 of 150,000 lines uncommitted). A final barrier is aligned now."""
    log = Log()
    for tp in (P0, P2):
        log.ctl(tp, GenerationStart(1))
    log.data(P0, "a")
    log.ctl(P0, Barrier(1, 1, unaligned=False))
    log.data(P0, "a")
    log.data(P2, "b")
    task = _task(tmp_path, log, "unaligned")
    task.open(None, {"in": 2})
    task.step(0.0, 100)
    assert task.inputs.blocked == {P0} and _acks(task) == []
    log.ctl(P2, Barrier(1, 1, unaligned=False))
    task.step(0.0, 100)
    assert _acks(task) == [1]
    snap = task.env.store.read_task_snapshot(str(tmp_path / "job/chk-0000000001/count.0.g1.snap"))
    assert snap["operators"]["count"] == {"a": 1, "b": 1}


def test_source_writes_an_aligned_barrier_when_the_trigger_asks_for_one(tmp_path: Path) -> None:
    log = Log()
    task = _task(tmp_path, log, "unaligned")
    source = Task(task.env, task.plan.stage_of("s"), 0)
    source.open(None, {"in": 2})
    source.trigger(1, aligned=True)
    source.trigger(2)
    barriers = [decode_control(h) for _t, _p, _v, h in log.written if h is not None]
    flags = {(b.checkpoint_id, b.unaligned) for b in barriers if isinstance(b, Barrier)}
    assert flags == {(1, False), (2, True)}


# -- local recovery -----------------------------------------------------------------------------


def _local_task(
    tmp_path: Path, log: Log, monkeypatch: pytest.MonkeyPatch, *, stale_through: int = 0
) -> Task:
    """The count task of :func:`_task` under ``--recovery local``, with an in-memory ID store."""
    import processor.runtime.operators.dedup_step as dedup_step
    from dedup.core import MemoryIdStore

    class NoClient:
        def close(self) -> None:
            pass

    monkeypatch.setattr(dedup_step, "redis_client", lambda _url: NoClient())
    monkeypatch.setattr(
        dedup_step, "InheritingIdStore", lambda _client, _prefix, **_kw: MemoryIdStore()
    )
    flow = Dataflow("job")
    (flow.source("s", "in").key_by("k", lambda v: v).count("count").sink("out", ListSink()))
    plan = compile_flow(flow, 2, combine=False)
    env = _env(tmp_path, log, plan, recovery="local", stale_through=stale_through)
    ListSink.committed = []
    return Task(env, plan.stage_of("count"), 0)


def _with_id(log: Log, tp: tuple[str, int], key: str, record_id: int, incarnation: int = 0) -> None:
    log._append(tp, orjson.dumps([key, {"k": key}, 0, f"{record_id:x}"]), None, incarnation)


def test_restarted_alone_it_processes_live_records_after_the_barrier_and_drops_copies_by_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = Log()
    for tp in (P0, P2):
        log.ctl(tp, GenerationStart(1))
    _with_id(log, P0, "a", 1)
    log.ctl(P0, Barrier(1, 1))
    log.ctl(P2, Barrier(1, 1))
    _with_id(log, P0, "a", 2)  # after the barrier, same generation: live (not dropped)
    _with_id(log, P2, "b", 3)
    log.ctl(P0, Barrier(2, 1))  # triggered before the restart (aborted): stale here
    log.ctl(P2, GenerationStart(1))  # upstream 1 restarted alone too: re-emits from checkpoint 1
    _with_id(log, P2, "b", 3)  # a copy: dropped
    _with_id(log, P2, "b", 4)
    state = {
        "checkpoint": 1,
        "generation": 1,
        "positions": {P0: 3, P2: 2},
        "barrier_seen": [P0, P2],
        "channel_wm": {},
        "max_ts": {},
        "watermark": 0,
        "operators": {"count": {"a": 1}},
        "sinks": {},
    }
    task = _local_task(tmp_path, log, monkeypatch, stale_through=2)
    task.open(state, {"in": 2})
    assert not task.inputs.modes  # nothing dropped by generation: copies go by ID
    task.step(0.0, 100)
    assert _counts(task) == {"a": 2, "b": 2}
    assert task.stats()["replayed"] == 1
    assert (
        task.inputs.aligner is not None and task.inputs.aligner.pending_checkpoint is None
    )  # 2 is stale
    log.ctl(P0, Barrier(3, 1))
    log.ctl(P2, Barrier(3, 1))
    task.step(0.0, 100)
    assert _acks(task) == [3]
    task.close()


def test_channel_record_ids_follow_ancestry_not_the_order_records_arrive_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two runs see the same source records in opposite partition order: every output record
    gets the same ID in both, and two equal outputs of one input get different IDs."""

    def run(reverse: bool) -> dict[int, bytes]:
        log = Log()
        for p in range(4):
            for i in range(3):
                log._append(("in", p), orjson.dumps(f"v{p}{i}"), None)
        flow = Dataflow("job")
        (
            flow.source("s", "in")
            .flat_map("twice", lambda v: [v.decode(), v.decode()])
            .key_by("k", lambda v: v)
            .count("count")
            .sink("out", ListSink())
        )
        plan = compile_flow(flow, 2, combine=False)
        reader = Reader(log)
        if reverse:
            reader.log.parts = dict(reversed(list(log.parts.items())))
            original = reader.poll

            def poll(max_records: int = 10_000, timeout: float = 0.0) -> list[Any]:
                return list(reversed(original(max_records, timeout)))

            reader.poll = poll  # type: ignore[method-assign]
        env = _env(tmp_path, log, plan, reader, recovery="local")
        task = Task(env, plan.stage_of("s"), 0)
        task.open(None, {"in": 4})
        task.step(0.0, 100)
        out: dict[int, bytes] = {}
        for _topic, _p, value, headers in log.written:
            if headers is None:
                k, v, _t, rid = orjson.loads(value)
                assert int(rid, 16) not in out, "two outputs share an ID"
                out[int(rid, 16)] = orjson.dumps([k, v])
        return out

    forward, backward = run(False), run(True)
    assert len(forward) == 12  # 6 inputs (subtask 0 reads partitions 0 and 2), 2 outputs each
    assert forward == backward


# -- loops (docs/iterations.md) ---------------------------------------------------------------


def _loop_head(tmp_path: Path, log: Log, generation: int = 1) -> tuple[Task, Any, Any]:
    """Subtask 0 of the head of ``source -> iterate(key_by -> count)``: its regular input and
    back-edge partitions."""
    flow = Dataflow("job")

    def body(loop: Any) -> Any:
        counts = loop.key_by("k", lambda v: v["k"]).count("count")
        return counts.filter("again", lambda n: n < 3), counts

    flow.source("s", "in").iterate("loop", body, max_iterations=2).sink("out", ListSink())
    plan = compile_flow(flow, 2)
    stage = plan.stage_of("loop")
    (regular,) = [(e.topic, 0) for e in stage.inputs if not e.back]
    (back,) = [(e.topic, 0) for e in stage.inputs if e.back]
    ListSink.committed = []
    env = _env(tmp_path, log, plan, generation=generation)
    return Task(env, stage, 0), regular, back


def _fed_back(log: Log, tp: tuple[str, int], key: str, iteration: int) -> None:
    log._append(tp, orjson.dumps([key, {"k": key}, 0, iteration]), None)


def _written_iterations(log: Log) -> list[tuple[str, int]]:
    """(key, iteration) of the data records the head wrote into the loop."""
    out = []
    for _topic, _p, value, headers in log.written:
        if headers is None:
            k, _v, _t, it = orjson.loads(value)
            out.append((k, it))
    return out


def test_loop_head_snapshots_on_regular_barriers_and_acks_when_the_barrier_comes_around(
    tmp_path: Path,
) -> None:
    log = Log()
    task, regular, back = _loop_head(tmp_path, log)
    for tp in (regular, back):
        log.ctl(tp, GenerationStart(1))
    log.data(regular, "a")
    log.ctl(regular, Barrier(1, 1))
    log.data(regular, "b")  # after the barrier: not paused, the head is not aligning any more
    task.open(None, {"in": 2})
    task.step(0.0, 100)
    assert (
        not task.inputs.blocked and _acks(task) == []
    )  # snapshot taken, barrier still going around
    _fed_back(log, back, "a", 0)  # the back-edge log of checkpoint 1: three records
    log.ctl(back, Barrier(0, 1))  # late, of an aborted checkpoint: the log goes on
    _fed_back(log, back, "a", 1)
    _fed_back(log, back, "z", 2)  # over max_iterations=2 once the head adds one: dropped
    task.step(0.0, 100)
    assert _acks(task) == []
    log.ctl(back, Barrier(1, 1))
    _fed_back(log, back, "b", 0)  # after the barrier: not in the log
    task.step(0.0, 100)
    assert _acks(task) == [1]
    assert task.loop_log.pop(1) == 3  # what the worker sends with the ack
    assert task.inputs.loop_exhausted == 1
    snap = task.env.store.read_task_snapshot(str(tmp_path / "job/chk-0000000001/loop.0.g1.snap"))
    assert snap["positions"] == {regular: 3, back: 1}  # the back-edge log starts at offset 1
    assert snap["barrier_seen"] == [regular]
    assert _written_iterations(log) == [("a", 0), ("b", 0), ("a", 1), ("a", 2), ("b", 1)]


def test_restored_loop_head_replays_the_back_edge_log_before_reading_its_input(
    tmp_path: Path,
) -> None:
    log = Log()
    task, regular, back = _loop_head(tmp_path, log, generation=2)
    log.ctl(back, GenerationStart(1))
    _fed_back(log, back, "x", 0)  # offset 1, 2: the log of checkpoint 1
    _fed_back(log, back, "y", 1)
    log.ctl(back, Barrier(1, 1))
    _fed_back(log, back, "stale", 0)  # the failed generation's, after the barrier: dropped
    log.ctl(regular, GenerationStart(1))
    log.ctl(regular, Barrier(1, 1))
    log.ctl(regular, GenerationStart(2))
    log.data(regular, "new")
    log.ctl(regular, Barrier(2, 2))
    state = {
        "checkpoint": 1,
        "generation": 1,
        "positions": {regular: 2, back: 1},
        "barrier_seen": [regular],
        "channel_wm": {regular: 0},
        "max_ts": {},
        "watermark": 0,
        "operators": {},
        "sinks": {"out": []},
    }
    task.open(state, {"in": 2})
    assert task.inputs.replaying == {back} and regular in task.reader.paused
    task.step(0.0, 100)
    assert _written_iterations(log) == [("x", 1), ("y", 2)]  # the log only
    # Still dropping the failed generation's records: a snapshot now would record a back-edge
    # position among them, and a restore from it would replay them. The input stays held.
    assert task.inputs.replaying == {back} and regular in task.reader.paused
    log.ctl(back, GenerationStart(2))
    task.step(0.0, 100)
    assert not task.inputs.replaying and regular not in task.reader.paused
    assert _written_iterations(log) == [("x", 1), ("y", 2), ("new", 0)]  # the log first
    assert task.inputs.log_replayed == 2 and task.inputs.stale_dropped == 1
    assert _acks(task) == []  # checkpoint 2: snapshot taken once the back-edge was live
    snap = task.env.store.read_task_snapshot(str(tmp_path / "job/chk-0000000002/loop.0.g2.snap"))
    assert snap["positions"][back] == 6  # after this generation's marker
