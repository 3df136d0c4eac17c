"""The dedup IDs a savepoint carries (:mod:`dedup.savepoint`), on a real Redis: copied out with
the state that relies on them, the keys deleted (``eosflow reset``), written back; the restored
deduplicator then finds every ID it found before, and no ``RedisDataLost``."""

from __future__ import annotations

import uuid

import pytest

from dedup.core import Deduplicator
from dedup.errors import RedisDataLost
from dedup.savepoint import load_ids, saved_ids
from dedup.store import RedisIdStore, redis_client

BASE = 1_700_000_000_000


def _dedup(client: object, prefix: str) -> Deduplicator:
    return Deduplicator(RedisIdStore(client, prefix), within_ms=60_000, bucket_ms=10_000)


def _delete(client: object, prefix: str) -> None:
    keys = list(client.scan_iter(match=f"{prefix}:*"))  # type: ignore[attr-defined]
    if keys:
        client.delete(*keys)  # type: ignore[attr-defined]


def test_saved_ids_restore_a_dedup_state_after_its_keys_were_deleted(redis_url: str) -> None:
    client = redis_client(redis_url)
    prefix = f"eosflow:sp-{uuid.uuid4().hex[:8]}:dedup:unique:0"
    dedup = _dedup(client, prefix)
    dedup.restore(None)
    first = list(range(1, 3001))
    assert all(dedup.check(first, [BASE + i * 20 for i in range(3000)]))
    dedup.prepare(1)
    dedup.commit(1)
    dedup.advance(BASE + 120_000)  # buckets leave the horizon: GC after checkpoint 2
    assert all(dedup.check([5000], [BASE + 119_000]))
    dedup.prepare(2)
    state = dedup.snapshot()
    dedup.commit(2)
    # A crashed later run wrote IDs too: not in the state's lineage, so not saved.
    later = _dedup(client, prefix)
    later.restore(state)
    assert later.check([6000], [BASE + 119_500]) == [True]
    later.prepare(3)

    saved = saved_ids(client, prefix, state)
    entries = sum(len(b) for e in saved["prefixes"] for b in e["buckets"].values()) // 32
    assert entries == 1  # 5000: every first ID is older than the horizon; 6000 is not its run
    _delete(client, prefix)  # eosflow reset
    with pytest.raises(RedisDataLost):
        _dedup(client, prefix).restore(state)
    assert load_ids(client, saved) == 1
    assert load_ids(client, saved) == 1  # idempotent

    restored = _dedup(client, prefix)
    restored.restore(state)
    assert restored.check([5000, 6000, 7000], [BASE + 119_000] * 3) == [False, True, True]
    client.close()


def test_saved_ids_keep_the_ids_a_newer_checkpoints_gc_deleted(redis_url: str) -> None:
    """A savepoint of a running job: the job goes on, its GC deletes buckets the savepoint
    still needs and raises the GC mark. Written back, the IDs are there again and the mark is
    lowered: a restore checks them instead of treating them as late."""
    client = redis_client(redis_url)
    prefix = f"eosflow:sp-{uuid.uuid4().hex[:8]}:dedup:unique:1"
    dedup = _dedup(client, prefix)
    dedup.restore(None)
    assert all(dedup.check([1, 2, 3], [BASE, BASE + 5_000, BASE + 15_000]))
    dedup.prepare(1)
    state = dedup.snapshot()
    dedup.commit(1)
    saved = saved_ids(client, prefix, state)
    dedup.advance(BASE + 100_000)
    dedup.prepare(2)
    dedup.commit(2)  # deletes the buckets below BASE + 40 s, raises the GC mark
    assert RedisIdStore(client, prefix).buckets() == []
    load_ids(client, saved)
    restored = _dedup(client, prefix)
    restored.restore(state)
    assert restored.cutoff < BASE  # not floored to the GC mark: the IDs are back
    assert restored.check([1, 2, 3, 4], [BASE, BASE + 5_000, BASE + 15_000, BASE]) == [
        False,
        False,
        False,
        True,
    ]
    client.close()
