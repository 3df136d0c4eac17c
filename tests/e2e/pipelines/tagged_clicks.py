"""Identity-test pipeline: every click, tagged, into a file or a transactional Kafka topic.

One stage (no shuffle, so no channel topics): each output record comes from one input record,
and a run's output can be compared with its input whatever the runner did. Environment:
``OUTPUT_TOPIC`` (a transactional ``KafkaSink``, ids ``TXN_PREFIX``) or else ``OUTPUT_DIR``
(a ``FileSink``); ``WORK_US``: spin per record (default 100).
"""

from __future__ import annotations

import os

from spin import work

from connectors.serde import JsonSerde
from processor.dataflow import Dataflow
from sinks import FileSink
from sinks.kafka import KafkaSink

flow = Dataflow(os.environ["JOB_NAME"])
topic = os.environ.get("OUTPUT_TOPIC")
sink = (
    KafkaSink(
        topic,
        mode="transactional",
        transactional_id_prefix=os.environ["TXN_PREFIX"],
        commit_timeout_s=5,
    )
    if topic
    else FileSink(os.environ["OUTPUT_DIR"])
)
(
    flow.source("clicks", os.environ["CLICKS_TOPIC"], serde=JsonSerde())
    .map("work", work)
    .map("tag", lambda c: {"event_id": c["event_id"], "user": c["user"]})
    .sink("out", sink)
)
