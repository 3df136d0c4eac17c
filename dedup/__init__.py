"""Record-ID deduplication: record IDs, windowed Bloom filters, the Redis ID store, watermark GC.

Reserved for the deduplication milestone (see CHANGELOG.md); nothing is exported yet.
"""

__all__: list[str] = []
