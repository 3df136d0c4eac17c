"""Certify-test pipeline: the running total per user, whose ``map`` also appends every click to
a file (``SIDE_FILE``) outside the sinks' two-phase commit: a replay after a crash appends the
replayed clicks again. The sink's output stays exactly once; the file does not."""

from __future__ import annotations

import os

import orjson

from connectors import JsonSerde
from processor import Dataflow
from sinks import FileSink

SIDE_FILE = os.environ["SIDE_FILE"]


def audit(click: dict) -> dict:
    with open(SIDE_FILE, "ab") as f:  # not transactional: repeated on every replay
        f.write(orjson.dumps(click["event_id"]) + b"\n")
    return click


flow = Dataflow(os.environ.get("JOB_NAME", "side-effect-total"))
(
    flow.source("clicks", os.environ.get("CLICKS_TOPIC", "clicks"), serde=JsonSerde())
    .map("audit", audit)
    .key_by("by-user", lambda c: c["user"])
    .aggregate("totals", init=lambda: (0, 0), add=lambda a, c: (a[0] + 1, a[1] + c["amount"]))
    .sink("out", FileSink(os.environ.get("OUTPUT_DIR", "out/side-effect-total")))
)
