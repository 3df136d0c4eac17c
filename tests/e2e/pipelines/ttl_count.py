"""Crash-test pipeline: a running count of clicks per user whose state expires after 5 s of
event time without a click of that user (``ttl``), into files (``OUTPUT_DIR``)."""

from __future__ import annotations

import os
from datetime import timedelta

from spin import worked_clicks

from processor.dataflow import Dataflow
from sinks import FileSink

flow = Dataflow(os.environ["JOB_NAME"])
(
    worked_clicks(flow)
    .key_by("by-user", lambda c: c["user"])
    .count("recent", ttl=timedelta(seconds=5))
    .sink("out", FileSink(os.environ["OUTPUT_DIR"]))
)
