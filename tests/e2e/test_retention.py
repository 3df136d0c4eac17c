"""Channel topics against retention (issue 17/18): they keep every record (the broker's
retention could delete what a restore of a retained checkpoint reads), and eosflow purges
what no retained checkpoint needs, with DeleteRecords, while workers are SIGKILLed and
restored after purges. The purge needs a broker with DeleteRecords: on Tansu (the probe says
it has none) the test checks the configuration and the output, then says it ran only so far.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from connectors import BrokerCapabilities, KafkaSettings, TopicAdmin
from connectors.claim import claim_topic
from processor.runtime.job import default_snapshot_url
from processor.snapshot.store import SnapshotStore
from tests.e2e.harness import (
    assert_exactly_once,
    chaos_seed,
    expected,
    expected_running_totals,
    run_chaos,
)
from tests.features import skip_unless_broker_has

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

INFINITE = {"cleanup.policy": "delete", "retention.ms": "-1", "retention.bytes": "-1"}


def _oldest_retained_positions(
    store: SnapshotStore, job: str
) -> tuple[int, dict[tuple[str, int], int]]:
    """The channel positions held by the oldest completed checkpoint in the store."""
    oldest = store.completed_ids(job)[0]
    manifest = store.load(job, oldest)
    positions: dict[tuple[str, int], int] = {}
    for handle in manifest.tasks.values():
        for (topic, partition), offset in store.read_task_snapshot(handle)["positions"].items():
            if topic.startswith(f"eosflow.{job}.") and offset is not None:
                positions[(topic, partition)] = offset
    return oldest, positions


def test_channels_are_purged_only_below_the_oldest_retained_checkpoint_when_workers_are_killed(
    kafka_endpoint: tuple[str, str], broker_caps: BrokerCapabilities, tmp_path: Path
) -> None:
    seed = chaos_seed()
    records = 100_000
    # Each kill comes after the generation completed 5 checkpoints: with 3 kept, the first
    # purges have happened, and the restore reads channels above purged offsets.
    run = run_chaos(
        "running_total_work.py",
        brokers=kafka_endpoint[0],
        tmp=tmp_path,
        records=records,
        seed=seed,
        mode="aligned",
        interval=0.2,
        random_kills=2,
        kill_plan=[(0.3, 5), (0.7, 5)],
        env={"WORK_US": "60"},
    )
    print(f"seed={seed} kills={run.random_kills} restarts={run.result.restarts}")
    assert len(run.random_kills) == 2, f"seed={seed}: {run.random_kills}"
    assert_exactly_once(expected(expected_running_totals, records, seed), run.output, seed=seed)

    job = run.result.job
    admin = TopicAdmin(KafkaSettings.from_env(brokers=kafka_endpoint[0]))
    # The job's claim topic is compacted on purpose (one record: who holds the job).
    channels = [t for t in admin.list_topics(prefix=f"eosflow.{job}.") if t != claim_topic(job)]
    assert channels, f"no channel topics for job {job}"
    for topic in channels:
        config = admin.describe(topic).config
        assert {k: config.get(k) for k in INFINITE} == INFINITE, (topic, config)

    store = SnapshotStore(default_snapshot_url(job, str(tmp_path / "state")))
    oldest, positions = _oldest_retained_positions(store, job)
    lows = {tp: low for tp, (low, _high) in admin.watermarks(list(positions)).items()}
    logs = "\n".join(run.logs.values())
    print(f"oldest retained checkpoint={oldest} positions={positions} low watermarks={lows}")
    for tp, low in lows.items():
        assert low <= positions[tp], f"seed={seed}: {tp} purged to {low}, beyond {positions[tp]}"
    if not broker_caps.delete_records:
        assert "are not purged" in logs
        assert set(lows.values()) == {0}
    skip_unless_broker_has(
        broker_caps,
        "DeleteRecords",
        broker_caps.delete_records,
        "configuration and output checked; the purge runs fully only on Apache Kafka "
        "(EOSFLOW_KAFKA_BROKERS)",
    )
    # Every incarnation of a worker purged (a kill came after 5 completed checkpoints of its
    # generation), and the partitions moved.
    assert logs.count("first purge of this worker") >= 3, logs[-3000:]
    assert sum(lows.values()) > 0, f"seed={seed}: nothing was purged: {lows}"
