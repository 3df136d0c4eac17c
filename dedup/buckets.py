"""Time-bucketed Bloom filters: "surely new" without I/O, forgetting by whole buckets.

Pure logic: time comes in as arguments (record timestamps, a watermark), never from a clock.

An ID is recorded in the bucket of its record's timestamp (``ts - ts % bucket_ms``), so
buckets can be dropped whole when the watermark has passed them by the horizon; a Bloom filter
cannot forget one element. A lookup probes every live filter, because a duplicate may carry
another timestamp than its original (a re-sent event).

Sizing: each filter is an rbloom filter for ``expected_ids`` IDs at ``fp_rate / max_filters``,
so with up to ``max_filters`` live filters the chance that a fresh ID hits some filter stays
below ``fp_rate``. A bucket that receives more than ``expected_ids`` IDs gets another filter
(its false-positive rate would grow otherwise); that costs one more probe per lookup and is
logged once per bucket, so ``expected_ids`` can be raised.

**Sparse filters are probed as unions.** A fresh ID must miss every live filter, and one probe
costs about 0.2 us (rbloom calls the Python hash function and converts the 127-bit ID each
time), so the probes are most of a fresh ID's cost. Filters are often far emptier than
``expected_ids``, and there are more of them than the horizon's buckets while the watermark lags
the newest records (a source reading its partitions unevenly). The OR of Bloom filters of equal
parameters is exactly the filter of their IDs' union, so filters whose IDs together fit in half
a filter are probed as one union (one probe instead of several, at no more than one filter's
false-positive rate), and every ID added to a member filter is added to its union too. The
unions are a cache rebuilt from the filters whenever the set of filters changes or a union
would exceed half a filter: the filters alone are the state (snapshots, restores).

The filters hash with ``int.__index__``: IDs are uniform 128-bit ints already
(:mod:`dedup.ids`), and a filter whose hash is not the built-in ``hash`` can be saved into a
snapshot (``save_bytes``) and loaded in another process.

Invariants:
    No false negatives: every ID passed to :meth:`add` is reported by :meth:`might_contain`
    until its bucket is dropped (a union holds every ID of its member filters).
    :meth:`drop_before` drops a bucket only when every timestamp it covers is below the cutoff,
    so it never forgets an ID of a timestamp at or after it.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from rbloom import Bloom

import dedup.native as accel  # its ``native``: read at each use, so one switch turns it off
from dedup.native import NativeBloom

__all__ = ["BloomBuckets", "merge_snapshots"]

log = logging.getLogger(__name__)

_HASH = int.__index__
#: IDs added between two packings of the unions, per live filter and per ``expected_ids``
#: (:meth:`BloomBuckets._reindex`): OR-ing a filter costs about 0.3 ns per expected ID (35 us
#: for 100,000), so packing costs at most ~30 ns per ID added.
_IDS_PER_REPACK = 0.01


class _Union:
    """A filter equal to the OR of some buckets' (single) filters, probed instead of them."""

    __slots__ = ("bloom", "count")

    def __init__(self, bloom: Bloom, count: int) -> None:
        self.bloom = bloom
        self.count = count


