"""Snapshot storage: a safe state codec, the snapshot and manifest file format, checkpoint
files on any fsspec URL, and the job's lease in them.

See docs/engine.md, "Checkpoints", and docs/engine.md, "Recovery (global)". Tasks write their
snapshots with :meth:`SnapshotStore.write_task_snapshot`; the coordinator marks a checkpoint
completed with :meth:`SnapshotStore.complete` once every task has acknowledged; recovery starts
from :meth:`SnapshotStore.latest_completed`.
"""

from __future__ import annotations

from processor.snapshot.codec import dumps, loads
from processor.snapshot.fileformat import (
    FORMAT_VERSION,
    Manifest,
    SnapshotHandle,
    decode_snapshot,
    encode_snapshot,
)
from processor.snapshot.store import MANIFEST, SnapshotStore

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST",
    "Manifest",
    "SnapshotHandle",
    "SnapshotStore",
    "decode_snapshot",
    "dumps",
    "encode_snapshot",
    "loads",
]
