"""The record IDs a savepoint carries, so that it restores after the IDs left Redis.

A dedup snapshot state holds the Bloom filters and the *lineage* of the IDs it relies on; the
IDs themselves are in Redis (:mod:`dedup.store`). A checkpoint is restored while Redis still
holds them. A savepoint belongs to the user (Flink's rule) and must restore later, after
``eosflow reset`` deleted the job's keys, after the GC deleted buckets that a newer checkpoint
no longer needed, or on another Redis. So a savepoint carries a copy of the IDs its dedup
states rely on (:func:`saved_ids`), and its restore writes them back (:func:`load_ids`) before
any worker starts.

What is copied, per prefix (the subtask's own and every inherited one, :mod:`dedup.rescale`):
every entry of a bucket not wholly below the state's cut-off whose tag the state's lineage
accepts (``run`` in the lineage, ``epoch`` at most its cut). Entries of other runs are absent
for that lineage anyway, and buckets below the cut-off hold only IDs older than the horizon.
The copy is taken after checking that the store still accounts for the state's write markers
(:class:`~dedup.errors.RedisDataLost` otherwise: a savepoint never copies a store that lost
IDs).

What is written back: the entries with their own tags, the bucket index, the write markers
raised to at least the counts the state expects (the entries they vouch for for this lineage
are back), and the GC mark lowered to the cut-off's bucket (every live bucket of the lineage is
back). Idempotent.

Invariants:
    After :func:`load_ids`, a :class:`~dedup.core.Deduplicator` restoring the state finds
    every ID it would have found when the savepoint was taken, and its write-marker checks
    pass: no copy passes, no :class:`~dedup.errors.RedisDataLost`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dedup.ids import ID_BYTES
from dedup.store import RedisIdStore, decode_tag

__all__ = ["SAVED_VERSION", "load_ids", "saved_ids"]

#: The layout of :func:`saved_ids`'s value (a restore refuses another).
SAVED_VERSION = 1
_ENTRY = ID_BYTES + 16  # an ID and its tag
MIN_TS = -(2**63)

# KEYS[1] the GC mark; ARGV[1] the mark to lower it to (never raised here).
_LOWER_MARK_LUA = """
local old = redis.call('GET', KEYS[1])
if old and tonumber(ARGV[1]) < tonumber(old) then redis.call('SET', KEYS[1], ARGV[1]) end
return 1
"""

# KEYS[1] the write markers; ARGV pairs (run, count): each raised to at least count.
_RAISE_WRITTEN_LUA = """
for i = 1, #ARGV, 2 do
  local old = tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '0')
  if tonumber(ARGV[i + 1]) > old then redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
end
return 1
"""


def _run(store: RedisIdStore, script: Any, key: str, args: list[int]) -> None:
    """``script`` on ``key`` with the store's retries (fail closed, as every store call)."""

    def call() -> Any:
        return script(keys=[key], args=args)

    store._call("load", call)


def _ints(mapping: Mapping[Any, Any] | None) -> dict[int, int]:
    return {int(k): int(v) for k, v in (mapping or {}).items()}


def saved_ids(client: Any, prefix: str, state: Mapping[str, Any]) -> dict[str, Any]:
    """The IDs the dedup snapshot ``state`` of the subtask whose own prefix is ``prefix``
    relies on, read from Redis (see the module docstring): a value of ints, strings and
    bytes, for the savepoint's files.

    Raises:
        RedisDataLost: the store no longer accounts for a write marker the state expects.
        RedisUnavailable: Redis did not answer.
    """
    lineage = _ints(state["lineage"])
    bucket_ms, cutoff = int(state["bucket_ms"]), int(state["cutoff"])
    scopes = [(prefix, _ints(state.get("written")))]
    scopes += [(e["prefix"], _ints(e.get("written"))) for e in state.get("inherited") or []]
    prefixes = []
    for name, written in scopes:
        store = RedisIdStore(client, name)
        if written:
            store.verify(written)
        buckets: dict[int, bytes] = {}
        for bucket in store.buckets():
            if bucket + bucket_ms <= cutoff:
                continue  # older than the horizon: the restored state never asks
            kept = bytearray()
            for record_id, tag in store.scan_bucket(bucket):
                run, epoch = decode_tag(tag)
                cut = lineage.get(run)
                if cut is not None and epoch <= cut:
                    kept += record_id.to_bytes(ID_BYTES, "little") + tag
            if kept:
                buckets[bucket] = bytes(kept)
        prefixes.append({"prefix": name, "written": written, "buckets": buckets})
    return {
        "version": SAVED_VERSION,
        "bucket_ms": bucket_ms,
        "cutoff": cutoff,
        "prefixes": prefixes,
    }


def load_ids(client: Any, saved: Mapping[str, Any]) -> int:
    """Writes the IDs of :func:`saved_ids` back into Redis; returns how many (see the module
    docstring).

    Raises:
        ValueError: ``saved`` has another layout version.
        RedisUnavailable: Redis did not answer.
    """
    if saved.get("version") != SAVED_VERSION:
        raise ValueError(
            f"saved dedup IDs of layout version {saved.get('version')!r}; this eosflow reads "
            f"version {SAVED_VERSION}"
        )
    bucket_ms, cutoff = int(saved["bucket_ms"]), int(saved["cutoff"])
    lower = client.register_script(_LOWER_MARK_LUA)
    raise_written = client.register_script(_RAISE_WRITTEN_LUA)
    loaded = 0
    for entry in saved["prefixes"]:
        store = RedisIdStore(client, entry["prefix"])
        by_tag: dict[bytes, dict[int, list[int]]] = {}
        for bucket, blob in entry["buckets"].items():
            for at in range(0, len(blob), _ENTRY):
                record_id = int.from_bytes(blob[at : at + ID_BYTES], "little")
                tag = bytes(blob[at + ID_BYTES : at + _ENTRY])
                by_tag.setdefault(tag, {}).setdefault(int(bucket), []).append(record_id)
                loaded += 1
        for tag, entries in by_tag.items():
            store.insert(entries, tag)
        written = _ints(entry["written"])
        args: list[int] = [n for run, count in written.items() for n in (run, count)]
        if args:  # after the IDs: the markers vouch for what is back
            _run(store, raise_written, store._written, args)
        mark = max(cutoff - cutoff % bucket_ms, MIN_TS)
        _run(store, lower, store._mark, [mark])
    return loaded
