"""Merging dedup states for a change of parallelism (dedup.rescale), without Redis."""

from __future__ import annotations

import random
from typing import Any

import pytest

from dedup.buckets import BloomBuckets, merge_snapshots
from dedup.core import Deduplicator, MemoryIdStore
from dedup.errors import DedupConfigError
from dedup.rescale import dedup_prefix, merge_dedup_states, referenced_prefixes

# each test with the C accelerator and with the pure-Python path (tests/unit/conftest.py)
pytestmark = pytest.mark.usefixtures("dedup_paths")


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(127) for _ in range(n)]


def _buckets() -> BloomBuckets:
    return BloomBuckets(bucket_ms=1000, expected_ids=1000, fp_rate=0.01, max_filters=4)


def test_dedup_prefix_is_unchanged_in_epoch_zero_and_per_epoch_after() -> None:
    assert dedup_prefix("clicks", "unique", 3) == "eosflow:clicks:dedup:unique:3"
    assert dedup_prefix("clicks", "unique", 3, 0) == "eosflow:clicks:dedup:unique:3"
    assert dedup_prefix("clicks", "unique", 3, 2) == "eosflow:clicks:dedup:unique:e2.3"
    with pytest.raises(ValueError):
        dedup_prefix("clicks", "unique", 0, -1)


def test_merged_filters_have_no_false_negatives_and_are_ored_when_the_ids_fit() -> None:
    parts = [_buckets() for _ in range(3)]
    ids = [_ids(300, seed) for seed in range(3)]
    for part, group in zip(parts, ids, strict=True):
        part.add_many(0, group)
        part.add_many(1000, group[:10])
    big = _buckets()
    big.add_many(0, _ids(1500, 9))  # two filters: 1000 + 500 IDs
    snaps = [p.snapshot() for p in parts]
    merged = _buckets()
    merged.restore(merge_snapshots(snaps, expected_ids=1000, drop_before=0, bucket_ms=1000))
    assert all(merged.might_contain(i) for group in ids for i in group)
    assert [len(merged.buckets[0]), len(merged.buckets[1000])] == [1, 1]  # 900 and 30 IDs: OR
    assert merged.counts[0] == 900
    with_big = merge_snapshots(
        [*snaps, big.snapshot()], expected_ids=1000, drop_before=0, bucket_ms=1000
    )
    merged.restore(with_big)
    assert len(merged.buckets[0]) == 3  # 1000 | 500 + 300 | 300 + 300
    assert all(merged.might_contain(i) for group in ids for i in group)
    merged.add_many(0, _ids(500, 10))  # the least loaded filter (600) takes new IDs: 400 fit
    assert len(merged.buckets[0]) == 4
    # an older snapshot without expected_ids: nothing OR-ed, nothing lost
    plain = merge_snapshots(snaps, expected_ids=None, drop_before=1000, bucket_ms=1000)
    assert list(plain) == [1000] and len(plain[1000][1]) == 3


def _state(store: MemoryIdStore, seed: int, watermark: int) -> dict[str, Any]:
    d = Deduplicator(store, within_ms=10_000, bucket_ms=1000, expected_ids=500, fp_rate=0.01)
    d.check(_ids(100, seed), [5000] * 100)
    d.advance(watermark)
    d.prepare(7)
    return d.snapshot()


def test_merge_takes_the_union_of_lineages_the_lowest_watermark_and_inherits_transitively() -> None:
    a, b = _state(MemoryIdStore(), 1, 12_000), _state(MemoryIdStore(), 2, 11_000)
    a["inherited"] = [{"prefix": "p:0", "written": {5: 2}, "buckets": [1000]}]
    b["inherited"] = [{"prefix": "p:0", "written": {5: 2}, "buckets": [1000]}]
    merged = merge_dedup_states([("p:e1.0", a), ("p:e1.1", b)])
    assert merged["lineage"] == {**a["lineage"], **b["lineage"]}
    assert (merged["watermark"], merged["cutoff"], merged["prepared"]) == (11_000, 1000, 7)
    assert merged["written"] == {}
    assert referenced_prefixes(merged) == {"p:0", "p:e1.0", "p:e1.1"}
    assert merged["inherited"][0] == {"prefix": "p:0", "written": {5: 2}, "buckets": [1000]}
    assert merged["inherited"][1]["buckets"] is None  # read at restore
    assert referenced_prefixes(None) == set() == referenced_prefixes(a | {"inherited": []})
    with pytest.raises(DedupConfigError, match="within_ms"):
        merge_dedup_states([("p:0", a), ("p:1", {**b, "within_ms": 20_000})])


def test_a_store_without_inheritance_refuses_a_state_that_inherits() -> None:
    state = merge_dedup_states([("p:0", _state(MemoryIdStore(), 1, 0))])
    d = Deduplicator(MemoryIdStore(), within_ms=10_000, bucket_ms=1000)
    with pytest.raises(DedupConfigError, match="InheritingIdStore"):
        d.restore(state)
