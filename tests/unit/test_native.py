"""The dedup step's C accelerator (dedup/_native.c, :mod:`dedup.native`) against the pure-Python
path it replaces: the same IDs, the same filter bits, the same decisions, and snapshots that move
between the two.

Skipped where the accelerator was not built (no C compiler at ``pip install``), except under CI,
whose machine has one: there a missing build fails.
"""

from __future__ import annotations

import copy
import os
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rbloom import Bloom

import dedup.native
from dedup import Deduplicator
from dedup.buckets import BloomBuckets
from dedup.core import MemoryIdStore
from dedup.ids import pair_id, record_pair_ids
from dedup.native import NativeBloom

native = dedup.native.native
if native is None:
    if os.environ.get("CI") and os.environ.get("EOSFLOW_NATIVE") != "0":
        raise RuntimeError(
            "dedup/_native.c was not built: CI's machine has a C compiler, so pip install "
            "should have compiled it (see the install's output)"
        )
    pytest.skip("dedup/_native.c is not built (no C compiler at install)", allow_module_level=True)

_HASH = int.__index__


def pair_ids(keys: list[Any], values: list[Any]) -> list[int]:
    """The IDs of records ``(key, value, ts)`` whose ``id=`` function returns the value."""
    return record_pair_ids([(k, v, 0) for k, v in zip(keys, values, strict=True)], _same)


def _same(value: Any) -> Any:
    return value


# -- IDs ----------------------------------------------------------------------------------------

_text = st.text(alphabet=st.characters(codec="utf-8"), max_size=200)  # control characters too
_i64 = st.integers(-(2**63), 2**63 - 1)
_fast = st.one_of(_text, _i64)
_json = st.one_of(  # what the fallback takes: orjson's other types, and ints the C path leaves
    st.none(), st.booleans(), st.floats(allow_nan=False), st.integers(2**63, 2**64 - 1),
    st.lists(st.one_of(_text, _i64), max_size=3),
    st.dictionaries(_text, _i64, max_size=3),
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.one_of(_fast, _json), st.one_of(_fast, _json)), max_size=40))
def test_pair_ids_are_pair_id_of_each_pair(pairs: list[tuple[Any, Any]]) -> None:
    keys, values = [k for k, _v in pairs], [v for _k, v in pairs]
    assert pair_ids(keys, values) == [pair_id(k, v) for k, v in pairs]


def test_pair_ids_escape_every_control_character_as_orjson_does() -> None:
    keys = [chr(c) * 3 for c in range(0x80)] + ['a"b\\c', "é€😀", "\u2028\u2029\x7f", ""]
    values = [f"v{chr(c)}" for c in range(0x80)] + [0, -1, 2**63 - 1, -(2**63)]
    assert pair_ids(keys, values) == [pair_id(k, v) for k, v in zip(keys, values, strict=True)]


def test_long_pairs_take_several_blocks() -> None:
    keys = ["k" * n for n in (60, 61, 62, 63, 64, 125, 126, 127, 128, 129, 255, 256, 5000)]
    values = ["x" * (n % 7) for n in range(len(keys))]
    assert pair_ids(keys, values) == [pair_id(k, v) for k, v in zip(keys, values, strict=True)]


@pytest.mark.parametrize(
    "bad", [object(), "\ud800", 2**64, -(2**63) - 1], ids=["object", "surrogate", "u64+1", "i64-1"]
)
def test_pair_ids_refuse_what_pair_id_refuses(bad: Any) -> None:
    with pytest.raises(TypeError) as python:
        pair_id("k", bad)
    with pytest.raises(TypeError) as c:
        pair_ids(["a", "k"], ["b", bad])
    assert str(c.value) == str(python.value)


