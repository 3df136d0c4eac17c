"""Kafka sinks: transactional (committed on checkpoint completion) and staged (published after it).

Transactional mode (DESIGN.md, "Sinks: two-phase commit")
    Each sink subtask owns a small pool of stable ``transactional.id``\\ s,
    ``<prefix>-<step>-<subtask>-<slot>``. An epoch's records go into one transaction on a free
    slot, each with two headers: :data:`HEADER_SINK` and :data:`HEADER_ID`, which names the sink
    subtask, the epoch and the record's place in it (two headers, not four: headers are the
    largest per-record cost of producing from Python, see bench/RESULTS.md). ``prepare`` writes
    a *marker* record for the epoch into the same transaction (topic
    ``eosflow.<job>.<step>.txn-markers``, partition = subtask), flushes, and returns the
    committable: the transactional id, the epoch tag, the record count, the offset
    range the transaction wrote in every partition and the marker's offset. ``commit`` commits
    the transaction. While it is prepared, the next epoch writes on another slot.

    Recovery closes the window librdkafka leaves open (it cannot resume a transaction after a
    restart; ``init_transactions`` aborts it): for each pending committable, the marker tells
    whether the epoch committed; if it did not, the recorded ranges are re-read with
    ``read_uncommitted``, the records whose headers name this sink, subtask and epoch are kept
    (other producers may share the partitions) and re-published in a new transaction with a new
    marker. A transaction the broker aborted on timeout (commit fails) goes the same way.

Staged mode (no broker transactions needed)
    An epoch's records are staged in the job's snapshot store at ``prepare`` and published with
    the idempotent producer only after the checkpoint completes. A crash while publishing makes
    recovery publish the epoch again, so a partition can hold an epoch's records twice, with the
    same :data:`HEADER_ID` and in the same order: :class:`dedup.staged.StagedDeduplicator` drops
    the repeats for readers (``read_committed`` not required). Partitions are computed at write
    time (Kafka's murmur2 for keyed records, round-robin otherwise) so a re-published record
    lands where the first copy did.

Header values are ASCII bytes. The epoch tag is ``<generation>.<n>`` (the writer's ``n``-th
transaction in that generation): it is known when the first record is written, unlike the
checkpoint id that will end the epoch.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fsspec
import orjson
from confluent_kafka import KafkaError, KafkaException, Producer, TopicPartition
from fsspec.implementations.local import LocalFileSystem

from connectors.admin import TopicAdmin
from connectors.config import (
    KafkaSettings,
    consumer_config,
    create_consumer,
    create_producer,
    producer_config,
)
from connectors.errors import ErrorClass, classify, error_class
from connectors.serde import JsonSerde
from connectors.transport import produce_waiting
from dedup.staged import HEADER_ID, HEADER_SINK
from processor.contracts import Serde, SinkContext
from processor.errors import ConfigError, EosflowError, KafkaClientError
from sinks.files import _fsync_dir

__all__ = [
    "HEADER_EPOCH",
    "HEADER_ID",
    "HEADER_SINK",
    "HEADER_SUBTASK",
    "KafkaSink",
    "KafkaSinkWriter",
    "StagedKafkaSinkWriter",
    "abort_lingering",
    "marker_topic",
    "murmur2",
    "murmur2_partition",
    "read_transaction_markers",
    "transactional_id",
    "transactional_ids",
]

log = logging.getLogger(__name__)

# HEADER_SINK "<job>/<step>", HEADER_ID "<subtask>.<generation>.<n>.<seq>" (unique per sink):
# one definition, shared with the readers' dedup.
HEADER_SUBTASK = "eosflow-subtask"  # on commit markers
HEADER_EPOCH = "eosflow-epoch"  # on commit markers: "<generation>.<n>"
_MODES = ("transactional", "staged")
_DEFAULT_TIMEOUT_MS = 60_000
_MAX_SLOTS = 8
Headers = list[tuple[str, str | bytes | None]]


def marker_topic(job: str, step: str) -> str:
    """The topic holding the commit markers of sink step ``step`` of ``job``."""
    return f"eosflow.{job}.{step}.txn-markers"


def transactional_id(prefix: str, step: str, subtask: int, slot: int) -> str:
    """The ``transactional.id`` of ``slot`` in the pool of one sink subtask."""
    return f"{prefix}-{step}-{subtask}-{slot}"


def transactional_ids(prefix: str, step: str, subtask: int, slots: int) -> list[str]:
    """The stable ``transactional.id`` pool of one sink subtask."""
    return [transactional_id(prefix, step, subtask, slot) for slot in range(slots)]


class KafkaSink:
    """Writes a stream to a Kafka topic, exactly once for ``read_committed`` readers.

    Args:
        topic: the output topic (must exist; eosflow does not guess its partitioning).
        transactional_id_prefix: required in transactional mode; unique per job and stable
            across its restarts (transactional ids derive from it). Two running jobs with the
            same prefix fence each other.
        mode: ``"transactional"`` (default) or ``"staged"`` (see the module docstring).
        serde: encodes values (default JSON).
        key: function value -> key (bytes, str or JSON-encodable) for the record key; on a
            keyed stream the default is the stream's key.
        settings: brokers and client settings (default: ``KafkaSettings.from_env()`` in the
            worker, i.e. ``EOSFLOW_KAFKA_BROKERS``).
        transaction_timeout_ms: the producers' ``transaction.timeout.ms`` (default 60 s); must be
            above twice the checkpoint interval and at most the broker's
            ``transaction.max.timeout.ms``.
        pool_size: transactional ids per subtask kept ready (2 covers one prepared epoch plus
            the open one; more are used while checkpoints keep failing, up to 8).
        producer_config: extra librdkafka producer settings.
        commit_timeout_s: how long a commit may keep failing with retriable errors before the
            epoch is treated as aborted and re-published (after fencing the old producer).

    Raises:
        ConfigError: unknown mode, missing prefix, non-callable ``key``, bad pool size.
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
    ) -> None:
        if mode not in _MODES:
            raise ConfigError(f"KafkaSink mode {mode!r} is unknown; expected one of {_MODES}")
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

    def __repr__(self) -> str:
        return f"KafkaSink({self.topic!r}, mode={self.mode!r}, prefix={self.prefix!r})"

    def resolved_settings(self) -> KafkaSettings:
        return self.settings if self.settings is not None else KafkaSettings.from_env()

    def preflight(self, *, job: str, checkpoint_interval: float | None) -> None:
        """Check the topic and the transaction timeout; create the marker topic."""
        settings = self.resolved_settings()
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
            )

    def open(self, ctx: SinkContext) -> KafkaSinkWriter | StagedKafkaSinkWriter:
        if self.mode == "staged":
            return StagedKafkaSinkWriter(self, ctx)
        return KafkaSinkWriter(self, ctx)


