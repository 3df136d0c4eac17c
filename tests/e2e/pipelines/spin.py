"""What crash-test pipelines share (a module, not a pipeline): the work per click, and the
worked clicks source.

``WORK_US`` microseconds of work per record (default 100) stretch a run over several seconds,
so SIGKILLs land while records are in flight. The work is a wait, not a busy loop: a record
takes as long, but the test suite's parallel jobs do not burn the machine's cores on it (a
busy loop cost the default test tier about a fifth of its CPU time, and slowed every other
test running beside it).
"""

from __future__ import annotations

import os
import time
from typing import Any

WORK_S = int(os.environ.get("WORK_US", "100")) / 1e6


def work(click: Any) -> Any:
    return spin(click, WORK_S)


#: Work is owed per record and waited in slices of about this long (a sleep per record of
#: 100 µs would cost more in system calls than it waits).
SLICE_S = 0.002
_owed = [0.0]


def spin(value: Any, seconds: float) -> Any:
    """``value``, after ``seconds`` at least, on average: the time is owed and slept in slices
    of :data:`SLICE_S`. A sleep that overran (a loaded machine) is not paid back by the next
    records: like the busy loop it replaces, a loaded machine makes a run longer, never shorter
    (tests time their faults by the job's progress; a job that caught up by running its next
    records unworked drained its input before a fault's generation started)."""
    _owed[0] += seconds
    if _owed[0] >= SLICE_S:
        time.sleep(_owed[0])
        _owed[0] = 0.0
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
