"""Certify-test pipeline: clicks deduplicated by ``event_id`` per user (IDs in Redis), the
running total per user, into a Kafka topic (``OUTPUT_TOPIC``), transactional or, with
``SINK_MODE=staged``, staged."""

from __future__ import annotations

import os
from datetime import timedelta

from connectors import JsonSerde
from processor import Dataflow
from sinks import KafkaSink

flow = Dataflow(os.environ.get("JOB_NAME", "dedup-kafka-total"))
(
    flow.source(
        "clicks",
        os.environ.get("CLICKS_TOPIC", "clicks"),
        serde=JsonSerde(),
        timestamp=lambda c: c["ts_ms"],
    )
    .key_by("by-user", lambda c: c["user"])
    .dedup("unique", id=lambda c: c["event_id"], within=timedelta(minutes=5))
    .aggregate("totals", init=lambda: (0, 0), add=lambda a, c: (a[0] + 1, a[1] + c["amount"]))
    .sink(
        "out",
        KafkaSink(
            os.environ.get("OUTPUT_TOPIC", "dedup-kafka-totals"),
            mode=os.environ.get("SINK_MODE", "transactional"),
            transactional_id_prefix=os.environ.get("TXN_PREFIX", "dedup-kafka-total"),
        ),
    )
)
