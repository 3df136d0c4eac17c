"""Apache Kafka, Redis and PostgreSQL in containers for tests, through testcontainers.

:func:`kafka_container`, :func:`redis_container` and :func:`postgres_container` start a server
in a container, wait until it answers a real client request, yield its address and remove the
container. What they start depends on the Docker engine and the environment:

* Image: ``EOSFLOW_KAFKA_IMAGE``, ``EOSFLOW_REDIS_IMAGE``, ``EOSFLOW_POSTGRES_IMAGE``, else the
  official images users pull (:data:`KAFKA_IMAGE`, :data:`REDIS_IMAGE`, :data:`POSTGRES_IMAGE`).
  An image built elsewhere must speak the official image's interface (environment, command):
  docker/images/ holds such images built from Debian packages (scripts/docker_images.py).
* Network (``EOSFLOW_DOCKER_NETWORK``, else detected): ``bridge`` when the engine has Docker's
  default bridge network — the container's port is published on a random host port, as
  testcontainers does; ``host`` when it has none (``dockerd --bridge=none``) — the container
  shares the host's network and its server listens on ``127.0.0.1`` and a free port only.
* Clean-up: every container is removed when its ``with`` block ends, and by an ``atexit`` hook
  if the block never ended. testcontainers' Ryuk reaper (which also removes the containers of a
  killed test process) is left on when it can run; it is turned off
  (``TESTCONTAINERS_RYUK_DISABLED=true`` does the same) on the host network, where it cannot
  publish its port, or when its image cannot be had. Containers are labelled with their owner
  (host name, PID): a later session removes those whose owner process is gone.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import logging
import os
import shutil
import socket
import subprocess
import tarfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from io import BytesIO
from typing import Any

from processor.admin.jobs import pid_alive
from processor.errors import ConfigError, InfrastructureError

__all__ = [
    "IMAGE_VARIABLES",
    "KAFKA_IMAGE",
    "NETWORK_VARIABLE",
    "NO_DOCKER",
    "OWNER_LABEL",
    "POSTGRES_IMAGE",
    "REDIS_IMAGE",
    "container_image",
    "docker_engine_available",
    "docker_network",
    "kafka_container",
    "postgres_container",
    "redis_container",
    "wait_for_kafka",
]

log = logging.getLogger(__name__)

#: The official Apache Kafka image (KRaft); the version CI runs (scripts/release_check.py).
KAFKA_IMAGE = "apache/kafka:4.3.1"
REDIS_IMAGE = "redis:7"
POSTGRES_IMAGE = "postgres:16"
IMAGE_VARIABLES = {
    "kafka": "EOSFLOW_KAFKA_IMAGE",
    "redis": "EOSFLOW_REDIS_IMAGE",
    "postgres": "EOSFLOW_POSTGRES_IMAGE",
}
_DEFAULT_IMAGES = {"kafka": KAFKA_IMAGE, "redis": REDIS_IMAGE, "postgres": POSTGRES_IMAGE}
NETWORK_VARIABLE = "EOSFLOW_DOCKER_NETWORK"
NETWORKS = ("bridge", "host")
#: Label of every container started here: ``<host name>:<pid>`` of the process that owns it.
OWNER_LABEL = "io.eosflow.testing.owner"
NO_DOCKER = (
    "no Docker engine answers 'docker info' (the docker CLI alone is not enough): start one, "
    "or choose other servers with --eosflow-servers=auto|embedded|env"
)
#: Seconds a server has to answer after its container started.
START_TIMEOUT = 120.0
_PG_USER = _PG_PASSWORD = _PG_DB = "eosflow"
_KAFKA_CLUSTER_ID = "ZW9zZmxvdy1rYWZrYS0wMQ"
_KAFKA_START_SCRIPT = "/tmp/eosflow-kafka-start.sh"


def docker_engine_available() -> bool:
    """Whether a Docker engine answers: ``docker info`` succeeds, or (no CLI) the Docker SDK
    that testcontainers uses reaches the engine (``DOCKER_HOST`` or the default socket)."""
    if shutil.which("docker") is not None:
        try:
            result = subprocess.run(["docker", "info"], capture_output=True, timeout=20)
        except subprocess.TimeoutExpired:
            return False
        return result.returncode == 0
    try:
        docker = _docker()
    except ImportError:
        return False
    try:
        client = docker.from_env(timeout=10)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (docker.errors.DockerException, OSError):  # requests' errors are OSErrors
        return False


def _docker() -> Any:
    # testcontainers' own dependency, imported by name: the repository's docker/ folder would
    # shadow it for mypy
    return importlib.import_module("docker")


def container_image(service: str, environ: Mapping[str, str] | None = None) -> str:
    """The image of ``service`` (``kafka``, ``redis``, ``postgres``): its ``EOSFLOW_*_IMAGE``
    variable, else the official image."""
    env = os.environ if environ is None else environ
    return env.get(IMAGE_VARIABLES[service]) or _DEFAULT_IMAGES[service]


def docker_network(environ: Mapping[str, str] | None = None) -> str:
    """``bridge`` or ``host``: ``EOSFLOW_DOCKER_NETWORK`` if set, else ``bridge`` when the
    engine has a network named ``bridge`` (Docker's default) and ``host`` when it has none.

    Raises:
        ConfigError: ``EOSFLOW_DOCKER_NETWORK`` is neither.
    """
    env = os.environ if environ is None else environ
    chosen = env.get(NETWORK_VARIABLE)
    if chosen:
        if chosen not in NETWORKS:
            raise ConfigError(f"{NETWORK_VARIABLE}={chosen!r}: choose one of {', '.join(NETWORKS)}")
        return chosen
    return _detected_network()


@functools.lru_cache(maxsize=1)
def _detected_network() -> str:
    client = _docker().from_env(timeout=20)
    try:
        has_bridge = bool(client.networks.list(names=["bridge"]))
    finally:
        client.close()
    if not has_bridge:
        log.info("the Docker engine has no bridge network: containers run on the host network")
    return "bridge" if has_bridge else "host"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _testcontainers(module: str, name: str) -> Any:
    """``name`` from ``testcontainers.<module>``, with a fix when testcontainers is missing."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            return getattr(importlib.import_module(f"testcontainers.{module}"), name)
        except ImportError:
            pass
    raise ConfigError(
        "--eosflow-servers=containers needs testcontainers, which is not installed: "
        "pip install 'testcontainers>=4' (or pip install 'eosflow[testing]')"
    )


# -- clean-up -------------------------------------------------------------------------------

_OWNED: dict[str, Any] = {}  # container id -> testcontainers DockerContainer, until removed
_OWNED_LOCK = threading.Lock()


def _owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _remove_orphans(client: Any) -> None:
    """Removes the containers labelled by a process of this host that no longer runs (a test
    session killed before its clean-up ran). The low-level listing: ``containers.list`` fetches
    each container again and fails when another session removes one in between."""
    host = socket.gethostname()
    for listed in client.api.containers(all=True, filters={"label": OWNER_LABEL}):
        owner_host, _, pid = (listed.get("Labels") or {}).get(OWNER_LABEL, "").rpartition(":")
        if owner_host == host and pid.isdigit() and not pid_alive(int(pid)):
            log.info("removing container %s of ended process %s", listed["Id"][:12], pid)
            with contextlib.suppress(_docker().errors.APIError):
                client.api.remove_container(listed["Id"], force=True, v=True)


def _remove_owned() -> None:
    with _OWNED_LOCK:
        leftovers = list(_OWNED.values())
        _OWNED.clear()
    for container in leftovers:
        with contextlib.suppress(Exception):
            container.stop()


atexit.register(_remove_owned)


@functools.cache
def _prepare_engine(network: str) -> None:
    """Once per process and network mode: orphans removed, Ryuk on or off (module docstring)."""
    client = _docker().from_env(timeout=60)
    try:
        _remove_orphans(client)
        config = _testcontainers("core.config", "testcontainers_config")
        if "TESTCONTAINERS_RYUK_DISABLED" in os.environ or config.ryuk_disabled:
            return
        why = None
        if network == "host":
            why = "the containers run on the host network, where Ryuk cannot publish its port"
        elif not _image_present(client, config.ryuk_image):
            why = f"its image {config.ryuk_image} is not on the engine and cannot be pulled"
        if why is not None:
            log.warning("testcontainers' Ryuk reaper off: %s; eosflow removes its containers", why)
            config.ryuk_disabled = True
    finally:
        client.close()


def _image_present(client: Any, image: str) -> bool:
    errors = _docker().errors
    try:
        client.images.get(image)
        return True
    except errors.ImageNotFound:
        pass
    try:
        client.images.pull(image)
        return True
    except errors.APIError as exc:
        log.info("cannot pull %s: %s", image, exc)
        return False


def _logs_tail(container: Any, lines: int = 40) -> str:
    try:
        raw = container.get_wrapped_container().logs(tail=lines)
    except Exception as exc:  # the container may be gone already
        return f"(no logs: {exc})"
    return str(raw.decode(errors="replace")).rstrip()


@contextlib.contextmanager
def _running(
    container: Any,
    what: str,
    ready: Callable[[], bool],
    network: str,
    timeout: float = START_TIMEOUT,
    after_start: Callable[[], None] | None = None,
) -> Iterator[None]:
    """Starts ``container``, waits until ``ready()`` holds, yields, removes the container.

    Raises:
        ConfigError: the image is not on the engine and cannot be pulled.
        InfrastructureError: the container exited, or its server did not answer within
            ``timeout`` seconds (the message ends with the container's log).
    """
    errors = _docker().errors
    _prepare_engine(network)
    try:
        container.start()
    except (errors.ImageNotFound, errors.NotFound) as exc:
        container.stop()
        raise ConfigError(_no_image(container.image, exc)) from exc
    except errors.APIError as exc:
        container.stop()
        if "pull" in str(exc).lower() or "not found" in str(exc).lower():
            raise ConfigError(_no_image(container.image, exc)) from exc
        raise
    cid = container.get_wrapped_container().id
    with _OWNED_LOCK:
        _OWNED[cid] = container
    try:
        if after_start is not None:
            after_start()
        deadline = time.monotonic() + timeout
        while not ready():
            container.get_wrapped_container().reload()
            state = container.get_wrapped_container().status
            if state not in ("created", "running"):
                raise InfrastructureError(
                    f"{what}: container {cid[:12]} ({container.image}) is {state}; its log ends:\n"
                    f"{_logs_tail(container)}"
                )
            if time.monotonic() > deadline:
                raise InfrastructureError(
                    f"{what}: no answer {timeout:g}s after container {cid[:12]} "
                    f"({container.image}) started; its log ends:\n{_logs_tail(container)}"
                )
            time.sleep(0.25)
        log.info(
            "%s ready in container %s (%s, %s network)", what, cid[:12], container.image, network
        )
        yield
    finally:
        with _OWNED_LOCK:
            _OWNED.pop(cid, None)
        container.stop()


def _no_image(image: str, exc: Exception) -> str:
    return (
        f"image {image} is not on the Docker engine and cannot be pulled ({exc}). Pull or build "
        "it, or name another with EOSFLOW_KAFKA_IMAGE / EOSFLOW_REDIS_IMAGE / "
        "EOSFLOW_POSTGRES_IMAGE (docs/containers.md)"
    )


def _container(image: str, network: str, **kwargs: Any) -> Any:
    """A testcontainers ``DockerContainer`` of ``image``, labelled with its owner; on the host
    network when ``network == "host"``."""
    docker_container = _testcontainers("core.container", "DockerContainer")
    options: dict[str, Any] = {"labels": {OWNER_LABEL: _owner()}, **kwargs}
    if network == "host":
        options["network_mode"] = "host"
    return docker_container(image).with_kwargs(**options)


# -- the servers -----------------------------------------------------------------------------


def _kafka_env(
    listeners: str, advertised: str, voters: str, inter_broker: str, protocols: str
) -> dict[str, str]:
    """A one-node KRaft broker + controller in the official image's ``KAFKA_*`` variables."""
    return {
        "CLUSTER_ID": _KAFKA_CLUSTER_ID,
        "KAFKA_NODE_ID": "1",
        "KAFKA_PROCESS_ROLES": "broker,controller",
        "KAFKA_LISTENERS": listeners,
        "KAFKA_ADVERTISED_LISTENERS": advertised,
        "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP": protocols,
        "KAFKA_CONTROLLER_LISTENER_NAMES": "CONTROLLER",
        "KAFKA_CONTROLLER_QUORUM_VOTERS": voters,
        "KAFKA_INTER_BROKER_LISTENER_NAME": inter_broker,
        # One broker: every internal topic with one replica, or transactions never work.
        "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR": "1",
        "KAFKA_OFFSETS_TOPIC_NUM_PARTITIONS": "1",
        "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR": "1",
        "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR": "1",
        "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_REPLICATION_FACTOR": "1",
        "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_MIN_ISR": "1",
        "KAFKA_MIN_INSYNC_REPLICAS": "1",
        "KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS": "0",
        "KAFKA_TRANSACTION_MAX_TIMEOUT_MS": "900000",
        "KAFKA_HEAP_OPTS": "-Xmx512m -Xms256m",
    }


def _kafka_ready(bootstrap: str) -> Callable[[], bool]:
    """A check: the broker answers Metadata and its group coordinator has loaded.

    The second part makes the broker create ``__consumer_offsets`` and waits until a consumer's
    offset fetch succeeds: until then a fresh broker answers a job's first group-offset lookup
    with ``COORDINATOR_LOAD_IN_PROGRESS``, which an admin client's ListConsumerGroupOffsets does
    not survive in librdkafka 2.16 (a NULL dereference in ``rd_kafka_cgrp_op``: SIGSEGV). A
    consumer has a group handle and retries the fetch itself.
    """
    from confluent_kafka import Consumer, KafkaException, TopicPartition

    def ready() -> bool:
        consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": "eosflow-testing-ready",
                "enable.auto.commit": False,
                "socket.timeout.ms": 3000,
                "log_level": 0,
            }
        )
        try:
            if not consumer.list_topics(timeout=2.0).brokers:
                return False
            consumer.committed([TopicPartition("eosflow-testing-ready", 0)], timeout=5.0)
            return True
        except KafkaException as exc:
            log.debug("Kafka at %s not ready: %s", bootstrap, exc)
            return False
        finally:
            consumer.close()

    return ready


