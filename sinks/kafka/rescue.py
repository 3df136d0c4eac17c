"""The rescue of an epoch whose transaction did not commit: decide from the commit marker,
and read the epoch's records back from the partition log.

librdkafka cannot resume a transaction after a restart (``init_transactions`` aborts it), and
the broker aborts a transaction that outlives ``transaction.timeout.ms``. The records of such an
epoch are still in the log, behind an abort marker. The committable recorded at ``prepare``
says where: the offset ranges the transaction wrote and the offset of the epoch's commit marker
(a record written inside the same transaction). :func:`epoch_committed` looks for that marker;
if it is not committed, :func:`read_epoch` re-reads the ranges with ``read_uncommitted`` and
keeps the records whose headers name this sink, subtask and epoch (other producers may share
the partitions), and the writer re-publishes them in a new transaction with a new marker
(:meth:`sinks.kafka.transactional.KafkaSinkWriter._rescue`).
"""

from __future__ import annotations

import logging
from typing import Any

from connectors.config import KafkaSettings
from sinks.kafka.broker import _read_range, _StalledRead
from sinks.kafka.records import HEADER_EPOCH, HEADER_ID, HEADER_SINK, HEADER_SUBTASK

__all__ = ["epoch_committed", "read_epoch"]

log = logging.getLogger(__name__)

#: (topic, partition, key, value, headers, timestamp ms) of a record to re-publish.
EpochRecord = tuple[str, int, Any, Any, Any, int]


def epoch_committed(
    settings: KafkaSettings, committable: Any, sink_id: bytes, subtask: bytes, where: str
) -> bool:
    """Whether a committed marker of the epoch exists at or after the recorded marker."""
    topic, partition, offset = committable["marker"]
    try:
        found = _marker_in(settings, committable, sink_id, subtask, read_committed=True)
    except _StalledRead:
        # Every id of this subtask's pool was fenced, so nothing of ours is open: a last
        # stable offset stuck below the marker is a broker fault. Seen on Tansu after
        # crashes, whose read_committed shows aborted records anyway, so reading
        # uncommitted answers what its readers see.
        log.warning(
            "%s: the last stable offset of %s[%s] does not advance past %s although this "
            "subtask's transactional ids are fenced; deciding on read_uncommitted (right for "
            "brokers whose read_committed shows aborted records, such as Tansu; on Apache "
            "Kafka this means another producer holds an open transaction in the marker topic)",
            where, topic, partition, offset,
        )  # fmt: skip
        found = _marker_in(settings, committable, sink_id, subtask, read_committed=False)
    return found


def _marker_in(
    settings: KafkaSettings,
    committable: Any,
    sink_id: bytes,
    subtask: bytes,
    *,
    read_committed: bool,
) -> bool:
    topic, partition, offset = committable["marker"]
    tag = str(committable["epoch"]).encode()
    for msg in _read_range(
        settings, topic, int(partition), int(offset), None, read_committed=read_committed
    ):  # markers carry (sink, subtask, epoch) headers
        headers = dict(msg.headers() or [])
        if (
            headers.get(HEADER_EPOCH) == tag
            and headers.get(HEADER_SUBTASK) == subtask
            and headers.get(HEADER_SINK) == sink_id
        ):
            return True
    return False


def read_epoch(
    settings: KafkaSettings, committable: Any, subtask: int, sink_id: bytes
) -> list[EpochRecord]:
    """The records of the committable's epoch, read back from its offset ranges with
    ``read_uncommitted`` (its transaction aborted, so ``read_committed`` would hide them)."""
    prefix = f"{subtask}.{committable['epoch']}.".encode()
    out: list[EpochRecord] = []
    for topic, partition, lo, hi in committable["ranges"]:
        for msg in _read_range(
            settings, topic, int(partition), int(lo), int(hi) + 1, read_committed=False
        ):
            headers = msg.headers() or []
            h = dict(headers)
            record_id = h.get(HEADER_ID)
            if (
                record_id is not None
                and record_id.startswith(prefix)
                and h.get(HEADER_SINK) == sink_id
            ):
                _ts_type, ts = msg.timestamp()
                out.append((topic, int(partition), msg.key(), msg.value(), headers, ts))
    return out
