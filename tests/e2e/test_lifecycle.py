"""A job's lifecycle as operators live it (issue 18): inputs written by transactional producers,
fresh starts over an earlier run's topics, two runs of one job, restarts before the first
checkpoint, stop signals. Each test runs ``eosflow run`` as a user does (a subprocess on a real
broker) and compares the committed output with an expectation computed without the engine."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from connectors import KafkaSettings, TopicAdmin, create_producer, producer_config
from tests.e2e.cli import committed_output, eosflow, job_env, wait_status
from tests.e2e.harness import (
    PIPELINES,
    click_events,
    expected_running_totals,
    produce_clicks,
    produce_json,
)
from tests.features import skip_unless_broker_has

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
RUNNING_TOTAL = str(ROOT / "examples" / "running_total.py")


def produce_in_transactions(
    brokers: str,
    topic: str,
    events: list[dict[str, object]],
    *,
    per_transaction: int = 2_000,
    aborted_tail: int = 0,
) -> None:
    """Write ``events`` keyed by user in committed transactions of ``per_transaction``; then,
    with ``aborted_tail``, one more transaction of that many junk records that is aborted.

    Every partition then ends in a transaction marker (a control record that takes an offset
    and is never delivered), as the output of any exactly-once job does."""
    settings = KafkaSettings.from_env(brokers=brokers)
    TopicAdmin(settings).ensure_topic(topic, 8)
    config = {**producer_config(settings), "transactional.id": f"{topic}-writer"}
    producer = create_producer(config)
    producer.init_transactions(30)
    for start in range(0, len(events), per_transaction):
        producer.begin_transaction()
        for event in events[start : start + per_transaction]:
            producer.produce(topic, orjson.dumps(event), key=str(event["user"]).encode())
        producer.commit_transaction(60)
    if aborted_tail:
        producer.begin_transaction()
        for i in range(aborted_tail):
            producer.produce(topic, b"not json: aborted", key=f"user-{i:05d}".encode())
        producer.flush(30)
        producer.abort_transaction(60)


@pytest.mark.parametrize("aborted", [False, True], ids=["last-committed", "last-aborted"])
def test_until_idle_ends_on_an_input_written_in_transactions(
    kafka_endpoint: tuple[str, str], broker_caps: Any, tmp_path: Path, aborted: bool
) -> None:
    """The main use of eosflow is reading another exactly-once job's output: its partitions end
    in commit or abort markers. ``--until-idle`` must end there (the end offsets are the high
    watermarks, and a read_committed position moves over control records and aborted records
    to them) with every committed record once and no aborted one."""
    if aborted:
        skip_unless_broker_has(
            broker_caps,
            "read_committed hides aborted records",
            broker_caps.read_committed_hides_aborted,
            "an aborted tail is input here; the committed-tail case runs on it, this one on "
            "Apache Kafka",
        )
    records = 6_000
    env = job_env(kafka_endpoint[0], tmp_path)
    events = list(click_events(records))
    produce_in_transactions(
        kafka_endpoint[0], env["CLICKS_TOPIC"], events, aborted_tail=40 if aborted else 0
    )
    started = time.monotonic()
    result = subprocess.run(
        eosflow("run", RUNNING_TOTAL, "--workers", "2", "--checkpoint-interval", "300ms",
                "--until-idle"),
        env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"finished: {records:,} records read" in result.stdout, result.stdout
    assert committed_output(env) == expected_running_totals(events)
    assert time.monotonic() - started < 120


def test_a_fresh_start_over_an_earlier_runs_channel_topics_reads_none_of_their_records(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    """The state directory is deleted (so are the checkpoints and the generation counter) but
    the channel topics on the broker keep the earlier run's records, which start with
    ``GenerationStart(1)`` like the new run's. The new run must read none of them."""
    records = 4_000
    env = job_env(kafka_endpoint[0], tmp_path)
    produce_clicks(kafka_endpoint[0], env["CLICKS_TOPIC"], records)
    run = eosflow("run", RUNNING_TOTAL, "--workers", "2", "--checkpoint-interval", "300ms",
                  "--until-idle")  # fmt: skip
    first = subprocess.run(run, env=env, capture_output=True, text=True, timeout=180)
    assert first.returncode == 0, first.stderr[-3000:]
    want = expected_running_totals(click_events(records))
    assert committed_output(env) == want
    shutil.rmtree(env["EOSFLOW_STATE_DIR"])
    env["OUTPUT_DIR"] = str(tmp_path / "out-again")
    # The job's consumer group holds the first run's offsets: without --start-over the start
    # is refused (tests/e2e/test_job_identity.py).
    again = subprocess.run(
        [*run, "--start-over"], env=env, capture_output=True, text=True, timeout=180
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert committed_output(env) == want


def test_a_latest_source_restarted_before_the_first_checkpoint_keeps_its_start(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    """``start="latest"`` means the end of the topic when the job first started, not when a
    worker restarted: records that arrived in between must not be skipped."""
    brokers = kafka_endpoint[0]
    env = job_env(brokers, tmp_path, CLICKS_START="latest", WORK_US="0")
    before = list(click_events(1_000, seed=3))  # in the topic before the job: not input
    produce_json(brokers, env["CLICKS_TOPIC"], before, key=lambda e: str(e["user"]))
    proc = subprocess.Popen(
        # --mode none: no checkpoint before the final one (a job's first periodic checkpoint
        # follows its first reads since issue 51, whatever the interval)
        eosflow("run", str(PIPELINES / "backlog_total.py"), "--workers", "2",
                "--mode", "none", "--checkpoint-timeout", "2m"),
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        status = wait_status(env, lambda s: s.get("state") == "running" and all(
            w["connected"] for w in s["workers"]))  # fmt: skip
        time.sleep(1.0)  # the source tasks opened their readers
        events = list(click_events(3_000))
        produce_json(brokers, env["CLICKS_TOPIC"], events, key=lambda e: str(e["user"]))
        wait_status(env, lambda s: s.get("records_out") == len(events))
        os.kill(status["workers"][0]["pid"], signal.SIGKILL)  # no checkpoint completed yet
        wait_status(env, lambda s: s.get("restarts", 0) >= 1 and s.get("state") == "running"
                     and all(w["connected"] for w in s["workers"]))  # fmt: skip
        time.sleep(1.0)
        os.killpg(proc.pid, signal.SIGINT)  # a final checkpoint commits what was read
        _out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    assert committed_output(env) == expected_running_totals(events)


def test_a_second_run_of_a_running_job_is_refused_and_the_first_stays_exact(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    """Two coordinators of one job would share its generations, channels and transactions.
    The second ``eosflow run`` must be refused at once, naming the first; the first goes on."""
    records = 5_000
    env = job_env(kafka_endpoint[0], tmp_path)
    produce_clicks(kafka_endpoint[0], env["CLICKS_TOPIC"], records)
    run = eosflow("run", RUNNING_TOTAL, "--workers", "2", "--checkpoint-interval", "500ms")
    first = subprocess.Popen(
        run, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        wait_status(env, lambda s: s.get("state") == "running")
        started = time.monotonic()
        second = subprocess.run(
            run, env={**env, "OUTPUT_DIR": str(tmp_path / "second")},
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        took = time.monotonic() - started
        status = wait_status(env, lambda s: s.get("records_out") == records)
        assert status["restarts"] == 0 and status["pid"] == first.pid
        os.killpg(first.pid, signal.SIGINT)
        _out, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert second.returncode == 2, second.stderr[-3000:]
    assert f"job '{env['JOB_NAME']}' is already running: runner pid {first.pid}" in second.stderr
    assert took < 20, took
    assert first.returncode == 0, err[-3000:]
    assert committed_output(env) == expected_running_totals(click_events(records))
    assert not Path(tmp_path / "second").exists() or not any(Path(tmp_path / "second").iterdir())


def test_a_stop_whose_final_checkpoint_cannot_complete_ends_after_the_stop_timeout(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    """SIGTERM while a user function blocks: the final checkpoint cannot complete. The stop
    must end after --stop-timeout, say why, and lose nothing: the next run resumes from the
    last completed checkpoint and the committed output is exactly once."""
    records = 3_000
    env = job_env(kafka_endpoint[0], tmp_path, BLOCK_AT="1500", BLOCK_FILE=str(tmp_path / "b"))
    produce_clicks(kafka_endpoint[0], env["CLICKS_TOPIC"], records)
    blocking = str(PIPELINES / "blocking_total.py")
    proc = subprocess.Popen(
        eosflow("run", blocking, "--checkpoint-interval", "300ms", "--stop-timeout", "4s"),
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not Path(env["BLOCK_FILE"]).exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGTERM)
        signalled = time.monotonic()
        _out, err = proc.communicate(timeout=60)
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, err[-3000:]
    assert "SIGTERM: stopping after a final checkpoint (waiting at most 4s; SIGTERM again " \
        "stops at once without it)" in err  # fmt: skip
    assert "SIGTERM: the final checkpoint did not complete within --stop-timeout 4s; no ack " \
        "from ['clicks." in err  # fmt: skip
    assert "nothing is lost or duplicated" in err and "resumes from checkpoint" in err
    assert took < 15, took
    again = subprocess.run(
        eosflow("run", blocking, "--checkpoint-interval", "300ms", "--until-idle"),
        env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert committed_output(env) == expected_running_totals(click_events(records))


def test_jobs_lists_a_job_and_reset_refuses_while_it_runs_then_starts_it_afresh(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    from connectors import KafkaSettings, TopicAdmin

    records = 3_000
    env = job_env(kafka_endpoint[0], tmp_path)
    job = env["JOB_NAME"]
    produce_clicks(kafka_endpoint[0], env["CLICKS_TOPIC"], records)
    want = expected_running_totals(click_events(records))
    proc = subprocess.Popen(
        eosflow("run", RUNNING_TOTAL, "--checkpoint-interval", "300ms"),
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        status = wait_status(env, lambda s: s.get("records_out") == records)
        # A worker dies while its runner cannot notice (stopped): status says so.
        os.kill(proc.pid, signal.SIGSTOP)
        os.kill(status["workers"][0]["pid"], signal.SIGKILL)
        time.sleep(0.5)
        shown = subprocess.run(eosflow("status", job), env=env, capture_output=True, text=True)
        os.kill(proc.pid, signal.SIGCONT)
        assert f"worker 0   pid {status['workers'][0]['pid']}  dead" in shown.stdout
        assert f"worker 1   pid {status['workers'][1]['pid']}  alive, connected" in shown.stdout
        listed = subprocess.run(eosflow("jobs"), env=env, capture_output=True, text=True)
        assert any(line.split()[:2] == [job, "running"] for line in listed.stdout.splitlines())
        refused = subprocess.run(
            eosflow("reset", job, "--yes"), env=env, capture_output=True, text=True
        )
        assert refused.returncode == 1
        assert f"refusing to reset: job '{job}' is already running: runner pid {proc.pid}" in (
            refused.stderr
        )
        wait_status(env, lambda s: s.get("restarts", 0) >= 1 and s.get("state") == "running")
        os.killpg(proc.pid, signal.SIGINT)
        _out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    assert committed_output(env) == want
    listed = subprocess.run(eosflow("jobs", "--json"), env=env, capture_output=True, text=True)
    (row,) = [r for r in json.loads(listed.stdout) if r["job"] == job]
    # Issue 50: a job a signal stopped is "stopped", not "finished" (its input may go on)
    assert row["state"] == "stopped" and row["last_checkpoint"] != "-"

    admin = TopicAdmin(KafkaSettings.from_env(brokers=kafka_endpoint[0]))
    assert admin.list_topics(f"eosflow.{job}.")
    unconfirmed = subprocess.run(
        eosflow("reset", job), env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL
    )
    assert unconfirmed.returncode == 1 and "pass --yes to confirm" in unconfirmed.stderr
    listed = subprocess.run(eosflow("jobs", "--json"), env=env, capture_output=True, text=True)
    (kept,) = [r for r in json.loads(listed.stdout) if r["job"] == job]
    assert kept["last_checkpoint"].split()[0] == row["last_checkpoint"].split()[0]
    assert admin.list_topics(f"eosflow.{job}.")  # nothing deleted
    done = subprocess.run(eosflow("reset", job, "--yes"), env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    # its channel topic and its claim topic (eosflow.JOB.claim), and its consumer group
    assert "deleted 2 topics" in done.stdout and f"job '{job}' reset" in done.stdout
    assert f"deleted consumer group eosflow-{job}" in done.stdout, done.stdout
    assert not admin.list_topics(f"eosflow.{job}.")
    listed = subprocess.run(eosflow("jobs", "--json"), env=env, capture_output=True, text=True)
    assert not [r for r in json.loads(listed.stdout) if r["job"] == job]
    env["OUTPUT_DIR"] = str(tmp_path / "after-reset")  # afresh: every input again, once
    again = subprocess.run(
        eosflow("run", RUNNING_TOTAL, "--checkpoint-interval", "300ms", "--until-idle"),
        env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert committed_output(env) == want


def test_a_checkpoint_whose_input_topic_was_recreated_fails_the_run_with_the_fix(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    """The source topic was deleted and created again (or the broker replaced): the restored
    positions are beyond its end. The run must fail fast with the cause, not hang."""
    from connectors import KafkaSettings, TopicAdmin

    env = job_env(kafka_endpoint[0], tmp_path)
    produce_clicks(kafka_endpoint[0], env["CLICKS_TOPIC"], 4_000)
    run = eosflow("run", RUNNING_TOTAL, "--checkpoint-interval", "300ms", "--until-idle")
    first = subprocess.run(run, env=env, capture_output=True, text=True, timeout=180)
    assert first.returncode == 0, first.stderr[-3000:]
    admin = TopicAdmin(KafkaSettings.from_env(brokers=kafka_endpoint[0]))
    admin.delete_topics([env["CLICKS_TOPIC"]])
    deadline = time.monotonic() + 30
    while admin.exists(env["CLICKS_TOPIC"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    produce_clicks(kafka_endpoint[0], env["CLICKS_TOPIC"], 400)
    started = time.monotonic()
    again = subprocess.run(run, env=env, capture_output=True, text=True, timeout=180)
    took = time.monotonic() - started
    assert again.returncode == 1, again.stderr[-3000:]
    assert "is beyond the partition's end" in again.stderr
    assert "the topic or the broker was recreated" in again.stderr
    assert took < 30, took


def test_a_renamed_stateful_step_is_refused_and_map_state_continues_its_state(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    """Issue 24: the running-total step is renamed between two runs (it is not the first step
    of its stage, so the stage keeps its name). Before, the restart dropped its state without
    a word and the counts started again from 1 while the source went on from the checkpoint.
    Now the restart is refused before any worker starts, naming the step and the fixes; with
    ``--map-state OLD=NEW`` the counts continue, so the two runs' output is every click's
    running total once."""
    events = list(click_events(3_000, users=40))
    first, rest = events[:1_800], events[1_800:]
    env = job_env(kafka_endpoint[0], tmp_path, TOTAL_STEP="totals")
    brokers, topic = kafka_endpoint[0], env["CLICKS_TOPIC"]
    produce_json(brokers, topic, first, key=lambda e: str(e["user"]))
    pipeline = str(PIPELINES / "renamed_total.py")
    run = eosflow("run", pipeline, "--checkpoint-interval", "300ms", "--until-idle")
    done = subprocess.run(run, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert committed_output(env) == expected_running_totals(first)
    produce_json(brokers, topic, rest, key=lambda e: str(e["user"]))
    env["TOTAL_STEP"] = "totals-v2"
    refused = subprocess.run(run, env=env, capture_output=True, text=True, timeout=180)
    assert refused.returncode != 0, refused.stderr[-3000:]
    assert "'totals': no longer in the pipeline" in refused.stderr, refused.stderr[-3000:]
    assert "--map-state OLD=NEW" in refused.stderr and "--allow-dropped-state" in refused.stderr
    assert committed_output(env) == expected_running_totals(first)  # nothing ran
    mapped = subprocess.run(
        [*run, "--map-state", "totals=totals-v2"],
        env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert mapped.returncode == 0, mapped.stderr[-3000:]
    assert committed_output(env) == expected_running_totals(events)
