"""Kafka connectors: client configuration, topic admin, the partition reader, serializers, probe.

Serializers a pipeline names in ``Dataflow.source(..., serde=)`` and in sinks: :class:`JsonSerde`,
:class:`AvroSerde`, :class:`ConfluentAvroSerde` (Schema Registry wire format), :class:`StringSerde`,
:class:`RawSerde`.
"""

from connectors.admin import TopicAdmin, TopicInfo, TopicSpec
from connectors.claim import KafkaJobClaim, delete_job_group, job_group, job_group_offsets
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
from connectors.serde import (
    AvroSerde,
    ConfluentAvroSerde,
    JsonSerde,
    RawSerde,
    StringSerde,
    serde_for,
)

__all__ = [
    "AvroSerde",
    "BrokerCapabilities",
    "ConfluentAvroSerde",
    "ErrorClass",
    "JsonSerde",
    "KafkaJobClaim",
    "KafkaSettings",
    "PartitionReader",
    "RawSerde",
    "StringSerde",
    "TopicAdmin",
    "TopicInfo",
    "TopicSpec",
    "classify",
    "consumer_config",
    "create_admin",
    "create_consumer",
    "create_producer",
    "delete_job_group",
    "error_class",
    "job_group",
    "job_group_offsets",
    "probe_broker",
    "producer_config",
    "serde_for",
]
