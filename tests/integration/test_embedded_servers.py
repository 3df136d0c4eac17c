"""The embedded servers and the `eosflow dev` commands, end to end with real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest
import redis

from processor.embedded import DevCluster
from processor.embedded._process import is_running
from processor.errors import ServerNotFoundError


def _pids_alive(pids: list[int], seconds: float = 5.0) -> list[int]:
    deadline = time.monotonic() + seconds
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [
            p
            for p in alive
            if Path(f"/proc/{p}").exists()
            and "Z" not in Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
        ]
        time.sleep(0.05)
    return alive


def _group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                pids.append(int(entry.name))
    return pids


def test_each_embedded_server_answers_its_protocol_and_stops_without_leftovers_when_started() -> (
    None
):
    try:
        cluster = DevCluster.start(["kafka", "redis", "postgres"], owned=True)
    except ServerNotFoundError as exc:
        pytest.skip(str(exc))
    try:
        pids = {kind: s.process.pid for kind, s in cluster.servers.items()}
        assert redis.Redis.from_url(cluster.servers["redis"].url).ping()
        with psycopg.connect(cluster.servers["postgres"].url) as conn:
            assert int(conn.execute("show max_prepared_transactions").fetchone()[0]) > 0
            assert conn.execute("show listen_addresses").fetchone()[0] == "127.0.0.1"
        from confluent_kafka.admin import AdminClient

        metadata = AdminClient({"bootstrap.servers": cluster.servers["kafka"].url}).list_topics(
            timeout=10
        )
        assert metadata.brokers
        workdirs = [s.workdir for s in cluster.servers.values()]
        # Every process of each server's group (postgres backends too) must be gone after stop.
        group = [p for pid in pids.values() for p in _group_pids(pid)]
        assert set(pids.values()) <= set(group)
    finally:
        cluster.stop()
    assert _pids_alive(group) == []
    assert not any(Path(w).exists() for w in workdirs)


def test_dev_commands_start_report_and_stop_servers_when_run_from_the_shell(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EOSFLOW_")}
    env["EOSFLOW_STATE_DIR"] = str(tmp_path)

    def eosflow(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "processor.cli", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    up = eosflow("dev", "up", "--services", "kafka,redis")
    assert up.returncode == 0, up.stderr
    assert "export EOSFLOW_KAFKA_BROKERS=127.0.0.1:" in up.stdout
    cluster = DevCluster.load(tmp_path / "dev.json")
    assert cluster is not None and set(cluster.servers) == {"kafka", "redis"}
    pids = [s.process.pid for s in cluster.servers.values()]
    try:
        again = eosflow("dev", "up", "--services", "kafka,redis")
        assert "already running" in again.stdout
        status = eosflow("dev", "status")
        assert status.returncode == 0 and status.stdout.count("running") == 2
        exports = eosflow("dev", "env").stdout
        assert "EOSFLOW_REDIS_URL=redis://127.0.0.1:" in exports
    finally:
        down = eosflow("dev", "down")
    assert down.returncode == 0 and "all stopped" in down.stdout
    assert _pids_alive(pids) == []
    assert not all(is_running(s.process) for s in cluster.servers.values())
    assert eosflow("dev", "status").returncode == 1


def test_dev_up_starts_fresh_servers_when_its_variables_point_at_dead_ones(tmp_path: Path) -> None:
    """Issue 50: ``eosflow dev down`` then ``dev up`` in a shell that had evaluated ``eosflow
    dev env`` reused the dead servers' variables, started nothing and said "up in 0.00s"; every
    run after it failed with "cannot reach"."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("EOSFLOW_")}
    env["EOSFLOW_STATE_DIR"] = str(tmp_path)
    env["EOSFLOW_REDIS_URL"] = f"redis://127.0.0.1:{dead}/0"

    def eosflow(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "processor.cli", *args],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    up = eosflow("dev", "up", "--services", "redis")
    try:
        assert up.returncode == 0, up.stderr
        assert f"EOSFLOW_REDIS_URL=redis://127.0.0.1:{dead}/0 does not answer" in up.stderr
        assert "starting a new redis" in up.stderr
        cluster = DevCluster.load(tmp_path / "dev.json")
        assert cluster is not None and set(cluster.servers) == {"redis"}
        assert all(is_running(s.process) for s in cluster.servers.values())
        new = [ln for ln in up.stdout.splitlines() if ln.startswith("export EOSFLOW_REDIS_URL=")]
        assert new and f":{dead}/" not in new[0], up.stdout
    finally:
        eosflow("dev", "down")


def test_tansu_starts_on_another_port_when_the_one_it_was_given_is_taken_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A port chosen free can be taken by another process before Tansu binds it (the suite's
    parallel workers start theirs at once): Tansu exited during start-up, and every test of
    that xdist worker errored (CI, once). The start now tries another free port."""
    import importlib
    import socket

    from processor.embedded import _process
    from processor.embedded._process import stop

    servers = importlib.import_module("processor.embedded.servers")

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1]]
    real = _process.free_port

    def first_taken() -> int:
        return ports.pop() if ports else real()

    monkeypatch.setattr(servers, "free_port", first_taken)
    try:
        server = servers.start_tansu(tmp_path, owned=True)
        try:
            assert server.port != taken.getsockname()[1]
            assert not ports  # the taken port was tried first
        finally:
            stop(server.process)
    finally:
        taken.close()
