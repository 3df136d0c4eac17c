"""What the Redis sink keeps in Redis and runs there: its keys, the commit script, and the
checks that a server can run it.

Keys of one sink subtask (``<base>`` is ``<namespace>:<job>:<step>:<subtask>``; the namespace is
``eosflow:sink`` unless configured)::

    <base>:epoch            hash: ``epoch`` = last committed checkpoint id (the guard);
                            ``partial``/``applied`` = progress of a commit that a command failed
    <base>:staged           set: names of this subtask's staging hashes (for recover)
    <base>:stage:<token>    hash: chunk number -> MessagePack array of operations; one per epoch
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from dedup.server import evicting_policy, persistent
from processor.errors import ConfigError
from sinks.redis.commands import OPERATIONS

__all__: list[str] = []

log = logging.getLogger(__name__)

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
    policy = evicting_policy(info)
    if policy is not None:
        raise ConfigError(
            f"Redis at {where} has maxmemory-policy {policy}: it may evict the sink's epoch "
            "guards and staged epochs, which would duplicate or lose output. Use noeviction "
            "(or a volatile-* policy) for the sink's database"
        )
    if not persistent(info):
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
