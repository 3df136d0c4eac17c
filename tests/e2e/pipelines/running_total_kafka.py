"""Crash-test pipeline: the running total with work per click, into a Kafka topic.

Environment: ``OUTPUT_TOPIC`` (must exist), ``SINK_MODE`` (``transactional`` | ``staged``),
``TXN_PREFIX`` (transactional ids), ``WORK_US`` (spin per record, default 100).
"""

from __future__ import annotations

import os

from spin import work  # the same work per click

from connectors.serde import JsonSerde
from processor.dataflow import Dataflow
from sinks.kafka import KafkaSink

flow = Dataflow(os.environ["JOB_NAME"])
(
    flow.source(
        "clicks", os.environ["CLICKS_TOPIC"], serde=JsonSerde(), timestamp=lambda c: c["ts_ms"]
    )
    .map("work", work)
    .key_by("by-user", lambda c: c["user"])
    .aggregate("totals", init=lambda: (0, 0), add=lambda a, c: (a[0] + 1, a[1] + c["amount"]))
    .sink(
        "out",
        KafkaSink(
            os.environ["OUTPUT_TOPIC"],
            mode=os.environ.get("SINK_MODE", "transactional"),
            transactional_id_prefix=os.environ.get("TXN_PREFIX"),
            commit_timeout_s=5,
            # RECORD_IDS=1 / 0; unset: the sink's default (IDs only in staged mode)
            record_ids={"1": True, "0": False}.get(os.environ.get("RECORD_IDS", "")),
        ),
    )
)
