"""Unit tests for processor.snapshot.codec: exact round trips, malformed input, refused types."""

from __future__ import annotations

import math
import struct
from collections import OrderedDict, namedtuple
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from processor.errors import SerializationError, SnapshotError
from processor.snapshot.codec import MAX_DEPTH, dumps, loads


def same(a: Any, b: Any) -> bool:
    """Equal, of the same type at every level, floats compared bit for bit (NaN, -0.0)."""
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return struct.pack("<d", a) == struct.pack("<d", b)
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if type(a) is dict:
        # Keys keep their insertion order; compare pairwise, keys included.
        return len(a) == len(b) and all(
            same(ka, kb) and same(va, vb)
            for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True)
        )
    if type(a) in (set, frozenset):
        rest = list(b)  # every element of a matches a distinct element of b
        for x in a:
            match = next((i for i, y in enumerate(rest) if same(x, y)), None)
            if match is None:
                return False
            rest.pop(match)
        return not rest
    return bool(a == b)


scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**200), max_value=2**200)
    | st.floats(allow_nan=False)
    | st.text()
    | st.text(alphabet=st.characters(codec=None, categories=["Cs", "Lu", "Nd"]))  # surrogates
    | st.binary()
)
# Hashable: what can be a dict key or set element. NaN is left out: NaN keys are legal but two of
# them never compare equal, which would make the equality check meaningless (tested apart).
hashables = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.tuples(inner, inner) | st.frozensets(inner, max_size=4),
    max_leaves=8,
)
values = st.recursive(
    scalars | hashables,
    lambda inner: (
        st.lists(inner, max_size=6)
        | st.lists(inner, max_size=6).map(tuple)
        | st.dictionaries(hashables, inner, max_size=6)
        | st.sets(hashables, max_size=6)
        | st.frozensets(hashables, max_size=6)
    ),
    max_leaves=40,
)
# For tests that decode every prefix (quadratic in the size): smaller trees, same shapes.
small_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(hashables, inner, max_size=3)
        | st.sets(hashables, max_size=3)
        | st.frozensets(hashables, max_size=3)
    ),
    max_leaves=10,
)


@settings(max_examples=250, deadline=None)
@given(values)
def test_round_trip_is_exact_when_value_is_any_supported_tree(value: Any) -> None:
    assert same(loads(dumps(value)), value)


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_float_round_trip_is_bit_exact_when_float_is_nan_inf_or_signed_zero(x: float) -> None:
    assert struct.pack("<d", loads(dumps(x))) == struct.pack("<d", x)


def test_nan_survives_when_nested_in_keys_and_sets() -> None:
    state = {float("nan"): [float("nan")], "s": {float("nan")}, "z": -0.0, "i": -math.inf}
    back = loads(dumps(state))
    key, value = next(iter(back.items()))
    assert math.isnan(key) and math.isnan(value[0])
    assert math.isnan(next(iter(back["s"])))
    assert math.copysign(1.0, back["z"]) == -1.0 and back["i"] == -math.inf


def test_types_are_preserved_when_values_compare_equal() -> None:
    state = {True: [1, True, 1.0, 0, False], 2: (0.0, 0), (1, 2): {0, 1.5}, b"k": frozenset()}
    back = loads(dumps(state))
    assert same(back, state)
    assert [type(k) for k in back] == [bool, int, tuple, bytes]
    assert [type(v) for v in back[True]] == [int, bool, float, int, bool]


@pytest.mark.parametrize("n", [0, 1, -1, 2**63 - 1, -(2**63), 2**63, -(2**63) - 1, 10**100])
def test_int_round_trip_is_exact_when_int_is_at_a_width_boundary(n: int) -> None:
    assert loads(dumps(n)) == n


def test_deep_nesting_round_trips_when_deeper_than_the_recursion_limit() -> None:
    value: list[Any] = []
    for _ in range(3000):
        value = [value]
    back = loads(dumps(value))
    for _ in range(3000):
        assert type(back) is list and len(back) == 1
        back = back[0]
    assert back == []


