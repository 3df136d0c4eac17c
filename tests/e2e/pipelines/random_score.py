"""Certify-test pipeline whose output depends on chance: each click gets a random score, so two
runs without any fault already differ and ``eosflow certify`` must say so."""

from __future__ import annotations

import os
import random

from connectors import JsonSerde
from processor import Dataflow
from sinks import FileSink

flow = Dataflow(os.environ.get("JOB_NAME", "random-score"))
(
    flow.source("clicks", os.environ.get("CLICKS_TOPIC", "clicks"), serde=JsonSerde())
    .map("score", lambda c: {"id": c["event_id"], "score": round(random.random(), 3)})
    .sink("out", FileSink(os.environ.get("OUTPUT_DIR", "out/random-score")))
)