def test_an_id_function_that_changes_the_batch_changes_nothing_here() -> None:
    """The batch is read from a copy: an ``id=`` function that empties or rewrites the list
    does not crash the process (a read of freed records), and the IDs are of the records the
    call was given."""
    batch: list[Any] = [(f"k{i}", {"id": i}, 0) for i in range(500)]
    given = list(batch)

    def clears(value: Any) -> Any:
        batch.clear()
        return value["id"]

    def rewrites(value: Any) -> Any:
        batch[:] = [("x", {"id": "y"}, 0)] * 3
        return value["id"]

    want = [pair_id(k, v["id"]) for k, v, _t in given]
    for fn in (clears, rewrites):
        batch[:] = given
        assert native.record_pair_ids(batch, fn, pair_id) == want


def test_records_of_another_shape_take_the_python_path() -> None:
    """Lists, or tuples of another length: the C call says so before it calls ``fn``, and
    :func:`record_pair_ids` does what the Python path does with them."""
    calls: list[Any] = []

    def fn(value: Any) -> Any:
        calls.append(value)
        return value

    assert native.record_pair_ids([("k", "v", 0), ["k", "v", 0]], fn, pair_id) is None
    assert native.record_pair_ids([("k", "v")], fn, pair_id) is None
    assert calls == []
    mixed: list[Any] = [("k", "v", 0), ["k", "w", 0]]
    assert record_pair_ids(mixed, fn) == [pair_id("k", "v"), pair_id("k", "w")]


def test_a_batch_of_other_timestamps_or_ids_is_decided_in_python() -> None:
    nb = NativeBloom.load_bytes(Bloom(100, 0.01, _HASH).save_bytes())
    pending: set[int] = set()
    for ids, ts in [
        ([1, 2], [1.5, 2]),
        ([1, True], [1, 2]),
        ([1, 2], [2**63, 2]),
        ([1, 2], [5, -(2**63) + 1]),  # its bucket's start is below int64
    ]:
        assert native.decide(ids, ts, -(2**63), [nb.bits], [nb.k], pending, 1000) is None
    assert pending == set()  # nothing was changed before the refusal
    d = Deduplicator(MemoryIdStore(), within_ms=10_000, expected_ids=100, fp_rate=0.01)
    assert d.check([5, 6, 5], [1000.5, 2000.0, 1000.0]) == [True, True, False]  # type: ignore[list-item]


def test_ids_are_taken_as_rbloom_takes_its_hash() -> None:
    """A signed 128-bit int: negative ones hash as rbloom hashes them, 2**127 and more are
    refused as rbloom refuses them."""
    rb = Bloom(100, 0.01, _HASH)
    nb = NativeBloom.load_bytes(rb.save_bytes())
    rb.update([-5, -(2**127)])
    nb.update([-5, -(2**127)])
    assert nb.save_bytes() == rb.save_bytes()
    with pytest.raises(OverflowError):
        rb.update([2**127])
    with pytest.raises(OverflowError):
        nb.update([2**127])


def test_pair_ids_with_and_without_the_accelerator_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dedup.native, "native", None)
    keys = [str(i % 13) for i in range(500)]
    values = [f"{i:x}" for i in range(500)]
    python = pair_ids(keys, values)
    records = [(k, {"id": v}, 0) for k, v in zip(keys, values, strict=True)]
    assert python == native.record_pair_ids(records, lambda value: value["id"], pair_id)


def test_an_id_function_that_raises_raises_through_the_batch() -> None:
    def fn(value: Any) -> Any:
        if value == 3:
            raise KeyError("no id")
        return value

    with pytest.raises(KeyError, match="no id"):
        record_pair_ids([("k", v, 0) for v in range(5)], fn)
    with pytest.raises(ValueError, match="not enough values"):  # as the Python path
        record_pair_ids([("k",)], fn)


# -- filters ------------------------------------------------------------------------------------


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(127) for _ in range(n)] + [0, 1, 2**127 - 1][: min(n, 3)]


