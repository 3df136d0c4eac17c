"""Where the servers are: environment variables, a ``dev up`` cluster, or servers started now.

Resolution, per service, in this order (:func:`servers`):

1. ``EOSFLOW_KAFKA_BROKERS`` / ``EOSFLOW_REDIS_URL`` / ``EOSFLOW_POSTGRES_DSN``: a real server;
   nothing is started for it.
2. The state file written by ``eosflow dev up`` (``$EOSFLOW_STATE_DIR/dev.json``, default
   ``~/.eosflow/dev.json``), if the server it names is still alive.
3. Otherwise an embedded server is started for the duration of the ``with`` block, owned by this
   process (it dies with it, even on SIGKILL).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from processor.embedded._process import is_running, stop
from processor.embedded.servers import Server, start_postgres, start_redis, start_tansu
from processor.errors import ConfigError

__all__ = [
    "ENV_VARS",
    "SERVICES",
    "DevCluster",
    "Endpoints",
    "endpoint_answers",
    "servers",
    "state_file",
]

log = logging.getLogger(__name__)

SERVICES = ("kafka", "redis", "postgres")
ENV_VARS = {
    "kafka": "EOSFLOW_KAFKA_BROKERS",
    "redis": "EOSFLOW_REDIS_URL",
    "postgres": "EOSFLOW_POSTGRES_DSN",
}
_STARTERS = {"kafka": start_tansu, "redis": start_redis, "postgres": start_postgres}


@dataclass(frozen=True)
class Endpoints:
    """How to reach each server, and where each address came from.

    Attributes:
        kafka_brokers: librdkafka ``bootstrap.servers``.
        redis_url: a ``redis://`` URL.
        postgres_dsn: a libpq connection string.
        origin: service -> ``"env"`` | ``"dev"`` | ``"embedded"``.
    """

    kafka_brokers: str | None = None
    redis_url: str | None = None
    postgres_dsn: str | None = None
    origin: Mapping[str, str] = field(default_factory=dict)

    def get(self, service: str) -> str | None:
        return {
            "kafka": self.kafka_brokers,
            "redis": self.redis_url,
            "postgres": self.postgres_dsn,
        }[service]

    def as_env(self) -> dict[str, str]:
        """The ``EOSFLOW_*`` variables that point another process at the same servers."""
        return {ENV_VARS[s]: v for s in SERVICES if (v := self.get(s)) is not None}


_DEFAULT_PORTS = {"kafka": 9092, "redis": 6379, "postgres": 5432}


def endpoint_answers(service: str, value: str, timeout: float = 1.0) -> bool:
    """Whether something accepts connections where ``value`` (the service's variable of
    :data:`ENV_VARS`) points: a TCP connect to any of its addresses, or a Unix socket that
    exists. A value this cannot parse counts as answering (the job's own error names it)."""
    import socket
    from urllib.parse import urlsplit

    addresses: list[tuple[str, int]] = []
    try:
        if service == "kafka":
            for part in value.split(","):
                host, _, port = part.strip().split("://")[-1].rpartition(":")
                addresses.append((host or "127.0.0.1", int(port or _DEFAULT_PORTS[service])))
        elif "://" in value:
            url = urlsplit(value)
            if url.scheme == "unix" or (url.hostname or "").startswith("/"):
                return os.path.exists(url.path or url.hostname or "")
            addresses.append((url.hostname or "127.0.0.1", url.port or _DEFAULT_PORTS[service]))
        else:  # libpq key=value
            pairs = dict(p.split("=", 1) for p in value.split() if "=" in p)
            host = pairs.get("host", "127.0.0.1")
            if host.startswith("/"):
                return os.path.isdir(host)
            addresses.append((host, int(pairs.get("port", _DEFAULT_PORTS[service]))))
    except (ValueError, KeyError):
        return True
    for address in addresses:
        with contextlib.suppress(OSError), socket.create_connection(address, timeout=timeout):
            return True
    return False


def state_dir() -> Path:
    """``$EOSFLOW_STATE_DIR``, default ``~/.eosflow``: dev servers' state, jobs' status and logs."""
    return Path(os.environ.get("EOSFLOW_STATE_DIR") or str(Path.home() / ".eosflow"))


def state_file() -> Path:
    """The file ``eosflow dev up`` writes and every other command reads."""
    return state_dir() / "dev.json"


class DevCluster:
    """A set of embedded servers that can be saved to and loaded from the state file."""

    def __init__(self, servers: dict[str, Server]) -> None:
        self.servers = servers

    @classmethod
    def start(cls, services: Iterable[str], *, owned: bool) -> DevCluster:
        """Start the named services, each in a temporary directory of its own.

        Sequential on purpose: an owned server dies with the thread that started it (see
        :func:`processor.embedded._process.spawn`), so pool threads cannot start them.
        """
        cluster = cls({})
        for service in _validated(services):
            workdir = Path(tempfile.mkdtemp(prefix=f"eosflow-{service}-"))
            try:
                cluster.servers[service] = _STARTERS[service](workdir, owned=owned)
            except BaseException:
                shutil.rmtree(workdir, ignore_errors=True)
                cluster.stop()
                raise
        return cluster

    def stop(self) -> None:
        """Stop every server by PID and delete its directory."""
        for server in self.servers.values():
            stop(server.process)
            shutil.rmtree(server.workdir, ignore_errors=True)
        self.servers = {}

    def endpoints(self, origin: str) -> Endpoints:
        def url(kind: str) -> str | None:
            return self.servers[kind].url if kind in self.servers else None

        return Endpoints(
            url("kafka"), url("redis"), url("postgres"), {k: origin for k in self.servers}
        )

    def alive(self) -> dict[str, bool]:
        return {kind: is_running(server.process) for kind, server in self.servers.items()}

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        payload = {
            "created": time.time(),
            "servers": {k: s.to_dict() for k, s in self.servers.items()},
        }
        tmp.write_text(json.dumps(payload, indent=2))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> DevCluster | None:
        try:
            payload = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"{path} is not a valid eosflow state file ({exc}); delete it"
            ) from exc
        return cls({k: Server.from_dict(v) for k, v in payload.get("servers", {}).items()})


