"""The runtime: what runs a compiled pipeline. Its modules live in rooms (subpackages), each
owning one part of a run; the modules here at the root are the floor every room stands on.

The floor (this package's own modules) holds what a run *is*, as values, and what both ends of
the control plane share: :mod:`.job` (run options and their parsing, faults, results, the
runner's view of a worker, job directories), :mod:`.control` (the TCP control plane between the
runner and its workers), :mod:`.pipeline` and :mod:`.redirect` (loading a pipeline file and the
pluggable parts a job names; certify's rewrite of it), :mod:`.topics` (the topics a run reads,
the ends of a bounded run, the start of a fresh job). The floor imports no room.

The rooms, and the rooms each may import (the floor: all of them)::

    supervision  -> observe, shape, checkpoints, task, operators
    observe      -> checkpoints
    shape        -> checkpoints, operators
    checkpoints  -> operators
    task         -> operators
    operators    -> (the floor only)

===============  ============================================================================
``operators``    the steps of a stage as objects that process batches: the operator contract,
                 windows, sessions, joins, ``process`` and its timers, the ``dedup`` step, the
                 step-kind table, which operator state a restore keeps
``task``         one subtask of a stage between Kafka partitions: its inputs, operator chain,
                 snapshots and acks, output channels, dead letters, channel purging
``checkpoints``  a job's checkpoints on the runner's side: the coordinator that completes them,
                 drained checkpoints
``shape``        a job's shape (parallelism, key groups, shape epoch) and its change: the new
                 shape's checkpoint, keyed state redistributed, the old shape's sinks settled,
                 older shapes' leftovers removed; savepoints and a job restored from one
``observe``      what a running job tells: metrics, the job page and its HTTP server
``supervision``  the processes of a run: the runner (coordinator loop, supervision, recovery,
                 stop and restart, progress line) on the local and Spark runners, start-up checks,
                 worker health, and the worker process the runner starts
===============  ============================================================================

The directions say who may know whom: a task never knows the job side (the coordinator, the
runner: it talks to them over :mod:`.control` only); what observes a job reads the coordinator's
values and never steers the runner; a room below never imports a room above. Checked, with no
import cycle between rooms or files, by ``tests/unit/test_layers.py``; docs/architecture.md,
"The runtime's rooms".
"""
