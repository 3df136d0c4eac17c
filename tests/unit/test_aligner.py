"""Barrier alignment over random interleavings of FIFO input channels (hypothesis).

Each channel is a FIFO sequence of data records, barriers and an optional end-of-stream; the
simulator delivers the head of any channel that is not paused, in an order hypothesis chooses, and
executes the aligner's actions the way the task runtime will.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from processor.checkpoint import (
    AbortCheckpoint,
    AlignmentDone,
    BarrierAligner,
    ForwardBarrier,
    Pause,
    Resume,
    TakeSnapshot,
)

EOS = ("eos",)


def _barrier(n: int) -> tuple[str, int]:
    return ("barrier", n)


@dataclass
class Run:
    snapshots: dict[int, frozenset[str]] = field(default_factory=dict)
    snapshot_order: list[int] = field(default_factory=list)
    done: list[int] = field(default_factory=list)
    forwarded: list[int] = field(default_factory=list)
    aborted: list[int] = field(default_factory=list)
    pauses: int = 0
    # barriers (or end) each channel had delivered when each AlignmentDone / TakeSnapshot happened
    delivered_at_done: dict[int, dict[int, set[object]]] = field(default_factory=dict)
    delivered_at_snapshot: dict[int, dict[int, set[object]]] = field(default_factory=dict)


def simulate(channels: list[list[object]], unaligned: bool, data: st.DataObject) -> Run:
    aligner = BarrierAligner(range(len(channels)), unaligned=unaligned)
    heads = [0] * len(channels)
    paused: set[int] = set()
    processed: set[str] = set()
    delivered: dict[int, set[object]] = {c: set() for c in range(len(channels))}
    run = Run()
    while True:
        ready = [c for c in range(len(channels)) if c not in paused and heads[c] < len(channels[c])]
        if not ready:
            break
        c = data.draw(st.sampled_from(ready))
        event = channels[c][heads[c]]
        heads[c] += 1
        if isinstance(event, str):
            processed.add(event)
            continue
        if event == EOS:
            delivered[c].add("eos")
            actions = aligner.on_end_of_stream(c)
        else:
            delivered[c].add(event[1])
            actions = aligner.on_barrier(c, event[1])
        for action in actions:
            if isinstance(action, Pause):
                assert action.channel not in paused
                paused.add(action.channel)
                run.pauses += 1
            elif isinstance(action, Resume):
                assert action.channels <= paused
                paused -= action.channels
            elif isinstance(action, TakeSnapshot):
                n = action.checkpoint_id
                assert n not in run.snapshots, f"checkpoint {n} snapshotted twice"
                run.snapshots[n] = frozenset(processed)
                run.snapshot_order.append(n)
                run.delivered_at_snapshot[n] = {k: set(v) for k, v in delivered.items()}
            elif isinstance(action, ForwardBarrier):
                run.forwarded.append(action.checkpoint_id)
            elif isinstance(action, AlignmentDone):
                n = action.checkpoint_id
                assert n not in run.done, f"alignment of {n} reported twice"
                run.done.append(n)
                run.delivered_at_done[n] = {k: set(v) for k, v in delivered.items()}
            elif isinstance(action, AbortCheckpoint):
                run.aborted.append(action.checkpoint_id)
    assert all(heads[c] == len(channels[c]) for c in range(len(channels))), (
        f"deadlock: channels {sorted(paused)} paused with input left"
    )
    assert not paused, f"channels {sorted(paused)} left paused"
    return run


def _before(channel: list[object], n: int) -> set[str]:
    """Data records that precede barrier n on a channel (all of them if it has no barrier n)."""
    out: set[str] = set()
    for event in channel:
        if event == _barrier(n):
            break
        if isinstance(event, str):
            out.add(event)
    return out


@st.composite
def complete_channels(draw: st.DrawFn) -> tuple[list[list[object]], int]:
    """1-5 channels, each delivering barriers 1..m in order with data between, maybe then EOS."""
    k = draw(st.integers(1, 5))
    m = draw(st.integers(1, 6))
    channels: list[list[object]] = []
    for c in range(k):
        events: list[object] = []
        for n in range(1, m + 2):
            events += [f"c{c}-e{n}-r{i}" for i in range(draw(st.integers(0, 3)))]
            if n <= m:
                events.append(_barrier(n))
        if draw(st.booleans()):
            events.append(EOS)
        channels.append(events)
    return channels, m


@st.composite
def gappy_channels(draw: st.DrawFn) -> list[list[object]]:
    """Channels that each deliver an increasing subsequence of barriers, then end-of-stream."""
    k = draw(st.integers(1, 4))
    m = draw(st.integers(1, 6))
    channels: list[list[object]] = []
    for c in range(k):
        ids = sorted(draw(st.sets(st.integers(1, m))))
        events: list[object] = []
        for n in ids:
            events += [f"c{c}-b{n}-r{i}" for i in range(draw(st.integers(0, 2)))]
            events.append(_barrier(n))
        events += [f"c{c}-tail-r{i}" for i in range(draw(st.integers(0, 2)))]
        events.append(EOS)
        channels.append(events)
    return channels


@settings(max_examples=400, deadline=None)
@given(complete_channels(), st.data())
def test_aligned_snapshot_holds_exactly_the_records_before_the_barrier_when_channels_interleave(
    spec: tuple[list[list[object]], int], data: st.DataObject
) -> None:
    channels, m = spec
    run = simulate(channels, unaligned=False, data=data)
    assert run.snapshot_order == list(range(1, m + 1))
    assert run.done == run.forwarded == list(range(1, m + 1))
    assert run.aborted == []
    for n in range(1, m + 1):
        expected = set().union(*(_before(ch, n) for ch in channels))
        assert run.snapshots[n] == expected, f"snapshot {n} is not the consistent cut"
        assert all(n in got for got in run.delivered_at_snapshot[n].values())


@settings(max_examples=400, deadline=None)
@given(gappy_channels(), st.data(), st.booleans())
def test_checkpoint_completes_only_when_every_live_channel_delivered_it_when_barriers_are_missing(
    channels: list[list[object]], data: st.DataObject, unaligned: bool
) -> None:
    run = simulate(channels, unaligned=unaligned, data=data)
    assert run.snapshot_order == sorted(set(run.snapshot_order)), (
        "snapshots out of order or repeated"
    )
    for n, delivered in run.delivered_at_done.items():
        for channel, got in delivered.items():
            assert n in got or "eos" in got, f"checkpoint {n} done before channel {channel} had it"
        assert n in run.snapshots
    assert set(run.done).isdisjoint(run.aborted)
    if unaligned:
        assert run.pauses == 0
    else:
        for n in run.done:
            expected = set().union(
                *(
                    _before(ch, n)
                    for c, ch in enumerate(channels)
                    if n in run.delivered_at_snapshot[n][c]
                )
            )
            assert expected <= run.snapshots[n]


@settings(max_examples=300, deadline=None)
@given(complete_channels(), st.data())
def test_unaligned_snapshots_at_the_first_barrier_and_never_pauses_when_channels_interleave(
    spec: tuple[list[list[object]], int], data: st.DataObject
) -> None:
    channels, m = spec
    run = simulate(channels, unaligned=True, data=data)
    assert run.pauses == 0
    assert set(run.snapshot_order) | set(run.aborted) >= set(range(1, m + 1))
    for n in run.snapshot_order:
        # At the snapshot, at least one channel (the first to deliver it) had barrier n.
        assert any(n in got for got in run.delivered_at_snapshot[n].values())
    for n in run.done:
        assert all(n in got or "eos" in got for got in run.delivered_at_done[n].values())


def test_stale_barrier_is_ignored_when_its_checkpoint_was_restored() -> None:
    aligner = BarrierAligner(["a", "b"], restored_checkpoint=5)
    assert aligner.on_barrier("a", 5) == []
    assert aligner.on_barrier("a", 3) == []
    assert aligner.on_barrier("a", 6) == [Pause("a")]
    assert aligner.pending_checkpoint == 6


def test_newer_barrier_aborts_the_pending_checkpoint_when_it_overtakes_it() -> None:
    aligner = BarrierAligner(["a", "b"])
    assert aligner.on_barrier("a", 1) == [Pause("a")]
    assert aligner.on_barrier("b", 2) == [
        AbortCheckpoint(1, "subsumed by 2"),
        Resume(frozenset({"a"})),
        Pause("b"),
    ]
    assert aligner.on_barrier("a", 2) == [
        TakeSnapshot(2),
        ForwardBarrier(2),
        Resume(frozenset({"b"})),
        AlignmentDone(2),
    ]


def test_coordinator_abort_resumes_paused_channels_when_the_checkpoint_is_pending() -> None:
    aligner = BarrierAligner(["a", "b"])
    aligner.on_barrier("a", 1)
    assert aligner.on_abort(1, "timeout") == [
        AbortCheckpoint(1, "timeout"),
        Resume(frozenset({"a"})),
    ]
    assert aligner.pending_checkpoint is None
    assert aligner.on_barrier("b", 1) == []  # its barriers are stale now


def test_end_of_stream_completes_alignment_when_the_last_missing_channel_ends() -> None:
    aligner = BarrierAligner(["a", "b"])
    aligner.on_barrier("a", 1)
    assert aligner.on_end_of_stream("b") == [
        TakeSnapshot(1),
        ForwardBarrier(1),
        Resume(frozenset({"a"})),
        AlignmentDone(1),
    ]


def test_trigger_snapshots_when_every_input_has_ended() -> None:
    aligner = BarrierAligner(["a"])
    with pytest.raises(RuntimeError, match="live input"):
        aligner.trigger(1)
    aligner.on_end_of_stream("a")
    assert aligner.trigger(1) == [TakeSnapshot(1), ForwardBarrier(1), AlignmentDone(1)]
    assert aligner.trigger(1) == []


def test_aligner_refuses_when_the_task_has_no_input_channels() -> None:
    with pytest.raises(ValueError, match="source"):
        BarrierAligner([])
