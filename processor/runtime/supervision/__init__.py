"""The processes of a run (the supervision room of :mod:`processor.runtime`).

Owns :mod:`.runner` (what every runner shares: the coordinator loop, supervision), its
collaborators :mod:`.recovery` (global and local recovery), :mod:`.lifecycle` (stop signals,
the restart strategy), :mod:`.reporting` (the progress line, ``status.json``, the run's result)
and :mod:`.identity` (the job's claim in the broker), :mod:`.health` (stuck workers),
:mod:`.preflight` (start-up checks), the runners :mod:`.local` (one OS process per worker) and
:mod:`.spark` (one Spark barrier job), and :mod:`.worker`, the worker process they start (``python
-m processor.runtime.supervision.worker``; in a Spark task on Spark).

May import every other room and the runtime's floor; no room imports it. Only the wiring above
the runtime (the CLI, :mod:`processor.certify`, :mod:`processor.testing`) starts a runner.
"""
