"""Crash-test pipeline: every (item view, cart click) pair of a user with the cart click 0 to
30 s after the item view (an interval join of two streams cut from the clicks), into files."""

from __future__ import annotations

import os
from datetime import timedelta

from spin import worked_clicks

from processor.dataflow import Dataflow
from sinks import FileSink

flow = Dataflow(os.environ["JOB_NAME"])
clicks = worked_clicks(flow)
items = clicks.filter("items", lambda c: c["page"] == "/item").key_by("i-user", lambda c: c["user"])
carts = clicks.filter("carts", lambda c: c["page"] == "/cart").key_by("c-user", lambda c: c["user"])
(
    items.interval_join(
        "item-then-cart",
        carts,
        lambda item, cart: [item["event_id"], cart["event_id"]],
        lower=timedelta(0),
        upper=timedelta(seconds=30),
    ).sink("out", FileSink(os.environ["OUTPUT_DIR"]))
)
