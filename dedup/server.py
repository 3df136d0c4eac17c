"""What the ID store needs of its Redis server, checked once at start-up.

- **Reachable**, within a few seconds: otherwise a job would start, time its checkpoints out
  and name Redis only when the store gives up (minutes later).
- **No eviction of keys without a TTL.** The ID store's keys have no TTL. ``allkeys-*``
  policies evict any key when memory is full, one by one: an evicted bucket is a set of IDs
  forgotten without a trace that the write markers (:mod:`dedup.store`) could see, since those
  detect the loss of a *suffix* of Redis's writes (a restart, a failover). ``volatile-*`` and
  ``noeviction`` never evict them.
- **Persistence**: without ``appendonly yes`` a Redis restart loses the IDs written since the
  last RDB save (all of them with no save either). The job then refuses to go on
  (:class:`dedup.errors.RedisDataLost`): it is safe, but it stops. That is worth one warning.

:func:`evicting_policy` and :func:`persistent` read a server's ``INFO``; the Redis sink
(:mod:`sinks.redis.server`) applies them to its own keys, with its own messages.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import redis

from dedup.errors import DedupConfigError
from dedup.store import redis_client, redis_where

__all__ = ["allow_eviction", "check_redis", "evicting_policy", "persistent"]

log = logging.getLogger(__name__)

DOCS = "docs/dedup.md, 'Redis durability'"


def evicting_policy(info: Mapping[str, Any]) -> str | None:
    """The ``maxmemory-policy`` of a server's ``INFO`` if it may evict keys without a TTL
    (``allkeys-*``), else ``None``."""
    policy = str(info.get("maxmemory_policy", "noeviction"))
    return policy if policy.startswith("allkeys-") else None


def persistent(info: Mapping[str, Any]) -> bool:
    """Whether a server's ``INFO`` says it writes an append-only file (``appendonly yes``):
    the only persistence that keeps writes made since the last RDB save across a restart."""
    return bool(int(info.get("aof_enabled", 0) or 0))


def check_redis(
    url: str | None,
    *,
    what: str,
    source: str,
    allow_eviction: bool = False,
    timeout_s: float = 5.0,
) -> None:
    """Checks the server at ``url`` (default ``EOSFLOW_REDIS_URL``) for an ID store: reachable
    within ``timeout_s``, no ``allkeys-*`` eviction (unless ``allow_eviction``); warns once
    when it keeps no append-only file.

    Args:
        what: who needs it, for the messages (``"dedup step 'unique'"``).
        source: where the URL came from, for the messages (``"EOSFLOW_REDIS_URL"``).

    Raises:
        DedupConfigError: no URL, not reachable, or an evicting policy; says how to fix it.
    """
    client = redis_client(url, timeout_s=timeout_s, name="eosflow-preflight")
    where = redis_where(client)
    try:
        try:
            info = client.info()
        except (redis.RedisError, OSError) as exc:  # refused, timed out, AUTH refused ...
            reason = str(exc).rstrip(".")
            raise DedupConfigError(
                f"{what} keeps record IDs in Redis, which did not answer at {where} ({source}) "
                f"within {timeout_s:g}s: {type(exc).__name__}: {reason}. Start Redis there "
                f"('eosflow dev up' starts one on loopback), or point {source} at a running one"
            ) from None
    finally:
        client.close()
    policy = evicting_policy(info)
    if policy is not None and not allow_eviction:
        raise DedupConfigError(
            f"Redis at {where} ({source}) has maxmemory-policy {policy}: when memory is full it "
            f"evicts any key, also the record IDs of {what}, and copies of the evicted records "
            "would pass as new. Fix: redis-cli -u URL CONFIG SET maxmemory-policy noeviction "
            "(and maxmemory-policy noeviction in redis.conf), or give the IDs a Redis of their "
            f"own; to accept the risk, set EOSFLOW_DEDUP_ALLOW_EVICTION=1 ({DOCS})"
        )
    if policy is not None:
        log.warning(
            "redis url=%s maxmemory-policy=%s may evict record IDs of %s; allowed by "
            "EOSFLOW_DEDUP_ALLOW_EVICTION: copies of evicted records pass as new",
            where, policy, what,
        )  # fmt: skip
    if not persistent(info):
        log.warning(
            "redis url=%s appendonly=no: a Redis restart loses the record IDs of %s written "
            "since its last save, and the job then refuses to go on until they are back; set "
            "appendonly yes (%s)",
            where, what, DOCS,
        )  # fmt: skip


def allow_eviction(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the user accepted an evicting policy (``EOSFLOW_DEDUP_ALLOW_EVICTION=1``)."""
    value = (os.environ if environ is None else environ).get("EOSFLOW_DEDUP_ALLOW_EVICTION", "")
    return value.strip().lower() in ("1", "true", "yes")
