"""Benchmark job: six operators and three shuffles, in the spirit of the ABS paper's evaluation.

The pipeline (4 stages, 3 key-routed channel topics)::

    clicks (Kafka, JSON)
      -> enrich (map: spend band, site section)                       stage 1 (source)
      -> key by user --[shuffle 1]--> per-user running totals         stage 2
      -> tier (map: the user's tier from their running spend)
      -> key by page --[shuffle 2]--> per-page running view counts    stage 3
      -> key by tier --[shuffle 3 + combiner]--> count per tier and   stage 4
         tumbling 10 s event-time window (clicks 1 s out of order at most) -> part files

The six operators are enrich, user-totals, tier, page-views, per-window and the sink. The first
two shuffles carry every click (running aggregates emit one record per input); the third is
a windowed count with partial combining, so it carries one partial count per tier, window and
batch. The per-page stage has six keys only, so it is skewed across subtasks on purpose: real
jobs have hot keys.

Accumulators are tuples and every aggregate returns a new one (the engine snapshots state by a
shallow copy while the task keeps running; see ``processor/runtime/operators/core.py``).

Configured by the environment variables ``JOB_NAME``, ``CLICKS_TOPIC`` and ``OUTPUT_DIR`` (see
``keyed_count.py``).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from connectors.serde import JsonSerde
from processor.dataflow import Dataflow, Tumbling
from sinks import FileSink

WINDOW = timedelta(seconds=10)


def enrich(click: dict[str, Any]) -> dict[str, Any]:
    page = click["page"]
    return {
        "user": click["user"],
        "page": page,
        "amount": click["amount"],
        "band": click["amount"] // 25,
        "section": "shop" if page in ("/item", "/cart", "/checkout") else "site",
    }


def add_user(acc: tuple[Any, ...], click: dict[str, Any]) -> tuple[Any, ...]:
    """(clicks, spend, last page, user): the aggregate's output must still say which page."""
    return (acc[0] + 1, acc[1] + click["amount"], click["page"], click["user"])


def tier(acc: tuple[Any, ...]) -> dict[str, Any]:
    clicks, spend, page, user = acc
    level = "gold" if spend >= 5000 else "silver" if spend >= 1000 else "bronze"
    return {"user": user, "page": page, "tier": level, "clicks": clicks}


def add_page(acc: tuple[Any, ...], view: dict[str, Any]) -> tuple[Any, ...]:
    """(views, last viewer's tier)."""
    return (acc[0] + 1, view["tier"])


flow = Dataflow(os.environ.get("JOB_NAME", "bench-six-ops"))
(
    flow.source(
        "clicks",
        os.environ.get("CLICKS_TOPIC", "clicks"),
        serde=JsonSerde(),
        timestamp=lambda click: click["ts_ms"],
        max_out_of_orderness=timedelta(seconds=1),
    )
    .map("enrich", enrich)
    .key_by("by-user", lambda click: click["user"])
    .aggregate("user-totals", init=lambda: (0, 0, "", ""), add=add_user)
    .map("tier", tier)
    .key_by("by-page", lambda view: view["page"])
    .aggregate("page-views", init=lambda: (0, ""), add=add_page)
    .key_by("by-tier", lambda acc: acc[1])
    .count("per-window", window=Tumbling(WINDOW))
    .sink("out", FileSink(os.environ.get("OUTPUT_DIR", "out/bench-six-ops")))
)
