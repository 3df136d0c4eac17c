"""Record-ID deduplication, a library of its own: it imports nothing from the engine
(:mod:`processor`); the engine's ``dedup`` step is :mod:`processor.runtime.operators.dedup_step`.

Record-ID deduplication (docs/dedup.md).

- :mod:`dedup.ids`: deterministic 127-bit record IDs.
- :mod:`dedup.buckets`: time-bucketed Bloom filters (rbloom), saved into snapshots.
- :mod:`dedup.native`: the optional C accelerator (``dedup/_native.c``) of the IDs and the
  filters, bit for bit the same as the Python path.
- :mod:`dedup.store`: the Redis ID store, one round trip per batch, failing closed.
- :mod:`dedup.core`: :class:`Deduplicator`, filters in front of the store, agreeing with the
  restored checkpoint; watermark garbage collection.
- :mod:`dedup.rescale`: the IDs across a change of the job's parallelism (a prefix per shape
  epoch, merged states, inherited read-only prefixes, the sweep of retired ones).
- :mod:`dedup.errors`: the library's errors (it imports nothing from the engine).
- :mod:`dedup.consumer`: :class:`IdDedupConsumer`, exactly-once reading for services without
  the engine.
- :mod:`dedup.staged`: readers of a staged Kafka sink drop re-published repeats
  (:class:`DedupConsumer`, :class:`StagedDeduplicator`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The names below load their module on first use (PEP 562): a worker whose pipeline has no
# dedup step imports dedup.ids alone, not Redis's client, rbloom and the consumer (25 ms of
# every worker's and runner's start; bench/RESULTS.md, "Start-up: 50 ms per new client").
_HOMES = {
    "IdDedupConsumer": "dedup.consumer",
    "sink_record_id": "dedup.consumer",
    "Deduplicator": "dedup.core",
    "DedupStats": "dedup.core",
    "MemoryIdStore": "dedup.core",
    "DedupConfigError": "dedup.errors",
    "DedupError": "dedup.errors",
    "RedisUnavailable": "dedup.errors",
    "derived_id": "dedup.ids",
    "emission_id": "dedup.ids",
    "source_id": "dedup.ids",
    "value_id": "dedup.ids",
    "InheritingIdStore": "dedup.rescale",
    "dedup_prefix": "dedup.rescale",
    "merge_dedup_states": "dedup.rescale",
    "referenced_prefixes": "dedup.rescale",
    "sweep_retired": "dedup.rescale",
    "DedupConsumer": "dedup.staged",
    "StagedDeduplicator": "dedup.staged",
    "RedisIdStore": "dedup.store",
}

if TYPE_CHECKING:
    from dedup.consumer import IdDedupConsumer, sink_record_id
    from dedup.core import Deduplicator, DedupStats, MemoryIdStore
    from dedup.errors import DedupConfigError, DedupError, RedisUnavailable
    from dedup.ids import derived_id, emission_id, source_id, value_id
    from dedup.rescale import (
        InheritingIdStore,
        dedup_prefix,
        merge_dedup_states,
        referenced_prefixes,
        sweep_retired,
    )
    from dedup.staged import DedupConsumer, StagedDeduplicator
    from dedup.store import RedisIdStore


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'dedup' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


__all__ = [
    "DedupConfigError",
    "DedupConsumer",
    "DedupError",
    "DedupStats",
    "Deduplicator",
    "IdDedupConsumer",
    "InheritingIdStore",
    "MemoryIdStore",
    "RedisIdStore",
    "RedisUnavailable",
    "StagedDeduplicator",
    "dedup_prefix",
    "derived_id",
    "emission_id",
    "merge_dedup_states",
    "referenced_prefixes",
    "sink_record_id",
    "source_id",
    "sweep_retired",
    "value_id",
]