def check_transaction_timeout(
    timeout_ms: int, checkpoint_interval: float | None, broker_max_ms: int | None
) -> None:
    """Refuse a ``transaction.timeout.ms`` the job cannot live with, saying what to change."""
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


def murmur2_partition(key: bytes, partitions: int) -> int:
    """Kafka's default partition for ``key`` (the Java client's murmur2, positive modulo)."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


def murmur2(key: bytes) -> int:
    """The Java client's ``Utils.murmur2`` as an unsigned 32-bit value."""
    m, r = 0x5BD1E995, 24
    length = len(key)
    h = (0x9747B28C ^ length) & 0xFFFFFFFF
    whole = length - length % 4
    for (k,) in struct.iter_unpack("<I", key[:whole]):
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> r
        k = (k * m) & 0xFFFFFFFF
        h = ((h * m) & 0xFFFFFFFF) ^ k
    rest = length % 4
    if rest == 3:
        h ^= key[whole + 2] << 16
    if rest >= 2:
        h ^= key[whole + 1] << 8
    if rest >= 1:
        h ^= key[whole]
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return h


def _key_bytes(key: Any) -> bytes | None:
    if key is None or isinstance(key, bytes):
        return key
    if isinstance(key, str):
        return key.encode()
    return orjson.dumps(key)


