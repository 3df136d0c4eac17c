"""Crash-test pipeline: every click joined with its user's plan as of the click's time (an
event-time temporal join with the user table of ``<CLICKS_TOPIC>-users``), into files."""

from __future__ import annotations

import os

from spin import worked_clicks

from connectors.serde import JsonSerde
from processor.dataflow import Dataflow
from sinks import FileSink

flow = Dataflow(os.environ["JOB_NAME"])
topic = os.environ["CLICKS_TOPIC"] + "-users"
users = flow.table("users", topic, serde=JsonSerde(), timestamp=lambda u: u["ts_ms"])
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
