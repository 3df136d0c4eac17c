"""Unit tests for processor.wire: control-record round trips, malformed payloads, topology."""

from __future__ import annotations

import re
import struct
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from processor.errors import ConfigError, DeserializationError
from processor.wire import (
    CONTROL_HEADER,
    FORMAT_VERSION,
    MAX_CHECKPOINT_ID,
    MAX_GENERATION,
    MAX_TOPIC_NAME_LENGTH,
    MAX_TS_MS,
    MIN_TS_MS,
    Barrier,
    Control,
    EndOfStream,
    GenerationStart,
    Watermark,
    channel_key,
    channel_partition,
    channel_partitions_for,
    channel_topic_name,
    decode_control,
    encode_control,
    key_incarnation,
    key_to_downstream,
    source_partitions_for,
    upstream_of,
)

checkpoint_ids = st.integers(0, MAX_CHECKPOINT_ID)
generations = st.integers(0, MAX_GENERATION)
timestamps = st.integers(MIN_TS_MS, MAX_TS_MS)
controls: st.SearchStrategy[Control] = st.one_of(
    st.builds(Barrier, checkpoint_ids, generations, st.booleans()),
    st.builds(Watermark, timestamps),
    st.just(EndOfStream()),
    st.builds(GenerationStart, generations),
    st.builds(GenerationStart, generations, generations),
)
parallelisms = st.integers(1, 16)
TOPIC = re.compile(r"[a-zA-Z0-9._-]{1,249}")


def payload_of(ctl: Control) -> bytes:
    _, headers = encode_control(ctl)
    return headers[0][1]


# --- control records -------------------------------------------------------------------------


@given(controls)
def test_decode_returns_the_encoded_control_when_round_tripped(ctl: Control) -> None:
    value, headers = encode_control(ctl)
    assert value == b""
    assert [key for key, _ in headers] == [CONTROL_HEADER]
    assert decode_control(headers) == ctl


@given(controls, st.lists(st.tuples(st.text(), st.binary()), max_size=3))
def test_decode_finds_the_control_header_when_other_headers_surround_it(
    ctl: Control, others: list[tuple[str, bytes]]
) -> None:
    others = [(k, v) for k, v in others if k != CONTROL_HEADER]
    _, headers = encode_control(ctl)
    assert decode_control([*others, *headers, *others]) == ctl


@pytest.mark.parametrize(
    ("ctl", "expected"),
    [
        (Barrier(7, 3, unaligned=True), b"\x02\x01" + (7).to_bytes(8, "big") + b"\0\0\0\x03\x01"),
        (Watermark(-1), b"\x02\x02" + b"\xff" * 8),
        (EndOfStream(), b"\x02\x03"),
        (GenerationStart(2), b"\x02\x04\0\0\0\x02\0\0\0\x02"),
        (GenerationStart(2, 9), b"\x02\x04\0\0\0\x02\0\0\0\x09"),
    ],
)
def test_encode_writes_the_documented_bytes_when_given_each_kind(
    ctl: Control, expected: bytes
) -> None:
    """Pins the format: a change here breaks readers of topics written by older releases."""
    assert payload_of(ctl) == expected


@pytest.mark.parametrize("headers", [None, [], [("eosflow-id", b"abc")], [("k", None)]])
def test_decode_returns_none_when_record_is_data(headers: list[tuple[str, bytes]] | None) -> None:
    assert decode_control(headers) is None


@given(st.lists(st.tuples(st.text(), st.binary()), max_size=5))
def test_decode_returns_none_when_headers_are_unrelated(headers: list[tuple[str, bytes]]) -> None:
    headers = [(k, v) for k, v in headers if k != CONTROL_HEADER]
    assert decode_control(headers) is None


@given(controls, st.data())
def test_decode_raises_when_payload_is_truncated(ctl: Control, data: st.DataObject) -> None:
    payload = payload_of(ctl)
    cut = data.draw(st.integers(0, len(payload) - 1))
    with pytest.raises(DeserializationError):
        decode_control([(CONTROL_HEADER, payload[:cut])])


