"""``eosflow txn list|abort`` on a pipeline with a transactional Kafka sink."""

from __future__ import annotations

from pathlib import Path

import pytest

from connectors import KafkaSettings
from connectors.admin import TopicAdmin
from processor.cli import main
from processor.contracts import SinkContext
from sinks.kafka import KafkaSink

PIPELINE = Path(__file__).resolve().parents[1] / "e2e" / "pipelines" / "running_total_kafka.py"


def test_txn_list_shows_the_pool_and_markers_and_abort_fences_it(
    kafka_settings: KafkaSettings,
    topic_name: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    TopicAdmin(kafka_settings).ensure_topic(topic_name, 2)
    job = f"txn-{topic_name[-8:]}"
    for key, value in {
        "JOB_NAME": job,
        "CLICKS_TOPIC": topic_name,
        "OUTPUT_TOPIC": topic_name,
        "TXN_PREFIX": f"p-{topic_name}",
        "EOSFLOW_KAFKA_BROKERS": kafka_settings.brokers,
        "EOSFLOW_STATE_DIR": str(tmp_path),
    }.items():
        monkeypatch.setenv(key, value)
    sink = KafkaSink(topic_name, transactional_id_prefix=f"p-{topic_name}", settings=kafka_settings)
    writer = sink.open(SinkContext(job, "out", 0, 2, 1))
    writer.recover([])
    writer.write([{"n": 1}, {"n": 2}])
    writer.commit(1, writer.prepare(1))
    writer.write([{"n": 3}])
    writer.prepare(2)  # left open: what `txn abort` is for
    assert main(["txn", "list", str(PIPELINE)]) == 0
    out = capsys.readouterr().out
    assert f"p-{topic_name}-out-0-0, p-{topic_name}-out-0-1" in out
    assert "1 commit markers" in out  # the open transaction's marker is not committed
    assert main(["txn", "abort", str(PIPELINE)]) == 0
    assert "fenced 16 transactional ids" in capsys.readouterr().out


def test_txn_commands_cover_the_subtasks_of_an_earlier_higher_parallelism_when_rescaled(
    kafka_settings: KafkaSettings,
    topic_name: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """After a rescale from 3 to 1 the ids of subtasks 1 and 2 exist on the broker too: the
    job file _SINK_SUBTASKS makes `txn list|abort --workers 1` cover them (issue 24)."""
    from processor.runtime.job import default_snapshot_url
    from processor.runtime.shape.topology import record_parallelism
    from processor.snapshot.store import SnapshotStore

    TopicAdmin(kafka_settings).ensure_topic(topic_name, 2)
    job = f"txn-{topic_name[-8:]}"
    for key, value in {
        "JOB_NAME": job,
        "CLICKS_TOPIC": topic_name,
        "OUTPUT_TOPIC": topic_name,
        "TXN_PREFIX": f"p-{topic_name}",
        "EOSFLOW_KAFKA_BROKERS": kafka_settings.brokers,
        "EOSFLOW_STATE_DIR": str(tmp_path),
    }.items():
        monkeypatch.setenv(key, value)
    store = SnapshotStore(default_snapshot_url(job))
    assert record_parallelism(store, job, 3) == 3
    assert record_parallelism(store, job, 1) == 3  # the highest stays
    assert main(["txn", "list", str(PIPELINE), "--workers", "1"]) == 0
    assert f"p-{topic_name}-out-2-0, p-{topic_name}-out-2-1" in capsys.readouterr().out
    assert main(["txn", "abort", str(PIPELINE), "--workers", "1"]) == 0
    assert "fenced 24 transactional ids" in capsys.readouterr().out
