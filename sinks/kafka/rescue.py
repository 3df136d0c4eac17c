"""The rescue of an epoch whose transaction did not commit: decide from the commit marker,
and read the epoch's records back from the partition log.

librdkafka cannot resume a transaction after a restart (``init_transactions`` aborts it), and
the broker aborts a transaction that outlives ``transaction.timeout.ms``. The records of such an
epoch are still in the log, behind an abort marker. The committable recorded at ``prepare``
says where: the offset ranges the transaction wrote and the offset of the epoch's commit marker
(a record written inside the same transaction). :func:`epoch_committed` looks for that marker;
if it is not committed, :func:`read_epoch` re-reads the ranges with ``read_uncommitted`` and
keeps the records whose headers name this sink, subtask and epoch, or (``record_ids=False``:
no header) the exact offsets the writer recorded (runs per partition, with the records'
digests where other producers' records lie between), and the writer re-publishes them in a
new transaction with a new marker (:meth:`sinks.kafka.transactional.KafkaSinkWriter._rescue`).
"""

from __future__ import annotations

import logging
from typing import Any

from connectors.config import KafkaSettings
from connectors.probe import hides_aborted_records
from processor.errors import KafkaClientError
from sinks.kafka.broker import _read_range, _StalledRead
from sinks.kafka.records import (
    DIGEST_BYTES,
    HEADER_EPOCH,
    HEADER_ID,
    HEADER_SINK,
    HEADER_SUBTASK,
    HEADER_TXN,
    record_digest,
)

__all__ = ["epoch_committed", "read_epoch"]

log = logging.getLogger(__name__)

#: (topic, partition, key, value, headers, timestamp ms) of a record to re-publish.
EpochRecord = tuple[str, int, Any, Any, Any, int]


def epoch_committed(
    settings: KafkaSettings, committable: Any, sink_id: bytes, subtask: bytes, where: str
) -> bool:
    """Whether a committed marker of the epoch exists at or after the recorded marker.

    The marker is read with ``read_committed``: an epoch whose transaction aborted has its
    marker in the log too, behind an abort marker, and must not count as committed.

    When the read stalls (the last stable offset does not pass the marker although every id of
    this subtask's pool was fenced), the broker decides what happens next:

    * one whose ``read_committed`` hides aborted records (Apache Kafka): another producer holds
      an open transaction in the marker partition, and it ends by its timeout. The read is
      tried again for longer, then the task fails with the reason. ``read_uncommitted`` would
      see an *aborted* marker and call a lost epoch committed (found in review, issue 17).
    * one whose ``read_committed`` shows aborted records anyway (Tansu, whose last stable
      offset can stick after crashes): ``read_uncommitted`` answers exactly what its readers
      see. The broker probe (:func:`connectors.probe.hides_aborted_records`) switches this on,
      never a timeout.
    """
    topic, partition, offset = committable["marker"]
    try:
        return _marker_in(settings, committable, sink_id, subtask, read_committed=True)
    except _StalledRead:
        if hides_aborted_records(settings):
            return _marker_after_open_transaction(settings, committable, sink_id, subtask, where)
        log.warning(
            "%s: the last stable offset of %s[%s] does not advance past %s although this "
            "subtask's transactional ids are fenced; this broker's read_committed shows "
            "aborted records (the probe says so, e.g. Tansu), so deciding on read_uncommitted",
            where, topic, partition, offset,
        )  # fmt: skip
        return _marker_in(settings, committable, sink_id, subtask, read_committed=False)


#: How long a rescue waits for another producer's open transaction in the marker partition.
OPEN_TRANSACTION_WAIT_S = 120.0


def _marker_after_open_transaction(
    settings: KafkaSettings, committable: Any, sink_id: bytes, subtask: bytes, where: str
) -> bool:
    topic, partition, offset = committable["marker"]
    log.warning(
        "%s: the last stable offset of %s[%s] stays below the marker at %s: another producer "
        "holds an open transaction there; waiting up to %.0fs for it to end (never deciding "
        "from read_uncommitted, which would count an aborted epoch as committed)",
        where, topic, partition, offset, OPEN_TRANSACTION_WAIT_S,
    )  # fmt: skip
    try:
        return _marker_in(
            settings,
            committable,
            sink_id,
            subtask,
            read_committed=True,
            timeout=OPEN_TRANSACTION_WAIT_S + 30.0,
            stall_s=OPEN_TRANSACTION_WAIT_S,
        )
    except _StalledRead:
        raise KafkaClientError(
            f"{where}: cannot tell whether epoch {committable['epoch']} committed: the last "
            f"stable offset of {topic}[{partition}] stayed below {offset} for "
            f"{OPEN_TRANSACTION_WAIT_S:.0f}s. Another producer holds an open transaction in "
            "that partition of the marker topic (it ends by its transaction.timeout.ms); list "
            "and abort this job's lingering ones with 'eosflow txn list|abort PIPELINE.py'. "
            "The task restarts and tries again",
            retriable=True,
        ) from None


