"""A job's first start on a brand-new Apache Kafka (a fresh container, a fresh CI broker).

The first consumer-group request makes the broker create ``__consumer_offsets``, and its
coordinator answers COORDINATOR_LOAD_IN_PROGRESS while it loads. librdkafka 2.16.1's admin
ListConsumerGroupOffsets crashed the process on that answer (SIGSEGV in ``rd_kafka_cgrp_op``:
3 of 3 tries on a fresh Kafka 4.3.1), which a job's start makes (``connectors.claim``: the job's
history); where it did not crash, the error was final. The job group's offsets are now read
once a consumer's offset fetch found the coordinator loaded.

Needs a broker this test starts itself: Apache Kafka 4.3.1 from ``EOSFLOW_KAFKA_DIST`` or the
team's ``../shared/kafka``; skips without one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from processor.embedded._process import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DIST = Path(os.environ.get("EOSFLOW_KAFKA_DIST", ROOT.parent / "shared" / "kafka")) / "4.3.1"


@pytest.mark.skipif(
    not (DIST / "start.sh").exists(),
    reason=f"no Apache Kafka 4.3.1 distribution at {DIST} (set EOSFLOW_KAFKA_DIST)",
)
def test_the_job_group_is_read_without_a_crash_when_the_broker_is_brand_new() -> None:
    port = free_port()
    state = tempfile.mkdtemp(prefix="eosflow-fresh-kafka-")
    env = {
        **os.environ,
        "KAFKA_PORT": str(port),
        "KAFKA_CONTROLLER_PORT": str(free_port()),
        "KAFKA_STATE_DIR": state,
        "KAFKA_PYTHON": sys.executable,
    }
    started = subprocess.run(
        [str(DIST / "start.sh"), "--fresh"], env=env, capture_output=True, text=True, timeout=120
    )
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        read = subprocess.run(
            [sys.executable, "-c",
             "from connectors import KafkaSettings\n"
             "from connectors.claim import job_group_offsets\n"
             f"print(job_group_offsets(KafkaSettings.from_env(brokers='127.0.0.1:{port}'),"
             " 'fresh-job', timeout=60))"],
            capture_output=True, text=True, timeout=120, cwd=ROOT,
        )  # fmt: skip
        assert read.returncode == 0, (read.returncode, read.stdout, read.stderr[-2000:])
        assert read.stdout.strip() == "{}"
    finally:
        subprocess.run([str(DIST / "stop.sh"), "--wipe"], env=env, capture_output=True, timeout=120)
