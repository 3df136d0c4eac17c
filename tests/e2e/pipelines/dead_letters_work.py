"""Crash-test pipeline: the running total of ``running_total_work.py`` with a dead-letter
destination, fed clicks with malformed records mixed in.

Every kind of bad record fails in another place: undecodable bytes and a missing ``ts_ms`` at the
source, ``poison`` in the ``check`` map, a missing ``user`` in ``key_by`` (both fused with the
source), a missing ``amount`` in the aggregation after the shuffle. Dead letters go to the file
sink in ``DEAD_LETTER_DIR``; the totals to ``OUTPUT_DIR``.
"""

from __future__ import annotations

import os
from typing import Any

from spin import work

from connectors.serde import JsonSerde
from processor.dataflow import Dataflow
from sinks import FileSink


def check(click: Any) -> Any:
    if click.get("poison"):
        raise ValueError(f"poisoned click {click['bad_id']}")
    return work(click)


flow = Dataflow(os.environ["JOB_NAME"], dead_letters=FileSink(os.environ["DEAD_LETTER_DIR"]))
(
    flow.source(
        "clicks", os.environ["CLICKS_TOPIC"], serde=JsonSerde(), timestamp=lambda c: c["ts_ms"]
    )
    .map("check", check)
    .key_by("by-user", lambda c: c["user"])
    .aggregate("totals", init=lambda: (0, 0), add=lambda a, c: (a[0] + 1, a[1] + c["amount"]))
    .sink("out", FileSink(os.environ["OUTPUT_DIR"]))
)
