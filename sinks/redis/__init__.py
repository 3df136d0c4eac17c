"""Redis sink: an epoch's writes are staged in Redis, then applied by one epoch-guarded script.

During an epoch, operations are buffered in memory and spilled to the epoch's staging hash in
chunks. ``prepare(n)`` stages the rest (one round trip) and returns ``{"key", "chunks", "ops"}``.
``commit(n, committable)`` runs one Lua script that atomically: does nothing if the guard is
``>= n`` (already committed); else applies the staged operations, sets the guard to ``n`` and
deletes the staging hash. A replayed epoch is therefore a no-op, and ``commit`` is idempotent.
See docs/sink-redis.md for the semantics, the limits and the server settings it relies on.

Modules: :mod:`sinks.redis.sink` (configuration, preflight), :mod:`sinks.redis.writer` (staging
and committing epochs), :mod:`sinks.redis.commands` (what a value becomes, encoded) and
:mod:`sinks.redis.server` (the keys, the commit script, the server checks). Inside this package,
``import redis`` is the redis-py library: imports are absolute.
"""

from sinks.redis.commands import OPERATIONS
from sinks.redis.sink import MODES, RedisSink
from sinks.redis.writer import RedisSinkWriter

__all__ = ["MODES", "OPERATIONS", "RedisSink", "RedisSinkWriter"]
