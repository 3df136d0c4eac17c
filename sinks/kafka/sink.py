"""The Kafka sink's configuration: :class:`KafkaSink`, checked before the job runs, opens
one writer per subtask (:mod:`sinks.kafka.transactional` or :mod:`sinks.kafka.staged`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from connectors.admin import TopicAdmin
from connectors.config import KafkaSettings
from connectors.serde import JsonSerde
from connectors.transport import check_reachable
from processor.contracts import Serde, SinkContext
from processor.errors import ConfigError
from sinks.kafka.records import _MAX_SLOTS
from sinks.kafka.staged import StagedKafkaSinkWriter
from sinks.kafka.transactional import KafkaSinkWriter

__all__ = ["KafkaSink", "check_transaction_timeout"]

_MODES = ("transactional", "staged")
#: 15 minutes, Apache Kafka's default ``transaction.max.timeout.ms``: an epoch's transaction
#: must outlive the checkpoint interval plus the checkpoint timeout (60 s by default).
_DEFAULT_TIMEOUT_MS = 900_000
_COMMIT_MARGIN_MS = 10_000


class KafkaSink:
    """Writes a stream to a Kafka topic, exactly once for ``read_committed`` readers.

    Args:
        topic: the output topic (must exist; eosflow does not guess its partitioning).
        transactional_id_prefix: required in transactional mode; unique per job and stable
            across its restarts (transactional ids derive from it). Two running jobs with the
            same prefix fence each other.
        mode: ``"transactional"`` (default) or ``"staged"`` (see the module docstrings of
            :mod:`sinks.kafka.transactional` and :mod:`sinks.kafka.staged`).
        serde: encodes values (default JSON).
        key: function value -> key (bytes, str or JSON-encodable) for the record key; on a
            keyed stream the default is the stream's key.
        settings: brokers and client settings (default: ``KafkaSettings.from_env()`` in the
            worker, i.e. ``EOSFLOW_KAFKA_BROKERS``).
        transaction_timeout_ms: the producers' ``transaction.timeout.ms`` (default 15 min);
            must exceed the checkpoint interval plus the checkpoint timeout (with 10 s to
            commit), be above twice the interval, and be at most the broker's
            ``transaction.max.timeout.ms``.
        pool_size: transactional ids per subtask kept ready (2 covers one prepared epoch plus
            the open one; more are used while checkpoints keep failing, up to 8).
        producer_config: extra librdkafka producer settings.
        commit_timeout_s: how long a commit may keep failing with retriable errors before the
            epoch is treated as aborted and re-published (after fencing the old producer).
        record_ids: give every record its own ID header (``eosflow-sink`` and ``eosflow-id``,
            what :class:`dedup.IdDedupConsumer` and other ID-based readers use). Default:
            ``True`` in staged mode (its readers need them), ``False`` in transactional mode:
            the records carry no header, like a Flink or Kafka Streams job's output; the
            sink's own recovery finds an epoch's records by their offsets (docs/sinks.md,
            "Record IDs"), and ``read_committed`` readers see every record once. Headers are the
            largest per-record cost of producing from Python: 0.6 to 0.9 µs of CPU per record
            in the reference job (bench/RESULTS.md, "Performance on a real Kafka";
            docs/sinks.md, "Record IDs"). Give ``True`` when the output's readers drop
            repeats by ID (a service reading at least once, a broker whose ``read_committed``
            shows aborted records).

    Raises:
        ConfigError: unknown mode, missing prefix, non-callable ``key``, bad pool size,
            ``record_ids=False`` in staged mode.
    """

    def __init__(
        self,
        topic: str,
        *,
        transactional_id_prefix: str | None = None,
        mode: str = "transactional",
        serde: Serde | None = None,
        key: Callable[[Any], Any] | None = None,
        settings: KafkaSettings | None = None,
        transaction_timeout_ms: int = _DEFAULT_TIMEOUT_MS,
        pool_size: int = 2,
        producer_config: dict[str, Any] | None = None,
        commit_timeout_s: float = 30.0,
        record_ids: bool | None = None,
    ) -> None:
        if mode not in _MODES:
            raise ConfigError(f"KafkaSink mode {mode!r} is unknown; expected one of {_MODES}")
        if record_ids is None:
            record_ids = mode == "staged"
        if not record_ids and mode == "staged":
            raise ConfigError(
                "KafkaSink(mode='staged') needs record_ids=True: its readers drop the repeats "
                "a crash while publishing leaves by the records' IDs"
            )
        if mode == "transactional" and not transactional_id_prefix:
            raise ConfigError(
                "KafkaSink needs transactional_id_prefix=<a name unique to this job, stable "
                "across restarts> in transactional mode (or mode='staged' for brokers without "
                "transactions)"
            )
        if key is not None and not callable(key):
            raise ConfigError(f"KafkaSink key must be a function value -> key, got {key!r}")
        if not 1 <= pool_size <= _MAX_SLOTS:
            raise ConfigError(f"KafkaSink pool_size must be 1..{_MAX_SLOTS}, got {pool_size}")
        self.topic = topic
        self.prefix = transactional_id_prefix
        self.mode = mode
        self.serde = serde or JsonSerde()
        self.key = key
        self.settings = settings
        self.transaction_timeout_ms = int(transaction_timeout_ms)
        self.pool_size = pool_size
        self.producer_config = dict(producer_config or {})
        self.commit_timeout_s = float(commit_timeout_s)
        self.record_ids = bool(record_ids)

    def __repr__(self) -> str:
        return f"KafkaSink({self.topic!r}, mode={self.mode!r}, prefix={self.prefix!r})"

    def resolved_settings(self) -> KafkaSettings:
        return self.settings if self.settings is not None else KafkaSettings.from_env()

    def preflight(
        self,
        *,
        job: str,
        checkpoint_interval: float | None,
        checkpoint_timeout: float | None = None,
    ) -> None:
        """Check the topic and the transaction timeout (each writer sets up the marker topic)."""
        settings = self.resolved_settings()
        check_reachable(settings)  # one clear error in seconds, not minutes of client logs
        admin = TopicAdmin(settings)
        if not admin.exists(self.topic):
            raise ConfigError(
                f"KafkaSink: output topic {self.topic!r} does not exist on {settings.brokers}; "
                "create it with the partition count its readers expect"
            )
        if self.mode == "transactional":
            from connectors.probe import broker_transaction_max_timeout

            check_transaction_timeout(
                self.transaction_timeout_ms,
                checkpoint_interval,
                broker_transaction_max_timeout(settings),
                checkpoint_timeout=checkpoint_timeout,
            )

    def open(self, ctx: SinkContext) -> KafkaSinkWriter | StagedKafkaSinkWriter:
        if self.mode == "staged":
            return StagedKafkaSinkWriter(self, ctx)
        return KafkaSinkWriter(self, ctx)


def check_transaction_timeout(
    timeout_ms: int,
    checkpoint_interval: float | None,
    broker_max_ms: int | None,
    *,
    checkpoint_timeout: float | None = None,
) -> None:
    """Refuse a ``transaction.timeout.ms`` the job cannot live with, saying what to change.

    An epoch's transaction is open from its first record until the commit after its
    checkpoint completes: up to one interval, then up to the checkpoint timeout, then the
    commit. A shorter transaction timeout lets the broker abort a healthy epoch whose
    checkpoint is merely slow (found in review, issue 17: the checkpoint timeout, 60 s, equalled
    the default transaction timeout, 60 s)."""
    if broker_max_ms is not None and timeout_ms > broker_max_ms:
        raise ConfigError(
            f"KafkaSink transaction_timeout_ms={timeout_ms} exceeds the broker's "
            f"transaction.max.timeout.ms={broker_max_ms}: lower transaction_timeout_ms to at most "
            f"{broker_max_ms}, or raise transaction.max.timeout.ms on the brokers"
        )
    if checkpoint_interval is not None and timeout_ms < 2_000 * checkpoint_interval:
        raise ConfigError(
            f"KafkaSink transaction_timeout_ms={timeout_ms} is below twice the checkpoint "
            f"interval ({checkpoint_interval:g}s): an epoch's transaction stays open for about "
            f"one interval plus the checkpoint, so the broker would abort most of them. Raise "
            f"transaction_timeout_ms to at least {int(4_000 * checkpoint_interval)} or shorten "
            "--checkpoint-interval"
        )
    if checkpoint_interval is not None and checkpoint_timeout is not None:
        needed_ms = int(1000 * (checkpoint_interval + checkpoint_timeout)) + _COMMIT_MARGIN_MS
        if timeout_ms < needed_ms:
            raise ConfigError(
                f"KafkaSink transaction_timeout_ms={timeout_ms} is shorter than the longest an "
                f"epoch's transaction stays open: the checkpoint interval ({checkpoint_interval:g}"
                f"s) plus the checkpoint timeout ({checkpoint_timeout:g}s) plus "
                f"{_COMMIT_MARGIN_MS // 1000}s to commit = {needed_ms} ms; the broker would "
                f"abort the epoch of a slow checkpoint. Raise transaction_timeout_ms to at least "
                f"{needed_ms} (within the broker's transaction.max.timeout.ms), or lower "
                "--checkpoint-timeout"
            )
