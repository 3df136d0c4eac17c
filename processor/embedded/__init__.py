"""Embedded servers on loopback for development and tests: Tansu (Kafka), Redis, PostgreSQL.

Use :func:`servers` to get endpoints (from ``EOSFLOW_*`` variables, a ``dev up`` cluster, or servers
started for the block), or :class:`DevCluster` to manage a set of servers explicitly.
"""

from processor.embedded.cluster import (
    ENV_VARS,
    SERVICES,
    DevCluster,
    Endpoints,
    endpoint_answers,
    servers,
    state_file,
)
from processor.embedded.servers import Server, find_binary

__all__ = [
    "ENV_VARS",
    "SERVICES",
    "DevCluster",
    "Endpoints",
    "Server",
    "endpoint_answers",
    "find_binary",
    "servers",
    "state_file",
]
