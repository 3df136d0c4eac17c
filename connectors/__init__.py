"""Kafka connectors: client configuration, topic admin, the partition reader, serializers, probe."""

from connectors.admin import TopicAdmin, TopicInfo, TopicSpec
from connectors.config import (
    KafkaSettings,
    consumer_config,
    create_admin,
    create_consumer,
    create_producer,
    producer_config,
)
from connectors.errors import ErrorClass, classify, error_class
from connectors.probe import BrokerCapabilities, probe_broker
from connectors.reader import PartitionReader

__all__ = [
    "BrokerCapabilities",
    "ErrorClass",
    "KafkaSettings",
    "PartitionReader",
    "TopicAdmin",
    "TopicInfo",
    "TopicSpec",
    "classify",
    "consumer_config",
    "create_admin",
    "create_consumer",
    "create_producer",
    "error_class",
    "probe_broker",
    "producer_config",
]
