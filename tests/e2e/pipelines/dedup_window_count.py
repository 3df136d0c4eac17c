"""Crash-test pipeline: clicks with duplicates in the input, deduplicated by ``event_id``, then
the windowed count per page.

``DEDUP_SCOPE=global`` (default) dedups the unkeyed stream (records are shuffled by ID);
``DEDUP_SCOPE=user`` keys by user first and dedups per key. The answer is the windowed count of
the distinct clicks either way (a copy has its original's user). ``DEDUP_FP_RATE`` (default
0.001) set high, with filters small enough to fill (``DEDUP_EXPECTED_IDS``, ``DEDUP_BUCKET_S``),
sends many Bloom hits to the Redis store, whose answers must then agree with the restored
checkpoint.
"""

from __future__ import annotations

import os
from datetime import timedelta

from spin import work

from connectors.serde import JsonSerde
from processor.dataflow import Dataflow, Tumbling
from sinks import FileSink

flow = Dataflow(os.environ["JOB_NAME"])
clicks = flow.source(
    "clicks",
    os.environ["CLICKS_TOPIC"],
    serde=JsonSerde(),
    timestamp=lambda c: c["ts_ms"],
    max_out_of_orderness=timedelta(seconds=1),
).map("work", work)
options = {
    "within": timedelta(minutes=1),
    "bucket": timedelta(seconds=int(os.environ.get("DEDUP_BUCKET_S", "15"))),
    "fp_rate": float(os.environ.get("DEDUP_FP_RATE", "0.001")),
    "expected_ids": int(os.environ.get("DEDUP_EXPECTED_IDS", "100000")),
}
if os.environ.get("DEDUP_SCOPE", "global") == "global":
    unique = clicks.dedup("unique", id=lambda c: c["event_id"], **options)
else:
    unique = clicks.key_by("by-user", lambda c: c["user"]).dedup(
        "unique", id=lambda c: c["event_id"], **options
    )
(
    unique.key_by("by-page", lambda c: c["page"])
    # Copies arrive up to 20 s of event time after their original: the lateness keeps a copy
    # that leaked through the dedup step countable, so the test sees it.
    .count(
        "per-window", window=Tumbling(timedelta(seconds=10)), allowed_lateness=timedelta(seconds=30)
    )
    .sink("out", FileSink(os.environ["OUTPUT_DIR"]))
)
