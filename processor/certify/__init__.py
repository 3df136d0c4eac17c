"""``eosflow certify``: prove a pipeline exactly-once by running it under faults.

:func:`certify` runs a pipeline file twice without faults and ``--runs`` times with injected
faults (SIGKILLs at protocol points and at random moments, a broker partition, a Redis restart),
each run on the same snapshot of its input and into outputs of its own, and compares every
committed output with the fault-free one; see docs/testing.md.

The rewrite that points each run's processes at their own job and destinations is applied by
every process that loads the pipeline, so it lives in the runtime
(:mod:`processor.runtime.redirect`); the runtime imports nothing of certify. The public names
are imported on first use (PEP 562): importing the whole of certify (the chaos kit, the runner,
the services) costs about 50 ms (bench/RESULTS.md, "Start-up and shut-down").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from processor.exports import lazy_exports

if TYPE_CHECKING:
    from processor.certify.core import CertifyOptions, certify
    from processor.certify.report import Report

__all__ = ["CertifyOptions", "Report", "certify"]

_HOME = {
    "CertifyOptions": "processor.certify.core",
    "certify": "processor.certify.core",
    "Report": "processor.certify.report",
}

__getattr__, __dir__ = lazy_exports(__name__, _HOME)
