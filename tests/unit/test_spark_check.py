"""The Spark runner's first-task check without Spark: what :func:`probe` finds in this Python,
and the one-line fixes built from its results (tests/e2e/test_spark_executors.py runs it on
Spark's executors)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from processor.compiler import compile_flow
from processor.errors import ConfigError
from processor.runtime.job import RunOptions
from processor.runtime.pipeline import load_flow
from processor.runtime.supervision.spark_check import failure_message, probe, results_message

PIPELINE = Path(__file__).resolve().parents[1] / "e2e" / "pipelines" / "running_total_work.py"
VERSION = "{}.{}".format(*sys.version_info[:2])
PIPELINE_ENV = {"JOB_NAME": "check-unit", "CLICKS_TOPIC": "clicks", "OUTPUT_DIR": "/tmp/x"}


def _payload(**changes: Any) -> dict[str, Any]:
    payload = {
        "version": VERSION,
        "environ": {},
        "pipeline": str(PIPELINE),
        "workers": 2,
        "recovery": "global",
        "key_groups": None,
        "epoch": 0,
    }
    payload.update(changes)
    return payload


def _result(**changes: Any) -> dict[str, Any]:
    result = {
        "host": "exec-1",
        "python": "/usr/bin/python3",
        "version": VERSION,
        "stage": "ok",
        "error": "",
        "missing": None,
        "fingerprint": "abc",
    }
    result.update(changes)
    return result


def _message(results: list[dict[str, Any]], **env: str) -> str | None:
    return results_message(results, version=VERSION, fingerprint="abc", driver_environ=env)


def test_probe_finds_the_variable_a_pipeline_misses_when_it_is_not_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in PIPELINE_ENV:
        monkeypatch.delenv(name, raising=False)
    (found,) = probe(_payload(), iter([]))
    assert found["stage"] == "pipeline" and found["missing"] == "JOB_NAME", found
    assert "KeyError: 'JOB_NAME'" in found["error"]


def test_probe_loads_the_pipeline_into_the_drivers_plan_with_the_jobs_environ(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in PIPELINE_ENV.items():
        monkeypatch.setenv(name, value)  # undone after the test, as the probe's update is
    want = compile_flow(load_flow(PIPELINE), 2).fingerprint()
    (found,) = probe(_payload(environ=dict(PIPELINE_ENV)), iter([]))
    assert found["stage"] == "ok" and found["fingerprint"] == want, found
    assert found["version"] == VERSION and found["python"] == sys.executable


#: A pipeline that reads its variables with defaults, as the examples do: an executor without
#: them compiles another plan instead of failing to load.
DEFAULTS_PIPELINE = """
import os
from processor.dataflow import Dataflow
from sinks import FileSink

flow = Dataflow(os.environ.get("JOB_NAME", "defaults"))
topic = os.getenv("CLICKS_TOPIC") or "clicks"
parts = int(os.environ["PARTS"]) if "PARTS" in os.environ else 1
flow.source("in", topic).key_by("k", lambda r: r).sink("out", FileSink(os.environ.get("OUT", "o")))
"""


def _defaults_pipeline(tmp_path: Path) -> str:
    path = tmp_path / "defaults.py"
    path.write_text(DEFAULTS_PIPELINE)
    return str(path)


def test_probe_records_the_variables_the_pipeline_reads_by_digest(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in ("JOB_NAME", "CLICKS_TOPIC", "PARTS", "OUT"):
        monkeypatch.delenv(name, raising=False)
    payload = _payload(pipeline=_defaults_pipeline(tmp_path), environ={"JOB_NAME": "secret-x"})
    (found,) = probe(payload, iter([]))
    assert found["stage"] == "ok", found
    read = found["read"]  # environ[...], environ.get, getenv and `in`
    assert {"JOB_NAME", "CLICKS_TOPIC", "PARTS", "OUT"} <= set(read), read
    assert read["CLICKS_TOPIC"] is None and read["JOB_NAME"] is not None, read
    assert "secret-x" not in json.dumps(read)  # digests, not values
    assert type(os.environ).__name__ == "_Environ"  # put back


def test_probe_reports_another_python_version_before_importing_anything() -> None:
    (found,) = probe(_payload(version="2.7"), iter([]))
    assert found["stage"] == "version" and found["version"] == VERSION


def test_probe_runs_in_a_python_without_eosflow_and_reports_it() -> None:
    """The check is pickled by value: an executor without eosflow must get the check's result
    (stage ``import``), not fail unpickling the function by a reference to eosflow."""
    from pyspark import cloudpickle

    import processor.runtime.supervision.spark_check as module

    cloudpickle.register_pickle_by_value(module)
    try:
        data = cloudpickle.dumps(functools.partial(probe, _payload()))
    finally:
        cloudpickle.unregister_pickle_by_value(module)
    # A Python where eosflow cannot be imported (PySpark's unpickler can: executors have it).
    script = textwrap.dedent(
        """
        import json, pickle, sys
        class NoEosflow:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("processor", "connectors", "sinks", "dedup"):
                    raise ModuleNotFoundError(f"No module named {name!r}")
        sys.meta_path.insert(0, NoEosflow())
        print(json.dumps(list(pickle.loads(sys.stdin.buffer.read())(iter([])))))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], input=data, capture_output=True, timeout=60
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    (found,) = json.loads(done.stdout)
    assert found["stage"] == "import", found
    assert "No module named 'processor" in found["error"], found