class _Encoder:
    """Turns the values handed to a writer into (key bytes, value bytes)."""

    def __init__(self, sink: KafkaSink) -> None:
        self.serialize = sink.serde.serialize
        self.key_fn = sink.key

    def __call__(self, item: Any) -> tuple[bytes | None, bytes]:
        # Keyed streams hand (key, value) tuples; a key function overrides the stream's key.
        if self.key_fn is not None:
            value = item[1] if _is_keyed_pair(item) else item
            return _key_bytes(self.key_fn(value)), self.serialize(value)
        if _is_keyed_pair(item):
            return _key_bytes(item[0]), self.serialize(item[1])
        return None, self.serialize(item)


def _is_keyed_pair(item: Any) -> bool:
    return type(item) is tuple and len(item) == 2


class KafkaSinkWriter:
    """One subtask's transactional writer; see the module docstring for the protocol.

    Invariants:
        Every record of an epoch is in exactly one transaction, on one transactional id, with
        headers naming (sink, subtask, epoch); the epoch's marker is in the same transaction.
        A slot holds at most one open or prepared transaction; a slot is free again only after
        its transaction committed.
        An epoch is published (committed) once: ``commit``/``recover`` re-publish only when the
        marker says the original did not commit, and a re-publication writes a new marker
        inside its own transaction.
    """

    def __init__(self, sink: KafkaSink, ctx: SinkContext) -> None:
        assert sink.prefix is not None
        self.sink = sink
        self.ctx = ctx
        self.settings = sink.resolved_settings()
        self.encode = _Encoder(sink)
        self.sink_id = f"{ctx.job}/{ctx.step}".encode()
        self.subtask_b = str(ctx.subtask).encode()
        self.markers = marker_topic(ctx.job, ctx.step)
        self.marker_partition = ctx.subtask
        TopicAdmin(self.settings).ensure_topic(self.markers, ctx.parallelism)
        self.producers: dict[int, Producer] = {}
        self.busy: dict[int, str] = {}  # slot -> epoch tag of its open or prepared transaction
        self.slot: int | None = None  # slot of the open (not yet prepared) transaction
        self.tag = ""
        self.n = 0
        self.seq = 0
        self.ranges: dict[tuple[str, int], list[int]] = {}
        self.errors: list[KafkaError] = []
        self.marker_offset: list[int] = []
        self.published = 0
        self.republished = 0

    # -- producers -------------------------------------------------------------------------------

    def _tid(self, slot: int) -> str:
        assert self.sink.prefix is not None
        return transactional_id(self.sink.prefix, self.ctx.step, self.ctx.subtask, slot)

    def _producer(self, slot: int, *, fresh: bool = False) -> Producer:
        """The producer of ``slot``; ``fresh``: a new instance (fences and aborts the old one)."""
        producer = self.producers.get(slot)
        if producer is None or fresh:
            producer = self.producers[slot] = self._new_producer(slot)
        return producer

    def _new_producer(self, slot: int) -> Producer:
        """A producer for ``slot``, initialized: its id's open transaction is aborted."""
        conf = producer_config(
            self.settings,
            transactional_id=self._tid(slot),
            overrides={
                **self.sink.producer_config,
                "transaction.timeout.ms": self.sink.transaction_timeout_ms,
            },
        )
        conf["partitioner"] = "murmur2_random"  # as the Java client: same key, same partition
        producer = create_producer(conf)
        _retrying(producer.init_transactions, f"init_transactions {self._tid(slot)}")
        return producer

    def _free_slot(self) -> int:
        for slot in range(_MAX_SLOTS):
            if slot not in self.busy:
                return slot
        raise EosflowError(
            f"sink {self.ctx.step}[{self.ctx.subtask}]: {_MAX_SLOTS} epochs are prepared and not "
            "committed (checkpoints keep failing?); refusing to open more transactions"
        )

    def _delivered(self, err: KafkaError | None, msg: Any) -> None:
        if err is not None:
            self.errors.append(err)
            return
        tp = (msg.topic(), msg.partition())
        offset = msg.offset()
        if tp == (self.markers, self.marker_partition):
            self.marker_offset.append(offset)
            return
        r = self.ranges.get(tp)
        if r is None:
            self.ranges[tp] = [offset, offset]
        elif offset > r[1]:
            r[1] = offset
        elif offset < r[0]:
            r[0] = offset

    # -- the epoch -------------------------------------------------------------------------------

    def _begin(self) -> Producer:
        slot = self._free_slot()
        producer = self._producer(slot)
        producer.begin_transaction()
        self.slot = slot
        self.tag = f"{self.ctx.generation}.{self.n}"
        self.n += 1
        self.busy[slot] = self.tag
        self.seq = 0
        self.ranges = {}
        self.errors = []
        self.marker_offset = []
        return producer

    def write(self, values: Sequence[Any]) -> None:
        if not values:
            return
        producer = self._producer(self.slot) if self.slot is not None else self._begin()
        topic, encode, delivered = self.sink.topic, self.encode, self._delivered
        sink_header = (HEADER_SINK, self.sink_id)
        id_prefix = f"{self.ctx.subtask}.{self.tag}."
        seq = self.seq
        for item in values:
            key, value = encode(item)
            headers: Headers = [sink_header, (HEADER_ID, f"{id_prefix}{seq}".encode())]
            seq += 1
            produce_waiting(producer, topic, value, key, headers=headers, on_delivery=delivered)
        self.seq = seq
        producer.poll(0)
        if self.errors:
            self._raise_delivery(f"writing epoch {self.tag}")

    def _raise_delivery(self, context: str) -> None:
        err = self.errors[0]
        raise classify(err, context=f"sink {self.ctx.step}[{self.ctx.subtask}] {context}")

    def prepare(self, checkpoint_id: int) -> Any:
        if self.slot is None:
            return None
        slot, producer = self.slot, self._producer(self.slot)
        marker = orjson.dumps(
            {"job": self.ctx.job, "step": self.ctx.step, "subtask": self.ctx.subtask,
             "epoch": self.tag, "checkpoint": checkpoint_id, "count": self.seq}
        )  # fmt: skip
        self._produce_marker(producer, marker, self.tag, self._delivered)
        left = producer.flush(60)
        if left:
            raise KafkaClientError(
                f"sink {self.ctx.step}[{self.ctx.subtask}]: {left} records undelivered after 60 s "
                f"at checkpoint {checkpoint_id}",
                retriable=True,
            )
        if self.errors:
            self._raise_delivery(f"preparing checkpoint {checkpoint_id}")
        committable = {
            "tid": self._tid(slot),
            "slot": slot,
            "epoch": self.tag,
            "count": self.seq,
            "ranges": [[t, p, lo, hi] for (t, p), (lo, hi) in sorted(self.ranges.items())],
            "marker": [self.markers, self.marker_partition, self.marker_offset[0]],
        }
        self.published += self.seq
        self.slot = None
        return committable

    def _produce_marker(
        self, producer: Producer, marker: bytes, tag: str, on_delivery: Callable[..., None]
    ) -> None:
        """The epoch's commit marker, inside the open transaction; its headers name (sink,
        subtask, epoch), which is what :meth:`_marker_in` looks for."""
        headers: Headers = [
            (HEADER_SINK, self.sink_id),
            (HEADER_SUBTASK, self.subtask_b),
            (HEADER_EPOCH, tag.encode()),
        ]
        produce_waiting(
            producer, self.markers, marker, self.subtask_b, partition=self.marker_partition,
            headers=headers, on_delivery=on_delivery,
        )  # fmt: skip

    def commit(self, checkpoint_id: int, committable: Any) -> None:
        slot, tag = int(committable["slot"]), str(committable["epoch"])
        if self.busy.get(slot) == tag and slot != self.slot:
            producer = self._producer(slot)
            try:
                _retrying(
                    producer.commit_transaction,
                    f"commit {self._tid(slot)}",
                    self.sink.commit_timeout_s,
                )
            except KafkaClientError as exc:
                # The broker aborted the transaction (timeout) or fenced this producer: rescue.
                log.warning(
                    "sink=%s subtask=%d epoch=%s checkpoint=%d commit failed (%s); re-publishing",
                    self.ctx.step, self.ctx.subtask, tag, checkpoint_id, exc,
                )  # fmt: skip
                self._rescue(committable, fresh=True)
            del self.busy[slot]
            self.ctx.fault("mid-sink-commit")  # committed; the engine has not recorded it yet
            return
        self._rescue(committable, fresh=False)

    def recover(self, pending: Sequence[tuple[int, Any]]) -> None:
        """Abort whatever the pool's ids left open, then publish every pending epoch once.

        Every id of the pool (all :data:`_MAX_SLOTS`) is initialized, in parallel: a crash
        during a streak of failed checkpoints can leave a transaction open on a high slot, and
        an open transaction holds back every ``read_committed`` reader of its partitions.
        """
        keep = {*range(self.sink.pool_size), *(int(c["slot"]) for _chk, c in pending)}
        self.producers.clear()
        with ThreadPoolExecutor(_MAX_SLOTS, thread_name_prefix="txn-init") as pool:
            fresh = dict(
                zip(range(_MAX_SLOTS), pool.map(self._new_producer, range(_MAX_SLOTS)), strict=True)
            )
        for slot, producer in fresh.items():
            if slot in keep:
                self.producers[slot] = producer
        for i, (chk, committable) in enumerate(pending):
            self._rescue(committable, fresh=False)
            log.info(
                "sink=%s subtask=%d recovered checkpoint=%d epoch=%s",
                self.ctx.step, self.ctx.subtask, chk, committable["epoch"],
            )  # fmt: skip
            if i == 0:
                self.ctx.fault("mid-sink-recover")
        self.busy.clear()

    def _rescue(self, committable: Any, *, fresh: bool) -> None:
        """Publish the epoch of ``committable`` unless its marker says it committed."""
        slot, tag = int(committable["slot"]), str(committable["epoch"])
        producer = self._producer(slot, fresh=fresh)
        if self._committed(committable):
            return
        records = self._read_epoch(committable)
        expected = int(committable["count"])
        if len(records) != expected:
            raise EosflowError(
                f"sink {self.ctx.step}[{self.ctx.subtask}]: epoch {tag} held {expected} records "
                f"but only {len(records)} are still in {committable['ranges']} (deleted by "
                "retention?); its output cannot be re-published"
            )
        self.errors = []
        _retrying(lambda _t: producer.begin_transaction(), f"begin {self._tid(slot)}")
        for topic, partition, key, value, headers, ts in records:
            produce_waiting(
                producer, topic, value, key, partition=partition, headers=headers, timestamp=ts,
                on_delivery=self._delivered_rescue,
            )  # fmt: skip
        marker = orjson.dumps({"epoch": tag, "republished": True, "count": expected})
        self._produce_marker(producer, marker, tag, self._delivered_rescue)
        producer.flush(60)
        if self.errors:
            self._raise_delivery(f"re-publishing epoch {tag}")
        _retrying(
            producer.commit_transaction, f"commit {self._tid(slot)}", self.sink.commit_timeout_s
        )
        self.republished += expected
        log.warning(
            "sink=%s subtask=%d re-published epoch=%s records=%d (its transaction had aborted)",
            self.ctx.step, self.ctx.subtask, tag, expected,
        )  # fmt: skip

    def _delivered_rescue(self, err: KafkaError | None, _msg: Any) -> None:
        if err is not None:
            self.errors.append(err)

    def _committed(self, committable: Any) -> bool:
        """Whether a committed marker of the epoch exists at or after the recorded marker."""
        topic, partition, offset = committable["marker"]
        try:
            found = self._marker_in(committable, read_committed=True)
        except _StalledRead:
            # Every id of this subtask's pool was fenced, so nothing of ours is open: a last
            # stable offset stuck below the marker is a broker fault. Seen on Tansu after
            # crashes, whose read_committed shows aborted records anyway, so reading
            # uncommitted answers what its readers see.
            log.warning(
                "sink=%s subtask=%d: the last stable offset of %s[%s] does not advance past "
                "%s although this subtask's transactional ids are fenced; deciding on "
                "read_uncommitted (right for brokers whose read_committed shows aborted "
                "records, such as Tansu; on Apache Kafka this means another producer holds an "
                "open transaction in the marker topic)",
                self.ctx.step, self.ctx.subtask, topic, partition, offset,
            )  # fmt: skip
            found = self._marker_in(committable, read_committed=False)
        return found

    def _marker_in(self, committable: Any, *, read_committed: bool) -> bool:
        topic, partition, offset = committable["marker"]
        tag = str(committable["epoch"]).encode()
        for msg in _read_range(
            self.settings, topic, int(partition), int(offset), None, read_committed=read_committed
        ):  # markers carry (sink, subtask, epoch) headers
            headers = dict(msg.headers() or [])
            if (
                headers.get(HEADER_EPOCH) == tag
                and headers.get(HEADER_SUBTASK) == self.subtask_b
                and headers.get(HEADER_SINK) == self.sink_id
            ):
                return True
        return False

    def _read_epoch(self, committable: Any) -> list[tuple[str, int, Any, Any, Any, int]]:
        prefix = f"{self.ctx.subtask}.{committable['epoch']}.".encode()
        out = []
        for topic, partition, lo, hi in committable["ranges"]:
            for msg in _read_range(
                self.settings, topic, int(partition), int(lo), int(hi) + 1, read_committed=False
            ):
                headers = msg.headers() or []
                h = dict(headers)
                record_id = h.get(HEADER_ID)
                if (
                    record_id is not None
                    and record_id.startswith(prefix)
                    and h.get(HEADER_SINK) == self.sink_id
                ):
                    _ts_type, ts = msg.timestamp()
                    out.append((topic, int(partition), msg.key(), msg.value(), headers, ts))
        return out

    def close(self) -> None:
        for slot, producer in self.producers.items():
            if slot == self.slot:
                try:
                    producer.abort_transaction(10)  # never prepared: nobody will commit it
                except KafkaException as exc:
                    log.warning("abort on close failed: %s", exc)
            producer.flush(10)
        self.producers.clear()


