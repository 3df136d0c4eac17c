"""Test kit for eosflow pipelines and for the services around them.

Like ``bytewax.testing``, this is public API: use it to prove your own pipelines exactly-once,
under faults too (docs/testing.md). The pytest plugin (:mod:`processor.testing.plugin`,
registered by the package) gives the servers, topics and jobs as ``eosflow_*`` fixtures.

* Servers: :class:`SessionServers` (embedded, ``EOSFLOW_*``, ``eosflow dev up`` or
  testcontainers), :func:`docker_engine_available`; :func:`kafka_container`,
  :func:`redis_container`, :func:`postgres_container` (one server in a container, official or
  local images, bridge or host network: docs/containers.md), :func:`wait_for_kafka`.
* Input: :func:`create_topic`, :func:`produce` (Python values), :func:`produce_jsonl` (a JSON
  lines file), :func:`unique_name`.
* Runs: :func:`run_pipeline` (in this process), :func:`run_pipeline_subprocess` (``eosflow
  run``), both bounded (``--until-idle``); :class:`Job`, :func:`new_job`, :class:`CliRun`.
* Output: :func:`assert_exactly_once`, :func:`diff`, :class:`Output`, :func:`canonical`,
  :func:`order_diff`.
* Output of every sink kind: :func:`read_output`, :func:`scan_topic`.
* Faults: :class:`Killer` (SIGKILLs placed by progress), :class:`Outage`, :class:`RecoveryClock`,
  :func:`hold_final`, :func:`on_driver_thread`, :mod:`processor.testing.redis` (a restartable
  private Redis); :class:`FaultProxy` — a loopback TCP proxy that black-holes (a network partition),
  delays or resets the connections to a server; :func:`kafka_behind_proxy` — an embedded broker
  whose advertised listener is a :class:`FaultProxy`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from processor.exports import lazy_exports

# Names are imported on first use (PEP 562): the pytest plugin, a submodule, is imported by
# every pytest run where eosflow is installed, and importing the whole kit (the runner, the
# Kafka client) would cost each of them about a quarter of a second.
_WHERE = {
    "BrokerBehindProxy": "processor.testing.kafka",
    "CliRun": "processor.testing.run",
    "Diff": "processor.testing.compare",
    "FaultProxy": "processor.testing.proxy",
    "Job": "processor.testing.run",
    "Killer": "processor.testing.chaos",
    "Outage": "processor.testing.chaos",
    "Output": "processor.testing.compare",
    "ProxyStats": "processor.testing.proxy",
    "RecoveryClock": "processor.testing.chaos",
    "SessionServers": "processor.testing.servers",
    "assert_exactly_once": "processor.testing.compare",
    "canonical": "processor.testing.compare",
    "create_topic": "processor.testing.topics",
    "diff": "processor.testing.compare",
    "docker_engine_available": "processor.testing.servers",
    "hold_final": "processor.testing.chaos",
    "kafka_behind_proxy": "processor.testing.kafka",
    "kafka_container": "processor.testing.containers",
    "logs_tail": "processor.testing.run",
    "new_job": "processor.testing.run",
    "on_driver_thread": "processor.testing.chaos",
    "order_diff": "processor.testing.compare",
    "postgres_container": "processor.testing.containers",
    "produce": "processor.testing.topics",
    "produce_jsonl": "processor.testing.topics",
    "read_output": "processor.testing.outputs",
    "redis_container": "processor.testing.containers",
    "run_pipeline": "processor.testing.run",
    "run_pipeline_subprocess": "processor.testing.run",
    "scan_topic": "processor.testing.outputs",
    "unique_name": "processor.testing.topics",
    "wait_for_kafka": "processor.testing.containers",
}

if TYPE_CHECKING:
    from processor.testing.chaos import (
        Killer,
        Outage,
        RecoveryClock,
        hold_final,
        on_driver_thread,
    )
    from processor.testing.compare import (
        Diff,
        Output,
        assert_exactly_once,
        canonical,
        diff,
        order_diff,
    )
    from processor.testing.containers import (
        kafka_container,
        postgres_container,
        redis_container,
        wait_for_kafka,
    )
    from processor.testing.kafka import (
        BrokerBehindProxy,
        kafka_behind_proxy,
    )
    from processor.testing.outputs import (
        read_output,
        scan_topic,
    )
    from processor.testing.proxy import (
        FaultProxy,
        ProxyStats,
    )
    from processor.testing.run import (
        CliRun,
        Job,
        logs_tail,
        new_job,
        run_pipeline,
        run_pipeline_subprocess,
    )
    from processor.testing.servers import (
        SessionServers,
        docker_engine_available,
    )
    from processor.testing.topics import (
        create_topic,
        produce,
        produce_jsonl,
        unique_name,
    )

__all__ = [
    "BrokerBehindProxy",
    "CliRun",
    "Diff",
    "FaultProxy",
    "Job",
    "Killer",
    "Outage",
    "Output",
    "ProxyStats",
    "RecoveryClock",
    "SessionServers",
    "assert_exactly_once",
    "canonical",
    "create_topic",
    "diff",
    "docker_engine_available",
    "hold_final",
    "kafka_behind_proxy",
    "kafka_container",
    "logs_tail",
    "new_job",
    "on_driver_thread",
    "order_diff",
    "postgres_container",
    "produce",
    "produce_jsonl",
    "read_output",
    "redis_container",
    "run_pipeline",
    "run_pipeline_subprocess",
    "scan_topic",
    "unique_name",
    "wait_for_kafka",
]

__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
