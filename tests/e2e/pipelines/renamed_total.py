"""Lifecycle test pipeline: the running total, computed by a step whose name comes from the
environment (``TOTAL_STEP``, default ``totals``), so that a restart can rename it.

The stage after the shuffle starts with ``latest`` (a stateful pass-through: it keeps each
user's last click and emits the click), so renaming the totals step does not rename its stage
(which ``check_graph`` refuses anyway): this is the case whose state used to be dropped without
a word. Output lines are ``[user, [count, amount]]``, as ``examples/running_total.py`` writes.
"""

from __future__ import annotations

import os

from connectors import JsonSerde
from processor import Dataflow
from sinks import FileSink

flow = Dataflow(os.environ["JOB_NAME"])
(
    flow.source(
        "clicks", os.environ["CLICKS_TOPIC"], serde=JsonSerde(), timestamp=lambda c: c["ts_ms"]
    )
    .key_by("by-user", lambda click: click["user"])
    .aggregate("latest", init=lambda: None, add=lambda _last, click: click)
    .aggregate(
        os.environ.get("TOTAL_STEP", "totals"),
        init=lambda: (0, 0),
        add=lambda acc, click: (acc[0] + 1, acc[1] + click["amount"]),
    )
    .sink("out", FileSink(os.environ["OUTPUT_DIR"]))
)