def _retrying(call: Callable[[float], Any], context: str, deadline_s: float = 30.0) -> Any:
    """Run ``call(timeout)``, retrying what librdkafka calls retriable until ``deadline_s``;
    classify the rest (connectors.errors is the one place that knows the classes)."""
    deadline = time.monotonic() + deadline_s
    delay = 0.1
    while True:
        left = deadline - time.monotonic()
        try:
            return call(max(0.1, min(10.0, left)))
        except KafkaException as exc:
            if error_class(exc) is ErrorClass.RETRIABLE and time.monotonic() + delay < deadline:
                time.sleep(delay)
                delay = min(2.0, delay * 2)
                continue
            raise classify(exc, context=context) from exc


class _StalledRead(KafkaClientError):
    """A read to the end delivered nothing, not even the end of the partition, for a while."""


def _read_range(
    settings: KafkaSettings,
    topic: str,
    partition: int,
    start: int,
    end: int | None,
    *,
    read_committed: bool,
    timeout: float = 30.0,
    stall_s: float = 5.0,
) -> list[Any]:
    """Records of ``topic[partition]`` from ``start`` to ``end`` (exclusive; ``None``: to the
    end a reader of that isolation level can reach)."""
    conf = consumer_config(
        settings,
        group_id=f"eosflow-sink-recovery-{os.getpid()}",
        overrides={"isolation.level": "read_committed" if read_committed else "read_uncommitted"},
        allow_read_uncommitted=not read_committed,
    )
    consumer = create_consumer(conf)
    out: list[Any] = []
    try:
        consumer.assign([TopicPartition(topic, partition, start)])
        deadline = time.monotonic() + timeout
        last_progress = time.monotonic()
        while time.monotonic() < deadline:
            msgs = consumer.consume(1000, 0.2)
            if msgs:
                last_progress = time.monotonic()
            elif end is None and time.monotonic() - last_progress > stall_s:
                raise _StalledRead(
                    f"reading {topic}[{partition}] from {start}: no record and no end of "
                    f"partition for {stall_s}s",
                    retriable=True,
                )
            for msg in msgs:
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        if end is None or (msg.offset() or 0) >= end:
                            return out
                        continue
                    raise classify(err, context=f"reading {topic}[{partition}] from {start}")
                offset: int = msg.offset() or 0
                if end is not None and offset >= end:
                    return out
                out.append(msg)
                if end is not None and offset == end - 1:
                    return out
        raise KafkaClientError(
            f"reading {topic}[{partition}] from {start} to {end}: not done within {timeout}s",
            retriable=True,
        )
    finally:
        consumer.close()


