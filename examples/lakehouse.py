"""Land the click stream in an Apache Iceberg table and a Delta Lake table, exactly once.

The pipeline (what ``eosflow run`` executes)::

    clicks (Kafka, JSON) -> one row per click -> Iceberg table  (partitioned by day(ts))
                                              -> Delta table    (partitioned by day)

Each checkpoint becomes one commit per table, made when the checkpoint completes and carrying
its id (docs/sink-lakehouse.md): whatever crashes, every click is in each table once. Needs
the extras: ``pip install 'eosflow[iceberg,delta]'``.

Run it end to end (embedded Kafka; an Iceberg SQL catalog on SQLite and a Delta table in
``out/lakehouse/<run>``, or under ``LAKE_DIR``; writes input, runs until idle, reads both tables
back with pyiceberg and deltalake, checks them against the generated clicks, and leaves them
there with the lines that open them with pyiceberg's and deltalake's defaults)::

    python examples/lakehouse.py [--records 100000] [--workers 2] [--keep]

Or run the pipeline on its own against an existing topic::

    CLICKS_TOPIC=clicks LAKE_DIR=out/lake eosflow run examples/lakehouse.py --until-idle
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import pyarrow as pa

from connectors import JsonSerde
from processor import Dataflow
from sinks import DeltaSink, IcebergSink

LAKE = os.path.abspath(os.environ.get("LAKE_DIR", "out/lake"))
SCHEMA = pa.schema(
    [
        pa.field("event_id", pa.string(), nullable=False),
        pa.field("user", pa.string(), nullable=False),
        ("page", pa.string()),
        ("amount", pa.int64()),
        pa.field("ts", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("day", pa.date32(), nullable=False),  # Delta's partition column
    ]
)
CATALOG = {
    "type": "sql",
    "uri": f"sqlite:///{LAKE}/catalog.db",
    "warehouse": f"file://{LAKE}/warehouse",
}


def to_row(click: dict[str, Any]) -> dict[str, Any]:
    ts = datetime.datetime.fromtimestamp(click["ts_ms"] / 1000, tz=datetime.timezone.utc)
    return {
        "event_id": click["event_id"],
        "user": click["user"],
        "page": click["page"],
        "amount": click["amount"],
        "ts": ts,
        "day": ts.date(),
    }


flow = Dataflow(os.environ.get("JOB_NAME", "lakehouse"))
clicks = flow.source(
    "clicks",
    os.environ.get("CLICKS_TOPIC", "clicks"),
    serde=JsonSerde(),
    timestamp=lambda click: click["ts_ms"],
)
clicks.sink(
    "iceberg",
    IcebergSink(
        "web.clicks",
        catalog=CATALOG,
        schema=SCHEMA,
        partition_by=[("ts", "day")],
        to_record=to_row,
    ),
)
clicks.sink(
    "delta",
    DeltaSink(f"{LAKE}/delta/clicks", schema=SCHEMA, partition_by=["day"], to_record=to_row),
)


def _main() -> None:
    from collections import Counter

    from clicks import click_events, example_parser, finish, produce_clicks, run_until_idle

    from sinks import read_delta, read_iceberg

    parser = example_parser("lakehouse")
    parser.add_argument("--records", type=int, default=100_000)
    args = parser.parse_args()

    def produce(brokers: str, run_id: str) -> str:
        topic = os.environ["CLICKS_TOPIC"] = f"clicks-{run_id}"
        took = produce_clicks(brokers, topic, args.records)
        return f"wrote {args.records:,} clicks to {topic} in {took:.1f}s"

    # The tables outlive the run (the scratch directory does not, without --keep): they are
    # what there is to look at afterwards (issue 50). One directory per run: each has its job.
    def produce_and_place(brokers: str, run_id: str) -> str:
        base = os.environ.get("LAKE_DIR") or os.path.join("out", "lakehouse")
        os.environ["LAKE_DIR"] = os.path.abspath(os.path.join(base, run_id))
        return produce(brokers, run_id)

    result = run_until_idle(__file__, args, "lakehouse", produce_and_place)
    lake = os.environ["LAKE_DIR"]
    catalog = {"type": "sql", "uri": f"sqlite:///{lake}/catalog.db"}
    want = Counter((c["event_id"], c["amount"]) for c in click_events(args.records))
    problems = []
    for name, table in (
        ("iceberg", read_iceberg("web.clicks", catalog=catalog)),
        ("delta", read_delta(f"{lake}/delta/clicks")),
    ):
        got = Counter(zip(table["event_id"].to_pylist(), table["amount"].to_pylist(), strict=True))
        missing, extra = sum((want - got).values()), sum((got - want).values())
        print(f"{name}: {table.num_rows:,} rows read back")
        if missing or extra:
            problems.append(f"{name}: {missing} clicks missing, {extra} duplicated or unexpected")
    rate = result.records_in / result.seconds if result.seconds else 0.0
    print(
        f"lakehouse: {result.records_in:,} clicks in {result.seconds:.1f}s ({rate:,.0f}/s), "
        f"{result.checkpoints} checkpoints"
    )
    print(
        f"the tables stay in {lake} (remove it when done); open them with the formats' "
        "own defaults:\n"
        f"  from pyiceberg.catalog.sql import SqlCatalog\n"
        f"  SqlCatalog('default', uri='sqlite:///{lake}/catalog.db', "
        f"warehouse='file://{lake}/warehouse').load_table('web.clicks').scan().to_arrow()\n"
        f"  from deltalake import DeltaTable\n"
        f"  DeltaTable('{lake}/delta/clicks').to_pyarrow_table()"
    )
    finish(args, problems, f"OK: every click exactly once in both tables ({args.records:,})")


if __name__ == "__main__":
    _main()
