"""The Kafka sinks' batch encoder gives exactly what encoding value by value gives."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from connectors.serde import JsonSerde, StringSerde
from processor.errors import SerializationError
from sinks.kafka.records import _Encoder

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=5,
)
keys = (
    st.none()
    | st.text(max_size=5)
    | st.binary(max_size=5)
    | st.integers()
    | st.lists(st.integers())
)
items = (
    st.tuples(keys, json_values)  # keyed pairs, the common case
    | json_values  # unkeyed values, 2-element lists among them
    | st.tuples(json_values, json_values, json_values)  # a tuple that is not a pair
)


def _encoder(serde: Any, key: Any = None) -> _Encoder:
    return _Encoder(SimpleNamespace(serde=serde, key=key))  # type: ignore[arg-type]


def _one_by_one(enc: _Encoder, values: list[Any]) -> Any:
    try:
        return [enc(v) for v in values]
    except Exception as exc:
        return type(exc)


def _batch(enc: _Encoder, values: list[Any]) -> Any:
    try:
        return enc.all(values)
    except Exception as exc:
        return type(exc)


@given(st.lists(items, max_size=8))
def test_batch_encoding_equals_encoding_one_by_one(values: list[Any]) -> None:
    for enc in (_encoder(JsonSerde()), _encoder(JsonSerde(), key=lambda v: str(v)[:3])):
        assert _batch(enc, values) == _one_by_one(enc, values)


def test_batch_of_pairs_takes_the_fast_path_and_keeps_bytes_keys() -> None:
    enc = _encoder(JsonSerde())
    assert enc.all([("u1", [1, 2]), (b"raw", {"a": 1}), (7, None)]) == [
        (b"u1", b"[1,2]"),
        (b"raw", b'{"a":1}'),
        (b"7", b"null"),
    ]


def test_a_value_the_serde_refuses_raises_its_own_error() -> None:
    with pytest.raises(SerializationError, match="expected str"):
        _encoder(StringSerde()).all([("k", "fine"), ("k", 12)])
