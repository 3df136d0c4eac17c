"""Skips for broker features the embedded Tansu lacks, which never skip on Apache Kafka.

A test that needs ``read_committed`` to hide aborted records, DeleteRecords or CreatePartitions
runs fully only where the broker has it. On Tansu it skips with a reason that starts with
:data:`FEATURE_SKIP`; on Apache Kafka (the probe found a Kafka release) a missing feature is a
failure, not a skip: every Kafka since 2.3 has all three, so a probe that says otherwise is a
bug of the probe or of the broker's set-up, and a release check that skipped there would prove
less than it says. ``.ci/run`` also fails its Kafka tier on any skip whose reason starts with
:data:`FEATURE_SKIP`, in case the probe did not recognise the release.
"""

from __future__ import annotations

from typing import Any

import pytest

__all__ = ["FEATURE_SKIP", "skip_unless_broker_has"]

#: How every skip for a missing broker feature begins (``.ci/run`` looks for it).
FEATURE_SKIP = "broker feature missing:"


def skip_unless_broker_has(caps: Any, feature: str, have: bool, why: str) -> None:
    """Skip (Tansu) or fail (Apache Kafka) the test when the broker lacks ``feature``.

    Args:
        caps: the session's :class:`connectors.probe.BrokerCapabilities` (``broker_caps``).
        feature: what is missing, e.g. ``"read_committed hides aborted records"``.
        have: whether the broker has it (a probe flag, or what a call just answered).
        why: what the test checks instead here, and where it runs fully.
    """
    if have:
        return
    if caps.release is not None:
        pytest.fail(
            f"Apache Kafka {caps.release} at {caps.brokers} lacks {feature}, by the probe or the "
            f"call just made; every Kafka since 2.3 has it: look at the broker's settings and "
            f"at connectors.probe ({why})"
        )
    pytest.skip(f"{FEATURE_SKIP} {feature} (broker {caps.brokers}): {why}")
