"""The one exception hierarchy of eosflow.

Every error eosflow raises on purpose is an :class:`EosflowError`. Configuration and definition
errors are also :class:`ValueError` so that code written against plain Python keeps working::

    EosflowError
    ├── ConfigError (ValueError)            bad settings; raised at start-up, says how to fix it
    │   ├── UnsafeKafkaConfigError          a librdkafka override that would break exactly-once
    │   └── JobHistoryError                 the broker holds the job's history, this state does
    │                                       not (lost or stale state: refused, with the ways on)
    ├── DefinitionError (ValueError)        a dataflow that cannot be built (names, missing sinks)
    ├── SerializationError                  a value could not be encoded
    │   └── RecordsRejected                 a sink wrote a batch but some values did not fit
    │                                       its table (each goes to dead letters with the cause)
    ├── DeserializationError                bytes read from Kafka could not be decoded
    │                                       (carries topic, partition, offset; goes to dead letters)
    ├── KafkaClientError                    a broker/client error, classified once (see
    │                                       connectors.errors.classify): retriable, abort, fatal
    ├── InfrastructureError                 an embedded server failed to start, stop or answer
    │   └── ServerNotFoundError             its binary is not installed; says what to install
    ├── BrokerCapabilityError               the broker lacks a feature the job was told to rely on
    ├── DataLossError                       records a restore needs are gone from the broker
    │                                       (retention deleted them, the topic was recreated)
    ├── JobRunningError                     another runner holds the job's lease
    │   └── JobFencedError                  another runner took the job in the broker (fenced)
    ├── JobNotFoundError (LookupError)      no such job recorded, or it lacks what an operation
    │                                       needs (its status, a completed checkpoint)
    └── SnapshotError                       a stored snapshot or manifest cannot be used
                                            (``reason``: corrupt, unknown_version, missing,
                                            completed)

The dedup library (:mod:`dedup`) imports nothing from the engine, so its errors are a tree of
their own in :mod:`dedup.errors`, reported by the CLI like these::

    DedupError
    ├── DedupConfigError (ValueError)       bad dedup settings; says how to fix it
    └── RedisUnavailable                    the ID store did not answer in time (fail closed)

Invariants:
    Messages say what was expected, what came, where (step, topic, partition, offset) and how to
    fix it. Nothing here imports a third-party package: the engine, connectors and sinks all
    raise these types.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BrokerCapabilityError",
    "ConfigError",
    "DataLossError",
    "DefinitionError",
    "DeserializationError",
    "EosflowError",
    "InfrastructureError",
    "JobFencedError",
    "JobHistoryError",
    "JobNotFoundError",
    "JobRunningError",
    "KafkaClientError",
    "RecordsRejected",
    "SerializationError",
    "ServerNotFoundError",
    "SnapshotError",
    "UnsafeKafkaConfigError",
    "UserFunctionError",
]


class EosflowError(Exception):
    """Base of every error eosflow raises on purpose."""


class ConfigError(EosflowError, ValueError):
    """Bad configuration, detected before anything runs."""


class UnsafeKafkaConfigError(ConfigError):
    """A librdkafka setting that would silently break the exactly-once guarantee.

    Attributes:
        key: the librdkafka property, e.g. ``enable.idempotence``.
        value: the value that was asked for.
    """

    def __init__(self, key: str, value: object, why: str, fix: str) -> None:
        self.key = key
        self.value = value
        super().__init__(f"unsafe Kafka setting {key}={value!r}: {why}. Fix: {fix}")


class DefinitionError(EosflowError, ValueError):
    """A dataflow definition that cannot be compiled."""


class SerializationError(EosflowError):
    """A value could not be encoded by a serializer."""


class RecordsRejected(SerializationError):
    """A sink writer wrote the values of a batch that fit its output, and not these.

    Raised by ``SinkWriter.write`` after it wrote the rest of the batch. The sink step hands
    each rejected value to the dataflow's dead letters with its cause (inside the epoch, so
    exactly once); without a dead-letter destination the task fails with this error.

    Attributes:
        failures: ``(index in the batch, cause)`` of each value not written.
    """

    def __init__(self, message: str, failures: list[tuple[int, Exception]]) -> None:
        self.failures = failures
        super().__init__(message)


class DeserializationError(EosflowError):
    """Bytes read from a topic could not be decoded.

    This is data, not a crash: the engine routes the record to the dead-letter destination with
    this error as the cause.

    Attributes:
        topic, partition, offset: where the bad record sits (``None`` when decoded outside Kafka).
        cause: the decoder's own message.
    """

    def __init__(
        self,
        cause: str,
        *,
        topic: str | None = None,
        partition: int | None = None,
        offset: int | None = None,
        serde: str | None = None,
        data: bytes | None = None,
    ) -> None:
        self.cause = cause
        self.topic = topic
        self.partition = partition
        self.offset = offset
        self.serde = serde
        self.data = data
        where = (
            f" at topic={topic!r} partition={partition} offset={offset}"
            if topic is not None
            else ""
        )
        preview = ""
        if data is not None:
            shown = data[:32]
            preview = f" (first {len(shown)} of {len(data)} bytes: {shown!r})"
        by = f"{serde} " if serde else ""
        super().__init__(f"{by}could not decode record{where}: {cause}{preview}")

    def located(self, topic: str, partition: int, offset: int) -> DeserializationError:
        """This error with the record's place filled in (decoders called on the hot path are
        given the bytes only; the place is added when one fails)."""
        if self.topic is not None:
            return self
        found = DeserializationError(
            self.cause, topic=topic, partition=partition, offset=offset, serde=self.serde,
            data=self.data,
        )  # fmt: skip
        found.__cause__ = self.__cause__
        return found


class IterationLimitError(EosflowError):
    """A record went around a loop more than its ``iterate(max_iterations=)`` allows (the cause
    of its dead letter)."""


class KafkaClientError(EosflowError):
    """A Kafka client or broker error, with librdkafka's own classification.

    Attributes:
        code: librdkafka error code name (e.g. ``_TIMED_OUT``).
        retriable: the operation may be retried as is.
        txn_requires_abort: the current transaction must be aborted and the epoch re-run.
        fatal: the client instance is unusable; the task must restart.
    """

    def __init__(
        self,
        message: str,
        *,
        code: str = "",
        retriable: bool = False,
        txn_requires_abort: bool = False,
        fatal: bool = False,
    ) -> None:
        self.code = code
        self.retriable = retriable
        self.txn_requires_abort = txn_requires_abort
        self.fatal = fatal
        super().__init__(message)


class InfrastructureError(EosflowError):
    """An embedded server failed to start, to answer or to stop."""


class ServerNotFoundError(InfrastructureError):
    """The binary of an embedded server is not installed."""


class BrokerCapabilityError(EosflowError):
    """The broker in use lacks a feature the job relies on."""


class DataLossError(EosflowError):
    """Records the job must read are no longer on the broker: a position below a partition's
    first offset (retention deleted records not yet read), or beyond its end (the topic or the
    broker was recreated since the checkpoint). Continuing would silently skip or invent input.

    Attributes:
        topic, partition: where.
        wanted: the position the job needs; first, end: what the partition holds.
    """

    def __init__(
        self, message: str, *, topic: str, partition: int, wanted: int, first: int, end: int
    ) -> None:
        self.topic, self.partition = topic, partition
        self.wanted, self.first, self.end = wanted, first, end
        super().__init__(message)


class UserFunctionError(EosflowError):
    """A pipeline's function raised on a record and the job has no dead-letter destination.

    The message names the step, the record's origin (topic, partition, offset) when the task
    can tell it, and the exception; the runner fails the job at once when the same record fails
    again after a restart (a deterministic error).
    """

    def __init__(self, message: str, *, step: str, origin: tuple[Any, Any, Any] | None) -> None:
        self.step, self.origin = step, origin
        super().__init__(message)


class JobRunningError(EosflowError):
    """Another runner holds the job's lease: two coordinators of one job would share its
    generations, channels, transactional ids and checkpoints. Also raised in the runner that
    lost its lease (it stops, and so do its workers)."""


class JobFencedError(JobRunningError):
    """Another runner of the job took it over in the broker: it initialized the job's runner
    transactional id (``eosflow.<job>.runner``) after this runner did, which fences this one
    (:mod:`processor.runtime.supervision.identity`). The fenced runner stops its workers and fails;
    the other one goes on with the job. Never a success."""


class JobHistoryError(ConfigError):
    """The job's consumer group in Kafka holds committed source offsets (the job ran and
    committed output) that the job's state does not account for: no checkpoint (the state
    directory or snapshot store was lost or is another one), or a checkpoint behind them (a
    stale copy). Starting would read the sources again and commit their output again, so the
    start is refused with the ways on (:mod:`processor.runtime.supervision.identity`)."""


class JobNotFoundError(EosflowError, LookupError):
    """No job of that name is recorded under the state directory, or it lacks what the
    operation needs of it: a status (``eosflow status``), a completed checkpoint (a stopped
    job's savepoint). Raised by :class:`processor.admin.JobAdmin`."""


class SnapshotError(EosflowError):
    """A stored snapshot or checkpoint manifest cannot be used.

    Reasons, and whether the job may continue:

    - ``corrupt``: bad magic, checksum, length or encoding (truncated write, flipped bits, not an
      eosflow file). That checkpoint is unusable; recovery may fall back to an older completed one.
    - ``unknown_version``: written by a newer eosflow. Nothing may continue until eosflow is
      upgraded: falling back to an older checkpoint would re-emit committed outputs.
    - ``missing``: the snapshot, manifest or checkpoint does not exist.
    - ``completed``: an operation meant for aborted checkpoints was asked of a completed one.

    Attributes:
        reason: one of the reasons above.
        path: the file concerned, when there is one.
    """

    def __init__(self, message: str, *, reason: str, path: str | None = None) -> None:
        self.reason = reason
        self.path = path
        super().__init__(message)