class BloomBuckets:
    """Bloom filters per time bucket. See the module docstring.

    Args:
        bucket_ms: length of a bucket in milliseconds.
        expected_ids: IDs one filter holds at its false-positive rate.
        fp_rate: target chance that a fresh ID is reported as possibly seen, over all live
            filters (each filter gets ``fp_rate / max_filters``).
        max_filters: how many filters are usually live (buckets in a horizon, plus one).
    """

    def __init__(
        self, *, bucket_ms: int, expected_ids: int, fp_rate: float, max_filters: int
    ) -> None:
        if bucket_ms < 1:
            raise ValueError(f"bucket_ms must be >= 1, got {bucket_ms}")
        if expected_ids < 1:
            raise ValueError(f"expected_ids must be >= 1, got {expected_ids}")
        if not 0 < fp_rate < 1:
            raise ValueError(f"fp_rate must be in (0, 1), got {fp_rate}")
        if max_filters < 1:
            raise ValueError(f"max_filters must be >= 1, got {max_filters}")
        self.bucket_ms = bucket_ms
        self.expected_ids = expected_ids
        self.fp_rate = fp_rate
        self.filter_fp = fp_rate / max_filters
        # bucket start -> its filters (the last one takes new IDs) and how many IDs it took
        self.buckets: dict[int, list[Any]] = {}  # rbloom Blooms, or NativeBlooms
        self.counts: dict[int, int] = {}
        # __contains__ of every live filter or of the union standing for it, newest bucket first
        self._probes: list[Any] = []
        self._union_of: dict[int, _Union] = {}  # bucket start -> the union holding its filter
        self._added = 0  # IDs added since the unions were last packed
        self._repack_at: int | None = None  # when _added reaches it, pack again
        # with the C accelerator (dedup.native): the probed filters' bits and k, in _probes' order
        self._probe_bits: tuple[list[bytearray], list[int]] | None = None
        self._blank: bytes | None = None  # an empty filter's save_bytes (rbloom's sizing)

    def _new_filter(self) -> Any:
        if accel.native is None:
            return Bloom(self.expected_ids, self.filter_fp, _HASH)
        if self._blank is None:  # rbloom's sizing (bits and k) of these parameters, once
            self._blank = Bloom(self.expected_ids, self.filter_fp, _HASH).save_bytes()
        return NativeBloom.load_bytes(self._blank)

    @staticmethod
    def _load_filter(blob: bytes) -> Any:
        """A saved filter (rbloom's ``save_bytes``, which :class:`NativeBloom` writes too)."""
        if accel.native is None:
            return Bloom.load_bytes(blob, _HASH)
        return NativeBloom.load_bytes(blob)

    def _reindex(self) -> None:
        """Rebuilds the probes after the filters changed: each bucket's union (once), or its
        own filters. The unions are re-packed when that is cheap against the IDs added since
        they last were: at most once per ``_IDS_PER_REPACK * expected_ids`` IDs per live
        filter."""
        n_filters = sum(len(f) for f in self.buckets.values())
        due = math.ceil(_IDS_PER_REPACK * self.expected_ids) * n_filters
        packable = self._probe_list()
        if packable > 1 and self._added >= due:
            self._repack()
            packable = self._probe_list()
        self._repack_at = due if packable > 1 else None

    def _probe_list(self) -> int:
        """Sets the probes; returns how many filters are probed alone that a union could take."""
        probes: list[Any] = []
        probed: list[Any] = []  # the filters behind probes
        seen: set[int] = set()
        room = self.expected_ids // 2
        packable = 0
        for start in sorted(self.buckets, reverse=True):
            union = self._union_of.get(start)
            if union is None:
                filters = self.buckets[start]
                probes.extend(f.__contains__ for f in reversed(filters))
                probed.extend(reversed(filters))
                packable += len(filters) == 1 and self.counts.get(start, 0) <= room
            elif id(union) not in seen:
                seen.add(id(union))
                probes.append(union.bloom.__contains__)
                probed.append(union.bloom)
        self._probes = probes
        self._probe_bits = None
        if accel.native is not None:  # then every filter is a NativeBloom (_new_filter)
            self._probe_bits = ([f.bits for f in probed], [f.k for f in probed])
        return packable

    def _repack(self) -> None:
        """Packs the buckets that have one filter, newest first, into unions of at most half
        a filter's IDs (so that a union takes as many again before a bucket must leave it)."""
        self._added = 0
        self._union_of = {}
        room = self.expected_ids // 2
        group: list[int] = []  # bucket starts of the union being packed
        count = 0
        for start in [*sorted(self.buckets, reverse=True), None]:
            n = 0 if start is None else self.counts.get(start, 0)
            if start is None or count + n > room:
                if len(group) > 1:
                    self._or(group, count)
                group, count = [], 0
            if start is not None and len(self.buckets[start]) == 1 and n <= room:
                group.append(start)
                count += n

    def _or(self, starts: list[int], count: int) -> None:
        bloom = self.buckets[starts[0]][0].copy()
        try:
            for start in starts[1:]:
                bloom |= self.buckets[start][0]
        except ValueError:  # another size or rate (an older snapshot's): probed alone
            return
        self._union_of.update(dict.fromkeys(starts, _Union(bloom, count)))

    @property
    def filter_bytes(self) -> int:
        """Memory of one filter, in bytes."""
        return math.ceil(int(self._new_filter().size_in_bits) / 8)

    def bucket_of(self, ts_ms: int) -> int:
        return ts_ms - ts_ms % self.bucket_ms

    def might_contain(self, record_id: int) -> bool:
        """``False``: surely never added (or its bucket was dropped)."""
        return any(probe(record_id) for probe in self._probes)

    def decide(
        self, ids: list[int], timestamps: list[int], cutoff: int, pending: set[int]
    ) -> tuple[list[bool], dict[int, list[int]], list[int], list[int], int] | None:
        """With the C accelerator, :meth:`dedup.Deduplicator.check`'s pass over a batch in one
        call (``decide`` in ``dedup/_native.c``), every live filter probed: ``(verdicts, fresh
        IDs by bucket start, indexes of filter hits, indexes older than cutoff, copies of IDs
        in pending)``; the fresh IDs are added to ``pending``. ``None`` without it (or for a
        batch with other than int64 timestamps and exact ``int`` IDs; nothing changed then)."""
        probe_bits = self._probe_bits
        if probe_bits is None:
            return None
        assert accel.native is not None
        return accel.native.decide(  # type: ignore[no-any-return]
            ids, timestamps, cutoff, probe_bits[0], probe_bits[1], pending, self.bucket_ms
        )

    def add(self, record_id: int, ts_ms: int) -> None:
        self.add_many(ts_ms - ts_ms % self.bucket_ms, [record_id])

    def add_many(self, start: int, ids: list[int]) -> None:
        """Adds IDs to the bucket starting at ``start`` (one C-level ``update`` per filter, and
        one for the union standing for it, if any)."""
        filters = self.buckets.get(start)
        count = self.counts.get(start, 0)
        regroup = filters is None
        if filters is None:
            filters = self.buckets[start] = [self._new_filter()]
        self.counts[start] = count + len(ids)
        self._added += len(ids)
        union = self._union_of.get(start)
        if union is not None:
            if (
                union.count + len(ids) <= self.expected_ids
                and count + len(ids) <= self.expected_ids
            ):
                union.bloom.update(ids)
                union.count += len(ids)
            else:  # the union would pass one filter's rate: the bucket leaves it
                del self._union_of[start]
                regroup = True
        cap = self.expected_ids
        while ids:
            room = cap - count % cap if count % cap or count == 0 else 0
            if room == 0:
                filters.append(self._new_filter())
                regroup = True
                if len(filters) == 2:  # once per bucket
                    log.warning(
                        "dedup bucket start_ms=%d holds more than expected_ids=%d IDs: a "
                        "filter was added (one more probe per lookup); raise expected_ids",
                        start, cap,
                    )  # fmt: skip
                room = cap
            filters[-1].update(ids[:room])
            count += min(room, len(ids))
            ids = ids[room:]
        # after the IDs are in the filters: a new union is OR-ed from them
        if regroup or (self._repack_at is not None and self._added >= self._repack_at):
            self._reindex()

    def drop_before(self, cutoff_ms: int) -> list[int]:
        """Drops the buckets whose every timestamp is below ``cutoff_ms``; returns their starts."""
        gone = [s for s in self.buckets if s + self.bucket_ms <= cutoff_ms]
        for start in gone:
            del self.buckets[start]
            self.counts.pop(start, None)
            self._union_of.pop(start, None)  # its union, holding others' IDs too, may stay
        if gone:
            self._reindex()
        return sorted(gone)

    def snapshot(self) -> dict[int, Any]:
        """``{bucket start: [count, [filter bytes...]]}``, an independent copy."""
        return {
            start: [self.counts.get(start, 0), [f.save_bytes() for f in filters]]
            for start, filters in self.buckets.items()
        }

    def restore(self, state: dict[int, Any] | None) -> None:
        self.buckets, self.counts = {}, {}
        for start, (count, blobs) in (state or {}).items():
            self.buckets[start] = [self._load_filter(b) for b in blobs]
            self.counts[start] = count
        self._repack()
        self._reindex()


