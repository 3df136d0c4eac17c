"""Crash-test pipeline: the running total (``running_total_work.py``) sunk into Avro files.

Every click yields one record ``{"user", "count", "amount"}``: the user's totals after that click
(``examples/clicks.py``, ``expected_running_totals``, as ``[user, [count, amount]]``). Settings
come from the environment: ``AVRO_CODEC`` (default ``deflate``), ``MAX_PART_BYTES`` (default:
one part file per epoch) and ``WORK_US`` (work per click, default 100).
"""

from __future__ import annotations

import os
from typing import Any

from spin import work  # the same work per click

from connectors.serde import JsonSerde
from processor.dataflow import Dataflow
from sinks.files import FileSink

MAX_PART_BYTES = int(os.environ["MAX_PART_BYTES"]) if os.environ.get("MAX_PART_BYTES") else None

SCHEMA = {
    "type": "record",
    "name": "RunningTotal",
    "namespace": "eosflow.tests",
    "fields": [
        {"name": "user", "type": "string"},
        {"name": "count", "type": "long"},
        {"name": "amount", "type": "long"},
    ],
}


def to_record(keyed: tuple[str, tuple[int, int]]) -> dict[str, Any]:
    user, (count, amount) = keyed
    return {"user": user, "count": count, "amount": amount}


flow = Dataflow(os.environ["JOB_NAME"])
(
    flow.source(
        "clicks", os.environ["CLICKS_TOPIC"], serde=JsonSerde(), timestamp=lambda c: c["ts_ms"]
    )
    .map("work", work)
    .key_by("by-user", lambda c: c["user"])
    .aggregate("totals", init=lambda: (0, 0), add=lambda a, c: (a[0] + 1, a[1] + c["amount"]))
    .sink(
        "out",
        FileSink(
            os.environ["OUTPUT_DIR"],
            format="avro",
            schema=SCHEMA,
            codec=os.environ.get("AVRO_CODEC", "deflate"),
            to_record=to_record,
            max_part_bytes=MAX_PART_BYTES,
        ),
    )
)
