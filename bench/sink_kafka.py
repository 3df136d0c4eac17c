"""Cost of the Kafka sink's modes, measured on the writer itself (no engine around it).

For each mode — a plain idempotent producer (no exactly-once, the floor), ``transactional`` and
``staged`` — one subtask writes ``--records`` running-total outputs in epochs of ``--epoch``
records: write, prepare, commit, like the engine does at every checkpoint. Modes alternate over
``--repeats`` rounds so that a noisy minute hits them alike; the ratio to the plain producer in the
same round is what to compare. Starts an embedded broker unless ``EOSFLOW_KAFKA_BROKERS`` is set.

    python bench/sink_kafka.py --records 300000 --epoch 50000 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from connectors import KafkaSettings
from connectors.admin import TopicAdmin
from connectors.config import create_producer, producer_config
from connectors.transport import produce_waiting
from processor.contracts import SinkContext
from processor.embedded import servers
from sinks.kafka import KafkaSink

MODES = ("plain", "transactional", "staged")


def outputs(records: int) -> list[tuple[str, tuple[int, int]]]:
    return [(f"user-{i % 1000:05d}", (i // 1000 + 1, i * 7 % 5000)) for i in range(records)]


def run_plain(settings: KafkaSettings, topic: str, data: list[Any], epoch: int) -> float:
    import orjson

    producer = create_producer(producer_config(settings))
    start = time.perf_counter()
    for i in range(0, len(data), epoch):
        for key, value in data[i : i + epoch]:
            produce_waiting(producer, topic, orjson.dumps(value), key.encode())
        producer.flush(60)
    return time.perf_counter() - start


def run_sink(
    settings: KafkaSettings, topic: str, data: list[Any], epoch: int, mode: str, url: str
) -> float:
    sink = KafkaSink(topic, mode=mode, transactional_id_prefix=f"bench-{topic}", settings=settings)
    writer = sink.open(SinkContext(f"bench-{uuid.uuid4().hex[:6]}", "out", 0, 1, 1,
                                   snapshot_url=url))  # fmt: skip
    writer.recover([])
    start = time.perf_counter()
    for n, i in enumerate(range(0, len(data), epoch), start=1):
        writer.write(data[i : i + epoch])
        writer.commit(n, writer.prepare(n))
    elapsed = time.perf_counter() - start
    writer.close()
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=300_000)
    parser.add_argument("--epoch", type=int, default=50_000, help="records per checkpoint")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    data = outputs(args.records)
    rows: dict[str, list[float]] = {m: [] for m in MODES}
    with servers(["kafka"]) as endpoints, tempfile.TemporaryDirectory() as tmp:
        assert endpoints.kafka_brokers is not None
        settings = KafkaSettings(endpoints.kafka_brokers)
        for r in range(args.repeats):
            order = MODES if r % 2 == 0 else tuple(reversed(MODES))
            for mode in order:
                topic = f"bench-sink-{uuid.uuid4().hex[:8]}"
                TopicAdmin(settings).ensure_topic(topic, 3)
                if mode == "plain":
                    took = run_plain(settings, topic, data, args.epoch)
                else:
                    took = run_sink(settings, topic, data, args.epoch, mode, Path(tmp).as_uri())
                rate = args.records / took
                rows[mode].append(rate)
                print(f"repeat {r} {mode:14s} {rate:10,.0f} records/s", file=sys.stderr)
    print(f"\n{args.records:,} records, epochs of {args.epoch:,}, {args.repeats} repeats (median)")
    print("| mode | records/s | vs plain |\n|---|---|---|")
    plain = statistics.median(rows["plain"])
    for mode in MODES:
        med = statistics.median(rows[mode])
        print(f"| {mode} | {med:,.0f} | {med / plain:.2f} |")
    out = Path(__file__).parent / "results" / f"sink-kafka-{time.strftime('%Y-%m-%d-%H%M%S')}.json"
    out.write_text(json.dumps({"args": vars(args), "rates": rows, "cpus": os.cpu_count()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
