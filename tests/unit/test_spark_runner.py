"""The Spark runner's configuration checks and failure parsing (no Spark started here; the
crash tests in tests/e2e/test_spark.py run it for real)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from processor.errors import ConfigError
from processor.runtime.supervision.local import LocalRunner, RunOptions
from processor.runtime.supervision.runner import WorkerHandle
from processor.runtime.supervision.spark import SparkOptions, SparkRunner, local_slots, spark_cause

PIPELINE = Path(__file__).resolve().parents[1] / "e2e" / "pipelines" / "running_total_work.py"


def _options(tmp: Path, workers: int = 2) -> RunOptions:
    run_id = uuid.uuid4().hex[:8]
    environ = {
        "JOB_NAME": f"spark-unit-{run_id}",
        "CLICKS_TOPIC": f"clicks-{run_id}",
        "OUTPUT_DIR": str(tmp / "out"),
    }
    return RunOptions(workers=workers, environ=environ, state_dir=str(tmp / "state"))


@pytest.mark.parametrize(
    ("master", "slots"),
    [("local", 1), ("local[4]", 4), ("local[3, 2]", 3), ("spark://h:7077", None), ("yarn", None)],
)
def test_local_slots(master: str, slots: int | None) -> None:
    assert local_slots(master) == slots


def test_local_star_has_one_slot_per_core() -> None:
    assert (local_slots("local[*]") or 0) >= 1


def test_a_local_master_with_fewer_slots_than_workers_is_refused_at_start(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"local\[1\] has 1 task slot.*use --master local\[2\]"):
        SparkRunner(PIPELINE, _options(tmp_path), SparkOptions(master="local[1]"))


@pytest.mark.parametrize("key", ["spark.speculation", "spark.python.worker.reuse"])
def test_settings_that_would_break_exactly_once_are_refused(tmp_path: Path, key: str) -> None:
    spark = SparkOptions(conf={key: "true"})
    with pytest.raises(ConfigError, match=f"needs {key}=false"):
        SparkRunner(PIPELINE, _options(tmp_path), spark)


def test_local_recovery_is_refused_on_spark_with_the_alternatives(tmp_path: Path) -> None:
    options = _options(tmp_path)
    options.recovery = "local"
    with pytest.raises(ConfigError, match="use --recovery global with --runner spark"):
        SparkRunner(PIPELINE, options)


def test_default_master_is_local_with_one_slot_per_worker(tmp_path: Path) -> None:
    runner = SparkRunner(PIPELINE, _options(tmp_path, workers=3))
    assert runner.spark.master == "local[3]" and runner.spark.local_master


def test_conf_items_parse_and_bad_ones_say_the_form() -> None:
    conf = SparkOptions.parse_conf(["spark.archives=env.tar.gz#environment", "a.b = c"])
    assert conf == {"spark.archives": "env.tar.gz#environment", "a.b": "c"}
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        SparkOptions.parse_conf(["spark.executor.cores"])


KILLED = """An error occurred while calling z:org.apache.spark.api.python.PythonRDD.collectAndServe.
: org.apache.spark.SparkException: Job aborted due to stage failure: Could not recover from a \
failed barrier ResultStage. Most recent failure reason: Stage failed because barrier task \
ResultTask(3, 1) finished unsuccessfully.
org.apache.spark.SparkException: Python worker exited unexpectedly (crashed)."""

RAISED = """Job aborted due to stage failure: ... barrier task ResultTask(0, 0) finished \
unsuccessfully.
org.apache.spark.api.python.PythonException: Traceback (most recent call last):
  File "worker.py", line 10, in run
processor.errors.ConfigError: pipeline file 'x.py' does not exist
"""


def test_spark_failures_become_one_line_causes_naming_the_worker() -> None:
    assert spark_cause(KILLED) == "worker 1: its Python process died (killed or crashed)"
    assert spark_cause(RAISED) == (
        "worker 0 failed: processor.errors.ConfigError: pipeline file 'x.py' does not exist"
    )
    assert spark_cause("ExecutorLostFailure (executor 2 exited)").endswith("executor was lost")
    assert spark_cause("something else\nmore").startswith("a worker task: Spark job failed: ")


class _Conn:
    def __init__(self) -> None:
        self.peer, self.closed, self.worker, self.sent = "127.0.0.1:1", False, None, []

    def send(self, msg: dict[str, Any]) -> bool:
        self.sent.append(msg)
        return True

    def close(self) -> None:
        self.closed = True


def test_a_worker_without_the_jobs_token_is_not_heard(tmp_path: Path) -> None:
    """The control port may be reachable from other hosts (Spark clusters): a hello must carry
    the per-run token the runner put in the workers' specs."""
    runner = LocalRunner(PIPELINE, _options(tmp_path))
    runner.generation = 1
    runner.workers = [WorkerHandle(0)]
    intruder = _Conn()
    hello = {"t": "hello", "worker": 0, "generation": 1, "pid": 1, "host": "x"}
    runner._handle(intruder, {**hello, "token": "guess"})  # type: ignore[arg-type]
    assert intruder.closed and runner.workers[0].conn is None
    ours = _Conn()
    runner._handle(ours, {**hello, "token": runner.token})  # type: ignore[arg-type]
    assert runner.workers[0].conn is ours and runner.workers[0].pid == 1
