"""Where a test session's servers come from: the choice behind the pytest plugin's fixtures.

Four modes (``--eosflow-servers``, see :mod:`processor.testing.plugin`):

* ``auto`` (default): per service, ``EOSFLOW_KAFKA_BROKERS`` / ``EOSFLOW_REDIS_URL`` /
  ``EOSFLOW_POSTGRES_DSN`` if set, else a running ``eosflow dev up`` cluster, else an embedded
  server (:func:`processor.embedded.servers`).
* ``embedded``: always an embedded server started for the session (Tansu, Redis, PostgreSQL on
  loopback), whatever the environment says.
* ``env``: only the servers the ``EOSFLOW_*`` variables name; a missing variable is an error.
* ``containers``: Apache Kafka, Redis and PostgreSQL in containers (testcontainers; images,
  network and clean-up in :mod:`processor.testing.containers`). Without a Docker engine the
  service is unavailable (:class:`ServerNotFoundError`: the fixtures skip).
  ``EOSFLOW_TESTCONTAINERS=1`` selects this mode when no option does.

:class:`SessionServers` starts nothing until a service is asked for, then keeps it for the rest
of the session: a run of unit tests starts no server at all.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from types import TracebackType

from processor.embedded import ENV_VARS, SERVICES, DevCluster, servers
from processor.errors import ConfigError, ServerNotFoundError
from processor.testing.containers import (
    KAFKA_IMAGE,
    NO_DOCKER,
    POSTGRES_IMAGE,
    REDIS_IMAGE,
    docker_engine_available,
    kafka_container,
    postgres_container,
    redis_container,
)

__all__ = [
    "KAFKA_IMAGE",
    "MODES",
    "NO_DOCKER",
    "POSTGRES_IMAGE",
    "REDIS_IMAGE",
    "SessionServers",
    "docker_engine_available",
    "kafka_container",
    "postgres_container",
    "redis_container",
    "selected_mode",
]

log = logging.getLogger(__name__)

MODES = ("auto", "embedded", "env", "containers")


def selected_mode(option: str | None, environ: Mapping[str, str] | None = None) -> str:
    """The servers mode: ``option`` (``--eosflow-servers``) if given, else ``containers`` when
    ``EOSFLOW_TESTCONTAINERS=1``, else ``auto``.

    Raises:
        ConfigError: ``option`` is not one of :data:`MODES`.
    """
    env = os.environ if environ is None else environ
    if option is None:
        return "containers" if env.get("EOSFLOW_TESTCONTAINERS") == "1" else "auto"
    if option not in MODES:
        raise ConfigError(f"--eosflow-servers={option!r}: choose one of {', '.join(MODES)}")
    return option


_CONTAINERS = {"kafka": kafka_container, "redis": redis_container, "postgres": postgres_container}


class SessionServers:
    """The servers of a test session, each resolved on first use and kept until :meth:`close`.

    Args:
        mode: one of :data:`MODES` (see the module docstring).
        environ: where the ``EOSFLOW_*`` variables are read (default ``os.environ``).

    Invariants:
        A service is resolved at most once: every test of the session gets the same address.
        Servers this object started stop at :meth:`close`, in reverse order.
    """

    def __init__(self, mode: str = "auto", environ: Mapping[str, str] | None = None) -> None:
        self.mode = selected_mode(mode, environ)
        self._environ = os.environ if environ is None else environ
        self._stack = contextlib.ExitStack()
        self._urls: dict[str, str] = {}
        self._origin: dict[str, str] = {}

    def url(self, service: str) -> str:
        """The address of ``service`` (``kafka``: bootstrap servers, ``redis``: a URL,
        ``postgres``: a DSN), starting its server now if the mode says so.

        Raises:
            ServerNotFoundError: the server cannot be had here (no binary for an embedded one,
                no Docker engine for a container); a test should skip.
            ConfigError: mode ``env`` and the service's variable is not set.
        """
        if service not in SERVICES:
            raise ConfigError(f"unknown service {service!r}; choose one of {list(SERVICES)}")
        if service not in self._urls:
            self._urls[service], self._origin[service] = self._resolve(service)
            log.info(
                "service=%s url=%s origin=%s", service, self._urls[service], self._origin[service]
            )
        return self._urls[service]

    def origin(self, service: str) -> str:
        """Where ``service``'s address came from: ``env``, ``dev``, ``embedded`` or
        ``container`` (resolving it first)."""
        self.url(service)
        return self._origin[service]

    def as_env(self) -> dict[str, str]:
        """The ``EOSFLOW_*`` variables of the services resolved so far: what points a pipeline
        (in this process or another) at the same servers."""
        return {ENV_VARS[s]: url for s, url in self._urls.items()}

    def _resolve(self, service: str) -> tuple[str, str]:
        variable = ENV_VARS[service]
        if self.mode == "env":
            value = self._environ.get(variable)
            if not value:
                raise ConfigError(
                    f"--eosflow-servers=env but {variable} is not set: set it to your "
                    f"{service} server, or use --eosflow-servers=auto to start one"
                )
            return value, "env"
        if self.mode == "containers":
            if not docker_engine_available():
                raise ServerNotFoundError(NO_DOCKER)
            return self._stack.enter_context(_CONTAINERS[service]()), "container"
        if self.mode == "embedded":
            cluster = DevCluster.start([service], owned=True)
            self._stack.callback(cluster.stop)
            return cluster.servers[service].url, "embedded"
        endpoints = self._stack.enter_context(servers([service], environ=self._environ))
        url = endpoints.get(service)
        assert url is not None, f"processor.embedded.servers resolved no {service}"
        return url, endpoints.origin[service]

    def close(self) -> None:
        """Stop the servers this object started (not the ones it was only told about)."""
        self._stack.close()
        self._urls.clear()
        self._origin.clear()

    def __enter__(self) -> SessionServers:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
