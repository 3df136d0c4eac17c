"""The ceiling: a plain confluent-kafka consume -> transform -> produce loop, no framework.

It does the keyed-count job (``pipelines/keyed_count.py``) by hand: ``orjson.loads`` every click,
keep ``amount > 0``, key by user, update the user's running ``(count, amount)``, and produce
``orjson.dumps([user, [count, amount]])`` keyed by user to an output topic (one output per
input). The clients use eosflow's own configuration (``connectors.consumer_config`` /
``producer_config``: idempotent producer, ``acks=all``, ``linger.ms=5``, ``read_committed``) with
``fetch.queue.backoff.ms=10`` as in bench/README.md, "The reference job", so the difference to the
engine is the engine, not the client settings.

It runs in one process reading every partition, or in ``n`` processes each reading
``partition % n == i`` (the engine's split of source partitions across workers). The clock
starts when every process has its clients assigned (a start event) and stops when the last
process has read to the end of its partitions and flushed its producer.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from queue import Empty
from typing import Any

__all__ = ["measure_ceiling"]

_BATCH = 10_000


def _loop(
    brokers: str,
    topic: str,
    partitions: list[int],
    out_topic: str,
    ready: Any,
    start: Any,
    results: Any,
) -> None:
    """One process of the ceiling: reads ``partitions`` of ``topic`` to their end."""
    import orjson
    from confluent_kafka import OFFSET_BEGINNING, KafkaError, TopicPartition

    from connectors import (
        KafkaSettings,
        consumer_config,
        create_consumer,
        create_producer,
        producer_config,
    )

    settings = KafkaSettings.from_env(brokers=brokers)
    consumer = create_consumer(
        consumer_config(
            settings, group_id="eosflow-bench-ceiling", overrides={"fetch.queue.backoff.ms": 10}
        )
    )
    producer = create_producer(producer_config(settings))
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
    loads, dumps, produce = orjson.loads, orjson.dumps, producer.produce
    eof = KafkaError._PARTITION_EOF
    totals: dict[str, tuple[int, int]] = {}
    at_end: set[int] = set()
    records = 0
    ready.put(1)
    start.wait()
    began = time.monotonic()
    while len(at_end) < len(partitions):
        for msg in consumer.consume(_BATCH, 0.1):
            err = msg.error()
            if err is not None:
                if err.code() == eof:
                    at_end.add(msg.partition())  # type: ignore[arg-type]
                    continue
                raise RuntimeError(f"ceiling consumer: {err}")
            records += 1
            click = loads(msg.value())  # type: ignore[arg-type]
            amount = click["amount"]
            if amount <= 0:
                continue
            user = click["user"]
            count, total = totals.get(user, (0, 0))
            acc = totals[user] = (count + 1, total + amount)
            key = user.encode()
            value = dumps([user, acc])
            try:
                produce(out_topic, value, key)
            except BufferError:  # local queue full: serve deliveries, then retry once
                producer.poll(0.05)
                produce(out_topic, value, key)
        producer.poll(0)
    left = producer.flush(60)
    ended = time.monotonic()
    consumer.close()
    if left:
        raise RuntimeError(f"ceiling producer: {left} records undelivered")
    results.put((records, began, ended))


def _collect(queue: Any, procs: list[Any], timeout: float) -> list[Any]:
    """One item per process from ``queue``; fails fast when a process died instead."""
    got: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(got) < len(procs):
        try:
            got.append(queue.get(timeout=0.5))
        except Empty:
            dead = [p.name for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"ceiling processes failed or timed out: {dead}") from None
    return got


def measure_ceiling(
    brokers: str, topic: str, *, partitions: int, processes: int, out_topic: str
) -> dict[str, Any]:
    """Runs the loop over ``topic`` in ``processes`` processes; returns records and seconds.

    ``out_topic`` must exist (8 partitions, say). Processes are spawned (not forked): forking a
    process that holds librdkafka threads is undefined behaviour.
    """
    ctx = mp.get_context("spawn")
    ready, results, start = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [
        ctx.Process(
            target=_loop,
            args=(
                brokers,
                topic,
                [p for p in range(partitions) if p % processes == i],
                out_topic,
                ready,
                start,
                results,
            ),
            name=f"ceiling-{i}",
        )
        for i in range(processes)
    ]
    for proc in procs:
        proc.start()
    try:
        _collect(ready, procs, 60.0)
        start.set()
        found = _collect(results, procs, 600.0)
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    records = sum(r for r, _b, _e in found)
    seconds = max(e for _r, _b, e in found) - min(b for _r, b, _e in found)
    return {
        "processes": processes,
        "records": records,
        "seconds": seconds,
        "records_per_s": records / seconds if seconds > 0 else 0.0,
    }
