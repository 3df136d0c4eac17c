"""The dedup step across a change of parallelism, on a real Redis (dedup.rescale).

IDs recorded by the subtasks of one shape must be found by the subtasks of the next, which
read the old prefixes (inherited, read-only) and judge their tags by the merged lineage. The
filters are tiny and their false-positive rate high (as in tests/e2e/test_dedup.py), so that
fresh IDs really reach Redis and a wrong lineage rule or a missing inherited lookup shows.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from dedup.errors import RedisDataLost
from dedup.ids import value_id
from dedup.rescale import dedup_prefix, merge_dedup_states, referenced_prefixes, sweep_retired
from dedup.store import redis_client
from processor.contracts import SinkContext
from processor.dataflow import Step
from processor.runtime.operators.dedup_step import DedupOperator
from processor.wire import key_owner, shared_keys

pytestmark = pytest.mark.integration

G = 128
STEP = "unique"
WITHIN, BUCKET = 120_000, 60_000
Record = tuple[Any, Any, int]


@pytest.fixture
def client(redis_url: str) -> Iterator[Any]:
    c = redis_client(redis_url)
    yield c
    c.close()


@pytest.fixture
def job(client: Any) -> Iterator[str]:
    name = f"rescale-{uuid.uuid4().hex[:8]}"
    yield name
    keys = list(client.scan_iter(match=f"eosflow:{name}:*"))
    if keys:
        client.delete(*keys)


def _op(redis_url: str, job: str, subtask: int, parallelism: int, epoch: int, keyed: bool) -> Any:
    params = {
        "id": lambda v: v["id"],
        "within_ms": WITHIN,
        "bucket_ms": BUCKET,
        "late": "drop",
        "expected_ids": 300,
        "fp_rate": 0.4,
        "redis_url": redis_url,
    }
    op = DedupOperator(Step(STEP, "dedup", ("src",), keyed, params))
    op.open(SinkContext(job, STEP, subtask, parallelism, 1, epoch=epoch))
    return op


class Shape:
    """The subtasks of one shape epoch, fed as the channels would feed them."""

    def __init__(self, url: str, job: str, parallelism: int, epoch: int, keyed: bool) -> None:
        self.parallelism, self.epoch, self.keyed = parallelism, epoch, keyed
        self.ops = [_op(url, job, i, parallelism, epoch, keyed) for i in range(parallelism)]
        self.prefixes = [dedup_prefix(job, STEP, i, epoch) for i in range(parallelism)]

    def feed(self, records: list[Record]) -> list[Record]:
        """Routes records by key group (the hex of the ID for a global dedup) and returns what
        passed; one batch per subtask."""
        parts: list[list[Record]] = [[] for _ in self.ops]
        for record in records:
            parts[key_owner(str(record[0]).encode(), self.parallelism, G)].append(record)
        out: list[Record] = []
        for op, part in zip(self.ops, parts, strict=True):
            if part:
                out += op.process(part)
        return out

    def checkpoint(self, checkpoint_id: int) -> list[dict[str, Any]]:
        for op in self.ops:
            op.prepare(checkpoint_id)
        return [op.snapshot() for op in self.ops]

    def rescale(self, url: str, job: str, states: list[dict[str, Any]], new_p: int) -> Shape:
        new = Shape(url, job, new_p, self.epoch + 1, self.keyed)
        sources = shared_keys(self.parallelism, G, new_p, G)
        for i, op in enumerate(new.ops):
            op.restore(merge_dedup_states([(self.prefixes[j], states[j]) for j in sources[i]]))
        self.close()
        return new

    def close(self) -> None:
        for op in self.ops:
            op.close()

    def stats(self, name: str) -> int:
        return sum(getattr(op.dedup.stats, name) for op in self.ops)


def _records(n: int, seed: int, keyed: bool) -> list[Record]:
    """Fresh records: unique IDs, timestamps over two buckets."""
    rng = random.Random(seed)
    out: list[Record] = []
    for _ in range(n):
        event = {"id": rng.getrandbits(64), "n": seed}
        ts = rng.randrange(0, 2 * BUCKET)
        key = f"page-{rng.randrange(500)}" if keyed else format(value_id(event["id"]), "x")
        out.append((key, event, ts))
    return out


def _sorted(records: list[Record]) -> list[tuple[int, int]]:
    """``(id, ts)`` of the records, sorted (the output of a global dedup is unkeyed)."""
    return sorted((v["id"], t) for _k, v, t in records)


def _copies(records: list[Record]) -> list[Record]:
    """Re-sent copies: same key and ID, another payload field and a later timestamp."""
    return [(k, {**v, "resent": True}, min(t + 1000, 2 * BUCKET - 1)) for k, v, t in records]


@pytest.mark.parametrize(
    ("shapes", "keyed"),
    [([2, 3], True), ([3, 1], True), ([1, 2, 1], True), ([2, 3], False)],
    ids=["2-3", "3-1", "1-2-1", "2-3-global"],
)
def test_ids_of_old_subtasks_drop_their_copies_when_the_parallelism_changes(
    redis_url: str, job: str, shapes: list[int], keyed: bool
) -> None:
    shape = Shape(redis_url, job, shapes[0], 0, keyed)
    seen: list[Record] = []
    replayed = 0
    for n, new_p in enumerate([*shapes[1:], None]):
        if n:  # copies of every record of the earlier shapes are dropped
            copies = _copies(seen)
            trips = [op.dedup.store.round_trips for op in shape.ops]
            assert shape.feed(copies) == [], f"shape {n}: copies of older IDs passed"
            # one batch per subtask, one round trip per batch (own and inherited prefixes)
            trips = [op.dedup.store.round_trips - t for op, t in zip(shape.ops, trips, strict=True)]
            assert trips == [1] * len(shape.ops)
            # all but the replayed lost epoch (in this run's memory) are resolved in Redis
            assert shape.stats("lookups") >= len(copies) - replayed
        fresh = _records(1500, seed=10 * n + 1, keyed=keyed)
        assert _sorted(shape.feed(fresh)) == _sorted(fresh)
        assert shape.feed(_copies(fresh)) == []
        seen += fresh
        states = shape.checkpoint(n + 1)
        # after the checkpoint: recorded in Redis (epoch n + 2), but lost with the old shape
        after = _records(1500, seed=10 * n + 2, keyed=keyed)
        assert _sorted(shape.feed(after)) == _sorted(after)
        shape.checkpoint(n + 2)  # never completes: the next shape restores checkpoint n + 1
        if new_p is None:
            break
        shape = shape.rescale(redis_url, job, states, new_p)
        # replayed after the restore: recorded by a run of the old shape after the checkpoint,
        # so the entries the new shape finds in the inherited prefixes do not count
        assert _sorted(shape.feed(after)) == _sorted(after), "records of a lost epoch were dropped"
        seen += after
        replayed = len(after)
        assert shape.stats("false_positives") > 100  # the store really decided
    shape.close()


def test_inherited_prefixes_retire_after_the_horizon_and_the_sweep_deletes_the_rest(
    redis_url: str, job: str, client: Any
) -> None:
    old = Shape(redis_url, job, 2, 0, True)
    assert old.feed(_records(800, seed=1, keyed=True))
    states = old.checkpoint(1)
    other = f"eosflow:{job}:dedup:{STEP}2:0"  # another step whose name starts the same
    client.set(f"{other}:gc", 0)
    new = old.rescale(redis_url, job, states, 3)
    assert new.feed(_records(800, seed=2, keyed=True))
    snaps = new.checkpoint(2)
    assert set().union(*map(referenced_prefixes, snaps)) == set(old.prefixes)
    assert all(s["version"] == 2 for s in snaps)
    # the cut-off passes bucket 0 only: bucket 60,000 of the old prefixes is still live
    for op in new.ops:
        op.on_watermark(WITHIN + BUCKET)
    assert set().union(*map(referenced_prefixes, new.checkpoint(3))) == set(old.prefixes)
    for op in new.ops:
        op.on_watermark(WITHIN + 2 * BUCKET)
    retired = new.checkpoint(4)
    assert [referenced_prefixes(s) for s in retired] == [set()] * 3
    assert all(s["version"] == 1 and "inherited" not in s for s in retired)

    def keys(prefix: str) -> set[bytes]:
        return set(client.scan_iter(match=f"{prefix}:*"))

    old_keys = [keys(p) for p in old.prefixes]
    new_keys = set().union(*(keys(p) for p in new.prefixes))
    assert all(old_keys) and new_keys
    # a checkpoint retained still references prefix 0: only prefix 1 goes
    assert sweep_retired(client, job, STEP, {old.prefixes[0]}, 1) == len(old_keys[1])
    assert keys(old.prefixes[0]) == old_keys[0] and not keys(old.prefixes[1])
    assert sweep_retired(client, job, STEP, set(), 1) == len(old_keys[0])
    assert not keys(old.prefixes[0])
    # the current epoch's prefixes and another step's keys are never touched
    assert set().union(*(keys(p) for p in new.prefixes)) == new_keys
    assert client.exists(f"{other}:gc")
    assert sweep_retired(client, job, STEP, set(), 1) == 0
    new.close()


def test_an_inherited_prefix_that_lost_its_ids_is_refused_at_restore_and_in_a_lookup(
    redis_url: str, job: str, client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = Shape(redis_url, job, 2, 0, True)
    records = _records(800, seed=3, keyed=True)
    assert old.feed(records)
    states = old.checkpoint(1)
    old.close()
    saved = {k: client.dump(k) for k in client.scan_iter(match=f"{old.prefixes[1]}:*")}
    client.delete(*saved)  # Redis restarted without the keys of old subtask 1
    new = Shape(redis_url, job, 1, 1, True)
    merged = merge_dedup_states(list(zip(old.prefixes, states, strict=True)))
    with pytest.raises(RedisDataLost, match=old.prefixes[1]):
        new.ops[0].restore(merged)
    for key, blob in saved.items():  # it comes back with its data: the restore goes on
        client.restore(key, 0, blob)
    new.ops[0].restore(merged)
    client.delete(*saved)  # lost while the new shape runs: the next lookup refuses
    with pytest.raises(RedisDataLost, match=old.prefixes[1]):
        new.feed(_copies(records))
    with pytest.raises(RedisDataLost, match=old.prefixes[1]):  # and so does an idle checkpoint
        new.ops[0].prepare(2)
    new.close()
    monkeypatch.setenv("EOSFLOW_DEDUP_ON_LOST_IDS", "accept")
    accepting = Shape(redis_url, job, 1, 1, True)
    accepting.ops[0].restore(merged)  # logged; the copies whose IDs were lost pass once
    passed = accepting.feed(_copies(records))
    assert passed and len(passed) < len(records)  # old subtask 0's IDs are still found
    accepting.close()


def test_epoch_zero_keeps_the_prefix_of_jobs_that_never_changed_parallelism(
    redis_url: str, job: str
) -> None:
    shape = Shape(redis_url, job, 2, 0, True)
    assert [op.dedup.store.prefix for op in shape.ops] == [
        f"eosflow:{job}:dedup:{STEP}:0",
        f"eosflow:{job}:dedup:{STEP}:1",
    ]
    shape.close()
    later = Shape(redis_url, job, 2, 3, True)
    assert later.ops[1].dedup.store.prefix == f"eosflow:{job}:dedup:{STEP}:e3.1"
    later.close()
