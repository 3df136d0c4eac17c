"""What a run pays before its first record (bench/RESULTS.md, "Start-up and shut-down"): the
runner's start-up checks share one admin client per cluster, and no process imports redis-py
unless something uses Redis."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import connectors.admin as admin
import sinks
from connectors.admin import (
    TopicAdmin,
    admin_client,
    quiet_admin_client,
    sharing_admin_clients,
)
from connectors.config import KafkaSettings

ROOT = Path(__file__).resolve().parents[2]


class FakeAdminClient:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config


@pytest.fixture
def created(monkeypatch: pytest.MonkeyPatch) -> list[FakeAdminClient]:
    """Every admin client made (none connects: no network in unit tests)."""
    made: list[FakeAdminClient] = []

    def create(config: dict[str, Any]) -> FakeAdminClient:
        made.append(FakeAdminClient(dict(config)))
        return made[-1]

    monkeypatch.setattr(admin, "create_admin", create)
    return made


def test_admin_clients_of_one_cluster_are_one_when_shared(
    created: list[FakeAdminClient],
) -> None:
    settings = KafkaSettings.from_env(brokers="127.0.0.1:1")
    other = KafkaSettings.from_env(brokers="127.0.0.1:2")
    with sharing_admin_clients():
        first = TopicAdmin(settings)
        with quiet_admin_client(settings) as quiet:
            pass
        clients = {id(first._admin), id(admin_client(settings)), id(quiet)}
        assert len(clients) == 1
        assert admin_client(other) is not first._admin
        assert TopicAdmin(settings, shared=False)._admin is not first._admin
    assert len(created) == 3
    assert admin_client(settings) is not first._admin  # the block ended: a new client each time
    assert TopicAdmin(settings)._admin is not first._admin


def test_shared_client_is_quiet_only_while_a_reachability_check_waits(
    created: list[FakeAdminClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    logged: list[tuple[Any, ...]] = []
    monkeypatch.setattr(admin.OUTAGES, "log", lambda *args: logged.append(args))
    settings = KafkaSettings.from_env(brokers="127.0.0.1:1")
    with sharing_admin_clients():
        with quiet_admin_client(settings):
            created[0].config["logger"].log(3, "%s", "connection refused")
        assert logged == []
        created[0].config["logger"].log(3, "%s", "connection refused")
    assert logged == [(3, "%s", "connection refused")]


def test_shared_client_is_dropped_when_the_reachability_check_fails(
    created: list[FakeAdminClient],
) -> None:
    """A client that could not reach the broker is not handed to the next check."""
    settings = KafkaSettings.from_env(brokers="127.0.0.1:1")
    with sharing_admin_clients():
        with pytest.raises(RuntimeError), quiet_admin_client(settings):
            raise RuntimeError("no broker")
        assert admin_client(settings) is not created[0]
    assert len(created) == 2


def test_every_public_name_of_sinks_resolves_when_imported_on_first_use() -> None:
    for name in sinks.__all__:
        assert getattr(sinks, name).__name__ == name
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = sinks.Nope  # type: ignore[attr-defined]


def test_redis_is_not_imported_when_nothing_uses_redis() -> None:
    """Regression: ``dedup`` and ``sinks`` imported redis-py in every worker and runner, about
    30 ms of each process's start-up, for jobs without Redis."""
    code = (
        "import sys\n"
        "import processor.runtime.supervision.worker, processor.runtime.supervision.local, dedup\n"
        "from sinks import ConsoleSink, FileSink, KafkaSink\n"
        "assert 'redis' not in sys.modules, 'redis imported'\n"
        "from sinks import RedisSink\n"
        "assert 'redis' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
