"""Two-phase-commit sinks (docs/sinks.md, "The two-phase contract").

Every sink implements :class:`processor.contracts.Sink`: it holds configuration only, and each
worker opens its own :class:`processor.contracts.SinkWriter` from it, which writes during the
epoch, ``prepare``-s at the barrier, ``commit``-s when the checkpoint completes and ``recover``-s
after a restart.

- :class:`FileSink`: JSON lines or raw lines in part files, renamed into place atomically on
  commit. :func:`read_committed_lines` and :func:`read_jsonl` read what was committed.
  Avro container files with ``format="avro"`` (:func:`read_avro`).
- :class:`KafkaSink`: transactional (``read_committed`` readers see each record once) or staged
  (readers drop re-published repeats with :class:`dedup.DedupConsumer`); docs/sinks.md.
- :class:`ConsoleSink`: prints on commit; for development (a terminal is not transactional).

- :class:`PostgresSink`: ``PREPARE TRANSACTION`` at the barrier, ``COMMIT PREPARED`` on
  completion (needs the ``postgres`` extra: psycopg); docs/sink-postgres.md.
- :class:`RedisSink`: one subtask's epoch applied atomically by a Lua script guarded by the last
  committed epoch; docs/sink-redis.md.
- :class:`IcebergSink`, :class:`DeltaSink`: Parquet data files written at the barrier, one table
  commit per checkpoint carrying the checkpoint id (extras ``iceberg``, ``delta``);
  :func:`read_iceberg`, :func:`read_delta` read them back; docs/sink-lakehouse.md.

The public names are imported on first use (PEP 562): a pipeline file that imports
``KafkaSink`` or ``FileSink`` does not load redis-py (``RedisSink``) in the runner and in every
worker, about 30 ms of each process's start-up (bench/RESULTS.md, "Start-up and shut-down").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from processor.exports import lazy_exports

if TYPE_CHECKING:
    from sinks.console import ConsoleSink
    from sinks.files import FileSink, read_avro, read_committed, read_committed_lines, read_jsonl
    from sinks.kafka import KafkaSink
    from sinks.lake import DeltaSink, IcebergSink, read_delta, read_iceberg
    from sinks.postgres import PostgresSink
    from sinks.redis import RedisSink

__all__ = [
    "ConsoleSink",
    "DeltaSink",
    "FileSink",
    "IcebergSink",
    "KafkaSink",
    "PostgresSink",
    "RedisSink",
    "read_avro",
    "read_committed",
    "read_committed_lines",
    "read_delta",
    "read_iceberg",
    "read_jsonl",
]

_HOME = {
    "ConsoleSink": "sinks.console",
    "DeltaSink": "sinks.lake",
    "FileSink": "sinks.files",
    "IcebergSink": "sinks.lake",
    "KafkaSink": "sinks.kafka",
    "PostgresSink": "sinks.postgres",
    "RedisSink": "sinks.redis",
    "read_avro": "sinks.files",
    "read_committed": "sinks.files",
    "read_committed_lines": "sinks.files",
    "read_delta": "sinks.lake",
    "read_iceberg": "sinks.lake",
    "read_jsonl": "sinks.files",
}

__getattr__, __dir__ = lazy_exports(__name__, _HOME)
