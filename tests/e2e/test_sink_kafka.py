"""Kafka sink under crashes: SIGKILL at every protocol point of the sink and at random moments.

Transactional mode is read with ``read_committed``. On a broker whose ``read_committed`` hides
aborted records (Apache Kafka) the committed output must equal the expectation exactly. On one
that does not (Tansu), records of transactions aborted by a crash stay visible, so duplicates
are expected there and the test checks what it can: nothing is lost (reading uncommitted: Tansu's
last stable offset was seen stuck after crashes, hiding committed records from read_committed
readers). Staged
mode needs no broker transactions: read through :class:`dedup.DedupConsumer`, it must be exact
on every broker.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest

from connectors import KafkaSettings
from connectors.admin import TopicAdmin
from processor.runtime.supervision.local import Fault
from sinks.kafka import HEADER_ID, read_transaction_markers
from tests.e2e.harness import (
    assert_exactly_once,
    chaos_seed,
    expected,
    expected_running_totals,
    run_chaos,
)
from tests.integration.test_sinks_kafka import read_topic

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

SINK_FAULTS = [
    Fault(0, 1, "before-prepare", 3),
    Fault(1, 0, "after-snapshot-before-ack", 2),
    Fault(2, 1, "after-completion-before-commit", 2),
    Fault(3, 0, "mid-sink-recover", 1),
    Fault(4, 1, "during-recovery", 1),
    Fault(5, 0, "mid-sink-commit", 1),
]


def _decoded(msgs: list[Any]) -> list[Any]:
    return [[m.key().decode(), orjson.loads(m.value())] for m in msgs]


@pytest.mark.parametrize(
    ("mode", "runner", "record_ids"),
    [
        # The default (record_ids=False): no header, the rescue finds an epoch's records by the
        # offsets of their delivery reports.
        ("transactional", "local", False),
        # Per-record ID headers, the rescue finds an epoch's records by them. Slow-marked (35 s
        # in CI, which must stay under 30 minutes): the rescue by header also has integration
        # tests (tests/integration/test_sinks_kafka.py, both ways).
        pytest.param("transactional", "local", True, marks=pytest.mark.slow),
        ("staged", "local", True),
        # Exact on any broker (Tansu included): the sink's side effects keyed by (epoch, worker)
        # under Spark's job cancel and re-submit.
        # CI's crash tier, in the Spark repeats' xdist group (tests/e2e/harness.py, SPARK_REPEAT).
        pytest.param(
            "staged",
            "spark",
            True,
            marks=[pytest.mark.spark, pytest.mark.crash, pytest.mark.xdist_group("spark")],
        ),
    ],
)
def test_kafka_sink_output_is_exactly_once_under_kills_at_every_sink_protocol_point(
    kafka_endpoint: tuple[str, str],
    kafka_settings: KafkaSettings,
    broker_caps: Any,
    tmp_path: Path,
    mode: str,
    runner: str,
    record_ids: bool,
) -> None:
    seed = chaos_seed()
    records = 60_000
    topic = f"chaos-out-{uuid.uuid4().hex[:8]}"
    TopicAdmin(kafka_settings).ensure_topic(topic, 3)
    seen: dict[str, list[Any]] = {}

    def read_output(job_env: dict[str, str]) -> list[Any]:
        # On Tansu read_committed shows aborted records anyway, and its last stable offset was
        # seen stuck after crashes (docs/sinks.md): read everything there.
        committed = mode == "staged" or broker_caps.read_committed_hides_aborted
        msgs = read_topic(kafka_settings, topic, committed=committed, dedup=mode == "staged")
        seen["msgs"] = msgs
        seen["job"] = [job_env["JOB_NAME"]]
        return _decoded(msgs)

    run = run_chaos(
        "running_total_kafka.py",
        brokers=kafka_endpoint[0],
        tmp=tmp_path,
        records=records,
        seed=seed,
        mode="aligned",
        interval=0.5,
        faults=SINK_FAULTS,
        random_kills=2,
        env={
            "OUTPUT_TOPIC": topic,
            "SINK_MODE": mode,
            "RECORD_IDS": "1" if record_ids else "0",
            "TXN_PREFIX": f"chaos-{topic}",
            "WORK_US": "300",  # long enough for every named fault and the random kills
        },
        read_output=read_output,
        runner=runner,
    )
    print(f"seed={seed} restarts={run.result.restarts} random kills={run.random_kills}")
    fired = {point for _w, point in run.faults_fired}
    assert fired == {f.point for f in SINK_FAULTS}, f"seed={seed}: faults fired: {fired}"
    want = expected(expected_running_totals, records, seed)
    if mode == "staged" or broker_caps.read_committed_hides_aborted:
        assert_exactly_once(want, run.output, seed=seed)
        return
    # Tansu, transactional: aborted transactions stay visible. No loss, and every extra record
    # belongs to an epoch without a commit marker of its own... which Tansu shows as well, so
    # the check that is left is: nothing lost, extras only from re-processed epochs.
    missing = want - run.output
    assert not missing, f"seed={seed}: {sum(missing.values())} records lost"
    markers = read_transaction_markers(kafka_settings, seen["job"][0], "out")
    assert markers, "the sink wrote no commit markers"
    if record_ids:  # record_ids=False: the records carry no header to count epochs by
        epochs = {dict(m.headers())[HEADER_ID].decode().rsplit(".", 1)[0] for m in seen["msgs"]}
        print(f"seed={seed} {len(epochs)} epochs with output")
    print(
        f"seed={seed} Tansu: {sum((run.output - want).values())} records of aborted "
        f"transactions visible (read_committed does not hide them here); "
        f"{len(markers)} commit markers"
    )
