"""Record-ID deduplication, a library of its own: it imports nothing from the engine
(:mod:`processor`); the engine's ``dedup`` step is :mod:`processor.runtime.operators.dedup_step`.

Record-ID deduplication (docs/dedup.md).

- :mod:`dedup.ids`: deterministic 127-bit record IDs.
- :mod:`dedup.buckets`: time-bucketed Bloom filters (rbloom), saved into snapshots.
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