@pytest.mark.parametrize(
    "ctl", [Barrier(1, 1), Watermark(0), EndOfStream(), GenerationStart(1)], ids=repr
)
def test_decode_raises_when_payload_is_truncated_anywhere(ctl: Control) -> None:
    payload = payload_of(ctl)
    for cut in range(len(payload)):
        with pytest.raises(DeserializationError, match="eosflow-ctl could not decode"):
            decode_control([(CONTROL_HEADER, payload[:cut])])


@given(controls, st.binary(min_size=1, max_size=8))
def test_decode_raises_when_payload_has_trailing_bytes(ctl: Control, extra: bytes) -> None:
    with pytest.raises(DeserializationError, match="must be"):
        decode_control([(CONTROL_HEADER, payload_of(ctl) + extra)])


@given(st.integers(0, 255).filter(lambda k: k not in (1, 2, 3, 4)), st.binary(max_size=16))
def test_decode_raises_when_kind_is_unknown(kind: int, rest: bytes) -> None:
    with pytest.raises(DeserializationError, match=f"unknown control kind {kind}") as info:
        decode_control([(CONTROL_HEADER, bytes([FORMAT_VERSION, kind]) + rest)])
    assert info.value.serde == CONTROL_HEADER


@pytest.mark.parametrize(
    ("payload", "ctl"),
    [
        (b"\x01\x01" + (7).to_bytes(8, "big") + b"\0\0\0\x03\x01", Barrier(7, 3, True)),
        (b"\x01\x02" + b"\xff" * 8, Watermark(-1)),
        (b"\x01\x03", EndOfStream()),
        (b"\x01\x04\0\0\0\x02", GenerationStart(2, 2)),
    ],
)
def test_decode_reads_version_1_when_an_older_release_wrote_the_channel(
    payload: bytes, ctl: Control
) -> None:
    """A new release restoring a job reads the tail an older one left (replay, drop)."""
    assert FORMAT_VERSION == 2
    assert decode_control([(CONTROL_HEADER, payload)]) == ctl


@given(generations)
def test_channel_key_round_trips_and_is_canonical_when_given_any_incarnation(n: int) -> None:
    key = channel_key(n)
    assert 1 <= len(key) <= 4 and key_incarnation(key) == n
    assert len(key) == 1 or key[0] != 0  # equal keys are equal incarnations
    assert channel_key(n) == key


@pytest.mark.parametrize("key", [None, b"", b"\0\x01", b"\x01\0\0\0\0"])
def test_key_incarnation_is_none_when_the_key_names_no_incarnation(key: bytes | None) -> None:
    assert key_incarnation(key) is None


def test_channel_key_refuses_an_incarnation_the_wire_cannot_carry() -> None:
    with pytest.raises(ConfigError, match="incarnation"):
        channel_key(MAX_GENERATION + 1)


@given(controls, st.integers(0, 255).filter(lambda v: v not in (1, FORMAT_VERSION)))
def test_decode_raises_when_version_is_unknown(ctl: Control, version: int) -> None:
    payload = bytes([version]) + payload_of(ctl)[1:]
    with pytest.raises(DeserializationError, match=f"unknown control format version {version}"):
        decode_control([(CONTROL_HEADER, payload)])


@pytest.mark.parametrize("flags", [0x02, 0x80, 0xFF])
def test_decode_raises_when_barrier_has_unknown_flags(flags: int) -> None:
    payload = struct.pack(">BBQIB", FORMAT_VERSION, 1, 5, 1, flags)
    with pytest.raises(DeserializationError, match="flag"):
        decode_control([(CONTROL_HEADER, payload)])


def test_decode_raises_when_control_header_has_no_value() -> None:
    with pytest.raises(DeserializationError, match="too short"):
        decode_control([(CONTROL_HEADER, None)])


