"""Crash-test pipeline: the user table joined with a table of each user's last click (a
table-table join), its changelog into files: ``[user, {"plan", "page"}]`` whenever either
changed, ``[user, null]`` when the user's row was deleted."""

from __future__ import annotations

import os

from spin import worked_clicks

from connectors.serde import JsonSerde
from processor.dataflow import Dataflow
from sinks import FileSink

flow = Dataflow(os.environ["JOB_NAME"])
topic = os.environ["CLICKS_TOPIC"] + "-users"
users = flow.table("users", topic, serde=JsonSerde(), timestamp=lambda u: u["ts_ms"])
last_click = worked_clicks(flow).key_by("by-user", lambda c: c["user"]).to_table("last-click")
(
    users.join(
        "with-last-click", last_click, lambda u, c: {"plan": u["plan"], "page": c["page"]}
    ).sink("out", FileSink(os.environ["OUTPUT_DIR"]))
)
