"""Kafka client configuration: exactly-once-safe defaults, validation, client factories.

Every Kafka client eosflow creates is built here, from :class:`KafkaSettings` (where the cluster is
and how to authenticate) plus the role's defaults plus the user's librdkafka overrides. Overrides
that would silently break exactly-once are refused with :class:`UnsafeKafkaConfigError`, naming
the key, the reason and the fix.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, KafkaException, Producer
from confluent_kafka.admin import AdminClient

from connectors.outage import OUTAGES, report_client_error
from processor.errors import ConfigError, UnsafeKafkaConfigError

log = logging.getLogger(__name__)

__all__ = [
    "CONSUMER_DEFAULTS",
    "PRODUCER_DEFAULTS",
    "KafkaSettings",
    "admin_config",
    "connect_producer",
    "consumer_config",
    "create_admin",
    "create_consumer",
    "create_producer",
    "producer_config",
]

# ``reconnect.backoff.ms`` stays librdkafka's 100 ms. A new client's first request waits up to
# half of it for its connection to the broker the metadata names (librdkafka's sparse
# connection interval): ~50 ms per client on loopback, a dozen clients per start. 20 ms made
# starts ~60 ms faster, but a runner retrying a group commit through a 45 s partition then
# aborted on a librdkafka assertion in 11 of 12 test runs, against 4 of 10 with 100 ms
# (bench/RESULTS.md, "Start-up: 50 ms per new client").
PRODUCER_DEFAULTS: Mapping[str, Any] = {
    # Exactly-once needs per-partition FIFO without duplicates from retries.
    "enable.idempotence": True,
    "acks": "all",
    "max.in.flight.requests.per.connection": 5,
    # Throughput: batch aggressively; checkpoints flush anyway.
    "linger.ms": 5,
    "batch.num.messages": 10000,
    "queue.buffering.max.messages": 1_000_000,
    "queue.buffering.max.kbytes": 1_048_576,
}

CONSUMER_DEFAULTS: Mapping[str, Any] = {
    # Offsets live in checkpoints. A group offset may be committed for lag monitoring only.
    "enable.auto.commit": False,
    "enable.auto.offset.store": False,
    "auto.offset.reset": "earliest",
    # Never show records of aborted (or still open) transactions to the pipeline.
    "isolation.level": "read_committed",
    # End-offset detection (bounded runs) relies on EOF events.
    "enable.partition.eof": True,
    # librdkafka's 1000 ms default capped one consumer near 160k records/s (bench/README.md,
    # "The reference job").
    "fetch.queue.backoff.ms": 10,
    "queued.max.messages.kbytes": 65536,
}

_ACKS_ALL = {"all", "-1", -1}
_VALID_ISOLATION = {"read_committed", "read_uncommitted"}
_VALID_RESET = {"earliest", "latest", "error", "smallest", "largest", "beginning", "end"}
_MANAGED_KEYS = {
    "transactional.id": "eosflow derives transactional ids from the job and sink subtask; set the "
    "sink's transactional_id_prefix instead",
    "bootstrap.servers": "set KafkaSettings.brokers (or EOSFLOW_KAFKA_BROKERS) instead",
}
_KNOWN_KEYS = set(PRODUCER_DEFAULTS) | set(CONSUMER_DEFAULTS) | {
    "client.id", "group.id", "security.protocol", "sasl.mechanism", "sasl.username",
    "sasl.password", "ssl.ca.location", "compression.type", "message.max.bytes",
    "session.timeout.ms", "max.poll.interval.ms", "transaction.timeout.ms", "retries",
    "fetch.min.bytes", "fetch.wait.max.ms", "statistics.interval.ms", "debug",
}  # fmt: skip


@dataclass(frozen=True)
class KafkaSettings:
    """Where the Kafka cluster is and the librdkafka settings every client shares.

    Attributes:
        brokers: ``bootstrap.servers``, e.g. ``"kafka-1:9092,kafka-2:9092"``.
        client_config: librdkafka properties merged into every client (security, SASL, TLS).
    """

    brokers: str
    client_config: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.brokers or not isinstance(self.brokers, str):
            raise ConfigError(
                "KafkaSettings.brokers is empty; expected 'host:port[,host:port]', e.g. set "
                "EOSFLOW_KAFKA_BROKERS=localhost:9092 or run 'eosflow dev up'"
            )
        _check_key_spelling(self.client_config, "client_config")
        for key in self.client_config:
            if key in _MANAGED_KEYS:
                raise ConfigError(f"client_config may not set {key!r}: {_MANAGED_KEYS[key]}")

    @classmethod
    def from_env(
        cls, brokers: str | None = None, environ: Mapping[str, str] | None = None
    ) -> KafkaSettings:
        """Settings from ``EOSFLOW_KAFKA_BROKERS`` and ``EOSFLOW_KAFKA_CONFIG`` (a properties file).

        Raises:
            ConfigError: no brokers given, or the properties file is unreadable or malformed.
        """
        env = os.environ if environ is None else environ
        brokers = brokers or env.get("EOSFLOW_KAFKA_BROKERS")
        if not brokers:
            raise ConfigError(
                "no Kafka brokers configured: set EOSFLOW_KAFKA_BROKERS=host:port, or run "
                "'eosflow dev up' to start an embedded broker"
            )
        path = env.get("EOSFLOW_KAFKA_CONFIG")
        return cls(brokers, read_properties(Path(path)) if path else {})


def read_properties(path: Path) -> dict[str, str]:
    """Parse a Java-style ``key=value`` properties file (``#`` and ``!`` start comments)."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"EOSFLOW_KAFKA_CONFIG={str(path)!r} cannot be read: {exc}") from exc
    props: dict[str, str] = {}
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line[0] in "#!":
            continue
        key, sep, value = line.partition("=")
        if not sep:
            key, sep, value = line.partition(":")
        if not sep or not key.strip():
            raise ConfigError(f"{path}:{number}: expected 'key=value', got {raw!r}")
        props[key.strip()] = value.strip()
    return props


def _check_key_spelling(config: Mapping[str, Any], where: str) -> None:
    for key in config:
        if not isinstance(key, str):
            raise ConfigError(f"{where}: librdkafka keys are strings, got {key!r}")
        if "_" in key and "." not in key:
            dotted = key.replace("_", ".")
            guess = difflib.get_close_matches(dotted, _KNOWN_KEYS, n=1)
            hint = guess[0] if guess else dotted
            raise ConfigError(
                f"{where}: {key!r} looks like a snake_case name; librdkafka keys are dotted "
                f"(did you mean {hint!r}?)"
            )


def _validate_producer(config: Mapping[str, Any]) -> None:
    idem = config.get("enable.idempotence")
    if str(idem).lower() in {"false", "0"}:
        raise UnsafeKafkaConfigError(
            "enable.idempotence", idem,
            "without idempotence a retried send can duplicate or reorder records in a channel",
            "remove the override (eosflow sets enable.idempotence=true)",
        )  # fmt: skip
    acks = config.get("acks")
    if acks not in _ACKS_ALL and str(acks) not in _ACKS_ALL:
        raise UnsafeKafkaConfigError(
            "acks", acks, "records acknowledged by the leader alone are lost if it fails",
            "use acks=all (the default)",
        )  # fmt: skip
    inflight = int(config.get("max.in.flight.requests.per.connection", 5))
    if inflight > 5:
        raise UnsafeKafkaConfigError(
            "max.in.flight.requests.per.connection", inflight,
            "the idempotent producer keeps order only with at most 5 requests in flight",
            "use a value from 1 to 5",
        )  # fmt: skip
    if "retries" in config and int(config["retries"]) == 0:
        raise UnsafeKafkaConfigError(
            "retries", 0, "a transient broker error would fail the epoch instead of retrying",
            "remove the override",
        )  # fmt: skip


def _validate_consumer(config: Mapping[str, Any], *, allow_read_uncommitted: bool) -> None:
    for key in ("enable.auto.commit", "enable.auto.offset.store"):
        if str(config.get(key)).lower() in {"true", "1"}:
            raise UnsafeKafkaConfigError(
                key, config[key],
                "eosflow keeps input offsets in checkpoints; automatic group commits run ahead "
                "of the last checkpoint, so anything restarting from group offsets skips records",
                f"remove the override ({key}=false is the default)",
            )  # fmt: skip
    isolation = config.get("isolation.level")
    if isolation not in _VALID_ISOLATION:
        raise ConfigError(
            f"isolation.level={isolation!r}; expected one of {sorted(_VALID_ISOLATION)}"
        )
    if isolation == "read_uncommitted" and not allow_read_uncommitted:
        raise UnsafeKafkaConfigError(
            "isolation.level", isolation,
            "a read_uncommitted reader sees records of transactions that are later aborted",
            "use read_committed (the default)",
        )  # fmt: skip
    reset = config.get("auto.offset.reset")
    if reset not in _VALID_RESET:
        raise ConfigError(f"auto.offset.reset={reset!r}; expected one of {sorted(_VALID_RESET)}")


def _merged(
    settings: KafkaSettings, defaults: Mapping[str, Any], overrides: Mapping[str, Any] | None
) -> dict[str, Any]:
    overrides = dict(overrides or {})
    _check_key_spelling(overrides, "overrides")
    for key in overrides:
        if key in _MANAGED_KEYS:
            raise ConfigError(f"overrides may not set {key!r}: {_MANAGED_KEYS[key]}")
    return {
        **defaults,
        **settings.client_config,
        **overrides,
        "bootstrap.servers": settings.brokers,
    }


def producer_config(
    settings: KafkaSettings,
    *,
    transactional_id: str | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """librdkafka producer settings: idempotent, acks=all, batched; validated."""
    config = _merged(settings, PRODUCER_DEFAULTS, overrides)
    _validate_producer(config)
    if transactional_id is not None:
        config["transactional.id"] = transactional_id
    return config


def consumer_config(
    settings: KafkaSettings,
    *,
    group_id: str,
    overrides: Mapping[str, Any] | None = None,
    allow_read_uncommitted: bool = False,
) -> dict[str, Any]:
    """librdkafka consumer settings: no auto-commit, read_committed, EOF events; validated.

    Args:
        group_id: used for lag monitoring only; offsets of record live in checkpoints.
        allow_read_uncommitted: only for readers that must see aborted records on purpose (the
            Kafka sink's recovery re-reads an aborted transaction's range).
    """
    config = _merged(settings, CONSUMER_DEFAULTS, overrides)
    config["group.id"] = group_id
    _validate_consumer(config, allow_read_uncommitted=allow_read_uncommitted)
    return config


def admin_config(
    settings: KafkaSettings, overrides: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    return _merged(settings, {}, overrides)


def _construct(kind: str, factory: Any, config: Mapping[str, Any]) -> Any:
    # librdkafka logs every retry of an unreachable broker: count them instead (outage.py).
    config = {"logger": OUTAGES, "error_cb": report_client_error, **config}
    try:
        return factory(config)
    except (KafkaException, ValueError, TypeError) as exc:
        # librdkafka validates every key and value at construction: surface it as configuration.
        raise ConfigError(f"invalid Kafka {kind} configuration: {exc}") from exc


def create_producer(config: Mapping[str, Any]) -> Producer:
    """A ``confluent_kafka.Producer``; a bad key or value is a :class:`ConfigError`."""
    return _construct("producer", Producer, config)  # type: ignore[no-any-return]


def connect_producer(producer: Producer, timeout: float = 5.0) -> None:
    """Bring ``producer``'s connection to the cluster up before ``init_transactions``.

    A new client talks to the bootstrap address first, then drops that connection for one to
    the broker the metadata names (librdkafka connects it up to ``reconnect.backoff.ms`` / 2
    later). ``init_transactions`` started in that gap finds no broker for the coordinator
    lookup and parks the producer-id request on librdkafka's fixed 500 ms timer ("Starting PID
    FSM timer: No broker available"). With the pool's ids initialized in parallel
    (the Kafka sink's ``recover``) on Tansu, 8 parallel inits hit it in 29 of 30 cold tries,
    so every start and restart of a job waited 0.5 s for nothing (bench/RESULTS.md, "Start-up
    and shut-down"). A cluster metadata request returns once the broker's own connection
    answered it: with it first, none of 65 tries waited. (A request for one topic is answered
    on the bootstrap connection and does not help: 20 of 20 waited.) An error here is left to
    ``init_transactions``, which retries and classifies it.

    The job's claim (:mod:`connectors.claim`) hit the same timer in about one start in three on
    Apache Kafka 4.3.1: its ``init_transactions`` took 504 ms instead of 54 (issue 51).

    The wait is librdkafka's, not Tansu's, so this is not switched by the broker probe. Its
    cost grows with the cluster: a full metadata reply per producer (up to 8 per sink subtask
    at each start). Measured on the embedded broker only; on a cluster with many thousands of
    topics it may cost more than the 0.5 s it saves (a known gap: bench/RESULTS.md).
    """
    try:
        producer.list_topics(timeout=timeout)
    except KafkaException as exc:
        log.debug("metadata request before init_transactions failed: %s", exc)


def create_consumer(config: Mapping[str, Any]) -> Consumer:
    """A ``confluent_kafka.Consumer``; a bad key or value is a :class:`ConfigError`."""
    return _construct("consumer", Consumer, config)  # type: ignore[no-any-return]


def create_admin(config: Mapping[str, Any]) -> AdminClient:
    """A ``confluent_kafka.admin.AdminClient``; a bad key or value is a :class:`ConfigError`."""
    return _construct("admin", AdminClient, config)  # type: ignore[no-any-return]
