"""Beginning and end offsets of partitions, measured the way a reader sees them.

Why not just ListOffsets: Tansu answers ListOffsets(latest) with a wrong offset (1 after a batch of
1,000 records), while the high watermark it returns in every Fetch response is right. Apache Kafka
gets both right. So the end offset is taken from a Fetch response: assign each partition near its
reported end, fetch once with a tiny byte limit, read librdkafka's cached watermark. That is the
high watermark for both isolation levels: librdkafka keeps a Fetch response's last stable offset
apart and does not expose it (measured on Apache Kafka 4.3.1 with a transaction open: 5 for both,
while a ``read_committed`` reader stopped at offset 2). So the end includes the records of
transactions still open; a ``read_committed`` reader reaches it once they are decided (a bounded
run waits for them, and says so: "a transaction open in the input").

A partition whose leader is not in place yet (a topic created a moment ago: KRaft answers
NOT_LEADER_OR_FOLLOWER until the leader has applied the new metadata, although the metadata
already names it) is asked again until ``timeout``: Kafka documents those errors as retriable.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from confluent_kafka import KafkaException, TopicPartition

from connectors.config import create_consumer
from connectors.errors import classify, retrying

__all__ = ["watermarks"]

TP = tuple[str, int]
_UNKNOWN = -1001  # librdkafka's RD_KAFKA_OFFSET_INVALID: no fetch response seen yet


def watermarks(
    consumer_conf: Mapping[str, Any], partitions: Iterable[TP], *, timeout: float = 30.0
) -> dict[TP, tuple[int, int]]:
    """``(beginning, end)`` per partition, the end the high watermark (module docstring), measured
    by a consumer with ``consumer_conf``.

    Raises:
        KafkaClientError: a partition did not answer within ``timeout``.
    """
    tps = list(dict.fromkeys(partitions))
    if not tps:
        return {}
    conf = {
        **consumer_conf,
        "enable.partition.eof": True,
        "max.partition.fetch.bytes": 1,  # one record at most: only the watermark matters
        "fetch.wait.max.ms": 10,
    }
    consumer = create_consumer(conf)
    try:
        listed: dict[TP, tuple[int, int]] = {}
        deadline = time.monotonic() + timeout
        for tp in tps:
            listed[tp] = retrying(
                lambda left, tp=tp: consumer.get_watermark_offsets(  # type: ignore[misc]
                    TopicPartition(*tp), timeout=left, cached=False
                ),
                f"offsets of {tp[0]}[{tp[1]}]",
                deadline_s=max(1.0, deadline - time.monotonic()),
            )
        consumer.assign(
            [TopicPartition(t, p, max(low, high - 1)) for (t, p), (low, high) in listed.items()]
        )
        result: dict[TP, tuple[int, int]] = {}
        deadline = time.monotonic() + timeout
        while len(result) < len(tps):
            consumer.consume(len(tps), 0.05)
            for tp in tps:
                if tp not in result:
                    _, high = consumer.get_watermark_offsets(TopicPartition(*tp), cached=True)
                    if high != _UNKNOWN and high is not None and high >= 0:
                        result[tp] = (listed[tp][0], int(high))
            if len(result) < len(tps) and time.monotonic() > deadline:
                missing = [tp for tp in tps if tp not in result]
                raise classify(
                    KafkaException(f"no fetch response for {missing} within {timeout}s"),
                    context="measuring end offsets",
                )
        return result
    finally:
        consumer.close()
