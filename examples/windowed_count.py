"""Keyed windowed count: clicks per page in 10-second event-time windows, exactly once.

The pipeline (what ``eosflow run`` executes)::

    clicks (Kafka, JSON) -> key by page -> count per page and tumbling 10 s window
                         (partial counts combined before the shuffle) -> part files

Each output line is ``["/cart", {"start_ms": ..., "end_ms": ..., "value": 171}]``, written once
when the watermark passes the window's end (event time = the click's ``ts_ms``; clicks may be up
to 1 s out of order).

Run it end to end (embedded Kafka unless configured; writes input, runs until idle, checks)::

    python examples/windowed_count.py [--records 200000] [--workers 2]

Or on its own::

    CLICKS_TOPIC=clicks OUTPUT_DIR=out/pages eosflow run examples/windowed_count.py --until-idle
"""

from __future__ import annotations

import os
from datetime import timedelta

from connectors import JsonSerde
from processor import Dataflow, Tumbling
from sinks import FileSink

WINDOW = timedelta(seconds=10)

flow = Dataflow(os.environ.get("JOB_NAME", "windowed-count"))
(
    flow.source(
        "clicks",
        os.environ.get("CLICKS_TOPIC", "clicks"),
        serde=JsonSerde(),
        timestamp=lambda click: click["ts_ms"],
        max_out_of_orderness=timedelta(seconds=1),
    )
    .key_by("by-page", lambda click: click["page"])
    .count("per-window", window=Tumbling(WINDOW))
    .sink("out", FileSink(os.environ.get("OUTPUT_DIR", "out/windowed-count")))
)


if __name__ == "__main__":
    from clicks import expected_window_counts, run_example

    run_example(__file__, expected_window_counts, "windowed count")
