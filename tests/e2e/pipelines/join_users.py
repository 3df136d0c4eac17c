"""Crash-test pipeline: every click joined with its user's plan as of the click's time (an
event-time temporal join with the user table of ``<CLICKS_TOPIC>-users``), into files.

Each table row is spun ``TABLE_WORK_US`` (default 2 ms), so the clicks are read ahead of the
table: a join that did not wait for the table's watermark would join many clicks with rows
that are not their time's (checked: it fails this test)."""

from __future__ import annotations

import os

from spin import spin, worked_clicks

from connectors.serde import JsonSerde
from processor.dataflow import Dataflow
from sinks import FileSink

flow = Dataflow(os.environ["JOB_NAME"])
topic = os.environ["CLICKS_TOPIC"] + "-users"
table_work_s = int(os.environ.get("TABLE_WORK_US", "2000")) / 1e6
users = (
    flow.table("users", topic, serde=JsonSerde(), timestamp=lambda u: u["ts_ms"])
    .map("slow-rows", lambda row: spin(row, table_work_s))
    .to_table("users-table")
)
(
    worked_clicks(flow)
    .key_by("by-user", lambda c: c["user"])
    .join(
        "with-plan",
        users,
        lambda c, u: {"id": c["event_id"], "plan": None if u is None else u["plan"]},
        how="left",
    )
    .sink("out", FileSink(os.environ["OUTPUT_DIR"]))
)
