"""Crash-test pipeline: the running total of ``running_total_work.py`` over a keyed source.

The clicks are produced keyed by user (``examples/clicks.py``), so ``keyed=True`` keys the stream
by exactly what ``key_by(lambda c: c["user"])`` would, and the output lines are the same. With no
``key_by`` the aggregation is fused into the source's stage: one stage, no channel topic, and each
user's total lives in the subtask that reads the user's partition.

``DEAD_LETTER_DIR`` (optional): a dead-letter destination (a file sink) for the records that cannot
be keyed (no message key); without it they are counted and skipped. ``KEY_BY=1``: the same job
as ``running_total_work.py`` builds it (an unkeyed source, ``key_by``, a shuffle), to restart a
job with the other layout. ``PAGES_DIR``: a second branch, clicks per page (a shuffle), to
restart a job with a stage added.
"""

from __future__ import annotations

import os

from spin import work

from connectors.serde import JsonSerde
from processor.dataflow import Dataflow
from sinks import FileSink

dead_dir = os.environ.get("DEAD_LETTER_DIR")
key_by = os.environ.get("KEY_BY") == "1"
flow = Dataflow(os.environ["JOB_NAME"], dead_letters=FileSink(dead_dir) if dead_dir else None)
clicks = flow.source(
    "clicks",
    os.environ["CLICKS_TOPIC"],
    serde=JsonSerde(),
    timestamp=lambda c: c["ts_ms"],
    keyed=not key_by,
).map("work", work)
(
    (clicks.key_by("by-user", lambda c: c["user"]) if key_by else clicks)
    .aggregate("totals", init=lambda: (0, 0), add=lambda a, c: (a[0] + 1, a[1] + c["amount"]))
    .sink("out", FileSink(os.environ["OUTPUT_DIR"]))
)
if os.environ.get("PAGES_DIR"):
    (
        clicks.key_by("by-page", lambda c: c["page"])
        .count("per-page")
        .sink("pages", FileSink(os.environ["PAGES_DIR"]))
    )
