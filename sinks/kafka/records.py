"""What a Kafka sink writes: header names, the marker topic, transactional ids, partitions
and the encoding of values into (key, value) bytes; and what its writers read of the sink's
configuration (:class:`KafkaSinkConfig`).

Header values are ASCII bytes. The epoch tag is ``<generation>.<n>`` (the writer's ``n``-th
transaction in that generation): it is known when the first record is written, unlike the
checkpoint id that will end the epoch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import hashlib
import logging
import os
import random
import struct
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import orjson

from connectors.config import KafkaSettings
from dedup.staged import HEADER_ID, HEADER_SINK
from processor.contracts import Serde

__all__ = [
    "DIGEST_BYTES",
    "HEADER_EPOCH",
    "HEADER_ID",
    "HEADER_SINK",
    "HEADER_SUBTASK",
    "HEADER_TXN",
    "KafkaSinkConfig",
    "KeyPartitioner",
    "marker_topic",
    "murmur2",
    "murmur2_partition",
    "record_digest",
    "transactional_id",
    "transactional_ids",
]

# HEADER_SINK "<job>/<step>", HEADER_ID "<subtask>.<generation>.<n>.<seq>" (unique per sink):
# one definition, shared with the readers' dedup.
HEADER_SUBTASK = "eosflow-subtask"  # on commit markers
HEADER_EPOCH = "eosflow-epoch"  # on commit markers: "<generation>.<n>"
# Written on every record of a record_ids=False sink by earlier versions (whose committables
# have no "runs"): "<job>/<step>|<subtask>.<generation>.<n>". Read only by the rescue of such
# an epoch; record_ids=False records carry no header now.
HEADER_TXN = "eosflow-txn"
_MAX_SLOTS = 8
Headers = list[tuple[str, str | bytes | None]]


class KafkaSinkConfig(Protocol):
    """What the writers read of their :class:`~sinks.kafka.sink.KafkaSink` (which implements
    it; the attributes are documented there). The sink's module opens the writers, so they know
    it by this protocol rather than by importing that module."""

    topic: str
    prefix: str | None
    serde: Serde
    key: Callable[[Any], Any] | None
    transaction_timeout_ms: int
    pool_size: int
    producer_config: dict[str, Any]
    commit_timeout_s: float
    record_ids: bool

    def resolved_settings(self) -> KafkaSettings: ...


def marker_topic(job: str, step: str) -> str:
    """The topic holding the commit markers of sink step ``step`` of ``job``."""
    return f"eosflow.{job}.{step}.txn-markers"


def transactional_id(prefix: str, step: str, subtask: int, slot: int) -> str:
    """The ``transactional.id`` of ``slot`` in the pool of one sink subtask."""
    return f"{prefix}-{step}-{subtask}-{slot}"


def transactional_ids(prefix: str, step: str, subtask: int, slots: int) -> list[str]:
    """The stable ``transactional.id`` pool of one sink subtask."""
    return [transactional_id(prefix, step, subtask, slot) for slot in range(slots)]


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


log = logging.getLogger(__name__)

#: Keys whose partition :class:`KeyPartitioner` remembers (about 100 bytes each) before it
#: forgets them all and starts again.
_CACHED_KEYS = 200_000


@functools.cache
def _librdkafka_murmur2() -> Callable[[bytes, int, int], int] | None:
    """librdkafka's own ``rd_kafka_msg_partitioner_murmur2`` (public API; its topic and opaque
    arguments are unused) through ctypes: about 0.5 us a key against 2.3 us for
    :func:`murmur2_partition` in Python. ``None`` when the library of confluent-kafka cannot be
    found or disagrees with :func:`murmur2_partition` on a few keys."""
    try:
        import confluent_kafka

        here = os.path.dirname(os.path.abspath(confluent_kafka.__file__))
        libs = os.path.join(here, os.pardir, "confluent_kafka.libs", "librdkafka*")
        found = sorted(glob.glob(libs))
        path = found[0] if found else ctypes.util.find_library("rdkafka")
        if path is None:
            return None
        fn = ctypes.CDLL(path).rd_kafka_msg_partitioner_murmur2
        fn.restype = ctypes.c_int32
        fn.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int32,
                       ctypes.c_void_p, ctypes.c_void_p]  # fmt: skip
    except (ImportError, OSError, AttributeError) as exc:
        log.debug("librdkafka's murmur2 is not reachable through ctypes (%s)", exc)
        return None

    def partition(key: bytes, length: int, partitions: int) -> int:
        return int(fn(None, key, length, partitions, None, None))

    probes = [b"", b"a", b"user-17", b"\x00\xff" * 9]
    if any(partition(k, len(k), 7) != murmur2_partition(k, 7) for k in probes):
        log.warning("librdkafka's murmur2 disagrees with the Java client's: using Python's")
        return None
    return partition


class KeyPartitioner:
    """The partition the Kafka sink's producers' partitioner (librdkafka's ``murmur2_random``,
    the Java client's default) gives each key: murmur2 of the key modulo the partition count;
    records without a key go to one random partition per call (librdkafka picks one per
    record: any choice is as good). Remembers up to :data:`_CACHED_KEYS` keys' partitions (a
    dict lookup, 40 ns, against 0.5 us for murmur2 through librdkafka)."""

    __slots__ = ("_cache", "_murmur2", "count")

    def __init__(self, count: int) -> None:
        self.count = count
        self._cache: dict[bytes | None, int] = {}
        self._murmur2 = _librdkafka_murmur2()

    def of(self, keys: list[bytes | None]) -> list[int]:
        cache = self._cache
        parts: list[Any] = list(map(cache.get, keys))
        if None not in parts:
            return parts
        count, murmur2_c, unkeyed = self.count, self._murmur2, None
        for i, part in enumerate(parts):
            if part is not None:
                continue
            key = keys[i]
            if key is None:
                if unkeyed is None:
                    unkeyed = random.randrange(count)
                parts[i] = unkeyed
                continue
            if len(cache) >= _CACHED_KEYS:
                cache.clear()
            parts[i] = cache[key] = (
                murmur2_c(key, len(key), count) if murmur2_c else murmur2_partition(key, count)
            )
        return parts


#: Bytes of a record's digest in a run that other producers' records interleave.
DIGEST_BYTES = 8


def record_digest(key: bytes | None, value: bytes | None) -> bytes:
    """What tells a record of a run apart from other producers' records between its edges:
    BLAKE2b of the key's length and bytes (-1: no key) and the value."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    h.update(b"%d:" % (-1 if key is None else len(key)))
    if key is not None:
        h.update(key)
    if value is not None:
        h.update(value)
    return h.digest()


