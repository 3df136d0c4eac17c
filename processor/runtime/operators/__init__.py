"""Operators: the steps of a stage as objects that process batches of records (the operators
room of :mod:`processor.runtime`).

Owns the operator contract and every operator a stage fuses: :mod:`.core` (the contract,
:data:`~.core.Record`, the watermark bounds, map / filter / flat_map / key_by, the running
aggregation, the sink), :mod:`.windows` (windowed aggregation and the pre-shuffle combiner),
:mod:`.sessions`, :mod:`.joins`, :mod:`.process` (keyed process functions and their timers),
:mod:`.dedup_step` (the ``dedup`` step and the local-recovery replay check), :mod:`.registry`
(which operator runs each step kind) and :mod:`.state_map` (which operator state a restore
keeps).

May import: the runtime's floor (the modules of :mod:`processor.runtime` itself) and the rest of
``processor`` below the runtime; no other room.
"""
