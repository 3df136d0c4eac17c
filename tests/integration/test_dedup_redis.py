"""The Redis ID store and the deduplicator on a real Redis: round trips per batch, restore
against stored tags, GC of stored buckets, fail-closed behaviour when Redis is down, a Redis
that restarted without its data, and the start-up check of the server."""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from dedup.core import Deduplicator
from dedup.errors import DedupConfigError, RedisDataLost
from dedup.server import check_redis
from dedup.store import RedisIdStore, RedisUnavailable, encode_tag, redis_client
from processor.testing.redis import kill_redis, private_redis, restart_redis

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
    # The client the store is given in production: without redis-py's own retries (redis-py 6+
    # retries 3 times with backoff, 25 s of this test), so each attempt is the store's.
    client = redis_client(f"redis://127.0.0.1:{port}/0", timeout_s=0.2)
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


def _written_on(url: str, prefix: str, n: int = 2000) -> tuple[dict, list[int]]:
    """A deduplicator's snapshot after it wrote ``n`` IDs to the Redis at ``url``."""
    client = redis_client(url)
    d = Deduplicator(RedisIdStore(client, prefix), within_ms=60_000, expected_ids=100)
    seen = ids(n, 20)
    assert all(d.check(seen, [1000] * n))
    d.prepare(1)
    client.close()
    return d.snapshot(), seen


def test_a_redis_restarted_empty_is_refused_at_restore_and_by_a_lookup(tmp_path: Path) -> None:
    """Issue 17: a Redis that came back empty answered "absent" for every ID, and the restored
    filters' hits passed as false positives: every copy of a record seen before got through."""
    server = private_redis(tmp_path / "redis")
    prefix = "test:lost"
    state, seen = _written_on(server.url, prefix)
    client = redis_client(server.url)
    live = Deduplicator(RedisIdStore(client, prefix), within_ms=60_000, expected_ids=100)
    live.restore(state)  # the data is there: trusted
    kill_redis(server)
    server = restart_redis(server, empty=True)
    try:
        with pytest.raises(RedisDataLost) as caught:  # mid-run: the first lookup after it
            live.check(seen[:50], [1000] * 50)
        message = str(caught.value)
        print(message)
        assert f"on Redis at {server.url}" in message
        assert f"{prefix}:written is gone" in message
        assert "appendonly yes" in message and "EOSFLOW_DEDUP_ON_LOST_IDS=accept" in message
        restored = Deduplicator(RedisIdStore(client, prefix), within_ms=60_000, expected_ids=100)
        with pytest.raises(RedisDataLost):
            restored.restore(state)
    finally:
        client.close()
        kill_redis(server, clean=True)


def test_a_batch_written_after_the_loss_does_not_make_the_marker_vouch_again(
    tmp_path: Path,
) -> None:
    server = private_redis(tmp_path / "redis")
    state, _seen = _written_on(server.url, "test:lost")
    client = redis_client(server.url)
    d = Deduplicator(RedisIdStore(client, "test:lost"), within_ms=60_000, expected_ids=100)
    d.restore(state)
    kill_redis(server)
    server = restart_redis(server, empty=True)
    try:
        d.check(ids(10, 21), [1000] * 10)  # surely new: no lookup
        with pytest.raises(RedisDataLost):
            d.prepare(2)  # the insert's script sees the restored marker gone
        assert client.hgetall("test:lost:written") == {}  # and did not count the new batch
    finally:
        client.close()
        kill_redis(server, clean=True)


def test_a_replica_that_missed_the_last_batch_is_refused(store: RedisIdStore) -> None:
    """A failover: the promoted replica has the older writes, not the last ones."""
    d = Deduplicator(store, within_ms=60_000, expected_ids=100, flush_ids=100)
    d.check(ids(100, 22), [1000] * 100)  # batch 1 (flushed: flush_ids)
    d.check(ids(50, 23), [1000] * 50)
    d.prepare(1)  # batch 2
    store.client.hset(f"{store.prefix}:written", str(d.run), 1)  # as the replica has it
    with pytest.raises(RedisDataLost, match="counts 1"):
        Deduplicator(store, within_ms=60_000).restore(d.snapshot())


def test_a_redis_restarted_with_its_data_is_trusted_and_drops_the_copies(tmp_path: Path) -> None:
    server = private_redis(tmp_path / "redis")
    state, seen = _written_on(server.url, "test:kept")
    kill_redis(server, clean=True)  # a clean shutdown writes the append-only file out
    server = restart_redis(server, empty=False)
    client = redis_client(server.url)
    try:
        d = Deduplicator(RedisIdStore(client, "test:kept"), within_ms=60_000, expected_ids=100)
        d.restore(state)
        assert not any(d.check(seen, [1000] * len(seen)))
        assert d.stats.lookups > 0  # the filters are full: Redis answered
    finally:
        client.close()
        kill_redis(server, clean=True)


# -- the start-up check of the server -------------------------------------------------------------


def test_check_redis_refuses_an_evicting_policy_unless_allowed_and_warns_without_aof(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = private_redis(tmp_path / "redis")
    client = redis.Redis.from_url(server.url)
    try:
        check_redis(server.url, what="dedup step 'unique'", source="EOSFLOW_REDIS_URL")
        assert "appendonly" not in caplog.text  # the embedded Redis writes an AOF
        client.config_set("maxmemory-policy", "allkeys-lru")
        with pytest.raises(DedupConfigError) as caught:
            check_redis(server.url, what="dedup step 'unique'", source="EOSFLOW_REDIS_URL")
        print(caught.value)
        assert "maxmemory-policy allkeys-lru" in str(caught.value)
        assert "CONFIG SET maxmemory-policy noeviction" in str(caught.value)
        with caplog.at_level(logging.WARNING):
            check_redis(server.url, what="x", source="y", allow_eviction=True)
        assert "may evict record IDs" in caplog.text
        client.config_set("maxmemory-policy", "volatile-lru")  # our keys have no TTL
        client.config_set("appendonly", "no")
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            check_redis(server.url, what="dedup step 'unique'", source="EOSFLOW_REDIS_URL")
        assert "appendonly=no: a Redis restart loses the record IDs" in caplog.text
    finally:
        client.close()
        kill_redis(server, clean=True)


def test_check_redis_names_the_address_and_the_variable_in_seconds_when_unreachable() -> None:
    url = f"redis://127.0.0.1:{_free_port()}/0"
    started = time.monotonic()
    with pytest.raises(DedupConfigError) as caught:
        check_redis(url, what="dedup step 'unique'", source="EOSFLOW_REDIS_URL")
    assert time.monotonic() - started < 6
    assert str(caught.value).startswith(
        "dedup step 'unique' keeps record IDs in Redis, which did not answer at "
        f"{url} (EOSFLOW_REDIS_URL) within 5s"
    )


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
