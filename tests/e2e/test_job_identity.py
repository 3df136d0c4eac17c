"""One job, one identity, in Kafka (issue 35, items 1 and 2): a second runner of a job with
another state directory fences the first or is refused, a fenced runner stops with a message
and a non-zero exit status, and a start that lost the job's state is refused instead of
reprocessing. Each test runs ``eosflow run`` as a user does and compares the committed output
with the input (``tagged_clicks.py``: one stage, one output per click)."""

from __future__ import annotations

import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from connectors import KafkaSettings, TopicAdmin
from processor.testing.outputs import scan_topic
from tests.e2e.cli import committed_output, elsewhere, eosflow, job_env, wait_status
from tests.e2e.harness import (
    PIPELINES,
    assert_exactly_once,
    canonical,
    chaos_seed,
    click_events,
    expected,
    expected_running_totals,
    produce_clicks,
)
from tests.features import skip_unless_broker_has

pytestmark = pytest.mark.integration

TAGGED = str(PIPELINES / "tagged_clicks.py")


def _expected(records: int) -> Counter[bytes]:
    return Counter(
        canonical({"event_id": c["event_id"], "user": c["user"]}) for c in click_events(records)
    )


def _run(
    env: dict[str, str], *extra: str, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    argv = eosflow("run", TAGGED, "--workers", "2", "--checkpoint-interval", "300ms",
                   "--until-idle", *extra)  # fmt: skip
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)


