"""Process management of the embedded servers, with real processes (no servers, no network)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from processor.embedded import DevCluster, Server, find_binary, servers
from processor.embedded._process import ServerProcess, free_port, is_running, spawn, stop
from processor.errors import ConfigError, ServerNotFoundError


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_dead(pid: int, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.02)
    return False


def test_stop_kills_the_whole_process_group_when_the_server_has_children(tmp_path: Path) -> None:
    server = spawn(
        "sh",
        ["/bin/sh", "-c", "sleep 300 & sleep 300 & wait"],
        log_path=tmp_path / "log",
        owned=True,
    )
    time.sleep(0.2)
    children = [
        int(p) for p in Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split()
    ]
    assert len(children) == 2
    stop(server, timeout=2)
    assert not is_running(server)
    assert all(_wait_dead(pid) for pid in children)


def test_owned_server_dies_when_its_parent_is_sigkilled(tmp_path: Path) -> None:
    """PR_SET_PDEATHSIG: a test process killed with SIGKILL must not leave its servers behind."""
    pid_file = tmp_path / "pid"
    script = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        from processor.embedded._process import spawn
        log = Path({str(tmp_path / "log")!r})
        server = spawn("sleep", ["/bin/sleep", "300"], log_path=log, owned=True)
        Path({str(pid_file)!r}).write_text(str(server.pid))
        time.sleep(300)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).parents[2])
    deadline = time.monotonic() + 10
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pid_file.read_text())
    assert _alive(child)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    assert _wait_dead(child), f"server pid {child} outlived its SIGKILLed parent"


def test_is_running_is_false_when_the_pid_runs_another_program(tmp_path: Path) -> None:
    server = spawn("sleep", ["/bin/sleep", "300"], log_path=tmp_path / "log", owned=True)
    try:
        impostor = ServerProcess(
            "redis", server.pid, ["/usr/bin/redis-server"], str(tmp_path / "log")
        )
        assert is_running(server)
        assert not is_running(impostor)
        stop(impostor)  # must not signal a process that is not the recorded server
        assert is_running(server)
    finally:
        stop(server)


def test_free_port_is_bindable_on_loopback_when_returned() -> None:
    import socket

    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_find_binary_names_the_variable_when_the_override_is_not_executable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("EOSFLOW_TANSU_BIN", str(tmp_path / "missing"))
    with pytest.raises(ServerNotFoundError, match="EOSFLOW_TANSU_BIN"):
        find_binary("tansu")


def test_servers_starts_nothing_when_every_service_is_configured_by_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("EOSFLOW_STATE_DIR", str(tmp_path))
    environ = {
        "EOSFLOW_KAFKA_BROKERS": "kafka.example:9092",
        "EOSFLOW_REDIS_URL": "redis://r:6379/0",
    }
    with servers(["kafka", "redis"], environ=environ) as endpoints:
        assert endpoints.kafka_brokers == "kafka.example:9092"
        assert endpoints.redis_url == "redis://r:6379/0"
        assert dict(endpoints.origin) == {"kafka": "env", "redis": "env"}
        assert endpoints.as_env() == environ


def test_unknown_service_is_refused_when_asked_for() -> None:
    with pytest.raises(ConfigError, match="choose from"), servers(["kafak"], environ={}):
        pass


def test_state_file_round_trips_when_saved_and_loaded(tmp_path: Path) -> None:
    proc = ServerProcess("redis", 4242, ["/bin/redis-server", "--port", "1"], "/tmp/log")
    cluster = DevCluster(
        {"redis": Server("redis", "redis://127.0.0.1:1/0", 1, proc, "/tmp/x", 0.1)}
    )
    path = tmp_path / "dev.json"
    cluster.save(path)
    loaded = DevCluster.load(path)
    assert loaded is not None
    assert loaded.servers["redis"].to_dict() == cluster.servers["redis"].to_dict()
    assert json.loads(path.read_text())["servers"]["redis"]["port"] == 1


def test_corrupt_state_file_is_a_config_error_when_loaded(tmp_path: Path) -> None:
    path = tmp_path / "dev.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="delete it"):
        DevCluster.load(path)


def test_dev_cluster_reports_dead_when_the_recorded_pid_is_gone(tmp_path: Path) -> None:
    server = spawn("sleep", ["/bin/sleep", "300"], log_path=tmp_path / "log", owned=True)
    cluster = DevCluster(
        {"redis": Server("redis", "redis://127.0.0.1:1/0", 1, server, str(tmp_path), 0.1)}
    )
    assert cluster.alive() == {"redis": True}
    stop(server)
    loaded_path = tmp_path / "dev.json"
    cluster.save(loaded_path)
    loaded = DevCluster.load(loaded_path)
    assert loaded is not None and loaded.alive() == {"redis": False}


def test_state_file_is_not_read_when_every_service_is_configured_by_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Regression: a corrupt ~/.eosflow/dev.json used to break runs that did not need it."""
    monkeypatch.setenv("EOSFLOW_STATE_DIR", str(tmp_path))
    (tmp_path / "dev.json").write_text("{not json")
    with servers(["redis"], environ={"EOSFLOW_REDIS_URL": "redis://r:6379/0"}) as endpoints:
        assert endpoints.origin["redis"] == "env"
    with pytest.raises(ConfigError, match="delete it"), servers(["redis"], environ={}):
        pass
