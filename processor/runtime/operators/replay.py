"""Local recovery's replay check: the copies a restarted upstream worker re-emits are dropped by
ID, and an ID is forgotten only once no copy of it can come any more (docs/local-recovery.md,
"The ID check on channel inputs").

Every channel partition has one writer: upstream subtask ``u`` writes to downstream subtask
``d`` on its own partition (:func:`processor.wire.channel_partition`), and a copy goes where its
original went (the same subtask routes the same key the same way). A writer *incarnation* is one
start of ``u``'s worker; its records carry it in their key, and a new one announces itself with
a ``GenerationStart`` before its first record (:mod:`processor.runtime.task.fence`).

**When a copy can come.** Incarnation ``I`` of ``u`` emitted record ``r`` (ID ``x``) and then
barrier ``Y``; if checkpoint ``Y`` completes, ``I``'s state at ``Y`` is past ``r``, every later
restore of ``u`` is of ``Y`` or newer, so ``x`` is never emitted again. Until then a copy can
come: ``I`` may die, and its successor restores an older checkpoint and re-emits ``r``. So, per
channel, the check keeps:

* ``open``: the IDs read since the channel's last barrier, from its current incarnation;
* ``covered[X]``: the IDs read between the incarnation's barriers before ``X`` and ``X``;
  forgotten when a checkpoint ``Y >= X`` completed *and* this task has read barrier ``Y`` from
  the same incarnation (whichever comes last): only then did that incarnation take part in
  ``Y`` (a successor never takes part in a checkpoint triggered before it started; a barrier
  ``Y`` read from an incarnation that died before ``Y`` completed never sees ``Y`` complete);
* ``pinned`` (one set per task): the IDs of incarnations that were replaced (a ``GenerationStart``
  of a newer one, or a record of it): their successor re-emits them. Each goes when its copy
  comes (the copy is then the current incarnation's, in ``open``). An ID whose copy never comes
  (a record the successor does not emit again) stays: it counts against the bound.

No event time is involved: a backfill that reads hours of event time per second keeps the same
IDs as a live job, for as long as the checkpoints say.

**Snapshots.** A task that restores checkpoint ``C`` re-reads its channels from ``C``'s positions
and meets every record after them again, so its replay check needs only the IDs from before
those positions whose copies may still come: the pinned ones, and the channels' groups that
``C``'s completion does not release (those of channels whose barrier ``C`` was not read yet: an
unaligned checkpoint's in-flight channels). An aligned checkpoint's snapshot holds only the
pinned IDs.

**The bound** (``--recovery-max-ids``, :data:`DEFAULT_MAX_IDS`): IDs are kept in memory
(about 90 bytes each), so a task holds at most that many. More means checkpoints are not
completing while records flow (a failing sink, a stuck task): the task fails with
:class:`ReplayBoundExceeded`, and the runner restores the whole job from the latest completed
checkpoint (global recovery, which needs no replay check), instead of forgetting an ID that a
copy may still need.

Invariants:
    An ID is forgotten only when a completed checkpoint includes the state, past that record,
    of the incarnation that emitted it, or when its copy came (then the copy's ID is kept in
    its place). A record whose ID is kept is dropped; none is passed unchecked.
"""

from __future__ import annotations

import logging
from typing import Any

from processor.dataflow import Step
from processor.errors import EosflowError
from processor.runtime.job import DEFAULT_MAX_IDS
from processor.runtime.operators.core import Operator

__all__ = ["ID_BYTES_IN_MEMORY", "ReplayBoundExceeded", "ReplayCheck"]

log = logging.getLogger(__name__)

TP = tuple[str, int]

#: Memory per kept ID, measured (an int of 127 bits and its slot in a set): for messages.
ID_BYTES_IN_MEMORY = 90
STATE_VERSION = 3  # 1 and 2: the event-time replay check before issue 49 (not read)
_ID = 16  # bytes of an ID in a snapshot


class ReplayBoundExceeded(EosflowError):
    """A task's replay check would hold more IDs than ``--recovery-max-ids``. The runner answers
    it with a global recovery (the class name in the worker's last error line says so)."""


def _pack(ids: set[int]) -> bytes:
    return b"".join([i.to_bytes(_ID, "little") for i in ids])


def _unpack(blob: bytes) -> set[int]:
    return {int.from_bytes(blob[i : i + _ID], "little") for i in range(0, len(blob), _ID)}


