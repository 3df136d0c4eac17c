"""What older shapes of a job leave behind after a change of parallelism, and its removal:
their channel topics, and the dedup steps' Redis IDs that no retained checkpoint needs
(:mod:`processor.runtime.shape.rescale`). Both best effort, at the start of a job whose shape epoch
is above 0: what fails is tried again at the next start."""

from __future__ import annotations

import logging
from typing import Any

from processor.compiler import Plan, compile_flow
from processor.runtime.shape.topology import current_topology, subtask_of
from processor.snapshot.store import SnapshotStore
from processor.wire import job_topic_prefix

__all__ = ["delete_other_epochs", "sweep_dedup"]

log = logging.getLogger(__name__)


def delete_other_epochs(plan: Plan, transport: Any, highest: int) -> None:
    """Deletes the channel topics of every other shape epoch of the job (best effort): a
    checkpoint of an older shape is always rewritten into a new epoch before it runs, so no
    start reads them again, and an interrupted rescale may have left some behind."""
    delete = getattr(transport, "delete_topics", None)
    if delete is None:
        return
    mine = {e.topic for e in plan.edges}
    names: set[str] = set()
    for epoch in range(highest + 1):
        if epoch != plan.epoch:
            shape = compile_flow(plan.flow, 1, key_groups=plan.key_groups, epoch=epoch)
            names |= {e.topic for e in shape.edges} - mine
    try:
        listed = getattr(transport, "list_topics", None)
        if listed is not None:
            names &= set(listed(job_topic_prefix(plan.job)))
        if names:
            delete(sorted(names))
            log.info("deleted the channel topics of older shapes: %s", sorted(names))
    except Exception as exc:  # the next start tries again
        log.warning("could not delete the channel topics of older shapes %s: %s", names, exc)


def sweep_dedup(plan: Plan, store: SnapshotStore) -> int:
    """Deletes the Redis IDs of dedup steps that older shapes wrote and no retained checkpoint
    needs any more (own prefixes of a checkpoint's shape, and the prefixes its states inherit:
    :func:`dedup.rescale.referenced_prefixes`). Best effort: Redis down only delays it."""
    from dedup.rescale import sweep_retired
    from dedup.store import redis_client

    job = plan.job
    steps = [s for s in plan.flow.steps.values() if s.kind == "dedup"]
    if not steps:
        return 0
    try:
        keep = _referenced_prefixes(plan, store, [s.name for s in steps])
    except Exception as exc:  # an unreadable checkpoint: delete nothing rather than too much
        log.warning("dedup: old IDs not swept (a retained checkpoint is unreadable: %s)", exc)
        return 0
    deleted = 0
    for step in steps:
        try:
            client = redis_client(step.params.get("redis_url"))
            deleted += sweep_retired(client, job, step.name, keep[step.name], plan.epoch)
        except Exception as exc:  # the next start tries again
            log.warning(
                "dedup %s: old IDs not swept (%s); the next start tries again", step.name, exc
            )
    if deleted:
        log.info("dedup: deleted %d Redis keys of older shapes of job %s", deleted, job)
    return deleted


def _referenced_prefixes(plan: Plan, store: SnapshotStore, names: list[str]) -> dict[str, set[str]]:
    """Dedup step -> the Redis prefixes the retained checkpoints need (own and inherited)."""
    from dedup.rescale import dedup_prefix, referenced_prefixes

    job = plan.job
    stage_of = {n: st.name for st in plan.stages for n in st.steps}
    keep: dict[str, set[str]] = {n: set() for n in names}
    for chk in store.completed_ids(job):
        manifest = store.load(job, chk)
        topo = current_topology(store, job, manifest)
        assert topo is not None
        for task, handle in manifest.tasks.items():
            held = [n for n in keep if stage_of[n] == task.rpartition(".")[0]]
            if not held:
                continue
            state = store.read_task_snapshot(handle)
            for name in held:
                keep[name].add(dedup_prefix(job, name, subtask_of(task), topo.epoch))
                op = state["operators"].get(name)
                if op is not None:
                    keep[name] |= referenced_prefixes(op)
    return keep
