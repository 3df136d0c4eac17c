"""Crash-test pipeline: the running-total example with a little work per click.

The work (``WORK_US`` microseconds of work per record, default 100) stretches a 200,000-record
run over several seconds, so SIGKILLs land while records are in flight.
"""

from __future__ import annotations

import os

from spin import work

from connectors.serde import JsonSerde
from processor.dataflow import Dataflow
from sinks import FileSink

flow = Dataflow(os.environ["JOB_NAME"])
(
    flow.source(
        "clicks", os.environ["CLICKS_TOPIC"], serde=JsonSerde(), timestamp=lambda c: c["ts_ms"]
    )
    .map("work", work)
    .key_by("by-user", lambda c: c["user"])
    .aggregate("totals", init=lambda: (0, 0), add=lambda a, c: (a[0] + 1, a[1] + c["amount"]))
    .sink("out", FileSink(os.environ["OUTPUT_DIR"]))
)