@pytest.mark.parametrize(
    "ctl",
    [
        Barrier(-1, 0),
        Barrier(MAX_CHECKPOINT_ID + 1, 0),
        Barrier(0, -1),
        Barrier(0, MAX_GENERATION + 1),
        Watermark(MIN_TS_MS - 1),
        Watermark(MAX_TS_MS + 1),
        GenerationStart(-1),
        GenerationStart(MAX_GENERATION + 1),
        Watermark(1.5),  # type: ignore[arg-type]
        GenerationStart(True),
    ],
    ids=repr,
)
def test_encode_raises_when_field_is_out_of_range(ctl: Control) -> None:
    with pytest.raises(ConfigError, match="must be an int in") as info:
        encode_control(ctl)
    assert isinstance(info.value, ValueError)


def test_encode_raises_when_given_something_else() -> None:
    with pytest.raises(TypeError, match="not a control message"):
        encode_control("barrier")  # type: ignore[arg-type]


# --- channel topology ------------------------------------------------------------------------


@given(parallelisms, parallelisms)
def test_channel_partition_is_a_bijection_when_parallelisms_vary(
    u_count: int, d_count: int
) -> None:
    mapped = {
        channel_partition(u, d, d_count): (u, d) for u in range(u_count) for d in range(d_count)
    }
    assert sorted(mapped) == list(range(u_count * d_count))
    for partition, (u, d) in mapped.items():
        assert upstream_of(partition, d_count) == u
        assert partition % d_count == d


@given(parallelisms, parallelisms)
def test_channel_partitions_for_are_those_of_downstream_when_parallelisms_vary(
    u_count: int, d_count: int
) -> None:
    seen: list[int] = []
    for d in range(d_count):
        mine = channel_partitions_for(d, u_count, d_count)
        assert mine == [channel_partition(u, d, d_count) for u in range(u_count)]
        assert [upstream_of(p, d_count) for p in mine] == list(range(u_count))
        seen.extend(mine)
    assert sorted(seen) == list(range(u_count * d_count))


@given(parallelisms, st.integers(0, 200))
def test_source_partitions_cover_each_partition_once_when_split_over_subtasks(
    parallelism: int, partition_count: int
) -> None:
    owned = [
        (p, s)
        for s in range(parallelism)
        for p in source_partitions_for(s, parallelism, partition_count)
    ]
    assert sorted(p for p, _ in owned) == list(range(partition_count))
    assert all(p % parallelism == s for p, s in owned)


@pytest.mark.parametrize(
    "call",
    [
        lambda: channel_partition(0, 2, 2),
        lambda: channel_partition(-1, 0, 2),
        lambda: channel_partition(0, 0, 0),
        lambda: channel_partitions_for(0, 0, 1),
        lambda: channel_partitions_for(3, 1, 3),
        lambda: upstream_of(-1, 2),
        lambda: upstream_of(0, 0),
        lambda: source_partitions_for(2, 2, 8),
        lambda: source_partitions_for(0, 0, 8),
        lambda: source_partitions_for(0, 1, -1),
    ],
)
def test_topology_raises_config_error_when_index_is_out_of_range(call: object) -> None:
    with pytest.raises(ConfigError):
        call()  # type: ignore[operator]


# --- key routing -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "parallelism", "expected"),
    [
        (b"user-1", 1, 0),
        (b"user-1", 3, 2),
        (b"user-1", 7, 5),
        (b"user-1", 8, 4),
        (b"user-1", 16, 4),
        (b"user-1", 2**32, 2_116_437_524),  # all 32 bits of the hash
        (b"", 5, 0),
        (b"user-42", 10, 5),
    ],
)
def test_key_to_downstream_returns_known_subtask_when_given_fixed_vectors(
    key: bytes, parallelism: int, expected: int
) -> None:
    """Pins the hash: a different function would move keys away from their restored state."""
    assert key_to_downstream(key, parallelism) == expected


