"""Checkpoints of a task: trigger (sources), snapshot, barrier forwarding, acks, completion.

The snapshot is a cheap copy taken in the task loop (positions, watermarks, operator state, the
sinks' committables); serialization and upload run on the worker's upload pool, and the ack is
sent once both the upload and the alignment are done (:meth:`TaskCheckpoints.ready_acks`). Sinks
``prepare`` at the barrier and ``commit`` on the completion notice (DESIGN.md, "Sinks: two-phase
commit"). Restoring is the mirror image (:meth:`TaskCheckpoints._restore`).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Any

from processor.runtime.operators import MAX_WATERMARK
from processor.runtime.purge import PurgeFloor
from processor.runtime.state_map import restore_sources, state_kind
from processor.runtime.task.base import TP, TaskBase
from processor.snapshot.store import SnapshotHandle
from processor.wire import (
    Barrier,
)

log = logging.getLogger(__name__)

_MAX_UPLOAD_FAILURES = 3


class TaskCheckpoints(TaskBase):
    """Snapshot, restore, barrier forwarding, acks and completion of a task."""

    #: the channel positions of this task's snapshots: what its worker may purge
    #: (:mod:`processor.runtime.purge`)
    purge_floor: PurgeFloor

    def _restore(self, state: dict[str, Any] | None, positions: dict[TP, int | None]) -> set[TP]:
        """Loads ``state`` (``None``: a fresh start) and recovers the sinks from the
        committables it holds; fills ``positions`` with the restored offsets of this task's
        inputs and returns the inputs whose barrier the snapshot had seen."""
        channels = {e.topic for e in self.stage.inputs}
        self.purge_floor = PurgeFloor(tp for tp in positions if tp[0] in channels)
        if state is None:
            for tp, offset in self.env.start_positions.items():
                if tp in positions:
                    positions[tp] = offset
            for _name, writer in self.committers:
                writer.recover([])
            return set()
        self.restored_id = state["checkpoint"]
        for tp, offset in state["positions"].items():
            if tp in positions:
                positions[tp] = offset
        # By step name; a step whose state is not restored here (renamed, removed, moved to
        # another stage) was refused, or allowed, by the runner before any worker started
        # (runtime.state_map.check_state); --map-state OLD=NEW gives NEW the state of OLD.
        operators = state["operators"]
        for target, source in restore_sources(operators, self.env.map_state).items():
            if target in self.ops:
                self.ops[target].restore(operators[source])
        self.channel_wm = dict(state["channel_wm"])
        self.max_ts = dict(state["max_ts"])
        self.watermark = state["watermark"]
        for name, writer in self.committers:
            writer.recover(list(state["sinks"].get(name, [])))
        self.purge_floor.record(self.restored_id, positions)
        return set(state["barrier_seen"])

    # -- checkpoints -----------------------------------------------------------------------------

    def trigger(self, checkpoint_id: int, *, aligned: bool = False) -> None:
        """Source tasks: the coordinator started ``checkpoint_id`` (``aligned``: even in
        unaligned mode, as the final checkpoint of a run must be)."""
        if checkpoint_id <= self._stale():
            return
        self.barrier_unaligned[checkpoint_id] = self.env.mode == "unaligned" and not aligned
        self._snapshot(checkpoint_id)
        self._forward_barrier(checkpoint_id)
        self.aligned.add(checkpoint_id)
        if self.env.mode == "sync":
            self.halted = True

    def _forward_barrier(self, checkpoint_id: int) -> None:
        unaligned = self.barrier_unaligned.pop(checkpoint_id, self.env.mode == "unaligned")
        for old in [c for c in self.barrier_unaligned if c < checkpoint_id]:
            del self.barrier_unaligned[old]
        barrier = Barrier(checkpoint_id, self.generation, unaligned)
        for out in self.outputs:
            out.control(barrier)

    def _snapshot(self, checkpoint_id: int) -> None:
        self._flush()  # partial aggregates belong to the epoch that ends here
        if self.dead is not None:
            self.dead.flush()  # so do dead letters (the combiner flush may add some)
        if self.committers:
            self.env.fault("before-prepare")
        for name, writer in self.committers:
            committable = writer.prepare(checkpoint_id)
            if committable is not None:
                self.sink_pending[name].append((checkpoint_id, committable))
        for op in self.ops.values():
            op.prepare(checkpoint_id)  # dedup: IDs into the store before the snapshot
        seen = self.barrier_seen.pop(checkpoint_id, set())
        for old in [c for c in self.barrier_seen if c < checkpoint_id]:
            del self.barrier_seen[old]
        if self.back:  # Algorithm 2: log the back-edges until the barrier comes around
            self.back_logging.clear()
            self.back_logging |= self.back - seen
            self.logging_id = checkpoint_id
            self.loop_log[checkpoint_id] = 0
        if self.modes:
            log.info(
                "snapshot with recovering channels task=%s checkpoint_id=%d channels=%d",
                self.name, checkpoint_id, len(self.modes),
            )  # fmt: skip
        steps = self.plan.flow.steps
        state = {
            "task": self.name,
            "checkpoint": checkpoint_id,
            "generation": self.generation,
            "positions": dict(self.pos),
            "barrier_seen": sorted(seen),
            "channel_wm": dict(self.channel_wm),
            "max_ts": dict(self.max_ts),
            "watermark": self.watermark,
            "operators": {n: op.snapshot() for n, op in self.ops.items() if op.stateful},
            # What kind of state each holds: a restore refuses another kind under the name.
            "kinds": {n: k for n in self.ops if n in steps and (k := state_kind(steps[n]))},
            "sinks": {n: list(p) for n, p in self.sink_pending.items()},
            # Channels still recovering (an unaligned snapshot taken before they were live): a
            # restore must go through their remaining phases from the recorded position, or
            # it would replay a dead generation's records (docs/checkpointing.md).
            "recovering": {tp: [list(ph) for ph in self.phases[tp]] for tp in self.modes},
        }
        self.purge_floor.record(checkpoint_id, self.pos)
        if self.is_source and self.watermark == MAX_WATERMARK:
            pos = self.pos
            self.drained_at[checkpoint_id] = [
                [t, p, pos[(t, p)]] for t, p in pos if (t, p) in self.max_ts
            ]
        env = self.env
        incarnation = env.sink_generation  # the generation, or this start under local recovery
        if env.mode == "sync":  # stop-the-world: serialize and upload in the task loop
            future: Future[SnapshotHandle] = Future()
            future.set_result(
                env.store.write_task_snapshot(
                    self.plan.job, checkpoint_id, self.name, state, incarnation=incarnation
                )
            )
        else:
            future = env.uploads.submit(
                env.store.write_task_snapshot,
                self.plan.job,
                checkpoint_id,
                self.name,
                state,
                incarnation=incarnation,
            )
        self.uploading[checkpoint_id] = future

    def _forget(self, checkpoint_id: int) -> None:
        logged = self.loop_log.pop(checkpoint_id, None) is not None
        if logged and checkpoint_id == self.logging_id:
            self.back_logging.clear()
        self.uploading.pop(checkpoint_id, None)
        self.uploaded.pop(checkpoint_id, None)
        self.drained_at.pop(checkpoint_id, None)
        self.aligned.discard(checkpoint_id)

    def alignment_of(self, checkpoint_id: int) -> float:
        """Seconds this task aligned its inputs for ``checkpoint_id`` (0: none, a source), when
        it is acked; what older (aborted, stale) checkpoints left is dropped with it."""
        seconds = self.align_s.get(checkpoint_id, 0.0)
        for times in (self.align_start, self.align_s):
            for old in [c for c in times if c <= checkpoint_id]:
                del times[old]
        return seconds

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
        for name, writer in self.committers:
            pending = self.sink_pending[name]
            due = [(c, x) for c, x in pending if c <= checkpoint_id]
            if due:
                self.env.fault("after-completion-before-commit")
            for chk, committable in due:
                began = time.monotonic()
                writer.commit(chk, committable)
                self.commit_times.append([name, round(time.monotonic() - began, 6)])
            self.sink_pending[name] = [(c, x) for c, x in pending if c > checkpoint_id]
        for op in self.ops.values():
            op.commit(checkpoint_id)
        for chk in [c for c in self.uploaded if c <= checkpoint_id]:
            del self.uploaded[chk]
