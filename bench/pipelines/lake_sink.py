"""The bench job of ``bench/lakehouse.py``: every click becomes one row (``to_row``) of the
table of ``LAKE_SINK`` (``file``: the same rows as JSON lines; ``iceberg``: an Iceberg table
partitioned by day(ts); ``delta``: a Delta table partitioned by day), under ``LAKE_DIR``."""

from __future__ import annotations

import datetime
import os
from typing import Any

import orjson
import pyarrow as pa

from connectors import JsonSerde
from processor import Dataflow
from sinks import DeltaSink, FileSink, IcebergSink

LAKE = os.environ["LAKE_DIR"]
KIND = os.environ.get("LAKE_SINK", "file")
SCHEMA = pa.schema(
    [
        ("event_id", pa.string()),
        ("user", pa.string()),
        ("page", pa.string()),
        ("amount", pa.int64()),
        ("ts", pa.timestamp("us", tz="UTC")),
        ("day", pa.date32()),
    ]
)
UTC = datetime.timezone.utc


def to_row(click: dict[str, Any]) -> dict[str, Any]:
    ts = datetime.datetime.fromtimestamp(click["ts_ms"] / 1000, tz=UTC)
    return {**{k: click[k] for k in ("event_id", "user", "page", "amount")}, "ts": ts,
            "day": ts.date()}  # fmt: skip


def sink() -> Any:
    if KIND == "iceberg":
        catalog = {
            "type": "sql",
            "uri": f"sqlite:///{LAKE}/catalog.db",
            "warehouse": f"file://{LAKE}/warehouse",
        }
        return IcebergSink(
            "bench.clicks", catalog=catalog, schema=SCHEMA, partition_by=[("ts", "day")],
            to_record=to_row,
        )  # fmt: skip
    if KIND == "delta":
        return DeltaSink(f"{LAKE}/delta", schema=SCHEMA, partition_by=["day"], to_record=to_row)
    # The same rows as JSON lines (orjson encodes datetime and date): the same job's work.
    return FileSink(f"{LAKE}/files", encoder=lambda click: orjson.dumps(to_row(click)))


flow = Dataflow(os.environ["JOB_NAME"])
flow.source(
    "clicks", os.environ["CLICKS_TOPIC"], serde=JsonSerde(), timestamp=lambda c: c["ts_ms"]
).sink("out", sink())
