"""``eosflow certify``: prove a pipeline exactly-once by running it under faults.

:func:`certify` runs a pipeline file twice without faults and ``--runs`` times with injected
faults (SIGKILLs at protocol points and at random moments, a broker partition, a Redis restart),
each run on the same snapshot of its input and into outputs of its own, and compares every
committed output with the fault-free one; see docs/testing.md.
"""

from processor.certify.core import CertifyOptions, certify
from processor.certify.report import Report

__all__ = ["CertifyOptions", "Report", "certify"]
