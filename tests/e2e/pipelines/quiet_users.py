"""Crash-test pipeline: "user went quiet" records from a keyed process function (issue 23, item
4), into files (``OUTPUT_DIR``).

Per user, the state is the current run of clicks ``[first_ms, last_ms, clicks]`` and one
event-time timer at ``last_ms + 5 s``, deleted and registered again at every click (a
hand-rolled session end). When it fires, the user went quiet: the run is emitted as
``{"start_ms", "end_ms", "value"}`` (``end_ms`` = last click + 5 s) and the state deleted. A
click 5 s or more after the run's last one while the watermark still lags behind the timer
ends the run itself. The output is the session windows' (``session_count.py``).
"""

from __future__ import annotations

import os
from typing import Any

from spin import worked_clicks

from processor.dataflow import Dataflow
from sinks import FileSink

QUIET_MS = 5_000


def on_click(ctx: Any, _click: Any) -> None:
    t, run = ctx.timestamp_ms, ctx.state.get()
    if run is not None and t - run[1] >= QUIET_MS:  # quiet already; the watermark lags
        ctx.timers.delete_event_time(run[1] + QUIET_MS)
        ctx.emit({"start_ms": run[0], "end_ms": run[1] + QUIET_MS, "value": run[2]})
        run = None
    if run is None:
        run = [t, t, 0]
    else:
        ctx.timers.delete_event_time(run[1] + QUIET_MS)
    run = [run[0], max(run[1], t), run[2] + 1]
    ctx.timers.register_event_time(run[1] + QUIET_MS)
    ctx.state.set(run)


def on_quiet(ctx: Any, _timer_ms: int, _kind: str) -> None:
    first, last, clicks = ctx.state.get()
    ctx.emit({"start_ms": first, "end_ms": last + QUIET_MS, "value": clicks})
    ctx.state.delete()


flow = Dataflow(os.environ["JOB_NAME"])
(
    worked_clicks(flow)
    .key_by("by-user", lambda c: c["user"])
    .process("quiet", on_click, on_timer=on_quiet)
    .sink("out", FileSink(os.environ["OUTPUT_DIR"]))
)
