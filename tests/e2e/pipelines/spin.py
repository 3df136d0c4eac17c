"""The CPU work per click that crash-test pipelines share (a module, not a pipeline).

``WORK_US`` microseconds of spinning per record (default 100) stretch a run over several
seconds, so SIGKILLs land while records are in flight.
"""

from __future__ import annotations

import os
import time
from typing import Any

WORK_S = int(os.environ.get("WORK_US", "100")) / 1e6


def work(click: Any) -> Any:
    end = time.perf_counter() + WORK_S
    while time.perf_counter() < end:
        pass
    return click
