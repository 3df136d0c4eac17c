"""The eosflow pytest plugin: servers, topics and jobs for testing pipelines.

Installing eosflow registers it (entry point ``pytest11``: ``eosflow``); ``-p no:eosflow``
turns it off. Every fixture's name starts with ``eosflow_`` so that none shadows a project's
own:

========================  ========  ===============================================================
fixture                   scope     gives
========================  ========  ===============================================================
``eosflow_servers``       session   the :class:`~processor.testing.servers.SessionServers`
``eosflow_kafka``         session   Kafka bootstrap servers (``host:port``)
``eosflow_redis``         session   a ``redis://`` URL
``eosflow_postgres``      session   a PostgreSQL DSN
``eosflow_topic``         test      ``eosflow_topic(partitions=1, config=None) -> name``: creates
                                    a topic of the test's own
``eosflow_job``           test      a :class:`~processor.testing.run.Job`: unique name, state
                                    under ``tmp_path``, the servers' ``EOSFLOW_*`` variables
``eosflow_spark_cluster`` session   a Spark standalone cluster on loopback
                                    (:class:`~processor.embedded.spark_cluster.SparkCluster`: a
                                    master and 2 worker JVMs of 2 cores, from ``pyspark``); each
                                    test gets it with every worker ALIVE
========================  ========  ===============================================================

Servers start on first use (a session whose tests ask for none starts none) and stop at the end
of the session. ``--eosflow-servers`` chooses where they come from (default ``auto``; see
:mod:`processor.testing.servers`). A server that cannot be had here (no embedded binary, no
Docker engine for ``containers``) skips the tests that need it, with the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from processor.embedded.spark_cluster import SparkCluster
    from processor.testing.run import Job
    from processor.testing.servers import SessionServers

__all__ = [
    "eosflow_job",
    "eosflow_kafka",
    "eosflow_postgres",
    "eosflow_redis",
    "eosflow_servers",
    "eosflow_spark_cluster",
    "eosflow_topic",
    "pytest_addoption",
]

# Kept here rather than imported: the plugin is imported by every pytest run in an environment
# where eosflow is installed, so its import must stay cheap (servers.MODES holds the same).
_MODES = ("auto", "embedded", "env", "containers")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("eosflow", "eosflow test servers")
    group.addoption(
        "--eosflow-servers",
        choices=_MODES,
        default=None,
        help=(
            "where the eosflow_* fixtures' Kafka, Redis and PostgreSQL come from: auto "
            "(default: EOSFLOW_* variables, else an 'eosflow dev up' cluster, else embedded), "
            "embedded, env (EOSFLOW_* variables only) or containers (testcontainers; needs a "
            "Docker engine, else the tests skip). EOSFLOW_TESTCONTAINERS=1 means containers."
        ),
    )


def _test_hint(request: pytest.FixtureRequest) -> str:
    return str(request.node.name)


@pytest.fixture(scope="session")
def eosflow_servers(request: pytest.FixtureRequest) -> Iterator[SessionServers]:
    """The session's servers, resolved on first use (:mod:`processor.testing.servers`)."""
    from processor.testing.servers import SessionServers

    with SessionServers(request.config.getoption("eosflow_servers")) as found:
        yield found


def _url(found: SessionServers, service: str) -> str:
    from processor.errors import ServerNotFoundError

    try:
        return found.url(service)
    except ServerNotFoundError as exc:
        pytest.skip(f"{service} unavailable (--eosflow-servers={found.mode}): {exc}")


@pytest.fixture(scope="session")
def eosflow_kafka(eosflow_servers: SessionServers) -> str:
    """Bootstrap servers of the session's Kafka-protocol broker."""
    return _url(eosflow_servers, "kafka")


@pytest.fixture(scope="session")
def eosflow_redis(eosflow_servers: SessionServers) -> str:
    """A ``redis://`` URL of the session's Redis."""
    return _url(eosflow_servers, "redis")


@pytest.fixture(scope="session")
def eosflow_postgres(eosflow_servers: SessionServers) -> str:
    """A DSN of the session's PostgreSQL (``max_prepared_transactions`` above zero)."""
    return _url(eosflow_servers, "postgres")


@pytest.fixture
def eosflow_topic(eosflow_kafka: str, request: pytest.FixtureRequest) -> Callable[..., str]:
    """A factory: ``eosflow_topic(partitions=1, config=None, hint=<test name>)`` creates a topic
    named after the test plus a random suffix and returns its name. Tests share the broker,
    never a topic."""
    from processor.testing.topics import create_topic, unique_name

    def make(
        partitions: int = 1, config: Mapping[str, str] | None = None, hint: str | None = None
    ) -> str:
        name = unique_name(hint if hint is not None else _test_hint(request), limit=120)
        return create_topic(eosflow_kafka, name, partitions, config=config)

    return make


@pytest.fixture
def eosflow_job(
    eosflow_kafka: str,
    eosflow_servers: SessionServers,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> Job:
    """A :class:`~processor.testing.run.Job` of this test: a unique name (``env["JOB_NAME"]``),
    a state directory of its own, and the ``EOSFLOW_*`` variables of the session's servers
    resolved so far (the broker always; Redis and PostgreSQL when the test asks for
    ``eosflow_redis`` / ``eosflow_postgres``: session fixtures are set up first)."""
    from processor.testing.run import new_job

    return new_job(tmp_path, eosflow_servers.as_env(), _test_hint(request))


@pytest.fixture(scope="session")
def _eosflow_spark_cluster() -> Iterator[SparkCluster]:
    from processor.embedded.spark_cluster import start_spark_cluster
    from processor.errors import ServerNotFoundError

    try:
        cluster = start_spark_cluster(2, cores=2)
    except ServerNotFoundError as exc:
        pytest.skip(f"no Spark cluster here: {exc}")
    with cluster:
        yield cluster


@pytest.fixture
def eosflow_spark_cluster(_eosflow_spark_cluster: SparkCluster) -> SparkCluster:
    """The session's Spark standalone cluster on 127.0.0.1, every worker ALIVE (a worker a
    test SIGKILLed is started again). Run the Spark runner on it with
    ``SparkOptions(master=cluster.master_url, control_host="127.0.0.1",
    conf={"spark.pyspark.python": sys.executable})`` and ``SPARK_LOCAL_IP=127.0.0.1``."""
    from processor.embedded._process import is_running

    cluster = _eosflow_spark_cluster
    for worker in cluster.workers:
        if not is_running(worker.process):
            cluster.restart_worker(worker.index)
    cluster.wait_alive(len(cluster.workers))
    return cluster
