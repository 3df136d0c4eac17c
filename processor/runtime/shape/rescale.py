"""Changing a job's parallelism: the checkpoint of the new shape.

A job's **topology** (its parallelism ``P``, key-group count ``G`` and shape epoch) is recorded
in its snapshot store: :mod:`processor.runtime.shape.topology`.

When ``eosflow run --workers N`` finds the job's last checkpoint at another parallelism, the
runner rescales it *before any worker starts* (:func:`rescale`), in this order:

1. **Refuse** what cannot move (:func:`check_rescalable`): an unaligned checkpoint or channels
   still recovering (records in flight in the old channels), a loop, keyed sources read without
   a shuffle (their state sits where Kafka's partitioner put the key), local recovery. (More
   workers than key groups take a larger key-group count: state is re-placed from its keys.)
2. **Settle the old shape's sinks** (:func:`processor.runtime.shape.settle.settle_old_shape`): every
   committer of every old subtask recovers what the checkpoint holds for it (commit, or
   re-publish) and cleans its orphans, so that no old transaction is open and no pending output
   is left when the new writers start. Idempotent: a crash here repeats it.
3. **Write the checkpoint of the new shape**, id ``C + 1``: for each new subtask ``i`` of each
   stage, the source partitions ``p % N == i`` with their offsets and event-time maxima, and
   each stateful step's state for the keys ``i`` owns, merged from the old subtasks that may
   hold them (:func:`processor.wire.shared_keys`; :mod:`processor.runtime.shape.rescale_state`,
   dedup IDs by :func:`dedup.rescale.merge_dedup_states`). The new channel
   topics start at their end, with every barrier seen (nothing to replay). The manifest is
   written last: a crash before it leaves checkpoint ``C`` the latest, and the rescale repeats.
4. Delete the old epoch's channel topics (best effort: nothing reads them any more).

This is a stop-and-restore rescale, as Flink's from a savepoint: the runner (the Spark driver)
reads every snapshot once, so its memory bounds the state it can move (docs/engine.md,
"Changing the parallelism").
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from processor.compiler import Plan, channel_inputs, compile_flow
from processor.errors import ConfigError
from processor.runtime.shape.settle import settle_old_shape
from processor.runtime.shape.shape_gc import delete_other_epochs, sweep_dedup
from processor.runtime.shape.topology import (
    EPOCH_FILE,
    TOPOLOGY_FILE,
    Topology,
    current_topology,
    highest_epoch,
    new_topology,
    record_parallelism,
    subtask_of,
)
from processor.runtime.topics import START_FILE, end_positions, ensure_channels
from processor.snapshot.store import Manifest, SnapshotHandle, SnapshotStore
from processor.wire import key_owner, shared_keys

__all__ = ["check_rescalable", "prepare_shape", "rescale", "runner_fault"]

log = logging.getLogger(__name__)

_DEDUP_KINDS = ("dedup", "keyed-dedup")


def check_rescalable(plan: Plan, latest: Manifest, old: Topology, recovery: str) -> None:
    """Refuses a change of parallelism that would lose or misplace state (the module
    docstring, step 1), with a message that says what to do instead."""
    job, N = plan.job, plan.parallelism
    how = f"Run it with --workers {old.parallelism}, or under a new job name (starting over)"
    if latest.metadata.get("aligned") is False:
        raise ConfigError(
            f"job {job!r}: its last checkpoint ({latest.checkpoint_id}) is unaligned, so its "
            "channels hold records in flight that cannot move to the channels of "
            f"{N} workers. Take an aligned one first: `eosflow savepoint {job} --stop` (or "
            f"stop the job with Ctrl-C: the final checkpoint is aligned), then start it with "
            f"--workers {N}"
        )
    if int(latest.metadata.get("loop_log", 0)) > 0 or plan.cyclic:
        raise ConfigError(
            f"job {job!r} has a loop (iterate): records its back-edge may hold cannot be "
            f"re-routed to another parallelism yet. {how}"
        )
    if plan.copartitioned:
        raise ConfigError(
            f"job {job!r}: keyed steps read keyed sources {list(plan.copartitioned)} without a "
            "shuffle, so their state sits where Kafka's partitioner put each key, not by key "
            f"group, and cannot be redistributed. {how}; or key_by(...) after the source "
            "(a shuffle) in a new job"
        )
    if recovery == "local":
        raise ConfigError(
            f"job {job!r}: change the parallelism with --recovery global (a worker restarted "
            "alone would restore the old shape); switch back to local recovery afterwards"
        )


def _stage_states(states: dict[str, dict[str, Any]], stage: str) -> dict[int, dict[str, Any]]:
    return {subtask_of(t): s for t, s in states.items() if t.rpartition(".")[0] == stage}


def _merge_operators(
    olds: list[dict[str, Any]],
    keep: Callable[[Any], bool],
    dedup_prefix: Callable[[str, int], str],
    old_subtasks: list[int],
) -> tuple[dict[str, Any], dict[str, str]]:

    # A local-recovery replay check (``~replay-<stage>``) describes the old channels: the new
    # shape reads new ones, so it starts without one.
    names = sorted({n for s in olds for n in s["operators"] if not n.startswith("~replay-")})
    kinds: dict[str, str] = {}
    for s in olds:
        kinds.update(s.get("kinds", {}))
    operators: dict[str, Any] = {}
    for name in names:
        kind = kinds.get(name)
        if kind is None:
            raise ConfigError(
                f"step {name!r}: its checkpoint does not say what kind of state it holds (a "
                "checkpoint of an older eosflow): restore it at its old parallelism once, so "
                "that a newer checkpoint records it, then change the parallelism"
            )
        if kind in _DEDUP_KINDS:
            from dedup.rescale import merge_dedup_states

            operators[name] = merge_dedup_states(
                [
                    (dedup_prefix(name, sub), s["operators"][name])
                    for sub, s in zip(old_subtasks, olds, strict=True)
                    if name in s["operators"]
                ]
            )
        else:
            from processor.runtime.shape.rescale_state import redistribute

            operators[name] = redistribute(
                kind, [s["operators"][name] for s in olds if name in s["operators"]], keep
            )
    return operators, kinds


def new_states(
    plan: Plan,
    old: Topology,
    states: dict[str, dict[str, Any]],
    *,
    checkpoint_id: int,
    generation: int,
    channel_starts: dict[tuple[str, int], int],
) -> dict[str, dict[str, Any]]:
    """The snapshot of every task of ``plan`` (the new shape), from the old tasks' ``states``
    (the module docstring, step 3). Pure: no I/O."""
    N, G = plan.parallelism, plan.key_groups
    owners = shared_keys(old.parallelism, old.key_groups, N, G)
    out: dict[str, dict[str, Any]] = {}
    for stage in plan.stages:
        by_sub = _stage_states(states, stage.name)
        for i in range(N):
            task = stage.task(i)
            subs = sorted(s for s in owners[i] if s in by_sub)
            if stage.sources:  # every old source task: partitions move by p % N
                subs = sorted(by_sub)
            olds = [by_sub[s] for s in subs]

            def keep(key: Any, i: int = i) -> bool:
                from processor.runtime.shape.rescale_state import key_bytes

                return key_owner(key_bytes(key), N, G) == i

            def prefix(step: str, sub: int) -> str:
                from dedup.rescale import dedup_prefix

                return dedup_prefix(plan.job, step, sub, old.epoch)

            operators, kinds = _merge_operators(olds, keep, prefix, subs)
            positions: dict[Any, int] = {}
            max_ts: dict[Any, int] = {}
            if stage.sources:
                for s in olds:
                    for tp, offset in s["positions"].items():
                        if tp[1] % N == i:
                            positions[tp] = offset
                    for tp, ts in s["max_ts"].items():
                        if tp[1] % N == i:
                            max_ts[tp] = ts
            mine = set(channel_inputs(plan, stage, i))
            inputs = [tp for tp in channel_starts if tp in mine]
            for tp in inputs:
                positions[tp] = channel_starts[tp]
            watermarks = [s["watermark"] for s in olds]
            out[task] = {
                "task": task,
                "checkpoint": checkpoint_id,
                "generation": generation,
                "positions": positions,
                "barrier_seen": sorted(inputs),  # nothing to replay: new, empty channels
                "channel_wm": {},
                "max_ts": max_ts,
                "watermark": min(watermarks) if watermarks else None,
                "operators": operators,
                "kinds": {n: k for n, k in kinds.items() if n in operators},
                "sinks": {},  # settled before (step 2)
                "recovering": {},
            }
    return out


def _check_channels_done(
    plan: Plan, old: Topology, states: dict[str, dict[str, Any]], checkpoint_id: int
) -> None:
    """Every old task saw the barrier on each of its channels (an aligned checkpoint): nothing
    of the old channels is in flight. A checkpoint from before manifests said whether they were
    aligned is checked here."""
    old_plan = compile_flow(plan.flow, old.parallelism, key_groups=old.key_groups, epoch=old.epoch)
    reads = {
        (s.name, i): set(channel_inputs(old_plan, s, i))
        for s in old_plan.stages
        for i in range(old_plan.parallelism)
    }
    for task, state in states.items():
        inputs = reads.get((task.rpartition(".")[0], subtask_of(task)), set())
        missing = inputs - {tuple(tp) for tp in state.get("barrier_seen", ())}
        if missing:
            raise ConfigError(
                f"job {plan.job!r}: task {task} of checkpoint {checkpoint_id} had not seen the "
                f"barrier on {len(missing)} channel(s) (an unaligned checkpoint): their records "
                f"in flight cannot move to another parallelism. Take an aligned one first: "
                f"`eosflow savepoint {plan.job} --stop`, then change the parallelism"
            )


def rescale(
    plan: Plan,
    old: Topology,
    store: SnapshotStore,
    transport: Any,
    latest: Manifest,
    *,
    metadata: dict[str, Any],
    settle: Callable[[dict[str, dict[str, Any]], int], int],
    fault: Callable[[str], None] = lambda point: None,
) -> Manifest:
    """Writes checkpoint ``latest + 1`` of ``plan``'s shape (the module docstring); returns its
    manifest. ``settle(states, generation)`` settles the old shape's sinks."""
    from processor.runtime.checkpoints.coordinator import LAST_CHECKPOINT, last_checkpoint

    job = plan.job
    started = time.monotonic()
    states = {t: store.read_task_snapshot(h) for t, h in latest.tasks.items()}
    for task, state in states.items():
        if state.get("recovering"):
            raise ConfigError(
                f"job {job!r}: task {task} of checkpoint {latest.checkpoint_id} was still "
                "replaying channels of an unaligned checkpoint; take an aligned one first "
                f"(`eosflow savepoint {job} --stop`), then change the parallelism"
            )
    _check_channels_done(plan, old, states, latest.checkpoint_id)
    # Everything that can refuse runs before the old sinks are settled (a dry run of the merge).
    new_states(plan, old, states, checkpoint_id=0, generation=0, channel_starts={})
    generation = store.next_generation(job)
    settled = settle(states, generation)
    fault("after-settle-before-rewrite")
    ensure_channels(plan, transport)
    starts = {(t, p): offset for t, p, offset in end_positions(plan, transport)}
    chk = (
        max(latest.checkpoint_id, store.newest_checkpoint_id(job), last_checkpoint(store, job)) + 1
    )
    built = new_states(
        plan, old, states, checkpoint_id=chk, generation=generation, channel_starts=starts
    )
    handles: dict[str, SnapshotHandle] = {
        task: store.write_task_snapshot(job, chk, task, state, incarnation=generation)
        for task, state in built.items()
    }
    store.write_job_file(job, LAST_CHECKPOINT, str(chk).encode())
    store.complete(
        job,
        chk,
        handles,
        {
            **metadata,
            "generation": generation,
            "duration_ms": int((time.monotonic() - started) * 1000),
            "loop_log": 0,
            "aligned": True,
            # a drained job stays drained: its sources keep their positions
            # (runtime.checkpoints.drain)
            **{k: v for k, v in latest.metadata.items() if k == "drained"},
            "rescaled_from": {
                "checkpoint": latest.checkpoint_id,
                "topology": old.as_json(),
                "settled": settled,
            },
        },
    )
    log.info(
        "rescaled job=%s from checkpoint=%d (%d workers, epoch %d) to checkpoint=%d "
        "(%d workers, epoch %d, key groups %d) settled=%d in %.2fs",
        job, latest.checkpoint_id, old.parallelism, old.epoch, chk, plan.parallelism,
        plan.epoch, plan.key_groups, settled, time.monotonic() - started,
    )  # fmt: skip
    return store.load(job, chk)


