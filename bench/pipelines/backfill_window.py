"""Benchmark job: the backfill of issue 37, clicks per user in tumbling 10 s event-time windows.

    clicks (Kafka, JSON, 8 partitions) -> key_by user (a shuffle) -> count per user and
    10 s window (the clicks' ``ts_ms``, 1 s out of order) -> FileSink (JSON lines)

``bench/backfill.py`` runs it over a backlog with and without ``--watermark-alignment``. A
window's state lives until the watermark passes its end, so the state the job holds is about
(users x the windows between the watermark and the newest event time read): what the
alignment bounds. Configured by ``JOB_NAME``, ``CLICKS_TOPIC`` and ``OUTPUT_DIR``.
"""

from __future__ import annotations

import os
from datetime import timedelta

from connectors.serde import JsonSerde
from processor.dataflow import Dataflow, Tumbling
from sinks import FileSink

flow = Dataflow(os.environ.get("JOB_NAME", "bench-backfill"))
(
    flow.source(
        "clicks",
        os.environ.get("CLICKS_TOPIC", "clicks"),
        serde=JsonSerde(),
        timestamp=lambda click: click["ts_ms"],
        max_out_of_orderness=timedelta(seconds=1),
    )
    .key_by("by-user", lambda click: click["user"])
    .count("per-window", window=Tumbling(timedelta(seconds=10)))
    .sink("out", FileSink(os.environ["OUTPUT_DIR"]))
)