@given(st.binary(max_size=64), parallelisms)
def test_key_to_downstream_is_in_range_when_given_any_key(key: bytes, parallelism: int) -> None:
    assert 0 <= key_to_downstream(key, parallelism) < parallelism


def test_key_to_downstream_is_identical_when_computed_in_another_process() -> None:
    """hash() would pass in-process but differ here: PYTHONHASHSEED salts it per process."""
    keys = [b"user-%d" % i for i in range(50)]
    code = f"from processor.wire import key_to_downstream as k;print([k(x, 7) for x in {keys!r}])"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == str([key_to_downstream(x, 7) for x in keys])


def test_key_to_downstream_spreads_keys_evenly_when_keys_are_sequential() -> None:
    counts = [0] * 7
    for i in range(70_000):
        counts[key_to_downstream(b"user-%d" % i, 7)] += 1
    assert max(counts) < 1.05 * 10_000
    assert min(counts) > 0.95 * 10_000


# --- topic names -----------------------------------------------------------------------------


def test_topic_name_is_readable_when_names_are_kebab_case() -> None:
    assert channel_topic_name("click-counts", "parse", "count-by-user") == (
        "eosflow.click-counts.parse.count-by-user"
    )


@pytest.mark.parametrize("parts", [("", "a", "b"), ("j", "", "b"), ("j", "a", "")])
def test_topic_name_raises_config_error_when_a_part_is_empty(parts: tuple[str, str, str]) -> None:
    with pytest.raises(ConfigError, match="non-empty"):
        channel_topic_name(*parts)


@given(st.text(min_size=1, max_size=300), st.text(min_size=1), st.text(min_size=1))
def test_topic_name_is_valid_and_deterministic_when_given_any_text(
    job: str, edge_from: str, edge_to: str
) -> None:
    name = channel_topic_name(job, edge_from, edge_to)
    assert TOPIC.fullmatch(name), name
    assert len(name) <= MAX_TOPIC_NAME_LENGTH
    assert name not in (".", "..")
    assert channel_topic_name(job, edge_from, edge_to) == name


@given(
    st.lists(
        st.tuples(st.text(min_size=1, max_size=300), st.text(min_size=1), st.text(min_size=1)),
        min_size=2,
        max_size=5,
        unique=True,
    )
)
def test_topic_names_differ_when_inputs_differ(parts: list[tuple[str, str, str]]) -> None:
    names = [channel_topic_name(*p) for p in parts]
    # Kafka refuses topics that differ only by '.' vs '_'; some file systems ignore case.
    assert len({n.replace("_", ".").lower() for n in names}) == len(parts)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (("j" * 300, "a", "b"), ("j" * 300, "a", "c")),  # same truncated prefix
        (("a.b", "c", "d"), ("a", "b.c", "d")),  # separator inside a part
        (("a b", "c", "d"), ("a-b", "c", "d")),  # sanitised to the same text
        (("a_b", "c", "d"), ("a.b", "c", "d")),  # Kafka's '.' / '_' collision
        (("Job", "c", "d"), ("job", "c", "d")),  # case
        (("a\0b", "c", "d"), ("a", "b\0c", "d")),  # hash input framing
    ],
)
def test_topic_names_differ_when_inputs_collide_after_sanitising(
    a: tuple[str, str, str], b: tuple[str, str, str]
) -> None:
    name_a, name_b = channel_topic_name(*a), channel_topic_name(*b)
    assert name_a.replace("_", ".").lower() != name_b.replace("_", ".").lower()
    assert len(name_a) <= MAX_TOPIC_NAME_LENGTH


def test_topic_name_is_truncated_with_hash_when_too_long() -> None:
    name = channel_topic_name("j" * 300, "from", "to")
    assert len(name) == MAX_TOPIC_NAME_LENGTH
    assert name.startswith("eosflow.jjj")
    assert re.fullmatch(r".*\.[0-9a-f]{12}", name)
