"""Keyed process functions in a task (issue 23, item 4): the task fires processing-time timers
on its clock and event-time timers on its watermark, and a failing timer is a dead letter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from processor.compiler import compile_flow
from processor.dataflow import Dataflow
from processor.runtime.operators.process import ProcessContext
from processor.runtime.task import Task
from processor.wire import GenerationStart, Watermark
from tests.unit.test_task import ListSink, Log, _env


def _timer_task(tmp_path: Path, log: Log, clock: list[int]) -> tuple[Task, str]:
    def fn(ctx: ProcessContext, value: Any) -> None:
        ctx.timers.register_processing_time(ctx.processing_time_ms + 100)
        ctx.timers.register_event_time(ctx.timestamp_ms + 5)

    def on_timer(ctx: ProcessContext, ts: int, kind: str) -> None:
        ctx.emit([kind, ts])

    flow = Dataflow("job")
    (
        flow.source("s", "in")
        .key_by("k", lambda v: v)
        .process("proc", fn, on_timer=on_timer)
        .sink("out", ListSink())
    )
    plan = compile_flow(flow, 2)
    env = _env(tmp_path, log, plan, now_ms=lambda: clock[0])
    return Task(env, plan.stage_of("proc"), 0), plan.edges[0].topic


def test_the_task_fires_processing_time_timers_on_its_clock_and_event_time_ones_on_the_watermark(
    tmp_path: Path,
) -> None:
    log, clock = Log(), [1_000]
    task, topic = _timer_task(tmp_path, log, clock)
    sink = task.chain.sinks[0].writer
    p0, p2 = (topic, 0), (topic, 2)
    for tp in (p0, p2):
        log.ctl(tp, GenerationStart(1))
    log.data(p0, "a", ts=50)
    task.open(None, {"in": 2})
    task.step(0.0, 100)
    assert getattr(sink, "epoch", []) == []
    clock[0] = 1_099
    task.step(0.0, 100)
    assert getattr(sink, "epoch", []) == []
    clock[0] = 1_100
    task.step(0.0, 100)
    assert sink.epoch == [("a", ["processing_time", 1_100])]
    log.ctl(p0, Watermark(60))
    log.ctl(p2, Watermark(54))  # the task's watermark is the minimum: 54 < 55
    task.step(0.0, 100)
    assert len(sink.epoch) == 1
    log.ctl(p2, Watermark(55))
    task.step(0.0, 100)
    assert sink.epoch[1:] == [("a", ["event_time", 55])]
    assert task.stats()["steps"]["proc"] == [1, 2]


def test_a_timer_whose_on_timer_raises_is_a_dead_letter_without_an_input_origin(
    tmp_path: Path,
) -> None:
    """What fires from the watermark has no input record: the dead letter names the timer,
    not the last record the task happened to push."""

    def fn(ctx: ProcessContext, value: Any) -> None:
        ctx.timers.register_event_time(ctx.timestamp_ms + 5)

    def on_timer(ctx: ProcessContext, ts: int, kind: str) -> None:
        raise ValueError(f"cannot handle {ts}")

    dead = ListSink()
    flow = Dataflow("job", dead_letters=dead)
    keyed = flow.source("s", "in").key_by("k", lambda v: v)
    keyed.process("proc", fn, on_timer=on_timer).sink("out", ListSink())
    plan = compile_flow(flow, 2)
    log = Log()
    task = Task(_env(tmp_path, log, plan), plan.stage_of("proc"), 0)
    p0, p2 = (plan.edges[0].topic, 0), (plan.edges[0].topic, 2)
    for tp in (p0, p2):
        log.ctl(tp, GenerationStart(1))
    log.data(p0, "a", ts=50)
    for tp in (p0, p2):
        log.ctl(tp, Watermark(60))
    task.open(None, {"in": 2})
    task.step(0.0, 100)
    (letter,) = dead.epoch
    assert letter["step"] == "proc" and letter["error_type"] == "ValueError"
    assert letter["key"] == "a" and letter["value"] == {"timer_ms": 55, "kind": "event_time"}
    assert letter["topic"] is None and letter["offset"] is None
