"""eosflow's internal topics keep their records: channel and commit-marker topics are created
with a retention that never deletes, an existing one with a short retention is altered at
start-up, and the probe tells whether the broker can purge them (DeleteRecords)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from connectors import BrokerCapabilities, KafkaSettings, TopicAdmin, TopicSpec
from connectors.transport import KafkaTransport
from processor.contracts import SinkContext
from sinks.kafka import KafkaSink, marker_topic

#: What a restore needs of an internal topic: nothing deleted by the broker.
INFINITE = {"cleanup.policy": "delete", "retention.ms": "-1", "retention.bytes": "-1"}


def _retention(admin: TopicAdmin, topic: str) -> dict[str, str]:
    config = admin.describe(topic).config
    return {k: config.get(k, "unreported") for k in INFINITE}


def test_channel_topics_keep_every_record_when_created(
    kafka_settings: KafkaSettings, topic_name: str
) -> None:
    channel = f"eosflow.{topic_name}.a.b"
    KafkaTransport(kafka_settings).ensure_topics({channel: 4})
    assert _retention(TopicAdmin(kafka_settings), channel) == INFINITE


def test_existing_channel_topic_with_a_short_retention_is_altered_when_the_job_starts(
    kafka_settings: KafkaSettings, topic_name: str, caplog: Any
) -> None:
    """A channel topic created by an older eosflow (the broker's default retention) or by hand
    with a short one: the start-up sets it, and says so."""
    channel = f"eosflow.{topic_name}.a.b"
    admin = TopicAdmin(kafka_settings)
    admin.ensure_topics(
        [TopicSpec(channel, 2, {"retention.ms": "60000", "retention.bytes": "1048576"})]
    )
    assert _retention(admin, channel)["retention.ms"] == "60000"
    with caplog.at_level(logging.WARNING, logger="connectors.admin"):
        KafkaTransport(kafka_settings).ensure_topics({channel: 2})
    assert _retention(admin, channel) == INFINITE
    assert f"topic={channel} had " in caplog.text
    assert "retention.ms=60000" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="connectors.admin"):
        KafkaTransport(kafka_settings).ensure_topics({channel: 2})  # right already: quiet
    assert "had" not in caplog.text


def test_commit_marker_topic_keeps_every_record_once_a_kafka_sink_opened(
    kafka_settings: KafkaSettings, topic_name: str
) -> None:
    TopicAdmin(kafka_settings).ensure_topic(topic_name, 1)
    sink = KafkaSink(topic_name, transactional_id_prefix=topic_name, settings=kafka_settings)
    job = f"j-{topic_name}"
    writer = sink.open(SinkContext(job=job, step="out", subtask=0, parallelism=1, generation=1))
    try:
        # as a task's open does: the marker topic is set up beside the producers' init
        writer.recover([])
        assert _retention(TopicAdmin(kafka_settings), marker_topic(job, "out")) == INFINITE
    finally:
        writer.close()


def test_probe_says_whether_channel_topics_can_be_purged(
    kafka_settings: KafkaSettings, broker_caps: BrokerCapabilities
) -> None:
    """Tansu 0.6 drops the connection on DeleteRecords (its in-memory storage lacks it):
    the probe must say no there, from the broker's answer, and yes on Apache Kafka."""
    from connectors.probe import deletes_records

    assert deletes_records(kafka_settings) is broker_caps.delete_records
    assert "DeleteRecords (channel topics purged)" in broker_caps.summary()
    if not broker_caps.delete_records:
        assert any("DeleteRecords" in note for note in broker_caps.notes)
        if broker_caps.read_committed_hides_aborted:
            pytest.fail(f"an Apache Kafka-like broker without DeleteRecords: {broker_caps}")
