"""Redis sink: an epoch's writes are staged in Redis, then applied by one epoch-guarded script.

Keys of one sink subtask (``<base>`` is ``<namespace>:<job>:<step>:<subtask>``; the namespace is
``eosflow:sink`` unless configured)::

    <base>:epoch            hash: ``epoch`` = last committed checkpoint id (the guard);
                            ``partial``/``applied`` = progress of a commit that a command failed
    <base>:staged           set: names of this subtask's staging hashes (for recover)
    <base>:stage:<token>    hash: chunk number -> MessagePack array of operations; one per epoch

During an epoch, operations are buffered in memory and spilled to the epoch's staging hash in
chunks. ``prepare(n)`` stages the rest (one round trip) and returns ``{"key", "chunks", "ops"}``.
``commit(n, committable)`` runs one Lua script that atomically: does nothing if the guard is
``>= n`` (already committed); else applies the staged operations, sets the guard to ``n`` and
deletes the staging hash. A replayed epoch is therefore a no-op, and ``commit`` is idempotent.
See docs/sink-redis.md for the semantics, the limits and the server settings it relies on.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import orjson
import redis

from dedup.store import redis_client
from processor.contracts import SinkContext
from processor.errors import (
    ConfigError,
    DefinitionError,
    InfrastructureError,
    SerializationError,
    SnapshotError,
)

__all__ = ["MODES", "OPERATIONS", "RedisSink", "RedisSinkWriter"]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Named modes of :class:`RedisSink` -> what each value becomes.
MODES = {
    "set": "SET key value",
    "hash": "HSET key field value",
    "list": "RPUSH key value",
    "stream": "XADD key * field value [field value ...]",
    "incr": "INCRBY key amount, or HINCRBY key field amount when field= is given",
    "command": "whatever command(value) returns: (op, key, *args) or a list of them",
}

#: Operations a ``command`` function may return: name -> (min, max args after the key, args in
#: pairs, positions of integer args). Every one is deterministic given the data it sees.
OPERATIONS: dict[str, tuple[int, int | None, bool, tuple[int, ...]]] = {
    "SET": (1, 1, False, ()),
    "DEL": (0, 0, False, ()),
    "HSET": (2, None, True, ()),
    "HDEL": (1, None, False, ()),
    "HINCRBY": (2, 2, False, (1,)),
    "INCRBY": (1, 1, False, (0,)),
    "RPUSH": (1, None, False, ()),
    "LPUSH": (1, None, False, ()),
    "SADD": (1, None, False, ()),
    "SREM": (1, None, False, ()),
    "ZADD": (2, None, True, ()),
    "ZREM": (1, None, False, ()),
    "XADD": (2, None, True, ()),
    "PEXPIRE": (1, 1, False, (0,)),
}
_MAX_ARGS = 1000  # Lua's unpack() fails past ~8000 values; a bigger op is surely a mistake
_MIN_VERSION = (5, 0)  # XADD and effects replication of scripts
_TRANSIENT_REPLIES = ("BUSY", "LOADING", "TRYAGAIN", "READONLY", "MASTERDOWN", "OOM")

# KEYS: guard, staging hash, registry. ARGV: checkpoint id, chunks staged.
# Replies: {"committed", ops} {"done", guard} {"stale", guard} {"missing", chunks present}
# {"failed", op index, error}. A failing command leaves the ops before it applied (Redis has no
# rollback): the guard records how far it got, so the next attempt resumes there and neither
# repeats nor skips an operation.
_COMMIT_LUA = """
if redis.replicate_commands then redis.replicate_commands() end
local guard, staged, registry = KEYS[1], KEYS[2], KEYS[3]
local epoch, chunks = tonumber(ARGV[1]), tonumber(ARGV[2])
local allowed = {ALLOWED}
local committed = tonumber(redis.call('HGET', guard, 'epoch') or '-1')
local present = redis.call('HLEN', staged)
if committed >= epoch then
  if present > 0 then return {'stale', committed} end
  return {'done', committed}
end
if present ~= chunks then return {'missing', present} end
local start = 0
if redis.call('HGET', guard, 'partial') == ARGV[1] then
  start = tonumber(redis.call('HGET', guard, 'applied'))
end
local function fail(index, why)
  redis.call('HSET', guard, 'partial', ARGV[1], 'applied', index)
  return {'failed', index, why}
