"""The one place where Kafka errors are classified.

librdkafka already knows whether an error is retriable, requires aborting the current transaction,
or is fatal for the client; eosflow reads those flags (as confluent-kafka's transactional example
does) instead of keeping its own tables of error codes.

=================  =====================================================================
class              what the caller does
=================  =====================================================================
``FATAL``          the client instance is unusable: close it, fail the task, restart it
``ABORT``          abort the open transaction and rewind to the last checkpoint
``RETRIABLE``      retry the same call (after a backoff)
``ERROR``          anything else: fail the operation with the message
=================  =====================================================================
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import Any, TypeVar

from confluent_kafka import KafkaError, KafkaException

from processor.errors import KafkaClientError

__all__ = [
    "FENCED_CODES",
    "ErrorClass",
    "classify",
    "error_class",
    "is_fenced",
    "raise_for",
    "retrying",
]

_T = TypeVar("_T")

#: Partition errors that the Kafka protocol documents as retriable (a partition's leadership
#: moving or not yet in place) but that librdkafka returns from its synchronous calls
#: (``get_watermark_offsets``, ``offsets_for_times``, admin results) without its retriable
#: flag. A topic created a moment ago answers NOT_LEADER_OR_FOLLOWER on KRaft until its leader
#: has applied the new metadata (issue 41: 3 of 5 rescale starts exited on it). The group
#: coordinator's codes too: a broker that just created ``__consumer_offsets`` answers
#: COORDINATOR_LOAD_IN_PROGRESS while it loads (issue 47: a job's first start on a fresh Kafka
#: container exited on it).
_LEADERSHIP_CODES = frozenset(
    {
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError.REPLICA_NOT_AVAILABLE,
        KafkaError.FENCED_LEADER_EPOCH,
        KafkaError.UNKNOWN_LEADER_EPOCH,
        KafkaError.OFFSET_NOT_AVAILABLE,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
        KafkaError.NOT_COORDINATOR,
    }
)


#: A transactional producer fenced by a newer one with its transactional id: librdkafka's own
#: ``_FENCED`` (fatal on Apache Kafka; Tansu answers the broker's PRODUCER_FENCED, which
#: librdkafka maps to an abortable ``_FENCED``), and the broker codes of older clients' paths.
FENCED_CODES = frozenset(
    {KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH}
)


def is_fenced(error: KafkaError | KafkaException) -> bool:
    """Whether ``error`` says a newer producer with the same transactional id fenced this one
    (whatever librdkafka's class of it: fatal on Kafka, abortable on Tansu)."""
    return _kafka_error(error).code() in FENCED_CODES


class ErrorClass(enum.Enum):
    FATAL = "fatal"
    ABORT = "abort"
    RETRIABLE = "retriable"
    ERROR = "error"


def _kafka_error(error: KafkaError | KafkaException) -> KafkaError:
    if isinstance(error, KafkaException):
        inner: Any = error.args[0] if error.args else None
        if isinstance(inner, KafkaError):
            return inner
        return KafkaError(KafkaError._FAIL, str(error))
    return error


_COORDINATOR_CODES = frozenset(
    {
        KafkaError.NOT_COORDINATOR,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    }
)


def error_class(error: KafkaError | KafkaException) -> ErrorClass:
    """Which of the four classes ``error`` belongs to, by librdkafka's own flags."""
    err = _kafka_error(error)
    if err.fatal():
        return ErrorClass.FATAL
    if err.txn_requires_abort():
        return ErrorClass.ABORT
    if err.retriable() or err.code() in _LEADERSHIP_CODES:
        return ErrorClass.RETRIABLE
    return ErrorClass.ERROR


def classify(error: KafkaError | KafkaException, *, context: str) -> KafkaClientError:
    """An eosflow :class:`KafkaClientError` for ``error``, saying what was being done."""
    err = _kafka_error(error)
    cls = error_class(err)
    return KafkaClientError(
        f"{context}: {err.str()} (code={err.name()}, class={cls.value})",
        code=err.name(),
        retriable=cls is ErrorClass.RETRIABLE,
        txn_requires_abort=cls is ErrorClass.ABORT,
        fatal=cls is ErrorClass.FATAL,
    )


def raise_for(error: KafkaError | KafkaException | None, *, context: str) -> None:
    """Raise :func:`classify` of ``error``, if there is one."""
    if error is not None:
        raise classify(error, context=context) from (
            error if isinstance(error, KafkaException) else None
        )


def retrying(
    call: Callable[[float], _T], context: str, deadline_s: float = 30.0, *, idempotent: bool = False
) -> _T:
    """Run ``call(timeout)``, retrying with backoff while it fails retriably, for at most
    ``deadline_s`` seconds; then (or at once, for any other class) raise :func:`classify` of
    the last error, saying how long it was retried. ``idempotent``: the call may be repeated
    whatever the broker did with it, so a dropped connection (``_TRANSPORT``) is retried too
    (Tansu 0.6 drops the first OffsetCommit to a group just deleted; measured).

    Raises:
        KafkaClientError: the call failed with a non-retriable error, or retriably past the
            deadline (``retriable`` is then True: the caller may try again later).
    """
    start = time.monotonic()
    deadline = start + deadline_s
    delay = 0.05
    while True:
        left = deadline - time.monotonic()
        try:
            return call(max(0.1, min(10.0, left)))
        except KafkaException as exc:
            retriable = error_class(exc) is ErrorClass.RETRIABLE or (
                idempotent and _kafka_error(exc).code() == KafkaError._TRANSPORT
            )
            if retriable and time.monotonic() + delay < deadline:
                time.sleep(delay)
                delay = min(1.0, delay * 2)
                continue
            if retriable:
                context = f"{context} (still failing after {time.monotonic() - start:.0f}s"
                if _kafka_error(exc).code() in _LEADERSHIP_CODES:
                    context += (
                        "; the partition has no leader ready: the broker that should lead it "
                        "is down or still applying the topic's metadata; see "
                        "kafka-topics.sh --describe"
                    )
                elif _kafka_error(exc).code() in _COORDINATOR_CODES:
                    context += (
                        "; the broker has no coordinator ready for this transactional id or "
                        "group. On Kafka 2.3-2.4 a broker whose ZooKeeper session expired (a "
                        "pause longer than zookeeper.session.timeout.ms) can answer so until it "
                        "is restarted (docs/brokers.md)"
                    )
                context += ")"
            raise classify(exc, context=context) from exc
