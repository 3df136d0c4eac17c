"""A task: subtask ``i`` of one stage, running its fused operators between Kafka partitions.

Source tasks read input partitions ``p % P == i`` and inject barriers when the coordinator
triggers a checkpoint. Channel tasks read their ``P`` partitions of every input channel topic and
align barriers with :class:`~processor.checkpoint.BarrierAligner`. Both write to their output
channels with the worker's idempotent writer and snapshot asynchronously.

The task is :class:`Task` (``core``), which owns its collaborators and wires them in one place
(Flink's ``StreamTask`` with its input gates and barrier handler, its ``OperatorChain`` and its
``SubtaskCheckpointCoordinator``); each has its own state and a narrow surface, and is testable
alone:

===============  ============================================================================
``chain``        :class:`OperatorChain`: the fused operators, output channels, sinks,
                 dead letters; pushing records, watermarks, processing-time timers
``checkpoints``  :class:`SubtaskCheckpoints`: trigger, snapshot, restore, barrier
                 forwarding, acks, completion (2PC sinks)
``inputs``       :class:`ChannelInputs`: the live fast path, recovery modes (replay /
                 drop), loop back-edges (Algorithm 2), local recovery by record ID, the
                 barrier aligner's actions
``sources``      :class:`SourceInputs`: decoding, timestamps, bad records, the source
                 watermark
``core``         :class:`Task`: the wiring, the lifecycle and the batch loop: ``open``,
                 ``step``, ``close``
``channels``     :class:`TaskEnv` (what the tasks of one worker share) and
                 :class:`~.channels.ChannelOut` (the operator that writes to an output channel)
``dead_letters`` :class:`~.dead_letters.DeadLetters`: failed records with their cause
``purge``        channel records no restore can read any more: a task's
                 :class:`~.purge.PurgeFloor`, its worker's :class:`~.purge.ChannelPurger`
===============  ============================================================================

Dependencies point one way: ``core`` -> ``inputs`` -> ``checkpoints`` -> ``chain``, and
``sources`` -> ``chain``. The inputs push into the chain and hand the aligner's actions to the
checkpoint coordinator (:class:`~.inputs.Barriers`); the coordinator is given the inputs at each
call (:class:`~.checkpoints.InputState`), never the task.

The task room of :mod:`processor.runtime` may import the operators room and the runtime's floor;
never the job's side (the coordinator, the runner, what observes a job: it talks to them over
:mod:`processor.runtime.control` only).

Invariants:
    ``inputs.pos[tp]`` is the offset after the last record of ``tp`` that went through the
    operators (or was deliberately dropped); records of a paused channel that were fetched
    anyway are stashed, never processed early, and replayed in order on resume.
    Dead letters are written to their writer before the barrier of the epoch that read them.
"""

from processor.runtime.task.channels import TaskEnv
from processor.runtime.task.core import Task

__all__ = ["Task", "TaskEnv"]
