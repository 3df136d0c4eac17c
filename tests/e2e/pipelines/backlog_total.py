"""Crash-test pipeline: the running total with its work *after* the shuffle.

The source stage is fast and the aggregating stage slow (``WORK_US`` per click in ``add``), so
the channel topics between them hold a backlog: after a restart, a dead generation's records
stay in the channels for a while, and unaligned snapshots are taken while channels are still
recovering (dropping them, or replaying in-flight records). The output equals the running-total
example's. ``CLICKS_START=latest`` starts the source at the end of its topic when the job first
starts.
"""

from __future__ import annotations

import os

from spin import work

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
        start=os.environ.get("CLICKS_START", "earliest"),
    )
    .key_by("by-user", lambda click: click["user"])
    .aggregate(
        "totals",
        init=lambda: (0, 0),
        add=lambda acc, click: (acc[0] + 1, acc[1] + work(click)["amount"]),
    )
    .sink("out", FileSink(os.environ["OUTPUT_DIR"]))
)
