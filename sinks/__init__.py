"""Two-phase-commit sinks (DESIGN.md, "Sinks: two-phase commit").

Every sink implements :class:`processor.contracts.Sink`: it holds configuration only, and each
worker opens its own :class:`processor.contracts.SinkWriter` from it, which writes during the
epoch, ``prepare``-s at the barrier, ``commit``-s when the checkpoint completes and ``recover``-s
after a restart.

- :class:`FileSink`: JSON lines or raw lines in part files, renamed into place atomically on
  commit. :func:`read_committed_lines` and :func:`read_jsonl` read what was committed.
- :class:`ConsoleSink`: prints on commit; for development (a terminal is not transactional).

Transactional Kafka, PostgreSQL, Redis and dead-letter sinks join this package later.
"""

from sinks.console import ConsoleSink
from sinks.files import FileSink, read_committed_lines, read_jsonl

__all__ = ["ConsoleSink", "FileSink", "read_committed_lines", "read_jsonl"]
