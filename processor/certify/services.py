"""The servers a certify runs against, and which outages it can inject into them.

Each server is the user's when its ``EOSFLOW_*`` variable names one (certify then cannot cut
it off or restart it: those faults are reported as not possible there), else one certify starts
for itself on loopback: the broker (Tansu) behind a :class:`~processor.testing.FaultProxy`, so
that a network partition can be cut between it and every client, and a private Redis it can
restart on the same port.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from processor.embedded import servers
from processor.embedded.servers import Server
from processor.testing.kafka import kafka_behind_proxy
from processor.testing.proxy import FaultProxy
from processor.testing.redis import private_redis, restart_redis

__all__ = ["Services", "services"]


@dataclass
class Services:
    """Where the runs' servers are and what certify may do to them.

    Attributes:
        kafka: bootstrap servers.
        origin: service -> ``env`` (the user's) or ``embedded`` (certify's own).
        proxy: the fault proxy in front of certify's own broker (``None`` for the user's).
        redis: the Redis URL, if the pipeline needs one.
        redis_server: certify's own Redis (restartable), ``None`` for the user's.
        postgres: the PostgreSQL DSN, if the pipeline needs one.
    """

    kafka: str
    origin: dict[str, str] = field(default_factory=dict)
    proxy: FaultProxy | None = None
    redis: str | None = None
    redis_server: Server | None = None
    postgres: str | None = None

    def environ(self) -> dict[str, str]:
        """The ``EOSFLOW_*`` variables every run's processes see."""
        env = {"EOSFLOW_KAFKA_BROKERS": self.kafka}
        if self.redis:
            env["EOSFLOW_REDIS_URL"] = self.redis
        if self.postgres:
            env["EOSFLOW_POSTGRES_DSN"] = self.postgres
        return env

    def stop_redis(self) -> None:
        """Stops certify's Redis cleanly (its append-only file flushed), if it runs."""
        from processor.embedded._process import stop

        if self.redis_server is not None:
            stop(self.redis_server.process)

    def start_redis(self) -> None:
        """Starts certify's Redis again on the same port, with its data (a Redis restart as an
        upgrade or a failover does it). Call it from a thread that outlives the server: an
        owned server dies with the thread that started it (``PR_SET_PDEATHSIG``)."""
        assert self.redis_server is not None
        self.redis_server = restart_redis(self.redis_server, empty=False)

    def why_not(self, fault: str) -> str | None:
        """Why ``fault`` cannot be injected here, or ``None`` if it can."""
        if fault == "broker-partition" and self.proxy is None:
            return (
                "the broker is the one named by EOSFLOW_KAFKA_BROKERS: certify can cut off only "
                "a broker it started behind its fault proxy (unset the variable)"
            )
        if fault == "redis-restart":
            if self.redis is None:
                return "the pipeline uses no Redis (no dedup step, Redis sink or local recovery)"
            if self.redis_server is None:
                return (
                    "Redis is the one named by EOSFLOW_REDIS_URL: certify restarts only a Redis "
                    "it started (unset the variable)"
                )
        return None


@contextlib.contextmanager
def services(workdir: Path, *, redis: bool, postgres: bool) -> Iterator[Services]:
    """The user's servers where ``EOSFLOW_*`` names them, else certify's own (stopped when
    the block ends)."""
    with contextlib.ExitStack() as stack:
        origin: dict[str, str] = {}
        proxy = None
        kafka = os.environ.get("EOSFLOW_KAFKA_BROKERS")
        if kafka:
            origin["kafka"] = "env"
        else:
            broker = stack.enter_context(kafka_behind_proxy(workdir / "kafka"))
            kafka, proxy, origin["kafka"] = broker.brokers, broker.proxy, "embedded"
        found = Services(kafka, origin, proxy)
        if redis:
            url = os.environ.get("EOSFLOW_REDIS_URL")
            if url:
                found.redis, origin["redis"] = url, "env"
            else:
                found.redis_server = private_redis(workdir / "redis")
                found.redis, origin["redis"] = found.redis_server.url, "embedded"
                stack.callback(found.stop_redis)
        if postgres:
            endpoints = stack.enter_context(servers(["postgres"]))
            found.postgres, origin["postgres"] = (
                endpoints.postgres_dsn,
                endpoints.origin["postgres"],
            )
        yield found
