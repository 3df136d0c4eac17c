"""Purging channel topics: delete the channel records that no restore can read any more.

Channel topics keep every record (``retention.ms=-1``, ``retention.bytes=-1``: the broker's
retention could delete what a restore of a retained checkpoint reads). eosflow deletes them
itself, as Kafka Streams does for its repartition topics
(``TaskManager.maybePurgeCommittedRecords``: DeleteRecords below the committed offsets, one
asynchronous request per thread after a commit).

**The rule.** A restore reads channel partition ``tp`` from the position that the restored
checkpoint's snapshot of ``tp``'s reader task holds. The snapshot store keeps the newest
``keep_checkpoints`` completed checkpoints (and, should the newest be unreadable, the one
:meth:`~processor.snapshot.store.SnapshotStore.latest_completed` would restore): the oldest
completed checkpoint in the store, ``R``, is the oldest any restore can use. So records of
``tp`` below ``R``'s position of ``tp`` are never read again, and only those are deleted.

**Who.** The task that reads ``tp`` (there is exactly one) knows the positions of every
snapshot it took, and of the checkpoint it restored. On each completion notice its worker lists
the completed checkpoints in the store once, and each task answers with :meth:`PurgeFloor.floor`:
the positions of ``R`` if it knows them, ``None`` if ``R`` is older than anything it saw (just
restored: the store still holds checkpoints older than the one it restored; it waits until
they are gone). The worker sends one DeleteRecords request for all its tasks.

**Local recovery** rewinds the restarted worker's channel inputs to the latest completed
checkpoint ``C``, and ``R <= C``. Only the reader task of a partition purges it, so the survivors
never delete what the restarted worker rewinds to; and the restarted worker knows only ``C``
until the store's oldest checkpoint is ``C`` or newer.

Invariants:
    A partition is never purged above the position that any completed checkpoint still in the
    store, or any snapshot this task took since, holds for it (the floor is the minimum over
    them: positions only grow within one incarnation, the minimum guards anyway).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

__all__ = ["ChannelPurger", "PurgeFloor"]

log = logging.getLogger(__name__)

TP = tuple[str, int]


class PurgeFloor:
    """Per task: the channel positions of its snapshots, and what may be deleted.

    Args:
        channels: the task's channel input partitions (never its source partitions: those
            are the user's topics).
    """

    def __init__(self, channels: Iterable[TP]) -> None:
        self.channels = frozenset(channels)
        self.disabled = False  # the broker cannot purge: keep nothing
        self._known: dict[int, dict[TP, int]] = {}

    def disable(self) -> None:
        self.disabled = True
        self._known.clear()

    def record(self, checkpoint_id: int, positions: Mapping[TP, int | None]) -> None:
        """A snapshot of ``checkpoint_id`` was taken (or restored) with these positions."""
        if not self.channels or self.disabled:
            return
        self._known[checkpoint_id] = {
            tp: int(o) for tp, o in positions.items() if tp in self.channels and o is not None
        }

    def floor(self, oldest_retained: int) -> dict[TP, int] | None:
        """What may be deleted when ``oldest_retained`` is the oldest completed checkpoint in
        the store: per partition, the lowest position held by the newest snapshot at or
        before it, or by any later snapshot. ``None`` when nothing this task knows is that old.
        Forgets the snapshots before that one: no restore can use them."""
        base = max((c for c in self._known if c <= oldest_retained), default=None)
        if base is None:
            return None
        for old in [c for c in self._known if c < base]:
            del self._known[old]
        floor: dict[TP, int] = {}
        for positions in self._known.values():
            for tp, offset in positions.items():
                floor[tp] = min(offset, floor.get(tp, offset))
        # A partition that a later snapshot holds but the base does not (it was never read
        # then) keeps the later position: still no lower than anything retained holds.
        return floor


class _Transport(Protocol):
    def purge_supported(self) -> bool: ...
    def purge(self, before: Mapping[TP, int]) -> Mapping[TP, Future[object]]: ...


class _Store(Protocol):
    def completed_ids(self, job: str) -> list[int]: ...


class _Task(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def purge_floor(self) -> PurgeFloor: ...


class ChannelPurger:
    """One worker's purges: after each completed checkpoint, one DeleteRecords request for the
    channel partitions its tasks read, below :meth:`PurgeFloor.floor` (docstring above).

    Asynchronous, as in Kafka Streams: a purge still in flight when the next checkpoint
    completes makes that one skip (the next takes its offsets); a failed purge is logged and
    its partitions are tried again at the next completion. Purging is never needed for
    exactly-once, only for disk space, so nothing here fails the worker.
    """

    def __init__(
        self,
        transport: Any,
        store: _Store,
        job: str,
        tasks: Sequence[_Task],
        *,
        supported: bool | None = None,
    ) -> None:
        """``supported``: the runner's probe of the broker (``None``: probe here, once)."""
        self.transport: _Transport = transport
        self.store = store
        self.job = job
        self.tasks = [t for t in tasks if t.purge_floor.channels]
        self.enabled: bool | None = supported if self.tasks else False
        self.purged: dict[TP, int] = {}
        self.requests = 0  # DeleteRecords requests sent (one per completed checkpoint at most)
        self._inflight: list[tuple[TP, int, Future[object]]] = []
        self._failures = 0
        self._told = False  # the "not purged" line was logged (once per worker)

    def completed(self, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id`` completed (its notice was handled by every task)."""
        try:
            self._completed(checkpoint_id)
        except Exception as exc:  # disk space only: a broker or store hiccup is tried again
            self._failures += 1
            if self._failures <= 5 or self._failures % 100 == 0:
                log.warning(
                    "purging channels after checkpoint_id=%d failed (tried again at the next "
                    "checkpoint; failures=%d): %s: %s",
                    checkpoint_id, self._failures, type(exc).__name__, exc,
                )  # fmt: skip

    def _completed(self, checkpoint_id: int) -> None:
        if self.enabled is None:
            self.enabled = bool(self.transport.purge_supported())
        if not self.enabled and not self._told:
            self._told = True
            for task in self.tasks:
                task.purge_floor.disable()
            if self.tasks:
                log.info(
                    "channel topics of job %r are not purged: the broker does not delete "
                    "records on request (DeleteRecords; the probe says so, e.g. Tansu). They "
                    "keep every record until 'eosflow reset'",
                    self.job,
                )
        if not self.enabled or not self._settled():
            return
        completed = self.store.completed_ids(self.job)
        if not completed:
            return
        oldest = completed[0]
        before: dict[TP, int] = {}
        for task in self.tasks:
            floor = task.purge_floor.floor(oldest)
            for tp, offset in (floor or {}).items():
                if offset > self.purged.get(tp, 0):
                    before[tp] = offset
        if not before:
            return
        futures = self.transport.purge(before)
        self.requests += 1
        self._inflight = [(tp, before[tp], f) for tp, f in futures.items()]
        self.purged.update(before)
        log.log(
            logging.INFO if self.requests == 1 else logging.DEBUG,
            "purging channel records below the oldest retained checkpoint checkpoint_id=%d "
            "oldest_retained=%d partitions=%d requests=%d%s",
            checkpoint_id, oldest, len(before), self.requests,
            " (first purge of this worker)" if self.requests == 1 else "",
        )  # fmt: skip

    def _settled(self) -> bool:
        """The previous request is done (its failures forgotten, to be tried again)."""
        if any(not f.done() for _tp, _o, f in self._inflight):
            return False
        for tp, offset, future in self._inflight:
            exc = future.exception()
            if exc is None:
                continue
            if self.purged.get(tp) == offset:
                del self.purged[tp]
            self._failures += 1
            if self._failures <= 5 or self._failures % 100 == 0:
                log.warning(
                    "purging channel %s[%d] below offset %d failed (tried again at the next "
                    "checkpoint; failures=%d): %s",
                    tp[0], tp[1], offset, self._failures, exc,
                )  # fmt: skip
        self._inflight = []
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Wait a little for the request in flight (a stopping worker's last purge)."""
        deadline = time.monotonic() + timeout
        for _tp, _o, future in self._inflight:
            try:
                future.result(max(0.0, deadline - time.monotonic()))
            except Exception as exc:  # disk space only: never fail a stopping worker
                log.debug("last purge not done: %s", exc)
        self._inflight = []
        if self.requests:
            log.info("channel purges job=%r requests=%d", self.job, self.requests)
