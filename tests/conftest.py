"""Fixtures shared by every tier.

Servers come from the test kit's pytest plugin (:mod:`processor.testing.plugin`): each service
is resolved once per session, lazily (a unit-only run starts nothing), as
``--eosflow-servers`` says (default ``auto``: ``EOSFLOW_KAFKA_BROKERS`` / ``EOSFLOW_REDIS_URL`` /
``EOSFLOW_POSTGRES_DSN`` if set, else a running ``eosflow dev up`` cluster, else an embedded
server owned by the test process, killed with it). ``--eosflow-servers=containers`` (or
``EOSFLOW_TESTCONTAINERS=1``) takes them from testcontainers, and skips without a Docker engine.
The fixtures below are the suite's names for the plugin's.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from processor.testing import SessionServers, unique_name

# The plugin is registered by the package's pytest11 entry point, which pytest loads before this
# file. An install whose metadata predates the entry point (an editable install not redone since)
# has not loaded it: load it here. Listing it when it is loaded already would fail ("Plugin
# already registered under a different name").
pytest_plugins = [] if "processor.testing.plugin" in sys.modules else ["processor.testing.plugin"]

ROOT = Path(__file__).resolve().parent.parent
NO_JAVA = "Spark needs a Java runtime: install OpenJDK 17 (apt-get install openjdk-17-jre-headless)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tier markers follow the folder: tests/integration -> integration, tests/e2e -> chaos."""
    no_java = None if java_available() else pytest.mark.skip(reason=NO_JAVA)
    for item in items:
        parts = Path(str(item.fspath)).parts
        if "integration" in parts:
            item.add_marker(pytest.mark.integration)
        if no_java is not None and item.get_closest_marker("spark") is not None:
            item.add_marker(no_java)


def java_available() -> bool:
    home = os.environ.get("JAVA_HOME")
    return shutil.which("java") is not None or bool(home and Path(home, "bin", "java").exists())


@pytest.fixture(scope="session")
def kafka_endpoint(eosflow_servers: SessionServers, eosflow_kafka: str) -> tuple[str, str]:
    """``(bootstrap servers, origin)`` of the session's Kafka-protocol broker."""
    return eosflow_kafka, eosflow_servers.origin("kafka")


@pytest.fixture(scope="session")
def kafka_settings(kafka_endpoint: tuple[str, str]):  # type: ignore[no-untyped-def]
    from connectors import KafkaSettings

    return KafkaSettings.from_env(brokers=kafka_endpoint[0])


@pytest.fixture(scope="session")
def broker_caps(kafka_settings):  # type: ignore[no-untyped-def]
    """What the session's broker can do (probed once)."""
    from connectors import probe_broker

    return probe_broker(kafka_settings)


@pytest.fixture(scope="session")
def redis_url(eosflow_redis: str) -> str:
    return eosflow_redis


@pytest.fixture(scope="session")
def postgres_dsn(eosflow_postgres: str) -> str:
    return eosflow_postgres


@pytest.fixture
def topic_name(request: pytest.FixtureRequest) -> str:
    """A topic name unique to this test (tests share brokers, never topics)."""
    return unique_name(request.node.name, limit=100)
