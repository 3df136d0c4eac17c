"""A deterministic user table (profile rows, plan changes, deletions) for the clicks of
``clicks.py``, and the rows a click must be joined with, computed here without the engine.

Every user of ``click_events(records, users=...)`` gets a profile ``{"user", "plan",
"country", "ts_ms"}``: most from a minute before the first click, some only from a random time
during the clicks (earlier clicks find no row). About half change plan once or twice during the
clicks, and one in twenty is deleted (a tombstone: a record with a null value) at some point.
The rows are written keyed by user, in time order, each with its ``ts_ms`` as the Kafka
timestamp (a tombstone has no value: the table takes its time from the Kafka timestamp).

    python examples/users.py --brokers 127.0.0.1:9092 --topic users --records 100000
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from bisect import bisect_right
from collections.abc import Iterable
from typing import Any

PLANS = ("free", "pro", "team")
COUNTRIES = ("de", "fr", "in", "jp", "us")
BASE_MS = 1_700_000_000_000  # click_events' first click

#: One version of a user's row: (user, row or None for a deletion, ts_ms).
Version = tuple[str, dict[str, Any] | None, int]


def user_versions(records: int, *, users: int = 1000, seed: int = 7) -> list[Version]:
    """The table's updates, in time order (the order they are written in)."""
    rng = random.Random(seed + 2)
    end = BASE_MS + records * 10  # click_events spans records * 10 ms
    out: list[Version] = []

    def row(user: str, ts: int) -> dict[str, Any]:
        plan, country = rng.choice(PLANS), rng.choice(COUNTRIES)
        return {"user": user, "plan": plan, "country": country, "ts_ms": ts}

    for u in range(users):
        user = f"user-{u:05d}"
        t = BASE_MS - 60_000 if rng.random() < 0.9 else rng.randrange(BASE_MS, end)
        out.append((user, row(user, t), t))
        for _ in range(rng.choice((0, 0, 1, 2))):
            if t >= end:  # an update at the last instant: none can follow (any other seed's
                break  # versions are unchanged: the draw below happens as before)
            t = rng.randrange(t + 1, end + 1)
            out.append((user, row(user, t), t))
        if rng.random() < 0.05:
            t = rng.randrange(t + 1, end + 2)
            out.append((user, None, t))
    out.sort(key=lambda v: v[2])
    return out


class RowsAt:
    """``rows.at(user, t)``: the row a join gives a click of ``user`` at ``t`` (the newest
    version at or before ``t``; ``None`` when there is none or it was deleted)."""

    def __init__(self, versions: Iterable[Version]) -> None:
        self._times: dict[str, list[int]] = {}
        self._rows: dict[str, list[dict[str, Any] | None]] = {}
        for user, row, ts in versions:  # in time order
            self._times.setdefault(user, []).append(ts)
            self._rows.setdefault(user, []).append(row)

    def at(self, user: str, t: int) -> dict[str, Any] | None:
        times = self._times.get(user)
        if not times:
            return None
        i = bisect_right(times, t)
        return self._rows[user][i - 1] if i else None


def produce_users(
    brokers: str, topic: str, versions: list[Version], *, partitions: int = 8
) -> float:
    """Create ``topic`` (compacted where the broker allows) and write ``versions``, keyed by
    user, with their times as Kafka timestamps; returns seconds taken."""
    import orjson

    from connectors import KafkaSettings, TopicAdmin, create_producer, producer_config

    settings = KafkaSettings.from_env(brokers=brokers)
    admin = TopicAdmin(settings)
    try:
        admin.ensure_topic(topic, partitions, {"cleanup.policy": "compact"})
    except Exception as exc:  # a broker without compaction (Tansu): a plain topic reads the same
        print(f"  {topic}: no compacted topic ({exc}); a plain one", file=sys.stderr)
        admin.ensure_topic(topic, partitions)
    producer = create_producer(producer_config(settings))
    failures: list[object] = []

    def delivered(err: object, _msg: object) -> None:
        if err is not None:
            failures.append(err)

    start = time.monotonic()
    for user, row, ts in versions:
        value = None if row is None else orjson.dumps(row)
        while True:
            try:
                producer.produce(
                    topic, value, key=user.encode(), timestamp=ts, on_delivery=delivered
                )
                break
            except BufferError:
                producer.poll(0.05)
    left = producer.flush(60)
    if left or failures:
        raise RuntimeError(f"{left} rows undelivered, first failures: {failures[:3]}")
    return time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--brokers", required=True)
    parser.add_argument("--topic", default="users")
    parser.add_argument("--records", type=int, default=100_000, help="the clicks' count")
    parser.add_argument("--users", type=int, default=1000)
    args = parser.parse_args()
    versions = user_versions(args.records, users=args.users)
    took = produce_users(args.brokers, args.topic, versions)
    print(f"wrote {len(versions):,} user rows to {args.topic} in {took:.1f}s")


if __name__ == "__main__":
    main()
