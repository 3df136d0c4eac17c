"""Benchmark job: ``keyed_count.py`` writing to a Kafka topic (the reference job of ``peers.py``).

    clicks (Kafka, JSON) -> filter amount > 0 -> key by user
        -> running (count, amount) per user   [shuffle through Kafka]
        -> transactional KafkaSink: key user, value JSON [count, amount]

Environment: ``JOB_NAME``, ``CLICKS_TOPIC`` (input), ``OUTPUT_TOPIC`` (must exist, 8
partitions), ``TXN_PREFIX`` (the sink's transactional ids, unique per run).
"""

from __future__ import annotations

import os

from connectors.serde import JsonSerde
from processor.dataflow import Dataflow
from sinks.kafka import KafkaSink

flow = Dataflow(os.environ.get("JOB_NAME", "bench-keyed-count-kafka"))
(
    flow.source(
        "clicks",
        os.environ.get("CLICKS_TOPIC", "clicks"),
        serde=JsonSerde(),
        timestamp=lambda click: click["ts_ms"],
    )
    .filter("valid", lambda click: click["amount"] > 0)
    .key_by("by-user", lambda click: click["user"])
    .aggregate(
        "per-user",
        init=lambda: (0, 0),
        add=lambda acc, click: (acc[0] + 1, acc[1] + click["amount"]),
    )
    .sink(
        "out",
        KafkaSink(
            os.environ.get("OUTPUT_TOPIC", "bench-keyed-count-out"),
            transactional_id_prefix=os.environ.get("TXN_PREFIX", "bench-keyed-count"),
        ),
    )
)
