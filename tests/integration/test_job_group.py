"""The job's consumer group shows where the job is (issue 35 item 2): after a run, Kafka's own
admin API (what ``kafka-consumer-groups --describe``, Burrow and lag exporters read) returns
the sources' checkpointed offsets under ``eosflow-<job>``, and ``eosflow status`` shows them."""

from __future__ import annotations

import subprocess
from pathlib import Path

from confluent_kafka import ConsumerGroupTopicPartitions
from confluent_kafka.admin import AdminClient

from connectors import KafkaSettings, TopicAdmin
from tests.e2e.cli import eosflow, job_env
from tests.e2e.harness import PIPELINES, produce_clicks


def test_the_job_group_holds_the_sources_checkpointed_offsets_after_a_run(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    """On main nothing was ever committed: the group did not exist."""
    brokers = kafka_endpoint[0]
    env = job_env(brokers, tmp_path, prefix="group", WORK_US="0")
    produce_clicks(brokers, env["CLICKS_TOPIC"], 2_000)
    run = subprocess.run(
        eosflow("run", str(PIPELINES / "tagged_clicks.py"), "--workers", "2",
                "--checkpoint-interval", "300ms", "--until-idle"),
        env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    group = f"eosflow-{env['JOB_NAME']}"
    admin = AdminClient({"bootstrap.servers": brokers})
    listed = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)])
    found = {(tp.topic, tp.partition): tp.offset for tp in listed[group].result().topic_partitions}
    topic_admin = TopicAdmin(KafkaSettings.from_env(brokers=brokers))
    ends = topic_admin.end_offsets(topic_admin.partitions(env["CLICKS_TOPIC"]))
    assert found == ends
    assert sum(found.values()) == 2_000

    status = subprocess.run(
        eosflow("status", env["JOB_NAME"]), env=env, capture_output=True, text=True, timeout=60
    )
    assert status.returncode == 0, status.stderr
    first = f"{env['CLICKS_TOPIC']}[0]={ends[(env['CLICKS_TOPIC'], 0)]}"
    assert f"group      {group}  committed " in status.stdout and first in status.stdout, (
        status.stdout
    )
