"""A job's shape and its change (the shape room of :mod:`processor.runtime`).

Owns :mod:`.topology` (a job's parallelism, key-group count and shape epoch as its snapshot
store records them), :mod:`.rescale` (the checkpoint of a new shape), :mod:`.rescale_state`
(keyed operator state redistributed between old and new subtasks), :mod:`.settle` (the old
shape's sinks settled before a restart), :mod:`.shape_gc` (older shapes' channel topics and
dedup IDs removed), :mod:`.savepoints` (checkpoints a user asks for and keeps, and a job
restored from one, its shape included) and :mod:`.savepoint_state` (what a savepoint carries
beyond its checkpoint: dedup IDs, channel positions rebased after a reset).
docs/design-rescaling.md, docs/engine.md "Savepoints".

May import: the checkpoints room (the latest checkpoint), the operators room and the runtime's
floor; never the task, the runner, or what observes a job.
"""
