"""Crash-test pipeline: the running total sunk into a Delta table and an Iceberg table.

Every click yields one row ``{"user", "count", "amount", "shard"}`` in each table: the user's
totals after that click (``expected_running_totals``). ``shard`` (the user's last character)
partitions the Delta table; the Iceberg table by ``identity(shard)``. Both live under
``LAKE_DIR`` (the Iceberg catalog is SQLite there), or, with ``LAKE_S3`` set, under
``s3://$LAKE_S3`` on the S3 API at ``AWS_ENDPOINT_URL``. ``WORK_US``: work per click.
``LAKE_MISFIT_EVERY=n``: a row whose count is a multiple of n gets a field that is not a
column (a dead letter in ``DEAD_DIR``, per sink step). ``LAKE_ORDER``: the sink steps' order
(default ``iceberg,delta``): a fault point kills at the first sink that reaches it.
"""

from __future__ import annotations

import os
from typing import Any

import pyarrow as pa
from spin import work  # the same work per click

from connectors.serde import JsonSerde
from processor.dataflow import Dataflow
from sinks.files import FileSink
from sinks.lake import DeltaSink, IcebergSink

SCHEMA = pa.schema(
    [("user", pa.string()), ("count", pa.int64()), ("amount", pa.int64()), ("shard", pa.string())]
)
LAKE = os.environ["LAKE_DIR"]
S3 = os.environ.get("LAKE_S3")


MISFIT = int(os.environ.get("LAKE_MISFIT_EVERY") or 0)


def to_record(keyed: tuple[str, tuple[int, int]]) -> dict[str, Any]:
    user, (count, amount) = keyed
    row = {"user": user, "count": count, "amount": amount, "shard": user[-1:]}
    if MISFIT and count % MISFIT == 0:
        row["misfit"] = True  # not a column: a dead letter of each sink step
    return row


def storage() -> tuple[str, dict[str, str], dict[str, str]]:
    """(Delta URI, delta-rs storage options, Iceberg catalog properties)."""
    catalog = {"type": "sql", "uri": f"sqlite:///{LAKE}/catalog.db"}
    if S3 is None:
        catalog["warehouse"] = f"file://{LAKE}/warehouse"
        return f"{LAKE}/delta", {}, catalog
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    options = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": os.environ["AWS_ACCESS_KEY_ID"],
        "AWS_SECRET_ACCESS_KEY": os.environ["AWS_SECRET_ACCESS_KEY"],
        "AWS_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
        "conditional_put": "etag",  # concurrent log writes safe (S3's If-None-Match)
    }
    catalog.update(
        {
            "warehouse": f"s3://{S3}/warehouse",
            "s3.endpoint": endpoint,
            "s3.access-key-id": os.environ["AWS_ACCESS_KEY_ID"],
            "s3.secret-access-key": os.environ["AWS_SECRET_ACCESS_KEY"],
            "s3.region": "us-east-1",
        }
    )
    return f"s3://{S3}/delta", options, catalog


DELTA_URI, DELTA_OPTIONS, CATALOG = storage()

DEAD = os.environ.get("DEAD_DIR")
flow = Dataflow(os.environ["JOB_NAME"], dead_letters=FileSink(DEAD) if DEAD else None)
totals = (
    flow.source(
        "clicks", os.environ["CLICKS_TOPIC"], serde=JsonSerde(), timestamp=lambda c: c["ts_ms"]
    )
    .map("work", work)
    .key_by("by-user", lambda c: c["user"])
    .aggregate("totals", init=lambda: (0, 0), add=lambda a, c: (a[0] + 1, a[1] + c["amount"]))
)
SINKS = {
    "delta": DeltaSink(
        DELTA_URI,
        schema=SCHEMA,
        partition_by=["shard"],
        to_record=to_record,
        storage_options=DELTA_OPTIONS,
    ),
    "iceberg": IcebergSink(
        "lake.totals",
        catalog=CATALOG,
        schema=SCHEMA,
        partition_by=[("shard", "identity")],
        to_record=to_record,
    ),
}
# The first sink step is the first to reach each protocol point (mid-sink-commit...) in a worker.
for name in os.environ.get("LAKE_ORDER", "iceberg,delta").split(","):
    totals.sink(name, SINKS[name])
