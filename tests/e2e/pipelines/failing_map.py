"""A pipeline whose user function raises on one record: the job must fail with that cause."""

from __future__ import annotations

import os
from typing import Any

from connectors.serde import JsonSerde
from processor.dataflow import Dataflow
from sinks import FileSink


def check(click: Any) -> Any:
    if click["event_id"].endswith("-777"):
        raise ValueError(f"cannot handle {click['event_id']}")
    return click


flow = Dataflow(os.environ["JOB_NAME"])
(
    flow.source("clicks", os.environ["CLICKS_TOPIC"], serde=JsonSerde())
    .map("check", check)
    .sink("out", FileSink(os.environ["OUTPUT_DIR"]))
)
