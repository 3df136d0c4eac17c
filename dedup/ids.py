"""Deterministic 127-bit record IDs.

Every ID is a BLAKE2b-128 digest read as a little-endian ``int`` with its top bit cleared
(``0 <= id < 2**127``: rbloom takes a hash as a signed 128-bit int), so IDs are uniform: the
Bloom filters use them as their own hash (:mod:`dedup.buckets`), and two distinct records collide
with probability ``n**2 / 2**128`` (about 3e-21 for a billion IDs in one horizon; a 64-bit ID
would be 3e-2).

The functions are the ID rules of docs/dedup.md, "Record IDs":

* :func:`source_id`: a record of a replayable input, from ``(topic, partition, offset)``;
* :func:`value_id`: a user's business ID (``id=`` function of ``.dedup``), any JSON-like value;
* :func:`derived_id`: the ``index``-th output of a step for the record ``parent``;
* :func:`emission_id`: an aggregation's ``n``-th emission for a key and window.

None of them depends on when or in which order records arrive, only on what identifies them, so a
replay produces the same IDs (the whole point: a replayed duplicate is recognised).

Each kind of input is domain-separated (a distinct one-byte tag and BLAKE2b ``person``), so a
``str`` and the ``bytes`` of its UTF-8 never share an ID, nor does a value with a derived ID.
Hashing one ID costs about 0.7 us in CPython (measured, ``bench/dedup_ids.py``).
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

import dedup.native as accel  # its ``native``: read at each use, so one switch turns it off

__all__ = [
    "ID_BYTES",
    "derived_id",
    "emission_id",
    "id_from_bytes",
    "id_to_bytes",
    "pair_id",
    "record_pair_ids",
    "source_id",
    "value_id",
]

#: Length of an ID in bytes (in Redis fields and Kafka headers).
ID_BYTES = 16
_PERSON = b"eosflow-id-v1"
_blake2b = hashlib.blake2b
_from_bytes = int.from_bytes
_dumps = orjson.dumps
_SORTED = orjson.OPT_SORT_KEYS


_MASK = 2**127 - 1


# Copying a keyed hash state costs about half of building one with its parameters.
_STATE = _blake2b(digest_size=ID_BYTES, person=_PERSON)
_copy = _STATE.copy


def _digest(data: bytes) -> int:
    state = _copy()
    state.update(data)
    return _from_bytes(state.digest(), "little") & _MASK


def value_id(value: Any) -> int:
    """ID of a business identifier: ``str``, ``bytes``, ``int`` or any JSON-like value.

    Equal values give equal IDs in every process (dict keys are sorted; a tuple and the list of
    the same items are equal, as they are after a JSON round trip through a channel).

    Raises:
        TypeError: the value is not JSON-like (orjson cannot encode it).
    """
    kind = type(value)
    if kind is str:
        return _digest(b"s" + value.encode("utf-8", "surrogatepass"))
    if kind is bytes:
        return _digest(b"b" + value)
    if kind is int:
        return _digest(b"i" + str(value).encode())
    return _digest(b"j" + _dumps(value, option=_SORTED))


def pair_id(key: Any, value: Any) -> int:
    """``value_id([key, value])``, without its type dispatch: the ID of a per-key ``dedup``
    step (:mod:`processor.runtime.operators.dedup_step`), computed for every record.

    Raises:
        TypeError: ``key`` or ``value`` is not JSON-like.
    """
    return _digest(b"j" + _dumps([key, value], option=_SORTED))


def record_pair_ids(records: list[tuple[Any, Any, Any]], fn: Any) -> list[int]:
    """``[pair_id(key, fn(value)) for key, value, _ts in records]``: the IDs of a batch of a
    per-key ``dedup`` step. With the C accelerator (:mod:`dedup.native`), one call that computes
    the IDs of ``str`` and ``int`` pairs itself (bit for bit as :func:`pair_id`) and hands any
    other pair to :func:`pair_id`.

    Raises:
        TypeError: a key or an ``fn`` result is not JSON-like (or ``fn``'s exception).
    """
    native = accel.native
    if native is not None:
        ids = native.record_pair_ids(records, fn, pair_id)
        if ids is not None:  # None: a record that is not a tuple of 3
            return ids  # type: ignore[no-any-return]
    return [pair_id(k, fn(v)) for k, v, _t in records]


def source_id(topic: str, partition: int, offset: int) -> int:
    """ID of the record at ``offset`` of ``topic``/``partition`` (a replayable input)."""
    return _digest(b"o" + f"{partition}:{offset}:".encode() + topic.encode())


def derived_id(parent: int, index: int) -> int:
    """ID of output number ``index`` that a step made from the record with ID ``parent``."""
    return _digest(b"d" + parent.to_bytes(ID_BYTES, "little") + index.to_bytes(8, "little"))


def emission_id(step: str, key: Any, window_end_ms: int | None, n: int) -> int:
    """ID of the ``n``-th result an aggregation ``step`` emitted for ``key`` and the window
    ending at ``window_end_ms`` (``None``: unwindowed)."""
    return _digest(b"e" + _dumps([step, key, window_end_ms, n], option=_SORTED))


def id_to_bytes(record_id: int) -> bytes:
    """The 16-byte little-endian form (Redis fields, Kafka headers)."""
    return record_id.to_bytes(ID_BYTES, "little")


def id_from_bytes(data: bytes) -> int:
    """Inverse of :func:`id_to_bytes`.

    Raises:
        ValueError: ``data`` is not 16 bytes.
    """
    if len(data) != ID_BYTES or data[-1] & 0x80:
        raise ValueError(
            f"not an eosflow record ID (16 bytes, top bit clear): {len(data)} bytes {data[:32]!r}"
        )
    return _from_bytes(data, "little")