def wait_for_kafka(bootstrap: str, timeout: float = START_TIMEOUT) -> float:
    """Waits until the broker at ``bootstrap`` answers Metadata and its group coordinator has
    loaded (what :func:`kafka_container` waits for); returns the seconds it took.

    Raises:
        InfrastructureError: not ready within ``timeout`` seconds.
    """
    ready, started = _kafka_ready(bootstrap), time.monotonic()
    while not ready():
        if time.monotonic() - started > timeout:
            raise InfrastructureError(
                f"Kafka at {bootstrap}: no Metadata answer or no group coordinator after "
                f"{timeout:g}s"
            )
        time.sleep(0.25)
    return time.monotonic() - started


@contextlib.contextmanager
def kafka_container(
    image: str | None = None, *, network: str | None = None, timeout: float = START_TIMEOUT
) -> Iterator[str]:
    """Apache Kafka (one KRaft node) in a container; yields its bootstrap servers.

    Args:
        image: default ``EOSFLOW_KAFKA_IMAGE``, else :data:`KAFKA_IMAGE`. The image must read
            the official apache/kafka image's ``KAFKA_*`` variables and start the broker with
            ``/etc/kafka/docker/run`` (docker/images/kafka does).
        network: ``bridge`` or ``host`` (default :func:`docker_network`).
        timeout: seconds the broker has to answer a Metadata request.

    Raises:
        ConfigError: the image cannot be had.
        InfrastructureError: the broker did not start (with the container's log).
    """
    image = image or container_image("kafka")
    network = network or docker_network()
    if network == "host":
        port, controller = _free_port(), _free_port()
        env = _kafka_env(
            listeners=f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller}",
            advertised=f"PLAINTEXT://127.0.0.1:{port}",
            voters=f"1@127.0.0.1:{controller}",
            inter_broker="PLAINTEXT",
            protocols="PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        )
        container = _container(image, network).with_envs(**env)
        bootstrap = f"127.0.0.1:{port}"
        with _running(container, "Kafka", _kafka_ready(bootstrap), network, timeout):
            yield bootstrap
        return
    # Bridge: the host port is known only once the container runs, so the container waits for
    # a start script that names it as the advertised listener (testcontainers-java's way with
    # apache/kafka). Other containers on the engine reach the broker as BROKER://localhost:9093.
    env = _kafka_env(
        listeners="PLAINTEXT://0.0.0.0:9092,BROKER://0.0.0.0:9093,CONTROLLER://0.0.0.0:9094",
        advertised="",  # set by the start script
        voters="1@localhost:9094",
        inter_broker="BROKER",
        protocols="PLAINTEXT:PLAINTEXT,BROKER:PLAINTEXT,CONTROLLER:PLAINTEXT",
    )
    del env["KAFKA_ADVERTISED_LISTENERS"]
    wait = (
        f"while [ ! -f {_KAFKA_START_SCRIPT} ]; do sleep 0.1; done; exec sh {_KAFKA_START_SCRIPT}"
    )
    container = (
        _container(image, network, entrypoint=["sh", "-c"])
        .with_envs(**env)
        .with_exposed_ports(9092)
        .with_command([wait])
    )
    found: list[str] = []
    checks: list[Callable[[], bool]] = []

    def advertise() -> None:
        host, port = container.get_container_host_ip(), container.get_exposed_port(9092)
        found.append(f"{host}:{port}")
        script = (
            f"export KAFKA_ADVERTISED_LISTENERS=PLAINTEXT://{host}:{port},BROKER://localhost:9093\n"
            "exec /etc/kafka/docker/run\n"
        ).encode()
        _put_file(container, _KAFKA_START_SCRIPT, script)
        checks.append(_kafka_ready(found[0]))

    with _running(container, "Kafka", lambda: checks[0](), network, timeout, advertise):
        yield found[0]


