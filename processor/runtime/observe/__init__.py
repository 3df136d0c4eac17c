"""What a running job tells its user (the observe room of :mod:`processor.runtime`).

Owns :mod:`.metrics` (Prometheus metrics and the job page's data), :mod:`.watermarks` (the
watermarks' summary, its words and gauges), :mod:`.webui` (the runner's HTTP server: the job
page, ``/api/job``, ``/metrics``), :mod:`.archive` (the page a finished run leaves, served by
``eosflow status --web``) and the job page's static assets in ``ui/`` (package data). The
progress line and ``status.json`` are the runner's
(:mod:`processor.runtime.supervision.reporting`: they count restarts). docs/observability.md.

May import: the checkpoints room (the coordinator's statistics and events), the snapshot store
(:mod:`.archive` reads the checkpoints a finished run left) and the runtime's
floor (options, results, the runner's view of a worker). It reads values and never steers: it
imports nothing of the runner, the tasks or the operators.
"""