end
local index = 0
for c = 0, chunks - 1 do
  local ok, ops = pcall(cmsgpack.unpack, redis.call('HGET', staged, tostring(c)))
  if not ok or type(ops) ~= 'table' then return fail(index, 'chunk ' .. c .. ' is corrupt') end
  if index + #ops <= start then
    index = index + #ops
  else
    for i = 1, #ops do
      if index >= start then
        local op = ops[i]
        if type(op) ~= 'table' or not allowed[op[1]] then
          return fail(index, 'operation not allowed: ' .. tostring(op[1]))
        end
        local reply = redis.pcall(unpack(op))
        if type(reply) == 'table' and reply.err then return fail(index, reply.err) end
      end
      index = index + 1
    end
  end
end
redis.call('HSET', guard, 'epoch', ARGV[1])
redis.call('HDEL', guard, 'partial', 'applied')
redis.call('DEL', staged)
redis.call('SREM', registry, staged)
return {'committed', index}
""".replace("ALLOWED", ", ".join(f"{op}=true" for op in OPERATIONS))

_PROBE_LUA = "return cmsgpack.unpack(ARGV[1])[1]"


class RedisSink:
    """Writes every value as a Redis command, exactly once: an epoch's commands become visible
    together, atomically, when its checkpoint completes, and a replayed epoch changes nothing.

    Args:
        mode: what a value becomes (see :data:`MODES`): ``"set"``, ``"hash"``, ``"list"``,
            ``"stream"``, ``"incr"`` or ``"command"``.
        key: the target key: a ``str``/``bytes`` constant or a function ``value -> key``
            (every mode but ``"command"``). Keyed streams hand ``(key, value)`` pairs.
        field: hash field, a constant or a function ``value -> field`` (``"hash"``; optional
            for ``"incr"``, which then uses HINCRBY).
        value: function ``value -> what is written`` (default: the value itself). ``bytes`` and
            ``str`` are written as they are, anything else as JSON (orjson); ``"incr"`` needs an
            ``int``; ``"stream"`` writes a mapping as the entry's fields, anything else as the
            field ``value``.
        command: function ``value -> (op, key, *args)``, a list of such tuples, or ``None``
            (``"command"`` mode only); ``op`` is one of :data:`OPERATIONS` (``XADD`` gets the
            id ``*``).
        url: ``redis://`` URL; default ``EOSFLOW_REDIS_URL``, read when a writer opens.
        namespace: prefix of the sink's own bookkeeping keys; targets may not start with it.
        timeout: socket timeout of one Redis call (a big epoch's commit runs in one call).
        retry_for: how long a call is retried while Redis is unreachable or busy, before the
            writer raises (the worker restarts and recovery commits again; nothing is dropped).
        chunk_ops: operations per staged chunk; bounds the memory an epoch takes in the worker.

    Raises:
        ConfigError: an unknown mode, a missing or superfluous function, a bad URL.

    Invariants:
        The sink holds configuration only; every worker opens its own connection.
        Targets must live on one Redis server (not Redis Cluster): the commit script touches
        keys it cannot declare. See docs/sink-redis.md.
    """

    def __init__(
        self,
        mode: str,
        *,
        key: str | bytes | Callable[[Any], Any] | None = None,
        field: str | bytes | Callable[[Any], Any] | None = None,
        value: Callable[[Any], Any] | None = None,
        command: Callable[[Any], Any] | None = None,
        url: str | None = None,
        namespace: str = "eosflow:sink",
        timeout: timedelta = timedelta(seconds=60),
        retry_for: timedelta = timedelta(seconds=30),
        chunk_ops: int = 10_000,
    ) -> None:
        if mode not in MODES:
            raise ConfigError(
                f"RedisSink mode {mode!r} is not supported: expected one of "
                f"{', '.join(map(repr, MODES))}"
            )
        if mode == "command":
            if not callable(command):
                raise ConfigError(
                    "RedisSink mode 'command' needs command=<function value -> (op, key, *args)>"
                )
            if key is not None or field is not None or value is not None:
                raise ConfigError(
                    "RedisSink mode 'command': key=, field= and value= are not used; the "
                    "command function returns the whole operation"
                )
        else:
            if command is not None:
                raise ConfigError(f"RedisSink command= needs mode='command', not {mode!r}")
            _check_part("key", key, required=True)
            _check_part("field", field, required=mode == "hash")
            if field is not None and mode not in ("hash", "incr"):
                raise ConfigError(f"RedisSink mode {mode!r} takes no field= (only hash, incr)")
            if value is not None and not callable(value):
                raise ConfigError(f"RedisSink value= must be a function, got {value!r}")
        if url is not None and (not isinstance(url, str) or not _is_redis_url(url)):
            raise ConfigError(
                f"RedisSink url {url!r} is not a Redis URL: expected redis://host:port/db, "
                "rediss://... or unix:///path/to/socket"
            )
        if not isinstance(namespace, str) or not namespace or any(c.isspace() for c in namespace):
            raise ConfigError(f"RedisSink namespace {namespace!r} must be a non-empty word")
        if not isinstance(chunk_ops, int) or chunk_ops < 1:
            raise ConfigError(f"RedisSink chunk_ops must be a positive int, got {chunk_ops!r}")
        self.mode = mode
        self.key, self.field, self.value, self.command = key, field, value, command
        self.url = url
        self.namespace = namespace
        self.timeout = timeout
        self.retry_for = retry_for
        self.chunk_ops = chunk_ops
        if isinstance(key, (str, bytes)):
            try:
                _check_target(_key_bytes(key), self._reserved, "key")
            except ValueError as exc:
                raise ConfigError(f"RedisSink {exc}") from None

    def __repr__(self) -> str:
        url = _redact(self.url) if self.url else "$EOSFLOW_REDIS_URL"
        return f"RedisSink({self.mode!r}, url={url!r})"

    @property
    def _reserved(self) -> bytes:
        return f"{self.namespace}:".encode()

    def resolve_url(self) -> str:
        """``url=`` or ``EOSFLOW_REDIS_URL`` (read now, not when the pipeline was imported).

        Raises:
            ConfigError: neither is set, or the variable is not a Redis URL.
        """
        url = self.url or os.environ.get("EOSFLOW_REDIS_URL")
        if not url:
            raise ConfigError(
                "RedisSink has no Redis to write to: pass url='redis://host:port/db' or set "
                "EOSFLOW_REDIS_URL (eosflow dev up starts one on loopback)"
            )
        if not _is_redis_url(url):
            raise ConfigError(
                f"EOSFLOW_REDIS_URL={_redact(url)!r} is not a Redis URL: expected "
                "redis://host:port/db, rediss://... or unix:///path/to/socket"
            )
        return url

    def client(self, url: str) -> redis.Redis:
        """A client without redis-py's own retries: the writer retries, and logs each attempt."""
        client: redis.Redis = redis_client(
            url, timeout_s=self.timeout.total_seconds(), name="eosflow-sink"
        )
        return client

    def preflight(self, *, job: str, checkpoint_interval: float | None) -> None:
        """Checks the server once before workers start: reachable, Redis >= 5, not a cluster,
        no eviction of keys without a TTL, Lua with cmsgpack; warns when persistence is off.

        Raises:
            ConfigError: what is wrong with the server and how to fix it.
        """
        url = self.resolve_url()
        where = _redact(url)
        client = self.client(url)
        try:
            try:
                client.ping()
                info = client.info()
            except redis.RedisError as exc:
                raise ConfigError(
                    f"RedisSink cannot reach Redis at {where}: {type(exc).__name__}: {exc}. "
                    "Start Redis there, or point url= / EOSFLOW_REDIS_URL at a running server"
                ) from exc
            _check_server(info, where)
            try:
                client.script_load(_COMMIT_LUA)
                probe = client.eval(_PROBE_LUA, 0, _mp_array(1) + _mp_str(b"ok"))
            except redis.RedisError as exc:
                raise ConfigError(
                    f"Redis at {where} refused the sink's Lua script ({exc}): the sink needs "
                    "EVAL/EVALSHA and SCRIPT LOAD with the cmsgpack library (allow them in the "
                    "server's ACL or rename-command settings)"
                ) from exc
            if probe != b"ok":
                raise ConfigError(f"Redis at {where}: cmsgpack returned {probe!r}, not b'ok'")
        finally:
            client.close()
        log.info(
            "preflight ok job=%r url=%s version=%s checkpoint_interval=%s",
            job, where, info.get("redis_version"), checkpoint_interval,
        )  # fmt: skip

    def open(self, ctx: SinkContext) -> RedisSinkWriter:
        """A writer for subtask ``ctx.subtask`` (connects lazily, on its first call)."""
        url = self.resolve_url()
        return RedisSinkWriter(self, ctx, url, self.client(url))


class RedisSinkWriter:
    """One subtask's writer of a :class:`RedisSink` (see the module docstring for the keys).

    Invariants:
        Nothing reaches a target key before ``commit``: operations wait in memory or in the
        epoch's staging hash, which readers of the targets never look at.
        An epoch is staged whole before ``prepare`` returns (in Redis, as durable as the server's
        persistence makes it), so a completed checkpoint's committable names data that exists.
        ``commit`` applies an epoch at most once (the guard) and all at once (one script), in
        checkpoint order; ``commit`` and ``recover`` are idempotent.
        ``recover`` deletes only staging hashes of this subtask that no pending committable
        names. ``write`` is all or nothing per call.
    """

    def __init__(self, sink: RedisSink, ctx: SinkContext, url: str, client: redis.Redis) -> None:
        self.ctx = ctx
        self.url = _redact(url)
        self._client = client
        self._retry_s = sink.retry_for.total_seconds()
        self._clock, self._sleep = time.monotonic, time.sleep  # tests pass a manual clock
        self._chunk_ops = sink.chunk_ops
        base = f"{sink.namespace}:{ctx.job}:{ctx.step}:{ctx.subtask}"
        self.guard_key = f"{base}:epoch"
        self.registry_key = f"{base}:staged"
        self._stage_prefix = f"{base}:stage:"
        self._encode, self._upsert = _encoder(sink, self._unencodable)
        self._script = client.register_script(_COMMIT_LUA)
        self._buffer: list[bytes] = []
        self._upserts: dict[bytes, bytes] = {}  # set/hash: target -> last value (last wins)
        self._stage: str | None = None
        self._chunks = 0
        self._written = 0  # operations of this epoch, buffered or staged
        self._staged = 0  # operations in the staged chunks (last writes only, for set/hash)

    def __repr__(self) -> str:
        ctx = self.ctx
        return f"RedisSinkWriter({self.url!r}, step={ctx.step!r}, subtask={ctx.subtask})"

    # -- epoch -----------------------------------------------------------------------------------

    def write(self, values: Sequence[Any]) -> None:
        """Buffers the operations of ``values``; spills a chunk to the staging hash when full.

        Raises:
            SerializationError: a value cannot become an operation (nothing of this call is kept).
        """
        if not values:
            return
        ops = self._encode(values)
        if self._upsert:
            # Distinct targets commute and the epoch applies at once: only the last write of
            # each target needs to reach Redis.
            self._upserts.update(ops)
            pending = len(self._upserts)
        else:
            self._buffer.extend(ops)
            pending = len(self._buffer)
        self._written += len(ops)
        if pending >= self._chunk_ops:
            self._stage_chunk(read_guard=False)

    def prepare(self, checkpoint_id: int) -> dict[str, Any] | None:
        """Stages what is buffered (one round trip); returns ``{"key": <staging hash>,
        "chunks": <count>, "ops": <count>}``, or ``None`` when the epoch wrote nothing.

        Raises:
            ConfigError: the guard already holds a checkpoint ``>= checkpoint_id`` (the job's
                name was used before with another snapshot store).
        """
        _check_checkpoint_id(checkpoint_id)
        if self._written == 0:
            return None
        guard = self._stage_chunk(read_guard=True)
        if guard is not None and int(guard) >= checkpoint_id:
            raise self._stale(int(guard), checkpoint_id)
        assert self._stage is not None
        committable = {"key": self._stage, "chunks": self._chunks, "ops": self._staged}
        log.info(
            "prepared checkpoint_id=%d step=%r subtask=%d key=%s chunks=%d ops=%d written=%d",
            checkpoint_id, self.ctx.step, self.ctx.subtask, self._stage, self._chunks,
            self._staged, self._written,
        )  # fmt: skip
        self._stage, self._chunks, self._written, self._staged = None, 0, 0, 0
        return committable

    def commit(self, checkpoint_id: int, committable: Any) -> None:
        """Applies the staged epoch with the guarded script. Idempotent; ``None`` is a no-op.

        Raises:
            SnapshotError: ``missing`` when the staged epoch is gone although the guard says it
                was not committed (Redis lost data: persistence off, or keys deleted);
                ``corrupt`` when ``committable`` is not one of this subtask's.
            ConfigError: the guard is ahead while the epoch is still staged (job name reused).
            InfrastructureError: Redis refused an operation (the guard keeps the progress: the
                next attempt resumes after the last applied operation), or stayed unreachable
                for ``retry_for``.
        """
        if committable is None:
            return
        key, chunks = self._parse(checkpoint_id, committable)
        keys = [self.guard_key, key, self.registry_key]
        reply: list[Any] = self._retrying(
            f"commit checkpoint_id={checkpoint_id}",
            lambda: self._script(keys=keys, args=[checkpoint_id, chunks]),
        )
        status = _text(reply[0])
        context = f"checkpoint_id={checkpoint_id} step={self.ctx.step!r} subtask={self.ctx.subtask}"
        if status == "committed":
            log.info("committed %s key=%s ops=%d", context, key, reply[1])
        elif status == "done":
            log.info("already committed %s guard=%d", context, reply[1])
        elif status == "stale":
            raise self._stale(int(reply[1]), checkpoint_id)
        elif status == "missing":
            raise SnapshotError(
                f"redis sink {context}: the staged output is missing ({reply[1]} of {chunks} "
                f"chunks in {key} at {self.url}) but the guard {self.guard_key} says it was never "
                "committed. Committing would lose that epoch's records. Redis lost data (a "
                "restart without persistence: enable appendonly) or something deleted the key",
                reason="missing",
                path=key,
            )
        else:
            raise InfrastructureError(
                f"redis sink {context}: Redis refused operation #{reply[1]} of the epoch staged "
                f"in {key}: {_text(reply[2])}. The operations before it are "
                f"applied and recorded in {self.guard_key}; fix the target (e.g. a key of "
                "another type) and restart: the commit resumes at that operation"
            )

    def recover(self, pending: Sequence[tuple[int, Any]]) -> None:
        """Commits ``pending`` in order, then deletes this subtask's other staging hashes
        (orphans of epochs after the restored checkpoint). Idempotent.

        Raises:
            ConfigError: the guard is ahead of every completed checkpoint of the job (its name
                was used before with another snapshot store).
            SnapshotError, InfrastructureError: as :meth:`commit`.
        """
        self._check_guard_behind_snapshots()
        keep = {self._stage} if self._stage is not None else set()
        for i, (checkpoint_id, committable) in enumerate(pending):
            self.commit(checkpoint_id, committable)
            if committable is not None:
                keep.add(committable["key"])
            if i == 0:
                self.ctx.fault("mid-sink-recover")
        registry = self.registry_key

        def clean() -> list[str]:
            names = [_text(m) for m in self._client.smembers(registry)]
            orphans = sorted(n for n in names if n not in keep and n.startswith(self._stage_prefix))
            if orphans:
                pipe = self._client.pipeline(transaction=True)
                pipe.delete(*orphans)
                pipe.srem(registry, *orphans)
                pipe.execute()
            return orphans

        orphans = self._retrying("recover", clean)
        log.info(
            "recovered step=%r subtask=%d generation=%d pending=%d orphans_deleted=%d",
            self.ctx.step, self.ctx.subtask, self.ctx.generation, len(pending), len(orphans),
        )  # fmt: skip

    def close(self) -> None:
        """Drops the connection and the unstaged buffer (``recover`` deletes staged orphans)."""
        self._buffer, self._upserts = [], {}
        self._client.close()

    # -- helpers ---------------------------------------------------------------------------------

    def _stage_chunk(self, *, read_guard: bool) -> bytes | None:
        """Writes the buffer as the next chunk of the epoch's staging hash (and reads the guard).

        Safe to retry: HSET of the same field with the same bytes, SADD of the same name.
        """
        if self._upsert:
            ops = [target + tail for target, tail in self._upserts.items()]
        else:
            ops = self._buffer
        if self._stage is None:
            token = f"g{self.ctx.generation}-{uuid.uuid4().hex[:16]}"
            self._stage = f"{self._stage_prefix}{token}"
        stage, chunk = self._stage, self._chunks
        blob = _mp_array(len(ops)) + b"".join(ops) if ops else None

        def send() -> list[Any]:
            pipe = self._client.pipeline(transaction=True)
            if blob is not None:
                if chunk == 0:
                    pipe.sadd(self.registry_key, stage)
                pipe.hset(stage, str(chunk), blob)
            if read_guard:
                pipe.hget(self.guard_key, "epoch")
            return pipe.execute()

        replies = self._retrying("stage", send)
        if blob is not None:
            self._chunks += 1
            self._staged += len(ops)
        self._buffer, self._upserts = [], {}
        return replies[-1] if read_guard else None

    def _retrying(self, what: str, call: Callable[[], T]) -> T:
        """``call()``, retried with backoff while Redis is unreachable, loading or busy."""
        deadline = self._clock() + self._retry_s
        delay, attempt = 0.05, 0
        while True:
            attempt += 1
            try:
                return call()
            except redis.RedisError as exc:
                transient = isinstance(exc, (redis.ConnectionError, redis.TimeoutError)) or str(
                    exc
                ).startswith(_TRANSIENT_REPLIES)
                if not transient or self._clock() + delay > deadline:
                    why = "stayed unavailable" if transient else "failed"
                    raise InfrastructureError(
                        f"redis sink step={self.ctx.step!r} subtask={self.ctx.subtask}: {what} "
                        f"{why} after {attempt} attempt(s) at {self.url}: "
                        f"{type(exc).__name__}: {exc}. The worker restarts and recovery "
                        "commits the pending epochs; nothing is dropped"
                    ) from exc
                log.warning(
                    "redis unavailable op=%r step=%r subtask=%d attempt=%d retry_in_s=%.2f "
                    "error=%r",
                    what, self.ctx.step, self.ctx.subtask, attempt, delay, str(exc),
                )  # fmt: skip
            self._sleep(delay)
            delay = min(delay * 2, 2.0)

    def _check_guard_behind_snapshots(self) -> None:
        """A guard ahead of every completed checkpoint belongs to an earlier job of the same
        name: left alone, it would turn this job's commits into silent no-ops."""
        url = self.ctx.snapshot_url
        if url is None:
            return
        guard = self._retrying("read guard", lambda: self._client.hget(self.guard_key, "epoch"))
        if guard is None:
            return
        from processor.snapshot.store import SnapshotStore

        try:
            completed = SnapshotStore(url).completed_ids(self.ctx.job)
        except OSError as exc:
            log.warning("could not list checkpoints url=%s error=%r: guard not checked", url, exc)
            return
        newest = completed[-1] if completed else 0
        if int(guard) > newest:
            raise self._stale(int(guard), newest)

    def _stale(self, guard: int, checkpoint_id: int) -> ConfigError:
        return ConfigError(
            f"redis sink step={self.ctx.step!r} subtask={self.ctx.subtask}: {self.guard_key} at "
            f"{self.url} says checkpoint {guard} was committed, but this job is at checkpoint "
            f"{checkpoint_id}: an earlier job named {self.ctx.job!r} wrote there (with another "
            "snapshot store, or its checkpoints were deleted), and its guard would silently drop "
            f"this job's output. Give the job a new name, or delete the keys "
            f"{self.guard_key.rsplit(':', 1)[0]}:* once that job's output is no longer needed"
        )

    def _parse(self, checkpoint_id: int, committable: Any) -> tuple[str, int]:
        key = committable.get("key") if isinstance(committable, dict) else None
        chunks = committable.get("chunks") if isinstance(committable, dict) else None
        if (
            not isinstance(key, str)
            or not key.startswith(self._stage_prefix)
            or not isinstance(chunks, int)
            or chunks < 1
        ):
            raise SnapshotError(
                f"redis sink step={self.ctx.step!r} subtask={self.ctx.subtask}: committable "
                f"{committable!r} of checkpoint {checkpoint_id} is not a Redis sink committable "
                f"of this subtask (expected {{'key': '{self._stage_prefix}<token>', 'chunks': "
                "<n >= 1>, 'ops': <n>}); was the step's sink replaced since the snapshot was "
                "taken?",
                reason="corrupt",
            )
        return key, chunks

    def _unencodable(self, value: Any, exc: BaseException) -> SerializationError:
        return SerializationError(
            f"redis sink step={self.ctx.step!r} subtask={self.ctx.subtask} could not turn a "
            f"value of type {type(value).__name__} into a Redis operation: "
            f"{type(exc).__name__}: {exc}. Convert it in a map step before the sink, or fix the "
            "sink's key/field/value/command functions"
        )


# -- operations ----------------------------------------------------------------------------------

Encoder = Callable[[Sequence[Any]], list[Any]]


def _encoder(
    sink: RedisSink, unencodable: Callable[[Any, BaseException], SerializationError]
) -> tuple[Encoder, bool]:
    """``(encode(values) -> ops, upsert)``: ops are MessagePack arrays of strings, or for
    upsert modes ``(target, tail)`` pairs whose concatenation is the op (last write wins)."""
    mode, reserved = sink.mode, sink._reserved
    value_of = sink.value or _identity
    key_of = _part(sink.key, reserved, "key")
    field_of = _part(sink.field, None, "field") if sink.field is not None else None

    def one(value: Any) -> Any:
        key = key_of(value)
        if mode == "set":
            return _mp_array(3) + _SET + key, _mp_str(_arg(value_of(value)))
        if mode == "hash":
            assert field_of is not None
            return _mp_array(4) + _HSET + key + field_of(value), _mp_str(_arg(value_of(value)))
        if mode == "list":
            return _mp_array(3) + _RPUSH + key + _mp_str(_arg(value_of(value)))
        if mode == "incr":
            amount = _mp_str(_int(value_of(value), "amount"))
            if field_of is None:
                return _mp_array(3) + _INCRBY + key + amount
            return _mp_array(4) + _HINCRBY + key + field_of(value) + amount
        return _xadd(key, value_of(value))

    def command(value: Any) -> list[bytes]:
        result = sink.command(value)  # type: ignore[misc]
        if result is None:
            return []
        if isinstance(result, tuple):
            return [_command_op(result, reserved)]
        if isinstance(result, list):
            return [_command_op(op, reserved) for op in result]
        raise TypeError(f"command returned {type(result).__name__}, not a tuple or a list")

    def encode(values: Sequence[Any]) -> list[Any]:
        ops: list[Any] = []
        for value in values:
            try:
                if mode == "command":
                    ops.extend(command(value))
                else:
                    ops.append(one(value))
            except Exception as exc:
                raise unencodable(value, exc) from exc
        return ops

    return encode, mode in ("set", "hash")


def _part(part: Any, reserved: bytes | None, what: str) -> Callable[[Any], bytes]:
    """A function ``value -> encoded key or field`` from a constant or a function."""
    if isinstance(part, (str, bytes)):
        constant = _mp_str(_key_bytes(part))
        return lambda _value: constant

    def of(value: Any) -> bytes:
        data = _key_bytes(part(value), what)
        if reserved is not None:
            _check_target(data, reserved, what)
        return _mp_str(data)

    return of


def _command_op(op: Any, reserved: bytes) -> bytes:
    if not isinstance(op, tuple) or len(op) < 2 or not isinstance(op[0], str):
        raise TypeError(f"an operation is a tuple (op, key, *args), got {op!r}")
    name = op[0].upper()
    spec = OPERATIONS.get(name)
    if spec is None:
        raise ValueError(f"operation {op[0]!r} is not allowed; use one of {', '.join(OPERATIONS)}")
    minimum, maximum, pairs, ints = spec
    args = op[2:]
    if not minimum <= len(args) <= (_MAX_ARGS if maximum is None else maximum) or (
        pairs and len(args) % 2
    ):
        shape = f"exactly {maximum}" if maximum == minimum else f"at least {minimum}"
        raise ValueError(
            f"{name} takes {shape} argument(s) after the key{' in pairs' if pairs else ''} "
            f"(at most {_MAX_ARGS}), got {len(args)}"
        )
    key = _key_bytes(op[1])
    _check_target(key, reserved, "key")
    parts = [_mp_str(name.encode()), _mp_str(key)]
    if name == "XADD":
        parts.append(_mp_str(b"*"))
    for i, arg in enumerate(args):
        parts.append(_mp_str(_int(arg, f"{name} argument {i + 1}") if i in ints else _arg(arg)))
    return _mp_array(len(parts)) + b"".join(parts)


def _xadd(key: bytes, value: Any) -> bytes:
    if isinstance(value, Mapping):
        if not value:
            raise ValueError("a stream entry needs at least one field (got an empty mapping)")
        fields = [_mp_str(_key_bytes(f, "field")) + _mp_str(_arg(v)) for f, v in value.items()]
    else:
        fields = [_VALUE + _mp_str(_arg(value))]
    return _mp_array(3 + 2 * len(fields)) + _XADD + key + _STAR + b"".join(fields)


def _identity(value: Any) -> Any:
    return value


def _arg(value: Any) -> bytes:
    """``bytes`` and ``str`` as they are, anything else as JSON."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return orjson.dumps(value)


def _key_bytes(part: Any, what: str = "key") -> bytes:
    if isinstance(part, bytes):
        return part
    if isinstance(part, str):
        return part.encode()
    if isinstance(part, int) and not isinstance(part, bool):
        return str(part).encode()
    raise TypeError(f"{what} must be str, bytes or int, got {type(part).__name__}")


def _int(amount: Any, what: str) -> bytes:
    if isinstance(amount, int) and not isinstance(amount, bool):
        return str(amount).encode()
    raise TypeError(f"{what} must be an int, got {type(amount).__name__}")


def _check_target(key: bytes, reserved: bytes, what: str) -> None:
    if key.startswith(reserved):
        raise ValueError(
            f"{what} {key!r} lies in the sink's namespace {reserved.decode()!r}, which holds its "
            "guards and staged epochs; choose another key or another namespace="
        )


def _check_part(what: str, part: Any, *, required: bool) -> None:
    if part is None:
        if required:
            raise ConfigError(f"RedisSink needs {what}=<str constant or function value -> {what}>")
        return
    if not isinstance(part, (str, bytes)) and not callable(part):
        raise ConfigError(f"RedisSink {what}= must be a str, bytes or a function, got {part!r}")


# MessagePack, just what Redis's cmsgpack reads back as Lua strings and tables.
def _mp_str(data: bytes) -> bytes:
    n = len(data)
    if n < 32:
        return bytes((0xA0 | n,)) + data
    if n < 0x100:
        return b"\xd9" + bytes((n,)) + data
    if n < 0x10000:
        return b"\xda" + n.to_bytes(2, "big") + data
    return b"\xdb" + n.to_bytes(4, "big") + data


def _mp_array(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    if n < 0x10000:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


_SET, _HSET, _RPUSH = _mp_str(b"SET"), _mp_str(b"HSET"), _mp_str(b"RPUSH")
_INCRBY, _HINCRBY = _mp_str(b"INCRBY"), _mp_str(b"HINCRBY")
_XADD, _STAR, _VALUE = _mp_str(b"XADD"), _mp_str(b"*"), _mp_str(b"value")


# -- checks --------------------------------------------------------------------------------------


def _check_checkpoint_id(checkpoint_id: int) -> None:
    if isinstance(checkpoint_id, bool) or not isinstance(checkpoint_id, int):
        raise DefinitionError(f"checkpoint id must be an int, got {checkpoint_id!r}")
    if checkpoint_id < 1:
        raise DefinitionError(f"checkpoint id {checkpoint_id} must be >= 1")


def _check_server(info: Mapping[str, Any], where: str) -> None:
    version = str(info.get("redis_version", "0"))
    numbers = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if numbers < _MIN_VERSION:
        raise ConfigError(
            f"Redis at {where} is version {version}; the Redis sink needs 5.0 or newer "
            "(streams, effects replication of scripts)"
        )
    if info.get("cluster_enabled"):
        raise ConfigError(
            f"Redis at {where} runs in cluster mode; the Redis sink applies an epoch with one "
            "script over keys in any hash slot, which a cluster refuses. Point it at a "
            "standalone Redis (a primary with replicas or Sentinel is fine)"
        )
    policy = str(info.get("maxmemory_policy", "noeviction"))
    if policy.startswith("allkeys-"):
        raise ConfigError(
            f"Redis at {where} has maxmemory-policy {policy}: it may evict the sink's epoch "
            "guards and staged epochs, which would duplicate or lose output. Use noeviction "
            "(or a volatile-* policy) for the sink's database"
        )
    if not info.get("aof_enabled"):
        log.warning(
            "redis persistence url=%s aof_enabled=0: staged epochs and guards are lost if Redis "
            "restarts (the job then fails with a missing-epoch error); enable appendonly",
            where,
        )


def _text(data: bytes | str) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def _is_redis_url(url: str) -> bool:
    return url.split("://", 1)[0] in ("redis", "rediss", "unix") and "://" in url


def _redact(url: str) -> str:
    """The URL without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[-1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + netloc))
