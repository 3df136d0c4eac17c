"""``eosflow certify`` on the lakehouse sinks: the running total into a Delta table and an
Iceberg table under ``LAKE_DIR`` (certify redirects both to tables of each run's own)."""

from __future__ import annotations

import os
from typing import Any

import pyarrow as pa

from connectors.serde import JsonSerde
from processor.dataflow import Dataflow
from sinks.lake import DeltaSink, IcebergSink

SCHEMA = pa.schema([("user", pa.string()), ("count", pa.int64()), ("amount", pa.int64())])
LAKE = os.environ["LAKE_DIR"]


def to_record(keyed: tuple[str, tuple[int, int]]) -> dict[str, Any]:
    user, (count, amount) = keyed
    return {"user": user, "count": count, "amount": amount}


flow = Dataflow(os.environ.get("JOB_NAME", "lake-certify"))
totals = (
    flow.source("clicks", "clicks", serde=JsonSerde(), timestamp=lambda c: c["ts_ms"])
    .key_by("by-user", lambda c: c["user"])
    .aggregate("totals", init=lambda: (0, 0), add=lambda a, c: (a[0] + 1, a[1] + c["amount"]))
)
totals.sink("delta", DeltaSink(f"{LAKE}/delta", schema=SCHEMA, to_record=to_record))
catalog = {"type": "sql", "uri": f"sqlite:///{LAKE}/catalog.db", "warehouse": f"file://{LAKE}/wh"}
totals.sink(
    "iceberg", IcebergSink("lake.totals", catalog=catalog, schema=SCHEMA, to_record=to_record)
)
