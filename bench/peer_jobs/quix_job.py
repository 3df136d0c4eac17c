"""The reference job in Quix Streams, exactly-once (run in its own virtual environment).

State is keyed by the Kafka message key (the user: the input is keyed by user), Quix's
default: no repartition topic. Quix's state store (RocksDB) is backed by a changelog topic, as
in production. The application stops after ``RECORDS`` outputs (``Application.run(count=)``).
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
        commit_interval=1.0,
        state_dir=os.environ["STATE_DIR"],
        consumer_extra_config={"fetch.queue.backoff.ms": 10},
        loglevel=os.environ.get("QUIX_LOGLEVEL", "INFO"),
    )
    source = app.topic(os.environ["INPUT_TOPIC"], key_deserializer="str", value_deserializer="json")
    out = app.topic(os.environ["OUTPUT_TOPIC"], key_serializer="str", value_serializer="json")
    sdf = app.dataframe(source)
    sdf = sdf.filter(lambda click: click["amount"] > 0)
    sdf = sdf.apply(totals, stateful=True)
    sdf.to_topic(out)
    app.run(count=int(os.environ["RECORDS"]), collect=False)


if __name__ == "__main__":
    main()