class ReplayCheck(Operator):
    """See the module docstring. The task calls :meth:`check` with each channel batch's IDs,
    :meth:`barrier` and :meth:`incarnation` for the channel's control records, and runs the
    operator lifecycle (snapshot, restore, commit) as for any step."""

    stateful = True
    keeps_index = False

    def __init__(self, stage: str, max_ids: int = DEFAULT_MAX_IDS, *, task: str = "") -> None:
        super().__init__(Step(f"~replay-{stage}", "replay", (), True, {"max_ids": max_ids}))
        if max_ids < 1:
            raise ValueError(f"max_ids must be >= 1, got {max_ids}")
        self.max_ids = max_ids
        self.task = task or stage
        self._inc: dict[TP, int] = {}  # the current writer incarnation of each channel
        self._open: dict[TP, set[int]] = {}
        self._covered: dict[TP, dict[int, set[int]]] = {}
        self._seen: dict[TP, int] = {}  # the last barrier read from the current incarnation
        self._completed: set[int] = set()  # recent completed checkpoints
        self._pinned: set[int] = set()
        self.size = 0  # IDs held
        self.peak = 0  # the most held at once (bench/local_recovery.py reports it)
        self.duplicates = 0  # copies dropped
        self._checkpoint = 0  # the checkpoint being taken (prepare, then snapshot)

    # -- the data path ---------------------------------------------------------------------------

    def check(self, tp: TP, incarnation: int, ids: list[int]) -> list[bool]:
        """For each ID read on ``tp`` from ``incarnation`` (in channel order): ``True`` if it is
        new (it is kept now), ``False`` for a copy.

        Raises:
            ReplayBoundExceeded: the task would hold more than ``max_ids`` IDs.
        """
        if self._inc.get(tp) != incarnation:
            self.incarnation(tp, incarnation)
        held = self._open[tp]
        groups = list(self._covered[tp].values())
        pinned = self._pinned
        out = [True] * len(ids)
        before = len(held)
        dups = 0
        for i, rid in enumerate(ids):
            if rid in held:
                out[i] = False
                dups += 1
            elif pinned and rid in pinned:  # a replaced incarnation's record, re-emitted
                pinned.discard(rid)
                held.add(rid)
                before += 1  # moved, not added
                out[i] = False
                dups += 1
            elif groups and any(rid in g for g in groups):
                out[i] = False
                dups += 1
            else:
                held.add(rid)
        self.duplicates += dups
        self.size += len(held) - before
        if self.size > self.peak:
            self.peak = self.size
            if self.size > self.max_ids:
                raise ReplayBoundExceeded(self._bound_message())
        return out

    def incarnation(self, tp: TP, incarnation: int) -> None:
        """``incarnation`` writes on ``tp`` now: an older one's IDs are pinned (its successor
        re-emits them)."""
        old = self._inc.get(tp)
        if old is not None and incarnation <= old:
            return  # the fence drops older incarnations' records; the same one goes on
        self._inc[tp] = incarnation
        self._seen[tp] = 0
        held, groups = self._open.get(tp), self._covered.get(tp)
        self._open[tp], self._covered[tp] = set(), {}
        if old is None:
            return
        moved = 0
        for group in [held or set(), *(groups or {}).values()]:
            self._pinned |= group
            moved += len(group)
        if moved:
            log.info(
                "replay check %s: channel %s[%d] has a new writer (incarnation %d after %d): "
                "its %d IDs wait for their copies",
                self.name, tp[0], tp[1], incarnation, old, moved,
            )  # fmt: skip
        self.size = len(self._pinned) + sum(self._held(t) for t in self._open)

    def _held(self, tp: TP) -> int:
        return len(self._open[tp]) + sum(len(g) for g in self._covered[tp].values())

    def barrier(self, tp: TP, incarnation: int, checkpoint_id: int) -> None:
        """Barrier ``checkpoint_id`` read on ``tp`` from ``incarnation``: the IDs read since its
        previous barrier are covered by it."""
        if self._inc.get(tp) != incarnation:
            self.incarnation(tp, incarnation)
        if incarnation != self._inc[tp]:
            return  # an older incarnation's (fenced before it reaches here)
        held = self._open[tp]
        if held:
            group = self._covered[tp].setdefault(checkpoint_id, set())
            group |= held
            self._open[tp] = set()
        self._seen[tp] = max(self._seen[tp], checkpoint_id)
        if checkpoint_id in self._completed:  # it completed before its barrier came here
            self._release(tp, checkpoint_id)

    def _release(self, tp: TP, checkpoint_id: int) -> None:
        groups = self._covered[tp]
        for x in [x for x in groups if x <= checkpoint_id]:
            self.size -= len(groups.pop(x))

    # -- lifecycle -------------------------------------------------------------------------------

    def commit(self, checkpoint_id: int) -> None:
        """``checkpoint_id`` completed: every channel's groups up to it go where this task read
        barrier ``checkpoint_id`` (or a later one) from the incarnation that wrote them; on the
        other channels, when that barrier comes (:meth:`barrier`)."""
        self._completed.add(checkpoint_id)
        if len(self._completed) > 256:  # a barrier later than that is released by the next
            self._completed.discard(min(self._completed))
        for tp in self._covered:
            if self._seen.get(tp, 0) >= checkpoint_id:
                self._release(tp, checkpoint_id)

    def snapshot(self) -> dict[str, Any]:
        """The pinned IDs, and per channel the IDs that the completion of the checkpoint being
        taken would not release (see the module docstring)."""
        chk = self._checkpoint
        channels = []
        for tp, inc in self._inc.items():
            cut = chk if self._seen.get(tp, 0) >= chk else 0
            keep = set(self._open.get(tp, ()))
            for x, group in self._covered.get(tp, {}).items():
                if x > cut:
                    keep |= group
            if keep:
                channels.append([tp[0], tp[1], inc, _pack(keep)])
        return {"version": STATE_VERSION, "pinned": _pack(self._pinned), "channels": channels}

    def prepare(self, checkpoint_id: int) -> None:
        self._checkpoint = checkpoint_id

    def restore(self, state: Any) -> None:
        self._inc, self._open, self._covered, self._seen = {}, {}, {}, {}
        self._pinned = set()
        self.size = 0
        if state is None:
            return
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            # An eosflow before issue 49 kept the check by event time, with its IDs in Redis:
            # its state does not say which incarnation wrote them. What it protected was a
            # re-emission in progress when that job stopped; a job restarted on a new release
            # restores every worker (none is re-emitting), so nothing of it is needed.
            log.warning(
                "replay check %s: the checkpoint holds an older release's replay check "
                "(version %r); starting without it",
                self.name, state.get("version") if isinstance(state, dict) else None,
            )  # fmt: skip
            return
        self._pinned = _unpack(state["pinned"])
        for topic, partition, inc, blob in state["channels"]:
            tp = (str(topic), int(partition))
            self._inc[tp] = int(inc)
            self._open[tp] = _unpack(blob)
            self._covered[tp] = {}
            self._seen[tp] = 0
        self.size = len(self._pinned) + sum(len(s) for s in self._open.values())
        self.peak = max(self.peak, self.size)

    @property
    def pinned(self) -> int:
        """IDs of replaced incarnations whose copies have not come."""
        return len(self._pinned)

    def held_ids(self) -> dict[str, int]:
        """What the check holds now (for stats and the benchmarks)."""
        covered = sum(len(g) for groups in self._covered.values() for g in groups.values())
        return {
            "open": sum(len(s) for s in self._open.values()),
            "covered": covered,
            "pinned": len(self._pinned),
        }

    def _bound_message(self) -> str:
        held = self.held_ids()
        mb = self.max_ids * ID_BYTES_IN_MEMORY / 1e6
        recent = held["open"] + held["covered"]
        return (
            f"the replay check of task {self.task} holds {self.size:,} record IDs, more than "
            f"--recovery-max-ids {self.max_ids:,} (about {mb:,.1f} MB): {recent:,} "
            f"of records read since the last checkpoint this task saw complete, "
            f"{held['pinned']:,} of a restarted upstream worker's records whose copies have not "
            "come. Under --recovery local an ID is kept until a completed checkpoint makes its "
            "copy impossible, so checkpoints are not completing while records flow (see "
            "`eosflow status`: a slow sink commit, a stuck task, timeouts). The job recovers "
            "globally now (every worker from the latest completed checkpoint); nothing passes "
            "unchecked. Fix the checkpoints, or raise --recovery-max-ids, or run with "
            "--recovery global"
        )
