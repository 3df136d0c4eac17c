"""Lakehouse sinks: Apache Iceberg (pyiceberg) and Delta Lake (delta-rs), exactly once.

- :class:`DeltaSink`: appends rows to a Delta table; each checkpoint is one commit carrying the
  application transaction ``txn(eosflow:<job>:<step>, <checkpoint>)`` (``eosflow[delta]``).
- :class:`IcebergSink`: appends rows to an Iceberg table through a catalog (SQL on SQLite or
  PostgreSQL, REST...); each checkpoint is one snapshot whose summary and the table's
  properties carry the checkpoint (``eosflow[iceberg]``).
- :func:`read_delta`, :func:`read_iceberg`: the committed rows as a ``pyarrow.Table``.

The protocol both share is in :mod:`sinks.lake.writer` (docs/sink-lakehouse.md).
"""

from __future__ import annotations

from sinks.lake.delta import DeltaSink, read_delta
from sinks.lake.iceberg import IcebergSink, read_iceberg

__all__ = ["DeltaSink", "IcebergSink", "read_delta", "read_iceberg"]
