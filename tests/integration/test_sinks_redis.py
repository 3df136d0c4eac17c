"""Integration tests for sinks.redis against a real Redis (the ``redis_url`` fixture).

Every test writes under its own job name and key prefix, so tests share the server, never keys.
"""

from __future__ import annotations

import logging
import pickle
import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from processor.contracts import Sink, SinkContext, SinkWriter
from processor.embedded._process import free_port, stop
from processor.embedded.servers import start_redis
from processor.errors import (
    ConfigError,
    DefinitionError,
    InfrastructureError,
    SerializationError,
    SnapshotError,
)
from processor.snapshot import codec
from processor.testing.redis import private_redis
from sinks.redis import OPERATIONS, RedisSink, RedisSinkWriter


class Crash(Exception):
    """Stands for a SIGKILL at a fault point."""


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def job() -> str:
    return f"job-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def p(job: str) -> str:
    """Key prefix of this test's targets."""
    return f"test:{job}"


def context(job: str, subtask: int = 0, generation: int = 1, **kw: Any) -> SinkContext:
    return SinkContext(
        job=job, step="out", subtask=subtask, parallelism=2, generation=generation, **kw
    )


def epoch(writer: RedisSinkWriter, checkpoint_id: int, values: list[Any]) -> Any:
    """Writes one epoch in two batches and prepares it."""
    writer.write(values[: len(values) // 2])
    writer.write(values[len(values) // 2 :])
    return writer.prepare(checkpoint_id)


def staged_keys(r: redis.Redis, job: str) -> list[bytes]:
    return sorted(r.scan_iter(match=f"eosflow:sink:{job}:*:stage:*"))


def lrange(r: redis.Redis, key: str) -> list[Any]:
    return [orjson.loads(v) for v in r.lrange(key, 0, -1)]


# -- two-phase commit ----------------------------------------------------------------------------


def test_nothing_is_visible_when_epoch_is_written_and_prepared_but_not_committed(
    r: redis.Redis, redis_url: str, job: str, p: str
) -> None:
    writer = RedisSink("list", key=f"{p}:out", url=redis_url, chunk_ops=2).open(context(job))
    writer.write([1, 2, 3])  # spills a chunk to the staging hash
    assert r.exists(f"{p}:out") == 0
    committable = writer.prepare(5)
    assert committable == {"key": committable["key"], "chunks": 1, "ops": 3}
    assert committable["key"].startswith(f"eosflow:sink:{job}:out:0:stage:g1-")
    assert r.exists(f"{p}:out") == 0
    assert r.hget(writer.guard_key, "epoch") is None
    writer.commit(5, committable)
    assert lrange(r, f"{p}:out") == [1, 2, 3]
    assert r.hget(writer.guard_key, "epoch") == b"5"
    assert staged_keys(r, job) == []
    assert r.smembers(writer.registry_key) == set()


def test_values_round_trip_in_order_when_epochs_span_many_chunks(
    r: redis.Redis, redis_url: str, job: str, p: str
) -> None:
    writer = RedisSink("list", key=f"{p}:out", url=redis_url, chunk_ops=1000).open(context(job))
    first = [{"n": i, "user": f"u{i % 7}"} for i in range(25_000)]
    for i in range(0, len(first), 700):
        writer.write(first[i : i + 700])
    c1 = writer.prepare(1)
    assert c1["chunks"] == 18 and c1["ops"] == 25_000  # a chunk: the writes that reached 1000
    writer.commit(1, c1)
    writer.commit(2, epoch(writer, 2, ["text", b"bytes", 1.5, None, [1, [2]]]))
    got = r.lrange(f"{p}:out", 0, -1)
    assert [orjson.loads(v) for v in got[:25_000]] == first
    assert got[25_000:] == [b"text", b"bytes", b"1.5", b"null", b"[1,[2]]"]


def test_commit_does_nothing_when_called_twice(
    r: redis.Redis, redis_url: str, job: str, p: str
) -> None:
    writer = RedisSink("list", key=f"{p}:out", url=redis_url).open(context(job))
    committable = epoch(writer, 1, ["a", "b"])
    writer.commit(1, committable)
    writer.commit(1, committable)
    writer.recover([(1, committable)])
    assert r.lrange(f"{p}:out", 0, -1) == [b"a", b"b"]


def test_replayed_epoch_is_a_no_op_when_increments_are_committed_again_after_restart(
    r: redis.Redis, redis_url: str, job: str, p: str
) -> None:
    """A duplicate commit of an increment would double count: the guard makes it a no-op."""
    sink = RedisSink("incr", key=f"{p}:amount", field=lambda c: c[0], value=lambda c: c[1],
                     url=redis_url)  # fmt: skip
    before = sink.open(context(job, generation=1))
    c1 = epoch(before, 1, [("a", 5), ("b", 1), ("a", 2)])
    c2 = epoch(before, 2, [("b", 10)])
    before.commit(1, c1)
    before.commit(2, c2)  # then a crash: the restored snapshot still lists both as pending
    after = sink.open(context(job, generation=2))
    after.recover([(1, c1), (2, c2)])
    after.commit(2, c2)
    assert r.hgetall(f"{p}:amount") == {b"a": b"7", b"b": b"11"}
    assert r.hget(after.guard_key, "epoch") == b"2"


def test_commit_is_a_no_op_when_a_later_checkpoint_of_the_subtask_was_committed(
    r: redis.Redis, redis_url: str, job: str, p: str
) -> None:
    """An aborted checkpoint's epoch commits with the next completed one, in order."""
    writer = RedisSink("incr", key=f"{p}:n", url=redis_url).open(context(job))
    c3 = epoch(writer, 3, [1, 2])  # checkpoint 3 aborted
    c4 = epoch(writer, 4, [4])  # checkpoint 4 completes: both commit, in order
    writer.commit(3, c3)
    writer.commit(4, c4)
    writer.recover([(3, c3), (4, c4)])
    assert r.get(f"{p}:n") == b"7"


def test_subtasks_are_guarded_separately_when_they_write_the_same_key(
    r: redis.Redis, redis_url: str, job: str, p: str
) -> None:
    sink = RedisSink("incr", key=f"{p}:n", url=redis_url)
    zero, one = sink.open(context(job, subtask=0)), sink.open(context(job, subtask=1))
    c0, c1 = epoch(zero, 7, [1]), epoch(one, 7, [10])
    zero.commit(7, c0)
    one.commit(7, c1)
    zero.commit(7, c0)
    assert r.get(f"{p}:n") == b"11"
    assert zero.guard_key != one.guard_key


def test_recover_commits_pending_and_deletes_own_orphans_when_restarted_after_crash(
    r: redis.Redis, redis_url: str, job: str, p: str
) -> None:
    sink = RedisSink("list", key=f"{p}:out", url=redis_url, chunk_ops=1)
    before = sink.open(context(job, subtask=0, generation=1))
    other = sink.open(context(job, subtask=1, generation=1))
    c1 = epoch(before, 1, ["epoch-1"])  # checkpoint 1 completes, crash before commit
    epoch(before, 2, ["epoch-2"])  # checkpoint 2 never completes: prepared orphan
    before.write(["epoch-3"])  # spilled but never prepared: orphan
    other.write(["other-subtask"])  # another subtask's staged epoch
    assert len(staged_keys(r, job)) == 4

    after = sink.open(context(job, subtask=0, generation=2))
    after.recover([(1, c1)])

    assert r.lrange(f"{p}:out", 0, -1) == [b"epoch-1"]
    left = staged_keys(r, job)
    assert len(left) == 1 and b":out:1:stage:" in left[0]
    assert r.smembers(after.registry_key) == set()
    after.write(["epoch-2-again"])
    after.commit(2, after.prepare(2))
    assert r.lrange(f"{p}:out", 0, -1) == [b"epoch-1", b"epoch-2-again"]


def test_recover_does_nothing_more_when_called_again_after_crash_during_recovery(
    r: redis.Redis, redis_url: str, job: str, p: str
) -> None:
    sink = RedisSink("incr", key=f"{p}:n", url=redis_url)
    before = sink.open(context(job, generation=1))
    c1, c2 = epoch(before, 1, [1]), epoch(before, 2, [10])
    epoch(before, 3, [100])  # orphan
    points: list[str] = []

    def crash(point: str) -> None:
        points.append(point)
        raise Crash(point)

    first = sink.open(context(job, generation=2, fault=crash))
    with pytest.raises(Crash):
        first.recover([(1, c1), (2, c2)])  # killed after the first pending epoch
    assert points == ["mid-sink-recover"]
    assert r.get(f"{p}:n") == b"1"
    second = sink.open(context(job, generation=3))
    second.recover([(1, c1), (2, c2)])
    second.recover([(1, c1), (2, c2)])
    assert r.get(f"{p}:n") == b"11"
    assert staged_keys(r, job) == []


def test_fault_hook_is_not_called_when_nothing_is_pending(redis_url: str, job: str, p: str) -> None:
    points: list[str] = []
    writer = RedisSink("list", key=f"{p}:out", url=redis_url).open(
        context(job, fault=points.append)
    )
    writer.recover([])
    assert points == []


def test_prepare_returns_none_and_stages_nothing_when_epoch_is_empty(
    r: redis.Redis, redis_url: str, job: str, p: str
) -> None:
    writer = RedisSink("command", command=lambda v: None, url=redis_url).open(context(job))
    writer.write([])
    assert writer.prepare(1) is None
    writer.write([1, 2])  # the command makes no operation of them
    assert writer.prepare(2) is None
    writer.commit(2, None)
    assert staged_keys(r, job) == []


# -- failures ------------------------------------------------------------------------------------


def test_commit_raises_missing_when_staged_epoch_was_lost(
    r: redis.Redis, redis_url: str, job: str, p: str
) -> None:
    writer = RedisSink("list", key=f"{p}:out", url=redis_url).open(context(job))
    committable = epoch(writer, 4, [1])
    r.delete(committable["key"])
    with pytest.raises(SnapshotError, match="staged output is missing") as info:
        writer.commit(4, committable)
    assert info.value.reason == "missing"
    assert committable["key"] in str(info.value)
    assert r.exists(f"{p}:out") == 0


def test_commit_raises_when_committable_is_not_a_redis_committable_of_this_subtask(
    redis_url: str, job: str, p: str
) -> None:
    sink = RedisSink("list", key=f"{p}:out", url=redis_url)
    writer, other = sink.open(context(job, subtask=0)), sink.open(context(job, subtask=1))
    foreign = epoch(other, 1, [1])
    for committable in (["x"], {"temp": "a", "final": "b"}, {"key": "k", "chunks": 1}, foreign):
        with pytest.raises(SnapshotError, match="not a Redis sink committable") as info:
            writer.commit(1, committable)
        assert info.value.reason == "corrupt"


def test_commit_resumes_after_the_failed_operation_when_redis_refused_one(
    r: redis.Redis, redis_url: str, job: str, p: str
) -> None:
    """Redis has no rollback: ops before a failing one stay applied. The guard records the
    progress so that the next attempt neither repeats nor skips an operation."""
    writer = RedisSink("command", command=lambda v: v, url=redis_url).open(context(job))
    r.set(f"{p}:wrong", "a string")
    committable = epoch(writer, 1, [
        ("INCRBY", f"{p}:a", 1),
        ("HINCRBY", f"{p}:wrong", "f", 1),  # WRONGTYPE
        ("INCRBY", f"{p}:b", 1),
    ])  # fmt: skip
    for _ in range(2):
        with pytest.raises(InfrastructureError, match=r"refused operation #1 .*WRONGTYPE"):
            writer.commit(1, committable)
    assert r.get(f"{p}:a") == b"1" and r.get(f"{p}:b") is None
    assert r.hgetall(writer.guard_key) == {b"partial": b"1", b"applied": b"1"}
    r.delete(f"{p}:wrong")  # the operator fixes the target
    writer.commit(1, committable)
    writer.commit(1, committable)
    assert (r.get(f"{p}:a"), r.hget(f"{p}:wrong", "f"), r.get(f"{p}:b")) == (b"1", b"1", b"1")
    assert r.hgetall(writer.guard_key) == {b"epoch": b"1"}


def test_config_error_is_raised_when_guard_is_ahead_of_the_job(
    r: redis.Redis, redis_url: str, job: str, p: str, tmp_path: Path
) -> None:
    """A job name reused with a fresh snapshot store would otherwise drop its output silently."""
    sink = RedisSink("list", key=f"{p}:out", url=redis_url)
    earlier = sink.open(context(job))
    earlier.commit(9, epoch(earlier, 9, ["old"]))
    store = f"file://{tmp_path}/checkpoints"
    fresh = sink.open(context(job, generation=1, snapshot_url=store))
    with pytest.raises(ConfigError, match=r"says checkpoint 9 was committed.*new name"):
        fresh.recover([])
    fresh.write(["new"])
    with pytest.raises(ConfigError, match="an earlier job named"):
        fresh.prepare(3)
    assert r.lrange(f"{p}:out", 0, -1) == [b"old"]


def test_commit_waits_for_redis_when_it_restarts_during_commit(tmp_path: Path, job: str) -> None:
    server = private_redis(tmp_path / "redis")
    retrying = threading.Event()

    class Retries(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("redis unavailable op='commit"):
                retrying.set()

    handler = Retries(logging.WARNING)
    logging.getLogger("sinks.redis").addHandler(handler)
    try:
        sink = RedisSink("incr", key="n", url=server.url, retry_for=timedelta(seconds=30))
        writer = sink.open(context(job))
        committable = epoch(writer, 1, [1, 2, 3])
        stop(server.process)  # Redis goes down between completion and commit
        errors: list[BaseException] = []

        def commit() -> None:
            try:
                writer.commit(1, committable)
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=commit)
        thread.start()
        assert retrying.wait(10)
        assert thread.is_alive()  # still retrying, not failed
        # The same port and directory: the append-only file brings the staged epoch back.
        server = start_redis(tmp_path / "redis", owned=True, port=server.port)
        thread.join(30)
        assert not thread.is_alive() and not errors, errors
        client = redis.Redis.from_url(server.url)
        assert client.get("n") == b"6"
        writer.recover([(1, committable)])
        assert client.get("n") == b"6"
        client.close()
    finally:
        logging.getLogger("sinks.redis").removeHandler(handler)
        stop(server.process)


def test_commit_raises_after_retry_for_when_redis_stays_down(job: str) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    sink = RedisSink("list", key="k", url=url, retry_for=timedelta(seconds=5))
    writer = sink.open(context(job))
    now = [0.0]
    writer._clock = lambda: now[0]
    writer._sleep = lambda s: now.__setitem__(0, now[0] + s)
    committable = {"key": f"eosflow:sink:{job}:out:0:stage:g1-x", "chunks": 1, "ops": 1}
    with pytest.raises(InfrastructureError, match=r"stayed unavailable after \d+ attempt.*"):
        writer.commit(1, committable)
    assert 3.0 <= now[0] <= 5.0  # backoff 0.05 s doubling to 2 s, within retry_for


# -- modes ---------------------------------------------------------------------------------------


def test_upsert_modes_keep_the_last_write_when_a_target_is_written_twice_in_an_epoch(
    r: redis.Redis, redis_url: str, job: str, p: str
) -> None:
    hashes = RedisSink("hash", key=f"{p}:latest", field=lambda kv: kv[0], value=lambda kv: kv[1],
                       url=redis_url).open(context(job))  # fmt: skip
    c = epoch(hashes, 1, [("a", [1, 5]), ("b", [1, 2]), ("a", [2, 9])])
    assert c["ops"] == 2
    hashes.commit(1, c)
    assert r.hgetall(f"{p}:latest") == {b"a": b"[2,9]", b"b": b"[1,2]"}
    sets = RedisSink("set", key=lambda kv: f"{p}:{kv[0]}", value=lambda kv: kv[1], url=redis_url)
    writer = sets.open(SinkContext(job=job, step="sets", subtask=0, parallelism=1, generation=1))
    writer.commit(1, epoch(writer, 1, [("x", "1"), ("x", "2"), ("y", b"\x00\xff")]))
    assert r.mget(f"{p}:x", f"{p}:y") == [b"2", b"\x00\xff"]


def test_incr_uses_incrby_when_no_field_is_given(r: redis.Redis, redis_url: str, job: str) -> None:
    p = f"test:{job}"
    sink = RedisSink("incr", key=lambda c: f"{p}:{c['user']}", value=lambda c: c["n"],
                     url=redis_url)  # fmt: skip
    writer = sink.open(context(job))
    writer.commit(1, epoch(writer, 1, [{"user": "a", "n": 2}, {"user": "a", "n": -5}]))
    assert r.get(f"{p}:a") == b"-3"


def test_stream_mode_writes_a_mapping_as_fields_and_anything_else_as_value(
    r: redis.Redis, redis_url: str, job: str, p: str
) -> None:
    writer = RedisSink("stream", key=f"{p}:events", url=redis_url).open(context(job))
    writer.commit(1, epoch(writer, 1, [{"user": "a", "n": 1}, [1, 2]]))
    entries = [fields for _id, fields in r.xrange(f"{p}:events")]
    assert entries == [{b"user": b"a", b"n": b"1"}, {b"value": b"[1,2]"}]


def test_command_mode_applies_every_allowed_operation_when_committed(
    r: redis.Redis, redis_url: str, job: str, p: str
) -> None:
    def command(v: int) -> list[tuple[Any, ...]]:
        return [
            ("set", f"{p}:s", v), ("hset", f"{p}:h", "f", v, "g", "x"), ("hdel", f"{p}:h", "g"),
            ("hincrby", f"{p}:hi", "f", v), ("incrby", f"{p}:i", v), ("rpush", f"{p}:l", v),
            ("lpush", f"{p}:l", -v), ("sadd", f"{p}:set", v, v + 1), ("srem", f"{p}:set", v + 1),
            ("zadd", f"{p}:z", v, f"m{v}"), ("zrem", f"{p}:z", "m1"), ("xadd", f"{p}:x", "v", v),
            ("pexpire", f"{p}:s", 60_000), ("del", f"{p}:gone"),
        ]  # fmt: skip

    r.set(f"{p}:gone", 1)
    writer = RedisSink("command", command=command, url=redis_url).open(context(job))
    writer.commit(1, epoch(writer, 1, [1, 2]))
    assert r.get(f"{p}:s") == b"2" and 0 < r.pttl(f"{p}:s") <= 60_000
    assert r.hgetall(f"{p}:h") == {b"f": b"2"}
    assert (r.hget(f"{p}:hi", "f"), r.get(f"{p}:i")) == (b"3", b"3")
    assert r.lrange(f"{p}:l", 0, -1) == [b"-2", b"-1", b"1", b"2"]
    assert r.smembers(f"{p}:set") == {b"1", b"2"}
    assert r.zrange(f"{p}:z", 0, -1) == [b"m2"]
    assert r.xlen(f"{p}:x") == 2 and r.exists(f"{p}:gone") == 0
    assert len(OPERATIONS) == 14


@pytest.mark.parametrize(
    ("result", "match"),
    [
        (("FLUSHALL", "k"), "not allowed; use one of SET, DEL"),
        (("SET", "k"), "SET takes exactly 1 argument"),
        (("DEL", "k", "x"), "DEL takes exactly 0 argument"),
        (("RPUSH", "k", *range(1001)), r"at most 1000\), got 1001"),
        (("HSET", "k", "f"), "HSET takes at least 2 argument.* in pairs"),
        (("INCRBY", "k", 1.5), "INCRBY argument 1 must be an int"),
        (("SET", {"a": 1}, 1), "key must be str, bytes or int"),
        (("SET", "eosflow:sink:x", 1), "lies in the sink's namespace"),
        ("SET k v", "not a tuple or a list"),
    ],
)
def test_serialization_error_is_raised_when_command_returns_a_bad_operation(
    r: redis.Redis, redis_url: str, job: str, result: Any, match: str
) -> None:
    writer = RedisSink("command", command=lambda v: v, url=redis_url).open(context(job))
    writer.write([("SET", "fine", 1)])
    with pytest.raises(SerializationError, match=match):
        writer.write([("SET", "fine", 2), result])
    c = writer.prepare(1)
    assert c["ops"] == 1  # the failed call left nothing behind


def test_serialization_error_names_step_and_type_when_value_cannot_be_encoded(
    redis_url: str, job: str
) -> None:
    writer = RedisSink("incr", key="k", url=redis_url).open(context(job))
    with pytest.raises(SerializationError, match=r"step='out'.*type str.*amount must be an int"):
        writer.write(["1"])
    writer = RedisSink("list", key="k", url=redis_url).open(context(job))
    with pytest.raises(SerializationError, match=r"type object.*TypeError"):
        writer.write([object()])


# -- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "zset", "key": "k"}, "mode 'zset' is not supported.*'set', 'hash', 'list'"),
        ({"mode": "list"}, "needs key="),
        ({"mode": "hash", "key": "k"}, "needs field="),
        ({"mode": "list", "key": "k", "field": "f"}, "takes no field="),
        ({"mode": "list", "key": 3}, "key= must be a str, bytes or a function"),
        ({"mode": "list", "key": "k", "value": "v"}, "value= must be a function"),
        ({"mode": "command"}, "needs command="),
        ({"mode": "command", "command": print, "key": "k"}, "key=, field= and value= are not"),
        ({"mode": "list", "key": "k", "command": print}, "command= needs mode='command'"),
        ({"mode": "list", "key": "k", "url": "http://x"}, "not a Redis URL"),
        ({"mode": "list", "key": "eosflow:sink:mine"}, "lies in the sink's namespace"),
        ({"mode": "list", "key": "k", "chunk_ops": 0}, "chunk_ops must be a positive int"),
    ],
)
def test_config_error_is_raised_when_sink_is_misconfigured(kwargs: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        RedisSink(**kwargs)


def test_url_is_read_from_environment_when_writer_opens_not_when_sink_is_built(
    monkeypatch: pytest.MonkeyPatch, redis_url: str, job: str
) -> None:
    monkeypatch.delenv("EOSFLOW_REDIS_URL", raising=False)
    sink = RedisSink("list", key="k")
    assert pickle.loads(pickle.dumps(sink)).mode == "list"  # configuration only
    with pytest.raises(ConfigError, match="set EOSFLOW_REDIS_URL"):
        sink.open(context(job))
    monkeypatch.setenv("EOSFLOW_REDIS_URL", "http://nope")
    with pytest.raises(ConfigError, match="is not a Redis URL"):
        sink.preflight(job=job, checkpoint_interval=1.0)
    monkeypatch.setenv("EOSFLOW_REDIS_URL", redis_url)
    sink.preflight(job=job, checkpoint_interval=1.0)
    assert sink.open(context(job)).url == redis_url


def test_sink_and_writer_satisfy_contracts_when_opened(redis_url: str, job: str) -> None:
    sink = RedisSink("list", key="k", url=redis_url)
    writer = sink.open(context(job))
    assert isinstance(sink, Sink)
    assert isinstance(writer, SinkWriter)
    writer.close()


def test_preflight_names_the_url_without_password_when_redis_is_unreachable(job: str) -> None:
    url = f"redis://:secret@127.0.0.1:{free_port()}/0"
    sink = RedisSink("list", key="k", url=url, timeout=timedelta(seconds=2))
    with pytest.raises(ConfigError, match=r"cannot reach Redis at redis://:\*\*\*@127\.0\.0\.1"):
        sink.preflight(job=job, checkpoint_interval=1.0)
    assert "secret" not in repr(sink)


def test_preflight_refuses_eviction_of_keys_without_ttl(tmp_path: Path, job: str) -> None:
    server = private_redis(tmp_path)
    try:
        client = redis.Redis.from_url(server.url)
        client.config_set("maxmemory-policy", "allkeys-lru")
        sink = RedisSink("list", key="k", url=server.url)
        with pytest.raises(ConfigError, match=r"maxmemory-policy allkeys-lru.*noeviction"):
            sink.preflight(job=job, checkpoint_interval=1.0)
        client.config_set("maxmemory-policy", "volatile-lru")
        sink.preflight(job=job, checkpoint_interval=1.0)
        client.close()
    finally:
        stop(server.process)


@pytest.mark.parametrize("checkpoint_id", [0, -1, True, "3"])
def test_definition_error_is_raised_when_checkpoint_id_is_invalid(
    redis_url: str, job: str, checkpoint_id: Any
) -> None:
    writer = RedisSink("list", key="k", url=redis_url).open(context(job))
    writer.write([1])
    with pytest.raises(DefinitionError, match="checkpoint id"):
        writer.prepare(checkpoint_id)


def test_committable_round_trips_when_stored_in_a_snapshot(
    r: redis.Redis, redis_url: str, job: str, p: str
) -> None:
    writer = RedisSink("list", key=f"{p}:out", url=redis_url).open(context(job))
    committable = epoch(writer, 1, [1])
    restored = codec.loads(codec.dumps(committable))
    assert restored == committable
    writer.commit(1, restored)
    assert r.lrange(f"{p}:out", 0, -1) == [b"1"]


def test_log_lines_carry_key_value_context_when_epoch_is_committed(
    redis_url: str, job: str, p: str, caplog: pytest.LogCaptureFixture
) -> None:
    writer = RedisSink("list", key=f"{p}:out", url=redis_url).open(context(job, subtask=2))
    with caplog.at_level(logging.INFO, logger="sinks.redis"):
        committable = epoch(writer, 7, [1])
        writer.commit(7, committable)
        writer.commit(7, committable)
    assert "prepared checkpoint_id=7 step='out' subtask=2" in caplog.text
    assert f"committed checkpoint_id=7 step='out' subtask=2 key={committable['key']}" in caplog.text
    assert "already committed checkpoint_id=7 step='out' subtask=2 guard=7" in caplog.text