def _marker_in(
    settings: KafkaSettings,
    committable: Any,
    sink_id: bytes,
    subtask: bytes,
    *,
    read_committed: bool,
    **read: float,
) -> bool:
    topic, partition, offset = committable["marker"]
    tag = str(committable["epoch"]).encode()
    for msg in _read_range(
        settings, topic, int(partition), int(offset), None, read_committed=read_committed, **read
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
    """The records of the committable's epoch, read back from the log with ``read_uncommitted``
    (its transaction aborted, so ``read_committed`` would hide them), in their order.

    How they are told apart from other producers' records in the same partitions depends on
    the committable: ``runs`` (``record_ids=False``; its records carry no header) lists their
    exact offsets; otherwise (``record_ids=True``, or ``record_ids=False`` committables written
    before ``runs`` existed) their headers name the sink, subtask and epoch within ``ranges``.
    """
    if "runs" in committable:
        return _read_runs(settings, committable["runs"])
    prefix = f"{subtask}.{committable['epoch']}.".encode()
    # committables of older versions have no "ids": they had IDs
    ids = committable.get("ids", True)
    epoch = None if ids else txn_header(sink_id, subtask, str(committable["epoch"]))
    out: list[EpochRecord] = []
    for topic, partition, lo, hi in committable["ranges"]:
        for msg in _read_range(
            settings, topic, int(partition), int(lo), int(hi) + 1, read_committed=False
        ):
            headers = msg.headers() or []
            h = dict(headers)
            if epoch is not None:  # an older record_ids=False epoch: one header names it
                mine = h.get(HEADER_TXN) == epoch
            else:
                record_id = h.get(HEADER_ID)
                mine = (
                    record_id is not None
                    and record_id.startswith(prefix)
                    and h.get(HEADER_SINK) == sink_id
                )
            if mine:
                out.append(_epoch_record(msg, topic, int(partition), headers))
    return out


def _read_runs(settings: KafkaSettings, runs: Any) -> list[EpochRecord]:
    """The records of ``runs`` (``[[topic, partition, [run, ...]], ...]``): one read per
    partition, from its first run's start to its last run's end. A run ``[first, last]`` is
    every offset from ``first`` to ``last``; a run ``[first, last, digests]`` (other producers'
    batches lay between its records) is, in order, the records of that span whose
    :func:`~sinks.kafka.records.record_digest` are the next of ``digests`` (hex, 8 bytes
    each). Where two records of a span are equal, either is the record: same bytes."""
    out: list[EpochRecord] = []
    for topic, partition, spans in runs:
        if not spans:
            continue
        spans = sorted(
            (int(span[0]), int(span[1]), bytes.fromhex(span[2]) if len(span) > 2 else None)
            for span in spans
        )
        i, at = 0, 0  # the span, and the next digest of a digested span
        for msg in _read_range(
            settings, topic, int(partition), spans[0][0], spans[-1][1] + 1, read_committed=False
        ):
            offset = msg.offset()
            while i < len(spans) and offset > spans[i][1]:
                i, at = i + 1, 0
            if i == len(spans) or offset < spans[i][0]:
                continue
            digests = spans[i][2]
            if digests is not None:
                if (
                    at == len(digests)
                    or record_digest(msg.key(), msg.value()) != digests[at : at + DIGEST_BYTES]
                ):
                    continue
                at += DIGEST_BYTES
            out.append(_epoch_record(msg, topic, int(partition), msg.headers()))
    return out


def _epoch_record(msg: Any, topic: str, partition: int, headers: Any) -> EpochRecord:
    _ts_type, ts = msg.timestamp()
    return (topic, partition, msg.key(), msg.value(), headers, ts)


def txn_header(sink_id: bytes, subtask: int, epoch: str) -> bytes:
    """The :data:`~sinks.kafka.records.HEADER_TXN` value of a sink subtask's epoch (written by
    ``record_ids=False`` sinks before committables had ``runs``; read only by rescues of
    those)."""
    return b"%s|%d.%s" % (sink_id, subtask, epoch.encode())
