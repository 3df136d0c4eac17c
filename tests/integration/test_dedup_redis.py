"""The Redis ID store and the deduplicator on a real Redis: round trips per batch, restore
against stored tags, GC of stored buckets, and fail-closed behaviour when Redis is down."""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator

import pytest
import redis

from dedup.core import Deduplicator
from dedup.errors import DedupConfigError
from dedup.store import RedisIdStore, RedisUnavailable, encode_tag, redis_client

pytestmark = pytest.mark.integration


@pytest.fixture
def store(redis_url: str) -> Iterator[RedisIdStore]:
    client = redis_client(redis_url)
    s = RedisIdStore(client, f"test:dedup:{uuid.uuid4().hex[:8]}")
    yield s
    s.clear()
    client.close()


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(127) for _ in range(n)]


def test_lookup_and_insert_take_one_round_trip_per_batch(store: RedisIdStore) -> None:
    batch = ids(5000, 1)
    store.insert({0: batch[:2500], 60_000: batch[2500:]}, encode_tag(7, 3))
    assert store.round_trips == 1
    found = store.lookup([0, 60_000, 120_000], batch + ids(10, 2))
    assert store.round_trips == 2
    assert all(t == [encode_tag(7, 3)] for t in found[:5000])
    assert all(t == [] for t in found[5000:])
    assert sorted(dict(store.scan_bucket(0))) == sorted(batch[:2500])


def test_deduplicator_on_redis_drops_copies_across_a_restore_and_forgets_later_ids(
    store: RedisIdStore,
) -> None:
    d = Deduplicator(store, within_ms=60_000, expected_ids=100, fp_rate=0.3)
    before, after = ids(2000, 3), ids(2000, 4)
    assert all(d.check(before, [1000] * 2000))
    d.prepare(1)
    state = d.snapshot()
    assert all(d.check(after, [2000] * 2000))
    d.prepare(2)  # in Redis with epoch 2; checkpoint 2 never completes
    restored = Deduplicator(store, within_ms=60_000, expected_ids=100, fp_rate=0.3)
    restored.restore(state)
    assert not any(restored.check(before, [1000] * 2000))
    assert all(restored.check(after, [2000] * 2000))
    # the filters are full (fp 0.3 over 20 filters): the store answered for many of them
    assert restored.stats.lookups > 500 and restored.stats.false_positives > 500


def test_stored_buckets_past_the_horizon_are_deleted_on_commit(store: RedisIdStore) -> None:
    d = Deduplicator(store, within_ms=10_000, bucket_ms=1000)
    d.check(ids(10, 5), [0] * 5 + [20_000] * 5)
    d.prepare(1)
    d.advance(25_000)
    d.prepare(2)
    d.commit(2)
    assert store.buckets() == [20_000]


def test_lookup_fails_closed_when_redis_is_down() -> None:
    """Nothing is let through unchecked: the store retries, then raises."""
    port = _free_port()
    client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.2)
    clock = iter(range(0, 1000, 10))
    sleeps: list[float] = []
    s = RedisIdStore(
        client, "test:down", give_up_s=60, sleep=sleeps.append, clock=lambda: float(next(clock))
    )
    with pytest.raises(RedisUnavailable, match="not let through unchecked"):
        s.lookup([0], [1, 2, 3])
    assert len(sleeps) >= 5 and sleeps[1] > sleeps[0]  # backed off, then gave up


def test_redis_client_says_how_to_configure_a_missing_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EOSFLOW_REDIS_URL", raising=False)
    with pytest.raises(DedupConfigError, match="EOSFLOW_REDIS_URL"):
        redis_client(None)
    with pytest.raises(DedupConfigError, match="not a Redis URL"):
        redis_client("http://example:6379")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
