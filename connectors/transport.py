"""The engine's Kafka transport: channel and source reading, idempotent writing, topic admin.

Implements :class:`processor.contracts.Transport`. The runtime receives it from the runner's
wiring (``--transport connectors.transport:from_env``), so the engine never imports Kafka code.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer

from connectors.admin import (
    INTERNAL_TOPIC_CONFIG,
    TopicAdmin,
    TopicSpec,
    quiet_admin_client,
    sharing_admin_clients,
)
from connectors.claim import KafkaJobClaim
from connectors.config import (
    KafkaSettings,
    create_producer,
    producer_config,
)
from connectors.errors import classify
from connectors.outage import report_client_error
from connectors.probe import deletes_records
from connectors.reader import PartitionReader
from processor.errors import ConfigError, KafkaClientError

__all__ = [
    "CHANNEL_PRODUCER_OVERRIDES",
    "KafkaTransport",
    "KafkaWriter",
    "channel_producer_config",
    "check_reachable",
    "from_env",
    "produce_waiting",
]

log = logging.getLogger(__name__)
TP = tuple[str, int]


def produce_waiting(producer: Any, topic: str, value: bytes, key: Any = None, **kw: Any) -> None:
    """``producer.produce(...)``, waiting for room while librdkafka's local queue is full."""
    while True:
        try:
            producer.produce(topic, value, key, **kw)
            return
        except BufferError:  # local queue full: serve delivery reports, then retry
            producer.poll(0.05)


#: Channel producers: a record is delivered, or the producer fails loudly; never a hole.
#: librdkafka (INTRODUCTION.md, "Idempotent Producer"): with ``enable.gapless.guarantee`` any
#: error that could leave a gap in a partition's series raises a fatal error and fails every
#: queued message, except a message that exceeded ``message.timeout.ms``; ``0`` makes that
#: timeout infinite, so a broker outage only delays records. The broker itself appends a batch
#: only after the producer's previous one (sequence numbers), so a barrier in the log proves
#: every earlier record of its channel is there too.
CHANNEL_PRODUCER_OVERRIDES: Mapping[str, Any] = {
    "enable.gapless.guarantee": True,
    "message.timeout.ms": 0,
}


def channel_producer_config(settings: KafkaSettings, *, client_id: str) -> dict[str, Any]:
    """The channel writer's librdkafka settings: :data:`CHANNEL_PRODUCER_OVERRIDES` win over
    the user's ``client_config`` (a ``message.timeout.ms`` meant for sinks must not let a
    channel drop records)."""
    # Delivery callbacks only for failures: a Python callback per record cost about a fifth
    # of a worker's CPU (py-spy, bench/RESULTS.md).
    return producer_config(
        settings,
        overrides={
            **CHANNEL_PRODUCER_OVERRIDES,
            "client.id": client_id,
            "delivery.report.only.error": True,
        },
    )


