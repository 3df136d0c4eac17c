"""Crash-test pipeline in two versions (``PIPELINE_VERSION``), for restoring a savepoint after a
code change that keeps the stateful step's name: version 2 adds a filter before the shuffle and
a step that tags each running total ``"v2"``; ``totals`` keeps its name and its state."""

from __future__ import annotations

import os

from spin import work

from connectors.serde import JsonSerde
from processor.dataflow import Dataflow
from sinks import FileSink

V2 = os.environ.get("PIPELINE_VERSION") == "2"

flow = Dataflow(os.environ["JOB_NAME"])
clicks = flow.source(
    "clicks", os.environ["CLICKS_TOPIC"], serde=JsonSerde(), timestamp=lambda c: c["ts_ms"]
).map("work", work)
if V2:
    clicks = clicks.filter("paid", lambda c: c["amount"] > 0)
totals = clicks.key_by("by-user", lambda c: c["user"]).aggregate(
    "totals", init=lambda: (0, 0), add=lambda a, c: (a[0] + 1, a[1] + c["amount"])
)
if V2:
    totals = totals.map("tag", lambda t: [*t, "v2"])
totals.sink("out", FileSink(os.environ["OUTPUT_DIR"]))
