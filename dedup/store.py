"""The durable ID store: one Redis hash per time bucket, one round trip per batch.

Layout, under a prefix unique per dedup scope (``eosflow:<job>:dedup:<step>:<subtask>``)::

    <prefix>:b:<bucket start ms>   HASH   16-byte ID -> 16-byte tag (run u64, epoch u64, big-endian)
    <prefix>:buckets               SET    the bucket starts that have a hash
    <prefix>:gc                    STRING the GC mark: buckets below it may be deleted
    <prefix>:written               HASH   run -> batches of IDs that run wrote (the write marker)

Every call is one round trip (a pipeline; ``HMGET`` of many IDs per bucket, ``HSET`` of many
fields per bucket), never one per record. The tag says which run of a task recorded the ID and in
which epoch: :class:`dedup.core.Deduplicator` treats an entry as seen only when that run and
epoch belong to the history it restored (docs/dedup.md, "The ID store agrees with the
snapshots").

Fail closed: a connection error or timeout is retried with backoff (logged at every attempt),
for up to ``give_up_s``; then :class:`RedisUnavailable` fails the task, whose records stay
unprocessed, to be replayed after its restart. A lookup never answers "absent" for a server it
could not ask.

Lost data is detected, never trusted: every insert ends with a script that raises this run's
write marker (``<prefix>:written``, one count per batch), after the IDs, in the same pipeline.
Redis loses writes as a suffix of its history (a restart from an AOF/RDB that missed the last
ones, a replica promoted before it received them, or all of them after a restart without
persistence), so a marker that still counts a batch vouches for that batch and everything
written before it. A lookup reads the marker in the same round trip as the IDs, and an insert
checks it in the script before it counts the new batch: a marker behind what the caller knows
was written raises :class:`RedisDataLost` instead of answering "absent" (never let records
through unchecked: docs/dedup.md, "Redis down: fail closed"). Eviction loses keys one by one,
not as a suffix: the start-up check refuses an ``allkeys-*`` policy (:mod:`dedup.server`). Run
Redis with ``appendonly yes``.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

import dedup.native as accel  # its ``native``: read at each use, so one switch turns it off
from dedup.errors import DedupConfigError, RedisDataLost, RedisUnavailable
from dedup.ids import ID_BYTES

__all__ = [
    "RedisIdStore",
    "RedisUnavailable",
    "Scope",
    "Tag",
    "decode_tag",
    "encode_tag",
    "lost_error",
    "lost_writes",
    "redis_client",
    "redis_where",
]

log = logging.getLogger(__name__)

T = TypeVar("T")
Tag = tuple[int, int]  # (run, epoch)
#: A prefix a lookup reads: ``(prefix, its buckets to read, {run: batches} its markers must hold)``.
Scope = tuple[str, list[int], Mapping[int, int]]
_TAG = struct.Struct(">QQ")


def _retriable() -> tuple[type[Exception], ...]:
    """What the store retries. redis-py is imported on first use: importing it cost every
    process that imports :mod:`dedup` (every worker, through the engine's record IDs) about
    30 ms of start-up, a job without Redis included (bench/RESULTS.md, "Start-up and
    shut-down"). An ``except`` clause evaluates this only when an exception is raised."""
    import redis

    return (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)


# KEYS[1] bucket hash, KEYS[2] bucket index; ARGV[1] tag, ARGV[2] bucket start, ARGV[3] IDs
# (16 bytes each, concatenated). HSET in chunks: unpack() refuses a few thousand values.
_MARK_LUA = """
local old = tonumber(redis.call('GET', KEYS[1]) or '-9223372036854775808')
if tonumber(ARGV[1]) > old then redis.call('SET', KEYS[1], ARGV[1]) end
return 1
"""

_INSERT_LUA = """
local blob, tag = ARGV[3], ARGV[1]
local args, n = {}, 0
for i = 1, #blob, 16 do
  args[n + 1] = string.sub(blob, i, i + 15)
  args[n + 2] = tag
  n = n + 2
  if n == 2000 then
    redis.call('HSET', KEYS[1], unpack(args))
    args, n = {}, 0
  end
end
if n > 0 then redis.call('HSET', KEYS[1], unpack(args)) end
redis.call('SADD', KEYS[2], ARGV[2])
return 1
"""


# KEYS[1] the write markers; ARGV[1] run, ARGV[2] its new count, then pairs (run, count) that
# must still be there. Counts only if none is behind: a batch written into a Redis that lost
# earlier ones must not make the marker vouch for them again.
_WRITTEN_LUA = """
local lost = {}
for i = 3, #ARGV, 2 do
  local have = tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '0')
  if have < tonumber(ARGV[i + 1]) then
    lost[#lost + 1] = ARGV[i]
    lost[#lost + 1] = tostring(have)
  end
end
if #lost == 0 and ARGV[1] ~= '' then
  local old = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
  if tonumber(ARGV[2]) > old then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end
end
return lost
"""


def _pack(ids: list[int]) -> bytes:
    """The IDs as one blob, ``ID_BYTES`` little-endian bytes each (in C where it was built)."""
    if accel.native is not None and type(ids) is list:
        return accel.native.pack_ids(ids)  # type: ignore[no-any-return]
    return b"".join([i.to_bytes(ID_BYTES, "little") for i in ids])


def lost_writes(watch: Mapping[int, int], stored: Mapping[int, int]) -> dict[int, tuple[int, int]]:
    """``{run: (written, stored)}`` for each run whose marker in the store is behind the batches
    the caller knows it wrote (an absent marker counts 0). Empty: nothing was lost."""
    return {
        run: (want, stored.get(run, 0)) for run, want in watch.items() if stored.get(run, 0) < want
    }


def lost_error(where: str, prefix: str, lost: dict[int, tuple[int, int]]) -> RedisDataLost:
    """The error for IDs lost from the store at ``where``: what, why, and what to do."""
    run, (want, have) = max(lost.items(), key=lambda item: item[1][0])
    state = "is gone" if have == 0 else f"counts {have}"
    return RedisDataLost(
        f"dedup ID store {prefix!r} on Redis at {where} lost record IDs this job relies on: "
        f"run {run:x} wrote {want} batch{'' if want == 1 else 'es'} of IDs there, and its "
        f"write marker "
        f"{prefix}:written {state}. Redis restarted without its data, failed over to a replica "
        "that missed the last writes, or evicted keys. Copies of records whose IDs were lost "
        "would pass as new, so the task refuses to go on (it restarts from its last checkpoint "
        "and refuses again). Fix: bring Redis back with its data (its AOF/RDB files, or the "
        "old primary) and the job continues by itself; or accept that copies of records seen "
        "before may pass once: restart the job with EOSFLOW_DEDUP_ON_LOST_IDS=accept. Then "
        "make Redis durable: appendonly yes, maxmemory-policy noeviction (docs/dedup.md, "
        "'Redis durability')",
        lost,
    )


def redis_where(client: Any) -> str:
    """``redis://host:port/db`` (or the socket path) of a client, without credentials."""
    kw = client.connection_pool.connection_kwargs
    if "path" in kw:
        return f"unix://{kw['path']}"
    return f"redis://{kw.get('host', 'localhost')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"


def encode_tag(run: int, epoch: int) -> bytes:
    return _TAG.pack(run, epoch)


def decode_tag(data: bytes) -> Tag:
    run, epoch = _TAG.unpack(data)
    return run, epoch


def redis_client(url: str | None, *, timeout_s: float = 10.0, name: str = "eosflow-dedup") -> Any:
    """A client for ``url`` (default ``EOSFLOW_REDIS_URL``) without redis-py's own retries (the
    store retries, and logs each attempt).

    Raises:
        DedupConfigError: no URL, or not a Redis URL.
    """
    url = url or os.environ.get("EOSFLOW_REDIS_URL")
    if not url:
        raise DedupConfigError(
            "dedup needs Redis for its ID store: pass redis_url='redis://host:port/db' or set "
            "EOSFLOW_REDIS_URL (eosflow dev up starts one on loopback)"
        )
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise DedupConfigError(
            f"{url.split('@')[-1]!r} is not a Redis URL: expected redis://host:port/db, "
            "rediss://... or unix:///path/to/socket"
        )
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=min(timeout_s, 10.0),
        socket_keepalive=True,
        retry=Retry(NoBackoff(), 0),
        client_name=name,
    )


class RedisIdStore:
    """IDs per time bucket in Redis. See the module docstring.

    Args:
        client: a ``redis.Redis`` (see :func:`redis_client`).
        prefix: the key prefix of this dedup scope.
        give_up_s: how long to retry an unreachable server before raising
            :class:`RedisUnavailable` (``None``: forever).
        sleep: the pause between retries (tests pass a fake).
        wait: a context manager factory wrapped around each call, retries included: the engine
            passes one that tells the job's status what the task waits on, while it waits
            (``processor.runtime.waits``); default: nothing.

    Attributes:
        round_trips: calls that reached the server (for the benchmarks and the stats).
    """

    def __init__(
        self,
        client: Any,
        prefix: str,
        *,
        give_up_s: float | None = 300.0,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        wait: Callable[[], AbstractContextManager[Any]] = nullcontext,
    ) -> None:
        self.client = client
        self._wait = wait
        self.prefix = prefix
        self.give_up_s = give_up_s
        self.sleep = sleep
        self.clock = clock
        self.round_trips = 0
        self._index = f"{prefix}:buckets"
        self._mark = f"{prefix}:gc"
        self._written = f"{prefix}:written"
        self._insert_script = client.register_script(_INSERT_LUA)
        self._raise_mark = client.register_script(_MARK_LUA)
        self._count_written = client.register_script(_WRITTEN_LUA)

    def __repr__(self) -> str:
        return f"RedisIdStore(prefix={self.prefix!r})"

    def _key(self, bucket: int) -> str:
        return f"{self.prefix}:b:{bucket}"

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        with self._wait():
            return self._retrying(what, fn)

    def _retrying(self, what: str, fn: Callable[[], T]) -> T:
        started = self.clock()
        delay, attempt = 0.05, 0
        while True:
            try:
                result = fn()
                self.round_trips += 1
                return result
            except _retriable() as exc:
                attempt += 1
                waited = self.clock() - started
                if self.give_up_s is not None and waited >= self.give_up_s:
                    raise RedisUnavailable(
                        f"dedup store {self.prefix!r}: Redis unreachable for {waited:.0f}s "
                        f"({attempt} attempts, last: {type(exc).__name__}: {exc}); records are "
                        "not let through unchecked: the task fails and restarts from its last "
                        "checkpoint. Check that Redis is up and EOSFLOW_REDIS_URL points at it"
                    ) from exc
                log.warning(
                    "dedup store unreachable, retrying (records wait, none pass unchecked) "
                    "prefix=%s op=%s attempt=%d error=%r",
                    self.prefix, what, attempt, str(exc),
                )  # fmt: skip
                self.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _lost(self, lost: dict[int, tuple[int, int]]) -> RedisDataLost:
        return lost_error(redis_where(self.client), self.prefix, lost)

    def lookup(
        self, buckets: Iterable[int], ids: list[int], watch: Mapping[int, int] | None = None
    ) -> list[list[bytes]]:
        """The tags stored for each ID in any of ``buckets`` (one round trip).

        ``watch``: ``{run: batches written}`` that the store must still account for; their
        markers are read in the same round trip, so an "absent" never comes from a Redis that
        lost data (:class:`RedisDataLost`)."""
        buckets = list(buckets)
        found: list[list[bytes]] = [[] for _ in ids]
        if not ids or not buckets:
            return found
        fields = [i.to_bytes(ID_BYTES, "little") for i in ids]
        scopes = self._scopes(buckets, watch or {})

        def run() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for prefix, held, marks in scopes:
                for bucket in held:
                    pipe.hmget(f"{prefix}:b:{bucket}", fields)
                if marks:
                    pipe.hmget(f"{prefix}:written", list(marks))
            return list(pipe.execute())

        replies = iter(self._call("lookup", run))
        tables: list[list[Any]] = []
        for prefix, held, marks in scopes:
            tables += [next(replies) for _ in held]
            if marks:
                self._check_written(prefix, marks, next(replies))
        for values in tables:
            for n, tag in enumerate(values):
                if tag is not None:
                    found[n].append(tag)
        return found

    def _scopes(self, buckets: list[int], watch: Mapping[int, int]) -> list[Scope]:
        """What a lookup of ``buckets`` reads, in this order: its own prefix's buckets, with the
        write markers of ``watch``. A subclass adds the prefixes it also reads."""
        return [(self.prefix, buckets, watch)]

    def _check_written(self, prefix: str, watch: Mapping[int, int], markers: list[Any]) -> None:
        """Raises :class:`RedisDataLost` if a write marker read from ``prefix`` (``markers``,
        in the order of ``watch``) is behind the batches ``watch`` says were written there."""
        stored = {r: int(m) for r, m in zip(watch, markers, strict=True) if m is not None}
        lost = lost_writes(watch, stored)
        if lost:
            raise lost_error(redis_where(self.client), prefix, lost)

    def insert(
        self,
        entries: dict[int, list[int]],
        tag: bytes,
        *,
        count: tuple[int, int] | None = None,
        watch: Mapping[int, int] | None = None,
    ) -> None:
        """Records the IDs per bucket with ``tag`` (one round trip; overwrites older tags).

        ``count``: ``(run, batches)``: after the IDs, raise that run's write marker to
        ``batches``, unless a marker of ``watch`` is behind (then :class:`RedisDataLost`, and
        the marker is left as it was).

        The IDs of a bucket travel as one binary argument of a Lua script that splits it into
        ``HSET`` fields: building an ``HSET`` with one argument per field costs redis-py about
        1.5 us of Python per ID (measured), the join about 0.15 us.
        """
        entries = {b: ids for b, ids in entries.items() if ids}
        if not entries and count is None and not watch:
            return
        blobs = {b: _pack(ids) for b, ids in entries.items()}
        args = self._watch_args(count, watch)

        def run() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for bucket, blob in blobs.items():
                self._insert_script(
                    keys=[self._key(bucket), self._index], args=[tag, bucket, blob], client=pipe
                )
            if args is not None:  # last: the marker vouches for the writes before it
                self._count_written(keys=[self._written], args=args, client=pipe)
            return list(pipe.execute())

        replies = self._call("insert", run)
        if args is not None:
            self._raise_if_lost(replies[-1], watch)

    def verify(self, watch: Mapping[int, int]) -> None:
        """Raises :class:`RedisDataLost` if a marker of ``watch`` is behind (one round trip)."""
        args = self._watch_args(None, watch)
        if args is not None:
            reply = self._call(
                "verify", lambda: self._count_written(keys=[self._written], args=args)
            )
            self._raise_if_lost(reply, watch)

    @staticmethod
    def _watch_args(
        count: tuple[int, int] | None, watch: Mapping[int, int] | None
    ) -> list[Any] | None:
        if count is None and not watch:
            return None
        args: list[Any] = [count[0], count[1]] if count is not None else ["", 0]
        for run, batches in (watch or {}).items():
            args += [run, batches]
        return args

    def _raise_if_lost(self, reply: list[Any], watch: Mapping[int, int] | None) -> None:
        if reply:
            stored = {int(r): int(have) for r, have in zip(reply[::2], reply[1::2], strict=True)}
            raise self._lost(lost_writes({r: (watch or {})[r] for r in stored}, stored))

    def delete_before(self, cutoff_ms: int, bucket_ms: int) -> list[int]:
        """Deletes every bucket wholly below ``cutoff_ms``, also ones a crashed run left."""
        members = self._call("buckets", lambda: self.client.smembers(self._index))
        gone = sorted(int(m) for m in members if int(m) + bucket_ms <= cutoff_ms)
        mark = cutoff_ms - cutoff_ms % bucket_ms

        def run() -> None:
            pipe = self.client.pipeline(transaction=False)
            # the GC mark first: a restore of an older checkpoint must know what is gone
            self._raise_mark(keys=[self._mark], args=[mark], client=pipe)
            if gone:
                pipe.delete(*[self._key(b) for b in gone])
                pipe.srem(self._index, *gone)
            pipe.execute()

        self._call("delete", run)
        return gone

    def deleted_below(self) -> int:
        """The GC mark: every bucket below it may have been deleted."""
        value = self._call("mark", lambda: self.client.get(self._mark))
        return int(value) if value is not None else -(2**63)

    def buckets(self) -> list[int]:
        """Bucket starts that have IDs stored."""
        return sorted(
            int(m) for m in self._call("buckets", lambda: self.client.smembers(self._index))
        )

    def scan_bucket(self, bucket: int, count: int = 10_000) -> Iterable[tuple[int, bytes]]:
        """Every ``(id, tag)`` of a bucket (``HSCAN``: one round trip per ``count`` entries)."""
        cursor = 0
        key = self._key(bucket)
        while True:

            def scan(c: int = cursor) -> Any:
                return self.client.hscan(key, c, count=count)

            cursor, page = self._call("scan", scan)
            for field, tag in page.items():
                yield int.from_bytes(field, "little"), tag
            if cursor == 0:
                return

    def clear(self) -> None:
        """Deletes every key of this scope (a job reset)."""
        for bucket in self.buckets():
            key = self._key(bucket)
            self._call("clear", lambda k=key: self.client.delete(k))  # type: ignore[misc]
        self._call("clear", lambda: self.client.delete(self._index, self._mark, self._written))
