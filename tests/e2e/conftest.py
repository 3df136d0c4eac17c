"""Fixtures of the partition tests: an embedded broker reachable only through a fault proxy."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from processor.testing import BrokerBehindProxy, kafka_behind_proxy


@pytest.fixture(scope="module")
def partitionable() -> Iterator[BrokerBehindProxy]:
    if os.environ.get("EOSFLOW_KAFKA_BROKERS"):
        pytest.skip(
            "partition tests need a broker whose advertised listener is the fault proxy; the "
            "broker named by EOSFLOW_KAFKA_BROKERS advertises itself (set its advertised."
            "listeners to a processor.testing.FaultProxy to run them there)"
        )
    with kafka_behind_proxy() as broker:
        yield broker


@pytest.fixture
def broker(partitionable: BrokerBehindProxy) -> Iterator[BrokerBehindProxy]:
    partitionable.proxy.heal()
    yield partitionable
    partitionable.proxy.heal()
