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
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from processor.errors import KafkaClientError

__all__ = ["ErrorClass", "classify", "error_class", "raise_for"]


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


def error_class(error: KafkaError | KafkaException) -> ErrorClass:
    """Which of the four classes ``error`` belongs to, by librdkafka's own flags."""
    err = _kafka_error(error)
    if err.fatal():
        return ErrorClass.FATAL
    if err.txn_requires_abort():
        return ErrorClass.ABORT
    if err.retriable():
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
