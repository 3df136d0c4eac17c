"""Crash-test pipeline: per user, the clicks' ``event_id``\\ s buffered in the key's state and
flushed by a processing-time timer 100 ms (wall clock) after the first of a batch (issue 23,
item 4), into files (``OUTPUT_DIR``) as ``{"by", "events"}``.

When a batch is flushed depends on the clock, so the batches differ from run to run; every
click is in exactly one committed batch. An event-time timer far in the future, registered
once per key (registering it again keeps one), flushes what is left when the input drains (the
maximum watermark fires it before the final checkpoint).
"""

from __future__ import annotations

import os
from typing import Any

from spin import worked_clicks

from processor.dataflow import Dataflow
from sinks import FileSink

FLUSH_AFTER_MS = 100
DRAIN_MS = 2**62


def on_click(ctx: Any, click: Any) -> None:
    batch = ctx.state.get()
    if batch is None:
        ctx.timers.register_processing_time(ctx.processing_time_ms + FLUSH_AFTER_MS)
        ctx.timers.register_event_time(DRAIN_MS)
        batch = []
    ctx.state.set([*batch, click["event_id"]])


def on_flush(ctx: Any, _timer_ms: int, kind: str) -> None:
    batch = ctx.state.get()
    if batch:
        ctx.emit({"by": kind, "events": batch})
    ctx.state.delete()


flow = Dataflow(os.environ["JOB_NAME"])
(
    worked_clicks(flow)
    .key_by("by-user", lambda c: c["user"])
    .process("flush", on_click, on_timer=on_flush)
    .sink("out", FileSink(os.environ["OUTPUT_DIR"]))
)