def read_transaction_markers(
    settings: KafkaSettings, job: str, step: str, *, read_committed: bool = True
) -> list[dict[str, Any]]:
    """Every commit marker of a sink step (``eosflow txn list``)."""
    topic = marker_topic(job, step)
    admin = TopicAdmin(settings)
    if not admin.exists(topic):
        return []
    out = []
    for partition in range(len(admin.partitions(topic))):
        for msg in _read_range(settings, topic, partition, 0, None, read_committed=read_committed):
            entry = orjson.loads(msg.value())
            entry["offset"], entry["partition"] = msg.offset(), partition
            out.append(entry)
    return out


def abort_lingering(settings: KafkaSettings, prefix: str, step: str, subtasks: int) -> list[str]:
    """Fence every transactional id of a sink step's pool (``eosflow txn abort``).

    ``init_transactions`` on an id aborts its open transaction. Never run this while the job
    runs: it fences the live producers (the job restarts and recovers).
    """
    done = []
    for subtask in range(subtasks):
        for tid in transactional_ids(prefix, step, subtask, _MAX_SLOTS):
            producer = create_producer(producer_config(settings, transactional_id=tid))
            _retrying(producer.init_transactions, f"init_transactions {tid}")
            producer.flush(5)
            done.append(tid)
    return done


