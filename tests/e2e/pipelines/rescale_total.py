"""Crash-test pipeline for rescaling (issue 24): clicks with copies in the input, deduplicated
per user by ``event_id`` (IDs in Redis), the running count and sum per user, into a Kafka topic
(``OUTPUT_TOPIC``; ``SINK_MODE`` ``transactional`` or ``staged``).

``DEDUP_FP_RATE`` set high with small filters (``DEDUP_EXPECTED_IDS``) sends many Bloom hits to
the Redis store, so that its IDs (and, after a rescale, the inherited ones) decide them.
"""

from __future__ import annotations

import os
from datetime import timedelta

from spin import work

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
    .dedup(
        "unique",
        id=lambda c: c["event_id"],
        within=timedelta(minutes=5),
        fp_rate=float(os.environ.get("DEDUP_FP_RATE", "0.001")),
        expected_ids=int(os.environ.get("DEDUP_EXPECTED_IDS", "100000")),
    )
    .aggregate("totals", init=lambda: (0, 0), add=lambda a, c: (a[0] + 1, a[1] + c["amount"]))
    .sink(
        "out",
        KafkaSink(
            os.environ["OUTPUT_TOPIC"],
            mode=os.environ.get("SINK_MODE", "transactional"),
            transactional_id_prefix=os.environ.get("TXN_PREFIX"),
            commit_timeout_s=5,
        ),
    )
)
