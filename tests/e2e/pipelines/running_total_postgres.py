"""Crash-test pipeline: the running total of ``running_total_work.py``, into PostgreSQL twice.

Every per-user total goes to two PostgreSQL sinks of the same stream:

- ``rows`` (append): one row ``(user_id, clicks, amount)`` per click, in ``PG_APPEND_TABLE``;
- ``latest`` (upsert by ``user_id``): the user's newest totals, in ``PG_UPSERT_TABLE``.

Both tables are created by the sinks' start-up check. The database comes from
``EOSFLOW_POSTGRES_DSN``, read by the sinks in the workers. ``WORK_US`` microseconds of work
per click (default 100) stretch the run so that SIGKILLs land while records are in flight.
"""

from __future__ import annotations

import os
from typing import Any

from spin import work  # the same work per click

from connectors.serde import JsonSerde
from processor.dataflow import Dataflow
from sinks.postgres import PostgresSink

COLUMNS = {"user_id": "text", "clicks": "bigint", "amount": "bigint"}


def as_row(item: Any) -> tuple[str, int, int]:
    user, (count, amount) = item
    return user, count, amount


flow = Dataflow(os.environ["JOB_NAME"])
totals = (
    flow.source(
        "clicks", os.environ["CLICKS_TOPIC"], serde=JsonSerde(), timestamp=lambda c: c["ts_ms"]
    )
    .map("work", work)
    .key_by("by-user", lambda c: c["user"])
    .aggregate("totals", init=lambda: (0, 0), add=lambda a, c: (a[0] + 1, a[1] + c["amount"]))
)
totals.sink("rows", PostgresSink(os.environ["PG_APPEND_TABLE"], COLUMNS, row=as_row))
totals.sink(
    "latest",
    PostgresSink(
        os.environ["PG_UPSERT_TABLE"], COLUMNS, mode="upsert", key=("user_id",), row=as_row
    ),
)
