"""The reference job in Quix Streams, exactly-once (run in its own virtual environment).

State is keyed by the Kafka message key (the user: the input is keyed by user), Quix's
default: no repartition topic. Quix's state store (RocksDB) is backed by a changelog topic, as
in production. The application stops after ``RECORDS`` outputs (``Application.run(count=)``).
Environment for diagnosis: ``QUIX_GUARANTEE`` (default ``exactly-once``), ``QUIX_LOGLEVEL``,
``QUIX_DEBUG`` (librdkafka debug contexts), ``QUIX_SESSION_TIMEOUT_MS`` (default 6000, see
below).
"""

from __future__ import annotations

import os

from quixstreams import Application


def totals(click: dict, state) -> list[int]:
    count, amount = state.get("t", (0, 0))
    acc = [count + 1, amount + click["amount"]]
    state.set("t", acc)
    return acc


def main() -> None:
    app = Application(
        broker_address=os.environ["BROKERS"],
        consumer_group=f"peers-quix-{os.environ['RUN_ID']}",
        auto_offset_reset="earliest",
        processing_guarantee=os.environ.get("QUIX_GUARANTEE", "exactly-once"),
        commit_interval=float(os.environ.get("QUIX_COMMIT_S", "1.0")),  # bench/latency.py
        state_dir=os.environ["STATE_DIR"],
        consumer_extra_config={
            "fetch.queue.backoff.ms": 10,
            # Tansu answers a new group's JoinGroup after about half the session timeout
            # (22.5 s at librdkafka's default 45 s: the run would time Tansu, not Quix); 6 s
            # is what eosflow's broker probe uses. Apache Kafka delays a new group by
            # group.initial.rebalance.delay.ms (3 s) whatever this is.
            "session.timeout.ms": int(os.environ.get("QUIX_SESSION_TIMEOUT_MS", "6000")),
            # librdkafka debug contexts, e.g. "cgrp" to see the group join (diagnosis only)
            **({"debug": os.environ["QUIX_DEBUG"]} if os.environ.get("QUIX_DEBUG") else {}),
        },
        loglevel=os.environ.get("QUIX_LOGLEVEL", "INFO"),
    )
    source = app.topic(os.environ["INPUT_TOPIC"], key_deserializer="str", value_deserializer="json")
    out = app.topic(os.environ["OUTPUT_TOPIC"], key_serializer="str", value_serializer="json")
    sdf = app.dataframe(source)
    sdf = sdf.filter(lambda click: click["amount"] > 0)
    sdf = sdf.apply(totals, stateful=True)
    sdf.to_topic(out)
    if os.environ.get("LOOP_FOREVER"):  # bench/latency.py: until stopped (SIGTERM)
        app.run()
    else:
        app.run(count=int(os.environ["RECORDS"]), collect=False)


if __name__ == "__main__":
    main()
