"""An embedded Kafka-protocol broker reachable only through a :class:`FaultProxy`.

A Kafka client connects to the bootstrap address, then to the addresses the broker advertises in
its metadata. A proxy in front of the bootstrap address alone would see one connection and miss
the rest, so the broker (Tansu, ``--advertised-listener-url``) advertises the proxy's port: every
connection of every client goes through the proxy, and :meth:`FaultProxy.black_hole` partitions
the broker from all of them at once.

A broker eosflow did not start (``EOSFLOW_KAFKA_BROKERS``) cannot be re-advertised from here:
tests that need a partition skip there (see ``tests/e2e/test_partitions.py``). On a real cluster,
set ``advertised.listeners`` to a proxy's address yourself and point the proxy at the listener.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from processor.embedded._process import free_port, stop
from processor.embedded.servers import Server, start_tansu
from processor.testing.proxy import FaultProxy

__all__ = ["BrokerBehindProxy", "kafka_behind_proxy"]


@dataclass
class BrokerBehindProxy:
    """A running broker and the proxy every client reaches it through.

    Attributes:
        brokers: the bootstrap servers to give clients (the proxy's address).
        proxy: break the network with it (``black_hole``, ``delay``, ``reset``, ``heal``).
        server: the broker process (its ``port`` is the one behind the proxy).
    """

    brokers: str
    proxy: FaultProxy
    server: Server


@contextlib.contextmanager
def kafka_behind_proxy(workdir: Path | None = None) -> Iterator[BrokerBehindProxy]:
    """Start Tansu on a free port, advertising a :class:`FaultProxy` in front of it.

    The broker is owned by the calling process (killed with it); both stop when the block
    ends. Start it from a thread that lives as long as the block (the main thread in tests).
    """
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="eosflow-")))
        workdir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        proxy = stack.enter_context(FaultProxy("127.0.0.1", port, kafka=True))
        server = start_tansu(workdir, owned=True, port=port, advertised_port=proxy.port)
        stack.callback(stop, server.process)
        yield BrokerBehindProxy(proxy.address, proxy, server)
