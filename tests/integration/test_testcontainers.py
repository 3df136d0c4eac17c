"""Connectors against Apache Kafka in a container, where a Docker engine exists.

Without one these tests skip, and the embedded broker (or EOSFLOW_KAFKA_BROKERS) covers the same
paths in the rest of the suite. --eosflow-servers=containers (or EOSFLOW_TESTCONTAINERS=1) runs
the whole suite on containers.
"""

from __future__ import annotations

import pytest

from connectors import KafkaSettings, PartitionReader, TopicAdmin, create_producer, probe_broker
from connectors.config import producer_config
from processor.testing.servers import NO_DOCKER, docker_engine_available, kafka_container

pytestmark = pytest.mark.skipif(not docker_engine_available(), reason=NO_DOCKER)


def test_probe_and_round_trip_when_kafka_runs_in_a_container() -> None:
    with kafka_container() as bootstrap:
        settings = KafkaSettings(bootstrap)
        caps = probe_broker(settings)
        assert caps.exactly_once_transactions, caps.summary()
        TopicAdmin(settings).ensure_topic("tc-round-trip", 2)
        producer = create_producer(producer_config(settings))
        for i in range(100):
            producer.produce("tc-round-trip", str(i).encode(), partition=i % 2)
        assert producer.flush(30) == 0
        with PartitionReader(settings) as reader:
            reader.open({("tc-round-trip", 0): None, ("tc-round-trip", 1): None})
            values = []
            while not reader.reached_end():
                values.extend(m.value() for m in reader.poll(100, 0.2))
        assert sorted(values, key=int) == [str(i).encode() for i in range(100)]
