"""A running total whose values cross a second shuffle: per-user running totals, re-keyed by
their last digit and counted. Under ``--recovery local`` it is refused at start-up (its
re-emitted totals would depend on the interleaving of the replay; docs/local-recovery.md,
"Limits"); global recovery runs it."""

from __future__ import annotations

import os

from connectors import JsonSerde
from processor import Dataflow
from sinks import FileSink

flow = Dataflow(os.environ.get("JOB_NAME", "two-shuffle-total"))
(
    flow.source("clicks", os.environ.get("CLICKS_TOPIC", "clicks"), serde=JsonSerde())
    .key_by("by-user", lambda click: click["user"])
    .aggregate("totals", init=lambda: 0, add=lambda total, click: total + click["amount"])
    .key_by("by-digit", lambda total: total % 10)
    .count("per-digit")
    .sink("out", FileSink(os.environ.get("OUTPUT_DIR", "out/two-shuffle-total")))
)