def merge_snapshots(
    snapshots: list[dict[int, Any]], *, expected_ids: int | None, drop_before: int, bucket_ms: int
) -> dict[int, Any]:
    """One :meth:`BloomBuckets.snapshot` holding every ID of ``snapshots`` (a change of
    parallelism: several old subtasks' filters for one new subtask).

    Per bucket, filters are OR-ed together while their IDs fit one filter (``expected_ids``):
    an OR of Bloom filters of equal parameters is exactly the filter of the union of their IDs,
    so it keeps the false-positive rate and has no false negatives. Filters that do not fit, or
    whose parameters differ, stay separate (one more probe each, until their bucket ages out).
    The least loaded filter comes last and takes the bucket's new IDs. Without
    ``expected_ids`` (snapshots of an eosflow that did not save it) nothing is OR-ed.
    Buckets wholly below ``drop_before`` are left out.
    """
    parts: dict[int, list[tuple[int, bytes]]] = {}  # bucket -> (IDs in the filter, filter)
    for snapshot in snapshots:
        for start, (count, blobs) in snapshot.items():
            start, count = int(start), int(count)
            if start + bucket_ms <= drop_before:
                continue
            cap = expected_ids or count
            for j, blob in enumerate(blobs):  # filter j took IDs j*cap .. (j+1)*cap - 1
                load = count if expected_ids is None else min(cap, count - j * cap)
                parts.setdefault(start, []).append((max(load, 0), blob))
    merged: dict[int, Any] = {}
    for start, filters in parts.items():
        if expected_ids is None:
            merged[start] = [sum(n for n, _b in filters), [b for _n, b in filters]]
            continue
        bins: list[list[Any]] = []  # [IDs, Bloom]
        for load, blob in sorted(filters, key=lambda part: -part[0]):
            bloom = Bloom.load_bytes(blob, _HASH)
            for slot in bins:
                if slot[0] + load <= expected_ids:
                    try:
                        slot[1] |= bloom
                    except ValueError:  # other size or rate: keep it apart
                        continue
                    slot[0] += load
                    break
            else:
                bins.append([load, bloom])
        bins.sort(key=lambda slot: -slot[0])
        count = (len(bins) - 1) * expected_ids + bins[-1][0]
        merged[start] = [count, [slot[1].save_bytes() for slot in bins]]
    return merged
