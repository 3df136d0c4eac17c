"""Crash-test pipeline for local recovery: two shuffles, with window results crossing the second.

Clicks are counted per page and 10 s window (first shuffle: records derived from source
offsets), and those counts are summed per window (second shuffle: window emissions, whose IDs
come from (step, key, window)). Both levels are written to file sinks, so a copy or a loss on
either channel changes the committed output. ``WORK_US``: work per click (``spin.py``).
"""

from __future__ import annotations

import os
from datetime import timedelta

from spin import work

from connectors.serde import JsonSerde
from processor.dataflow import Dataflow, Tumbling
from sinks import FileSink

WINDOW = Tumbling(timedelta(seconds=10))

flow = Dataflow(os.environ["JOB_NAME"])
pages = (
    flow.source(
        "clicks",
        os.environ["CLICKS_TOPIC"],
        serde=JsonSerde(),
        timestamp=lambda c: c["ts_ms"],
        max_out_of_orderness=timedelta(seconds=1),
    )
    .map("work", work)
    .key_by("by-page", lambda c: c["page"])
    .count("per-page", window=WINDOW)
)
pages.sink("pages-out", FileSink(os.path.join(os.environ["OUTPUT_DIR"], "pages")))
(
    pages.key_by("by-window", lambda r: r["start_ms"])
    .aggregate("per-window", init=lambda: 0, add=lambda n, r: n + r["value"], window=WINDOW)
    .sink("totals-out", FileSink(os.path.join(os.environ["OUTPUT_DIR"], "totals")))
)
