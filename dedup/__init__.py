"""Record-ID deduplication.

- :mod:`dedup.staged`: readers of a staged Kafka sink drop re-published repeats
  (:class:`DedupConsumer`, :class:`StagedDeduplicator`).

Windowed Bloom filters, the Redis ID store and watermark GC join this package later (issue 5).
"""

from dedup.staged import DedupConsumer, StagedDeduplicator

__all__ = ["DedupConsumer", "StagedDeduplicator"]