class KafkaWriter:
    """An idempotent, gapless producer writing to explicit partitions (one per channel).

    Invariants:
        A barrier (any control record: one with headers) is never written after a record of
        this writer failed: :meth:`write` serves the pending delivery reports first and raises
        the failure instead. :meth:`poll` raises it too, so the worker fails before it acks a
        snapshot. And since the producer is gapless with no local message timeout, a record
        that fails after its channel's barrier was written takes that barrier down with it (a
        fatal error fails every queued record): the barrier never reaches the log over a hole,
        and no checkpoint can complete over one.
    """

    def __init__(self, settings: KafkaSettings, *, client_id: str) -> None:
        config = channel_producer_config(settings, client_id=client_id)
        config["error_cb"] = self._error
        config["on_delivery"] = self._delivered  # every record's (failures only, see above)
        self._producer: Producer = create_producer(config)
        self._failure: KafkaClientError | None = None

    def _delivered(self, err: KafkaError | None, msg: Any) -> None:
        if err is not None and self._failure is None:
            self._failure = classify(err, context=f"delivering to {msg.topic()}[{msg.partition()}]")

    def _error(self, err: KafkaError) -> None:
        """Client-wide errors: a fatal one (the gapless guarantee tripped, a fenced or unknown
        producer) stops the producer; transient ones go to the rate-limited outage log."""
        if err.fatal():
            if self._failure is None:
                self._failure = classify(err, context="channel producer (fatal, it stopped)")
            log.error("channel producer failed: %s", err.str())
        else:
            report_client_error(err)

    def write(
        self,
        topic: str,
        partition: int,
        value: bytes,
        *,
        key: bytes | None = None,
        headers: Any = None,
    ) -> None:
        producer = self._producer
        if headers is not None:  # a control record: no barrier over a failed record
            producer.poll(0)
        if self._failure is not None:
            raise self._failure
        while True:
            try:
                producer.produce(topic, value, key, partition=partition, headers=headers)
                return
            except BufferError:  # local queue full: serve delivery reports, then retry
                producer.poll(0.01)
                if self._failure is not None:
                    raise self._failure from None

    def write_many(
        self, topic: str, records: Sequence[tuple[int, bytes]], key: bytes | None = None
    ) -> None:
        """``write(topic, partition, value, key=key)`` for each ``(partition, value)``, in
        order (the channels' hot path: data records, all with the writer's key, no headers)."""
        if self._failure is not None:
            raise self._failure
        producer = self._producer
        produce = producer.produce
        i, n = 0, len(records)
        while i < n:
            try:
                for partition, value in records[i:] if i else records:
                    produce(topic, value, key, partition)
                    i += 1
            except BufferError:  # local queue full: serve delivery reports, then retry
                producer.poll(0.01)
                if self._failure is not None:
                    raise self._failure from None

    def poll(self) -> None:
        """Serve delivery callbacks without blocking; raise a delivery failure."""
        self._producer.poll(0)
        if self._failure is not None:
            raise self._failure

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

    def sharing_clients(self) -> contextlib.AbstractContextManager[None]:
        """While the block runs, this process's admin clients of one cluster are one client
        (:func:`connectors.admin.sharing_admin_clients`): the runner's start-up checks."""
        return sharing_admin_clients()

    def check_reachable(self, timeout: float = 5.0) -> None:
        """One clear error, in seconds, when the cluster does not answer (instead of minutes of
        librdkafka connection errors, then a traceback: issue 17)."""
        check_reachable(self.settings, timeout=timeout)

    def ensure_topics(self, partitions: Mapping[str, int]) -> None:
        """Channel topics: created with, or altered to, a retention that never deletes
        (:data:`~connectors.admin.INTERNAL_TOPIC_CONFIG`); :meth:`purge` deletes instead."""
        self._admin.ensure_topics(
            TopicSpec(name, n, INTERNAL_TOPIC_CONFIG) for name, n in partitions.items()
        )

    def list_topics(self, prefix: str = "") -> list[str]:
        """The cluster's topics whose names start with ``prefix``."""
        return self._admin.list_topics(prefix)

    def delete_topics(self, names: Iterable[str]) -> None:
        """Deletes topics (an old shape's channels after a rescale); a missing one is fine."""
        self._admin.delete_topics(names)

    def purge_supported(self) -> bool:
        """Whether the broker deletes records on request (probed once per process; Tansu
        does not)."""
        return deletes_records(self.settings)

    def purge(self, before: Mapping[TP, int]) -> dict[TP, Future[object]]:
        """Delete each partition's records below its offset; returns without waiting."""
        return self._admin.delete_records(before)

    def partition_count(self, topic: str) -> int:
        if not self._admin.exists(topic):
            raise ConfigError(
                f"source topic {topic!r} does not exist on {self.settings.brokers}: create it "
                "(or produce to it) before starting the job, or fix the topic name"
            )
        return self._admin.describe(topic).partitions

    def end_offsets(self, tps: Iterable[TP]) -> dict[TP, int]:
        return self._admin.end_offsets(list(tps))

    def beginning_offsets(self, tps: Iterable[TP]) -> dict[TP, int]:
        """Each partition's first offset (above it: records deleted by retention or a purge)."""
        return self._admin.beginning_offsets(list(tps))

    def job_claim(self, job: str) -> KafkaJobClaim:
        """The job's claim: its runner's transactional id and its consumer group
        (:mod:`connectors.claim`)."""
        return KafkaJobClaim(self.settings, job)

    def reader(self, *, group_id: str, deleted: str = "fail") -> PartitionReader:
        return PartitionReader(self.settings, group_id=group_id, deleted=deleted)

    def writer(self, *, client_id: str) -> KafkaWriter:
        return KafkaWriter(self.settings, client_id=client_id)


def check_reachable(settings: KafkaSettings, *, timeout: float = 5.0) -> None:
    """Raise a :class:`ConfigError` naming the address (and where it came from) when no broker
    of ``settings`` answers a metadata request within ``timeout`` seconds.

    The client's own log is silenced for this one request: an unreachable broker made
    librdkafka print a connection error every few hundred milliseconds."""
    try:
        with quiet_admin_client(settings) as admin:
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
