"""``JobAdmin.reset`` (:mod:`processor.admin`) called directly, on a real broker and Redis: what
it lists, what it deletes, and that an unconfirmed reset deletes nothing."""

from __future__ import annotations

from pathlib import Path

from connectors import KafkaSettings
from connectors.admin import TopicAdmin
from dedup.store import redis_client
from processor.admin import JobAdmin, ResetPlan
from processor.runtime.job import default_snapshot_url, job_dir
from processor.snapshot.store import SnapshotStore
from processor.testing import unique_name
from processor.wire import job_topic_prefix


def _job(state_dir: Path, kafka: KafkaSettings, redis_url: str) -> tuple[str, list[str]]:
    """A stopped job with a checkpoint, a state directory, two internal topics and Redis keys;
    returns its name and topics."""
    job = unique_name("admin-reset", prefix="j")
    store = SnapshotStore(default_snapshot_url(job, str(state_dir)))
    store.complete(job, 1, {"src.0": store.write_task_snapshot(job, 1, "src.0", {})}, {})
    (job_dir(job, str(state_dir)) / "worker-0.log").write_text("a log line\n")
    topics = [f"{job_topic_prefix(job)}src.count", f"{job_topic_prefix(job)}out.txn-markers"]
    admin = TopicAdmin(kafka)
    for topic in topics:
        admin.ensure_topic(topic, 1)
    client = redis_client(redis_url)
    client.set(f"eosflow:{job}:ids:0", b"1")
    client.set(f"eosflow:{job}:ids:1", b"1")
    return job, sorted(topics)


def test_reset_deletes_checkpoints_topics_redis_keys_and_state_when_confirmed(
    tmp_path: Path, kafka_settings: KafkaSettings, redis_url: str
) -> None:
    job, topics = _job(tmp_path, kafka_settings, redis_url)
    other, other_topics = _job(tmp_path, kafka_settings, redis_url)
    admin = JobAdmin(tmp_path, kafka=kafka_settings, redis_url=redis_url)
    shown: list[ResetPlan] = []
    done = admin.reset(job, confirm=lambda plan: shown.append(plan) or True)
    assert done is not None
    (plan,) = shown
    assert plan.topics == tuple(topics) and plan.topic_prefix == job_topic_prefix(job)
    assert plan.directory == job_dir(job, str(tmp_path)) and plan.pipeline is None
    assert plan.snapshot_url == default_snapshot_url(job, str(tmp_path))
    assert (done.job, done.checkpoints, done.topics, done.redis_keys, done.fenced) == (
        job, 1, tuple(topics), 2, (),
    )  # fmt: skip
    assert TopicAdmin(kafka_settings).list_topics(job_topic_prefix(job)) == []
    assert not plan.directory.exists()
    assert SnapshotStore(plan.snapshot_url).completed_ids(job) == []
    assert list(redis_client(redis_url).scan_iter(match=f"eosflow:{job}:*")) == []
    assert [j.job for j in admin.list_jobs()] == [other]  # the other job is untouched
    assert TopicAdmin(kafka_settings).list_topics(job_topic_prefix(other)) == other_topics


def test_reset_deletes_nothing_when_not_confirmed(
    tmp_path: Path, kafka_settings: KafkaSettings, redis_url: str
) -> None:
    job, topics = _job(tmp_path, kafka_settings, redis_url)
    admin = JobAdmin(tmp_path, kafka=kafka_settings, redis_url=redis_url)
    assert admin.reset(job, confirm=lambda plan: False) is None
    assert TopicAdmin(kafka_settings).list_topics(job_topic_prefix(job)) == topics
    assert SnapshotStore(default_snapshot_url(job, str(tmp_path))).completed_ids(job) == [1]
    assert len(list(redis_client(redis_url).scan_iter(match=f"eosflow:{job}:*"))) == 2
    assert [j.job for j in admin.list_jobs()] == [job]
