"""Settle the sinks of a job's old shape before it restarts at another parallelism (issue 24,
docs/design-rescaling.md §3.4).

A checkpoint taken at parallelism ``P_old`` holds, per old task, the committables its sinks
prepared and had not committed (``state["sinks"][committer]``: ``[[checkpoint_id,
committable], ...]``). Only a writer of the *old* subtask can finish them: output names,
transactional ids, prepared-transaction ids and staging keys are all derived from the subtask
index, and its meaning changes with the parallelism. So before any new-shape worker starts,
:func:`settle_old_shape` opens every committer of every old task with the old context, calls
``recover(pending)`` (which commits or re-publishes the pending epochs and discards the old
subtask's orphans: open transactions, temp files, prepared PostgreSQL transactions, staging
hashes) and closes it. The new tasks then restore with no pending committables.

Why before, not alongside: after a rescale a key's output comes from another subtask. If old
subtask 2 re-published epoch ``n`` while new subtask 1 already wrote ``n + 1`` for the same
key, readers would see ``n + 1`` before ``n`` (the per-key order argument of
``KafkaSinkWriter._refuse_rescue_out_of_order``).

Committers are settled whether or not they hold a pending entry: ``recover([])`` is what cleans
the orphans of an old subtask that no new subtask will ever look at (old subtask 2 when
``P_new = 1``).

Invariants:
    Idempotent: every sink's ``recover`` is, so a crash mid-settle and a second call give the
    same committed output (nothing lost, nothing twice).
    A failure names the sink, the old subtask and the checkpoints it was settling.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from processor.contracts import Sink, SinkContext
from processor.dataflow import DEAD_LETTERS, Dataflow
from processor.errors import DefinitionError, EosflowError
from processor.runtime.shape.topology import current_topology
from processor.snapshot.store import SnapshotStore

__all__ = ["settle_old_shape"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Unit:
    """One old committer to settle: a sink's writer of one old subtask, with its pending."""

    committer: str  # the step name, or DEAD_LETTERS
    sink: Sink
    task: str  # the old task whose snapshot held the pending
    subtask: int  # the writer's subtask index (dead letters: stage_index * P + i)
    parallelism: int  # the writer's parallelism (dead letters: stages * P)
    checkpoint: int | None  # the snapshot's checkpoint
    pending: tuple[tuple[int, Any], ...]


def settle_old_shape(
    flow: Dataflow,
    states: Mapping[str, Mapping[str, Any]],
    *,
    parallelism: int,
    stage_names: list[str],
    epoch: int,
    generation: int,
    snapshot_url: str,
    checkpoint_interval: float | None,
    fault: Callable[[str], None] = lambda point: None,
    workers: int = 4,
) -> int:
    """Commit every pending committable of the old shape and clean its subtasks' orphans.

    Args:
        flow: the job's dataflow (its sink steps and dead-letter destination).
        states: old task name (``<stage>.<subtask>``) -> that task's snapshot state.
        parallelism: the OLD parallelism ``P_old``.
        stage_names: the old plan's stage names, in plan order (dead-letter writer indices).
        epoch: the OLD shape epoch (``SinkContext.epoch`` of the old writers).
        generation: the sink generation to open the writers with (a new one: no writer of the
            old run ever had it).
        snapshot_url: the job's snapshot store.
        checkpoint_interval: as the old writers had it.
        fault: crash-test hook, given to the writers (``mid-sink-recover``).
        workers: committers settled at once.

    Returns:
        How many pending committables were handed to ``recover``.

    Raises:
        DefinitionError: a task name that is not ``<stage>.<subtask>`` of the old shape, or
            an old task without a state.
        EosflowError: one or more committers failed; the message names each one's sink, old
            subtask and checkpoints. Nothing is lost: call again (it is idempotent).
    """
    units = _units(flow, states, parallelism, stage_names)

    def settle(unit: _Unit) -> tuple[_Unit, BaseException | None]:
        ctx = SinkContext(
            flow.name, unit.committer, unit.subtask, unit.parallelism, generation,
            checkpoint_interval=checkpoint_interval, snapshot_url=snapshot_url, fault=fault,
            epoch=epoch,
        )  # fmt: skip
        try:
            writer = unit.sink.open(ctx)
            try:
                writer.recover(list(unit.pending))
            finally:
                writer.close()
        except Exception as exc:  # reported with its place below; the others still settle
            return unit, exc
        log.info(
            "settled job=%r sink=%r old_subtask=%d/%d task=%s checkpoint=%s pending=%s",
            flow.name, unit.committer, unit.subtask, unit.parallelism, unit.task,
            unit.checkpoint, [c for c, _ in unit.pending],
        )  # fmt: skip
        return unit, None

    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="settle") as pool:
        results = list(pool.map(settle, units))
    failed = [(u, e) for u, e in results if e is not None]
    if failed:
        lines = [
            f"sink {u.committer!r} old subtask {u.subtask} of {u.parallelism} (task {u.task}, "
            f"checkpoint {u.checkpoint}, pending checkpoints {[c for c, _ in u.pending]}): "
            f"{type(e).__name__}: {e}"
            for u, e in failed
        ]
        raise EosflowError(
            f"job {flow.name!r}: settling the sinks of the old shape (parallelism {parallelism}) "
            f"failed for {len(failed)} of {len(units)} writers; nothing is lost, and settling "
            "again (the next start) resumes it:\n  " + "\n  ".join(lines)
        ) from failed[0][1]
    return sum(len(u.pending) for u in units)


