"""The checkpoint coordinator: triggers checkpoints, collects acknowledgements, completes them.

Pure bookkeeping with an injected clock (the runner does the messaging): at most one checkpoint
is pending at a time; a checkpoint is complete when every task acknowledged it, and only then
is its manifest written (atomically, by :meth:`SnapshotStore.complete`). A checkpoint that takes
longer than ``timeout_s``, or that a task declines, is aborted; the next one starts after the
interval. Completed checkpoints beyond the newest ``keep`` are deleted.

Invariants:
    Checkpoint ids only grow, across generations and runs (the next id is one more than the
    highest id with a directory in the store), so a barrier of an aborted checkpoint can never
    be mistaken for a newer one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from processor.runtime.checkpoints.drain import drained_metadata
from processor.snapshot.store import SnapshotHandle, SnapshotStore

#: The newest checkpoint id the job ever completed (:mod:`.savepoints` reads it).
LAST_CHECKPOINT = "_LAST_CHECKPOINT"

__all__ = ["CheckpointCoordinator", "CheckpointEvent", "CheckpointStats", "last_checkpoint"]

log = logging.getLogger(__name__)


def last_checkpoint(store: SnapshotStore, job: str) -> int:
    """The newest checkpoint id ``job`` ever completed (0: none), deleted ones included."""
    raw = store.read_job_file(job, LAST_CHECKPOINT)
    return int(raw) if raw else 0


@dataclass
class _Pending:
    checkpoint_id: int
    started: float
    acks: dict[str, SnapshotHandle] = field(default_factory=dict)
    loop_log: int = 0  # records on loop back-edges between the heads' snapshots and barrier
    alignment_s: float = 0.0  # the longest alignment of its tasks
    aligned: bool = True  # every barrier of it aligned (savepoints need it)
    drained: list[list[Any]] | None = None  # drained source tasks' positions
    undrained: bool = False  # some source task did not drain
    sources: list[list[Any]] = field(default_factory=list)  # source tasks' positions
    #: per task, the records its sinks got in the epochs this checkpoint commits
    sunk: dict[str, list[list[int]]] = field(default_factory=dict)


@dataclass
class CheckpointStats:
    """What the progress line and ``eosflow status`` show."""

    last_completed: int = 0
    last_duration_s: float = 0.0
    completed: int = 0
    durations: list[float] = field(default_factory=list)
    #: loops: the back-edge log of the last completed checkpoint, and (id, records, seconds)
    #: of the recent ones
    last_loop_log: int = 0
    loop_logs: list[tuple[int, int, float]] = field(default_factory=list)
    #: the source positions of the last completed checkpoint, ``[[topic, partition, offset]]``
    #: (what the job's consumer group is given: runtime.identity)
    last_sources: list[list[Any]] = field(default_factory=list)
    #: bytes of the largest completed checkpoint's task snapshots: the job's peak state, as
    #: far as checkpoints saw it (bench/backfill.py)
    peak_size_bytes: int = 0
    #: records the sinks committed in this run: each epoch of each task once, when a
    #: checkpoint that covers it completed (re-writes after a restart are new epochs; what an
    #: aborted or failed epoch wrote never counts)
    committed_records: int = 0
    #: per task, the newest epoch counted in :attr:`committed_records`
    counted_through: dict[str, int] = field(default_factory=dict)
    #: aborted checkpoints by kind: ``timeout``, ``declined``, ``restart``
    failed: dict[str, int] = field(
        default_factory=lambda: {"timeout": 0, "declined": 0, "restart": 0}
    )

    @property
    def aborted(self) -> int:
        return sum(self.failed.values())


@dataclass(frozen=True)
class CheckpointEvent:
    """A checkpoint ended (for metrics and the job page): completed, or failed with a reason."""

    checkpoint_id: int
    completed: bool
    duration_s: float
    at_ms: int  # wall clock
    size_bytes: int = 0
    alignment_s: float = 0.0
    kind: str | None = None  # failed: timeout, declined or restart
    reason: str | None = None


class CheckpointCoordinator:
    """Checkpoint bookkeeping for one job.

    Args:
        store: where manifests are written.
        job: the job name.
        tasks: every task that must acknowledge a checkpoint.
        interval_s: time from one checkpoint's trigger to the next one's, as Flink's
            ``execution.checkpointing.interval``; a checkpoint that took longer than half of
            it is followed by a pause of half of it (so a slow store or sink never has the job
            checkpointing back to back); after an abort, a whole interval. ``None``: only
            explicit :meth:`trigger_now`. (Until issue 51 it was counted from the end of the
            previous checkpoint: every commit came the checkpoint's duration later than the
            interval, 20-30 ms at 100 ms: bench/RESULTS.md, "Latency, start-up and recovery".)
        timeout_s: a pending checkpoint older than this is aborted.
        keep: completed checkpoints to retain.
        clock: monotonic seconds.
        observer: called with a :class:`CheckpointEvent` when a checkpoint completes or fails.
        metadata: recorded in every manifest's metadata too (the plan's operator state layout,
            :mod:`processor.runtime.operators.state_map`).
        aligned: periodic checkpoints are aligned (the manifest says ``aligned`` either way).
    """

    def __init__(
        self,
        store: SnapshotStore,
        job: str,
        tasks: Iterable[str],
        *,
        interval_s: float | None,
        timeout_s: float = 60.0,
        keep: int = 3,
        clock: Callable[[], float] = time.monotonic,
        observer: Callable[[CheckpointEvent], None] | None = None,
        metadata: Mapping[str, Any] | None = None,
        aligned: bool = True,
    ) -> None:
        self.observer = observer
        self.aligned = aligned
        self.metadata = dict(metadata or {})
        self.store = store
        self.job = job
        self.tasks = frozenset(tasks)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.keep = keep
        self.clock = clock
        self.generation = 0
        #: why each checkpoint timed out since the last one completed (or the generation began):
        #: the runner restarts a stuck worker when there are too many in a row
        self.timed_out: list[str] = []
        self.pending: _Pending | None = None
        latest = store.latest_completed(job)
        self.stats = CheckpointStats(last_completed=latest.checkpoint_id if latest else 0)
        # Ids never go back, even past deleted checkpoints (a savepoint restored after them):
        # sinks key their output by checkpoint id.
        newest = max(store.newest_checkpoint_id(job), last_checkpoint(store, job))
        self.next_id = max(newest, self.stats.last_completed) + 1
        self._next_due = clock() + (interval_s or 0.0)

    def start_generation(self, generation: int) -> None:
        """A new generation starts (after a recovery): the pending checkpoint is void."""
        if self.pending is not None:
            self._abort(f"generation {generation} started", "restart")
        self.generation = generation
        self.timed_out = []
        self._next_due = self.clock() + (self.interval_s or 0.0)

    def due(self) -> int | None:
        """The id of a checkpoint to trigger now, if the interval has passed."""
        if self.interval_s is None or self.pending is not None or self.clock() < self._next_due:
            return None
        return self.trigger_now(aligned=self.aligned)

    def due_in(self) -> float:
        """Seconds until :meth:`due` triggers (0: now; infinite while one is pending or with
        no interval): how long the runner may wait for messages before it looks again."""
        if self.interval_s is None or self.pending is not None:
            return float("inf")
        return max(0.0, self._next_due - self.clock())

    def trigger_now(self, *, aligned: bool = True) -> int | None:
        """Start a checkpoint at once unless one is pending (final checkpoints, savepoints,
        tests); ``aligned``: its barriers are aligned (recorded in its manifest)."""
        if self.pending is not None:
            return None
        chk = self.next_id
        self.next_id += 1
        now = self.clock()
        self.pending = _Pending(chk, now, aligned=aligned)
        self._next_due = now + (self.interval_s or 0.0)
        log.debug("triggered checkpoint_id=%d generation=%d", chk, self.generation)
        return chk

    def on_sunk(self, checkpoint_id: int, task: str, sunk: Any) -> None:
        """The ``sunk`` of an ack (before :meth:`on_ack`): ``[[epoch, records]]``."""
        pending = self.pending
        if pending is not None and pending.checkpoint_id == checkpoint_id and sunk:
            pending.sunk[task] = [[int(c), int(n)] for c, n in sunk]

    def on_ack(
        self,
        checkpoint_id: int,
        task: str,
        handle: SnapshotHandle,
        loop_log: int = 0,
        alignment_s: float = 0.0,
        drained: list[list[Any]] | bool | None = False,
        sources: list[list[Any]] | None = None,
    ) -> bool:
        """Records an acknowledgement; True when it completed the checkpoint. ``loop_log``: the
        back-edge records a loop head logged for it (docs/iterations.md); ``alignment_s``: how
        long the task aligned its inputs for it; ``drained``: a source task's positions if its
        snapshot had the drained watermark, else ``None``; ``False`` for other tasks (the
        manifest's ``drained``: runtime.checkpoints.drain); ``sources``: a source task's source
        positions (the manifest's ``sources``, and :attr:`CheckpointStats.last_sources`)."""
        pending = self.pending
        if pending is None or pending.checkpoint_id != checkpoint_id:
            log.debug("late ack checkpoint_id=%d task=%s ignored", checkpoint_id, task)
            return False
        if task not in self.tasks:
            log.warning("ack from unknown task=%s checkpoint_id=%d", task, checkpoint_id)
            return False
        if task not in pending.acks:
            pending.loop_log += loop_log
            pending.alignment_s = max(pending.alignment_s, alignment_s)
            if isinstance(drained, list):
                pending.drained = [*(pending.drained or []), *drained]
            elif drained is None:  # a source task that did not drain
                pending.undrained = True
            pending.sources.extend(sources or ())
        pending.acks[task] = handle
        if len(pending.acks) < len(self.tasks):
            return False
        duration = self.clock() - pending.started
        # Before the manifest: a crash between the two must not let an id be used again.
        self.store.write_job_file(self.job, LAST_CHECKPOINT, str(checkpoint_id).encode())
        self.store.complete(
            self.job,
            checkpoint_id,
            pending.acks,
            {
                **self.metadata,
                "generation": self.generation,
                "duration_ms": int(duration * 1000),
                "loop_log": pending.loop_log,
                "aligned": pending.aligned,
                "sources": sorted(pending.sources),
                **drained_metadata(pending.drained, every=not pending.undrained),
            },
        )
        self.pending = None
        self.timed_out = []
        stats = self.stats
        stats.last_completed, stats.last_duration_s = checkpoint_id, duration
        stats.completed += 1
        stats.durations.append(duration)
        del stats.durations[:-1000]
        stats.last_loop_log = pending.loop_log
        stats.last_sources = sorted(pending.sources)
        stats.loop_logs.append((checkpoint_id, pending.loop_log, duration))
        del stats.loop_logs[:-1000]
        self._next_due = max(self._next_due, self.clock() + (self.interval_s or 0.0) / 2)
        size = sum(h.size for h in pending.acks.values())
        stats.peak_size_bytes = max(stats.peak_size_bytes, size)
        for task, epochs in pending.sunk.items():
            through = stats.counted_through.get(task, 0)
            stats.committed_records += sum(n for c, n in epochs if c > through)
            stats.counted_through[task] = checkpoint_id
        log.info(
            "completed checkpoint_id=%d generation=%d duration_ms=%d loop_log=%d bytes=%d",
            checkpoint_id, self.generation, int(duration * 1000), pending.loop_log, size,
        )  # fmt: skip
        self.store.retain(self.job, self.keep)
        if self.observer is not None:
            self.observer(
                CheckpointEvent(
                    checkpoint_id,
                    True,
                    duration,
                    int(time.time() * 1000),
                    size,
                    pending.alignment_s,
                )
            )
        return True

    def expired(self) -> int | None:
        """Aborts and returns the pending checkpoint if it exceeded the timeout."""
        pending = self.pending
        if pending is None or self.clock() - pending.started < self.timeout_s:
            return None
        missing = sorted(self.tasks - set(pending.acks))
        reason = f"timed out after {self.timeout_s:g}s; no ack from {missing}"
        self.timed_out.append(reason)
        return self._abort(reason, "timeout")

    def decline(self, checkpoint_id: int, task: str, reason: str) -> int | None:
        if self.pending is None or self.pending.checkpoint_id != checkpoint_id:
            return None
        return self._abort(f"declined by task {task}: {reason}", "declined")

    def abort_pending(self, reason: str) -> int | None:
        """Aborts the pending checkpoint, if any (a worker restarts alone: it cannot ack it)."""
        return self._abort(reason, "restart") if self.pending is not None else None

    def _abort(self, reason: str, kind: str) -> int:
        assert self.pending is not None
        chk, started = self.pending.checkpoint_id, self.pending.started
        self.pending = None
        self.stats.failed[kind] += 1
        if self.observer is not None:
            self.observer(
                CheckpointEvent(
                    chk,
                    False,
                    self.clock() - started,
                    int(time.time() * 1000),
                    kind=kind,
                    reason=reason,
                )
            )
        self._next_due = self.clock() + (self.interval_s or 0.0)
        log.warning("aborted checkpoint_id=%d reason=%r", chk, reason)
        self.store.discard(self.job, chk)
        return chk
