"""Benchmark job: every click enriched with its user's row as of the click's time.

    users (Kafka, JSON rows) -> table --[shuffle]--\\
    clicks (Kafka, JSON) -> key by user --[shuffle]--> temporal join (left) -> part files

Against ``keyed_count.py`` (the same shuffle of the clicks, a running aggregate, one output per
click) it measures what the event-time temporal join costs: the table's rows crossing a second
shuffle, every click waiting in the join's state until the watermark passes it, the versions
lookup, and the pruning. One output per click, as keyed_count. The table is
``examples/users.py``'s (about 1.8 rows per user) in ``<CLICKS_TOPIC>-users``. Configured by
``JOB_NAME``, ``CLICKS_TOPIC`` and ``OUTPUT_DIR`` (see ``keyed_count.py``).
"""

from __future__ import annotations

import os
from datetime import timedelta

from connectors.serde import JsonSerde
from processor.dataflow import Dataflow
from sinks import FileSink

clicks_topic = os.environ.get("CLICKS_TOPIC", "clicks")
flow = Dataflow(os.environ.get("JOB_NAME", "bench-join-enrich"))
users = flow.table(
    "users", clicks_topic + "-users", serde=JsonSerde(), timestamp=lambda user: user["ts_ms"]
)
(
    flow.source(
        "clicks",
        clicks_topic,
        serde=JsonSerde(),
        timestamp=lambda click: click["ts_ms"],
        max_out_of_orderness=timedelta(seconds=1),
    )
    .key_by("by-user", lambda click: click["user"])
    .join(
        "with-user",
        users,
        lambda click, user: [click["amount"], None if user is None else user["plan"]],
        how="left",
    )
    .sink("out", FileSink(os.environ.get("OUTPUT_DIR", "out/bench-join-enrich")))
)
