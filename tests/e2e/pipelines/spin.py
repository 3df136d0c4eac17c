"""What crash-test pipelines share (a module, not a pipeline): the CPU work per click, and the
worked clicks source.

``WORK_US`` microseconds of spinning per record (default 100) stretch a run over several
seconds, so SIGKILLs land while records are in flight.
"""

from __future__ import annotations

import os
import time
from typing import Any

WORK_S = int(os.environ.get("WORK_US", "100")) / 1e6


def work(click: Any) -> Any:
    return spin(click, WORK_S)


def spin(value: Any, seconds: float) -> Any:
    """``value``, after ``seconds`` of CPU."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
    return value


def worked_clicks(flow: Any) -> Any:
    """The clicks of ``CLICKS_TOPIC`` (JSON, event time ``ts_ms``, 1 s out of order at most),
    each spun ``WORK_US`` (step ``work``) so that kills land while records are in flight."""
    from datetime import timedelta

    from connectors.serde import JsonSerde

    return flow.source(
        "clicks",
        os.environ["CLICKS_TOPIC"],
        serde=JsonSerde(),
        timestamp=lambda c: c["ts_ms"],
        max_out_of_orderness=timedelta(seconds=1),
    ).map("work", work)
