"""A job's checkpoints on the runner's side (the checkpoints room of :mod:`processor.runtime`).

Owns :mod:`.coordinator` (the checkpoint coordinator: trigger, acknowledgements, timeouts,
completion, retention) and :mod:`.drain` (what a drained bounded run records, and the refusal
to continue one where new input would be late). Savepoints (checkpoints a user asks for and
keeps) are a change of a job's state and live in the shape room. The task's side of a checkpoint is
:mod:`processor.runtime.task.checkpoints`; barrier alignment is :mod:`processor.checkpoint`.

May import: the operators room (which steps depend on the watermark) and the runtime's floor;
never the task, the runner, or what observes a job.
"""
