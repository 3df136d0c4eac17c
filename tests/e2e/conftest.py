"""Fixtures of the partition tests: the broker reachable only through a fault proxy.

The broker named by ``EOSFLOW_KAFKA_BROKERS`` (a real Apache Kafka in the release check and CI's
Kafka tier) when one is named, else an embedded Tansu of the module's own. The proxy advertises
itself in the broker's answers, so the named broker is not reconfigured and its other clients
(the rest of the suite) are not partitioned.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from processor.testing import BrokerBehindProxy, kafka_behind_proxy


@pytest.fixture(scope="module")
def partitionable() -> Iterator[BrokerBehindProxy]:
    with kafka_behind_proxy(brokers=os.environ.get("EOSFLOW_KAFKA_BROKERS") or None) as broker:
        yield broker


@pytest.fixture
def broker(partitionable: BrokerBehindProxy) -> Iterator[BrokerBehindProxy]:
    partitionable.proxy.heal()
    yield partitionable
    partitionable.proxy.heal()
