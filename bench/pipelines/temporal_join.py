"""Benchmark job: every click enriched with its user's plan as of the click's time, exactly once.

    users (Kafka, JSON rows, keyed by user) -> table ----------------------\\
    clicks (Kafka, JSON, keyed by user) -> event-time temporal join (left) -> transactional
        KafkaSink: key user, value [event_id, amount, plan or null]

Both inputs are keyed sources of 8 partitions keyed by user, so the join runs in the sources'
task with no shuffle (unlike ``join_enrich.py``, which measures the join behind a shuffle). A
click waits in the join's state until the watermark reaches its time, then takes the user's row
valid then (``examples/users.py``: profiles, plan changes during the clicks, deletions). The
table is ``<CLICKS_TOPIC>-users``. Configured by ``JOB_NAME``, ``CLICKS_TOPIC``,
``OUTPUT_TOPIC`` and ``TXN_PREFIX`` (see ``keyed_count.py``).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from connectors.serde import JsonSerde
from processor.dataflow import Dataflow
from sinks import KafkaSink


def enrich(click: dict[str, Any], user: dict[str, Any] | None) -> list[Any]:
    return [click["event_id"], click["amount"], None if user is None else user["plan"]]


clicks_topic = os.environ.get("CLICKS_TOPIC", "clicks")
flow = Dataflow(os.environ.get("JOB_NAME", "bench-temporal-join"))
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
        keyed=True,
    )
    .join("with-user", users, enrich, how="left")
    .sink(
        "out",
        KafkaSink(
            os.environ["OUTPUT_TOPIC"],
            transactional_id_prefix=os.environ.get("TXN_PREFIX", "bench-temporal-join"),
        ),
    )
)
