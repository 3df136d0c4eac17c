"""Cyclic dataflows: ``Stream.iterate``, the compiler's back-edges and loop flags, and barrier
alignment with back-edges (Algorithm 2 of Carbone et al. 2015), down to a simulated loop where
plain aligned ABS deadlocks and Algorithm 2 completes every checkpoint consistently."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest

from processor.checkpoint import (
    AbortCheckpoint,
    Action,
    AlignmentDone,
    BarrierAligner,
    ForwardBarrier,
    Pause,
    Resume,
    TakeSnapshot,
)
from processor.compiler import _back_edges, compile_flow
from processor.contracts import SinkContext
from processor.dataflow import Dataflow, Stream, Tumbling
from processor.errors import DefinitionError


class _Sink:
    def open(self, ctx: SinkContext) -> Any:
        raise AssertionError("not opened in these tests")


def _filter_map_body(loop: Stream) -> tuple[Stream, Stream]:
    return loop.filter("again", bool), loop.map("done", str)


# -- the Dataflow API ------------------------------------------------------------------------------


def test_iterate_returns_the_output_stream_and_records_the_feedback_step_when_built() -> None:
    flow = Dataflow("job")
    out = flow.source("src", "t").iterate("loop", _filter_map_body, max_iterations=3)
    assert out.step.name == "done"
    head = flow.steps["loop"]
    assert head.kind == "iterate" and head.parents == ("src",) and not head.keyed
    assert head.params == {"max_iterations": 3, "feedback": "again"}
    assert flow.steps["again"].parents == ("loop",)
    out.sink("out", _Sink())
    flow.validate()  # "again" is consumed by the loop alone, not dangling


def test_validate_names_the_output_when_the_loop_output_has_no_sink() -> None:
    flow = Dataflow("job")
    flow.source("src", "t").iterate("loop", _filter_map_body)
    with pytest.raises(DefinitionError, match=r"\['done'\] goes nowhere"):
        flow.validate()


def test_nested_iterate_is_refused_when_built_inside_a_body() -> None:
    flow = Dataflow("job")

    def outer(loop: Stream) -> tuple[Stream, Stream]:
        inner = loop.iterate("inner", _filter_map_body)
        return inner, loop.map("out", str)

    with pytest.raises(DefinitionError, match=r"inside the body of iterate 'outer'.*nested"):
        flow.source("src", "t").iterate("outer", outer)
    # the open-loop marker is cleared: a later, separate loop is fine
    flow2 = Dataflow("job2")
    flow2.source("src", "t").iterate("loop", _filter_map_body).sink("out", _Sink())
    flow2.validate()


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "3"])
def test_max_iterations_must_be_a_positive_int_when_given(bad: Any) -> None:
    flow = Dataflow("job")
    with pytest.raises(DefinitionError, match="max_iterations must be a positive int or None"):
        flow.source("src", "t").iterate("loop", _filter_map_body, max_iterations=bad)


def test_body_must_be_callable() -> None:
    flow = Dataflow("job")
    with pytest.raises(DefinitionError, match="body must be callable"):
        flow.source("src", "t").iterate("loop", 3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "returns",
    [
        lambda loop: loop.map("m", str),  # one stream, not two
        lambda loop: (loop.map("m", str),),
        lambda loop: (loop.map("m", str), loop.map("n", str), loop.map("o", str)),
        lambda loop: [loop.map("m", str), loop.map("n", str)],  # a list, not a tuple
        lambda loop: (loop.map("m", str), None),
        lambda loop: (loop.map("m", str), Dataflow("other").source("x", "t")),
    ],
)
def test_body_must_return_two_streams_of_this_flow(returns: Any) -> None:
    flow = Dataflow("job")
    with pytest.raises(DefinitionError, match=r"body must return \(feedback, output\)"):
        flow.source("src", "t").iterate("loop", returns)


def test_feedback_is_refused_when_it_is_the_loop_itself() -> None:
    flow = Dataflow("job")
    with pytest.raises(DefinitionError, match="feedback stream is the loop itself"):
        flow.source("src", "t").iterate("loop", lambda loop: (loop, loop.map("out", str)))


def test_feedback_is_refused_when_it_does_not_descend_from_the_loop() -> None:
    flow = Dataflow("job")
    src = flow.source("src", "t")
    side = flow.source("side", "t2").map("side-map", str)
    with pytest.raises(DefinitionError, match=r"feedback stream \(step 'side-map'\) does not come"):
        src.iterate("loop", lambda loop: (side, loop.map("out", str)))
    with pytest.raises(DefinitionError, match=r"feedback stream \(step 'src'\) does not come"):
        src.iterate("loop2", lambda loop: (src, loop.map("out2", str)))


# -- the compiler ----------------------------------------------------------------------------------


def _components_flow() -> Dataflow:
    """examples/connected_components.py, plus a shuffle after the loop (an edge leaving it)."""
    flow = Dataflow("cc")

    def propagate(loop: Stream) -> tuple[Stream, Stream]:
        nodes = loop.key_by("by-node", lambda m: m["node"]).aggregate(
            "node-state", init=lambda: None, add=lambda acc, m: m
        )
        messages = nodes.flat_map("tell-neighbours", lambda s: s["send"])
        labels = nodes.filter("label-changed", lambda s: s["changed"]).map(
            "label", lambda s: s["label"]
        )
        return messages, labels

    (
        flow.source("edges", "edges")
        .flat_map("both-ends", lambda e: [{"node": e["u"]}, {"node": e["v"]}])
        .iterate("propagate", propagate)
        .key_by("by-label", lambda label: label)
        .count("sizes")
        .sink("out", _Sink())
    )
    return flow


def test_connected_components_compiles_to_a_dag_plus_one_back_edge_into_the_head() -> None:
    plan = compile_flow(_components_flow(), 2)
    assert [s.steps for s in plan.stages] == [
        ("edges", "both-ends"),
        ("propagate", "by-node"),
        ("node-state", "tell-neighbours", "label-changed", "label", "by-label"),
        ("sizes", "out"),
    ]
    assert plan.cyclic
    (back,) = [e for e in plan.edges if e.back]
    assert (back.src_step, back.dst_step) == ("tell-neighbours", "propagate")
    assert (back.src_stage, back.dst_stage) == ("node-state", "propagate")
    assert not back.shuffle and not back.combine and back.loop
    flags = {(e.src_step, e.dst_step): (e.shuffle, e.back, e.loop) for e in plan.edges}
    assert flags == {
        ("both-ends", "propagate"): (False, False, False),  # into the loop
        ("by-node", "node-state"): (True, False, True),  # the shuffle inside the loop
        ("tell-neighbours", "propagate"): (False, True, True),  # the feedback
        ("by-label", "sizes"): (True, False, False),  # leaving the loop
    }
    head = plan.stage_of("propagate")
    assert {e.src_step for e in head.inputs} == {"both-ends", "tell-neighbours"}
    assert "back-edge (loop feedback) tell-neighbours -> propagate" in plan.describe()


def test_acyclic_plan_is_not_cyclic() -> None:
    flow = Dataflow("job")
    flow.source("src", "t").key_by("k", str).count("c").sink("out", _Sink())
    plan = compile_flow(flow, 2)
    assert not plan.cyclic
    assert not any(e.back or e.loop for e in plan.edges)
    assert "back-edge" not in plan.describe()


def test_body_without_a_shuffle_compiles_to_a_self_loop_on_the_head_stage() -> None:
    flow = Dataflow("job")
    flow.source("src", "t").iterate("loop", _filter_map_body).sink("out", _Sink())
    plan = compile_flow(flow, 3)
    assert [s.steps for s in plan.stages] == [("src",), ("loop", "again", "done", "out")]
    entry, back = plan.edges
    assert (entry.src_stage, entry.dst_stage, entry.back, entry.loop) == (
        "src",
        "loop",
        False,
        False,
    )
    assert back.src_stage == back.dst_stage == "loop"
    assert back.back and back.loop and plan.cyclic


def _windowed_count(stream: Stream) -> Stream:
    return stream.key_by("by-page", str).count("per-window", window=Tumbling(timedelta(seconds=10)))


def test_combiner_is_off_when_the_windowed_aggregation_is_inside_a_loop() -> None:
    def body(loop: Stream) -> tuple[Stream, Stream]:
        counts = _windowed_count(loop)
        return counts.filter("again", lambda _v: False), counts.map("done", str)

    looped = Dataflow("job")
    looped.source("src", "t").iterate("loop", body).sink("out", _Sink())
    (shuffle,) = [e for e in compile_flow(looped, 2).edges if e.shuffle]
    assert shuffle.dst_step == "per-window" and shuffle.loop and not shuffle.combine

    straight = Dataflow("job")
    _windowed_count(straight.source("src", "t")).sink("out", _Sink())
    (shuffle,) = compile_flow(straight, 2).edges
    assert shuffle.shuffle and shuffle.combine and not shuffle.loop


def _union_in_body_flow(*, outside_source_first: bool) -> Dataflow:
    """A union inside the body with a stream from another source (outside the loop)."""
    flow = Dataflow("job")
    if outside_source_first:
        side = flow.source("side", "t2").map("side-map", str)
        src = flow.source("src", "t")
    else:
        src = flow.source("src", "t")
        side = flow.source("side", "t2").map("side-map", str)

    def body(loop: Stream) -> tuple[Stream, Stream]:
        mixed = loop.union("mix", side)
        return mixed.filter("again", bool), mixed.map("done", str)

    src.iterate("loop", body).sink("out", _Sink())
    return flow


def test_union_with_an_outside_stream_in_the_body_depends_on_the_order_of_the_sources() -> None:
    # The loop's source first: the search enters the loop at its head and finds the feedback.
    plan = compile_flow(_union_in_body_flow(outside_source_first=False), 2)
    (back,) = [e for e in plan.edges if e.back]
    assert (back.src_step, back.dst_step) == ("again", "loop")
    loop = {(e.src_step, e.dst_step): e.loop for e in plan.edges}
    assert loop == {
        ("src", "loop"): False,
        ("side-map", "mix"): False,
        ("loop", "mix"): True,
        ("again", "loop"): True,
    }
    # The outside source first: the search enters the loop at the union, so head -> union is
    # the edge it closes the cycle with, and the plan is refused.
    with pytest.raises(DefinitionError, match="'loop' -> 'mix' is not the back-edge a depth-first"):
        compile_flow(_union_in_body_flow(outside_source_first=True), 2)


def test_two_loops_in_sequence_get_one_back_edge_each() -> None:
    def body(prefix: str) -> Any:
        def build(loop: Stream) -> tuple[Stream, Stream]:
            state = loop.key_by(f"{prefix}-key", str).aggregate(
                f"{prefix}-agg", init=lambda: None, add=lambda _acc, v: v
            )
            return state.filter(f"{prefix}-again", bool), state.map(f"{prefix}-done", str)

        return build

    flow = Dataflow("job")
    flow.source("src", "t").iterate("l1", body("a")).iterate("l2", body("b")).sink("o", _Sink())
    plan = compile_flow(flow, 2)
    flags = {(e.src_step, e.dst_step): (e.back, e.loop) for e in plan.edges}
    assert flags == {
        ("src", "l1"): (False, False),
        ("a-key", "a-agg"): (False, True),
        ("a-again", "l1"): (True, True),
        ("a-done", "l2"): (False, False),  # from the first loop into the second
        ("b-key", "b-agg"): (False, True),
        ("b-again", "l2"): (True, True),
    }


def test_back_edges_of_a_dag_and_a_diamond_are_none() -> None:
    assert _back_edges(["s"], [("s", "a"), ("a", "b"), ("s", "b")]) == set()
    diamond = [("s", "a"), ("s", "b"), ("a", "d"), ("b", "d")]
    assert _back_edges(["s"], diamond) == set()


def test_back_edge_of_a_cycle_is_the_edge_closing_it() -> None:
    assert _back_edges(["s"], [("s", "x"), ("x", "y"), ("y", "z"), ("z", "x")]) == {3}
    assert _back_edges(["s"], [("s", "x"), ("x", "x")]) == {1}  # a self-loop
    # only what the sources reach is searched
    assert _back_edges(["s"], [("s", "a"), ("b", "c"), ("c", "b")]) == set()


def test_back_edge_depends_on_the_order_of_the_roots_when_two_roots_enter_one_cycle() -> None:
    edges = [("s1", "a"), ("a", "b"), ("b", "a"), ("s2", "b")]
    assert _back_edges(["s1", "s2"], edges) == {2}  # s2 -> b is a cross edge: b is done
    assert _back_edges(["s2", "s1"], edges) == {1}  # entered at b, the cycle closes at a -> b
    two_cycles = [("s1", "a"), ("a", "s1x"), ("s1x", "a"), ("s2", "b"), ("b", "b")]
    assert _back_edges(["s1", "s2"], two_cycles) == {2, 4}


# -- barrier alignment with back-edges (Algorithm 2) -----------------------------------------------


def _head(*, unaligned: bool = False) -> BarrierAligner:
    """A loop head: regular inputs r0, r1 and the back-edge b."""
    return BarrierAligner(["r0", "r1", "b"], unaligned=unaligned, back_edges={"b"})


def test_head_snapshots_when_the_regular_channels_align_and_completes_when_the_back_edge_does() -> (
    None
):
    aligner = _head()
    assert aligner.on_barrier("r0", 1) == [Pause("r0")]
    assert aligner.pending_checkpoint == 1 and aligner.collecting is None
    assert aligner.on_barrier("r1", 1) == [
        TakeSnapshot(1),
        ForwardBarrier(1),
        Resume(frozenset({"r0"})),
    ]  # no AlignmentDone: barrier 1 has yet to come around the loop
    assert aligner.collecting == 1 and aligner.pending_checkpoint == 1
    assert aligner.paused == frozenset()
    assert aligner.on_barrier("b", 1) == [AlignmentDone(1)]
    assert aligner.collecting is None and aligner.pending_checkpoint is None
    # and the next checkpoint runs the same way
    assert aligner.on_barrier("r1", 2) == [Pause("r1")]
    assert aligner.on_barrier("r0", 2) == [
        TakeSnapshot(2),
        ForwardBarrier(2),
        Resume(frozenset({"r1"})),
    ]
    assert aligner.on_barrier("b", 2) == [AlignmentDone(2)]


def test_back_edge_barrier_never_starts_a_checkpoint_when_the_aligned_head_is_idle() -> None:
    aligner = _head()
    assert aligner.on_barrier("b", 1) == []
    assert aligner.pending_checkpoint is None and aligner.paused == frozenset()
    # and it did not make checkpoint 1 stale: the regular channels still start it
    assert aligner.on_barrier("r0", 1) != []
    assert aligner.pending_checkpoint == 1


def test_back_edge_barrier_starts_the_checkpoint_when_it_comes_first_to_an_unaligned_head() -> None:
    """Regression: unaligned, the loop body forwards at the first barrier it reads, which may be
    another head subtask's, so barrier n can come around a back-edge before this head read it on
    a regular channel. The head ignored it and then waited for it until the checkpoint timed out
    (found by tests/e2e/test_iterate.py once its kills were placed by progress)."""
    aligner = _head(unaligned=True)
    assert aligner.on_barrier("b", 1) == [TakeSnapshot(1), ForwardBarrier(1)]
    assert aligner.collecting == 1
    assert aligner.on_barrier("r0", 1) == []
    assert aligner.on_barrier("r1", 1) == [AlignmentDone(1)]


def test_newer_back_edge_barrier_subsumes_the_checkpoint_when_the_head_is_unaligned() -> None:
    aligner = _head(unaligned=True)
    assert aligner.on_barrier("r0", 1) == [TakeSnapshot(1), ForwardBarrier(1)]
    assert aligner.on_barrier("b", 1) == []
    assert aligner.on_barrier("b", 2) == [
        AbortCheckpoint(1, "subsumed by 2"),
        TakeSnapshot(2),
        ForwardBarrier(2),
    ]
    assert aligner.on_barrier("r1", 1) == []  # stale now
    assert aligner.on_barrier("r0", 2) == []
    assert aligner.on_barrier("r1", 2) == [AlignmentDone(2)]


def test_back_edge_barrier_is_never_paused_and_counts_when_it_arrives_while_aligning() -> None:
    # Not a schedule a valid plan produces (barrier n only comes around after the head forwarded
    # it), but what the aligner does: like Algorithm 2's ``marked``, the barrier is counted.
    aligner = _head()
    assert aligner.on_barrier("r0", 1) == [Pause("r0")]
    assert aligner.on_barrier("b", 1) == []
    assert aligner.paused == frozenset({"r0"})
    assert aligner.on_barrier("r1", 1) == [
        TakeSnapshot(1),
        ForwardBarrier(1),
        Resume(frozenset({"r0"})),
        AlignmentDone(1),
    ]


def test_newer_regular_barrier_aborts_the_checkpoint_when_the_head_is_still_collecting() -> None:
    aligner = _head()
    aligner.on_barrier("r0", 1)
    aligner.on_barrier("r1", 1)
    assert aligner.collecting == 1
    assert aligner.on_barrier("b", 2) == []  # a newer back-edge barrier is ignored
    assert aligner.on_barrier("r0", 2) == [AbortCheckpoint(1, "subsumed by 2"), Pause("r0")]
    assert aligner.collecting is None and aligner.pending_checkpoint == 2
    assert aligner.on_barrier("b", 1) == []  # stale now
    assert aligner.on_barrier("r1", 2) == [
        TakeSnapshot(2),
        ForwardBarrier(2),
        Resume(frozenset({"r0"})),
    ]
    assert aligner.on_barrier("b", 2) == [AlignmentDone(2)]


def test_end_of_the_back_edge_completes_the_checkpoint_when_the_head_is_collecting() -> None:
    aligner = _head()
    aligner.on_barrier("r0", 1)
    aligner.on_barrier("r1", 1)
    assert aligner.on_end_of_stream("b") == [AlignmentDone(1)]
    assert aligner.live_channels == frozenset({"r0", "r1"})


def test_unaligned_head_snapshots_at_the_first_regular_barrier_then_waits_for_the_back_edge() -> (
    None
):
    aligner = _head(unaligned=True)
    assert aligner.on_barrier("r0", 1) == [TakeSnapshot(1), ForwardBarrier(1)]
    assert aligner.collecting == 1
    assert aligner.on_barrier("r1", 1) == []
    assert aligner.collecting == 1 and aligner.paused == frozenset()
    assert aligner.on_barrier("b", 1) == [AlignmentDone(1)]
    assert aligner.collecting is None


def test_aligner_refuses_back_edges_when_they_are_not_some_of_the_channels() -> None:
    with pytest.raises(ValueError, match="some, not all"):
        BarrierAligner(["r", "b"], back_edges={"x"})
    with pytest.raises(ValueError, match="some, not all"):
        BarrierAligner(["r", "b"], back_edges={"b", "x"})
    with pytest.raises(ValueError, match="some, not all"):
        BarrierAligner(["r", "b"], back_edges={"r", "b"})
    assert BarrierAligner(["r", "b"], back_edges=()).on_barrier("b", 1) == [Pause("b")]


# -- a simulated loop: plain ABS deadlocks, Algorithm 2 completes every checkpoint -----------------


@dataclass
class _Task:
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    aligner: BarrierAligner | None = None  # None: the source
    paused: set[str] = field(default_factory=set)
    count: int = 0  # the task's state: records emitted (S), read (H), passes counted (T)
    snapshots: dict[int, int] = field(default_factory=dict)  # checkpoint -> count
    acked: list[int] = field(default_factory=list)
    aborted: list[int] = field(default_factory=list)
    turn: int = 0


@dataclass
class _Run:
    tasks: dict[str, _Task]
    channels: dict[str, deque[tuple[str, int]]]
    triggered: list[int] = field(default_factory=list)
    completed: list[int] = field(default_factory=list)
    # checkpoint -> (channel, hops) of the records H read after its snapshot and before the
    # barrier on that channel: the in-flight records of the cut (only b when aligned)
    log: dict[int, list[tuple[str, int]]] = field(default_factory=dict)
    in_loop_at_first_pause: int | None = None
    quiescent: bool = False  # stopped because nothing could move (not the step limit)


def _simulate(hops: list[int], *, every: int, algorithm_2: bool, unaligned: bool = False) -> _Run:
    """Runs a loop to quiescence, one step per task per round (deterministic round-robin).

    ``S`` (a source with two partitions s0, s1) -> ``H`` (loop head) -> ``T`` (body) -> ``H``
    through the back-edge ``b``, and ``T`` -> ``out``. A record is its remaining hop count: ``T``
    counts a pass and feeds it back with one hop less, or sends it out at zero. Channels are FIFO.
    ``S`` triggers checkpoint n (snapshot, barrier into s0 and s1, ack) once ``every`` records
    passed since the last trigger, and after its last record, if none is pending (like the
    coordinator: one checkpoint at a time). ``H`` and ``T`` read one item of an unpaused input
    per step and obey their real ``BarrierAligner``; ``H`` logs the back-edge records it reads
    while it is collecting a checkpoint, on every channel that has not delivered its barrier yet.
    ``algorithm_2=False`` gives ``H`` no back-edges: b is aligned like any input (plain ABS).
    A task's snapshot is its ``count``.
    """
    ch: dict[str, deque[tuple[str, int]]] = {c: deque() for c in ("s0", "s1", "h", "b", "out")}
    back = ("b",) if algorithm_2 else ()
    head = BarrierAligner(["s0", "s1", "b"], unaligned=unaligned, back_edges=back)
    tasks = {
        "S": _Task("S", (), ("s0", "s1")),
        "H": _Task("H", ("s0", "s1", "b"), ("h",), head),
        "T": _Task("T", ("h",), ("b", "out"), BarrierAligner(["h"], unaligned=unaligned)),
    }
    run = _Run(tasks, ch)
    last_trigger = 0
    arrived: dict[int, set[str]] = {}  # checkpoint -> channels that delivered its barrier

    def obey(task: _Task, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, Pause):
                task.paused.add(str(a.channel))
                if run.in_loop_at_first_pause is None:
                    run.in_loop_at_first_pause = sum(k == "rec" for c in "hb" for k, _ in ch[c])
            elif isinstance(a, Resume):
                task.paused -= a.channels
            elif isinstance(a, TakeSnapshot):
                task.snapshots[a.checkpoint_id] = task.count
            elif isinstance(a, ForwardBarrier):
                for c in task.outputs:
                    ch[c].append(("barrier", a.checkpoint_id))
            elif isinstance(a, AlignmentDone):
                assert a.checkpoint_id in task.snapshots, "ack before the snapshot"
                task.acked.append(a.checkpoint_id)
            elif isinstance(a, AbortCheckpoint):
                task.aborted.append(a.checkpoint_id)

    def source_step(s: _Task) -> bool:
        nonlocal last_trigger
        pending = len(run.triggered) > len(run.completed)
        if not pending and s.count - last_trigger >= min(every, len(hops) - last_trigger) > 0:
            last_trigger = s.count
            run.triggered.append(len(run.triggered) + 1)
            n = run.triggered[-1]
            obey(s, [TakeSnapshot(n), ForwardBarrier(n), AlignmentDone(n)])
            return True
        if s.count == len(hops):
            return False
        ch[s.outputs[s.count % 2]].append(("rec", hops[s.count]))
        s.count += 1
        return True

    def task_step(t: _Task) -> bool:
        assert t.aligner is not None
        ready = [c for c in t.inputs if c not in t.paused and ch[c]]
        if not ready:
            return False
        c = ready[t.turn % len(ready)]
        t.turn += 1
        kind, value = ch[c].popleft()
        if kind == "barrier":
            arrived.setdefault(value, set()).add(c)
            obey(t, t.aligner.on_barrier(c, value))
            return True
        t.count += 1
        if t.name == "H":
            n = t.aligner.collecting
            if n is not None and c not in arrived[n]:
                run.log.setdefault(n, []).append((c, value))
            ch["h"].append(("rec", value))
        else:
            ch["b" if value > 0 else "out"].append(("rec", value - 1 if value > 0 else 0))
        return True

    for _ in range(100_000):
        moved = [source_step(tasks["S"]), task_step(tasks["H"]), task_step(tasks["T"])]
        if run.triggered[len(run.completed) :] and all(
            run.triggered[len(run.completed)] in t.acked for t in tasks.values()
        ):
            run.completed.append(run.triggered[len(run.completed)])
        if not any(moved):
            run.quiescent = True
            break
    return run


_HOPS = [[i % 4 for i in range(40)], [3] * 20, [(i * 7) % 5 for i in range(31)]]


@pytest.mark.parametrize("hops", _HOPS)
def test_plain_aligned_abs_deadlocks_when_the_back_edge_is_aligned_like_any_input(
    hops: list[int],
) -> None:
    run = _simulate(hops, every=5, algorithm_2=False)
    head, body = run.tasks["H"], run.tasks["T"]
    assert run.quiescent  # nothing can move any more ...
    assert run.triggered == [1] and run.completed == []  # ... and checkpoint 1 never completes
    # the head never snapshots nor forwards: barrier 1 cannot come around the loop to it
    assert head.snapshots == {} and head.acked == [] and {"s0", "s1"} <= head.paused
    assert ("barrier", 1) not in run.channels["h"] and body.snapshots == {}
    assert run.in_loop_at_first_pause  # records were in the loop when the head paused
    stuck = sum(k == "rec" for c in ("s0", "s1") for k, _ in run.channels[c])
    assert stuck > 0  # source records wait behind barrier 1 for good
    assert sum(k == "rec" for k, _ in run.channels["out"]) < len(hops)


def test_unaligned_checkpoints_complete_even_when_the_back_edge_is_not_declared() -> None:
    # Unaligned checkpoints are Chandy-Lamport: the snapshot does not wait for any channel.
    run = _simulate(_HOPS[0], every=5, algorithm_2=False, unaligned=True)
    assert run.quiescent and len(run.completed) >= 2 and run.completed == run.triggered


@pytest.mark.parametrize("unaligned", [False, True])
@pytest.mark.parametrize("every", [2, 5, 13])
@pytest.mark.parametrize("hops", _HOPS)
def test_algorithm_2_completes_every_checkpoint_with_a_consistent_cut_when_records_loop(
    hops: list[int], every: int, unaligned: bool
) -> None:
    run = _simulate(hops, every=every, algorithm_2=True, unaligned=unaligned)
    source, head, body = run.tasks["S"], run.tasks["H"], run.tasks["T"]
    assert run.quiescent
    assert len(run.triggered) >= 2
    assert run.completed == run.triggered == list(range(1, len(run.triggered) + 1))
    for task in run.tasks.values():
        assert task.acked == run.completed and task.aborted == [] and task.paused == set()
    # drained: every record made all its passes and left the loop once
    assert all(not q for c, q in run.channels.items() if c != "out")
    assert sum(k == "rec" for k, _ in run.channels["out"]) == len(hops)
    assert body.count == sum(k + 1 for k in hops)
    for n in run.completed:
        # FIFO: T's barrier n follows exactly the records H read before its snapshot n
        assert body.snapshots[n] == head.snapshots[n]
        # conservation across the cut: the passes the source's records before barrier n need
        # are the passes T made before its snapshot plus those of the in-flight records
        log = run.log.get(n, [])
        if not unaligned:
            assert {c for c, _ in log} <= {"b"}  # aligned: only the back-edge is logged
        needed = sum(k + 1 for k in hops[: source.snapshots[n]])
        assert needed == body.snapshots[n] + sum(k + 1 for _, k in log)
    assert any(c == "b" for log in run.log.values() for c, _ in log), "empty back-edge logs"
    assert source.snapshots[run.completed[-1]] == len(hops)  # the last one covers every record


def test_a_refused_loop_leaves_no_step_behind() -> None:
    flow = Dataflow("job")
    src = flow.source("s", "in")
    sink = _Sink()

    def body(loop: Stream) -> tuple[Stream, Stream]:
        loop.map("x", str).sink("side", sink)
        return loop, src

    with pytest.raises(DefinitionError, match="the loop itself"):
        src.iterate("loop", body)
    assert list(flow.steps) == ["s"]
    src.sink("main", sink)
    assert not compile_flow(flow, 1).cyclic
