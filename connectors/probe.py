"""Probe what the broker in use can do, instead of assuming it.

Exactly-once through Kafka rests on broker features that Kafka-protocol brokers do not all have
(Tansu's ``read_committed`` consumers still see aborted records, for one). :func:`probe_broker`
tries each feature for real on a scratch topic and returns :class:`BrokerCapabilities`; the CLI and
the runners log it at start-up, and tests use it to decide what they can check.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from confluent_kafka import KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import ConfigResource  # type: ignore[attr-defined]

from connectors.admin import TopicAdmin, admin_client
from connectors.broker_version import api_versions
from connectors.config import (
    KafkaSettings,
    admin_config,
    connect_producer,
    consumer_config,
    create_admin,
    create_consumer,
    create_producer,
    producer_config,
)
from connectors.offsets import watermarks
from processor.errors import KafkaClientError

__all__ = [
    "BrokerCapabilities",
    "broker_transaction_max_timeout",
    "deletes_records",
    "probe_broker",
    "write_aborted_then_committed",
]

log = logging.getLogger(__name__)

_ABORTED = b"eosflow-probe-aborted"
_COMMITTED = b"eosflow-probe-committed"
_BATCH = 20


@dataclass(frozen=True)
class BrokerCapabilities:
    """What the broker did when tried.

    Attributes:
        brokers: the bootstrap servers probed.
        cluster_id: as reported in metadata.
        broker_count: brokers in the cluster.
        idempotent_producer: an idempotent producer initialized and delivered.
        transactions: init, commit and abort of a transaction worked.
        read_committed_hides_aborted: a ``read_committed`` consumer did not see aborted records.
            False on Tansu; True on Apache Kafka.
        group_join_seconds: time for a new consumer group member to get its assignment
            (``None`` if it did not within the probe's limit).
        transaction_max_timeout_ms: the broker's ``transaction.max.timeout.ms`` if it reports it.
        list_offsets_exact: ListOffsets(latest) agrees with the high watermark of a Fetch (False on
            Tansu; eosflow measures end offsets by fetch either way, see connectors.offsets).
        delete_records: DeleteRecords moved a partition's low watermark (False on Tansu 0.6,
            whose in-memory storage drops the connection): without it channel topics are
            never purged and grow until the job is reset.
        release: the Kafka release the cluster runs, from its finalized ``metadata.version``
            (KRaft) or its ``inter.broker.protocol.version`` (ZooKeeper), e.g. ``4.3 (KRaft,
            metadata.version 30)``; ``None`` when it reports neither (Tansu).
        transaction_version: the finalized ``transaction.version`` (KIP-890; 2 on Kafka 4.x
            clusters created new), 0 where it is not finalized, ``None`` where not reported.
        notes: what went wrong where a feature is missing.
    """

    brokers: str
    cluster_id: str | None
    broker_count: int
    idempotent_producer: bool
    transactions: bool
    read_committed_hides_aborted: bool
    group_join_seconds: float | None
    transaction_max_timeout_ms: int | None
    list_offsets_exact: bool = True
    delete_records: bool = False
    release: str | None = None
    transaction_version: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def exactly_once_transactions(self) -> bool:
        """Transactional output is hidden from readers until commit: the full Kafka guarantee."""
        return self.idempotent_producer and self.transactions and self.read_committed_hides_aborted

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "exactly_once_transactions": self.exactly_once_transactions}

    def summary(self) -> str:
        """A few lines for a person: what is and is not guaranteed on this broker."""
        yes = {True: "yes", False: "NO"}
        join = f"{self.group_join_seconds:.1f}s" if self.group_join_seconds is not None else "n/a"
        txv = "not reported" if self.transaction_version is None else self.transaction_version
        lines = [
            f"broker {self.brokers} (cluster {self.cluster_id}, {self.broker_count} broker(s))",
            f"  Kafka release: {self.release or 'not reported (not Apache Kafka?)'}",
            f"  transaction.version: {txv}",
            f"  idempotent producer: {yes[self.idempotent_producer]}",
            f"  transactions: {yes[self.transactions]}",
            f"  read_committed hides aborted records: {yes[self.read_committed_hides_aborted]}",
            f"  consumer group join: {join}",
            f"  transaction.max.timeout.ms: {self.transaction_max_timeout_ms or 'not reported'}",
            f"  ListOffsets(latest) exact: {yes[self.list_offsets_exact]}",
            f"  DeleteRecords (channel topics purged): {yes[self.delete_records]}",
        ]
        if self.exactly_once_transactions:
            lines.append(
                "  => transactional Kafka output is exactly-once for read_committed readers"
            )
        else:
            lines.append(
                "  => readers of this broker may see records of aborted transactions: use the "
                "staged (ID-deduplicated) Kafka output or dedup on read for exactly-once"
            )
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def probe_broker(settings: KafkaSettings, *, timeout: float = 20.0) -> BrokerCapabilities:
    """Try idempotence, transactions, ``read_committed`` and a group join on a scratch topic.

    The scratch topic ``eosflow-probe-<random>`` is deleted afterwards. Takes about as long as a
    group join on the broker (~3 s on Tansu and on Kafka with default settings).
    """
    notes: list[str] = []
    admin = TopicAdmin(settings, timeout=timeout)
    raw_admin = create_admin(admin_config(settings))
    metadata = raw_admin.list_topics(timeout=timeout)
    topic = f"eosflow-probe-{uuid.uuid4().hex[:12]}"
    admin.ensure_topic(topic, 1)
    join: list[float | None] = [None]
    joiner = threading.Thread(
        target=_time_group_join, args=(settings, topic, join, timeout), daemon=True
    )
    joiner.start()
    try:
        idempotent = _try_idempotent(settings, topic, notes, timeout)
        exact = _list_offsets_exact(settings, topic, notes, timeout)
        transactions = _try_transactions(settings, topic, notes, timeout)
        hides = transactions and _read_committed_hides_aborted(settings, topic, timeout)
        if transactions and not hides:
            notes.append("read_committed consumers receive records of aborted transactions")
        joiner.join(timeout + 5)
        purges = _try_delete_records(settings, topic, notes, timeout)  # last: it moves offset 0
        release, txv = _release(settings, raw_admin, metadata, notes, timeout)
        caps = BrokerCapabilities(
            brokers=settings.brokers,
            cluster_id=metadata.cluster_id,
            broker_count=len(metadata.brokers),
            idempotent_producer=idempotent,
            transactions=transactions,
            read_committed_hides_aborted=hides,
            group_join_seconds=join[0],
            transaction_max_timeout_ms=_transaction_max_timeout(raw_admin, metadata, notes),
            list_offsets_exact=exact,
            delete_records=purges,
            release=release,
            transaction_version=txv,
            notes=notes,
        )
        _DELETES_RECORDS.setdefault(settings.brokers, purges)
    finally:
        try:
            admin.delete_topics([topic])
        except Exception as exc:  # deleting scratch data must not hide the probe's result
            log.warning("could not delete probe topic=%s: %s", topic, exc)
    log.info("broker capabilities: %s", caps.as_dict())
    return caps


def _try_idempotent(settings: KafkaSettings, topic: str, notes: list[str], timeout: float) -> bool:
    producer = create_producer(producer_config(settings))
    failures: list[str] = []

    def delivered(err: KafkaError | None, _msg: object) -> None:
        if err is not None:
            failures.append(str(err))

    # Several records in one batch: exposes a ListOffsets that counts batches instead of records.
    for _ in range(_BATCH):
        producer.produce(topic, b"idempotent", partition=0, on_delivery=delivered)
    left = producer.flush(timeout)
    if left or failures:
        notes.append(f"idempotent produce failed: {failures or f'{left} undelivered'}")
        return False
    return True


def write_aborted_then_committed(
    settings: KafkaSettings,
    topic: str,
    *,
    aborted: bytes = _ABORTED,
    committed: bytes = _COMMITTED,
    timeout: float = 30.0,
) -> None:
    """Write ``aborted`` in a transaction that is aborted, then ``committed`` in one that commits.

    Both go to partition 0 of ``topic``. What a ``read_committed`` reader then sees tells whether
    the broker hides aborted records (the probe, and tests that check the probe, use this).
    """
    producer = create_producer(
        producer_config(
            settings, transactional_id=f"{topic}-txn", overrides={"transaction.timeout.ms": 60000}
        )
    )
    connect_producer(producer)
    producer.init_transactions(timeout)
    producer.begin_transaction()
    producer.produce(topic, aborted, partition=0)
    producer.flush(timeout)
    producer.abort_transaction(timeout)
    producer.begin_transaction()
    producer.produce(topic, committed, partition=0)
    producer.commit_transaction(timeout)


def _try_transactions(
    settings: KafkaSettings, topic: str, notes: list[str], timeout: float
) -> bool:
    try:
        write_aborted_then_committed(settings, topic, timeout=timeout)
    except KafkaException as exc:
        notes.append(f"transactions failed: {exc}")
        return False
    return True


def _list_offsets_exact(
    settings: KafkaSettings, topic: str, notes: list[str], timeout: float
) -> bool:
    conf = consumer_config(settings, group_id=f"{topic}-offsets")
    consumer = create_consumer(conf)
    try:
        _, listed = consumer.get_watermark_offsets(
            TopicPartition(topic, 0), timeout=timeout, cached=False
        )
    finally:
        consumer.close()
    fetched = watermarks(conf, [(topic, 0)], timeout=timeout)[(topic, 0)][1]
    if listed != fetched:
        notes.append(
            f"ListOffsets(latest) said {listed}, a fetch said {fetched}: end offsets are fetched"
        )
    return bool(listed == fetched)


def _read_committed_hides_aborted(settings: KafkaSettings, topic: str, timeout: float) -> bool:
    """Whether a ``read_committed`` reader skipped the aborted record before the committed one.

    Raises:
        KafkaClientError: the committed record did not arrive within ``timeout`` (a broker
            under strain): undecidable, so no answer, never "no" (issue 35: a "no" taken from a
            slow read switched a sink to counting an aborted epoch as committed).
    """
    consumer = create_consumer(consumer_config(settings, group_id=f"{topic}-rc"))
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        seen: set[bytes] = set()
        deadline = time.monotonic() + timeout
        while _COMMITTED not in seen and time.monotonic() < deadline:
            for msg in consumer.consume(100, 0.2):
                value = msg.value()
                if msg.error() is None and value is not None:
                    seen.add(value)
        if _COMMITTED not in seen:
            raise KafkaClientError(
                f"could not tell whether read_committed readers of {settings.brokers} skip "
                f"aborted records: the probe's own committed record in {topic}[0] did not "
                f"arrive within {timeout:g}s (the broker is slow or unreachable)",
                retriable=True,
            )
        return _ABORTED not in seen
    finally:
        consumer.close()


def _try_delete_records(
    settings: KafkaSettings, topic: str, notes: list[str], timeout: float
) -> bool:
    """DeleteRecords below offset 1 of partition 0 (which holds records by now), for real:
    True when the broker answered with a low watermark of at least 1.

    Decided by the broker's answer, never by a timeout: Tansu 0.6 drops the connection at
    once (its in-memory storage has no DeleteRecords), which fails the request with a
    transport error; a broker without the API answers an error code."""
    admin = TopicAdmin(settings, timeout=timeout, shared=False)  # it may drop the connection
    try:
        future = admin.delete_records({(topic, 0): 1})[(topic, 0)]
        low = getattr(future.result(), "low_watermark", None)
    except KafkaException as exc:
        err = exc.args[0] if exc.args else exc
        notes.append(
            "DeleteRecords failed "
            f"({err.str() if hasattr(err, 'str') else err}): channel topics are not purged"
        )
        return False
    if low is None or low < 1:
        notes.append(f"DeleteRecords answered low watermark {low}: channel topics are not purged")
        return False
    return True


#: What the child process of :func:`_try_delete_records_apart` runs.
_CHILD = "from connectors.probe import _delete_records_child; _delete_records_child()"


def _try_delete_records_apart(
    settings: KafkaSettings, topic: str, notes: list[str], timeout: float
) -> bool:
    """:func:`_try_delete_records` in a child process.

    On a broker that drops the connection at a DeleteRecords request (Tansu 0.6), the client's
    failure path once crashed the runner: SIGSEGV inside ``AdminClient.delete_records``, in the
    runner's probe thread, under load (faulthandler's stack, reproduced in a stress run of
    ``tests/e2e/test_savepoint_reset.py``); a runner's earlier unexplained exit -11 at the start
    of a lake job fits it. In a child, such a crash costs the probe, not the run: the answer is
    then "not purged", which never loses a record (this run keeps its channel records; the next
    run that purges deletes them below its oldest retained checkpoint, or ``eosflow reset``).
    """
    try:
        request = json.dumps(
            {"brokers": settings.brokers, "config": dict(settings.client_config),
             "topic": topic, "timeout": timeout}
        )  # fmt: skip
    except (TypeError, ValueError):  # callbacks in client_config: only this process has them
        return _try_delete_records(settings, topic, notes, timeout)
    root = str(Path(__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{path}" if path else root}
    limit = timeout + 30.0  # the child's interpreter and imports, then the request's timeout
    try:
        done = subprocess.run(
            [sys.executable, "-X", "faulthandler", "-c", _CHILD],
            input=request, capture_output=True, text=True, timeout=limit, env=env,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        notes.append(
            f"DeleteRecords probe gave no answer in {limit:.0f}s: channel topics are not purged"
        )
        return False
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        log.warning(
            "the DeleteRecords probe's process failed (exit %s); channel topics are not purged "
            "in this run: %s", done.returncode, done.stderr[-2000:],
        )  # fmt: skip
        notes.append(
            f"DeleteRecords probe failed (exit {done.returncode}): channel topics are not purged"
        )
        return False
    answer = json.loads(lines[-1])
    notes.extend(str(n) for n in answer["notes"])
    return bool(answer["answer"])


def _delete_records_child() -> None:
    """The child of :func:`_try_delete_records_apart`: the request on stdin, the answer and
    its notes as the last line of stdout."""
    request = json.loads(sys.stdin.read())
    settings = KafkaSettings(request["brokers"], request["config"])
    notes: list[str] = []
    answer = _try_delete_records(settings, request["topic"], notes, float(request["timeout"]))
    print(json.dumps({"answer": answer, "notes": notes}), flush=True)


_DELETES_RECORDS: dict[str, bool] = {}
_HIDES_ABORTED: dict[str, bool] = {}


def _remembered(
    cache: dict[str, bool],
    settings: KafkaSettings,
    what: str,
    check: Callable[[str], bool],
    timeout: float,
) -> bool:
    """``check(scratch_topic)``, tried for real once per process and cluster, then remembered;
    the scratch topic is deleted afterwards (a failure to delete it is only logged)."""
    known = cache.get(settings.brokers)
    if known is not None:
        return known
    admin = TopicAdmin(settings, timeout=timeout)
    topic = f"eosflow-probe-{uuid.uuid4().hex[:12]}"
    admin.ensure_topic(topic, 1)
    try:
        answer = check(topic)
    finally:
        try:
            admin.delete_topics([topic])
        except Exception as exc:  # deleting scratch data must not hide the answer
            log.warning("could not delete probe topic=%s: %s", topic, exc)
    cache[settings.brokers] = answer
    log.info("broker=%s %s: %s", settings.brokers, what, answer)
    return answer


def deletes_records(settings: KafkaSettings, *, timeout: float = 20.0) -> bool:
    """Whether the broker deletes records on request (DeleteRecords), tried for real on a
    scratch topic once per process and cluster, then remembered (Apache Kafka: yes; Tansu
    0.6: no). The runner asks once per run; its workers purge or not (docs/failures.md)."""
    notes: list[str] = []

    def check(topic: str) -> bool:
        if not _try_idempotent(settings, topic, notes, timeout):
            return False
        return _try_delete_records_apart(settings, topic, notes, timeout)

    answer = _remembered(_DELETES_RECORDS, settings, "DeleteRecords", check, timeout)
    if notes:
        log.info("broker=%s DeleteRecords probe: %s", settings.brokers, "; ".join(notes))
    return answer


def hides_aborted_records(settings: KafkaSettings, *, timeout: float = 20.0) -> bool:
    """Whether the broker's ``read_committed`` readers skip records of aborted transactions
    (Apache Kafka: yes; Tansu: no), tried for real on a scratch topic once per process and
    cluster, then remembered.

    A workaround for a broker that does not hide them must be switched on by this answer, never
    by a timeout that can also fire on Apache Kafka (docs/brokers.md).
    """

    def check(topic: str) -> bool:
        write_aborted_then_committed(settings, topic, timeout=timeout)
        return _read_committed_hides_aborted(settings, topic, timeout)

    return _remembered(
        _HIDES_ABORTED, settings, "read_committed hides aborted records", check, timeout
    )


def _time_group_join(
    settings: KafkaSettings, topic: str, out: list[float | None], timeout: float
) -> None:
    joined = threading.Event()
    consumer = create_consumer(
        consumer_config(
            settings,
            group_id=f"{topic}-join",
            overrides={"session.timeout.ms": 6000, "enable.partition.eof": False},
        )
    )
    try:
        start = time.monotonic()
        consumer.subscribe([topic], on_assign=lambda _c, _p: joined.set())
        while not joined.is_set() and time.monotonic() - start < timeout:
            consumer.poll(0.1)
        out[0] = time.monotonic() - start if joined.is_set() else None
    finally:
        consumer.close()


def _release(
    settings: KafkaSettings, raw_admin: object, metadata: object, notes: list[str], timeout: float
) -> tuple[str | None, int | None]:
    """The release the cluster runs and its ``transaction.version`` (see
    :mod:`connectors.broker_version`)."""
    host, _, port = settings.brokers.split(",")[0].strip().rpartition(":")
    txv: int | None = None
    try:
        version = api_versions(host or "127.0.0.1", int(port), timeout=min(timeout, 5.0))
    except (OSError, ValueError) as exc:  # TLS/SASL listeners, or not Kafka: say so
        notes.append(f"ApiVersions not readable over plain text ({exc})")
    else:
        txv = version.transaction_version if version.finalized else None
        if version.kraft_release:
            level = version.finalized["metadata.version"]
            return f"{version.kraft_release} (KRaft, metadata.version {level})", txv
    ibp = _broker_config(raw_admin, metadata, "inter.broker.protocol.version", notes)
    if ibp:
        return f"{ibp.split('-')[0]} (inter.broker.protocol.version {ibp})", txv
    return None, txv


def broker_transaction_max_timeout(settings: KafkaSettings, *, timeout: float = 10.0) -> int | None:
    """The broker's ``transaction.max.timeout.ms``, or ``None`` if it does not report it."""
    value = broker_config(settings, "transaction.max.timeout.ms", timeout=timeout)
    return int(value) if value is not None else None


