"""Where a run reads: the topics it needs, the end of a bounded run, the start of a fresh job.

Both ends of a run are fixed once and kept, so that restarts read the same range:

* ``--until-idle`` ends at the source partitions' last stable offsets when ``eosflow run``
  started (records written later are the next run's).
* A job without a completed checkpoint starts where it was when it first started, recorded in
  its snapshot store (``_START``) before any worker runs: a ``start="latest"`` source at the end
  it had then, and every channel partition at its end then. Without this a restart before the
  first checkpoint would skip what a "latest" source received meanwhile, and a job whose state
  was deleted (its snapshot store, so its generations, begin again at 1) would read an earlier
  run's channel records, whose ``GenerationStart(1)`` would let them through. Once a checkpoint
  completes, its positions govern and ``_START`` is not read again.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from processor.compiler import Plan
from processor.snapshot.store import SnapshotStore

__all__ = ["START_FILE", "prepare_topics", "start_positions"]

log = logging.getLogger(__name__)

#: The job file holding a fresh job's start positions.
START_FILE = "_START"

Offsets = list[list[Any]]  # [[topic, partition, offset], ...]: JSON-able


def prepare_topics(
    plan: Plan, transport: Any, *, until_idle: bool, run_dir: Path
) -> tuple[dict[str, int], Offsets | None]:
    """Creates the channel topics; returns the source topics' partition counts and, for a
    bounded run, the end offsets it stops at (also written to ``run_dir/end_offsets.json``)."""
    steps = plan.flow.steps
    topics = [s.params["topic"] for s in steps.values() if s.kind == "source"]
    counts = {t: transport.partition_count(t) for t in topics}
    P = plan.parallelism
    transport.ensure_topics({e.topic: P * P for e in plan.edges})
    if not until_idle:
        return counts, None
    tps = [(t, p) for t in topics for p in range(counts[t])]
    found = transport.end_offsets(tps)
    ends = [[t, p, found[(t, p)]] for t, p in tps]
    (run_dir / "end_offsets.json").write_text(json.dumps(ends))
    return counts, ends


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
    P = plan.parallelism
    tps = [(t, p) for t in sorted(latest) for p in range(counts[t])]
    tps += [(e.topic, p) for e in plan.edges for p in range(P * P)]
    found = transport.end_offsets(tps) if tps else {}
    starts = [[t, p, found[(t, p)]] for t, p in tps]
    store.write_job_file(plan.job, START_FILE, json.dumps(starts).encode())
    return starts
