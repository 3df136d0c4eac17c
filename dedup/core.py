"""The deduplicator: Bloom filters in front of the ID store, agreeing with the snapshots.

A batch of IDs is checked in three tiers, cheapest first:

1. the time-bucketed Bloom filters (:mod:`dedup.buckets`): a miss means "surely new", no I/O;
2. the IDs this run recorded recently (the epoch not yet written, and a bounded set of the last
   ones written): a hit there is a certain duplicate, no I/O;
3. the ID store (:mod:`dedup.store`), asked once per batch for all remaining Bloom hits.

New IDs go into the filters and a pending list that :meth:`Deduplicator.prepare` writes to the
store at the checkpoint barrier (one round trip; also every ``flush_ids`` IDs), tagged with this
run and the epoch that recorded them.

**Writes behind** (``write_behind=True``, the ``dedup`` step): each write runs on a thread of its
own while the caller goes on; :meth:`Deduplicator.prepare_async` returns the write that the
snapshot taken next relies on, and the task's snapshot upload waits for it, so a checkpoint is
acknowledged only after its IDs are stored. One write is in flight at most (the next waits for
it), so writes land in order; the IDs of the write in flight stay in the recent-ID sets, which
drop IDs only at a later write, so a copy of one is found in memory and never asked of a store
that does not hold it yet; lookups watch the batches the store acknowledged, not the ones sent.
A failed write raises at the next write or barrier.

**The store agrees with the snapshots** (docs/dedup.md, "The ID store agrees with the
snapshots"). Each incarnation of a task is a *run* with
a random 63-bit ID. A snapshot holds the *lineage*: for every run whose IDs it includes, the
last epoch it includes (``{run: checkpoint}``). After a restore, a stored entry counts as seen
only if its run is in the restored lineage and its epoch is at most that run's cut-off, or it
was written by the current run. Entries written after the restored checkpoint by a run that
crashed are therefore absent, and a record they would have hidden is processed again: nothing
is lost. The filters are part of the snapshot, so they too hold exactly the restored IDs (plus
false positives, which the store resolves). A stored entry holds one tag, the last writer's:
that is enough because a restore never returns to a checkpoint prepared after the one an
earlier restore chose (those never complete: checkpoint ids only grow), so an entry overwritten
by a later run is only ever read under a lineage that includes that run.

**Garbage collection.** When the watermark passes, buckets wholly below ``watermark - within``
leave the filters at once, and the store's hashes of buckets below the cut-off of a *completed*
checkpoint are deleted on :meth:`Deduplicator.commit` (deleting earlier could remove IDs that a
restore of that checkpoint still needs). A record whose timestamp is below the cut-off can no
longer be checked: the ``late`` policy drops it or passes it, and either is counted and logged.

**Redis down**: the store retries, then fails the task (:class:`dedup.errors.RedisUnavailable`);
no record passes unchecked.

**Redis lost data** (restarted empty, failed over to a replica that missed writes): a Bloom hit
that the store calls absent would pass a copy as a false positive. So each run counts the
batches of IDs it wrote (its write marker in the store, :mod:`dedup.store`), and a snapshot
holds the counts of its lineage (``written``). The store must account for them: at restore
(one round trip), in every lookup (the marker is read in the same round trip as the IDs), in
every insert (checked in the script before the new batch counts) and at every checkpoint
without one. Until this run writes its first batch, the restored counts are watched; then its
own count, which vouches for everything written before it (Redis loses a suffix of its
writes). A marker behind raises :class:`dedup.errors.RedisDataLost` (``on_lost="fail"``), or
is logged and accepted (``on_lost="accept"``: copies of records whose IDs were lost may pass
once). A first start (no snapshot) expects nothing.

Invariants:
    No false negatives: an ID recorded at timestamp ``t`` is reported as a duplicate while
    ``t >= watermark - within``, in this run and after any restore of a snapshot taken after it
    was recorded. An ID recorded after the restored checkpoint is never reported as seen.
    ``snapshot`` is only taken right after ``prepare`` (nothing pending).
    No decision rests on a store that lost IDs the snapshot or this run wrote: with
    ``on_lost="fail"`` such a store raises :class:`dedup.errors.RedisDataLost` in the same
    round trip that would have answered "absent".
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any, Protocol

from dedup.buckets import BloomBuckets
from dedup.errors import DedupConfigError, RedisDataLost
from dedup.store import decode_tag, encode_tag, lost_error, lost_writes

__all__ = ["DedupStats", "Deduplicator", "IdStore", "MemoryIdStore"]

log = logging.getLogger(__name__)

MIN_TS = -(2**63)
STATE_VERSION = 2  # 2: may hold ``inherited`` prefixes (dedup.rescale); 1 is read too
_READS = (1, 2)
LATE_POLICIES = ("drop", "pass")
ON_LOST = ("fail", "accept")


def _behind(fn: Callable[[], None], name: str) -> Future[None]:
    """Runs ``fn`` on a daemon thread of its own; its outcome in the returned future."""
    future: Future[None] = Future()

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(None)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


class IdStore(Protocol):
    """What the deduplicator needs from a store (:class:`dedup.store.RedisIdStore`)."""

    round_trips: int

    def lookup(
        self, buckets: list[int], ids: list[int], watch: Mapping[int, int] | None = None
    ) -> list[list[bytes]]: ...

    def insert(
        self,
        entries: dict[int, list[int]],
        tag: bytes,
        *,
        count: tuple[int, int] | None = None,
        watch: Mapping[int, int] | None = None,
    ) -> None: ...

    def verify(self, watch: Mapping[int, int]) -> None: ...

    def delete_before(self, cutoff_ms: int, bucket_ms: int) -> list[int]: ...

    def buckets(self) -> list[int]: ...

    def deleted_below(self) -> int: ...


class MemoryIdStore:
    """An :class:`IdStore` in this process's memory, with Redis's layout and tags.

    Not durable: a restarted process starts empty. For unit tests, the benchmarks' I/O-free
    baseline, and single-process programs that need no recovery.
    """

    def __init__(self) -> None:
        self.data: dict[int, dict[int, bytes]] = {}
        self.written: dict[int, int] = {}  # the write markers, run -> batches
        self.round_trips = 0
        self.gc_mark = MIN_TS

    def _check(self, watch: Mapping[int, int] | None) -> None:
        lost = lost_writes(watch or {}, self.written)
        if lost:
            raise lost_error("memory", "memory", lost)

    def lookup(
        self, buckets: list[int], ids: list[int], watch: Mapping[int, int] | None = None
    ) -> list[list[bytes]]:
        self.round_trips += 1
        self._check(watch)
        found: list[list[bytes]] = [[] for _ in ids]
        for bucket in buckets:
            entries = self.data.get(bucket, {})
            for n, record_id in enumerate(ids):
                tag = entries.get(record_id)
                if tag is not None:
                    found[n].append(tag)
        return found

    def insert(
        self,
        entries: dict[int, list[int]],
        tag: bytes,
        *,
        count: tuple[int, int] | None = None,
        watch: Mapping[int, int] | None = None,
    ) -> None:
        self.round_trips += 1
        for bucket, ids in entries.items():
            self.data.setdefault(bucket, {}).update(dict.fromkeys(ids, tag))
        self._check(watch)
        if count is not None:
            run, batches = count
            self.written[run] = max(self.written.get(run, 0), batches)

    def verify(self, watch: Mapping[int, int]) -> None:
        self.round_trips += 1
        self._check(watch)

    def delete_before(self, cutoff_ms: int, bucket_ms: int) -> list[int]:
        self.round_trips += 1
        gone = sorted(b for b in self.data if b + bucket_ms <= cutoff_ms)
        for bucket in gone:
            del self.data[bucket]
        self.gc_mark = max(self.gc_mark, cutoff_ms - cutoff_ms % bucket_ms)
        return gone

    def deleted_below(self) -> int:
        return self.gc_mark

    def buckets(self) -> list[int]:
        return sorted(self.data)

    def scan_bucket(self, bucket: int) -> list[tuple[int, bytes]]:
        return list(self.data.get(bucket, {}).items())


class DedupStats:
    """Counters (cumulative for this process)."""

    __slots__ = ("duplicates", "false_positives", "fresh", "late_dropped", "late_passed", "lookups")

    def __init__(self) -> None:
        self.fresh = 0  # IDs recorded as new
        self.duplicates = 0  # records dropped as duplicates
        self.late_dropped = 0  # older than the horizon, dropped (late="drop")
        self.late_passed = 0  # older than the horizon, passed unchecked (late="pass")
        self.lookups = 0  # IDs sent to the store
        self.false_positives = 0  # Bloom hits that the store said were new

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


class Deduplicator:
    """Checks and records record IDs. See the module docstring.

    Args:
        store: where IDs are kept durably.
        within_ms: the horizon: a duplicate is recognised if its timestamp is at least
            ``watermark - within_ms``.
        bucket_ms: length of a time bucket (default ``within_ms / 4``, at least 1 s).
        expected_ids: IDs per bucket that one Bloom filter holds at its rate.
        fp_rate: target false-positive rate of the filters together (each Bloom hit that is
            not a duplicate costs part of a store round trip, never correctness).
        late: ``"drop"`` or ``"pass"`` records older than the horizon (counted and logged).
        recent_ids: how many recently written IDs to keep in memory to confirm duplicates
            without a round trip.
        flush_ids: write pending IDs to the store when this many accumulate in one epoch.
        name: for log lines.
        run: a fixed run ID for every incarnation (``None``: random per restore). With a fixed
            run every stored entry counts as seen, which is right only without snapshots (the
            consumer-side :class:`dedup.consumer.IdDedupConsumer`, which stores IDs when the
            application commits).
        on_lost: when the store lost IDs that the restored snapshot or this run wrote:
            ``"fail"`` (raise :class:`dedup.errors.RedisDataLost`) or ``"accept"`` (log, and
            go on without them: copies of those records may pass once).
        write_behind: write each batch of IDs on a thread of its own while the caller goes
            on (see "Writes behind" in the module docstring); :meth:`prepare_async` then
            returns the write that a snapshot must wait for. ``False``: every write is done
            before :meth:`check` or :meth:`prepare` returns.
    """

    def __init__(
        self,
        store: IdStore,
        *,
        within_ms: int,
        bucket_ms: int | None = None,
        expected_ids: int = 100_000,
        fp_rate: float = 0.001,
        late: str = "drop",
        recent_ids: int = 200_000,
        flush_ids: int = 50_000,
        name: str = "dedup",
        run: int | None = None,
        on_lost: str = "fail",
        write_behind: bool = False,
    ) -> None:
        if within_ms < 1:
            raise ValueError(f"within_ms must be >= 1, got {within_ms}")
        if late not in LATE_POLICIES:
            raise ValueError(f"late must be one of {LATE_POLICIES}, got {late!r}")
        if on_lost not in ON_LOST:
            raise DedupConfigError(f"on_lost must be one of {ON_LOST}, got {on_lost!r}")
        self.on_lost = on_lost
        self.store = store
        self.within_ms = within_ms
        self.bucket_ms = bucket_ms or max(1000, within_ms // 4)
        self.late = late
        self.name = name
        self.recent_ids = recent_ids
        self.flush_ids = flush_ids
        self.filters = BloomBuckets(
            bucket_ms=self.bucket_ms,
            expected_ids=expected_ids,
            fp_rate=fp_rate,
            max_filters=math.ceil(within_ms / self.bucket_ms) + 2,
        )
        self.stats = DedupStats()
        self._fixed_run = run
        self.run = secrets.randbits(63) if run is None else run
        self.lineage: dict[int, int] = {}  # run -> last epoch included (older runs only)
        self.batches = 0  # batches of IDs this run sent to the store
        self.acked = 0  # of them, the ones the store acknowledged (its write marker's count)
        self.written: dict[int, int] = {}  # run -> batches the restored snapshot relies on
        self.write_behind = write_behind
        self._inflight: Future[None] | None = None  # the write behind, at most one
        self.prepared = 0  # last checkpoint prepared by this run (or restored)
        self.watermark = MIN_TS
        self.cutoff = MIN_TS  # records below it are older than the horizon
        self.pending: dict[int, list[int]] = {}
        self.pending_set: set[int] = set()
        self._recent: set[int] = set()
        self._older: set[int] = set()
        self._cutoff_at: dict[int, int] = {}  # prepared checkpoint -> cutoff in its snapshot
        self._deleted_below = MIN_TS

    # -- the hot path ---------------------------------------------------------------------------

    def check(self, ids: list[int], timestamps: list[int]) -> list[bool]:
        """For each ID: ``True`` if new (it is recorded now), ``False`` if a duplicate, or
        older than the horizon under ``late="drop"``. Records are decided in order: the second
        of two equal IDs in one batch is a duplicate."""
        decided = self.filters.decide(ids, timestamps, self.cutoff, self.pending_set)
        if decided is not None:  # the C accelerator: this pass in one call
            out, groups, candidates, late, dups = decided
            for i in late:
                out[i] = self._late(timestamps[i])
        else:
            out, groups, candidates, dups = self._decide(ids, timestamps)
        self.stats.duplicates += dups
        if groups:
            self._record_groups(groups)
        if candidates:
            self._resolve(ids, timestamps, candidates, out)
        # Never flush while a batch is being decided: a flush rotates the recent-ID sets, and a
        # candidate found there before the flush must still be found after it.
        if len(self.pending_set) >= self.flush_ids:
            self._flush()
        return out

    def _decide(
        self, ids: list[int], timestamps: list[int]
    ) -> tuple[list[bool], dict[int, list[int]], list[int], int]:
        """The pass over a batch: its verdicts so far, the fresh IDs by bucket start (already
        added to the pending set), the indexes of filter hits (resolved by :meth:`_resolve`),
        and the copies of pending IDs (of earlier batches, or earlier in this one).
        :meth:`BloomBuckets.decide` does this in C, where it was built.

        An ID in the pending set is a copy without a probe: it was recorded since the last
        flush, so it is in the filters too, and :meth:`_resolve` would call it known."""
        out = [True] * len(ids)
        probes = self.filters._probes
        cutoff, size = self.cutoff, self.bucket_ms
        candidates: list[int] = []  # filter hits, resolved below
        pending = self.pending_set
        pending_add = pending.add
        groups: dict[int, list[int]] = {}
        dups = 0
        for i, record_id in enumerate(ids):
            ts = timestamps[i]
            if ts < cutoff:
                out[i] = self._late(ts)
                continue
            if record_id in pending:
                out[i] = False
                dups += 1
                continue
            for probe in probes:
                if probe(record_id):
                    candidates.append(i)
                    break
            else:
                pending_add(record_id)
                start = ts - ts % size
                group = groups.get(start)
                if group is None:
                    groups[start] = [record_id]
                else:
                    group.append(record_id)
        return out, groups, candidates, dups

    def _resolve(
        self, ids: list[int], timestamps: list[int], candidates: list[int], out: list[bool]
    ) -> None:
        known = self._known
        ask = [i for i in candidates if not known(ids[i])]
        asked_set = {ids[i] for i in ask}
        seen: set[int] = set()
        if ask:
            asked = [ids[i] for i in ask]
            self.stats.lookups += len(asked)
            tags = self.store.lookup(sorted(self.filters.buckets), asked, self._watch())
            valid = self._valid
            answers = zip(asked, tags, strict=True)
            seen = {record_id for record_id, t in answers if any(map(valid, t))}
        for i in candidates:
            record_id = ids[i]
            if record_id in seen or record_id not in asked_set or record_id in self.pending_set:
                out[i] = False
                self.stats.duplicates += 1
            else:  # a false positive of the filters
                self.stats.false_positives += 1
                self._record(record_id, timestamps[i])

    def _known(self, record_id: int) -> bool:
        return (
            record_id in self.pending_set or record_id in self._recent or record_id in self._older
        )

    def _valid(self, tag: bytes) -> bool:
        run, epoch = decode_tag(tag)
        if run == self.run:
            return True
        cut = self.lineage.get(run)
        return cut is not None and epoch <= cut

    def _record(self, record_id: int, ts: int) -> None:
        self.pending_set.add(record_id)
        self._record_groups({ts - ts % self.bucket_ms: [record_id]})

    def _record_groups(self, groups: dict[int, list[int]]) -> None:
        """Records new IDs, already in the pending set, by bucket start: filters and pending
        lists (usually one bucket per batch). The lists are kept, not copied."""
        for bucket, group in groups.items():
            self.filters.add_many(bucket, group)
            self.stats.fresh += len(group)
            pending = self.pending.get(bucket)
            if pending is None:
                self.pending[bucket] = group
            else:
                pending.extend(group)

    def _late(self, ts: int) -> bool:
        passed = self.late == "pass"
        if passed:
            self.stats.late_passed += 1
        else:
            self.stats.late_dropped += 1
        n = self.stats.late_passed + self.stats.late_dropped
        if n <= 10 or n % 10_000 == 0:
            log.warning(
                "dedup %s: record older than the horizon %s (ts_ms=%d < watermark %d - within "
                "%d ms); it cannot be checked. count=%d (raise within= to check older records)",
                self.name, "passed unchecked" if passed else "dropped", ts, self.watermark,
                self.within_ms, n,
            )  # fmt: skip
        return passed

    def _watch(self) -> dict[int, int]:
        """The write markers the store must still account for: this run's once the store
        acknowledged a batch of it (Redis loses a suffix of its writes, so it vouches for every
        earlier batch), else the restored snapshot's."""
        return {self.run: self.acked} if self.acked else self.written

    def _flush(self) -> Future[None] | None:
        """Sends the pending IDs to the store; returns the write if it goes on behind."""
        if not self.pending_set:
            return None
        self._settle()  # one write in flight at most (the recent-ID sets rely on it)
        entries, tag = self.pending, encode_tag(self.run, self.prepared + 1)
        count = (self.run, self.batches + 1)

        def write() -> None:
            # the watch is read when the write runs: every earlier batch was acknowledged
            self.store.insert(entries, tag, count=count, watch=self._watch())
            self.acked = count[1]

        if not self.write_behind:
            write()  # an error leaves everything as it was: a retry sends the same IDs
        self.batches += 1
        if len(self._recent) + len(self.pending_set) > self.recent_ids // 2:
            self._older, self._recent = self._recent, set()
        if self._recent:
            self._recent |= self.pending_set
        else:  # no copy: the pending set is replaced below
            self._recent = self.pending_set
        self.pending, self.pending_set = {}, set()
        if not self.write_behind:
            return None
        self._inflight = _behind(write, f"eosflow-dedup-write {self.name}")
        return self._inflight

    def _settle(self) -> None:
        """Waits for the write behind, if any; raises its error (the task then fails and
        restarts from its last checkpoint, whose snapshot did not rely on that write)."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            inflight.result()

    # -- event time ------------------------------------------------------------------------------

    def advance(self, watermark: int) -> None:
        """Event time reached ``watermark``: drop the filters of buckets past the horizon, and
        stop reading inherited prefixes whose every bucket is past it (:mod:`dedup.rescale`)."""
        if watermark <= self.watermark:
            return
        self.watermark = watermark
        self.cutoff = max(self.cutoff, watermark - self.within_ms)
        self.filters.drop_before(self.cutoff)
        if getattr(self.store, "inherited", None):
            self.store.retire(self.cutoff, self.bucket_ms)  # type: ignore[attr-defined]

    # -- checkpoints -----------------------------------------------------------------------------

    def prepare(self, checkpoint_id: int) -> None:
        """At the barrier of ``checkpoint_id``: write the pending IDs (before the snapshot);
        with none, check that the store still holds what was written (so that lost data is
        found at the next checkpoint even when no record needs the store)."""
        write = self.prepare_async(checkpoint_id)
        if write is not None:
            self._settle()

    def prepare_async(self, checkpoint_id: int) -> Future[None] | None:
        """:meth:`prepare`, but with ``write_behind`` the write of the pending IDs may still
        run when it returns: the snapshot taken next relies on it, so it must not be
        acknowledged before this write completes (the task's snapshot upload waits for it)."""
        if self.pending_set:
            write = self._flush()
        else:
            write = self._inflight
            if write is not None and write.done():
                self._settle()  # raises if it failed
                write = None
            watch = self._watch()
            if write is None and (watch or getattr(self.store, "inherited", None)):
                self.store.verify(watch)
        self.prepared = checkpoint_id
        self._cutoff_at[checkpoint_id] = self.cutoff
        return write

    def snapshot(self) -> dict[str, Any]:
        assert not self.pending_set, "snapshot() without prepare(): IDs not in the store"
        inherited: list[dict[str, Any]] = getattr(self.store, "inherited_state", list)()
        return {
            # 1 when nothing is inherited: an eosflow before dedup.rescale can restore it
            "version": STATE_VERSION if inherited else 1,
            "lineage": {**self.lineage, self.run: self.prepared},
            "written": {**self.written, self.run: self.batches} if self.batches else self.written,
            "prepared": self.prepared,
            "watermark": self.watermark,
            "cutoff": self.cutoff,
            "bucket_ms": self.bucket_ms,
            "within_ms": self.within_ms,
            "expected_ids": self.filters.expected_ids,
            "filters": self.filters.snapshot(),
            **({"inherited": inherited} if inherited else {}),
        }

    def restore(self, state: dict[str, Any] | None) -> None:
        """Loads a :meth:`snapshot`; this becomes a new run (see the module docstring)."""
        self._drop_inflight()
        self.run = secrets.randbits(63) if self._fixed_run is None else self._fixed_run
        self.pending, self.pending_set = {}, set()
        self._recent, self._older = set(), set()
        self._cutoff_at = {}
        self.batches = self.acked = 0
        self.written = {}
        if state is None:
            self.lineage, self.prepared = {}, 0
            self.watermark = self.cutoff = MIN_TS
            self.filters.restore(None)
            self._inherit([])
            return
        if state.get("version") not in _READS:
            raise DedupConfigError(
                f"dedup {self.name}: the checkpoint holds dedup state version "
                f"{state.get('version')!r}, this eosflow reads versions {_READS}: run the "
                "eosflow release that wrote it, or reset the job to start afresh"
            )
        for name, mine in (("bucket_ms", self.bucket_ms), ("within_ms", self.within_ms)):
            if state[name] != mine:
                raise DedupConfigError(
                    f"dedup {self.name}: the checkpoint was taken with {name}={state[name]}, "
                    f"this job says {mine}; the filters and stored buckets depend on it. Keep "
                    "the old within=/bucket=, or reset the job (new job name or "
                    "eosflow reset) to start deduplicating afresh"
                )
        self.lineage = dict(state["lineage"])
        self.prepared = state["prepared"]
        self.watermark = state["watermark"]
        self.cutoff = state["cutoff"]
        self.filters.restore(state["filters"])
        # A snapshot of an eosflow before the write markers has none: nothing to check.
        self.written = {int(r): int(n) for r, n in state.get("written", {}).items()}
        self._check_restored()
        self._inherit(state.get("inherited") or [])
        self._floor_cutoff()

    def _drop_inflight(self) -> None:
        """Before a restore or a close: the write behind, if any, ends first (its entries are
        tagged with the old run, which the restored lineage does not count past its cut-off);
        its error no longer matters."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            try:
                inflight.result()
            except Exception as exc:
                log.info("dedup %s: a write behind failed (before a restore or close): %r",
                         self.name, exc)  # fmt: skip

    def close(self) -> None:
        """Waits for the write behind, if any (a closing task's last snapshot is already
        acknowledged or never will be)."""
        self._drop_inflight()

    def _check_restored(self) -> None:
        """The store must still hold every batch the restored snapshot relies on."""
        if not self.written:
            return
        try:
            self.store.verify(self.written)
        except RedisDataLost as exc:
            if self.on_lost != "accept":
                raise
            log.warning(
                "dedup %s: going on without lost IDs (on_lost=accept): copies of records "
                "whose IDs were lost may pass once. %s",
                self.name, exc,
            )  # fmt: skip
            self.written = {}

    def _inherit(self, entries: list[dict[str, Any]]) -> None:
        """The prefixes of older shapes this subtask reads (:mod:`dedup.rescale`): checked
        now (one round trip), then read by every lookup."""
        inherit = getattr(self.store, "inherit", None)
        if inherit is None:
            if entries:
                raise DedupConfigError(
                    f"dedup {self.name}: the checkpoint inherits ID stores of an older "
                    f"parallelism, which {type(self.store).__name__} cannot read: use "
                    "dedup.rescale.InheritingIdStore"
                )
            return
        inherit(entries, on_lost=self.on_lost)
        self.store.retire(self.cutoff, self.bucket_ms)  # type: ignore[attr-defined]

    def _floor_cutoff(self) -> None:
        """Stored buckets below the store's GC mark are gone (deleted after a newer checkpoint
        completed; a restore may fall back to an older one): records there are older than the
        horizon now, and follow the declared ``late`` policy instead of passing unchecked."""
        deleted = self.store.deleted_below()
        if deleted > self.cutoff:
            log.warning(
                "dedup %s: restored cut-off %d is below the store's GC mark %d (an older "
                "checkpoint was restored); records below it are handled as late (%s)",
                self.name, self.cutoff, deleted, self.late,
            )  # fmt: skip
            self.cutoff = deleted
            self.filters.drop_before(deleted)

    def rebuild(self) -> int:
        """Fills the filters from the store (every live bucket); returns the IDs loaded. For
        users without snapshots; a restore loads the filters from the snapshot instead."""
        loaded = 0
        self._floor_cutoff()
        scan = self.store.scan_bucket  # type: ignore[attr-defined]  # Redis or memory store
        for bucket in self.store.buckets():
            if bucket + self.bucket_ms <= self.cutoff:
                continue
            ids = [record_id for record_id, _tag in scan(bucket)]
            self.filters.add_many(bucket, ids)
            loaded += len(ids)
        return loaded

    def commit(self, checkpoint_id: int) -> None:
        """``checkpoint_id`` completed: delete the stored buckets its snapshot had dropped."""
        due = [c for c in self._cutoff_at if c <= checkpoint_id]
        if not due:
            return
        cutoff = max(self._cutoff_at.pop(c) for c in due)
        if cutoff - cutoff % self.bucket_ms > self._deleted_below:
            self.store.delete_before(cutoff, self.bucket_ms)
            self._deleted_below = cutoff - cutoff % self.bucket_ms