def _units(
    flow: Dataflow,
    states: Mapping[str, Mapping[str, Any]],
    parallelism: int,
    stage_names: list[str],
) -> list[_Unit]:
    """Every committer of every old task: sink steps at (subtask, P); dead letters at
    (stage_index * P + subtask, stages * P), as ``TaskBase._build_operators`` opens them."""
    by_task: dict[tuple[str, int], Mapping[str, Any]] = {}
    for task, state in states.items():
        stage, _, index = task.rpartition(".")
        if stage not in stage_names or not index.isdigit() or int(index) >= parallelism:
            raise DefinitionError(
                f"job {flow.name!r}: snapshot of task {task!r} is not a task of the old shape "
                f"(stages {stage_names}, parallelism {parallelism}): cannot settle its sinks"
            )
        by_task[stage, int(index)] = state
    missing = [f"{s}.{i}" for s in stage_names for i in range(parallelism) if (s, i) not in by_task]
    if missing:  # its pending committables would never be committed: lost output
        raise DefinitionError(
            f"job {flow.name!r}: no snapshot state for old task(s) {', '.join(missing)} (stages "
            f"{stage_names}, parallelism {parallelism}): cannot settle their sinks without "
            "losing their pending output; pass the state of every task of the checkpoint"
        )
    units: list[_Unit] = []
    sink_steps = {n: s.params["sink"] for n, s in flow.steps.items() if s.kind == "sink"}
    for i in range(parallelism):
        for name, sink in sink_steps.items():
            # A sink step lives in one stage; its pending sits in that stage's task i (none
            # holds it when the step had nothing pending: then only orphans are cleaned).
            # Settled once per (step, subtask) whichever stage it is in.
            held = [s for s in stage_names if name in by_task.get((s, i), {}).get("sinks", {})]
            state = by_task.get((held[0], i), {}) if held else {}
            task = f"{held[0]}.{i}" if held else f"?.{i}"
            units.append(
                _Unit(name, sink, task, i, parallelism, state.get("checkpoint"),
                      _pending(state.get("sinks", {}).get(name, ())))
            )  # fmt: skip
    if flow.dead_letter_sink is not None:
        for k, stage in enumerate(stage_names):
            for i in range(parallelism):
                state = by_task.get((stage, i), {})
                units.append(
                    _Unit(DEAD_LETTERS, flow.dead_letter_sink, f"{stage}.{i}",
                          k * parallelism + i, len(stage_names) * parallelism,
                          state.get("checkpoint"),
                          _pending(state.get("sinks", {}).get(DEAD_LETTERS, ())))
                )  # fmt: skip
    return units


def _pending(entries: Any) -> tuple[tuple[int, Any], ...]:
    """``[[chk, committable], ...]`` in checkpoint order (the order ``recover`` commits in)."""
    return tuple(sorted(((int(c), x) for c, x in entries), key=lambda e: e[0]))


def settle_checkpoint(
    flow: Dataflow,
    store: SnapshotStore,
    latest: Any,
    *,
    checkpoint_interval: float | None,
) -> int:
    """Commit what the completed checkpoint ``latest`` left pending, in its own shape, without
    restoring it: a start refused after it (``runtime.checkpoints.drain``) must not leave the
    output of a job killed before its sinks committed uncommitted. Idempotent, as ``recover`` is:
    a later restore of ``latest`` commits nothing twice. Returns the committables recovered."""
    from processor.compiler import compile_flow

    job = latest.job
    topo = current_topology(store, job, latest)
    assert topo is not None, "a completed checkpoint has a topology"
    plan = compile_flow(flow, topo.parallelism, key_groups=topo.key_groups, epoch=topo.epoch)
    states = {t: store.read_task_snapshot(h) for t, h in latest.tasks.items()}
    return settle_old_shape(
        flow,
        states,
        parallelism=topo.parallelism,
        stage_names=[s.name for s in plan.stages],
        epoch=topo.epoch,
        generation=store.next_generation(job),
        snapshot_url=store.url,
        checkpoint_interval=checkpoint_interval,
    )
