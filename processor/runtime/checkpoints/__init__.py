"""A job's checkpoints on the runner's side (the checkpoints room of :mod:`processor.runtime`).

Owns :mod:`.coordinator` (the checkpoint coordinator: trigger, acknowledgements, timeouts,
completion, retention), :mod:`.drain` (what a drained bounded run records, and the refusal to
continue one where new input would be late) and :mod:`.savepoints` (checkpoints a user asks for
and keeps, and restoring a job from one). The task's side of a checkpoint is
:mod:`processor.runtime.task.checkpoints`; barrier alignment is :mod:`processor.checkpoint`.

May import: the operators room (which steps depend on the watermark) and the runtime's floor;
never the task, the runner, or what observes a job.
"""
