"""Benchmark job: running count and amount sum per user, one output per click, exactly once.

The pipeline (what ``eosflow run`` executes)::

    clicks (Kafka, JSON) -> filter amount > 0 -> key by user
        -> running (count, amount) per user   [shuffle through Kafka]
        -> part files

This is the reference job (bench/README.md, "The reference job": parse, filter, key by user,
running count and sum per user, one output per input), so its throughput compares directly with
the raw confluent-kafka loop that ``bench/throughput.py`` measures as the ceiling.

Why a running count and not a windowed count: a running aggregate emits one record per input, so
every click crosses the shuffle, the aggregate and the sink, the same work the ceiling loop does.
A windowed count per user would, with partial combining before the shuffle, emit far fewer
records, and the ratio against the ceiling would measure the combiner rather than the engine.
The windowed path (watermarks, combiner, window firing) is covered by ``six_ops.py``.

Configured by environment variables (read in the runner and in every worker process):

* ``JOB_NAME``: the job (names its channel topics and checkpoints; a new name starts at offset 0);
* ``CLICKS_TOPIC``: the input topic (``examples/clicks.py`` writes it);
* ``OUTPUT_DIR``: where the file sink commits its part files;
* ``OUTPUT_TOPIC``: write to this Kafka topic instead (it must exist), through a transactional
  ``KafkaSink`` with ids ``TXN_PREFIX`` (the reference job as ``bench/peers.py`` runs it: key
  user, value JSON ``[count, amount]``);
* ``KEYED_SOURCE=1``: key the stream by the message key (the input is keyed by user) instead
  of ``key_by``: the aggregate runs in the source's task, with no shuffle (no channel topic);
* ``RECORD_IDS=1`` / ``0``: the Kafka sink's ``record_ids`` (unset: the sink's default, no
  header in transactional mode);
* ``DEDUP=1``: drop re-sent clicks before the aggregate: a per-user ``dedup`` step on the
  click's ``event_id`` (Bloom filters in front of Redis, ``EOSFLOW_REDIS_URL``), horizon
  ``DEDUP_WITHIN_S`` seconds of event time (default 300), filters for ``DEDUP_EXPECTED_IDS``
  IDs (default 100,000, the step's default). ``bench/dedup_job.py`` runs the job with and
  without it.
"""

from __future__ import annotations

import os
from datetime import timedelta

from connectors.serde import JsonSerde
from processor.dataflow import Dataflow
from sinks import FileSink, KafkaSink

OUTPUT_TOPIC = os.environ.get("OUTPUT_TOPIC")
KEYED_SOURCE = os.environ.get("KEYED_SOURCE") == "1"

flow = Dataflow(os.environ.get("JOB_NAME", "bench-keyed-count"))
clicks = flow.source(
    "clicks",
    os.environ.get("CLICKS_TOPIC", "clicks"),
    serde=JsonSerde(),
    timestamp=lambda click: click["ts_ms"],
    keyed=KEYED_SOURCE,
)
valid = clicks.filter("valid", lambda click: click["amount"] > 0)
by_user = valid if KEYED_SOURCE else valid.key_by("by-user", lambda click: click["user"])
if os.environ.get("DEDUP") == "1":
    within = timedelta(seconds=float(os.environ.get("DEDUP_WITHIN_S", "300")))
    expected = int(os.environ.get("DEDUP_EXPECTED_IDS", "100000"))
    by_user = by_user.dedup(
        "unique", id=lambda click: click["event_id"], within=within, expected_ids=expected
    )
(
    by_user.aggregate(
        "per-user",
        init=lambda: (0, 0),
        add=lambda acc, click: (acc[0] + 1, acc[1] + click["amount"]),
    ).sink(
        "out",
        KafkaSink(
            OUTPUT_TOPIC,
            transactional_id_prefix=os.environ.get("TXN_PREFIX", "bench"),
            record_ids={"1": True, "0": False}.get(os.environ.get("RECORD_IDS", "")),
        )
        if OUTPUT_TOPIC
        else FileSink(os.environ.get("OUTPUT_DIR", "out/bench-keyed-count")),
    )
)
