"""What a Kafka sink writes: header names, the marker topic, transactional ids, partitions
and the encoding of values into (key, value) bytes; and what its writers read of the sink's
configuration (:class:`KafkaSinkConfig`).

Header values are ASCII bytes. The epoch tag is ``<generation>.<n>`` (the writer's ``n``-th
transaction in that generation): it is known when the first record is written, unlike the
checkpoint id that will end the epoch.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import orjson

from connectors.config import KafkaSettings
from dedup.staged import HEADER_ID, HEADER_SINK
from processor.contracts import Serde

__all__ = [
    "HEADER_EPOCH",
    "HEADER_ID",
    "HEADER_SINK",
    "HEADER_SUBTASK",
    "HEADER_TXN",
    "KafkaSinkConfig",
    "marker_topic",
    "murmur2",
    "murmur2_partition",
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
