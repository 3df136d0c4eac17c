"""Crash-test pipeline: the windowed-count example with work per click.

See ``running_total_work.py`` for the work knob.
"""

from __future__ import annotations

import os
from datetime import timedelta

from spin import work

from connectors.serde import JsonSerde
from processor.dataflow import Dataflow, Tumbling
from sinks import FileSink

flow = Dataflow(os.environ["JOB_NAME"])
(
    flow.source(
        "clicks",
        os.environ["CLICKS_TOPIC"],
        serde=JsonSerde(),
        timestamp=lambda c: c["ts_ms"],
        max_out_of_orderness=timedelta(seconds=1),
    )
    .map("work", work)
    .key_by("by-page", lambda c: c["page"])
    .count("per-window", window=Tumbling(timedelta(seconds=10)))
    .sink("out", FileSink(os.environ["OUTPUT_DIR"]))
)