def runner_fault(point: str) -> None:
    """Crash-test hook: SIGKILLs the runner itself at ``point`` when the environment variable
    ``EOSFLOW_RUNNER_FAULT`` names it (a no-op otherwise)."""
    if os.environ.get("EOSFLOW_RUNNER_FAULT") == point:
        log.warning("runner fault %s: SIGKILL", point)
        os.kill(os.getpid(), signal.SIGKILL)


def prepare_shape(
    plan: Plan,
    store: SnapshotStore,
    transport: Any,
    latest: Manifest | None,
    *,
    recovery: str,
    metadata: dict[str, Any],
    checkpoint_interval: float | None,
) -> tuple[Plan, Manifest | None]:
    """The plan of this start, compiled with the job's topology, and the checkpoint to restore:
    rescaled first when the parallelism changed (see the module docstring). Records the
    topology for a job without a completed checkpoint."""
    job, N = plan.job, plan.parallelism
    old = current_topology(store, job, latest)
    legacy = latest is not None and not latest.metadata.get("topology")
    highest = highest_epoch(store, job)
    topo = new_topology(old, N, legacy=legacy, highest=highest)
    plan = compile_flow(
        plan.flow,
        N,
        combine=recovery != "local",
        key_groups=topo.key_groups,
        epoch=topo.epoch,
    )
    if old is not None and topo != old:
        # Before any topic of the new epoch exists: a crash from here on never reuses it.
        store.write_job_file(job, EPOCH_FILE, str(topo.epoch).encode())
        old_plan = compile_flow(
            plan.flow, old.parallelism, key_groups=old.key_groups, epoch=old.epoch
        )

        def settle(states: dict[str, dict[str, Any]], generation: int) -> int:
            runner_fault("before-settle")
            return settle_old_shape(
                plan.flow,
                states,
                parallelism=old.parallelism,
                stage_names=[s.name for s in old_plan.stages],
                epoch=old.epoch,
                generation=generation,
                snapshot_url=store.url,
                checkpoint_interval=checkpoint_interval,
                fault=runner_fault,
            )

        if latest is None:  # never checkpointed: only the old writers' orphans to clean
            settle({t: {"sinks": {}} for t in old_plan.task_names()}, store.next_generation(job))
            _restart_channels(plan, store, transport)
        else:
            check_rescalable(plan, latest, old, recovery)
            meta = {**metadata, "topology": topo.as_json()}
            latest = rescale(
                plan, old, store, transport, latest, metadata=meta, settle=settle,
                fault=runner_fault,
            )  # fmt: skip
            runner_fault("after-rescale-before-spawn")
    record_parallelism(store, job, max(N, old.parallelism if old else N))
    store.write_job_file(job, TOPOLOGY_FILE, json.dumps(topo.as_json()).encode())
    if plan.epoch:
        delete_other_epochs(plan, transport, max(highest, plan.epoch))
        sweep_dedup(plan, store)
    return plan, latest


def _restart_channels(plan: Plan, store: SnapshotStore, transport: Any) -> None:
    """A job that never completed a checkpoint changes shape: its recorded fresh-start
    positions (``_START``) keep the sources' and name the new channels at their ends."""
    saved = store.read_job_file(plan.job, START_FILE)
    if saved is None:
        return
    ensure_channels(plan, transport)
    sources = {s.params["topic"] for s in plan.flow.steps.values() if s.kind == "source"}
    kept = [entry for entry in json.loads(saved) if entry[0] in sources]
    kept += end_positions(plan, transport)
    store.write_job_file(plan.job, START_FILE, json.dumps(kept).encode())
