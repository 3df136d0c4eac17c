"""Crash-test pipeline: the running total whose user function blocks, once, forever.

The first worker process that reaches click ``BLOCK_AT`` (its index in the input) creates
``BLOCK_FILE`` and then sleeps for a minute: alive and heartbeating, not progressing. The job
must notice (checkpoints time out more often in a row than tolerated), restart, and finish
exactly once; the file makes every later attempt pass.
"""

from __future__ import annotations

import os
import time
from typing import Any

from connectors import JsonSerde
from processor import Dataflow
from sinks import FileSink

BLOCK_AT = int(os.environ.get("BLOCK_AT", "1000"))
BLOCK_FILE = os.environ["BLOCK_FILE"]


def maybe_block(click: Any) -> Any:
    if click["event_id"].endswith(f"-{BLOCK_AT}") and not os.path.exists(BLOCK_FILE):
        with open(BLOCK_FILE, "w") as f:
            f.write(str(os.getpid()))
        # A user function stuck on a lost lock, a hung call...: for a minute, so that a runner
        # that never notices fails the test instead of hanging it.
        time.sleep(60)
    return click


flow = Dataflow(os.environ["JOB_NAME"])
(
    flow.source(
        "clicks",
        os.environ["CLICKS_TOPIC"],
        serde=JsonSerde(),
        timestamp=lambda click: click["ts_ms"],
    )
    .map("maybe-block", maybe_block)
    .key_by("by-user", lambda click: click["user"])
    .aggregate(
        "totals",
        init=lambda: (0, 0),
        add=lambda acc, click: (acc[0] + 1, acc[1] + click["amount"]),
    )
    .sink("out", FileSink(os.environ["OUTPUT_DIR"]))
)
