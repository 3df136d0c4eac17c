"""The checkpoints of a task: trigger (sources), snapshot, restore, barrier forwarding, acks and
completion (the task's ``SubtaskCheckpointCoordinator``, in Flink's words).

The snapshot is a cheap copy taken in the task loop (positions, watermarks, operator state, the
sinks' committables); serialization and upload run on the worker's upload pool, and the ack is
sent once both the upload and the alignment are done (:meth:`SubtaskCheckpoints.ready_acks`).
Sinks ``prepare`` at the barrier and ``commit`` on the completion notice (docs/sinks.md, "The
two-phase contract"). Restoring is the mirror image (:meth:`SubtaskCheckpoints.restore`).

The coordinator works on the task's :class:`~.chain.OperatorChain` (flush, prepare, snapshot,
restore and commit its operators and writers) and on the inputs it is given at each call (an
:class:`InputState`: their positions and their part of the snapshot); it never reads records.

Invariants:
    A checkpoint is acked once, only when its snapshot is uploaded and its alignment is done;
    a sink commits an epoch only after the completion notice of a checkpoint at or after it.
    Checkpoints up to :meth:`SubtaskCheckpoints.stale` are ignored (restored, or triggered
    before this task restarted alone).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Any, Protocol

from processor.runtime.operators.core import MAX_WATERMARK
from processor.runtime.operators.state_map import restore_sources, state_kind
from processor.runtime.task.chain import TP, OperatorChain
from processor.runtime.task.channels import TaskEnv
from processor.runtime.task.purge import PurgeFloor
from processor.runtime.waits import waiting
from processor.snapshot.store import SnapshotHandle
from processor.wire import (
    Barrier,
)

log = logging.getLogger(__name__)

_MAX_UPLOAD_FAILURES = 3


class InputState(Protocol):
    """What the checkpoint coordinator needs of a task's inputs (source or channel)."""

    #: the offset after the last record of each input partition that went through the chain
    pos: dict[TP, int]
    #: event-time progress of each source partition (source inputs)
    max_ts: dict[TP, int]

    def restore(self, state: dict[str, Any]) -> None:
        """Takes the inputs' part of a restored snapshot (watermarks per input)."""

    def snapshot(self, checkpoint_id: int) -> dict[str, Any]:
        """The inputs' part of the snapshot of ``checkpoint_id``: ``barrier_seen``,
        ``channel_wm``, ``max_ts`` and ``recovering``."""


