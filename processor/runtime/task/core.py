"""The task: its collaborators, wired in one place, its lifecycle and its batch loop.

:class:`Task` owns, and builds in :meth:`Task.__init__`:

* :class:`~.chain.OperatorChain` (``chain``): the fused operators, output channels, sinks and
  dead-letter writer, the watermark;
* :class:`~.checkpoints.SubtaskCheckpoints` (``checkpoints``): snapshot, restore, barrier
  forwarding, acks, the sinks' two-phase commit;
* the task's inputs (``inputs``): :class:`~.sources.SourceInputs` for a source task,
  :class:`~.inputs.ChannelInputs` (the channels, their recovery phases and the barrier aligner)
  for the others;
* the reader of its input partitions, which the inputs share with the batch loop.

Each collaborator gets only what it needs: the inputs push into the chain and hand the aligner's
actions to the checkpoint coordinator; the coordinator works on the chain and on the inputs it is
given at each call. The task itself only opens, steps, closes and answers the worker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from processor.compiler import Stage, channel_inputs
from processor.runtime.task.chain import TP, OperatorChain
from processor.runtime.task.channels import Lineage, Loop, TaskEnv
from processor.runtime.task.checkpoints import SubtaskCheckpoints
from processor.runtime.task.inputs import ChannelInputs
from processor.runtime.task.purge import PurgeFloor
from processor.runtime.task.sources import SourceInputs
from processor.snapshot.store import SnapshotHandle
from processor.wire import (
    GenerationStart,
    source_partitions_for,
)

log = logging.getLogger(__name__)


class Task:
    """One subtask of one stage. See :mod:`processor.runtime.task`."""

    def __init__(self, env: TaskEnv, stage: Stage, subtask: int) -> None:
        self.env = env
        self.stage = stage
        self.subtask = subtask
        self.name = stage.task(subtask)
        self.plan = env.plan
        self.generation = env.generation
        self.is_source = bool(stage.sources)
        # Local recovery (docs/local-recovery.md): records are pushed one at a time with their
        # ID in ``lineage``; channel inputs are checked against the chain's replay check, the
        # IDs this task processed, so the copies a restarted upstream worker re-emits are
        # dropped. Loops: the iteration count of what is pushed, for a task with a loop channel.
        lineage = Lineage() if env.recovery == "local" else None
        loop_edges = [e for e in (*stage.inputs, *stage.outputs) if e.loop]
        loop = Loop() if loop_edges else None
        self.chain = OperatorChain(env, stage, subtask, lineage=lineage, loop=loop)
        self.reader = env.reader_factory(f"eosflow-{self.plan.job}")
        self.checkpoints = SubtaskCheckpoints(env, self.name, self.chain, is_source=self.is_source)
        self.inputs: SourceInputs | ChannelInputs
        if self.is_source:
            self.inputs = SourceInputs(env, stage, self.name, self.chain, self.reader)
        else:
            self.inputs = ChannelInputs(
                env, stage, self.name, self.chain, self.reader, self.checkpoints
            )
        self.batch_size = 500

    # -- lifecycle -------------------------------------------------------------------------------

    def open(self, state: dict[str, Any] | None, source_counts: dict[str, int]) -> None:
        """Restore ``state`` (``None``: fresh start), announce the generation, start reading."""
        tps = self.input_partitions(source_counts)
        positions: dict[TP, int | None] = dict.fromkeys(tps)
        channels = {e.topic for e in self.stage.inputs}
        seen = self.checkpoints.restore(state, positions, channels, self.inputs)
        # Restarted alone (local recovery) in the generation the other workers still run: every
        # channel record after the restored positions is live, and copies are dropped by ID.
        alone = (
            state is not None
            and self.chain.lineage is not None
            and state["generation"] == self.generation
        )
        restored_id = self.checkpoints.restored_id
        if isinstance(self.inputs, ChannelInputs):
            self.inputs.open(tps, positions, state, seen, alone=alone, restored_id=restored_id)
        else:
            self.inputs.open(tps, positions)
        if state is not None:
            self.env.fault("during-recovery")
        # Before any other record: readers fence the incarnations before this one from here on.
        for out in self.chain.outputs:
            out.control(GenerationStart(self.generation, self.env.sink_generation))
        log.info(
            "opened task=%s generation=%d restored_checkpoint=%d inputs=%d recovery=%s%s",
            self.name, self.generation, restored_id, len(tps), self.env.recovery,
            f" alone stale_through={self.env.stale_through}" if alone else "",
        )  # fmt: skip

    def close(self) -> None:
        if isinstance(self.inputs, SourceInputs):
            self.inputs.close()
        self.reader.close()
        self.chain.close()

    def input_partitions(self, source_counts: dict[str, int]) -> list[TP]:
        P, i = self.plan.parallelism, self.subtask
        steps = self.plan.flow.steps
        tps: list[TP] = []
        for name in self.stage.sources:
            topic = steps[name].params["topic"]
            tps += [(topic, p) for p in source_partitions_for(i, P, source_counts[topic])]
        return tps + channel_inputs(self.plan, self.stage, i)

    # -- the data path ---------------------------------------------------------------------------

    def step(
        self,
        timeout: float,
        max_records: int,
        budget_s: float = 0.05,
        limit: int = 0,
        urgent: Callable[[], bool] | None = None,
    ) -> int:
        """Poll and process for up to ``budget_s``; returns the number of records read (at
        most ``limit`` if given: a paced source, ``--max-rate``).

        Batches are sized so that one takes about a quarter of the budget: a task with a slow
        user function must not starve the other tasks of its worker (or delay a checkpoint
        trigger) with one long batch. ``urgent`` is asked after each batch: when it says so
        (the worker has a coordinator message to serve, or a snapshot's ack to send), the
        step ends before its budget. A busy step held each checkpoint's ack and each
        completion's commit back by up to the budget: ~100 ms of every checkpoint under load
        (bench/RESULTS.md, "Checkpoints under load: acks and commits between batches").
        """
        checkpoints, chain, inputs = self.checkpoints, self.chain, self.inputs
        if checkpoints.halted:
            return 0
        if chain.timed:
            chain.processing_time()
        clock = time.perf_counter
        start = clock()
        total = 0
        source = isinstance(inputs, SourceInputs)
        while True:
            size = min(self.batch_size, limit - total) if limit else self.batch_size
            msgs = self.reader.poll(size, timeout if total == 0 else 0.0)
            if msgs:
                began = clock()
                before = inputs.records_in if source else 0
                inputs.read(msgs)
                chain.flush()
                if chain.dead is not None:
                    chain.dead.flush()
                per_record = (clock() - began) / len(msgs)
                target = int(budget_s / 4 / per_record) if per_record > 0 else max_records
                self.batch_size = max(16, min(max_records, target))
                # a source's records given back unread (watermark alignment) are not counted:
                # --max-rate paces what is read, and they come again
                total += inputs.records_in - before if source else len(msgs)
            if isinstance(inputs, SourceInputs):
                inputs.polled(msgs)
            if not msgs or checkpoints.halted or clock() - start >= budget_s:
                return total
            if urgent is not None and urgent():
                return total
            if limit and total >= limit:
                return total

    # -- checkpoints (the worker's messages) -----------------------------------------------------

    def trigger(self, checkpoint_id: int, *, aligned: bool = False) -> None:
        """Source tasks: the coordinator started ``checkpoint_id`` (``aligned``: even in
        unaligned mode, as the final checkpoint of a run must be)."""
        self.checkpoints.trigger(checkpoint_id, self.inputs, aligned=aligned)

    def complete(self, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id`` completed: commit the sinks' epochs up to it."""
        self.checkpoints.complete(checkpoint_id)

    def abort(self, checkpoint_id: int, reason: str) -> None:
        self.checkpoints.halted = False
        if isinstance(self.inputs, ChannelInputs):
            self.inputs.abort(checkpoint_id, reason)
        else:
            self.checkpoints.forget(checkpoint_id)

    def ready_acks(self) -> list[tuple[int, SnapshotHandle]]:
        """Checkpoints whose snapshot is uploaded and whose alignment is done (ack them now)."""
        return self.checkpoints.ready_acks()

    def align(self, others: int | None) -> None:
        """Source tasks: the lowest watermark of the other source tasks, as the coordinator
        last heard (watermark alignment, :mod:`.sources`)."""
        if isinstance(self.inputs, SourceInputs):
            self.inputs.align(others)

    def local_watermark(self) -> int | None:
        """Source tasks: the lowest watermark of the partitions with records to read."""
        return self.inputs.local_watermark() if isinstance(self.inputs, SourceInputs) else None

    def alignment_of(self, checkpoint_id: int) -> float:
        """Seconds this task aligned its inputs for ``checkpoint_id`` (0: none, a source)."""
        if isinstance(self.inputs, ChannelInputs):
            return self.inputs.alignment_of(checkpoint_id)
        return 0.0

    @property
    def declined(self) -> list[tuple[int, str]]:
        """(checkpoint, reason) to decline to the coordinator; the worker clears it."""
        return self.checkpoints.declined

    @property
    def drained_at(self) -> dict[int, list[list[Any]]]:
        """Checkpoint -> this source task's positions, when its snapshot was drained."""
        return self.checkpoints.drained_at

    @property
    def sources_at(self) -> dict[int, list[list[Any]]]:
        """Checkpoint -> this source task's source positions (sent with its ack)."""
        return self.checkpoints.sources_at

    @property
    def purge_floor(self) -> PurgeFloor:
        """The channel positions of this task's snapshots (:mod:`processor.runtime.task.purge`)."""
        return self.checkpoints.purge_floor

    @property
    def loop_log(self) -> dict[int, int]:
        """Checkpoint -> back-edge records logged (a loop head's; empty otherwise)."""
        if isinstance(self.inputs, ChannelInputs):
            return self.inputs.loop_log
        return {}

    @property
    def drained(self) -> bool:
        """A source task read its inputs up to the end offsets of a bounded run."""
        return isinstance(self.inputs, SourceInputs) and self.inputs.drained

    @property
    def watermark(self) -> int:
        return self.chain.watermark

    # -- reporting -------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        inputs = self.inputs
        counts = self.chain.counts()
        channels = inputs if isinstance(inputs, ChannelInputs) else None
        return {
            "in": inputs.records_in,
            "out": counts["out"],
            "sunk": counts["sunk"],
            "bad": inputs.bad_records if isinstance(inputs, SourceInputs) else 0,
            "dead": counts["dead"],
            "late": counts["late"],
            "dups": counts["dups"],
            "stale": channels.stale_dropped if channels is not None else 0,
            "fenced": channels.fence.fenced if channels is not None else 0,
            "replayed": counts["replayed"],
            # local recovery: the IDs the replay check holds now, and at most so far
            "replay_ids": counts["replay_ids"],
            "replay_peak": counts["replay_peak"],
            "replay_pinned": counts["replay_pinned"],
            "loop_limit": channels.loop_exhausted if channels is not None else 0,
            "lag": inputs.lag() if isinstance(inputs, SourceInputs) else 0,
            "watermark": self.chain.watermark,
            **self._metrics(),
        }

    def _metrics(self) -> dict[str, Any]:
        """What only the metrics and the job page read (docs/observability.md): per step,
        per partition, per sink, and the dedup steps' store traffic."""
        chain = self.chain.metrics()
        lag = self.reader.cached_lag()
        inputs = self.inputs
        others = None
        if isinstance(inputs, SourceInputs):
            wm_parts, local = inputs.watermark_parts(lag), inputs.local_watermark(lag)
            others = inputs.others_wm
        else:
            wm_parts, local = inputs.watermark_parts(), None
        return {
            # per input partition [topic, partition, watermark, newest event time, state];
            # a source task's watermark for the coordinator's alignment (None: all idle)
            "wm_parts": wm_parts,
            "align_wm": local,
            # the other source tasks' lowest, as the coordinator last told (alignment's floor)
            "align_others": others,
            "steps": chain["steps"],
            "sinks": chain["sinks"],
            "parts": [[t, p, n] for (t, p), n in lag.items()],
            "lookups": chain["lookups"],
            "round_trips": chain["round_trips"],
            "commits": self.checkpoints.take_commit_times(),
            "headroom": chain["headroom"],
            "dead_recent": chain["dead_recent"],
        }
