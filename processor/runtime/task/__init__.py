"""A task: subtask ``i`` of one stage, running its fused operators between Kafka partitions.

Source tasks read input partitions ``p % P == i`` and inject barriers when the coordinator
triggers a checkpoint. Channel tasks read their ``P`` partitions of every input channel topic and
align barriers with :class:`~processor.checkpoint.BarrierAligner`. Both write to their output
channels with the worker's idempotent writer and snapshot asynchronously.

The task is one class, :class:`Task`, built in layers, one concept a module, each layer seeing
the ones below it:

==================  =============================================================================
``base``            state, operator construction, pushing records, watermarks, stats
``checkpoints``     trigger, snapshot, restore, barrier forwarding, acks, completion (2PC sinks)
``inputs``          channel inputs: the live fast path, recovery modes (replay / drop),
                    loop back-edges (Algorithm 2), local recovery by record ID, alignment actions
``sources``         source inputs: decoding, timestamps, bad records, the source watermark
``core``            the lifecycle and the batch loop: ``open``, ``step``, ``close``
==================  =============================================================================

Invariants:
    ``self.pos[tp]`` is the offset after the last record of ``tp`` that went through the
    operators (or was deliberately dropped); records of a paused channel that were fetched
    anyway are stashed, never processed early, and replayed in order on resume.
    Dead letters are written to their writer before the barrier of the epoch that read them.
"""

from processor.runtime.channels import TaskEnv
from processor.runtime.task.core import Task

__all__ = ["Task", "TaskEnv"]
