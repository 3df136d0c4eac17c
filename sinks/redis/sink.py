"""The Redis sink's configuration, and its start-up check of the server (preflight)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import redis

from dedup.store import redis_client
from processor.contracts import SinkContext
from processor.errors import ConfigError
from sinks.redis.commands import _check_target, _key_bytes, _mp_array, _mp_str
from sinks.redis.server import _COMMIT_LUA, _PROBE_LUA, _check_server, _is_redis_url, _redact
from sinks.redis.writer import RedisSinkWriter

__all__ = ["MODES", "RedisSink"]

log = logging.getLogger(__name__)

#: Named modes of :class:`RedisSink` -> what each value becomes.
MODES = {
    "set": "SET key value",
    "hash": "HSET key field value",
    "list": "RPUSH key value",
    "stream": "XADD key * field value [field value ...]",
    "incr": "INCRBY key amount, or HINCRBY key field amount when field= is given",
    "command": "whatever command(value) returns: (op, key, *args) or a list of them",
}


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


def _check_part(what: str, part: Any, *, required: bool) -> None:
    if part is None:
        if required:
            raise ConfigError(f"RedisSink needs {what}=<str constant or function value -> {what}>")
        return
    if not isinstance(part, (str, bytes)) and not callable(part):
        raise ConfigError(f"RedisSink {what}= must be a str, bytes or a function, got {part!r}")
