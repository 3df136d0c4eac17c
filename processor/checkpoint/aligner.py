"""Barrier alignment: what a task does when checkpoint barriers arrive on its input channels.

A pure state machine (no Kafka, no clock), in the shape of Flink's ``BarrierHandlerState``: one
small class per state, each event returns the next state and the actions for the task runtime::

    aligned (default, Algorithm 1 of Carbone et al. 2015)

        Idle ──barrier n on c──▶ Aligning(n)          [Pause c]
        Aligning(n) ──barrier n on c──▶ Aligning(n)   [Pause c]
        Aligning(n) ──last channel delivers n──▶ Idle [TakeSnapshot n, ForwardBarrier n,
                                                       Resume paused, AlignmentDone n]
        Aligning(n) ──barrier m > n──▶ Aligning(m)    [AbortCheckpoint n, Resume, Pause c]

    unaligned

        Idle ──barrier n on c──▶ Collecting(n)        [TakeSnapshot n, ForwardBarrier n]
        Collecting(n) ──last channel delivers n──▶ Idle   [AlignmentDone n]
        Collecting(n) ──barrier m > n──▶ Collecting(m)    [AbortCheckpoint n, TakeSnapshot m, ...]

    aligned, with back-edge inputs (a loop head; Algorithm 2 of Carbone et al. 2015)

        Idle ──barrier n on regular c──▶ Aligning(n)  [Pause c]
        Aligning(n) ──last *regular* channel delivers n──▶ Collecting(n)
                                        [TakeSnapshot n, ForwardBarrier n, Resume paused]
        Collecting(n) ──last back-edge delivers n──▶ Idle  [AlignmentDone n]

    Back-edges are never paused and, aligned, never start a checkpoint: their barrier only
    comes around after this task forwarded it, so waiting for it before the snapshot (plain
    ABS) deadlocks. The records they deliver between the snapshot and the barrier are the
    loop's in-flight records (the *back-edge log*); in a Kafka channel they stay replayable by
    offset, so the snapshot keeps the back-edges' positions and recovery replays up to the
    barrier. Unaligned, a back-edge's barrier *can* come first (the loop body forwards at the
    first barrier it reads, possibly another head subtask's): it starts the checkpoint like any
    first barrier, and a newer one subsumes the pending checkpoint like any newer barrier.

A barrier whose id is not newer than the newest one this task has started is stale (a checkpoint
that was subsumed or aborted, or a barrier replayed after recovery) and ignored. End-of-stream on
a channel removes it from the set alignment waits for (a finished channel delivers no barriers).

The runtime acknowledges checkpoint n to the coordinator when it has both ``AlignmentDone(n)`` and
the uploaded snapshot of n. In unaligned mode the snapshot's channel positions are the reader's
positions when ``TakeSnapshot`` is executed: with Kafka channels, the in-flight "channel state" of
Chandy-Lamport is just the offset range from there to the barrier, replayed on recovery.

Invariants:
    A checkpoint id is snapshotted at most once, and ids are snapshotted in increasing order.
    Aligned: ``TakeSnapshot(n)`` happens exactly when every live channel has delivered barrier n,
    and no channel that delivered barrier n delivers anything before that snapshot (it is paused).
    ``AlignmentDone(n)`` is emitted at most once, and only when every live channel delivered n.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable
from dataclasses import dataclass, field

__all__ = [
    "AbortCheckpoint",
    "Action",
    "AlignmentDone",
    "BarrierAligner",
    "ForwardBarrier",
    "Pause",
    "Resume",
    "TakeSnapshot",
]

Channel = Hashable


@dataclass(frozen=True, slots=True)
class Pause:
    """Stop delivering records of ``channel`` (``consumer.pause``)."""

    channel: Channel


@dataclass(frozen=True, slots=True)
class Resume:
    """Deliver records of ``channels`` again."""

    channels: frozenset[Channel]


@dataclass(frozen=True, slots=True)
class TakeSnapshot:
    """Copy operator state and input positions now; upload in the background."""

    checkpoint_id: int


@dataclass(frozen=True, slots=True)
class ForwardBarrier:
    """Write barrier ``checkpoint_id`` into every output channel."""

    checkpoint_id: int


@dataclass(frozen=True, slots=True)
class AlignmentDone:
    """Every live input delivered barrier ``checkpoint_id``: ack once the snapshot is uploaded."""

    checkpoint_id: int


@dataclass(frozen=True, slots=True)
class AbortCheckpoint:
    """Checkpoint ``checkpoint_id`` will not complete on this task; drop its pending snapshot."""

    checkpoint_id: int
    reason: str


Action = Pause | Resume | TakeSnapshot | ForwardBarrier | AlignmentDone | AbortCheckpoint


@dataclass
class _Ctx:
    live: set[Channel]
    unaligned: bool
    back: frozenset[Channel] = frozenset()  # back-edge channels (Algorithm 2)
    newest: int = 0  # newest checkpoint id this task has started (barriers <= it are stale)
    paused: set[Channel] = field(default_factory=set)


class _State:
    def barrier(
        self, ctx: _Ctx, channel: Channel, checkpoint_id: int
    ) -> tuple[_State, list[Action]]:
        raise NotImplementedError

    def finished(self, ctx: _Ctx, channel: Channel) -> tuple[_State, list[Action]]:
        raise NotImplementedError

    def abort(self, ctx: _Ctx, checkpoint_id: int, reason: str) -> tuple[_State, list[Action]]:
        return self, []

    @property
    def pending(self) -> int | None:
        return None


def _resume_all(ctx: _Ctx) -> list[Action]:
    if not ctx.paused:
        return []
    resumed = frozenset(ctx.paused)
    ctx.paused.clear()
    return [Resume(resumed)]


class _Idle(_State):
    def barrier(
        self, ctx: _Ctx, channel: Channel, checkpoint_id: int
    ) -> tuple[_State, list[Action]]:
        if checkpoint_id <= ctx.newest or channel not in ctx.live:
            return self, []
        if channel in ctx.back and not ctx.unaligned:
            return self, []  # aligned: a back-edge's barrier only comes around after a snapshot
        # Unaligned, a back-edge's barrier can come first: a loop body snapshots and forwards at
        # the first barrier it reads, which may be another head subtask's. Ignoring it lost it,
        # and the checkpoint waited for it until it timed out (found by the progress-placed kills
        # of tests/e2e/test_iterate.py). Like any first barrier, it starts the checkpoint.
        return _start(ctx, channel, checkpoint_id, [])

    def finished(self, ctx: _Ctx, channel: Channel) -> tuple[_State, list[Action]]:
        ctx.live.discard(channel)
        return self, []


def _start(
    ctx: _Ctx, channel: Channel, checkpoint_id: int, actions: list[Action]
) -> tuple[_State, list[Action]]:
    ctx.newest = checkpoint_id
    arrived = {channel}
    if ctx.unaligned:
        actions += [TakeSnapshot(checkpoint_id), ForwardBarrier(checkpoint_id)]
        return _Collecting(checkpoint_id, arrived).check(ctx, actions)
    return _Aligning(checkpoint_id, arrived).check(ctx, actions, channel)


class _InProgress(_State):
    """A checkpoint that has started on this task and waits for barriers on the other channels."""

    def __init__(self, checkpoint_id: int, arrived: set[Channel]) -> None:
        self.checkpoint_id = checkpoint_id
        self.arrived = arrived

    @property
    def pending(self) -> int | None:
        return self.checkpoint_id

    def barrier(
        self, ctx: _Ctx, channel: Channel, checkpoint_id: int
    ) -> tuple[_State, list[Action]]:
        if channel not in ctx.live or checkpoint_id < self.checkpoint_id:
            return self, []
        if checkpoint_id > self.checkpoint_id and (channel not in ctx.back or ctx.unaligned):
            # A newer barrier overtook this checkpoint on some channel: it can never align.
            actions: list[Action] = [
                AbortCheckpoint(self.checkpoint_id, f"subsumed by {checkpoint_id}")
            ]
            actions += _resume_all(ctx)
            return _start(ctx, channel, checkpoint_id, actions)
        if channel in self.arrived or checkpoint_id != self.checkpoint_id:
            return self, []  # a replayed duplicate of a barrier already counted
        self.arrived.add(channel)
        return self.check(ctx, [], channel)

    def finished(self, ctx: _Ctx, channel: Channel) -> tuple[_State, list[Action]]:
        ctx.live.discard(channel)
        ctx.paused.discard(channel)
        return self.check(ctx, [])

    def abort(self, ctx: _Ctx, checkpoint_id: int, reason: str) -> tuple[_State, list[Action]]:
        if checkpoint_id != self.checkpoint_id:
            return self, []
        return _Idle(), [AbortCheckpoint(checkpoint_id, reason), *_resume_all(ctx)]

    def check(
        self, ctx: _Ctx, actions: list[Action], channel: Channel | None = None
    ) -> tuple[_State, list[Action]]:
        raise NotImplementedError


class _Aligning(_InProgress):
    def check(
        self, ctx: _Ctx, actions: list[Action], channel: Channel | None = None
    ) -> tuple[_State, list[Action]]:
        n = self.checkpoint_id
        if ctx.live <= self.arrived:
            actions += [TakeSnapshot(n), ForwardBarrier(n), *_resume_all(ctx), AlignmentDone(n)]
            return _Idle(), actions
        if ctx.live - ctx.back <= self.arrived:  # Algorithm 2: log the back-edges until n returns
            actions += [TakeSnapshot(n), ForwardBarrier(n), *_resume_all(ctx)]
            return _Collecting(n, self.arrived), actions
        if channel is not None and channel not in ctx.back:
            ctx.paused.add(channel)
            actions.append(Pause(channel))
        return self, actions


class _Collecting(_InProgress):
    def check(
        self, ctx: _Ctx, actions: list[Action], channel: Channel | None = None
    ) -> tuple[_State, list[Action]]:
        if ctx.live <= self.arrived:
            actions.append(AlignmentDone(self.checkpoint_id))
            return _Idle(), actions
        return self, actions


class BarrierAligner:
    """Turns barrier arrivals on a task's input channels into snapshot, forward and pause actions.

    Args:
        channels: the task's input channels (e.g. ``(topic, partition)`` pairs).
        unaligned: snapshot at the first barrier and never pause (default: aligned).
        restored_checkpoint: the checkpoint this task restored; its barriers and older are stale.
        back_edges: the channels of ``channels`` that are loop back-edges (Algorithm 2: they are
            not aligned before the snapshot, only collected after it).
    """

    def __init__(
        self,
        channels: Collection[Channel],
        *,
        unaligned: bool = False,
        restored_checkpoint: int = 0,
        back_edges: Collection[Channel] = (),
    ) -> None:
        if not channels:
            raise ValueError(
                "a task with no input channels is a source: use trigger(), not barriers"
            )
        back = frozenset(back_edges)
        if not back <= set(channels) or back == set(channels):
            raise ValueError("back-edges must be some, not all, of the task's channels")
        self._ctx = _Ctx(set(channels), unaligned, back, newest=restored_checkpoint)
        self._state: _State = _Idle()

    def on_barrier(
        self, channel: Channel, checkpoint_id: int, *, unaligned: bool | None = None
    ) -> list[Action]:
        """Barrier ``checkpoint_id`` was read from ``channel``.

        ``unaligned`` (the barrier's own flag) chooses the mode of a checkpoint this barrier
        starts; ``None`` keeps the task's default. A final checkpoint is always aligned: in
        unaligned mode the records still in flight on other channels would belong to an epoch
        that never commits.
        """
        if unaligned is not None:
            self._ctx.unaligned = unaligned  # read only when a newer checkpoint starts
        self._state, actions = self._state.barrier(self._ctx, channel, checkpoint_id)
        return actions

    def on_end_of_stream(self, channel: Channel) -> list[Action]:
        """``channel`` will deliver nothing more; alignment stops waiting for it."""
        self._state, actions = self._state.finished(self._ctx, channel)
        return actions

    def on_abort(
        self, checkpoint_id: int, reason: str = "aborted by the coordinator"
    ) -> list[Action]:
        """The coordinator gave up on ``checkpoint_id`` (timeout, a failed task)."""
        self._state, actions = self._state.abort(self._ctx, checkpoint_id, reason)
        return actions

    def trigger(self, checkpoint_id: int) -> list[Action]:
        """Start a checkpoint without a barrier: for a task whose every input has ended."""
        if self._ctx.live:
            raise RuntimeError(
                f"trigger() with live input channels {sorted(map(str, self._ctx.live))}"
            )
        if checkpoint_id <= self._ctx.newest:
            return []
        self._ctx.newest = checkpoint_id
        n = checkpoint_id
        return [TakeSnapshot(n), ForwardBarrier(n), AlignmentDone(n)]

    @property
    def pending_checkpoint(self) -> int | None:
        """The checkpoint being aligned, if any."""
        return self._state.pending

    @property
    def collecting(self) -> int | None:
        """The checkpoint whose snapshot is taken and whose barrier has not yet arrived on every
        live channel (unaligned, or a loop head's back-edges), if any."""
        return self._state.checkpoint_id if isinstance(self._state, _Collecting) else None

    @property
    def paused(self) -> frozenset[Channel]:
        return frozenset(self._ctx.paused)

    @property
    def live_channels(self) -> frozenset[Channel]:
        return frozenset(self._ctx.live)
