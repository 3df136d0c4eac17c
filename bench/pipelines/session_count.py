"""Benchmark job: clicks per user session (5 s of event time without a click ends one).

    clicks (Kafka, JSON) -> key by user --[shuffle]--> count per user session -> part files

Against ``keyed_count.py`` (the same shuffle, a running aggregate that emits per click) it
measures what session windows cost: merging per record, the firing heap, and one output per
session instead of one per click. The clicks of ``examples/clicks.py`` are 10 ms apart over
1,000 users, so a user's clicks are about 10 s apart and 4 in 10 gaps merge. Configured by
``JOB_NAME``, ``CLICKS_TOPIC`` and ``OUTPUT_DIR`` (see ``keyed_count.py``).
"""

from __future__ import annotations

import os
from datetime import timedelta

from connectors.serde import JsonSerde
from processor.dataflow import Dataflow, Session
from sinks import FileSink

flow = Dataflow(os.environ.get("JOB_NAME", "bench-session-count"))
(
    flow.source(
        "clicks",
        os.environ.get("CLICKS_TOPIC", "clicks"),
        serde=JsonSerde(),
        timestamp=lambda click: click["ts_ms"],
        max_out_of_orderness=timedelta(seconds=1),
    )
    .key_by("by-user", lambda click: click["user"])
    .count("sessions", window=Session(timedelta(seconds=5)))
    .sink("out", FileSink(os.environ.get("OUTPUT_DIR", "out/bench-session-count")))
)
