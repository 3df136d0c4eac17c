"""Test kit for eosflow pipelines and for the services around them.

* :class:`FaultProxy` — a loopback TCP proxy that black-holes (a network partition), delays or
  resets the connections to a server, for a chosen time or until healed.
* :func:`kafka_behind_proxy` — an embedded Kafka-protocol broker (Tansu) whose advertised
  listener is a :class:`FaultProxy`, so that every client connection goes through it.

Like ``bytewax.testing``, this is public API: use it to test your own pipelines under faults.
"""

from processor.testing.kafka import BrokerBehindProxy, kafka_behind_proxy
from processor.testing.proxy import FaultProxy, ProxyStats

__all__ = ["BrokerBehindProxy", "FaultProxy", "ProxyStats", "kafka_behind_proxy"]