@pytest.mark.parametrize(
    ("expected", "fp"), [(1, 0.3), (7, 0.01), (1000, 0.001), (100_000, 0.001 / 6), (12_345, 1e-7)]
)
def test_a_native_filter_has_rblooms_bits_and_answers(expected: int, fp: float) -> None:
    rb = Bloom(expected, fp, _HASH)
    nb = NativeBloom.load_bytes(rb.save_bytes())
    assert nb.size_in_bits == rb.size_in_bits
    added, others = _ids(min(expected, 3000), 1), _ids(3000, 2)
    rb.update(added)
    nb.update(added)
    assert nb.save_bytes() == rb.save_bytes()
    assert [i in nb for i in added + others] == [i in rb for i in added + others]
    # each loads the other's bytes
    assert Bloom.load_bytes(nb.save_bytes(), _HASH) == rb
    assert NativeBloom.load_bytes(rb.save_bytes()).save_bytes() == nb.save_bytes()


def test_deciding_a_batch_probes_every_filter_and_finds_copies_in_order() -> None:
    filters = [NativeBloom.load_bytes(Bloom(500, 0.05, _HASH).save_bytes()) for _ in range(3)]
    for i, f in enumerate(filters):
        f.update(_ids(400, i))
    ids = _ids(400, 0)[:100] + _ids(400, 2)[:100] + _ids(3000, 9)
    ids += ids[-50:]  # copies within the batch
    ts = [1000 + i % 7 for i in range(len(ids))]
    bits, ks = [f.bits for f in filters], [f.k for f in filters]
    want: tuple[Any, ...] = ([], {}, [], [])  # out, fresh IDs by bucket, hits, late
    earlier = set(_ids(20, 0)[:10])  # pending before the batch: copies without a probe
    fresh = set(earlier)
    for i, (record_id, t) in enumerate(zip(ids, ts, strict=True)):  # in order, as check()
        copy = t >= 1003 and record_id in fresh
        want[0].append(not copy)
        if t < 1003:
            want[3].append(i)
        elif not copy and any(record_id in f for f in filters):
            want[2].append(i)
        elif not copy:
            fresh.add(record_id)
            want[1].setdefault(t - t % 3, []).append(record_id)
    pending = set(earlier)
    got = native.decide(ids, ts, 1003, bits, ks, pending, 3)
    assert got == (*want, want[0].count(False))
    assert pending == fresh
    assert want[2] and want[3] and want[0].count(False) and len(want[1]) > 1  # each kind occurs
    everything = native.decide(ids, ts, 0, [], [], set(), 1000)[1]
    assert everything == {1000: list(dict.fromkeys(ids))}


def test_bucket_starts_are_pythons_for_negative_timestamps() -> None:
    ts = [-7, -6, -1, 0, 5, -(2**62)]
    ids = list(range(len(ts)))
    groups = native.decide(ids, ts, -(2**63), [], [], set(), 3)[1]
    want: dict[int, list[int]] = {}
    for i, t in zip(ids, ts, strict=True):
        want.setdefault(t - t % 3, []).append(i)
    assert groups == want


@given(st.lists(st.integers(min_value=0, max_value=2**128 - 1), max_size=50))
def test_packed_ids_are_int_to_bytes(ids: list[int]) -> None:
    assert native.pack_ids(ids) == b"".join(i.to_bytes(16, "little") for i in ids)


@pytest.mark.parametrize("bad", [-1, 2**128, "1", 1.0])
def test_packing_refuses_what_to_bytes_refuses(bad: Any) -> None:
    with pytest.raises((OverflowError, TypeError)):
        native.pack_ids([1, bad])


def test_or_of_native_filters_is_rblooms_or() -> None:
    a, b = Bloom(1000, 0.01, _HASH), Bloom(1000, 0.01, _HASH)
    a.update(_ids(300, 1))
    b.update(_ids(300, 2))
    na, nb = NativeBloom.load_bytes(a.save_bytes()), NativeBloom.load_bytes(b.save_bytes())
    na |= nb
    a |= b  # type: ignore[misc]
    assert na.save_bytes() == a.save_bytes()
    other = NativeBloom.load_bytes(Bloom(2000, 0.01, _HASH).save_bytes())
    with pytest.raises(ValueError, match="must be the same"):
        na |= other


