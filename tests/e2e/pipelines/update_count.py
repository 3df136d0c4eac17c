"""Crash-test pipeline: clicks per user and 30 s tumbling window, emitted on every update
(``emit="update"``, issue 23, item 5b), into files (``OUTPUT_DIR``)."""

from __future__ import annotations

import os
from datetime import timedelta

from spin import worked_clicks

from processor.dataflow import Dataflow, Tumbling
from sinks import FileSink

flow = Dataflow(os.environ["JOB_NAME"])
(
    worked_clicks(flow)
    .key_by("by-user", lambda c: c["user"])
    .count("per-window", window=Tumbling(timedelta(seconds=30)), emit="update")
    .sink("out", FileSink(os.environ["OUTPUT_DIR"]))
)
