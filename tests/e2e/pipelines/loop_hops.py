"""Crash-test pipeline for loops: every click goes around a loop ``amount % 6`` times.

Each pass goes through a shuffle and a keyed aggregation that counts the click's passes in its
state (``n``), so a back-edge record processed twice, or lost, changes the committed output: a
click leaves the loop once, with ``n = hops + 1``, exactly when every pass counted once. Clicks
with 5 hops exceed ``max_iterations=4`` and go to the dead-letter destination instead.
"""

from __future__ import annotations

import os
from typing import Any

from connectors.serde import JsonSerde
from processor.dataflow import Dataflow, Stream
from sinks import FileSink

MAX_ITERATIONS = 4


def count_pass(acc: dict[str, Any] | None, r: dict[str, Any]) -> dict[str, Any]:
    return {"id": r["id"], "page": r["page"], "hops": r["hops"], "n": (acc["n"] if acc else 0) + 1}


def body(loop: Stream) -> tuple[Stream, Stream]:
    passes = loop.key_by("by-click", lambda r: r["id"]).aggregate(
        "passes", init=lambda: None, add=count_pass
    )
    return (
        passes.filter("again", lambda s: s["n"] <= s["hops"]),
        passes.filter("done", lambda s: s["n"] > s["hops"]),
    )


flow = Dataflow(os.environ["JOB_NAME"], dead_letters=FileSink(os.environ["DEAD_LETTER_DIR"]))
(
    flow.source(
        "clicks",
        os.environ["CLICKS_TOPIC"],
        serde=JsonSerde(),
        timestamp=lambda c: c["ts_ms"],
    )
    .map("to-record", lambda c: {"id": c["event_id"], "page": c["page"], "hops": c["amount"] % 6})
    .iterate("loop", body, max_iterations=MAX_ITERATIONS)
    .sink("out", FileSink(os.environ["OUTPUT_DIR"]))
)
