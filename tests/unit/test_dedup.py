"""Record IDs, Bloom buckets and the deduplicator's rules, without I/O (``MemoryIdStore``).

The same rules against a real Redis: ``tests/integration/test_dedup_redis.py``.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dedup.buckets import BloomBuckets
from dedup.core import Deduplicator, MemoryIdStore
from dedup.errors import DedupConfigError, RedisDataLost
from dedup.ids import (
    derived_id,
    emission_id,
    id_from_bytes,
    id_to_bytes,
    pair_id,
    source_id,
    value_id,
)

# each test with the C accelerator and with the pure-Python path (tests/unit/conftest.py)
pytestmark = pytest.mark.usefixtures("dedup_paths")


def fresh_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(127) for _ in range(n)]


# -- IDs -----------------------------------------------------------------------------------------


def test_ids_are_stable_128_bit_and_domain_separated() -> None:
    assert value_id("abc") == value_id("abc")
    assert value_id("abc") != value_id(b"abc")
    assert value_id(1) != value_id("1")
    assert value_id({"a": 1, "b": [1, 2]}) == value_id({"b": [1, 2], "a": 1})
    assert value_id(("x", 1)) == value_id(["x", 1])  # a tuple key comes back as a list
    assert source_id("t", 1, 23) != source_id("t", 12, 3)
    assert derived_id(value_id("a"), 0) != derived_id(value_id("a"), 1)
    assert emission_id("count", "k", 10_000, 0) != emission_id("count", "k", 20_000, 0)
    # pinned: an ID must never change between releases (stored IDs would stop matching)
    assert value_id("abc") == 0x74DCC2D0D97DD4AB6E0A61E6997B5745
    assert source_id("t", 0, 0) == 0x287F0CF2D114973C4583573B3D77DEB2
    for x in (
        value_id("abc"),
        source_id("t", 0, 0),
        derived_id(1, 2),
        emission_id("s", 1, None, 3),
    ):
        assert 0 <= x < 2**127
        assert id_from_bytes(id_to_bytes(x)) == x
    with pytest.raises(ValueError, match="not an eosflow record ID"):
        id_from_bytes(b"short")


def test_pair_id_is_the_value_id_of_the_pair() -> None:
    """The per-key dedup step hashes ``[key, id]`` with ``pair_id``: IDs stored by an older
    eosflow (``value_id([key, id])``) must still match."""
    assert pair_id("user-00001", "c-7-1") == value_id(["user-00001", "c-7-1"])
    assert pair_id("user-00001", "c-7-1") == 0x3D33A606C4001E464D64A3316AF58044  # pinned
    assert pair_id(7, {"b": 1, "a": [1, 2]}) == value_id((7, {"a": [1, 2], "b": 1}))
    assert value_id({"b": 1, "a": [1, 2]}) == 0x7D9B13471CB6D62ACA563232385E5116  # pinned
    with pytest.raises(TypeError):
        pair_id("k", object())


# -- Bloom buckets --------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 2**127 - 1), st.integers(0, 10**7)), max_size=300),
    st.integers(1, 10**6),
)
def test_bloom_buckets_have_no_false_negatives_until_their_bucket_is_dropped(
    entries: list[tuple[int, int]], cutoff: int
) -> None:
    buckets = BloomBuckets(bucket_ms=60_000, expected_ids=50, fp_rate=0.01, max_filters=4)
    for record_id, ts in entries:
        buckets.add(record_id, ts)
    restored = BloomBuckets(bucket_ms=60_000, expected_ids=50, fp_rate=0.01, max_filters=4)
    restored.restore(buckets.snapshot())
    for b in (buckets, restored):
        b.drop_before(cutoff)
        for record_id, ts in entries:
            if ts >= cutoff:  # never forgets an ID younger than the cutoff
                assert b.might_contain(record_id)


@pytest.mark.parametrize("target", [0.01, 0.001])
def test_false_positive_rate_of_a_full_filter_is_within_1_5x_of_the_target(target: float) -> None:
    n, probes = 100_000, 400_000
    buckets = BloomBuckets(bucket_ms=1000, expected_ids=n, fp_rate=target, max_filters=1)
    for record_id in fresh_ids(n, 1):
        buckets.add(record_id, 0)
    hits = sum(buckets.might_contain(x) for x in fresh_ids(probes, 2))
    rate = hits / probes
    print(f"target={target} measured={rate:.5f} ({hits} of {probes})")
    assert target / 1.5 <= rate <= target * 1.5


def test_false_positive_rate_over_all_live_buckets_stays_within_1_5x_of_the_target() -> None:
    target, per_bucket, probes = 0.01, 20_000, 200_000
    buckets = BloomBuckets(bucket_ms=1000, expected_ids=per_bucket, fp_rate=target, max_filters=5)
    for b, ids in enumerate(fresh_ids(per_bucket * 5, 3)[i::5] for i in range(5)):
        for record_id in ids:
            buckets.add(record_id, b * 1000)
    rate = sum(buckets.might_contain(x) for x in fresh_ids(probes, 4)) / probes
    print(f"target={target} measured over 5 buckets={rate:.5f}")
    assert rate <= target * 1.5


def test_an_overfull_bucket_gets_another_filter_and_keeps_its_rate() -> None:
    buckets = BloomBuckets(bucket_ms=1000, expected_ids=1000, fp_rate=0.01, max_filters=1)
    ids = fresh_ids(3500, 5)
    for record_id in ids:
        buckets.add(record_id, 10)
    assert len(buckets.buckets[0]) == 4
    assert all(buckets.might_contain(x) for x in ids)
    rate = sum(buckets.might_contain(x) for x in fresh_ids(50_000, 6)) / 50_000
    assert rate <= 4 * 0.01 * 1.5  # one filter's rate per filter probed


# -- the deduplicator ------------------------------------------------------------------------------


def make(store: MemoryIdStore | None = None, **kw: object) -> Deduplicator:
    args: dict[str, object] = {"within_ms": 60_000, "expected_ids": 10_000, "fp_rate": 0.01}
    args.update(kw)
    return Deduplicator(store if store is not None else MemoryIdStore(), **args)  # type: ignore[arg-type]


def test_check_drops_copies_in_one_batch_and_across_batches() -> None:
    d = make()
    assert d.check([1, 2, 1, 3, 2], [0, 0, 5, 0, 0]) == [True, True, False, True, False]
    assert d.check([3, 4], [0, 0]) == [False, True]
    assert d.stats.duplicates == 3 and d.stats.fresh == 4


def test_duplicates_are_confirmed_without_a_round_trip_when_recent() -> None:
    store = MemoryIdStore()
    d = make(store)
    ids = fresh_ids(1000, 7)
    d.check(ids, [0] * 1000)
    d.prepare(1)
    writes = store.round_trips
    assert d.check(ids[:100], [0] * 100) == [False] * 100
    assert store.round_trips == writes  # the recent set answered


def test_ids_survive_a_restore_and_ids_recorded_after_the_checkpoint_do_not() -> None:
    """The rule that matters most: an ID recorded after the restored checkpoint is absent."""
    store = MemoryIdStore()
    d = make(store)
    before, after = fresh_ids(500, 8), fresh_ids(500, 9)
    d.check(before, [1000] * 500)
    d.prepare(1)
    state = d.snapshot()
    d.check(after, [2000] * 500)
    d.prepare(2)  # written to the store, tagged epoch 2, but checkpoint 2 never completes
    r = make(store)
    r.restore(state)
    assert r.check(before, [1000] * 500) == [False] * 500
    assert r.check(after, [2000] * 500) == [True] * 500


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_restored_deduplicator_agrees_with_a_reference_after_any_crash_sequence(
    data: st.DataObject,
) -> None:
    """Random runs of check/prepare/snapshot/crash/restore against a dict of what the restored
    history saw: no duplicate passes, no new ID is dropped."""
    _crash_sequences(data, MemoryIdStore(), steps=25, id_max=60, fp_rate=0.2, expected_ids=20)


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_with_writes_behind_a_restored_deduplicator_agrees_with_a_reference(
    data: st.DataObject,
) -> None:
    """The same with every write behind (slow, on its own thread, some still running when the
    task crashes: a dead run's late writes), small flushes and few recent IDs: the local sets
    must hold every ID whose write is not acknowledged, and a checkpoint counts only once its
    write is done."""
    _crash_sequences(
        data, SlowStore(), steps=25, id_max=60, fp_rate=0.2, expected_ids=20, behind=True
    )


class SlowStore(MemoryIdStore):
    """Writes after a short, random delay (a write behind still runs while the task goes on)."""

    def insert(self, *args: Any, **kwargs: Any) -> None:
        time.sleep(random.random() * 0.002)
        super().insert(*args, **kwargs)


def _crash_sequences(
    data: st.DataObject,
    store: MemoryIdStore,
    *,
    steps: int,
    id_max: int,
    fp_rate: float,
    expected_ids: int,
    empties: bool = False,
    behind: bool = False,
) -> None:
    """Drives a deduplicator through random check / checkpoint / crash (and, with ``empties``,
    store-restarted-empty) steps; every answer must agree with the restored history. With
    ``behind``, writes go on behind (``prepare_async``), and a checkpoint whose write is not
    done cannot be restored (it is not acknowledged)."""
    kw: dict[str, Any] = {"fp_rate": fp_rate, "expected_ids": expected_ids}
    if behind:
        kw.update(write_behind=True, flush_ids=3, recent_ids=4)
    d = make(store, **kw)  # many Bloom hits: store decides
    seen: set[int] = set()  # IDs of the current history
    # (state, history, its write behind) per prepared checkpoint
    snapshots: list[tuple[dict[str, Any], set[int], Future[None] | None]] = []
    checkpoint = 0
    actions = ["check"] * 3 + ["checkpoint", "crash"] + (["empty"] if empties else [])
    for _ in range(data.draw(st.integers(1, steps))):
        action = data.draw(st.sampled_from(actions))
        if action == "check":
            ids = data.draw(st.lists(st.integers(0, id_max), max_size=20))
            got = d.check(ids, [5000] * len(ids))
            want = []
            for x in ids:
                want.append(x not in seen)
                seen.add(x)
            assert got == want
        elif action == "checkpoint":
            checkpoint += 1
            write = d.prepare_async(checkpoint)
            snapshots.append((d.snapshot(), set(seen), write))
        elif action == "empty":
            _restart_empty(store)
        elif snapshots:
            # Recovery restores the latest completed checkpoint, or the one before it when that
            # is unusable. Checkpoints prepared after the restored one never complete (the
            # coordinator's ids only grow), so they are never restored later. A checkpoint
            # whose write behind is not done is not acknowledged: not complete either.
            usable = [i for i, (_s, _h, w) in enumerate(snapshots) if w is None or w.done()]
            if not usable:
                continue
            restored = data.draw(st.sampled_from(usable[-2:]))
            del snapshots[restored + 1 :]
            state, history, _write = snapshots[restored]
            d = make(store, **kw)  # the crashed one's write behind may still land
            d.restore(state)
            seen = set(history)


def test_gc_never_forgets_an_id_younger_than_the_horizon_and_deletes_old_buckets() -> None:
    store = MemoryIdStore()
    d = make(store, within_ms=10_000, bucket_ms=1000)
    d.check([1, 2, 3], [0, 5_500, 9_999])
    d.advance(15_000)  # cutoff 5000: bucket [0, 1000) goes
    assert d.check([2, 3], [5_500, 9_999]) == [False, False]
    d.prepare(1)
    d.commit(1)
    assert 0 not in store.data and 5000 in store.data


def test_records_older_than_the_horizon_follow_the_declared_policy() -> None:
    d = make(within_ms=1000, late="drop")
    d.advance(10_000)
    assert d.check([1], [8_000]) == [False]
    assert d.stats.late_dropped == 1
    p = make(within_ms=1000, late="pass")
    p.advance(10_000)
    assert p.check([1, 1], [8_000, 8_000]) == [True, True]  # unchecked, not recorded
    assert p.stats.late_passed == 2
    with pytest.raises(ValueError, match="late"):
        make(late="keep")


def test_stored_buckets_are_deleted_only_once_a_checkpoint_without_them_completed() -> None:
    store = MemoryIdStore()
    d = make(store, within_ms=1000, bucket_ms=1000)
    d.check([1], [0])
    d.prepare(1)
    d.advance(5000)
    d.commit(1)  # checkpoint 1 still had bucket 0: a restore of it needs the stored IDs
    assert 0 in store.data
    d.prepare(2)
    d.commit(2)
    assert 0 not in store.data


def test_a_flush_while_a_batch_is_decided_does_not_forget_a_known_copy() -> None:
    """Regression: a false positive recorded in the resolve loop flushed and rotated the
    recent-ID sets, so a copy found there a moment before was recorded as new."""
    d = make(recent_ids=4, flush_ids=2, fp_rate=0.4, expected_ids=2)
    seen = fresh_ids(3, 10)
    d.check(seen, [0] * 3)
    d.prepare(1)  # written; now only in the recent sets
    more = fresh_ids(40, 11)
    got = d.check([*more, seen[0]], [0] * 41)
    assert got[-1] is False


class GatedStore(MemoryIdStore):
    """Writes once ``gate`` opens (a store that is slow to answer); ``fail`` makes it raise."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.fail: Exception | None = None
        self.started: list[int] = []

    def insert(self, entries: Any, tag: bytes, **kwargs: Any) -> None:
        self.started.append(sum(len(ids) for ids in entries.values()))
        assert self.gate.wait(10)
        if self.fail is not None:
            raise self.fail
        super().insert(entries, tag, **kwargs)


def test_a_write_behind_lets_the_task_go_on_and_the_snapshot_waits_for_it() -> None:
    store = GatedStore()
    d = make(store, write_behind=True)
    ids = fresh_ids(300, 21)
    assert d.check(ids, [0] * 300) == [True] * 300
    write = d.prepare_async(1)
    assert write is not None and not write.done()  # the store has not answered
    state = d.snapshot()
    # meanwhile the task goes on: copies of the IDs being written are found without the store
    more = fresh_ids(50, 22)
    assert d.check([*ids[:100], *more], [0] * 150) == [False] * 100 + [True] * 50
    assert store.data == {} and d.acked == 0
    store.gate.set()
    write.result(timeout=10)
    assert d.acked == 1 and len(store.data[0]) == 300
    assert state["written"] == {d.run: 1}  # the snapshot relies on the write it waited for
    r = make(store)
    r.restore(state)
    assert r.check(ids[:10], [0] * 10) == [False] * 10


def test_one_write_at_most_is_behind() -> None:
    store = GatedStore()
    d = make(store, write_behind=True, flush_ids=10)
    d.check(fresh_ids(10, 23), [0] * 10)  # a flush: its write waits for the gate
    threading.Timer(0.2, store.gate.set).start()
    started = time.monotonic()
    d.check(fresh_ids(10, 24), [0] * 10)  # the next flush waits for the first write
    assert time.monotonic() - started >= 0.15
    assert store.started == [10, 10]
    d.prepare(1)  # and prepare waits for its own
    assert d.acked == 2 and sum(len(v) for v in store.data.values()) == 20


def test_a_failed_write_behind_fails_the_task_at_its_next_checkpoint() -> None:
    store = GatedStore()
    store.fail = ConnectionError("Redis went away")
    store.gate.set()
    d = make(store, write_behind=True)
    d.check(fresh_ids(5, 25), [0] * 5)
    write = d.prepare_async(1)
    assert write is not None
    with pytest.raises(ConnectionError):
        write.result(timeout=10)  # the snapshot upload fails: the checkpoint does not count
    with pytest.raises(ConnectionError):
        d.prepare_async(2)  # and the task fails at its next barrier, though nothing is pending


def test_a_failed_write_in_step_changes_nothing_and_a_retry_sends_the_same_ids() -> None:
    """Without writes behind (the consumer-side library), a failed write leaves the pending IDs
    as they were: the application's next commit() writes them."""
    store = GatedStore()
    store.gate.set()
    store.fail = ConnectionError("Redis went away")
    d = make(store)
    ids = fresh_ids(5, 26)
    d.check(ids, [0] * 5)
    with pytest.raises(ConnectionError):
        d.prepare(1)
    assert d.pending_set == set(ids) and d.batches == d.acked == 0
    store.fail = None
    d.prepare(1)
    assert sorted(store.data[0]) == sorted(ids) and d.batches == d.acked == 1


def test_a_restore_of_an_older_checkpoint_after_gc_treats_gone_buckets_as_late() -> None:
    """Regression: commit(2) deleted stored buckets that a fallback restore of checkpoint 1
    (the newest one corrupt) still pointed at; a copy then passed unchecked."""
    store = MemoryIdStore()
    d = make(store, within_ms=10_000, bucket_ms=1000)
    d.check([42], [5000])
    d.prepare(1)
    older = d.snapshot()
    d.advance(16_000)
    d.prepare(2)
    d.commit(2)  # bucket 5000 deleted from the store
    r = make(store, within_ms=10_000, bucket_ms=1000)
    r.restore(older)
    assert r.check([42], [5500]) == [False]  # late (dropped, counted), not passed as new
    assert r.stats.late_dropped == 1


def test_restore_refuses_a_checkpoint_taken_with_another_bucket_or_horizon() -> None:
    d = make(within_ms=10_000, bucket_ms=1000)
    d.prepare(1)
    other = make(within_ms=10_000, bucket_ms=2000)
    with pytest.raises(ValueError, match="bucket_ms=1000"):
        other.restore(d.snapshot())


# -- lost store data: the write markers ----------------------------------------------------------


def _restart_empty(store: MemoryIdStore) -> None:
    """What Redis without persistence looks like after a restart."""
    store.data.clear()
    store.written.clear()
    store.gc_mark = -(2**63)


def _written_then_restored(store: MemoryIdStore) -> tuple[Deduplicator, list[int]]:
    d = make(store)
    ids = fresh_ids(500, 12)
    d.check(ids, [1000] * 500)
    d.prepare(1)
    r = make(store)
    r.restore(d.snapshot())
    return r, ids


def test_restore_refuses_when_the_store_restarted_empty_after_the_checkpoint() -> None:
    """Issue 17: the restored filters say "maybe seen", an empty store says "absent", and every
    copy of a record before the crash passed as a Bloom false positive."""
    store = MemoryIdStore()
    d = make(store)
    d.check(fresh_ids(500, 12), [1000] * 500)
    d.prepare(1)
    state = d.snapshot()
    _restart_empty(store)
    with pytest.raises(RedisDataLost, match="lost record IDs this job relies on") as caught:
        make(store).restore(state)
    assert caught.value.lost == {d.run: (1, 0)}
    assert "EOSFLOW_DEDUP_ON_LOST_IDS=accept" in str(caught.value)


def test_restore_refuses_when_a_failover_lost_the_last_batches_before_the_checkpoint() -> None:
    """A promoted replica that missed the last writes: the marker is behind, not gone."""
    store = MemoryIdStore()
    d = make(store, flush_ids=100)
    ids = fresh_ids(350, 13)
    for start in range(0, 350, 100):
        d.check(ids[start : start + 100], [1000] * len(ids[start : start + 100]))
    d.prepare(1)  # three batches flushed on the way, the fourth now
    state = d.snapshot()
    assert state["written"] == {d.run: 4}
    store.written[d.run] = 3  # the replica had the first three
    with pytest.raises(RedisDataLost, match="counts 3"):
        make(store).restore(state)


def test_a_first_start_and_a_checkpoint_that_wrote_nothing_expect_nothing() -> None:
    store = MemoryIdStore()
    d = make(store)
    d.restore(None)  # a first start, on an empty store
    assert d.check([1, 2], [0, 0]) == [True, True]
    idle = make(store)
    idle.prepare(1)  # nothing to write
    _restart_empty(store)
    make(store).restore(idle.snapshot())  # relied on nothing: fine


def test_a_lookup_refuses_when_the_store_restarted_empty_before_this_run_wrote() -> None:
    store = MemoryIdStore()
    r, ids = _written_then_restored(store)
    _restart_empty(store)  # after the restore's check, before the first write of this run
    with pytest.raises(RedisDataLost):
        r.check(ids[:10], [1000] * 10)  # Bloom hits: the store must answer them


def test_a_lookup_refuses_when_the_store_restarted_empty_after_this_run_wrote() -> None:
    store = MemoryIdStore()
    r, ids = _written_then_restored(store)
    r.check(fresh_ids(100, 14), [2000] * 100)
    r.prepare(2)  # this run's first batch: now its own marker is watched
    _restart_empty(store)
    with pytest.raises(RedisDataLost):
        r.check(ids[:10], [1000] * 10)


def test_an_insert_into_a_store_that_lost_earlier_batches_does_not_count() -> None:
    """Otherwise the new batch would raise the marker again, and a restore would trust it."""
    store = MemoryIdStore()
    d = make(store)
    d.check(fresh_ids(10, 15), [0] * 10)
    d.prepare(1)
    state = d.snapshot()
    _restart_empty(store)
    d.check(fresh_ids(10, 16), [0] * 10)
    with pytest.raises(RedisDataLost):
        d.prepare(2)
    assert store.written == {}
    with pytest.raises(RedisDataLost):
        make(store).restore(state)


def test_a_checkpoint_without_new_ids_finds_a_store_that_lost_them() -> None:
    store = MemoryIdStore()
    d = make(store)
    d.check([1, 2, 3], [0, 0, 0])
    d.prepare(1)
    _restart_empty(store)
    with pytest.raises(RedisDataLost):
        d.prepare(2)


def test_on_lost_accept_goes_on_without_the_lost_ids_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = MemoryIdStore()
    d = make(store)
    d.check(fresh_ids(10, 17), [0] * 10)
    d.prepare(1)
    state = d.snapshot()
    _restart_empty(store)
    r = make(store, on_lost="accept")
    r.restore(state)
    assert "going on without lost IDs (on_lost=accept)" in caplog.text
    r.check(fresh_ids(10, 18), [0] * 10)
    r.prepare(2)  # counts again from here
    make(store).restore(r.snapshot())
    with pytest.raises(DedupConfigError, match="on_lost"):
        make(on_lost="ignore")


def test_a_snapshot_from_before_the_write_markers_restores() -> None:
    d = make()
    d.check([1], [0])
    d.prepare(1)
    state = d.snapshot()
    del state["written"]
    make().restore(state)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_a_store_that_restarts_empty_never_lets_a_copy_through_silently(
    data: st.DataObject,
) -> None:
    """Random check/checkpoint/crash/restart-empty sequences: every answer agrees with the
    history, until the deduplicator refuses with RedisDataLost (then the task would fail)."""
    store = MemoryIdStore()
    with contextlib.suppress(RedisDataLost):
        _crash_sequences(
            data, store, steps=30, id_max=80, fp_rate=0.3, expected_ids=10, empties=True
        )
