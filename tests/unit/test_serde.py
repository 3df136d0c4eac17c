"""Unit tests for connectors.serde: round trips (hypothesis), malformed input, bad values."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from connectors.serde import (
    AvroSerde,
    ConfluentAvroSerde,
    JsonSerde,
    RawSerde,
    Serde,
    StringSerde,
    serde_for,
)
from processor.errors import ConfigError, DeserializationError, SerializationError

WHERE: dict[str, Any] = {"topic": "clicks", "partition": 3, "offset": 1042}

CLICK_V1 = {
    "type": "record",
    "name": "Click",
    "namespace": "eosflow.test",
    "fields": [
        {"name": "user", "type": "string"},
        {"name": "ts_ms", "type": "long"},
        {"name": "score", "type": "double"},
        {"name": "clicked", "type": "boolean"},
        {"name": "referrer", "type": ["null", "string"]},
        {"name": "tags", "type": {"type": "array", "items": "string"}},
        {"name": "attrs", "type": {"type": "map", "values": "long"}},
    ],
}
# v2 adds a defaulted field: records written with v1 must still read, with the default filled in.
CLICK_V2 = {
    **CLICK_V1,
    "fields": [*CLICK_V1["fields"], {"name": "region", "type": "string", "default": "eu"}],
}

CLICK = {
    "user": "u-17",
    "ts_ms": 1_700_000_000_000,
    "score": 0.5,
    "clicked": True,
    "referrer": None,
    "tags": ["a", "b"],
    "attrs": {"x": 1},
}

finite_floats = st.floats(allow_nan=False, allow_infinity=False)
longs = st.integers(min_value=-(2**63), max_value=2**63 - 1)

# orjson encodes ints in [-2**63, 2**64) only, and NaN/inf as null (no JSON spelling for them).
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | finite_floats
    | st.text(),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(), children, max_size=5)
    ),
    max_leaves=20,
)

clicks = st.fixed_dictionaries(
    {
        "user": st.text(),
        "ts_ms": longs,
        "score": finite_floats,
        "clicked": st.booleans(),
        "referrer": st.none() | st.text(),
        "tags": st.lists(st.text(), max_size=5),
        "attrs": st.dictionaries(st.text(), longs, max_size=5),
    }
)


def confluent(**kwargs: Any) -> ConfluentAvroSerde:
    return ConfluentAvroSerde(CLICK_V2, 2, **kwargs)


def v1_confluent_bytes(record: dict[str, Any]) -> bytes:
    return ConfluentAvroSerde(CLICK_V1, 1).serialize(record)


def assert_bad_record(serde: Serde, data: bytes, *cause_parts: str) -> DeserializationError:
    """Decode ``data`` and check the error carries the location, the serde and the bytes."""
    with pytest.raises(DeserializationError) as info:
        serde.deserialize(data, **WHERE)
    err = info.value
    assert (err.topic, err.partition, err.offset) == ("clicks", 3, 1042)
    assert "topic='clicks' partition=3 offset=1042" in str(err)
    assert err.serde == serde.name
    assert err.data == data
    for part in cause_parts:
        assert part in err.cause, err.cause
    return err


# --- round trips --------------------------------------------------------------------------------


@given(st.binary())
def test_round_trips_when_raw_bytes(data: bytes) -> None:
    serde = RawSerde()
    assert serde.deserialize(serde.serialize(data)) == data


@given(st.text())
def test_round_trips_when_string_is_any_text(text: str) -> None:
    serde = StringSerde()
    assert serde.deserialize(serde.serialize(text)) == text


@given(json_values, st.booleans())
def test_round_trips_when_json_value(value: Any, sort_keys: bool) -> None:
    serde = JsonSerde(sort_keys=sort_keys)
    assert serde.deserialize(serde.serialize(value)) == value


@given(clicks)
def test_round_trips_when_record_matches_avro_schema(record: dict[str, Any]) -> None:
    serde = AvroSerde(CLICK_V1)
    assert serde.deserialize(serde.serialize(record)) == record


@given(clicks)
def test_round_trips_when_record_matches_confluent_schema(record: dict[str, Any]) -> None:
    serde = ConfluentAvroSerde(CLICK_V1, 7)
    data = serde.serialize(record)
    assert data[:5] == b"\x00\x00\x00\x00\x07"
    assert serde.deserialize(data) == record


@pytest.mark.parametrize("serde", [StringSerde(), JsonSerde(), AvroSerde(CLICK_V1), confluent()])
@given(data=st.binary())
def test_raises_only_deserialization_error_when_bytes_are_arbitrary(
    serde: Serde, data: bytes
) -> None:
    try:
        serde.deserialize(data, **WHERE)
    except DeserializationError as err:
        assert (err.topic, err.partition, err.offset) == ("clicks", 3, 1042)


# --- raw and string -----------------------------------------------------------------------------


def test_accepts_bytes_like_when_raw_serializes() -> None:
    serde = RawSerde()
    assert serde.serialize(bytearray(b"ab")) == b"ab"
    assert serde.serialize(memoryview(b"ab")) == b"ab"


def test_raises_serialization_error_when_raw_gets_str() -> None:
    with pytest.raises(SerializationError, match=r"expected bytes.*got str"):
        RawSerde().serialize("ab")


@pytest.mark.parametrize(
    "data", [b"\xff", b"caf\xc3", b"\xed\xa0\x80"], ids=["garbage", "cut", "surrogate"]
)
def test_raises_deserialization_error_when_string_is_malformed_utf8(data: bytes) -> None:
    err = assert_bad_record(StringSerde(), data, "malformed UTF-8")
    assert isinstance(err.__cause__, UnicodeDecodeError)


@pytest.mark.parametrize(
    "value", [b"ab", 3, None, "\ud800"], ids=["bytes", "int", "none", "surrogate"]
)
def test_raises_serialization_error_when_string_gets_non_text(value: Any) -> None:
    with pytest.raises(SerializationError, match="string: expected"):
        StringSerde().serialize(value)


# --- json ---------------------------------------------------------------------------------------


def test_writes_sorted_keys_when_sort_keys_is_set() -> None:
    assert JsonSerde(sort_keys=True).serialize({"b": 1, "a": 2}) == b'{"a":2,"b":1}'
    assert JsonSerde().serialize({"b": 1, "a": 2}) == b'{"b":1,"a":2}'


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b'{"user": "u-1", "ts',
        b"\xff\xfe\x00garbage",
        b'{"a": 1} {"b": 2}',
        b"\x00\x00\x00\x00\x01",
    ],
    ids=["empty", "truncated", "garbage", "trailing", "avro"],
)
def test_raises_deserialization_error_when_json_is_malformed(data: bytes) -> None:
    err = assert_bad_record(JsonSerde(), data, "invalid JSON")
    assert err.__cause__ is not None


@pytest.mark.parametrize(
    "value",
    [object(), 2**64, -(2**63) - 1, {1: "int key"}, b"bytes"],
    ids=["object", "int-too-big", "int-too-small", "non-str-key", "bytes"],
)
def test_raises_serialization_error_when_json_value_is_not_encodable(value: Any) -> None:
    with pytest.raises(SerializationError, match="json: expected a JSON-compatible value") as info:
        JsonSerde().serialize(value)
    assert info.value.__cause__ is not None


# --- avro ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "record",
    [
        {**CLICK, "ts_ms": "late"},
        {**CLICK, "ts_ms": 1.7},  # fastavro alone would write 1
        {**CLICK, "clicked": "no"},  # fastavro alone would write true
        {**CLICK, "ts_ms": 2**63},
        {k: v for k, v in CLICK.items() if k != "referrer"},
        {**CLICK, "extra": 1},
        [CLICK],
    ],
    ids=[
        "str-for-long",
        "float-for-long",
        "str-for-boolean",
        "long-overflow",
        "missing",
        "extra",
        "list",
    ],
)
@pytest.mark.parametrize(
    "serde", [AvroSerde(CLICK_V1), ConfluentAvroSerde(CLICK_V1, 1)], ids=["avro", "confluent"]
)
def test_raises_serialization_error_naming_schema_when_record_does_not_match(
    serde: Serde, record: Any
) -> None:
    with pytest.raises(SerializationError, match=r"schema eosflow\.test\.Click") as info:
        serde.serialize(record)
    assert info.value.__cause__ is not None


def test_writes_defaulted_field_when_record_omits_it() -> None:
    serde = AvroSerde(CLICK_V2)
    assert serde.deserialize(serde.serialize(CLICK)) == {**CLICK, "region": "eu"}


def test_skips_type_check_when_validate_is_off() -> None:
    serde = AvroSerde(CLICK_V1, validate=False)
    assert serde.deserialize(serde.serialize({**CLICK, "ts_ms": 1.7}))["ts_ms"] == 1


GOOD_AVRO = AvroSerde(CLICK_V1).serialize(CLICK)


@pytest.mark.parametrize(
    ("data", "cause"),
    [
        (b"", "truncated"),
        (GOOD_AVRO[:-3], "truncated"),
        (b"\xff" * 12, "not a valid Avro datum of schema eosflow.test.Click"),
        (GOOD_AVRO + b"\x00\x01", "2 trailing bytes after a complete datum"),
    ],
    ids=["empty", "truncated", "garbage", "trailing"],
)
def test_raises_deserialization_error_when_avro_is_malformed(data: bytes, cause: str) -> None:
    err = assert_bad_record(AvroSerde(CLICK_V1), data, cause)
    assert err.__cause__ is not None


def test_reads_into_reader_schema_when_avro_schema_evolved() -> None:
    old = AvroSerde(CLICK_V1).serialize(CLICK)
    assert AvroSerde(CLICK_V1, reader_schema=CLICK_V2).deserialize(old) == {**CLICK, "region": "eu"}


def test_raises_config_error_when_avro_schema_is_invalid() -> None:
    with pytest.raises(ConfigError, match="schema is not a valid Avro schema"):
        AvroSerde({"type": "record", "name": "Bad", "fields": [{"name": "x", "type": "nope"}]})


# --- confluent avro -----------------------------------------------------------------------------


GOOD_CONFLUENT = confluent().serialize(CLICK)


@pytest.mark.parametrize(
    ("data", "cause"),
    [
        (b"", "too short: 0 bytes, expected at least 5"),
        (b"\x00\x00\x00", "too short: 3 bytes"),
        (b'{"user": "u-17"}', "expected magic byte 0x00, got 0x7b; is this JSON?"),
        (b"\x01" + GOOD_CONFLUENT[1:], "expected magic byte 0x00, got 0x01"),
        (b"\x00\x00\x00\x00\x63" + GOOD_CONFLUENT[5:], "unknown schema id 99 (known: [2])"),
        (GOOD_CONFLUENT[:-3], "schema id 2: not a valid Avro datum of schema eosflow.test.Click"),
        (GOOD_CONFLUENT[:5] + b"\xff" * 12, "schema id 2: not a valid Avro datum"),
        (GOOD_CONFLUENT + b"\x00", "1 trailing bytes after a complete datum"),
    ],
    ids=["empty", "short", "json", "wrong-magic", "unknown-id", "truncated", "garbage", "trailing"],
)
def test_raises_deserialization_error_when_confluent_record_is_malformed(
    data: bytes, cause: str
) -> None:
    assert_bad_record(confluent(), data, cause)


def test_reads_old_schema_id_into_new_schema_when_schemas_maps_it() -> None:
    serde = confluent(schemas={1: CLICK_V1})
    assert serde.deserialize(v1_confluent_bytes(CLICK)) == {**CLICK, "region": "eu"}
    assert serde.deserialize(serde.serialize(CLICK)) == {**CLICK, "region": "eu"}


def test_resolves_unknown_id_once_when_resolve_is_given() -> None:
    calls: list[int] = []

    def resolve(schema_id: int) -> Any:
        calls.append(schema_id)
        return CLICK_V1 if schema_id == 1 else None

    serde = confluent(resolve=resolve)
    for _ in range(3):
        assert serde.deserialize(v1_confluent_bytes(CLICK))["region"] == "eu"
    assert calls == [1]
    assert_bad_record(serde, b"\x00\x00\x00\x00\x05" + GOOD_CONFLUENT[5:], "unknown schema id 5")


def test_treats_id_as_unknown_when_resolve_raises_lookup_error() -> None:
    def resolve(schema_id: int) -> Any:
        raise KeyError(schema_id)

    assert_bad_record(confluent(resolve=resolve), v1_confluent_bytes(CLICK), "unknown schema id 1")


def test_propagates_registry_failure_when_resolve_raises_other_error() -> None:
    """A registry outage must not turn good records into dead letters."""

    def resolve(schema_id: int) -> Any:
        raise ConnectionError("registry down")

    with pytest.raises(ConnectionError):
        confluent(resolve=resolve).deserialize(v1_confluent_bytes(CLICK), **WHERE)


@pytest.mark.parametrize("schema_id", [-1, 2**31, True, "2"])
def test_raises_config_error_when_schema_id_is_invalid(schema_id: Any) -> None:
    with pytest.raises(ConfigError, match="schema_id"):
        ConfluentAvroSerde(CLICK_V1, schema_id)


def test_raises_config_error_when_schemas_contradicts_schema_id() -> None:
    with pytest.raises(ConfigError, match="both claim id 2"):
        confluent(schemas={2: CLICK_V1})


# --- serde_for ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "cls"), [("json", JsonSerde), ("raw", RawSerde), ("string", StringSerde)]
)
def test_builds_serde_when_spec_is_a_known_name(spec: str, cls: type) -> None:
    assert type(serde_for(spec)) is cls


def test_returns_instance_when_spec_is_a_serde() -> None:
    serde = AvroSerde(CLICK_V1)
    assert serde_for(serde) is serde


@pytest.mark.parametrize("spec", ["avro", "JSON", JsonSerde, 3])
def test_raises_config_error_listing_names_when_spec_is_unknown(spec: Any) -> None:
    with pytest.raises(ConfigError, match="expected one of 'json', 'raw', 'string'") as info:
        serde_for(spec)
    assert isinstance(info.value, ValueError)
