"""Crash-test pipeline: clicks (some sent twice, as an at-least-once producer does) deduplicated
by ``event_id`` per user, then each user's running total (count, amount) per distinct click.

The dedup step runs after the shuffle, so the job has a channel topic and Redis IDs: what a
savepoint must bring back after ``eosflow reset`` (issue 35, item 3). ``SINK=kafka`` writes to
the transactional Kafka sink (``OUTPUT_TOPIC``, ``TXN_PREFIX``), else to files
(``OUTPUT_DIR``).
"""

from __future__ import annotations

import os
from datetime import timedelta

from connectors.serde import JsonSerde
from processor.dataflow import Dataflow
from sinks import FileSink
from sinks.kafka import KafkaSink

flow = Dataflow(os.environ["JOB_NAME"])
totals = (
    flow.source(
        "clicks", os.environ["CLICKS_TOPIC"], serde=JsonSerde(), timestamp=lambda c: c["ts_ms"]
    )
    .key_by("by-user", lambda c: c["user"])
    .dedup("unique", id=lambda c: c["event_id"], within=timedelta(minutes=10))
    .aggregate("totals", init=lambda: (0, 0), add=lambda a, c: (a[0] + 1, a[1] + c["amount"]))
)
if os.environ.get("SINK") == "kafka":
    sink: FileSink | KafkaSink = KafkaSink(
        os.environ["OUTPUT_TOPIC"],
        mode="transactional",
        transactional_id_prefix=os.environ["TXN_PREFIX"],
        commit_timeout_s=5,
    )
else:
    sink = FileSink(os.environ["OUTPUT_DIR"])
totals.sink("out", sink)