def test_an_executor_without_eosflow_is_told_to_set_pyspark_python_or_ship_a_venv() -> None:
    error = "ModuleNotFoundError: No module named 'processor'"
    message = _message([_result(), _result(stage="import", error=error, fingerprint=None)])
    assert message is not None and "\n" not in message
    assert message.startswith("executor exec-1 (/usr/bin/python3) cannot import eosflow")
    assert error in message
    assert f"set PYSPARK_PYTHON (or --conf spark.pyspark.python=PATH) to a Python {VERSION}" in (
        message
    )
    assert "--archives" in message and "docs/spark.md" in message


def test_another_python_version_on_an_executor_names_both_and_the_fix() -> None:
    message = _message([_result(stage="version", version="3.9", fingerprint=None)])
    assert message is not None
    assert f"runs Python 3.9 but the driver runs Python {VERSION}" in message
    assert "PYSPARK_PYTHON" in message


def test_a_variable_set_on_the_driver_only_is_named_with_env() -> None:
    result = _result(stage="pipeline", error="KeyError: 'CHAOS_IN'", missing="CHAOS_IN")
    message = _message([result], CHAOS_IN="in-topic")
    assert message is not None and message.endswith("forward it with --env CHAOS_IN")
    assert "CHAOS_IN is set on the driver but not on the executors" in message


def test_a_variable_missing_everywhere_is_named_with_a_value_to_give() -> None:
    result = _result(stage="pipeline", error="KeyError: 'CHAOS_IN'", missing="CHAOS_IN")
    message = _message([result])
    assert message is not None and message.endswith("--env CHAOS_IN=VALUE")


def test_another_pipeline_failure_names_env_and_archives() -> None:
    result = _result(stage="pipeline", error="ModuleNotFoundError: No module named 'mylib'")
    message = _message([result])
    assert message is not None and "No module named 'mylib'" in message
    assert "--env NAME" in message and "--archives" in message


def test_another_plan_on_an_executor_is_blamed_on_its_environment() -> None:
    message = _message([_result(fingerprint="other")])
    assert message is not None and "another plan" in message and "--env NAME" in message


def test_another_plan_names_the_variables_that_differ_and_the_env_options(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Regression: the examples read JOB_NAME and OUTPUT_DIR with defaults; on a cluster the
    executors compiled another plan and the fix named no variable."""
    for name in ("JOB_NAME", "CLICKS_TOPIC", "PARTS", "OUT"):
        monkeypatch.delenv(name, raising=False)
    payload = _payload(
        pipeline=_defaults_pipeline(tmp_path), environ={"JOB_NAME": "a", "OUT": "/o"}
    )
    (found,) = probe(payload, iter([]))
    result = _result(fingerprint="other", read=found["read"])
    message = _message([result], JOB_NAME="b", OUT="/o", CLICKS_TOPIC="c")
    assert message is not None and "another plan" in message, message
    assert "reads CLICKS_TOPIC, JOB_NAME," in message, message  # OUT is the same, PARTS unset
    assert "unset there (CLICKS_TOPIC)" in message, message
    assert message.endswith("forward them with --env CLICKS_TOPIC --env JOB_NAME"), message


def test_executors_that_can_run_the_workers_pass() -> None:
    assert _message([_result(), _result(host="exec-2")]) is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "org.apache.spark.api.python.PythonException: [PYTHON_VERSION_MISMATCH] Python in "
            "worker has different version (3, 9) than that in driver 3.11",
            "another Python than the driver's",
        ),
        (
            'java.io.IOException: Cannot run program "/opt/py/bin/python": error=2, No such file',
            "cannot start their Python (/opt/py/bin/python)",
        ),
        (
            "Traceback ...\nModuleNotFoundError: No module named 'pyspark'\n",
            "No module named 'pyspark'",
        ),
        ("org.apache.spark.SparkException: Job aborted\nsomething", "first-task check failed"),
    ],
)
def test_a_check_job_that_failed_in_spark_is_told_the_python_fix(text: str, expected: str) -> None:
    message = failure_message(text, version=VERSION, python="/opt/py/bin/python")
    assert expected in message and "\n" not in message
    assert "PYSPARK_PYTHON" in message and "--archives" in message


def test_env_takes_values_and_forwards_names_from_this_process() -> None:
    env = RunOptions.parse_env(["A=1", "B", "C=x=y", "D="], environ={"B": "from-here"})
    assert env == {"A": "1", "B": "from-here", "C": "x=y", "D": ""}


@pytest.mark.parametrize(
    ("item", "error"),
    [
        ("MISSING", r"--env MISSING: MISSING is not set here.*--env MISSING=VALUE"),
        ("=1", r"expected NAME or NAME=VALUE"),
        ("A B=1", r"expected NAME or NAME=VALUE"),
    ],
)
def test_env_refuses_what_it_cannot_forward(item: str, error: str) -> None:
    assert "MISSING" not in os.environ
    with pytest.raises(ConfigError, match=error):
        RunOptions.parse_env([item], environ={})
