"""A job's shape as its snapshot store records it: the topology, the newest shape epoch, and the
highest parallelism its sinks ever ran at.

A job's **topology** is its parallelism ``P``, its key-group count ``G`` (a keyed record goes
to the owner of key group ``crc32(key) % G``, :func:`processor.wire.owner_of`) and its shape
epoch (one more at each change of ``P``; the channel topics of each epoch are new topics, since
their partition count is ``P*P``). Every manifest records it (metadata ``topology``); a job
without a completed checkpoint keeps it in the job file ``_TOPOLOGY``; a checkpoint written
before key groups existed is read as ``G = P`` (``crc32 % P`` is ``owner_of`` with ``G = P``).

The rescale (:mod:`processor.runtime.shape.rescale`), the settling of an old shape's sinks
(:mod:`processor.runtime.shape.settle`) and the removal of what older shapes left behind
(:mod:`processor.runtime.shape.shape_gc`) all read it from here.

:func:`record_parallelism` keeps the highest parallelism a job ever ran at in the job file
:data:`SINK_SUBTASKS`, so ``eosflow txn list|abort`` cover every transactional id ever used.

Invariants:
    The job file ``_EPOCH`` names a new epoch before any topic of it exists, so no two shapes
    share a channel topic or a dedup prefix, even across a crash mid-rescale.
    :data:`SINK_SUBTASKS` only grows.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass

from processor.compiler import Plan
from processor.errors import ConfigError
from processor.snapshot.store import Manifest, SnapshotStore
from processor.wire import MIN_KEY_GROUPS, default_key_groups

__all__ = [
    "EPOCH_FILE",
    "SINK_SUBTASKS",
    "TOPOLOGY_FILE",
    "Topology",
    "check_shape",
    "current_topology",
    "highest_epoch",
    "new_topology",
    "record_parallelism",
    "recorded_parallelism",
    "subtask_of",
]

log = logging.getLogger(__name__)

#: The job file holding the topology of a job that has no completed checkpoint yet.
TOPOLOGY_FILE = "_TOPOLOGY"
#: The job file holding the newest shape epoch the job ever started: written before any topic
#: of that epoch is created, so that no two shapes share a channel topic or a dedup prefix.
EPOCH_FILE = "_EPOCH"
#: Job file: the highest parallelism the job ever ran at (``eosflow txn`` reads it).
SINK_SUBTASKS = "_SINK_SUBTASKS"


@dataclass(frozen=True)
class Topology:
    """See the module docstring."""

    parallelism: int
    key_groups: int
    epoch: int = 0

    def as_json(self) -> dict[str, int]:
        return asdict(self)


def subtask_of(task: str) -> int:
    """The subtask index of a task name ``<stage>.<i>``."""
    return int(task.rpartition(".")[2])


def current_topology(store: SnapshotStore, job: str, latest: Manifest | None) -> Topology | None:
    """The topology the job last ran with (``None``: a new job)."""
    if latest is not None:
        recorded = latest.metadata.get("topology")
        if recorded:
            return Topology(**recorded)
        if latest.tasks:  # written before key groups: crc32 % P is owner_of with G = P
            before = 1 + max(subtask_of(t) for t in latest.tasks)
            return Topology(before, before, 0)
    raw = store.read_job_file(job, TOPOLOGY_FILE)
    return Topology(**json.loads(raw)) if raw else None


def new_topology(
    old: Topology | None, parallelism: int, *, legacy: bool = False, highest: int = 0
) -> Topology:
    """The topology of a start at ``parallelism``: the old one if unchanged; a new job's key
    groups; or, for a change (another parallelism, or a checkpoint of an older shape than the
    newest the job ever ran, ``highest``), the next epoch after every one the job used, with
    the same key groups (the default count when the new parallelism is above it, when the old
    count is below the default: a job from before key groups, with ``G = P``)."""
    if old is None:
        return Topology(parallelism, default_key_groups(parallelism), 0)
    if old.parallelism == parallelism and old.epoch >= highest:
        return old
    groups = old.key_groups
    if legacy or parallelism > groups or groups < MIN_KEY_GROUPS:
        groups = max(default_key_groups(parallelism), groups)
    return Topology(parallelism, groups, max(old.epoch, highest) + 1)


def highest_epoch(store: SnapshotStore, job: str) -> int:
    """The newest shape epoch the job ever started (job file ``_EPOCH``; 0 without one)."""
    raw = store.read_job_file(job, EPOCH_FILE)
    return int(raw) if raw else 0


def check_shape(plan: Plan, store: SnapshotStore, latest: Manifest | None) -> None:
    """A restart restores a checkpoint of the shape it runs (the newest one was unreadable and
    an older shape's is the newest left, say): otherwise the job must be started again, which
    rescales it.

    Raises:
        ConfigError: naming both shapes.
    """
    found = current_topology(store, plan.job, latest) if latest is not None else None
    if found is None:
        return
    if (found.parallelism, found.epoch) != (plan.parallelism, plan.epoch):
        raise ConfigError(
            f"job {plan.job!r}: the newest readable checkpoint ({latest and latest.checkpoint_id}"
            f") was taken with {found.parallelism} workers (shape epoch {found.epoch}), and this "
            f"run has {plan.parallelism} (epoch {plan.epoch}): start the job again (eosflow "
            "run), which rescales that checkpoint"
        )


def record_parallelism(store: SnapshotStore, job: str, parallelism: int) -> int:
    """Record that ``job`` runs at ``parallelism``; returns the highest ever recorded.

    ``eosflow txn list|abort`` fence the transactional ids of subtasks ``0 ..`` that number:
    after a rescale from 4 to 2, ids of subtasks 2 and 3 exist on the broker too.
    """
    highest = max(parallelism, recorded_parallelism(store, job))
    store.write_job_file(job, SINK_SUBTASKS, f"{highest}\n".encode())
    return highest


def recorded_parallelism(store: SnapshotStore, job: str) -> int:
    """The highest parallelism recorded by :func:`record_parallelism` (0: none)."""
    raw = store.read_job_file(job, SINK_SUBTASKS)
    if not raw:
        return 0
    try:
        return int(raw.decode().strip())
    except ValueError:
        log.warning("job=%r job file %s is not an integer: %r; ignored", job, SINK_SUBTASKS, raw)
        return 0
