"""Benchmark job: clicks and amount per user in tumbling 10 s event-time windows, exactly once.

    clicks (Kafka, JSON, keyed by user; keyed source: no shuffle)
        -> (count, amount sum) per user and 10 s window, emitted when the window closes
        -> transactional KafkaSink: key user, value {"start_ms", "end_ms", "value": [n, sum]}

``bench/operators.py`` runs it against ``peer_jobs/operator_loop.py window``. The watermark is
the clicks' own ``ts_ms`` (1 s out of order at most); a bounded run ends with the maximum
watermark, so the windows still open at the end of the input fire then. Configured by
``JOB_NAME``, ``CLICKS_TOPIC``, ``OUTPUT_TOPIC`` and ``TXN_PREFIX`` (see ``keyed_count.py``).
"""

from __future__ import annotations

import os
from datetime import timedelta

from connectors.serde import JsonSerde
from processor.dataflow import Dataflow, Tumbling
from sinks import KafkaSink

WINDOW = timedelta(seconds=10)

flow = Dataflow(os.environ.get("JOB_NAME", "bench-window-count"))
(
    flow.source(
        "clicks",
        os.environ.get("CLICKS_TOPIC", "clicks"),
        serde=JsonSerde(),
        timestamp=lambda click: click["ts_ms"],
        max_out_of_orderness=timedelta(seconds=1),
        keyed=True,
    )
    .aggregate(
        "per-window",
        init=lambda: (0, 0),
        add=lambda acc, click: (acc[0] + 1, acc[1] + click["amount"]),
        window=Tumbling(WINDOW),
    )
    .sink(
        "out",
        KafkaSink(
            os.environ["OUTPUT_TOPIC"],
            transactional_id_prefix=os.environ.get("TXN_PREFIX", "bench-window-count"),
        ),
    )
)
