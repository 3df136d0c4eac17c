"""The task's lifecycle and batch loop: ``open`` (restore, then read), ``step``, ``close``."""

from __future__ import annotations

import logging
import time
from typing import Any

from processor.checkpoint.aligner import (
    BarrierAligner,
)
from processor.runtime.operators import (
    MIN_WATERMARK,
)
from processor.runtime.task.base import _DROP, _REPLAY, TP
from processor.runtime.task.sources import SourceInputs
from processor.wire import (
    GenerationStart,
)

log = logging.getLogger(__name__)


class Task(SourceInputs):
    """One subtask of one stage. See :mod:`processor.runtime.task`."""

    # -- lifecycle -------------------------------------------------------------------------------

    def open(self, state: dict[str, Any] | None, source_counts: dict[str, int]) -> None:
        """Restore ``state`` (``None``: fresh start), announce the generation, start reading."""
        tps = self.input_partitions(source_counts)
        positions: dict[TP, int | None] = dict.fromkeys(tps)
        seen = self._restore(state, positions)
        # Restarted alone (local recovery) in the generation the other workers still run: every
        # channel record after the restored positions is live, and copies are dropped by ID.
        alone = (
            state is not None
            and self.lineage is not None
            and state["generation"] == self.generation
        )
        recovering = state.get("recovering", {}) if state is not None else {}
        if not self.is_source:
            self.back = {tp for tp in tps if tp[0] in self.back_topics}
            for tp in tps:
                if tp in self.back:  # a loop's watermark comes from its regular inputs only
                    self.channel_wm.pop(tp, None)
                else:
                    self.channel_wm.setdefault(tp, MIN_WATERMARK)
                if alone:
                    continue
                # What the snapshot's channel still had to go through when it was taken (an
                # unaligned snapshot during an earlier recovery), then this restore's phases.
                phases = [(int(m), int(b)) for m, b in recovering.get(tp, [])]
                if state is not None and tp not in seen and positions[tp] is not None:
                    phases.append((_REPLAY, self.restored_id))
                phases.append((_DROP, self.generation))
                self.phases[tp] = phases
                self.modes[tp] = phases[0][0]
            self.aligner = BarrierAligner(
                tps,
                unaligned=self.env.mode == "unaligned",
                restored_checkpoint=self._stale(),
                back_edges=self.back,
            )
            self.replaying = {tp for tp in self.back if tp in self.modes}
        else:
            for tp in tps:
                self.max_ts.setdefault(tp, MIN_WATERMARK)
        start = "earliest"
        if self.is_source:
            starts = {self.plan.flow.steps[s].params["start"] for s in self.stage.sources}
            start = "latest" if starts == {"latest"} else "earliest"
        # A bounded run reads its sources up to the end offsets it had at start, never past
        # them: what is appended meanwhile is left for the next run (docs/engine.md, "Bounded
        # runs"), not read after the drain as late records.
        ends = self.env.end_offsets if self.is_source else None
        stop_at = {tp: ends[tp] for tp in tps if tp in ends} if ends is not None else None
        self.reader.open(positions, start=start, stop_at=stop_at)
        self.pos = {tp: o for tp, o in self.reader.positions().items()}
        if self.replaying:  # replay the back-edge log before consuming the regular inputs
            self.held = [tp for tp in tps if tp not in self.back]
            self.blocked |= set(self.held)  # anything fetched anyway is stashed, not processed
            self.reader.pause(self.held)
        if state is not None:
            self.env.fault("during-recovery")
        for out in self.outputs:
            out.control(GenerationStart(self.generation))
        log.info(
            "opened task=%s generation=%d restored_checkpoint=%d inputs=%d recovery=%s%s",
            self.name, self.generation, self.restored_id, len(tps), self.env.recovery,
            f" alone stale_through={self.env.stale_through}" if alone else "",
        )  # fmt: skip

    def close(self) -> None:
        self.reader.close()
        for _name, writer in self.committers:
            writer.close()
        for op in self.ops.values():
            op.close()

    # -- the data path ---------------------------------------------------------------------------

    def step(self, timeout: float, max_records: int, budget_s: float = 0.05, limit: int = 0) -> int:
        """Poll and process for up to ``budget_s``; returns the number of records read (at
        most ``limit`` if given: a paced source, ``--max-rate``).

        Batches are sized so that one takes about a quarter of the budget: a task with a slow
        user function must not starve the other tasks of its worker (or delay a checkpoint
        trigger) with one long batch.
        """
        if self.halted:
            return 0
        if self.timed:
            self._processing_time()
        clock = time.perf_counter
        start = clock()
        total = 0
        while True:
            size = min(self.batch_size, limit - total) if limit else self.batch_size
            msgs = self.reader.poll(size, timeout if total == 0 else 0.0)
            if msgs:
                began = clock()
                if self.is_source:
                    self._source_batch(msgs)
                else:
                    self._channel_batch(msgs)
                    self._resume_pending()
                self._flush()
                if self.dead is not None:
                    self.dead.flush()
                per_record = (clock() - began) / len(msgs)
                target = int(budget_s / 4 / per_record) if per_record > 0 else max_records
                self.batch_size = max(16, min(max_records, target))
                total += len(msgs)
            if self.is_source:
                if not msgs:
                    # The reader's position also moves over what it never delivers: transaction
                    # markers and aborted records. Without this a partition that ends in a
                    # marker (the output of any exactly-once job) never counts as read.
                    self.pos = self.reader.positions()
                self._source_watermark()
                if self.dead is not None:
                    self.dead.flush()
            if not msgs or self.halted or clock() - start >= budget_s:
                return total
            if limit and total >= limit:
                return total
