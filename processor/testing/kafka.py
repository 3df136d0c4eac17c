"""A Kafka broker reachable only through a :class:`FaultProxy`.

A Kafka client connects to the bootstrap address, then to the addresses the broker advertises in
its metadata. A proxy in front of the bootstrap address alone would see one connection and miss
the rest, so the proxy (``kafka=True``) writes its own address over the broker's in every answer
that carries one: every connection of every client goes through the proxy, and
:meth:`FaultProxy.black_hole` partitions the broker from all of them at once.

Two brokers can stand behind it: an embedded Tansu of the caller's own (the default; it also
advertises the proxy's port itself), or a running single-broker cluster named by ``brokers``
(a real Apache Kafka, ``EOSFLOW_KAFKA_BROKERS``), which is not reconfigured: the other clients of
that broker are not affected by the proxy's faults. A cluster of several brokers is refused
(one proxy stands for one broker).
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
        server: the embedded broker process (its ``port`` is the one behind the proxy), or None
            for a named broker.
    """

    brokers: str
    proxy: FaultProxy
    server: Server | None


@contextlib.contextmanager
def kafka_behind_proxy(
    workdir: Path | None = None, *, brokers: str | None = None
) -> Iterator[BrokerBehindProxy]:
    """A :class:`FaultProxy` in front of the single-broker cluster ``brokers``, or (None) in
    front of a Tansu started on a free port.

    The embedded broker is owned by the calling process (killed with it); it and the proxy stop
    when the block ends. Start it from a thread that lives as long as the block (the main thread
    in tests).

    Raises:
        ValueError: ``brokers`` names a cluster of more than one broker.
    """
    if brokers is not None:
        with FaultProxy(*_single_broker(brokers), kafka=True) as proxy:
            yield BrokerBehindProxy(proxy.address, proxy, None)
        return
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="eosflow-")))
        workdir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        proxy = stack.enter_context(FaultProxy("127.0.0.1", port, kafka=True))
        server = start_tansu(workdir, owned=True, port=port, advertised_port=proxy.port)
        stack.callback(stop, server.process)
        yield BrokerBehindProxy(proxy.address, proxy, server)


def _single_broker(brokers: str) -> tuple[str, int]:
    """The advertised address of the one broker of the cluster ``brokers``."""
    from connectors import KafkaSettings
    from connectors.admin import quiet_admin_client

    with quiet_admin_client(KafkaSettings.from_env(brokers=brokers)) as admin:
        found = list(admin.list_topics(timeout=30).brokers.values())
    if len(found) != 1:
        raise ValueError(
            f"a fault proxy stands for one broker; the cluster at {brokers} has {len(found)} "
            f"({', '.join(f'{b.host}:{b.port}' for b in found)}): name a single-broker cluster"
        )
    return str(found[0].host), int(found[0].port)
