"""Where a run reads: the topics it needs, the end of a bounded run, the start of a fresh job.

Both ends of a run are fixed once and kept, so that restarts read the same range:

* ``--until-idle`` ends at the source partitions' end offsets (high watermarks) when
  ``eosflow run`` started (records written later are the next run's; a transaction open then is
  waited for, and its records read if it commits: :mod:`connectors.offsets`).
* A job without a completed checkpoint starts where it was when it first started, recorded in
  its snapshot store (``_START``) before any worker runs: a ``start="latest"`` source at the end
  it had then, and every channel partition a task reads at its end then. Without this a restart
  before the first checkpoint would skip what a "latest" source received meanwhile, and a job
  whose state was deleted (its snapshot store, so its generations, begin again at 1) would read
  an earlier run's channel records, whose ``GenerationStart(1)`` would let them through. Once a
  checkpoint completes, its positions govern and ``_START`` is not read again.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from processor.compiler import Plan, channel_partitions
from processor.errors import ConfigError
from processor.snapshot.store import SnapshotStore

__all__ = [
    "KEYED_FILE",
    "START_FILE",
    "check_graph",
    "check_keyed_sources",
    "end_positions",
    "ensure_channels",
    "prepare_topics",
    "start_positions",
]

log = logging.getLogger(__name__)

#: The job file holding a fresh job's start positions.
START_FILE = "_START"

#: The job file holding the partition counts of the keyed sources at the job's first start.
KEYED_FILE = "_KEYED_SOURCES"

Offsets = list[list[Any]]  # [[topic, partition, offset], ...]: JSON-able


def prepare_topics(
    plan: Plan, transport: Any, *, until_idle: bool, run_dir: Path
) -> tuple[dict[str, int], Offsets | None]:
    """Creates the channel topics; returns the source topics' partition counts and, for a
    bounded run, the end offsets it stops at (also written to ``run_dir/end_offsets.json``)."""
    steps = plan.flow.steps
    topics = [s.params["topic"] for s in steps.values() if s.kind == "source"]
    counts = {t: transport.partition_count(t) for t in topics}
    ensure_channels(plan, transport)
    if not until_idle:
        return counts, None
    tps = [(t, p) for t in topics for p in range(counts[t])]
    found = transport.end_offsets(tps)
    ends = [[t, p, found[(t, p)]] for t, p in tps]
    (run_dir / "end_offsets.json").write_text(json.dumps(ends))
    return counts, ends


def ensure_channels(plan: Plan, transport: Any) -> None:
    """Creates the channel topics of ``plan`` that do not exist yet (``P x P`` partitions)."""
    P = plan.parallelism
    transport.ensure_topics({e.topic: P * P for e in plan.edges})


def end_positions(
    plan: Plan, transport: Any, sources: list[tuple[str, int]] | None = None
) -> Offsets:
    """The end offsets now of the partitions ``sources``, then of every channel partition a
    task of ``plan`` reads (:func:`processor.compiler.channel_partitions`), in one broker call:
    where a fresh start reads them from."""
    tps = [*(sources or ()), *channel_partitions(plan)]
    found = transport.end_offsets(tps) if tps else {}
    return [[t, p, found[(t, p)]] for t, p in tps]


def start_positions(
    plan: Plan, store: SnapshotStore, transport: Any, counts: dict[str, int]
) -> Offsets:
    """The fresh-start positions of the job's "latest" sources and channels: read from the
    store if an earlier start recorded them, else taken from the broker now and recorded."""
    saved = store.read_job_file(plan.job, START_FILE)
    if saved is not None:
        starts: Offsets = json.loads(saved)
        log.info("fresh start at the positions recorded at the job's first start: %s", starts)
        return starts
    sources = [s for s in plan.flow.steps.values() if s.kind == "source"]
    latest = {s.params["topic"] for s in sources if s.params["start"] == "latest"}
    tps = [(t, p) for t in sorted(latest) for p in range(counts[t])]
    starts = end_positions(plan, transport, tps)
    store.write_job_file(plan.job, START_FILE, json.dumps(starts).encode())
    return starts


def check_keyed_sources(plan: Plan, store: SnapshotStore, counts: dict[str, int]) -> None:
    """A keyed step that reads a keyed source without a shuffle keeps each key's state in the
    subtask that reads the key's partition. That holds only while every key stays in its
    partition: topics that meet in one keyed step must have equal partition counts, and no
    topic may gain partitions during the job's life (Kafka's partitioner would send some keys
    elsewhere, splitting their state). The counts are recorded at the first start and compared
    at every later one.

    Raises:
        ConfigError: the topics' counts differ, or a count changed since the first start.
    """
    if not plan.copartitioned:
        return
    topics = sorted({t for group in plan.copartitioned for t in group})
    for group in plan.copartitioned:
        found = {t: counts[t] for t in group}
        if len(set(found.values())) > 1:
            raise ConfigError(
                f"job {plan.job!r}: keyed sources of topics {found} (partition counts) meet in "
                "one keyed step without a shuffle, so each key must be in the same partition "
                "of every topic: give the topics the same number of partitions (and the same "
                "partitioner), or re-key the union with key_by(...) to shuffle it"
            )
    now = {t: counts[t] for t in topics}
    saved = store.read_job_file(plan.job, KEYED_FILE)
    if saved is None:
        store.write_job_file(plan.job, KEYED_FILE, json.dumps(now).encode())
        return
    first: dict[str, int] = json.loads(saved)
    changed = {t: (first[t], n) for t, n in now.items() if t in first and first[t] != n}
    if changed:
        what = ", ".join(f"{t!r} from {a} to {b}" for t, (a, b) in sorted(changed.items()))
        raise ConfigError(
            f"job {plan.job!r}: the partition count of keyed source topic(s) changed since the "
            f"job first started ({what}). Its keyed state was built with each key in the "
            "partition Kafka's partitioner chose for the old count; with the new count some "
            "keys are in other partitions, read by other subtasks, and their state would be "
            "split. Restore the old partition count, run the pipeline under a new job name "
            "(starting over), or key_by(...) after the source (a shuffle; not "
            "state-compatible with this job either)"
        )
    if set(now) - set(first):  # a keyed source added to the job: record it too
        store.write_job_file(plan.job, KEYED_FILE, json.dumps({**now, **first}).encode())


def check_graph(plan: Plan, restored_tasks: list[str]) -> None:
    """The plan's stages must be the stages whose state the checkpoint to restore holds.

    A shuffle added or removed (``keyed=`` toggled on a source, a ``key_by`` added) moves a
    stateful step to another task, where its state would not be found; a stage added (even a
    new branch) has no snapshot to start from and no start positions (the workers failed on it
    with a ``KeyError``); a stage removed would drop its state. Changing a running job's graph
    is a migration. (Another parallelism is a rescale: :mod:`processor.runtime.shape.rescale`.)

    Raises:
        ConfigError: naming the stages added and removed.
    """
    if not restored_tasks:
        return
    before = {t.rpartition(".")[0] for t in restored_tasks}
    now = {s.name for s in plan.stages}
    gone, added = sorted(before - now), sorted(now - before)
    if gone or added:
        raise ConfigError(
            f"job {plan.job!r}: its stages changed since its last checkpoint (stages no longer "
            f"there: {gone or 'none'}; new stages: {added or 'none'}). A "
            "shuffle added or removed (e.g. keyed= changed on a source, a key_by added) moves "
            "stateful steps between tasks, and a new stage has no snapshot to start from, so "
            "restoring would lose or misplace state. Run the pipeline as it was, or under a "
            f"new job name (starting over); `eosflow run PIPELINE --explain` shows the stages"
        )
