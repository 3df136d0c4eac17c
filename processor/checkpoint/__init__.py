"""Asynchronous Barrier Snapshotting: barrier alignment (the coordinator joins with the engine)."""

from processor.checkpoint.aligner import (
    AbortCheckpoint,
    Action,
    AlignmentDone,
    BarrierAligner,
    ForwardBarrier,
    Pause,
    Resume,
    TakeSnapshot,
)

__all__ = [
    "AbortCheckpoint",
    "Action",
    "AlignmentDone",
    "BarrierAligner",
    "ForwardBarrier",
    "Pause",
    "Resume",
    "TakeSnapshot",
]