def _put_file(container: Any, path: str, content: bytes) -> None:
    with BytesIO() as archive:
        with tarfile.TarFile(fileobj=archive, mode="w") as tar:
            info = tarfile.TarInfo(name=path.lstrip("/"))
            info.size, info.mode, info.mtime = len(content), 0o755, int(time.time())
            tar.addfile(info, BytesIO(content))
        container.get_wrapped_container().put_archive("/", archive.getvalue())


def _redis_answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@contextlib.contextmanager
def redis_container(
    image: str | None = None, *, network: str | None = None, timeout: float = START_TIMEOUT
) -> Iterator[str]:
    """Redis in a container, without persistence; yields a ``redis://`` URL.

    Args:
        image: default ``EOSFLOW_REDIS_IMAGE``, else :data:`REDIS_IMAGE`; its command must be
            ``redis-server [options]`` (as the official image's).
        network: ``bridge`` or ``host`` (default :func:`docker_network`).
        timeout: seconds Redis has to answer ``PING``.

    Raises:
        ConfigError: the image cannot be had.
        InfrastructureError: Redis did not start (with the container's log).
    """
    image = image or container_image("redis")
    network = network or docker_network()
    options = ["--save", "", "--appendonly", "no", "--protected-mode", "no"]
    if network == "host":
        port = _free_port()
        container = _container(image, network).with_command(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(port), *options]
        )
        with _running(container, "Redis", lambda: _redis_answers("127.0.0.1", port), network):
            yield f"redis://127.0.0.1:{port}/0"
        return
    container = (
        _container(image, network)
        .with_exposed_ports(6379)
        .with_command(["redis-server", "--bind", "0.0.0.0", "--port", "6379", *options])
    )
    found: list[tuple[str, int]] = []

    def address() -> None:
        found.append((container.get_container_host_ip(), int(container.get_exposed_port(6379))))

    with _running(container, "Redis", lambda: _redis_answers(*found[0]), network, timeout, address):
        yield f"redis://{found[0][0]}:{found[0][1]}/0"


