"""Topic administration: idempotent creation, description, beginning and end offsets, the
retention of eosflow's internal topics, and deleting records no restore needs."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewPartitions,
    NewTopic,
)

from connectors.config import KafkaSettings, admin_config, consumer_config, create_admin
from connectors.errors import classify
from connectors.offsets import watermarks
from connectors.outage import OUTAGES, report_client_error
from processor.errors import ConfigError

__all__ = [
    "INTERNAL_TOPIC_CONFIG",
    "TopicAdmin",
    "TopicInfo",
    "TopicSpec",
    "admin_client",
    "forget_admin_client",
    "kept_admin_client",
    "quiet_admin_client",
    "sharing_admin_clients",
]

log = logging.getLogger(__name__)
#: Where a reachability check's client logs go: nowhere (its one error says it all).
_QUIET = logging.getLogger("connectors.transport.reachability")
_QUIET.addHandler(logging.NullHandler())
_QUIET.propagate = False

TP = tuple[str, int]

#: eosflow's internal topics (channels, commit markers) keep every record until eosflow
#: deletes it: the broker's retention (time or size) could delete channel records that a
#: restore of a retained checkpoint still reads, or the commit marker a rescue looks for.
#: Kafka Streams creates its repartition topics the same way (``RepartitionTopicConfig``:
#: ``retention.ms=-1``, ``cleanup.policy=delete``) and purges them with DeleteRecords.
INTERNAL_TOPIC_CONFIG: Mapping[str, str] = {
    "cleanup.policy": "delete",
    "retention.ms": "-1",
    "retention.bytes": "-1",
}


@dataclass(frozen=True)
class TopicSpec:
    """A topic eosflow needs: name, partition count, and topic-level configs."""

    name: str
    partitions: int
    config: Mapping[str, str] = field(default_factory=dict)
    replication_factor: int | None = None  # None: min(3, brokers in the cluster)

    def __post_init__(self) -> None:
        if self.partitions < 1:
            raise ConfigError(
                f"topic {self.name!r}: partitions must be >= 1, got {self.partitions}"
            )


class _Gate:
    """``logger`` and ``error_cb`` of a shared admin client: what every client logs
    (:data:`~connectors.outage.OUTAGES`), except while a reachability check waits on it."""

    def __init__(self) -> None:
        self.quiet = 0

    def log(self, level: int, fmt: str, *args: object) -> None:
        if not self.quiet:
            OUTAGES.log(level, fmt, *args)

    def error(self, err: KafkaError) -> None:
        if not self.quiet:
            report_client_error(err)


_lock = threading.Lock()
#: Within :func:`sharing_admin_clients`: one client (and its gate) per cluster configuration.
_shared: dict[str, tuple[AdminClient, _Gate]] | None = None


@contextlib.contextmanager
def sharing_admin_clients() -> Iterator[None]:
    """While the block runs, the admin clients of this process for one cluster configuration
    (:func:`admin_client`, :func:`quiet_admin_client`, :class:`TopicAdmin`) are one client.

    Every new librdkafka client pays about 50 ms for its first request to the broker the
    metadata names (a new connection, paced by librdkafka); the runner's start-up checks
    (the sinks' preflight, the reachability check, the topic preparation) made five
    (bench/RESULTS.md, "Start-up and shut-down"). Every check still runs; a client taken in
    the block stays usable after it. Nested blocks share the outer one's clients.
    """
    global _shared
    with _lock:
        outer = _shared is not None
        if not outer:
            _shared = {}
    try:
        yield
    finally:
        if not outer:
            with _lock:
                _shared = None


def _key(settings: KafkaSettings) -> str:
    return repr(sorted(admin_config(settings).items()))


def _shared_entry(settings: KafkaSettings) -> tuple[str, tuple[AdminClient, _Gate]] | None:
    with _lock:
        if _shared is None:
            return None
        key = _key(settings)
        entry = _shared.get(key)
        if entry is None:
            entry = _shared[key] = _gated_admin(settings)
        return key, entry


def _gated_admin(settings: KafkaSettings) -> tuple[AdminClient, _Gate]:
    """A new client whose log goes through a :class:`_Gate` (every client's destination)."""
    gate = _Gate()
    return create_admin({**admin_config(settings), "logger": gate, "error_cb": gate.error}), gate


def admin_client(settings: KafkaSettings) -> AdminClient:
    """A new ``AdminClient``, or in :func:`sharing_admin_clients` the shared one."""
    shared = _shared_entry(settings)
    return shared[1][0] if shared is not None else create_admin(admin_config(settings))


def kept_admin_client(settings: KafkaSettings) -> AdminClient:
    """A new ``AdminClient`` for a caller that keeps it for many requests (the job's claim
    commits the group's offsets on every checkpoint): a new client's first request pays its
    connection, 50-55 ms on a local Apache Kafka 4.3.1, a kept one's 2 ms (bench/RESULTS.md,
    "Latency, start-up and recovery"). Its log goes where every client's does
    (:data:`~connectors.outage.OUTAGES`)."""
    return _gated_admin(settings)[0]


def forget_admin_client(client: AdminClient) -> None:
    """In :func:`sharing_admin_clients`, ``client`` is no longer shared: the next caller gets a
    new one (a client that did not answer in time, which its holder drops)."""
    with _lock:
        if _shared is not None:
            for key, (shared, _gate) in list(_shared.items()):
                if shared is client:
                    del _shared[key]


@contextlib.contextmanager
def quiet_admin_client(settings: KafkaSettings) -> Iterator[AdminClient]:
    """An admin client whose own log is silenced while the block runs (an unreachable broker
    made librdkafka print a connection error every few hundred milliseconds; issue 17).

    In :func:`sharing_admin_clients`, the shared one; when the block raises, it is no longer
    shared (the next caller gets a fresh client, not one left reconnecting)."""
    shared = _shared_entry(settings)
    if shared is None:
        yield create_admin(
            {**admin_config(settings), "logger": _QUIET, "error_cb": lambda _err: None}
        )
        return
    _, (client, gate) = shared
    gate.quiet += 1
    try:
        yield client
    except BaseException:
        forget_admin_client(client)
        raise
    finally:
        gate.quiet -= 1


@dataclass(frozen=True)
class TopicInfo:
    name: str
    partitions: int
    replication_factor: int
    config: Mapping[str, str]


class TopicAdmin:
    """Create, describe and measure topics.

    Args:
        settings: the cluster.
        timeout: seconds for each admin request.
    """

    def __init__(
        self, settings: KafkaSettings, *, timeout: float = 30.0, shared: bool = True
    ) -> None:
        self._settings = settings
        self._timeout = timeout
        # shared in sharing_admin_clients() unless ``shared=False`` (a request that may
        # break the connection)
        self._admin = admin_client(settings) if shared else create_admin(admin_config(settings))

    def broker_count(self) -> int:
        return len(self._admin.list_topics(timeout=self._timeout).brokers)

    def ensure_topics(self, specs: Iterable[TopicSpec], *, any_count: bool = False) -> list[str]:
        """Create the topics that do not exist; verify the partition count of those that do
        (unless ``any_count``: a topic that exists is accepted with any count), and give them
        the spec's topic configs (:meth:`ensure_config`).

        Returns:
            The names of the topics this call created.

        Raises:
            ConfigError: a topic exists with another partition count (channel and source
                partitioning are fixed by the job's parallelism; changing it is a migration),
                or with other configs that cannot be altered.
        """
        specs = list(specs)
        if not specs:
            return []
        # One metadata request first: the topics it lists with a leader for every partition
        # exist, and are neither created nor waited for (every start of a job ensures its
        # claim, channel and marker topics: a CreateTopics refused as TOPIC_ALREADY_EXISTS and
        # two more metadata requests took ~60 ms each on Kafka 4.3). The others take the
        # create path, which also copes with a topic still being deleted.
        metadata = self._admin.list_topics(timeout=self._timeout)
        visible = {
            s.name: n for s in specs if (n := _ready_partitions(metadata, s.name)) is not None
        }
        brokers = max(1, len(metadata.brokers))
        new = [
            NewTopic(
                s.name,
                num_partitions=s.partitions,
                replication_factor=s.replication_factor or min(3, brokers),
                config=dict(s.config),
            )
            for s in specs
            if s.name not in visible
        ]
        created = self._create(new)
        visible.update(self._wait_visible([t.topic for t in new]))
        for spec in specs:
            actual = visible[spec.name]
            if actual != spec.partitions and not any_count:
                raise ConfigError(
                    f"topic {spec.name!r} exists with {actual} partitions, expected "
                    f"{spec.partitions}. Its partitioning is fixed by the job's parallelism: "
                    "delete the topic (losing its data) or keep the old parallelism"
                )
        existing = [s for s in specs if s.name not in created and s.config]
        if existing:
            self.ensure_config(existing)
        return created

    def _create(self, new: list[NewTopic]) -> list[str]:
        """Create ``new``; the names created. A topic whose deletion is still under way is
        created again once it is gone: Kafka deletes asynchronously, and a ZooKeeper broker
        (2.3) answers TOPIC_ALREADY_EXISTS for a while after the topic left the metadata, so a
        delete-then-create (a recreated source topic, ``eosflow reset``) would otherwise find
        a topic that never becomes visible."""
        created: list[str] = []
        deadline = time.monotonic() + self._timeout
        while new:
            specs = {t.topic: t for t in new}
            exist: list[str] = []
            futures = self._admin.create_topics(new, request_timeout=self._timeout)
            for name, future in futures.items():
                try:
                    future.result()
                    created.append(name)
                    log.info("created topic=%s", name)
                except KafkaException as exc:
                    if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                        raise classify(exc, context=f"creating topic {name!r}") from exc
                    exist.append(name)
            deleting: list[NewTopic] = []
            if exist and time.monotonic() < deadline:
                # "already exists" for a topic the metadata no longer lists: being deleted
                listed = self._admin.list_topics(timeout=self._timeout).topics
                deleting = [specs[n] for n in exist if n not in listed]
            if deleting:
                log.info(
                    "topics=%s still being deleted: creating again", [t.topic for t in deleting]
                )
                time.sleep(0.2)
            new = deleting
        return created

    def ensure_config(self, specs: Iterable[TopicSpec]) -> list[str]:
        """Give existing topics the configs of their specs: what the broker reports
        differently (or not at all) is set with IncrementalAlterConfigs, with a warning.

        Altered rather than refused: these are eosflow's own topics (an older eosflow created
        its channel and marker topics with the broker's default retention), the right value is
        never in doubt, and a refusal would leave the operator one command to type on every
        upgrade. Refused only when the broker does not let eosflow alter them.

        Returns:
            The names of the topics altered.

        Raises:
            ConfigError: the broker refused the change (an ACL without AlterConfigs on the
                topic, a broker policy); the message names the topic, the settings and the
                command that fixes them.
        """
        specs = [s for s in specs if s.config]
        if not specs:
            return []
        actual = self._describe_configs([s.name for s in specs])
        altered = []
        for spec in specs:
            have = actual.get(spec.name, {})
            wrong = {k: v for k, v in spec.config.items() if have.get(k) != v}
            if not wrong:
                continue
            was = ", ".join(f"{k}={have.get(k, 'unreported')}" for k in sorted(wrong))
            want = ",".join(f"{k}={v}" for k, v in sorted(wrong.items()))
            resource = ConfigResource(
                "topic",
                spec.name,
                incremental_configs=[
                    ConfigEntry(k, v, incremental_operation=AlterConfigOpType.SET)
                    for k, v in sorted(wrong.items())
                ],
            )
            try:
                for future in self._admin.incremental_alter_configs(
                    [resource], request_timeout=self._timeout
                ).values():
                    future.result()
            except KafkaException as exc:
                reason = exc.args[0].str() if exc.args and hasattr(exc.args[0], "str") else exc
                raise ConfigError(
                    f"topic {spec.name!r} has {was}; eosflow needs {want} (its records must "
                    "stay until no retained checkpoint needs them), and the broker refused to "
                    f"change it: {reason}. Set it yourself: kafka-configs.sh --bootstrap-server "
                    f"{self._settings.brokers} --alter --entity-type topics --entity-name "
                    f"{spec.name} --add-config {want}"
                ) from None
            altered.append(spec.name)
            log.warning(
                "topic=%s had %s: set %s (records no retained checkpoint needs are deleted by "
                "eosflow, not by the broker's retention)",
                spec.name, was, want,
            )  # fmt: skip
        return altered

    def _describe_configs(self, names: list[str]) -> dict[str, dict[str, str]]:
        """The configs the broker reports for each topic (``{}`` for one it reports none of,
        as Tansu does for a topic created without configs)."""
        futures = self._admin.describe_configs(
            [ConfigResource("topic", n) for n in names], request_timeout=self._timeout
        )
        out: dict[str, dict[str, str]] = {}
        for resource, future in futures.items():
            try:
                entries = future.result()
            except KafkaException as exc:  # not allowed to read them: altering will tell
                log.debug("describe_configs topic=%s failed: %s", resource.name, exc)
                entries = {}
            out[resource.name] = {k: v.value for k, v in entries.items() if v.value is not None}
        return out

    def delete_records(self, before: Mapping[TP, int]) -> dict[TP, Future[object]]:
        """Delete the records of each partition below its offset (DeleteRecords; Kafka >= 0.11).

        Returns at once with one future per partition (its result has the new
        ``low_watermark``); the caller decides whether to wait.
        """
        if not before:
            return {}
        request = [TopicPartition(t, p, o) for (t, p), o in sorted(before.items())]
        futures = self._admin.delete_records(request, request_timeout=self._timeout)
        return {(tp.topic, tp.partition): f for tp, f in futures.items()}

    def ensure_topic(
        self,
        name: str,
        partitions: int,
        config: Mapping[str, str] | None = None,
        *,
        any_count: bool = False,
    ) -> bool:
        """Create ``name`` if missing; True when this call created it (``any_count``: accept
        an existing topic whatever its partition count)."""
        spec = TopicSpec(name, partitions, config or {})
        return bool(self.ensure_topics([spec], any_count=any_count))

    def grow_partitions(self, name: str, partitions: int) -> int:
        """Give the existing topic ``name`` at least ``partitions`` partitions (CreatePartitions;
        only for topics whose records are not placed by key, e.g. the commit markers).

        Returns:
            The partition count the broker reports afterwards: fewer than asked when it
            refused (logged with its reason; the caller copes with fewer).
        """
        have = self._wait_visible([name])[name]
        if have >= partitions:
            return have
        try:
            for future in self._admin.create_partitions(
                [NewPartitions(name, partitions)], request_timeout=self._timeout
            ).values():
                future.result()
        except KafkaException as exc:
            err = exc.args[0]
            if err.code() != KafkaError.INVALID_PARTITIONS:  # not "another caller grew it"
                log.warning(
                    "topic=%s not grown from %d to %d partitions: %s", name, have, partitions, err
                )
                return have
        deadline = time.monotonic() + self._timeout
        while True:
            have = self._wait_visible([name])[name]
            if have >= partitions or time.monotonic() > deadline:
                return have
            time.sleep(0.05)

    def _wait_visible(self, names: Iterable[str]) -> dict[str, int]:
        """Wait until metadata shows every partition with a leader; return the partition counts."""
        deadline = time.monotonic() + self._timeout
        pending = set(names)
        counts: dict[str, int] = {}
        while pending:
            metadata = self._admin.list_topics(timeout=self._timeout)
            for name in list(pending):
                count = _ready_partitions(metadata, name)
                if count is not None:
                    counts[name] = count
                    pending.discard(name)
            if pending and time.monotonic() > deadline:
                raise ConfigError(f"topics {sorted(pending)} not visible after {self._timeout}s")
            if pending:
                time.sleep(0.05)
        return counts

    def describe(self, name: str) -> TopicInfo:
        """Partition count, replication factor and (where the broker reports them) configs."""
        metadata = self._admin.list_topics(topic=name, timeout=self._timeout)
        topic = metadata.topics.get(name)
        if topic is None or topic.error is not None:
            raise ConfigError(
                f"topic {name!r} does not exist ({topic.error if topic else 'absent'})"
            )
        replication = max((len(p.replicas) for p in topic.partitions.values()), default=0)
        config: dict[str, str] = {}
        try:
            futures = self._admin.describe_configs(
                [ConfigResource("topic", name)], request_timeout=min(self._timeout, 10.0)
            )
            for future in futures.values():
                config = {k: v.value for k, v in future.result().items() if v.value is not None}
        except KafkaException as exc:
            log.debug("describe_configs topic=%s failed: %s", name, exc)
        return TopicInfo(name, len(topic.partitions), replication, config)

    def exists(self, name: str) -> bool:
        # Metadata for all topics: asking for one topic by name makes brokers that allow
        # auto-creation (Tansu, Kafka's default) create it, and a typo would become a topic.
        topic = self._admin.list_topics(timeout=self._timeout).topics.get(name)
        return topic is not None and topic.error is None and bool(topic.partitions)

    def list_topics(self, prefix: str = "") -> list[str]:
        """The names of the cluster's topics that start with ``prefix``, sorted."""
        topics = self._admin.list_topics(timeout=self._timeout).topics
        return sorted(name for name in topics if name.startswith(prefix))

    def delete_topics(self, names: Iterable[str]) -> None:
        names = list(names)
        if not names:
            return
        for name, future in self._admin.delete_topics(names, request_timeout=self._timeout).items():
            try:
                future.result()
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                    raise classify(exc, context=f"deleting topic {name!r}") from exc

    def partitions(self, topic: str) -> list[TP]:
        return [(topic, p) for p in range(self.describe(topic).partitions)]

    def watermarks(
        self, partitions: Iterable[TP], *, committed: bool = True
    ) -> dict[TP, tuple[int, int]]:
        """``(beginning, end)`` offsets per partition (see :mod:`connectors.offsets`).

        The end is the high watermark whatever ``committed`` says (:mod:`connectors.offsets`:
        librdkafka does not expose the last stable offset); ``committed`` picks the measuring
        consumer's isolation level.
        """
        conf = consumer_config(
            self._settings,
            group_id="eosflow-offsets",
            overrides={"isolation.level": "read_committed" if committed else "read_uncommitted"},
            allow_read_uncommitted=True,
        )
        return watermarks(conf, partitions, timeout=self._timeout)

    def end_offsets(self, partitions: Iterable[TP], *, committed: bool = True) -> dict[TP, int]:
        return {
            tp: high for tp, (_, high) in self.watermarks(partitions, committed=committed).items()
        }

    def beginning_offsets(self, partitions: Iterable[TP]) -> dict[TP, int]:
        return {tp: low for tp, (low, _) in self.watermarks(partitions).items()}


def _ready_partitions(metadata: Any, name: str) -> int | None:
    """``name``'s partition count when ``metadata`` lists it with a leader for every
    partition, else ``None``."""
    topic = metadata.topics.get(name)
    if (
        topic is not None
        and topic.error is None
        and topic.partitions
        and all(p.leader >= 0 for p in topic.partitions.values())
    ):
        return len(topic.partitions)
    return None
