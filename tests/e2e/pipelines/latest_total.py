"""The running total of ``examples/running_total.py`` over a source that starts at the end of its
topic (``start="latest"``): what was in the topic before the job first started is not input."""

from __future__ import annotations

import os

from connectors import JsonSerde
from processor import Dataflow
from sinks import FileSink

flow = Dataflow(os.environ["JOB_NAME"])
(
    flow.source(
        "clicks",
        os.environ["CLICKS_TOPIC"],
        serde=JsonSerde(),
        timestamp=lambda click: click["ts_ms"],
        start="latest",
    )
    .key_by("by-user", lambda click: click["user"])
    .aggregate(
        "totals",
        init=lambda: (0, 0),
        add=lambda acc, click: (acc[0] + 1, acc[1] + click["amount"]),
    )
    .sink("out", FileSink(os.environ["OUTPUT_DIR"]))
)
