"""Per-user running total over a JSON click stream: one output per click, exactly once.

The pipeline (what ``eosflow run`` executes)::

    clicks (Kafka, JSON) -> key by user -> running (count, amount) per user -> part files

Every click yields one output line ``["user-00042", [count, amount]]``: the user's totals after
that click. Exactly-once means, per user, the counts 1..n each appear once with the right sums,
whatever crashed in between.

Run it end to end (embedded Kafka unless EOSFLOW_KAFKA_BROKERS or ``eosflow dev up`` says
otherwise; writes input, runs the job until idle, checks the output)::

    python examples/running_total.py [--records 200000] [--workers 2]

Or run the pipeline on its own against an existing topic::

    CLICKS_TOPIC=clicks OUTPUT_DIR=out/totals eosflow run examples/running_total.py --until-idle

With ``OUTPUT_TOPIC`` set, the totals go to that Kafka topic through the transactional
``KafkaSink`` instead of part files (exactly-once for ``read_committed`` readers on Apache Kafka;
``eosflow probe`` says whether the broker hides aborted records)::

    OUTPUT_TOPIC=totals eosflow certify examples/running_total.py --input clicks=clicks.jsonl \
        --input-key user
"""

from __future__ import annotations

import os

from connectors import JsonSerde
from processor import Dataflow
from sinks import FileSink, KafkaSink

flow = Dataflow(os.environ.get("JOB_NAME", "running-total"))
(
    flow.source(
        "clicks",
        os.environ.get("CLICKS_TOPIC", "clicks"),
        serde=JsonSerde(),
        timestamp=lambda click: click["ts_ms"],
    )
    .key_by("by-user", lambda click: click["user"])
    .aggregate(
        "totals",
        init=lambda: (0, 0),
        add=lambda acc, click: (acc[0] + 1, acc[1] + click["amount"]),
    )
    .sink(
        "out",
        KafkaSink(os.environ["OUTPUT_TOPIC"], transactional_id_prefix=flow.name)
        if os.environ.get("OUTPUT_TOPIC")
        else FileSink(os.environ.get("OUTPUT_DIR", "out/running-total")),
    )
)


if __name__ == "__main__":
    from clicks import expected_running_totals, run_example

    run_example(__file__, expected_running_totals, "running total")
