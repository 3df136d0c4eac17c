"""A user's own pipeline test, written in a fresh directory outside the repository with only the
pytest plugin's fixtures and :mod:`processor.testing`, run by ``python -m pytest`` there.

Two environments: the one running this suite (the plugin must come from the package's
``pytest11`` entry point, as for a user), and (``slow``) a new virtualenv where the package is
``pip install``-ed from the repository path, not editable.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from importlib.metadata import entry_points
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = "processor.testing.plugin"

USER_PIPELINE = """\
import os

from connectors import JsonSerde
from processor import Dataflow
from sinks import FileSink

flow = Dataflow(os.environ.get("JOB_NAME", "order-totals"))
(
    flow.source("orders", os.environ.get("ORDERS_TOPIC", "orders"), serde=JsonSerde())
    .key_by("by-customer", lambda order: order["customer"])
    .aggregate("spent", init=lambda: 0, add=lambda total, order: total + order["amount"])
    .sink("out", FileSink(os.environ.get("OUTPUT_DIR", "out/order-totals")))
)
"""

USER_TEST = """\
from collections import defaultdict
from pathlib import Path

from processor.testing import assert_exactly_once, produce
from sinks import read_jsonl

PIPELINE = Path(__file__).parent / "order_totals.py"


def orders(n):
    return [{"order": i, "customer": f"c{i % 7}", "amount": i % 13} for i in range(n)]


def expected_totals(orders):
    totals = defaultdict(int)
    for order in orders:
        totals[order["customer"]] += order["amount"]
        yield [order["customer"], totals[order["customer"]]]


def test_order_totals_are_committed_exactly_once(
    eosflow_kafka, eosflow_topic, eosflow_job, tmp_path
):
    topic = eosflow_topic(partitions=3)
    data = orders(500)
    produce(eosflow_kafka, topic, data, key=lambda order: order["customer"])
    eosflow_job.env.update(ORDERS_TOPIC=topic, OUTPUT_DIR=str(tmp_path / "out"))

    result = eosflow_job.run(PIPELINE, workers=2)

    assert result.records_in == 500
    assert_exactly_once(read_jsonl(tmp_path / "out"), list(expected_totals(data)))
"""

USER_PYPROJECT = """\
[tool.pytest.ini_options]
addopts = "-ra"
"""


def _user_project(directory: Path) -> Path:
    """A user's project: the pipeline, its test, a pytest configuration; nothing else."""
    assert not directory.resolve().is_relative_to(ROOT), "the user's project must be outside"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "order_totals.py").write_text(USER_PIPELINE)
    (directory / "test_order_totals.py").write_text(USER_TEST)
    (directory / "pyproject.toml").write_text(USER_PYPROJECT)
    return directory


def _run_user_tests(python: str, directory: Path, env: dict[str, str]) -> str:
    """``python -m pytest`` in ``directory``; fails the test with its output unless it passed."""
    env = {k: v for k, v in env.items() if k != "PYTEST_ADDOPTS"}
    run = subprocess.run(
        [python, "-m", "pytest", "-v", str(directory)],
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = run.stdout + run.stderr
    if run.returncode != 0:
        pytest.fail(f"the user's tests failed (exit status {run.returncode}):\n{output}")
    assert "test_order_totals_are_committed_exactly_once PASSED" in output, output
    return output


def test_a_users_pipeline_test_passes_in_a_fresh_directory_with_the_installed_plugin(
    tmp_path: Path,
) -> None:
    registered = [ep for ep in entry_points(group="pytest11") if ep.value == PLUGIN]
    if not registered:
        pytest.fail(
            f"the eosflow pytest plugin is not registered in this environment ({sys.prefix}): "
            f"no pytest11 entry point names {PLUGIN!r}, so a user's pytest would not find the "
            "eosflow_* fixtures. The installed metadata predates the entry point in "
            "pyproject.toml: reinstall the package (pip install -e '.[dev]')"
        )
    output = _run_user_tests(sys.executable, _user_project(tmp_path / "user"), dict(os.environ))
    plugins = next(line for line in output.splitlines() if line.startswith("plugins:"))
    assert "eosflow-" in plugins, plugins  # loaded through the entry point, as for a user


@pytest.mark.slow
def test_a_users_pipeline_test_passes_in_a_new_virtualenv_with_the_package_pip_installed(
    tmp_path: Path,
) -> None:
    """The package as a user gets it: built from the repository path and installed (not
    editable) with its ``testing`` extra into a new virtualenv, then the user's tests run with
    that interpreter, in a directory outside the repository, without this suite's PYTHONPATH."""
    home = tmp_path / "venv"
    venv.create(home, with_pip=True)
    python = str(home / "bin" / "python")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PIP_REQUIRE_VIRTUALENV")
    }
    install = subprocess.run(
        [python, "-m", "pip", "install", "--quiet", f"{ROOT}[testing]"],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    where = subprocess.run(
        [python, "-c", "import processor; print(processor.__file__)"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert where.startswith(str(home)), f"processor imported from {where}, not the virtualenv"
    _run_user_tests(python, _user_project(tmp_path / "user"), env)