def test_a_run_that_lost_its_state_is_refused_until_reset_or_start_over(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    """Issue 35 item 2: ``rm -rf $EOSFLOW_STATE_DIR/jobs/JOB`` and a new ``run`` re-read every
    source from the earliest offset and committed its output again. Now the job's consumer
    group shows its history, and the start is refused, naming the ways on; ``--start-over``
    and ``eosflow reset`` (which deletes the group) are two of them."""
    records = 3_000
    env = job_env(kafka_endpoint[0], tmp_path, prefix="lost", WORK_US="0")
    produce_clicks(kafka_endpoint[0], env["CLICKS_TOPIC"], records)
    first = _run(env)
    assert first.returncode == 0, first.stderr[-3000:]
    want = _expected(records)
    assert committed_output(env) == want
    job = env["JOB_NAME"]
    state = Path(env["EOSFLOW_STATE_DIR"]) / "jobs" / job

    import shutil

    shutil.rmtree(state)
    refused = _run(env, timeout=120)
    assert refused.returncode == 2, (refused.returncode, refused.stderr[-3000:])
    message = refused.stderr
    assert f"job {job!r} has history in Kafka but no checkpoint" in message, message[-3000:]
    assert f"eosflow-{job}" in message and "eosflow reset" in message, message[-3000:]
    assert "--start-over" in message, message[-3000:]
    assert committed_output(env) == want  # nothing was written twice

    shutil.rmtree(state, ignore_errors=True)
    env["OUTPUT_DIR"] = str(tmp_path / "out-start-over")
    over = _run(env, "--start-over")
    assert over.returncode == 0, over.stderr[-3000:]
    assert "--start-over: deleted the offsets of consumer group" in over.stderr
    assert committed_output(env) == want  # a start over: the whole input, once, again

    shutil.rmtree(state)
    again = _run(env, timeout=120)
    assert again.returncode == 2, again.stderr[-3000:]  # the start over left history too
    reset = subprocess.run(
        eosflow("reset", job, "--yes"), env=env, capture_output=True, text=True, timeout=120
    )
    assert reset.returncode == 0, reset.stderr
    assert f"deleted consumer group eosflow-{job}" in reset.stdout, reset.stdout
    env["OUTPUT_DIR"] = str(tmp_path / "out-after-reset")
    fresh = _run(env)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert committed_output(env) == want


def test_a_second_runner_with_another_state_dir_is_refused_while_the_first_has_history(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    """Issue 35 item 1, the runner that has checkpointed: a second ``run`` of the job with
    another ``EOSFLOW_STATE_DIR`` (another host, a fresh volume) is refused before it fences
    anything, and the first runner ends the job exactly once. Issue 48: the refusal says the
    job is running now, where, and how to move it (it said "has history in Kafka" and offered
    ``--start-over``, which fenced the running job mid-run: both runners died); ``--start-over``
    is refused while the first runner is live, and so is ``eosflow reset`` from the other state
    directory (it deleted the running job's topics and group under it)."""
    records = 4_000
    env_a = job_env(kafka_endpoint[0], tmp_path / "a", prefix="twice", WORK_US="1000")
    produce_clicks(kafka_endpoint[0], env_a["CLICKS_TOPIC"], records)
    env_b = elsewhere(env_a, tmp_path / "b")
    with (tmp_path / "a.err").open("w") as err:
        first = subprocess.Popen(  # about 50 s of input: running through B's three tries
            eosflow("run", TAGGED, "--workers", "2", "--checkpoint-interval", "300ms",
                    "--max-rate", "40", "--until-idle"),
            env=env_a, stdout=subprocess.PIPE, stderr=err, text=True,
        )  # fmt: skip
    try:
        wait_status(env_a, lambda st: st["checkpoint"]["last_completed"] >= 2, timeout=120)
        second = _run(env_b, timeout=120)
        assert second.returncode == 2, second.stderr[-3000:]
        said = second.stderr[-3000:]
        assert f"job {env_a['JOB_NAME']!r} is running now: runner on host " in said, said
        assert f"pid {first.pid}, checkpoint " in said and "left alone" in said, said
        assert f"eosflow savepoint {env_a['JOB_NAME']} --stop" in said, said
        over = _run(env_b, "--start-over", timeout=120)
        said = over.stderr[-3000:]
        assert over.returncode == 2 and "is running now" in said and "--force" in said, said
        reset = subprocess.run(
            eosflow("reset", env_a["JOB_NAME"], "--yes"),
            env=env_b, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        said = reset.stderr[-3000:]
        assert reset.returncode == 1 and "refusing to reset" in said, (reset.stdout, said)
        assert "is running now" in said and "--force" in said, said
        first.communicate(timeout=240)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, (tmp_path / "a.err").read_text()[-3000:]
    assert committed_output(env_a) == _expected(records)
    assert not Path(env_b["OUTPUT_DIR"]).exists() or not committed_output(env_b)


@pytest.mark.parametrize("sink", ["file", "kafka"])
def test_a_second_runner_fences_the_first_which_stops_saying_so(
    kafka_endpoint: tuple[str, str], broker_caps: Any, tmp_path: Path, sink: str
) -> None:
    """Issue 35 item 1, the runner that has not checkpointed yet: runner A (state dir A, no
    periodic checkpoint: ``--mode none``, reading slowly: ``--max-rate``; a long interval no
    longer keeps a job from checkpointing, its first checkpoint follows its first reads since
    issue 51) reads; runner B of the same job
    (state dir B) starts, finds no history, and takes the job, fencing A. A stops with
    "another runner took job" and a non-zero exit status (on main it went on and finished with
    exit status 0): at its first checkpoint (file sink), or as soon as its workers'
    transactional ids are fenced by B's (Kafka sink). A committed nothing; B's output is the
    input exactly once."""
    if sink == "kafka":
        skip_unless_broker_has(
            broker_caps,
            "read_committed hides aborted records",
            broker_caps.read_committed_hides_aborted,
            "the fenced runner's aborted transactions would be read as output; the file-sink "
            "case runs here, this one on Apache Kafka",
        )
    records = 4_000
    env_a = job_env(kafka_endpoint[0], tmp_path / "a", prefix="fence", WORK_US="0")
    produce_clicks(kafka_endpoint[0], env_a["CLICKS_TOPIC"], records)
    settings = KafkaSettings.from_env(brokers=kafka_endpoint[0])
    if sink == "kafka":
        env_a["OUTPUT_TOPIC"] = f"{env_a['JOB_NAME']}-out"
        env_a["TXN_PREFIX"] = env_a["JOB_NAME"]
        TopicAdmin(settings).ensure_topic(env_a["OUTPUT_TOPIC"], 4)
    env_b = elsewhere(env_a, tmp_path / "b")
    with (tmp_path / "a.err").open("w") as err:
        first = subprocess.Popen(
            eosflow("run", TAGGED, "--workers", "2", "--mode", "none",
                    "--max-rate", "60", "--until-idle"),
            env=env_a, stdout=subprocess.PIPE, stderr=err, text=True,
        )  # fmt: skip
    try:
        wait_status(env_a, lambda st: st["records_in"] > 0, timeout=120)
        started = time.monotonic()
        second = _run(env_b)
        a_out, _ = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    a_err = (tmp_path / "a.err").read_text()
    assert second.returncode == 0, second.stderr[-3000:]
    assert first.returncode not in (0, None), (first.returncode, a_out, a_err[-3000:])
    assert f"another runner took job {env_a['JOB_NAME']!r}" in a_err, a_err[-3000:]
    assert "finished" not in a_out, a_out
    assert time.monotonic() - started < 200
    want = _expected(records)
    if sink == "kafka":
        got = Counter(
            canonical(_json(m.value())) for m in scan_topic(settings, env_a["OUTPUT_TOPIC"])
        )
        assert got == want
    else:
        assert committed_output(env_b) == want
        assert not Path(env_a["OUTPUT_DIR"]).exists() or not committed_output(env_a)


def _json(raw: bytes | None) -> Any:
    import orjson

    return orjson.loads(raw or b"null")


@pytest.mark.parametrize("start", ["while-the-first-runs", "together"])
def test_two_runners_without_state_on_a_two_stage_pipeline_leave_one_exact_output(
    kafka_endpoint: tuple[str, str], tmp_path: Path, start: str
) -> None:
    """Issue 48 item 2: two runners of a job with two state directories, none with history,
    on a pipeline with a shuffle (its channel topics are the job's, shared by both). Both
    allocated generation 1 from their own stores, so the one fenced later went on writing
    channel records until its next checkpoint and the other's readers took them as their own:
    the winner's running totals counted some clicks twice (on main, ``while-the-first-runs``).
    Now the newcomer starts above the generation the claim names, and its readers drop the
    fenced runner's records. Exactly one runner ends well, with every click's total once; the
    other fails saying why and committed nothing."""
    brokers = kafka_endpoint[0]
    records, seed = 3_000, chaos_seed()
    env_a = job_env(brokers, tmp_path / "a", prefix="two", WORK_US="0")
    produce_clicks(brokers, env_a["CLICKS_TOPIC"], records, seed=seed)
    env_b = elsewhere(env_a, tmp_path / "b")
    total = str(PIPELINES / "running_total_work.py")
    # per worker: 30 s of input, no checkpoint before its final one (the first checkpoint of a
    # job with an interval follows its first reads, issue 51)
    slow = ("--mode", "none", "--max-rate", "50")
    fast = ("--checkpoint-interval", "300ms", "--max-rate", "1500")
    runs: dict[str, subprocess.Popen[str]] = {}
    try:
        for name, env, pace in (("a", env_a, slow if start != "together" else fast),
                                ("b", env_b, fast)):  # fmt: skip
            if name == "b" and start != "together":  # A has written channel records
                wait_status(env_a, lambda st: st["records_in"] > 200, timeout=120)
            with (tmp_path / f"{name}.err").open("w") as err:
                runs[name] = subprocess.Popen(
                    eosflow("run", total, "--workers", "2", "--until-idle", *pace),
                    env=env, stdout=subprocess.DEVNULL, stderr=err, text=True,
                )  # fmt: skip
        for run in runs.values():
            run.wait(timeout=240)
    finally:
        for run in runs.values():
            if run.poll() is None:
                run.kill()
    codes = {name: run.returncode for name, run in runs.items()}
    errors = {name: (tmp_path / f"{name}.err").read_text() for name in runs}
    winners = [name for name, code in codes.items() if code == 0]
    assert len(winners) == 1, (codes, {n: e[-2000:] for n, e in errors.items()})
    loser = "a" if winners == ["b"] else "b"
    # The loser is fenced by the winner's claim, refused for the winner's history in Kafka,
    # or (started later than the winner's first checkpoints: CI under load) refused because
    # the job is running elsewhere; each leaves the running job alone.
    refusals = (
        f"another runner took job {env_a['JOB_NAME']!r}",
        "has history in Kafka",
        f"job {env_a['JOB_NAME']!r} is running now",
    )
    assert any(text in errors[loser] for text in refusals), errors[loser][-3000:]
    if start != "together":
        assert winners == ["b"], codes
    winner_env = env_a if winners == ["a"] else env_b
    assert_exactly_once(
        expected(expected_running_totals, records, seed), committed_output(winner_env), seed=seed
    )
    loser_env = env_b if winners == ["a"] else env_a
    assert not Path(loser_env["OUTPUT_DIR"]).exists() or not committed_output(loser_env)


def test_a_running_job_moves_to_another_state_dir_through_a_savepoint_exactly_once(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    """Issue 48 item 3, the documented way to move or upgrade a running job (docs/deployment.md,
    "One runner per job"): on the old runner's side, ``eosflow savepoint J --stop --path P``
    (its final checkpoint, sinks committed, runner stopped); on the new one, with another state
    directory, ``eosflow run ... --from-savepoint P``. The new runner is not refused (the old
    one's last claim record says it stopped) and goes on from the savepoint: the two runners'
    committed outputs together are every click's running total once, through a shuffle."""
    brokers = kafka_endpoint[0]
    records, seed = 4_000, chaos_seed()
    env_a = job_env(brokers, tmp_path / "a", prefix="move", WORK_US="0")
    produce_clicks(brokers, env_a["CLICKS_TOPIC"], records, seed=seed)
    env_b = elsewhere(env_a, tmp_path / "b")
    total = str(PIPELINES / "running_total_work.py")
    shared = tmp_path / "shared" / "savepoint"  # a path both runners reach (S3 in production)
    with (tmp_path / "a.err").open("w") as err:
        # about 40 s of input: the savepoint must stop it before it read everything (with
        # 10 s, CI under load read it all before the savepoint command stopped it)
        first = subprocess.Popen(
            eosflow("run", total, "--workers", "2", "--checkpoint-interval", "500ms",
                    "--max-rate", "50", "--until-idle"),
            env=env_a, stdout=subprocess.PIPE, stderr=err, text=True,
        )  # fmt: skip
    try:
        wait_status(env_a, lambda st: st["checkpoint"]["last_completed"] >= 2, timeout=120)
        saved = subprocess.run(
            eosflow("savepoint", env_a["JOB_NAME"], "--stop", "--path", str(shared)),
            env=env_a, capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        assert saved.returncode == 0, saved.stdout + saved.stderr[-3000:]
        path = saved.stdout.strip().splitlines()[-1]
        first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, (tmp_path / "a.err").read_text()[-3000:]
    moved = subprocess.run(
        eosflow("run", total, "--workers", "2", "--checkpoint-interval", "500ms",
                "--until-idle", "--from-savepoint", path),
        env=env_b, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert moved.returncode == 0, moved.stderr[-3000:]
    before, after = committed_output(env_a), committed_output(env_b)
    assert sum(before.values()) < records, "the first runner read everything: nothing moved"
    assert_exactly_once(expected(expected_running_totals, records, seed), before + after, seed=seed)


def test_mode_none_takes_no_checkpoint_but_the_final_one(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    """``--mode none`` (for comparisons: "no checkpoints except the final one") checkpointed
    back to back from issue 48 on: the coordinator got an interval of 0.0 instead of none.
    Found by issue 51's tests: a runner in that mode had 53 checkpoints in a few seconds."""
    records = 2_000
    env = job_env(kafka_endpoint[0], tmp_path, prefix="none", WORK_US="0")
    produce_clicks(kafka_endpoint[0], env["CLICKS_TOPIC"], records)
    done = _run(env, "--mode", "none", "--max-rate", "1000")  # 1 s of input per worker
    assert done.returncode == 0, done.stderr[-3000:]
    checkpoint = wait_status(env, lambda st: st["state"] == "finished")["checkpoint"]
    assert checkpoint["completed"] == 1, checkpoint
    assert committed_output(env) == _expected(records)