class StagedKafkaSinkWriter:
    """Staged mode: records staged at ``prepare``, published with the idempotent producer on
    ``commit``; readers drop re-published repeats by :data:`HEADER_ID`.

    Invariants:
        The staged file of an epoch holds (partition, key, value, id) in write order and is
        durable before ``prepare`` returns; publishing it again yields the same records in the
        same partitions in the same order.
        ``commit`` deletes the staged file only after every record was acknowledged, so a crash
        before that publishes the epoch again (duplicates carry the same ID).
    """

    def __init__(self, sink: KafkaSink, ctx: SinkContext) -> None:
        self.sink = sink
        self.ctx = ctx
        self.settings = sink.resolved_settings()
        self.encode = _Encoder(sink)
        self.partitions = len(TopicAdmin(self.settings).partitions(sink.topic))
        base = ctx.snapshot_url or f"file://{os.path.abspath('.eosflow-staging')}"
        self.dir = f"{base.rstrip('/')}/{ctx.job}/staging/{ctx.step}/{ctx.subtask:05d}"
        self.fs, self.path = fsspec.core.url_to_fs(self.dir)
        self.fs.makedirs(self.path, exist_ok=True)
        self.buffer: list[tuple[int, bytes | None, bytes]] = []
        self.n = 0
        self.rr = ctx.subtask
        self.producer: Producer | None = None
        self.errors: list[KafkaError] = []
        self.published = 0

    def write(self, values: Sequence[Any]) -> None:
        encode, n, buf = self.encode, self.partitions, self.buffer
        for item in values:
            key, value = encode(item)
            if key is None:
                self.rr += 1
                partition = self.rr % n
            else:
                partition = murmur2_partition(key, n)
            buf.append((partition, key, value))

    def prepare(self, checkpoint_id: int) -> Any:
        if not self.buffer:
            return None
        tag = f"{self.ctx.generation}.{self.n}"
        self.n += 1
        name = f"{self.path}/{tag}.staged"
        frames = bytearray()
        pack = struct.pack
        for partition, key, value in self.buffer:
            klen = 0xFFFFFFFF if key is None else len(key)
            frames += pack("<III", partition, klen, len(value))
            if key is not None:
                frames += key
            frames += value
        with self.fs.open(name + ".tmp", "wb") as f:
            f.write(bytes(frames))
            _fsync(f)
        self.fs.mv(name + ".tmp", name)
        if isinstance(self.fs, LocalFileSystem):
            # The rename must survive a power cut: commit reads a missing file as published.
            _fsync_dir(self.path)
        count = len(self.buffer)
        self.buffer = []
        return {"file": name, "epoch": tag, "count": count}

    def _load(self, name: str) -> list[tuple[int, bytes | None, bytes]]:
        data = self.fs.cat_file(name)
        out = []
        pos, unpack = 0, struct.unpack_from
        while pos < len(data):
            partition, klen, vlen = unpack("<III", data, pos)
            pos += 12
            key = None
            if klen != 0xFFFFFFFF:
                key = bytes(data[pos : pos + klen])
                pos += klen
            out.append((partition, key, bytes(data[pos : pos + vlen])))
            pos += vlen
        return out

    def _delivered(self, err: KafkaError | None, _msg: Any) -> None:
        if err is not None:
            self.errors.append(err)

    def commit(self, checkpoint_id: int, committable: Any) -> None:
        name, tag = committable["file"], str(committable["epoch"])
        if not self.fs.exists(name):
            return  # published and cleaned up before
        if self.producer is None:
            self.producer = create_producer(
                producer_config(self.settings, overrides=self.sink.producer_config)
            )
        producer, topic = self.producer, self.sink.topic
        sink_header = (HEADER_SINK, f"{self.ctx.job}/{self.ctx.step}".encode())
        id_prefix = f"{self.ctx.subtask}.{tag}."
        self.errors = []
        for seq, (partition, key, value) in enumerate(self._load(name)):
            headers: Headers = [sink_header, (HEADER_ID, f"{id_prefix}{seq}".encode())]
            produce_waiting(
                producer, topic, value, key, partition=partition, headers=headers,
                on_delivery=self._delivered,
            )  # fmt: skip
        left = producer.flush(60)
        if left or self.errors:
            detail = self.errors[0].str() if self.errors else f"{left} undelivered"
            raise KafkaClientError(
                f"staged sink {self.ctx.step}[{self.ctx.subtask}]: publishing epoch {tag} "
                f"failed: {detail}",
                retriable=True,
            )
        self.published += int(committable["count"])
        self.ctx.fault("mid-sink-commit")  # published, not yet cleaned up: recovery repeats it
        self.fs.rm(name)

    def recover(self, pending: Sequence[tuple[int, Any]]) -> None:
        keep = set()
        for i, (chk, committable) in enumerate(pending):
            self.commit(chk, committable)
            keep.add(committable["file"])
            if i == 0:
                self.ctx.fault("mid-sink-recover")
        for name in self.fs.ls(self.path, detail=False):
            if name not in keep and name.endswith((".staged", ".tmp")):
                self.fs.rm(name)  # staged by an epoch that never completed

    def close(self) -> None:
        if self.producer is not None:
            self.producer.flush(10)


def _fsync(f: Any) -> None:
    try:
        f.flush()
        os.fsync(f.fileno())
    except (AttributeError, OSError, ValueError):
        pass  # not a local file: the file system's own durability applies
