"""The engine's Kafka transport: channel and source reading, idempotent writing, topic admin.

Implements :class:`processor.contracts.Transport`. The runtime receives it from the runner's
wiring (``--transport connectors.transport:from_env``), so the engine never imports Kafka code.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer

from connectors.admin import TopicAdmin, TopicSpec
from connectors.config import (
    KafkaSettings,
    admin_config,
    create_admin,
    create_producer,
    producer_config,
)
from connectors.errors import classify
from connectors.reader import PartitionReader
from processor.errors import ConfigError, KafkaClientError

__all__ = [
    "KafkaTransport",
    "KafkaWriter",
    "check_reachable",
    "from_env",
    "produce_waiting",
]

log = logging.getLogger(__name__)
#: Where the reachability check's client logs go: nowhere (its one error says it all).
_QUIET = logging.getLogger(f"{__name__}.reachability")
_QUIET.addHandler(logging.NullHandler())
_QUIET.propagate = False

TP = tuple[str, int]


def produce_waiting(producer: Any, topic: str, value: bytes, key: Any = None, **kw: Any) -> None:
    """``producer.produce(...)``, waiting for room while librdkafka's local queue is full."""
    while True:
        try:
            producer.produce(topic, value, key, **kw)
            return
        except BufferError:  # local queue full: serve delivery reports, then retry
            producer.poll(0.05)


class KafkaWriter:
    """An idempotent producer writing to explicit partitions.

    Delivery failures are collected by the delivery callback and raised by the next
    :meth:`flush` (or :meth:`write`): a record that cannot be delivered fails the task, and the
    job recovers from its last checkpoint instead of continuing with a hole in a channel.
    """

    def __init__(self, settings: KafkaSettings, *, client_id: str) -> None:
        # Delivery callbacks only for failures: a Python callback per record cost about a fifth
        # of a worker's CPU (py-spy, bench/RESULTS.md).
        config = producer_config(
            settings, overrides={"client.id": client_id, "delivery.report.only.error": True}
        )
        self._producer: Producer = create_producer(config)
        self._failure: KafkaClientError | None = None

    def _delivered(self, err: KafkaError | None, msg: Any) -> None:
        if err is not None and self._failure is None:
            self._failure = classify(err, context=f"delivering to {msg.topic()}[{msg.partition()}]")

    def write(
        self,
        topic: str,
        partition: int,
        value: bytes,
        *,
        key: bytes | None = None,
        headers: Any = None,
    ) -> None:
        if self._failure is not None:
            raise self._failure
        producer = self._producer
        while True:
            try:
                producer.produce(
                    topic, value, key, partition=partition, headers=headers,
                    on_delivery=self._delivered,
                )  # fmt: skip
                return
            except BufferError:  # local queue full: serve delivery reports, then retry
                producer.poll(0.01)

    def poll(self) -> None:
        """Serve delivery callbacks without blocking."""
        self._producer.poll(0)

    def flush(self, timeout: float = 30.0) -> None:
        left = self._producer.flush(timeout)
        if self._failure is not None:
            raise self._failure
        if left:
            raise KafkaClientError(
                f"{left} records not delivered after {timeout}s (broker unreachable?)",
                code="_TIMED_OUT",
                retriable=True,
                txn_requires_abort=False,
                fatal=False,
            )

    def close(self) -> None:
        self._producer.flush(5.0)


class KafkaTransport:
    """Topic admin, readers and writers for one cluster."""

    def __init__(self, settings: KafkaSettings) -> None:
        self.settings = settings
        self._admin_client: TopicAdmin | None = None

    @property
    def _admin(self) -> TopicAdmin:
        """Created on first use: a client connects (and logs every failed attempt) at once,
        and :meth:`check_reachable` must be able to speak first."""
        if self._admin_client is None:
            self._admin_client = TopicAdmin(self.settings)
        return self._admin_client

    def __repr__(self) -> str:
        return f"KafkaTransport({self.settings.brokers!r})"

    def check_reachable(self, timeout: float = 5.0) -> None:
        """One clear error, in seconds, when the cluster does not answer (instead of minutes of
        librdkafka connection errors, then a traceback: issue 17)."""
        check_reachable(self.settings, timeout=timeout)

    def ensure_topics(self, partitions: Mapping[str, int]) -> None:
        self._admin.ensure_topics(TopicSpec(name, n) for name, n in partitions.items())

    def partition_count(self, topic: str) -> int:
        if not self._admin.exists(topic):
            raise ConfigError(
                f"source topic {topic!r} does not exist on {self.settings.brokers}: create it "
                "(or produce to it) before starting the job, or fix the topic name"
            )
        return self._admin.describe(topic).partitions

    def end_offsets(self, tps: Iterable[TP]) -> dict[TP, int]:
        return self._admin.end_offsets(list(tps))

    def reader(self, *, group_id: str, deleted: str = "fail") -> PartitionReader:
        return PartitionReader(self.settings, group_id=group_id, deleted=deleted)

    def writer(self, *, client_id: str) -> KafkaWriter:
        return KafkaWriter(self.settings, client_id=client_id)


def check_reachable(settings: KafkaSettings, *, timeout: float = 5.0) -> None:
    """Raise a :class:`ConfigError` naming the address (and where it came from) when no broker
    of ``settings`` answers a metadata request within ``timeout`` seconds.

    The client's own log is silenced for this one request: an unreachable broker made
    librdkafka print a connection error every few hundred milliseconds."""
    admin = create_admin({**admin_config(settings), "logger": _QUIET})
    try:
        admin.list_topics(timeout=timeout)
    except KafkaException as exc:
        reason = exc.args[0].str() if exc.args and hasattr(exc.args[0], "str") else str(exc)
        source = (
            "EOSFLOW_KAFKA_BROKERS"
            if os.environ.get("EOSFLOW_KAFKA_BROKERS") == settings.brokers
            else "the configured brokers"
        )
        raise ConfigError(
            f"cannot reach Kafka at {settings.brokers} ({source}) within {timeout:g}s: "
            f"{reason}. Start the broker there, or point EOSFLOW_KAFKA_BROKERS at a running "
            "one (unset, eosflow starts an embedded broker; 'eosflow dev up' keeps one running)"
        ) from None


def from_env(environ: Mapping[str, str] | None = None) -> KafkaTransport:
    """The transport for ``EOSFLOW_KAFKA_BROKERS`` (and ``EOSFLOW_KAFKA_CONFIG``)."""
    env = os.environ if environ is None else environ
    brokers = env.get("EOSFLOW_KAFKA_BROKERS")
    if not brokers:
        raise ConfigError(
            "EOSFLOW_KAFKA_BROKERS is not set for the worker: the runner passes the brokers it "
            "resolved; set it to host:port[,host:port] when starting a worker by hand"
        )
    return KafkaTransport(KafkaSettings.from_env(brokers=brokers))
