"""Bloom buckets probed as unions of sparse filters (dedup.buckets), without I/O.

The no-false-negative and false-positive properties of plain buckets: ``test_dedup.py``.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dedup.buckets
from dedup.buckets import BloomBuckets

# each test with the C accelerator and with the pure-Python path (tests/unit/conftest.py)
pytestmark = pytest.mark.usefixtures("dedup_paths")


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(127) for _ in range(n)]


def _sparse(buckets: int, per_bucket: int, expected_ids: int = 10_000) -> BloomBuckets:
    b = BloomBuckets(bucket_ms=1000, expected_ids=expected_ids, fp_rate=0.01, max_filters=6)
    for start, ids in enumerate(_ids(buckets * per_bucket, 1)[i::buckets] for i in range(buckets)):
        b.add_many(start * 1000, ids)
    return b


def _restored(b: BloomBuckets) -> BloomBuckets:
    out = BloomBuckets(bucket_ms=1000, expected_ids=b.expected_ids, fp_rate=0.01, max_filters=6)
    out.restore(b.snapshot())
    return out


def test_sparse_buckets_are_probed_as_few_unions_when_many_are_live() -> None:
    """Issue 38: a watermark lagging the newest records (partitions read unevenly) left 14
    filters live in the reference job, each probed for every fresh ID (0.2 us a probe): the
    dedup step cost 0.62x the job without it. 40 buckets of 500 IDs fit in 4 half filters."""
    b = _sparse(40, 500)
    assert len(b.buckets) == 40
    assert len(b._probes) <= 10  # the newest buckets wait for enough IDs to be packed
    assert all(b.might_contain(x) for x in _ids(40 * 500, 1))
    restored = _restored(b)  # a restore packs at once
    assert len(restored._probes) == 4
    assert all(restored.might_contain(x) for x in _ids(40 * 500, 1))


def test_full_buckets_are_probed_alone() -> None:
    b = _sparse(4, 6000)  # more than half a filter each: no union would save a probe
    assert len(b._probes) == 4
    assert not b._union_of


def test_false_positive_rate_of_unions_stays_within_1_5x_of_one_filters_target() -> None:
    b = _sparse(40, 500)
    probes = 200_000
    rate = sum(b.might_contain(x) for x in _ids(probes, 2)) / probes
    # 40 filters probed alone: up to 40 times one filter's rate (0.01 / 6)
    print(f"measured over {len(b._probes)} probes for 40 buckets: {rate:.5f}")
    assert rate <= len(b._probes) * b.filter_fp * 1.5


def test_a_bucket_that_outgrows_its_union_leaves_it_and_is_still_found() -> None:
    b = _restored(_sparse(8, 500))
    assert len(b._probes) == 1
    more = _ids(9_000, 3)  # the union would pass expected_ids
    b.add_many(7000, more)
    assert 7000 not in b._union_of
    assert len(b._probes) == 2
    assert all(b.might_contain(x) for x in more)
    assert all(b.might_contain(x) for x in _ids(8 * 500, 1))


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("add"), st.integers(0, 30), st.integers(1, 40)),
            st.tuples(st.just("drop"), st.integers(0, 30), st.just(0)),
            st.tuples(st.just("restore"), st.just(0), st.just(0)),
        ),
        max_size=60,
    )
)
def test_unions_have_no_false_negatives_through_adds_drops_and_restores(
    ops: list[tuple[str, int, int]],
) -> None:
    saved = dedup.buckets._IDS_PER_REPACK
    dedup.buckets._IDS_PER_REPACK = 1e-9  # repack at every change
    try:
        b = BloomBuckets(bucket_ms=1000, expected_ids=64, fp_rate=0.01, max_filters=4)
        live: dict[int, list[int]] = {}
        rng = random.Random(len(ops))
        for op, bucket, n in ops:
            if op == "add":
                ids = [rng.getrandbits(127) for _ in range(n)]
                b.add_many(bucket * 1000, ids)
                live.setdefault(bucket * 1000, []).extend(ids)
            elif op == "drop":
                b.drop_before(bucket * 1000)
                live = {s: ids for s, ids in live.items() if s + 1000 > bucket * 1000}
            else:
                restored = BloomBuckets(
                    bucket_ms=1000, expected_ids=64, fp_rate=0.01, max_filters=4
                )
                restored.restore(b.snapshot())
                b = restored
            for ids in live.values():
                assert all(b.might_contain(x) for x in ids)
    finally:
        dedup.buckets._IDS_PER_REPACK = saved


@pytest.mark.parametrize("expected_ids", [1000, 2000])
def test_filters_of_another_size_are_probed_alone(expected_ids: int) -> None:
    """A restored snapshot may hold filters of an older ``expected_ids``: they cannot be
    OR-ed with the new ones, and stay probed alone (no false negatives)."""
    old = _sparse(3, 100, expected_ids=expected_ids)
    b = BloomBuckets(bucket_ms=1000, expected_ids=1000, fp_rate=0.01, max_filters=6)
    b.restore(old.snapshot())
    fresh = _ids(50, 7)
    b.add_many(5000, fresh)
    assert all(b.might_contain(x) for x in _ids(300, 1) + fresh)