def test_bad_filters_and_ids_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 9 bytes"):
        NativeBloom.load_bytes(b"\x01" * 8)
    nb = NativeBloom.load_bytes(Bloom(10, 0.1, _HASH).save_bytes())
    with pytest.raises(TypeError, match="an ID is an int"):
        nb.update(["0"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="k >= 1"):
        NativeBloom(0, bytearray(8))
    nb.k = 0
    with pytest.raises(ValueError, match="k=0 hashes"):
        nb.update([1])


# -- decisions and snapshots ----------------------------------------------------------------------


def _workload(seed: int, batches: int = 40) -> list[tuple[list[int], list[int]]]:
    """Batches of IDs with copies (in and across batches) and timestamps across buckets, some
    behind the horizon."""
    rng = random.Random(seed)
    pool = [rng.getrandbits(127) for _ in range(3000)]
    out = []
    for b in range(batches):
        n = rng.randrange(1, 300)
        ids = [rng.choice(pool) for _ in range(n)]
        ts = [b * 1500 + rng.randrange(-4000, 2000) for _ in range(n)]
        out.append((ids, ts))
    return out


def _run(
    batches: list[tuple[list[int], list[int]]],
    store: MemoryIdStore,
    state: dict[str, Any] | None = None,
) -> tuple[list[list[bool]], dict[str, Any]]:
    d = Deduplicator(store, within_ms=10_000, bucket_ms=1000, expected_ids=200, fp_rate=0.05, run=7)
    d.restore(state)
    decided = []
    for checkpoint, (ids, ts) in enumerate(batches, start=1):
        decided.append(d.check(ids, ts))
        d.advance(max(ts) - 3000)
        d.prepare(checkpoint)
        d.commit(checkpoint)
    return decided, d.snapshot()


def test_a_deduplicator_decides_the_same_with_and_without_the_accelerator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Same decisions, same snapshots (filters byte for byte), and a snapshot of either path
    restored by the other decides as the first would have."""
    first, second = _workload(1), _workload(2)
    c_store, py_store = MemoryIdStore(), MemoryIdStore()
    c_decided, c_state = _run(first, c_store)
    with monkeypatch.context() as m:
        m.setattr(dedup.native, "native", None)
        py_decided, py_state = _run(first, py_store)
        # the Python path restores C's snapshot
        py_after_c, _ = _run(second, copy.deepcopy(c_store), c_state)
    assert c_decided == py_decided
    assert c_state == py_state
    c_after_py, _ = _run(second, copy.deepcopy(py_store), py_state)
    assert c_after_py == py_after_c
    assert any(not ok for batch in c_decided for ok in batch)  # copies were found


def test_a_filter_of_an_older_shape_saved_by_python_is_probed_in_c(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A restore under the accelerator of a filter that the Python path saved with other
    parameters (an older snapshot) probes it too."""
    with monkeypatch.context() as m:
        m.setattr(dedup.native, "native", None)
        old = BloomBuckets(bucket_ms=1000, expected_ids=50, fp_rate=0.01, max_filters=2)
        ids = _ids(40, 5)
        old.add_many(0, ids)
        state = old.snapshot()
    new = BloomBuckets(bucket_ms=1000, expected_ids=5000, fp_rate=0.01, max_filters=6)
    new.restore(state)
    new.add_many(1000, _ids(30, 6))
    assert all(type(f) is NativeBloom for fs in new.buckets.values() for f in fs)
    probed = ids + _ids(30, 6)
    assert new.decide(probed, [1000] * len(probed), 0, set())[2] == list(range(len(probed)))