def broker_config(settings: KafkaSettings, name: str, *, timeout: float = 10.0) -> str | None:
    """One setting of a broker of the cluster (DescribeConfigs), or ``None`` if the broker
    does not report it (Tansu reports none; an ACL may forbid it)."""
    raw_admin = admin_client(settings)
    metadata = raw_admin.list_topics(timeout=timeout)
    return _broker_config(raw_admin, metadata, name, [])


def _transaction_max_timeout(raw_admin: object, metadata: object, notes: list[str]) -> int | None:
    value = _broker_config(raw_admin, metadata, "transaction.max.timeout.ms", notes)
    return int(value) if value is not None else None


def _broker_config(raw_admin: object, metadata: object, name: str, notes: list[str]) -> str | None:
    brokers = getattr(metadata, "brokers", {})
    if not brokers:
        return None
    broker_id = str(next(iter(brokers)))
    try:
        futures = raw_admin.describe_configs(  # type: ignore[attr-defined]
            [ConfigResource("broker", broker_id)], request_timeout=5.0
        )
        for future in futures.values():
            entry = future.result().get(name)
            if entry is not None and entry.value is not None:
                return str(entry.value)
    except KafkaException as exc:
        notes.append(f"broker configs not readable ({exc.args[0].str() if exc.args else exc})")
    return None