def _key_bytes(key: Any) -> bytes | None:
    if key is None or isinstance(key, bytes):
        return key
    if isinstance(key, str):
        return key.encode()
    return orjson.dumps(key)


class _Encoder:
    """Turns the values handed to a writer into (key bytes, value bytes)."""

    def __init__(self, sink: KafkaSinkConfig) -> None:
        self.serialize = sink.serde.serialize
        self.serialize_many = getattr(sink.serde, "serialize_many", None)
        self.key_fn = sink.key

    def columns(self, keys: list[Any], values: list[Any]) -> tuple[list[Any], list[bytes]]:
        """Key bytes and value bytes of a keyed stream's batch (no key function): the same as
        ``all(list(zip(keys, values)))`` in two lists, with the serde's batch form when it
        has one (on an error, per value: the serde's own error for the bad one)."""
        assert self.key_fn is None
        serialize_many = self.serialize_many
        encoded: list[bytes] | None = None
        if serialize_many is not None:
            try:
                encoded = serialize_many(values)
            except Exception:
                encoded = None
        if encoded is None:
            serialize = self.serialize
            encoded = [serialize(value) for value in values]
        try:
            return list(map(str.encode, keys)), encoded  # the common case: str keys
        except TypeError:
            return [_key_bytes(k) for k in keys], encoded

    def all(self, values: Sequence[Any]) -> list[tuple[bytes | None, bytes]]:
        """``[self(v) for v in values]``, faster for the common batch: every value a
        ``(key, value)`` pair of a keyed stream with a ``str`` key, no key function. The
        result is the same (the fast path falls back to the general one on anything else)."""
        serialize = self.serialize
        if self.key_fn is None:
            try:
                out = [
                    (
                        item[0].encode() if type(item[0]) is str else _key_bytes(item[0]),
                        serialize(item[1]),
                    )
                    for item in values
                    if type(item) is tuple and len(item) == 2
                ]
                if len(out) == len(values):  # no value was left out for not being a pair
                    return out
            except Exception:
                pass  # a serde error, or not all pairs: per value, for the exact behaviour
        return [self(v) for v in values]

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
