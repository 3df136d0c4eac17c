"""The reference job in Bytewax (run in its own virtual environment with ``-m bytewax.run``).

No recovery store is configured, so Bytewax gives no delivery guarantee across a crash (with
one it is at-least-once; it has no exactly-once Kafka sink). The source stops at the end of the
input (``tail=False``; with ``LOOP_FOREVER`` set, as bench/latency.py runs it, it waits for
more); the running totals are a ``stateful_map`` keyed by the message key.
"""

from __future__ import annotations

import os

import bytewax.operators as op
import orjson
from bytewax.connectors.kafka import KafkaSink, KafkaSinkMessage, KafkaSource
from bytewax.dataflow import Dataflow


def _totals(state, click):
    count, amount = state or (0, 0)
    acc = (count + 1, amount + click["amount"])
    return acc, acc


brokers = [os.environ["BROKERS"]]
flow = Dataflow("peers-bytewax")
msgs = op.input(
    "in",
    flow,
    KafkaSource(
        brokers,
        [os.environ["INPUT_TOPIC"]],
        tail=bool(os.environ.get("LOOP_FOREVER")),  # bench/latency.py: until stopped
        add_config={"fetch.queue.backoff.ms": "10"},
    ),
)
clicks = op.map("parse", msgs, lambda m: (m.key.decode(), orjson.loads(m.value)))
valid = op.filter("valid", clicks, lambda kv: kv[1]["amount"] > 0)
running = op.stateful_map("totals", valid, _totals)
encoded = op.map(
    "encode", running, lambda kv: KafkaSinkMessage(kv[0].encode(), orjson.dumps(kv[1]))
)
op.output("out", encoded, KafkaSink(brokers, os.environ["OUTPUT_TOPIC"]))


if __name__ == "__main__":  # bench/latency.py: its epoch below a second (the CLI takes whole s)
    from datetime import timedelta

    from bytewax._bytewax import cli_main
    from bytewax.recovery import RecoveryConfig

    cli_main(
        flow,
        workers_per_process=1,
        process_id=None,
        addresses=None,
        epoch_interval=timedelta(seconds=float(os.environ["BYTEWAX_EPOCH_S"])),
        recovery_config=RecoveryConfig(os.environ["BYTEWAX_RECOVERY_DIR"], timedelta(0)),
    )