def _validated(services: Iterable[str]) -> list[str]:
    wanted = list(dict.fromkeys(services))
    unknown = [s for s in wanted if s not in SERVICES]
    if unknown:
        raise ConfigError(f"unknown service(s) {unknown}; choose from {list(SERVICES)}")
    return wanted


@contextlib.contextmanager
def servers(
    services: Iterable[str] = ("kafka", "redis"), *, environ: Mapping[str, str] | None = None
) -> Iterator[Endpoints]:
    """Endpoints for ``services``, starting embedded servers only for those not configured.

    Servers started here are owned by this process and stopped when the block exits.
    """
    env = os.environ if environ is None else environ
    wanted = _validated(services)
    found: dict[str, str] = {}
    origin: dict[str, str] = {}
    for service in wanted:
        if env.get(ENV_VARS[service]):
            found[service], origin[service] = env[ENV_VARS[service]], "env"
    # Read the dev state only while a service is unresolved: a fully configured run must neither
    # depend on nor fail because of a stale or corrupt ~/.eosflow/dev.json.
    dev = DevCluster.load(state_file()) if len(found) < len(wanted) else None
    if dev is not None:
        alive = dev.alive()
        for service in wanted:
            if service not in found and alive.get(service):
                found[service], origin[service] = dev.servers[service].url, "dev"
    missing = [s for s in wanted if s not in found]
    cluster = DevCluster.start(missing, owned=True) if missing else DevCluster({})
    try:
        for service, server in cluster.servers.items():
            found[service], origin[service] = server.url, "embedded"
        for service, where in origin.items():
            log.info("service=%s url=%s origin=%s", service, found[service], where)
        yield Endpoints(found.get("kafka"), found.get("redis"), found.get("postgres"), origin)
    finally:
        cluster.stop()