class Point:
    pass


@pytest.mark.parametrize(
    ("state", "path", "type_name"),
    [
        ({"count": [0, 1, 2, Point()]}, "state['count'][3]", "Point"),
        ({"ts": {"a": 1.5j}}, "state['ts']['a']", "complex"),
        ({"k": OrderedDict()}, "state['k']", "collections.OrderedDict"),
        ([namedtuple("P", "x")(1)], "state[0]", "P"),
        ({"e": {Point()}}, "state['e'] element", "Point"),
        ({"k": {(1, Point()): 1}}, "state['k'] key", "Point"),
        (bytearray(b"x"), "state", "bytearray"),
    ],
)
def test_dumps_names_type_and_path_when_value_is_unsupported(
    state: Any, path: str, type_name: str
) -> None:
    with pytest.raises(SerializationError, match=r"cannot snapshot ") as info:
        dumps(state)
    message = str(info.value)
    assert message.startswith(f"cannot snapshot {path}")
    assert type_name in message


def test_dumps_refuses_when_value_contains_a_cycle() -> None:
    cycle: list[Any] = []
    cycle.append(cycle)
    with pytest.raises(SerializationError, match="reference cycle"):
        dumps({"x": cycle})


def test_dumps_uses_root_name_when_given() -> None:
    with pytest.raises(SerializationError, match=r"cannot snapshot count\[0\]"):
        dumps([Point()], root="count")


@settings(max_examples=150, deadline=None)
@given(small_values)
def test_loads_raises_snapshot_error_when_encoding_is_truncated(value: Any) -> None:
    data = dumps(value)
    for cut in range(len(data)):
        with pytest.raises(SnapshotError) as info:
            loads(data[:cut])
        assert info.value.reason == "corrupt"


@settings(max_examples=100, deadline=None)
@given(values, st.binary(min_size=1, max_size=8))
def test_loads_raises_snapshot_error_when_bytes_trail_the_value(value: Any, extra: bytes) -> None:
    with pytest.raises(SnapshotError, match="trailing"):
        loads(dumps(value) + extra)


@settings(max_examples=1000)
@given(st.binary(max_size=64))
def test_loads_raises_only_snapshot_error_when_bytes_are_random(data: bytes) -> None:
    try:
        loads(data)
    except SnapshotError as exc:
        assert exc.reason == "corrupt"


@settings(max_examples=200, deadline=None)
@given(values, st.data())
def test_loads_raises_only_snapshot_error_when_a_byte_is_changed(value: Any, data: Any) -> None:
    encoded = bytearray(dumps(value))
    i = data.draw(st.integers(0, len(encoded) - 1))
    encoded[i] = data.draw(st.integers(0, 255))
    try:
        loads(bytes(encoded))
    except SnapshotError as exc:
        assert exc.reason == "corrupt"


@pytest.mark.parametrize(
    ("data", "what"),
    [
        (b"", "empty"),
        (b"Z", "unknown tag"),
        (b"s\x02\x00\x00\x00\xff\xfe", "invalid UTF-8"),
        (b"l\xff\xff\xff\xff", "forged count"),
        (b"D\x01\x00\x00\x00l\x00\x00\x00\x00N", "unhashable key"),
        (b"S\x01\x00\x00\x00l\x00\x00\x00\x00", "unhashable element"),
        (b"D\x02\x00\x00\x00NNNN", "duplicate key"),
        (b"S\x02\x00\x00\x00TT", "duplicate element"),
        (b"l\x01\x00\x00\x00" * (MAX_DEPTH + 1) + b"N", "too deep"),
    ],
)
def test_loads_raises_corrupt_when_input_is_forged(data: bytes, what: str) -> None:
    with pytest.raises(SnapshotError) as info:
        loads(data)
    assert info.value.reason == "corrupt", what


def test_loads_accepts_bytearray_and_memoryview_when_content_is_valid() -> None:
    data = dumps({"a": (1, 2)})
    assert loads(bytearray(data)) == loads(memoryview(data)) == {"a": (1, 2)}
