"""Keyed process functions with timers (issue 23, item 4):
:mod:`processor.runtime.operators.process`.

Timers fire once, in time order; deleted ones never fire; register/delete deduplicate per
(key, time, kind); calls are atomic (a raise changes nothing); processing-time timers run on a
manual clock; and two properties: a snapshot and restore at any point, with any batching, gives
the output of a run without one, and a hand-rolled session end (an event-time timer re-registered
at every record) gives the sessions computed from the records alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from processor.compiler import compile_flow
from processor.dataflow import Dataflow
from processor.errors import DefinitionError
from processor.runtime.operators.core import MAX_WATERMARK, Record
from processor.runtime.operators.process import (
    EVENT_TIME,
    PROCESSING_TIME,
    ProcessContext,
    ProcessOperator,
)
from processor.runtime.operators.registry import build_operator
from processor.snapshot import codec
from sinks import ConsoleSink

Fn = Callable[[ProcessContext, Any], None]
OnTimer = Callable[[ProcessContext, int, str], None]


def _op(fn: Fn, on_timer: OnTimer | None = None, clock: list[int] | None = None) -> ProcessOperator:
    flow = Dataflow("job", dead_letters=ConsoleSink())
    flow.source("s", "t").key_by("k", lambda v: v).process("proc", fn, on_timer=on_timer)
    op = build_operator(flow.steps["proc"])
    assert isinstance(op, ProcessOperator)
    if clock is not None:
        op.clock = lambda: clock[0]
    return op


def _timers_from_values(ctx: ProcessContext, value: Any) -> None:
    """A value ``[action, ts]``: ``reg``/``del`` an event-time timer, ``preg``/``pdel`` a
    processing-time one."""
    action, ts = value
    timers = ctx.timers
    {
        "reg": timers.register_event_time,
        "del": timers.delete_event_time,
        "preg": timers.register_processing_time,
        "pdel": timers.delete_processing_time,
    }[action](ts)


def _fired(ctx: ProcessContext, ts: int, kind: str) -> None:
    ctx.emit([kind, ts, ctx.timestamp_ms, ctx.watermark_ms])


def test_event_time_timers_fire_once_in_time_order_when_the_watermark_reaches_them() -> None:
    op = _op(_timers_from_values, _fired)
    op.process([("b", ["reg", 30], 1), ("a", ["reg", 20], 2), ("a", ["reg", 10], 3)])
    assert op.on_watermark(9) == []
    assert op.on_watermark(25) == [
        ("a", [EVENT_TIME, 10, 10, 25], 10),  # the output is stamped with the timer's time
        ("a", [EVENT_TIME, 20, 20, 25], 20),
    ]
    assert op.on_watermark(30) == [("b", [EVENT_TIME, 30, 30, 30], 30)]
    assert op.on_watermark(MAX_WATERMARK) == [] and op.fired == 3


def test_a_deleted_timer_never_fires_and_deleting_a_missing_one_does_nothing() -> None:
    op = _op(_timers_from_values, _fired)
    op.process([("a", ["reg", 10], 0), ("a", ["del", 10], 0), ("a", ["del", 99], 0)])
    op.process([("b", ["reg", 10], 0), ("a", ["del", 10], 0)])  # b's timer is b's
    assert [k for k, _v, _t in op.on_watermark(MAX_WATERMARK)] == ["b"]


def test_registering_a_timer_twice_keeps_one_and_a_delete_removes_it_whatever_came_before() -> None:
    op = _op(_timers_from_values, _fired)
    op.process([("a", ["reg", 10], 0), ("a", ["reg", 10], 1), ("a", ["preg", 10], 2)])
    assert len(op.on_watermark(10)) == 1  # one event-time timer; the processing-time one waits
    op.process([("a", ["reg", 20], 0), ("a", ["del", 20], 0), ("a", ["reg", 20], 0)])
    op.process([("a", ["reg", 20], 0)])
    assert op.on_watermark(20) == [("a", [EVENT_TIME, 20, 20, 20], 20)]
    assert op.on_processing_time(10) == [("a", [PROCESSING_TIME, 10, 10, 20], 10)]


def test_stale_heap_entries_are_compacted_when_they_outnumber_the_live_timers() -> None:
    op = _op(_timers_from_values, _fired)
    for t in range(1000):  # register at t + 100, delete the previous: one live timer
        op.process([("a", ["reg", t + 100], t), ("a", ["del", t + 99], t)])
    queue = op.timers[EVENT_TIME]
    assert len(queue.live) == 1 and len(queue.heap) < 200
    assert op.on_watermark(MAX_WATERMARK) == [("a", [EVENT_TIME, 1099, 1099, MAX_WATERMARK], 1099)]


def test_a_timer_registered_by_on_timer_at_or_behind_the_watermark_fires_in_the_same_call() -> None:
    def chain(ctx: ProcessContext, ts: int, kind: str) -> None:
        ctx.emit(ts)
        if ts < 5:
            ctx.timers.register_event_time(ts + 1)

    op = _op(_timers_from_values, chain)
    op.process([("a", ["reg", 1], 0)])
    assert [v for _k, v, _t in op.on_watermark(3)] == [1, 2, 3]
    assert [v for _k, v, _t in op.on_watermark(10)] == [4, 5]


def test_processing_time_timers_fire_on_the_clock_and_not_on_the_watermark() -> None:
    clock = [1_000]

    def fn(ctx: ProcessContext, value: Any) -> None:
        ctx.timers.register_processing_time(ctx.processing_time_ms + 50)
        ctx.state.set(value)

    def on_timer(ctx: ProcessContext, ts: int, kind: str) -> None:
        ctx.emit([kind, ts, ctx.state.get()])

    op = _op(fn, on_timer, clock)
    op.process([("a", "x", 0)])
    clock[0] = 1_020
    op.process([("b", "y", 0)])
    assert op.on_watermark(MAX_WATERMARK) == []
    assert op.next_processing_time() == 1_050
    assert op.on_processing_time(1_049) == []
    assert op.on_processing_time(1_060) == [("a", [PROCESSING_TIME, 1_050, "x"], 1_050)]
    assert op.on_processing_time(2_000) == [("b", [PROCESSING_TIME, 1_070, "y"], 1_070)]
    assert op.on_processing_time(3_000) == [] and op.next_processing_time() is None


def test_state_is_per_key_and_reads_see_the_calls_own_writes() -> None:
    def fn(ctx: ProcessContext, value: Any) -> None:
        if value == "clear":
            ctx.state.delete()
            ctx.emit(ctx.state.get("gone"))
            return
        ctx.state.set(ctx.state.get(0) + value)
        ctx.emit(ctx.state.get())

    op = _op(fn)
    out = op.process([("a", 1, 0), ("b", 10, 0), ("a", 2, 0), ("a", "clear", 0), ("a", 5, 0)])
    assert [(k, v) for k, v, _t in out] == [("a", 1), ("b", 10), ("a", 3), ("a", "gone"), ("a", 5)]
    assert op.state == {"a": 5, "b": 10}


def test_a_call_that_raises_changes_nothing_and_its_record_goes_to_the_handler() -> None:
    def fn(ctx: ProcessContext, value: Any) -> None:
        ctx.state.set(value)
        ctx.timers.register_event_time(10)
        ctx.emit(value)
        if value == "bad":
            raise ValueError("bad value")

    failed: list[tuple[Record, str]] = []
    op = _op(fn, _fired)
    op.on_error = lambda _op, batch, i, exc: failed.append((batch[i], str(exc)))
    out = op.process([("a", "ok", 1), ("b", "bad", 2), ("a", "fine", 3)])
    assert out == [("a", "ok", 1), ("a", "fine", 3)]
    assert failed == [(("b", "bad", 2), "bad value")]
    assert op.state == {"a": "fine"}
    assert [k for k, _v, _t in op.on_watermark(10)] == ["a"]
    op.on_error = None
    with pytest.raises(ValueError, match="bad value"):  # without a handler the task fails
        op.process([("c", "bad", 4)])
    assert "c" not in op.state


def test_a_raising_on_timer_consumes_the_timer_and_is_handed_over_as_the_timer() -> None:
    def on_timer(ctx: ProcessContext, ts: int, kind: str) -> None:
        ctx.state.set("changed")
        ctx.emit("lost")
        raise RuntimeError("timer failed")

    failed: list[Record] = []
    op = _op(_timers_from_values, on_timer)
    op.on_error = lambda _op, batch, i, exc: failed.append(batch[i])
    op.process([("a", ["reg", 10], 0)])
    assert op.on_watermark(20) == []
    assert failed == [("a", {"timer_ms": 10, "kind": EVENT_TIME}, 10)]
    assert op.state == {} and op.on_watermark(30) == []


def test_registering_a_timer_without_on_timer_fails_the_job_naming_the_step() -> None:
    op = _op(_timers_from_values)
    op.on_error = lambda *_a: pytest.fail("a definition error is not a bad record")
    with pytest.raises(DefinitionError, match="step 'proc' registers event-time timers"):
        op.process([("a", ["reg", 10], 0)])
    op.process([("a", ["del", 10], 0)])  # deleting needs no on_timer


def test_process_is_defined_with_callables_and_placed_like_a_keyed_aggregate() -> None:
    keyed = Dataflow("job").source("s", "t").key_by("k", lambda v: v)
    with pytest.raises(DefinitionError, match="fn must be callable"):
        keyed.process("p", "not a function")  # type: ignore[arg-type]
    with pytest.raises(DefinitionError, match="on_timer must be callable"):
        keyed.process("p", _fired, on_timer=3)  # type: ignore[arg-type]
    out = keyed.process("p", _timers_from_values, on_timer=_fired)
    out.process("q", _timers_from_values).sink("out", ConsoleSink())  # same key: fused
    plan = compile_flow(keyed.flow, 2)
    assert [s.steps for s in plan.stages] == [("s", "k"), ("p", "q", "out")]
    assert [(e.src_step, e.dst_step, e.shuffle, e.combine) for e in plan.edges] == [
        ("k", "p", True, False)
    ]


def test_timers_and_state_survive_a_snapshot_through_the_codec() -> None:
    op = _op(_timers_from_values, _fired)
    op.process([(("t", 1), ["reg", 20], 0), ("b", ["preg", 5], 0), ("b", ["reg", 10], 0)])
    op.state["b"] = {"nested": [1, 2]}
    op.on_watermark(3)
    taken = op.snapshot()
    op.state["b"]["nested"].append(3)  # changed in place after the snapshot: not in it
    restored = _op(_timers_from_values, _fired)
    restored.restore(codec.loads(codec.dumps(taken)))
    assert restored.watermark == 3 and restored.state == {"b": {"nested": [1, 2]}}
    assert restored.on_watermark(MAX_WATERMARK) == [
        ("b", [EVENT_TIME, 10, 10, MAX_WATERMARK], 10),
        (("t", 1), [EVENT_TIME, 20, 20, MAX_WATERMARK], 20),
    ]
    assert restored.on_processing_time(5) == [("b", [PROCESSING_TIME, 5, 5, MAX_WATERMARK], 5)]


# -- properties --------------------------------------------------------------------------------

GAP = 10


def _sessions(ctx: ProcessContext, _value: Any) -> None:
    """A hand-rolled session end: per key ``[first, last, n]``, a timer at ``last + GAP``,
    moved at every record. A record GAP or more after the last ends the run itself when the
    watermark lagged (the timer had not fired yet)."""
    t, run = ctx.timestamp_ms, ctx.state.get()
    if run is not None and t - run[1] >= GAP:
        ctx.timers.delete_event_time(run[1] + GAP)
        ctx.emit({"start_ms": run[0], "end_ms": run[1] + GAP, "value": run[2]})
        run = None
    if run is None:
        run = [t, t, 0]
    ctx.timers.delete_event_time(run[1] + GAP)
    run = [run[0], max(run[1], t), run[2] + 1]
    ctx.timers.register_event_time(run[1] + GAP)
    ctx.state.set(run)


def _session_end(ctx: ProcessContext, ts: int, kind: str) -> None:
    run = ctx.state.get()
    ctx.emit({"start_ms": run[0], "end_ms": run[1] + GAP, "value": run[2]})
    ctx.state.delete()


def _reference_sessions(records: list[tuple[str, int]]) -> list[tuple[str, int, int, int]]:
    out = []
    for key in sorted({k for k, _t in records}):
        ts = sorted(t for k, t in records if k == key)
        first = last = ts[0]
        n = 0
        for t in ts:
            if t - last >= GAP:
                out.append((key, first, last + GAP, n))
                first, n = t, 0
            last, n = t, n + 1
        out.append((key, first, last + GAP, n))
    return sorted(out)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 30)), min_size=1, max_size=60),
    st.integers(1, 7),
    st.integers(0, 8),
    st.integers(0, 3 * GAP),
)
def test_a_timer_moved_at_every_record_ends_the_same_sessions_as_the_records_give(
    gaps: list[tuple[str, int]], batch: int, cut: int, lag: int
) -> None:
    """Records in time order (as one partition delivers a key's), a watermark ``lag`` behind
    the newest, any batching, a snapshot and restore at any batch: the sessions ended by the
    timers (or by a record when the watermark lagged) are the reference's."""
    records, t = [], 0
    for key, gap in gaps:
        t += gap
        records.append((key, t))
    op = _op(_sessions, _session_end)
    out: list[Record] = []
    for i in range(0, len(records), batch):
        if i // batch == cut:
            fresh = _op(_sessions, _session_end)
            fresh.restore(codec.loads(codec.dumps(op.snapshot())))
            op = fresh
        chunk = records[i : i + batch]
        out += op.process([(k, None, t) for k, t in chunk])
        out += op.on_watermark(chunk[-1][1] - lag)
    out += op.on_watermark(MAX_WATERMARK)
    got = sorted((k, v["start_ms"], v["end_ms"], v["value"]) for k, v, _t in out)
    assert got == _reference_sessions(records)


_ACTIONS = st.tuples(st.sampled_from(["reg", "del", "preg", "pdel"]), st.integers(0, 40))
_EVENTS = st.lists(
    st.one_of(
        st.tuples(st.just("record"), st.sampled_from("ab"), _ACTIONS, st.integers(0, 40)),
        st.tuples(st.just("watermark"), st.integers(0, 45)),
        st.tuples(st.just("clock"), st.integers(0, 45)),
    ),
    max_size=50,
)


def _counting(ctx: ProcessContext, value: Any) -> None:
    _timers_from_values(ctx, value)
    ctx.state.set(ctx.state.get(0) + 1)
    ctx.emit(["record", ctx.state.get()])


def _counted(ctx: ProcessContext, ts: int, kind: str) -> None:
    ctx.emit([kind, ts, ctx.state.get(0)])
    if ts % 3 == 0:  # some timers re-arm one later
        ctx.timers.register_event_time(ts + 7)
        ctx.timers.register_processing_time(ts + 5)


def _replay(events: list[Any], batch: int, cut: int | None) -> list[Record]:
    """``events`` through a process operator with records in batches of ``batch``, and a
    snapshot and restore before event ``cut`` (``None``: none)."""
    op = _op(_counting, _counted)
    out: list[Record] = []
    pending: list[Record] = []
    for i, event in enumerate([*events, ("watermark", MAX_WATERMARK)]):
        if event[0] != "record" or len(pending) >= batch or i == cut:
            out += op.process(pending)
            pending = []
        if i == cut:
            fresh = _op(_counting, _counted)
            fresh.restore(codec.loads(codec.dumps(op.snapshot())))
            op = fresh
        if event[0] == "record":
            _kind, key, action, t = event
            pending.append((key, list(action), t))
        elif event[0] == "watermark":
            out += op.on_watermark(event[1])
        else:
            out += op.on_processing_time(event[1])
    return out


@settings(max_examples=300, deadline=None)
@given(_EVENTS, st.integers(1, 6), st.integers(0, 50))
def test_a_snapshot_and_restore_anywhere_gives_the_output_of_a_run_without_one(
    events: list[Any], batch: int, cut: int
) -> None:
    """Registers, deletes, both kinds of timers, timers that re-arm: the same output, record
    for record and in order, whatever the batching and wherever the snapshot is taken."""
    assert _replay(events, batch, cut) == _replay(events, 1, None)
