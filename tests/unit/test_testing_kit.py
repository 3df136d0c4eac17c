"""The test kit's parts that need no server: the servers mode, names, log tails, the plugin's
option (run as a user's pytest would, in a directory of its own)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from processor.errors import ConfigError, ServerNotFoundError
from processor.testing import SessionServers, logs_tail, unique_name
from processor.testing.servers import NO_DOCKER, selected_mode

JOB_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,62}\Z")  # processor.dataflow's rule


def test_the_option_wins_over_the_environment_when_both_choose_servers() -> None:
    assert selected_mode("embedded", {"EOSFLOW_TESTCONTAINERS": "1"}) == "embedded"
    assert selected_mode(None, {"EOSFLOW_TESTCONTAINERS": "1"}) == "containers"
    assert selected_mode(None, {"EOSFLOW_TESTCONTAINERS": "0"}) == "auto"
    assert selected_mode(None, {}) == "auto"


def test_an_unknown_mode_is_refused_with_the_choices_when_given() -> None:
    with pytest.raises(ConfigError, match="choose one of auto, embedded, env, containers"):
        SessionServers("docker")


def test_env_mode_gives_the_variables_servers_and_starts_nothing_when_they_are_set() -> None:
    environ = {"EOSFLOW_KAFKA_BROKERS": "kafka.example:9092", "EOSFLOW_REDIS_URL": "redis://r/0"}
    with SessionServers("env", environ) as found:
        assert found.as_env() == {}  # nothing resolved before it is asked for
        assert found.url("kafka") == "kafka.example:9092"
        assert found.origin("kafka") == "env"
        assert found.as_env() == {"EOSFLOW_KAFKA_BROKERS": "kafka.example:9092"}


def test_env_mode_fails_naming_the_variable_when_it_is_not_set() -> None:
    with (
        SessionServers("env", {"EOSFLOW_KAFKA_BROKERS": "k:9092"}) as found,
        pytest.raises(ConfigError, match="EOSFLOW_POSTGRES_DSN is not set"),
    ):
        found.url("postgres")


def test_an_unknown_service_is_refused_when_asked_for() -> None:
    with SessionServers("env", {}) as found, pytest.raises(ConfigError, match="unknown service"):
        found.url("zookeeper")


# Where no Docker engine answers, whether or not one runs on this machine (CI starts one for the
# container tests: these two then reached it and tried to pull testcontainers' reaper image).
_NO_ENGINE = "unix:///nonexistent/eosflow-no-docker.sock"


def test_containers_mode_says_there_is_no_docker_engine_when_none_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DOCKER_HOST", _NO_ENGINE)
    with SessionServers("containers", {}) as found, pytest.raises(ServerNotFoundError) as err:
        found.url("kafka")
    assert str(err.value) == NO_DOCKER


def test_unique_names_are_valid_job_and_topic_names_when_the_hint_is_anything() -> None:
    hints = ["", "test_x[Param-1]", "É" * 10, "a" * 300, "---", "UPPER case/slash"]
    names = [unique_name(h, prefix="job") for h in hints for _ in range(3)]
    assert all(JOB_NAME.match(n) for n in names), names
    assert len(set(names)) == len(names)
    assert unique_name("test_totals[2]").startswith("t-test-totals-2-")
    assert len(unique_name("x" * 300, limit=120)) == 120


def test_logs_tail_shows_the_end_of_every_worker_log_when_there_are_some(tmp_path: Path) -> None:
    job = tmp_path / "jobs" / "job-a"
    job.mkdir(parents=True)
    (job / "worker-0.log").write_text("".join(f"line {i}\n" for i in range(100)))
    (job / "worker-1.log").write_text("ValueError: boom\n")
    (job / "status.json").write_text("{}")
    tail = logs_tail(tmp_path, lines=3)
    assert f"--- {job / 'worker-0.log'} (last 3 lines) ---\nline 97\nline 98\nline 99" in tail
    assert "ValueError: boom" in tail
    assert "line 96" not in tail and "status" not in tail
    assert logs_tail(tmp_path / "nothing") == ""


def _pytest(
    directory: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m pytest`` in ``directory`` (no repository conftest), the plugin loaded as the
    repository's conftest loads it (by its entry point, else by name)."""
    (directory / "conftest.py").write_text(
        "import sys\n"
        "pytest_plugins = [] if 'processor.testing.plugin' in sys.modules "
        "else ['processor.testing.plugin']\n"
    )
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", *args],
        cwd=directory,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_the_servers_option_refuses_an_unknown_mode_when_pytest_starts(tmp_path: Path) -> None:
    (tmp_path / "test_x.py").write_text("def test_x():\n    pass\n")
    run = _pytest(tmp_path, "--eosflow-servers=docker")
    assert run.returncode == 4, run.stdout + run.stderr
    assert "invalid choice: 'docker'" in run.stderr


def test_a_session_starts_no_server_when_its_tests_ask_for_none(tmp_path: Path) -> None:
    (tmp_path / "test_lazy.py").write_text(
        "def test_nothing_resolved(eosflow_servers):\n"
        "    assert eosflow_servers.mode == 'env'\n"
        "    assert eosflow_servers.as_env() == {}\n"
    )
    run = _pytest(tmp_path, "--eosflow-servers=env")
    assert run.returncode == 0, run.stdout + run.stderr


def test_containers_mode_skips_with_the_reason_when_no_docker_engine_answers(
    tmp_path: Path,
) -> None:
    (tmp_path / "test_servers.py").write_text(
        "def test_kafka(eosflow_kafka):\n    pass\n"
        "def test_redis(eosflow_redis):\n    pass\n"
        "def test_postgres(eosflow_postgres):\n    pass\n"
        "def test_no_server():\n    pass\n"
    )
    run = _pytest(tmp_path, "--eosflow-servers=containers", env={"DOCKER_HOST": _NO_ENGINE})
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed, 3 skipped" in run.stdout, run.stdout
    assert "kafka unavailable (--eosflow-servers=containers): no Docker engine answers" in (
        run.stdout
    )
