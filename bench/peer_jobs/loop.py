"""The hand-written loop: confluent-kafka consume -> orjson -> running totals -> produce.

    python bench/peer_jobs/loop.py at-least-once|transactional [PROCESSES]

One process reads all partitions of ``INPUT_TOPIC`` (assigned, no group join) and stops at
their end; with ``PROCESSES`` (e.g. 2: the ceiling of two cores), that many processes each read
every ``PROCESSES``-th partition, with transactional ids of their own.

``at-least-once``: idempotent producer; every second the producer is flushed, then the
consumer's positions are committed. ``transactional``: one transaction per second holding
the outputs and the consumer's positions (``send_offsets_to_transaction``), as Kafka Streams'
exactly-once does. The consumer uses ``fetch.queue.backoff.ms=10`` (bench/README.md, "The reference
job": the librdkafka default of 1000 ms caps one consumer).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import orjson
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Producer, TopicPartition

_BATCH = 10_000
#: A transaction (or a flush and a commit) this often; bench/latency.py sets it.
_COMMIT_S = float(os.environ.get("LOOP_COMMIT_S", "1.0"))
#: ``LOOP_FOREVER=1`` (bench/latency.py): read until SIGTERM, not to the partitions' end.
_FOREVER = os.environ.get("LOOP_FOREVER") == "1"


def main() -> None:
    mode = sys.argv[1]
    processes = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    if processes > 1 and "LOOP_SHARE" not in os.environ:
        children = [
            subprocess.Popen(
                [sys.executable, __file__, mode, str(processes)],
                env={**os.environ, "LOOP_SHARE": str(i)},
            )
            for i in range(processes)
        ]
        codes = [child.wait() for child in children]
        if any(codes):
            raise SystemExit(f"loop: a process failed: exit codes {codes}")
        return
    share = int(os.environ.get("LOOP_SHARE", "0"))
    brokers, topic, out = (
        os.environ["BROKERS"],
        os.environ["INPUT_TOPIC"],
        os.environ["OUTPUT_TOPIC"],
    )
    txn = mode == "transactional"
    consumer = Consumer(
        {
            "bootstrap.servers": brokers,
            "group.id": f"peers-loop-{mode}-{os.environ['RUN_ID']}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "isolation.level": "read_committed",
            "fetch.queue.backoff.ms": 10,
        }
    )
    producer_conf = {
        "bootstrap.servers": brokers,
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 5,
    }
    if txn:
        producer_conf["transactional.id"] = f"peers-loop-{os.environ['RUN_ID']}-{share}"
    producer = Producer(producer_conf)
    parts = sorted(consumer.list_topics(topic, timeout=30).topics[topic].partitions)
    parts = parts[share::processes]
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
    if txn:
        producer.init_transactions(30)
        producer.begin_transaction()
    loads, dumps, produce = orjson.loads, orjson.dumps, producer.produce
    eof = KafkaError._PARTITION_EOF
    totals: dict[str, tuple[int, int]] = {}
    positions: dict[int, int] = {}
    at_end: set[int] = set()
    last = time.monotonic()

    def commit() -> None:
        offsets = [TopicPartition(topic, p, o) for p, o in positions.items()]
        if txn:
            if offsets:
                producer.send_offsets_to_transaction(
                    offsets, consumer.consumer_group_metadata(), 30
                )
            producer.commit_transaction(30)
            producer.begin_transaction()
        else:
            if producer.flush(30):
                raise RuntimeError("loop: outputs undelivered after 30 s")
            if offsets:
                consumer.commit(offsets=offsets, asynchronous=True)

    stopping: list[int] = []
    if _FOREVER:
        signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    while (len(at_end) < len(parts) or _FOREVER) and not stopping:
        for msg in consumer.consume(_BATCH, 0.1):
            err = msg.error()
            if err is not None:
                if err.code() == eof:
                    at_end.add(msg.partition())
                    continue
                raise RuntimeError(f"loop consumer: {err}")
            positions[msg.partition()] = msg.offset() + 1
            click = loads(msg.value())
            amount = click["amount"]
            if amount <= 0:
                continue
            user = click["user"]
            count, total = totals.get(user, (0, 0))
            acc = totals[user] = (count + 1, total + amount)
            value, key = dumps(acc), user.encode()
            while True:
                try:
                    produce(out, value, key)
                    break
                except BufferError:  # local queue full: serve deliveries, then retry
                    producer.poll(0.05)
        producer.poll(0)
        now = time.monotonic()
        if now - last >= _COMMIT_S:
            commit()
            last = now
    if txn:
        offsets = [TopicPartition(topic, p, o) for p, o in positions.items()]
        producer.send_offsets_to_transaction(offsets, consumer.consumer_group_metadata(), 30)
        producer.commit_transaction(60)
    elif producer.flush(60):
        raise RuntimeError("loop: outputs undelivered after 60 s")
    consumer.close()


if __name__ == "__main__":
    main()