def _postgres_answers(dsn: str) -> bool:
    try:
        psycopg = importlib.import_module("psycopg")
    except ImportError as exc:
        raise ConfigError(
            "postgres_container() checks the server with psycopg, which is not installed: "
            "pip install 'psycopg[binary]' (or pip install 'eosflow[testing]')"
        ) from exc
    try:
        with psycopg.connect(dsn, connect_timeout=2) as conn:
            conn.execute("SELECT 1")
        return True
    except psycopg.OperationalError:
        return False


@contextlib.contextmanager
def postgres_container(
    image: str | None = None, *, network: str | None = None, timeout: float = START_TIMEOUT
) -> Iterator[str]:
    """PostgreSQL in a container, with prepared transactions on (the PostgreSQL sink's two-phase
    commit needs ``max_prepared_transactions`` above zero); yields a libpq DSN.

    Args:
        image: default ``EOSFLOW_POSTGRES_IMAGE``, else :data:`POSTGRES_IMAGE`; it must take
            ``POSTGRES_USER`` / ``POSTGRES_PASSWORD`` / ``POSTGRES_DB`` and the command
            ``postgres -c ...`` (as the official image does).
        network: ``bridge`` or ``host`` (default :func:`docker_network`).
        timeout: seconds the server has to accept a connection and run a query.

    Raises:
        ConfigError: the image cannot be had.
        InfrastructureError: PostgreSQL did not start (with the container's log).
    """
    image = image or container_image("postgres")
    network = network or docker_network()
    command = ["postgres", "-c", "max_prepared_transactions=64", "-c", "max_connections=200"]
    env = {"POSTGRES_USER": _PG_USER, "POSTGRES_PASSWORD": _PG_PASSWORD, "POSTGRES_DB": _PG_DB}
    found: list[str] = []

    def dsn(host: str, port: int) -> str:
        return f"postgresql://{_PG_USER}:{_PG_PASSWORD}@{host}:{port}/{_PG_DB}"

    if network == "host":
        port = _free_port()
        found.append(dsn("127.0.0.1", port))
        container = (
            _container(image, network)
            .with_envs(**env)
            .with_command([*command, "-c", "listen_addresses=127.0.0.1", "-c", f"port={port}"])
        )
        after_start = None
    else:
        container = (
            _container(image, network)
            .with_envs(**env)
            .with_exposed_ports(5432)
            .with_command([*command, "-c", "listen_addresses=*"])
        )

        def after_start() -> None:
            found.append(dsn(container.get_container_host_ip(), container.get_exposed_port(5432)))

    with _running(
        container, "PostgreSQL", lambda: _postgres_answers(found[0]), network, timeout, after_start
    ):
        yield found[0]
