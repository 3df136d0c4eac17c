"""Fixtures shared by every tier.

Servers: each service is resolved once per session, lazily (a unit-only run starts nothing):
``EOSFLOW_KAFKA_BROKERS`` / ``EOSFLOW_REDIS_URL`` / ``EOSFLOW_POSTGRES_DSN`` if set, else a running
``eosflow dev up`` cluster, else an embedded server owned by the test process (killed with it).
With ``EOSFLOW_TESTCONTAINERS=1`` and a Docker engine, Kafka comes from testcontainers instead.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from processor.embedded import Endpoints, servers
from processor.errors import ServerNotFoundError

ROOT = Path(__file__).resolve().parent.parent
KAFKA_IMAGE = "confluentinc/cp-kafka:7.6.0"  # testcontainers' own default: Apache Kafka 3.6
NO_JAVA = "Spark needs a Java runtime: install OpenJDK 17 (apt-get install openjdk-17-jre-headless)"
NO_DOCKER = "no Docker engine answers 'docker info' (the docker CLI alone is not enough)"


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


def docker_engine_available() -> bool:
    if shutil.which("docker") is None:
        return False
    result = subprocess.run(["docker", "info"], capture_output=True, check=False, timeout=20)
    return result.returncode == 0


@contextlib.contextmanager
def kafka_container() -> Iterator[str]:
    """An Apache Kafka broker in a container (testcontainers); yields its bootstrap servers."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from testcontainers.kafka import KafkaContainer

    with KafkaContainer(KAFKA_IMAGE) as container:
        yield container.get_bootstrap_server()


@contextlib.contextmanager
def _one_service(service: str) -> Iterator[Endpoints]:
    try:
        with servers([service]) as endpoints:
            yield endpoints
    except ServerNotFoundError as exc:
        pytest.skip(f"{service} unavailable: {exc}")


@pytest.fixture(scope="session")
def kafka_endpoint() -> Iterator[tuple[str, str]]:
    """``(bootstrap servers, origin)`` of the session's Kafka-protocol broker."""
    wants_container = os.environ.get("EOSFLOW_TESTCONTAINERS") == "1"
    if wants_container and not os.environ.get("EOSFLOW_KAFKA_BROKERS"):
        if docker_engine_available():
            with kafka_container() as bootstrap:
                yield bootstrap, "testcontainers"
            return
        warnings.warn(
            f"EOSFLOW_TESTCONTAINERS=1 but {NO_DOCKER}: using the embedded broker", stacklevel=1
        )
    with _one_service("kafka") as endpoints:
        assert endpoints.kafka_brokers is not None
        yield endpoints.kafka_brokers, endpoints.origin["kafka"]


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
def redis_url() -> Iterator[str]:
    with _one_service("redis") as endpoints:
        assert endpoints.redis_url is not None
        yield endpoints.redis_url


@pytest.fixture(scope="session")
def postgres_dsn() -> Iterator[str]:
    with _one_service("postgres") as endpoints:
        assert endpoints.postgres_dsn is not None
        yield endpoints.postgres_dsn


@pytest.fixture
def topic_name(request: pytest.FixtureRequest) -> str:
    """A topic name unique to this test (tests share brokers, never topics)."""
    base = re.sub(r"[^a-zA-Z0-9]+", "-", request.node.name).strip("-")[:80]
    return f"t-{base}-{uuid.uuid4().hex[:8]}"