class SubtaskCheckpoints:
    """Snapshot, restore, barrier forwarding, acks and completion of one task.

    Owns: the id of the restored checkpoint, the mode of each checkpoint's barrier, the
    snapshots being uploaded and uploaded, the checkpoints aligned, the sinks' pending
    committables, what to decline, the commit durations, the drained positions of a source
    task's snapshots, the purge floor, and :attr:`halted` (sync mode).
    """

    #: the channel positions of this task's snapshots: what its worker may purge
    #: (:mod:`processor.runtime.task.purge`)
    purge_floor: PurgeFloor

    def __init__(self, env: TaskEnv, name: str, chain: OperatorChain, *, is_source: bool) -> None:
        self.env = env
        self.plan = env.plan
        self.name = name
        self.generation = env.generation
        self.chain = chain
        self.is_source = is_source
        self.restored_id = 0
        #: Checkpoint -> this source task's positions, when its snapshot had the drained
        #: (maximum) watermark: recorded in the manifest (runtime.checkpoints.drain).
        self.drained_at: dict[int, list[list[Any]]] = {}
        #: Checkpoint -> this source task's source positions (``[[topic, partition, offset]]``),
        #: sent with its ack: the runner commits them to the job's consumer group when the
        #: checkpoint completes (runtime.identity).
        self.sources_at: dict[int, list[list[Any]]] = {}
        self._channels: set[str] = set()
        self.barrier_unaligned: dict[int, bool] = {}  # the mode each checkpoint runs in
        # snapshot bookkeeping: checkpoint id -> future / handle / alignment done
        self.uploading: dict[int, Future[SnapshotHandle]] = {}
        self.uploaded: dict[int, SnapshotHandle] = {}
        self.aligned: set[int] = set()
        # metrics: the sinks' commit durations since the last stats message
        self.commit_times: list[list[Any]] = []
        self.declined: list[tuple[int, str]] = []  # (checkpoint, reason) for the coordinator
        self._upload_failures = 0  # in a row
        self.sink_pending: dict[str, list[tuple[int, Any]]] = {n: [] for n, _w in chain.committers}
        #: records handed to the sinks in each epoch not known committed yet (checkpoint id ->
        #: records since the previous snapshot): sent with the acks, the coordinator adds up
        #: the committed output (``committed`` on the progress line) once per epoch
        self.epoch_sunk: dict[int, int] = {}
        self._sunk_at_snapshot = 0
        self.halted = False  # sync mode: a source stops between trigger and completion

    def restore(
        self,
        state: dict[str, Any] | None,
        positions: dict[TP, int | None],
        channels: set[str],
        inputs: InputState,
    ) -> set[TP]:
        """Loads ``state`` (``None``: a fresh start) and recovers the sinks from the
        committables it holds; fills ``positions`` with the restored offsets of this task's
        inputs (``channels``: the channel topics among them) and returns the inputs whose
        barrier the snapshot had seen."""
        chain = self.chain
        self._channels = set(channels)
        self.purge_floor = PurgeFloor(tp for tp in positions if tp[0] in channels)
        if state is None:
            for tp, offset in self.env.start_positions.items():
                if tp in positions:
                    positions[tp] = offset
            for _name, writer in chain.committers:
                writer.recover([])
            return set()
        self.restored_id = state["checkpoint"]
        for tp, offset in state["positions"].items():
            if tp in positions:
                positions[tp] = offset
        # By step name; a step whose state is not restored here (renamed, removed, moved to
        # another stage) was refused, or allowed, by the runner before any worker started
        # (runtime.operators.state_map.check_state); --map-state OLD=NEW gives NEW the state of OLD.
        operators = state["operators"]
        for target, source in restore_sources(operators, self.env.map_state).items():
            if target in chain.ops:
                chain.ops[target].restore(operators[source])
        inputs.restore(state)
        chain.watermark = state["watermark"]
        for name, writer in chain.committers:
            writer.recover(list(state["sinks"].get(name, [])))
        self.purge_floor.record(self.restored_id, positions)
        return set(state["barrier_seen"])

    def stale(self) -> int:
        """Checkpoints up to this id are over for this task (restored, or triggered before it
        was restarted alone): their barriers and triggers are ignored."""
        return max(self.restored_id, self.env.stale_through)

    # -- checkpoints -----------------------------------------------------------------------------

    def trigger(self, checkpoint_id: int, inputs: InputState, *, aligned: bool = False) -> None:
        """Source tasks: the coordinator started ``checkpoint_id`` (``aligned``: even in
        unaligned mode, as the final checkpoint of a run must be)."""
        if checkpoint_id <= self.stale():
            return
        self.barrier_unaligned[checkpoint_id] = self.env.mode == "unaligned" and not aligned
        self.snapshot(checkpoint_id, inputs)
        self.forward_barrier(checkpoint_id)
        self.aligned.add(checkpoint_id)
        if self.env.mode == "sync":
            self.halted = True

    def note_barrier(self, checkpoint_id: int, unaligned: bool) -> None:
        """A barrier of ``checkpoint_id`` came in: the first one sets the checkpoint's mode."""
        self.barrier_unaligned.setdefault(checkpoint_id, unaligned)

    def forward_barrier(self, checkpoint_id: int) -> None:
        unaligned = self.barrier_unaligned.pop(checkpoint_id, self.env.mode == "unaligned")
        for old in [c for c in self.barrier_unaligned if c < checkpoint_id]:
            del self.barrier_unaligned[old]
        barrier = Barrier(checkpoint_id, self.generation, unaligned)
        for out in self.chain.outputs:
            out.control(barrier)

    def snapshot(self, checkpoint_id: int, inputs: InputState) -> None:
        chain = self.chain
        chain.flush()  # partial aggregates belong to the epoch that ends here
        if chain.dead is not None:
            chain.dead.flush()  # so do dead letters (the combiner flush may add some)
        if chain.committers:
            self.env.fault("before-prepare")
        for name, writer in chain.committers:
            with waiting(f"sink {name!r} (its prepare of checkpoint {checkpoint_id})"):
                committable = writer.prepare(checkpoint_id)
            if committable is not None:
                self.sink_pending[name].append((checkpoint_id, committable))
        # dedup: IDs into the store before the snapshot counts (a write behind is waited
        # for by the upload below, so the task goes on meanwhile)
        behind = [w for op in chain.ops.values() if (w := op.prepare(checkpoint_id)) is not None]
        sunk = sum(s.written for s in chain.sinks)
        self.epoch_sunk[checkpoint_id] = sunk - self._sunk_at_snapshot
        self._sunk_at_snapshot = sunk
        part = inputs.snapshot(checkpoint_id)
        steps = self.plan.flow.steps
        pos = inputs.pos
        state = {
            "task": self.name,
            "checkpoint": checkpoint_id,
            "generation": self.generation,
            "positions": dict(pos),
            "barrier_seen": part["barrier_seen"],
            "channel_wm": part["channel_wm"],
            "max_ts": part["max_ts"],
            "watermark": chain.watermark,
            "operators": {n: op.snapshot() for n, op in chain.ops.items() if op.stateful},
            # What kind of state each holds: a restore refuses another kind under the name.
            "kinds": {n: k for n in chain.ops if n in steps and (k := state_kind(steps[n]))},
            "sinks": {n: list(p) for n, p in self.sink_pending.items()},
            # Channels still recovering (an unaligned snapshot taken before they were live): a
            # restore must go through their remaining phases from the recorded position, or
            # it would replay a dead generation's records (docs/checkpointing.md).
            "recovering": part["recovering"],
        }
        self.purge_floor.record(checkpoint_id, pos)
        if self.is_source:
            channels = self._channels
            self.sources_at[checkpoint_id] = [
                [t, p, o] for (t, p), o in pos.items() if t not in channels
            ]
        if self.is_source and chain.watermark == MAX_WATERMARK:
            max_ts = inputs.max_ts
            self.drained_at[checkpoint_id] = [
                [t, p, pos[(t, p)]] for t, p in pos if (t, p) in max_ts
            ]
        env = self.env
        incarnation = env.sink_generation  # the generation, or this start under local recovery

        def upload() -> SnapshotHandle:
            for write in behind:  # the snapshot relies on them: it counts after them
                with waiting(f"the writes behind of checkpoint {checkpoint_id}"):
                    write.result()
            return env.store.write_task_snapshot(
                self.plan.job, checkpoint_id, self.name, state, incarnation=incarnation
            )

        if env.mode == "sync":  # stop-the-world: serialize and upload in the task loop
            future: Future[SnapshotHandle] = Future()
            future.set_result(upload())
        else:
            future = env.uploads.submit(upload)
        self.uploading[checkpoint_id] = future

    def alignment_done(self, checkpoint_id: int) -> None:
        """Every input delivered the barrier of ``checkpoint_id``: acked once uploaded."""
        self.aligned.add(checkpoint_id)

    def forget(self, checkpoint_id: int) -> None:
        """``checkpoint_id`` was aborted: its upload, handle and alignment are dropped."""
        self.uploading.pop(checkpoint_id, None)
        self.uploaded.pop(checkpoint_id, None)
        self.drained_at.pop(checkpoint_id, None)
        self.sources_at.pop(checkpoint_id, None)
        self.aligned.discard(checkpoint_id)

    def upload_done(self) -> bool:
        """A snapshot upload finished: its ack (or decline) is due (:meth:`ready_acks`)."""
        return any(future.done() for future in self.uploading.values())

    def ready_acks(self) -> list[tuple[int, SnapshotHandle]]:
        """Checkpoints whose snapshot is uploaded and whose alignment is done (ack them now).

        A failed upload is declined (:attr:`declined`), not fatal: the coordinator may have
        aborted that checkpoint and deleted its directory while the upload ran (a timeout, or
        another worker restarting alone); if it had not, declining aborts it, and the next
        checkpoint tries again."""
        for chk, future in list(self.uploading.items()):
            if future.done():
                del self.uploading[chk]
                try:
                    self.uploaded[chk] = future.result()
                    self._upload_failures = 0
                except Exception as exc:
                    self._upload_failures += 1
                    if self._upload_failures >= _MAX_UPLOAD_FAILURES:
                        raise  # not a race with an abort: the store is failing
                    log.warning(
                        "snapshot upload failed task=%s checkpoint_id=%d: %s: %s (declined)",
                        self.name, chk, type(exc).__name__, exc,
                    )  # fmt: skip
                    self.declined.append((chk, f"snapshot upload failed: {exc}"))
                    self.aligned.discard(chk)
        ready = []
        for chk in sorted(self.uploaded):
            if chk in self.aligned:
                ready.append((chk, self.uploaded.pop(chk)))
                self.aligned.discard(chk)
        return ready

    def complete(self, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id`` completed: commit the sinks' epochs up to it."""
        self.halted = False
        chain = self.chain
        for name, writer in chain.committers:
            pending = self.sink_pending[name]
            due = [(c, x) for c, x in pending if c <= checkpoint_id]
            if due:
                self.env.fault("after-completion-before-commit")
            for chk, committable in due:
                began = time.monotonic()
                with waiting(f"sink {name!r} (its commit of checkpoint {chk})"):
                    writer.commit(chk, committable)
                self.commit_times.append([name, round(time.monotonic() - began, 6)])
            self.sink_pending[name] = [(c, x) for c, x in pending if c > checkpoint_id]
        for op in chain.ops.values():
            op.commit(checkpoint_id)
        for chk in [c for c in self.uploaded if c <= checkpoint_id]:
            del self.uploaded[chk]
        for chk in [c for c in self.epoch_sunk if c <= checkpoint_id]:
            del self.epoch_sunk[chk]

    def sunk_through(self, checkpoint_id: int) -> list[list[int]]:
        """``[[checkpoint, records]]`` handed to the sinks in the epochs up to
        ``checkpoint_id`` not known committed (an aborted checkpoint's epoch commits with
        the next one): what the ack of ``checkpoint_id`` reports."""
        return [[c, n] for c, n in sorted(self.epoch_sunk.items()) if c <= checkpoint_id and n]

    def take_commit_times(self) -> list[list[Any]]:
        """The sinks' commit durations since the last call (metrics)."""
        commits, self.commit_times = self.commit_times, []
        return commits
