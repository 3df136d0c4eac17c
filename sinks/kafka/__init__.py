"""Kafka sinks: transactional (committed on checkpoint completion) and staged (published after it).

- :mod:`sinks.kafka.sink`: :class:`KafkaSink`, the configuration, checked before the job runs.
- :mod:`sinks.kafka.transactional`: :class:`KafkaSinkWriter`, one transaction per epoch,
  committed on checkpoint completion; recovery re-publishes an epoch whose transaction aborted.
- :mod:`sinks.kafka.staged`: :class:`StagedKafkaSinkWriter`, epochs staged in the snapshot store
  and published with the idempotent producer after the checkpoint completes.
- :mod:`sinks.kafka.rescue`: the rescue of an epoch whose transaction did not commit (the
  commit marker decides; the epoch is read back from the log and re-published).
- :mod:`sinks.kafka.records`: header names, the marker topic, transactional ids, partitions,
  the encoding of values, and what the writers read of the sink (:class:`KafkaSinkConfig`).
- :mod:`sinks.kafka.broker`: retried librdkafka calls, reading a partition range back, the
  ``eosflow txn`` commands.
"""

from __future__ import annotations

from sinks.kafka.broker import abort_lingering, read_transaction_markers
from sinks.kafka.records import (
    HEADER_EPOCH,
    HEADER_ID,
    HEADER_SINK,
    HEADER_SUBTASK,
    HEADER_TXN,
    marker_topic,
    murmur2,
    murmur2_partition,
    transactional_id,
    transactional_ids,
)
from sinks.kafka.sink import KafkaSink, check_transaction_timeout
from sinks.kafka.staged import StagedKafkaSinkWriter
from sinks.kafka.transactional import KafkaSinkWriter

__all__ = [
    "HEADER_EPOCH",
    "HEADER_ID",
    "HEADER_SINK",
    "HEADER_SUBTASK",
    "HEADER_TXN",
    "KafkaSink",
    "KafkaSinkWriter",
    "StagedKafkaSinkWriter",
    "abort_lingering",
    "check_transaction_timeout",
    "marker_topic",
    "murmur2",
    "murmur2_partition",
    "read_transaction_markers",
    "transactional_id",
    "transactional_ids",
]
