"""Crash-test pipeline: clicks counted per page and 10 s window; records that arrive after
their window closed go to dead letters (``late="dead_letters"``), not to a counter.

``OUTPUT_DIR``: the window counts; ``DEAD_LETTER_DIR``: the dead letters (late records, with
their key, value and event time).
"""

from __future__ import annotations

import os
from datetime import timedelta

from spin import worked_clicks

from processor.dataflow import Dataflow, Tumbling
from sinks import FileSink

flow = Dataflow(os.environ["JOB_NAME"], dead_letters=FileSink(os.environ["DEAD_LETTER_DIR"]))
(
    worked_clicks(flow)
    .key_by("by-page", lambda c: c["page"])
    .count(
        "per-window",
        window=Tumbling(timedelta(seconds=10)),
        allowed_lateness=timedelta(seconds=2),
        late="dead_letters",
    )
    .sink("out", FileSink(os.environ["OUTPUT_DIR"]))
)
