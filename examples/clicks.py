"""A deterministic JSON click stream and the answer a per-user aggregation must give.

Used by the examples, the tests and the benchmarks; the expectation is computed here, from the
generated events, never by the engine.

    python examples/clicks.py --brokers 127.0.0.1:9092 --topic clicks --records 100000
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

PAGES = ("/", "/search", "/item", "/cart", "/checkout", "/help")


@dataclass(frozen=True)
class Totals:
    count: int
    amount: int


def click_events(records: int, *, users: int = 1000, seed: int = 7) -> Iterator[dict[str, object]]:
    """``records`` click events; the same arguments always give the same events."""
    rng = random.Random(seed)
    base_ms = 1_700_000_000_000
    for i in range(records):
        yield {
            "event_id": f"c-{seed}-{i}",
            "user": f"user-{rng.randrange(users):05d}",
            "page": PAGES[rng.randrange(len(PAGES))],
            "amount": rng.randrange(1, 100),
            "ts_ms": base_ms + i * 10 + rng.randrange(10),
        }


def expected_totals(events: Iterator[dict[str, object]]) -> dict[str, Totals]:
    """Per-user click count and amount sum: the reference answer."""
    acc: dict[str, list[int]] = {}
    for event in events:
        entry = acc.setdefault(str(event["user"]), [0, 0])
        entry[0] += 1
        entry[1] += int(str(event["amount"]))
    return {user: Totals(c, a) for user, (c, a) in acc.items()}


def produce_clicks(
    brokers: str, topic: str, records: int, *, partitions: int = 8, users: int = 1000, seed: int = 7
) -> float:
    """Create ``topic`` and write the events to it, keyed by user; returns seconds taken."""
    import orjson

    from connectors import KafkaSettings, TopicAdmin, create_producer, producer_config

    settings = KafkaSettings.from_env(brokers=brokers)
    TopicAdmin(settings).ensure_topic(topic, partitions)
    producer = create_producer(producer_config(settings))
    failures: list[object] = []

    def delivered(err: object, _msg: object) -> None:
        if err is not None:
            failures.append(err)

    start = time.monotonic()
    for i, event in enumerate(click_events(records, users=users, seed=seed)):
        key = str(event["user"]).encode()
        while True:
            try:
                producer.produce(topic, orjson.dumps(event), key=key, on_delivery=delivered)
                break
            except BufferError:  # local queue full: let deliveries drain
                producer.poll(0.05)
        if i % 50_000 == 0:
            producer.poll(0)
            if i:
                print(f"  produced {i:,}/{records:,}", file=sys.stderr)
    left = producer.flush(60)
    if left or failures:
        raise RuntimeError(f"{left} records undelivered, first failures: {failures[:3]}")
    return time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--brokers", required=True)
    parser.add_argument("--topic", default="clicks")
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--users", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    took = produce_clicks(
        args.brokers,
        args.topic,
        args.records,
        partitions=args.partitions,
        users=args.users,
        seed=args.seed,
    )
    print(f"wrote {args.records:,} clicks to {args.topic} in {took:.1f}s")


if __name__ == "__main__":
    main()
