"""The hand-written loops of ``bench/operators.py``: a tumbling window and a temporal join.

    python bench/peer_jobs/operator_loop.py window|join

Both are ``loop.py``'s ``transactional`` mode around another computation: one process reads
every partition (assigned, no group join) with confluent-kafka, parses with orjson, and writes
one transaction per second holding the outputs and the consumer's positions
(``send_offsets_to_transaction``). They compute what ``pipelines/window_count.py`` and
``pipelines/temporal_join.py`` compute, with the same event-time rules:

* ``window``: (count, amount sum) per user and tumbling 10 s window of ``ts_ms``; the watermark
  is the smallest, over the partitions not at their end, of the newest ``ts_ms`` read minus
  1 s; a window ``[start, end)`` fires when the watermark reaches ``end - 1``: key user, value
  ``{"start_ms", "end_ms", "value": [count, sum]}``. At the end of the input every open window
  fires (as a drained eosflow run does).
* ``join``: the clicks and the user table ``USERS_TOPIC`` (JSON rows, a null value deletes the
  row, the Kafka timestamp is the row's time) read together. A click waits in a heap until the
  watermark reaches its ``ts_ms``, then takes the user's newest version at or before it: key
  user, value ``[event_id, amount, plan or null]``. A table partition holds the watermark back
  until it has reached its end (as eosflow's table source does).

Exactly once without a state store: the state lives in memory only, so the offsets committed
with a transaction are, per partition, those of the oldest record whose output is not yet
written (the first record of the oldest open window; the oldest click still waiting), and the
table is read again from its start after a restart. A restarted loop replays what its lost
state held, and nothing it had already written. (Not crash-tested: this is a comparator.)
"""

from __future__ import annotations

import heapq
import os
import sys
import time
from bisect import bisect_right
from collections.abc import Callable
from typing import Any

import orjson
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Producer, TopicPartition

_BATCH = 10_000
_COMMIT_S = 1.0
_WINDOW_MS = 10_000
_OUT_OF_ORDER_MS = 1_000
_MIN = -(2**63)
_MAX = 2**63 - 1


class Transactions:
    """The consumer of the input and a transactional producer; ``tick`` commits one
    transaction a second with the offsets ``offsets()`` gives."""

    def __init__(self, mode: str) -> None:
        brokers, run_id = os.environ["BROKERS"], os.environ["RUN_ID"]
        self.topic, self.out = os.environ["INPUT_TOPIC"], os.environ["OUTPUT_TOPIC"]
        self.consumer = Consumer(
            {
                "bootstrap.servers": brokers,
                "group.id": f"operators-loop-{mode}-{run_id}",
                "enable.auto.commit": False,
                "enable.partition.eof": True,
                "isolation.level": "read_committed",
                "fetch.queue.backoff.ms": 10,
            }
        )
        self.producer = Producer(
            {
                "bootstrap.servers": brokers,
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 5,
                "transactional.id": f"operators-loop-{mode}-{run_id}",
            }
        )
        self.producer.init_transactions(30)
        self.producer.begin_transaction()
        self.last = time.monotonic()

    def partitions(self, topic: str) -> list[int]:
        return sorted(self.consumer.list_topics(topic, timeout=30).topics[topic].partitions)

    def send(self, key: str, value: Any) -> None:
        data, k = orjson.dumps(value), key.encode()
        while True:
            try:
                self.producer.produce(self.out, data, k)
                return
            except BufferError:  # local queue full: serve deliveries, then retry
                self.producer.poll(0.05)

    def tick(self, offsets: Callable[[], dict[int, int]], *, final: bool = False) -> None:
        self.producer.poll(0)
        now = time.monotonic()
        if not final and now - self.last < _COMMIT_S:
            return
        self.last = now
        committed = [TopicPartition(self.topic, p, o) for p, o in offsets().items()]
        if committed:
            metadata = self.consumer.consumer_group_metadata()
            self.producer.send_offsets_to_transaction(committed, metadata, 30)
        self.producer.commit_transaction(60)
        if not final:
            self.producer.begin_transaction()


def window(io: Transactions) -> None:
    topic, size, send = io.topic, _WINDOW_MS, io.send
    parts = io.partitions(topic)
    io.consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
    windows: dict[int, dict[str, list[int]]] = {}  # window end -> user -> [count, sum]
    firsts: dict[int, dict[int, int]] = {}  # window end -> partition -> its first offset there
    current: dict[int, int] = {}  # partition -> the window end of its last record
    newest = dict.fromkeys(parts, _MIN)  # partition -> newest ts_ms read
    positions: dict[int, int] = {}
    at_end: set[int] = set()
    watermark, late = _MIN, 0
    loads, eof = orjson.loads, KafkaError._PARTITION_EOF

    def fire(upto: int) -> None:
        for end in sorted(e for e in windows if e - 1 <= upto):
            start = end - size
            firsts.pop(end, None)
            for user, acc in windows.pop(end).items():
                send(user, {"start_ms": start, "end_ms": end, "value": acc})

    def offsets() -> dict[int, int]:
        out = dict(positions)
        for first in firsts.values():
            for p, offset in first.items():
                if offset < out[p]:
                    out[p] = offset
        return out

    while len(at_end) < len(parts):
        for msg in io.consumer.consume(_BATCH, 0.1):
            err = msg.error()
            if err is not None:
                if err.code() == eof:
                    at_end.add(msg.partition())
                    continue
                raise RuntimeError(f"window loop consumer: {err}")
            p, offset = msg.partition(), msg.offset()
            positions[p] = offset + 1
            click = loads(msg.value())
            t = click["ts_ms"]
            end = t - t % size + size
            if end - 1 <= watermark:
                late += 1
                continue
            if t > newest[p]:
                newest[p] = t
            if current.get(p) != end:
                current[p] = end
                firsts.setdefault(end, {}).setdefault(p, offset)
            bucket = windows.get(end)
            if bucket is None:
                bucket = windows[end] = {}
            user = click["user"]
            acc = bucket.get(user)
            if acc is None:
                bucket[user] = [1, click["amount"]]
            else:
                acc[0] += 1
                acc[1] += click["amount"]
        live = [newest[p] for p in parts if p not in at_end]
        wm = min(live) - _OUT_OF_ORDER_MS if live else _MAX
        if wm > watermark:
            watermark = wm
            fire(watermark)
        io.tick(offsets)
    fire(_MAX)
    io.tick(offsets, final=True)
    if late:
        print(f"window loop: {late:,} late clicks dropped", file=sys.stderr)


def join(io: Transactions) -> None:
    topic, table, send = io.topic, os.environ["USERS_TOPIC"], io.send
    parts, table_parts = io.partitions(topic), io.partitions(table)
    io.consumer.assign(
        [TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts]
        + [TopicPartition(table, p, OFFSET_BEGINNING) for p in table_parts]
    )
    versions: dict[str, tuple[list[int], list[Any]]] = {}  # user -> (times, plans)
    held: list[tuple[int, int, int, str, str, int]] = []  # (ts, partition, offset, user, ...)
    newest = {(topic, p): _MIN for p in parts} | {(table, p): _MIN for p in table_parts}
    positions: dict[int, int] = {}
    at_end: set[tuple[str, int]] = set()
    watermark = _MIN
    loads, eof, push, pop = orjson.loads, KafkaError._PARTITION_EOF, heapq.heappush, heapq.heappop

    def plan_at(user: str, t: int) -> Any:
        found = versions.get(user)
        if found is None:
            return None
        i = bisect_right(found[0], t)
        return found[1][i - 1] if i else None

    def offsets() -> dict[int, int]:
        out = dict(positions)
        for _t, p, offset, *_ in held:
            if offset < out[p]:
                out[p] = offset
        return out

    while len(at_end) < len(newest):
        for msg in io.consumer.consume(_BATCH, 0.1):
            err = msg.error()
            if err is not None:
                if err.code() == eof:
                    at_end.add((msg.topic(), msg.partition()))
                    continue
                raise RuntimeError(f"join loop consumer: {err}")
            p, offset = msg.partition(), msg.offset()
            if msg.topic() == table:
                t, value = msg.timestamp()[1], msg.value()
                plan = None if value is None else loads(value)["plan"]
                times, plans = versions.setdefault(msg.key().decode(), ([], []))
                i = bisect_right(times, t)
                if i and times[i - 1] == t:
                    plans[i - 1] = plan  # one time, one version: the later update wins
                else:
                    times.insert(i, t)
                    plans.insert(i, plan)
                if t > newest[(table, p)]:
                    newest[(table, p)] = t
                continue
            positions[p] = offset + 1
            click = loads(msg.value())
            t, user = click["ts_ms"], click["user"]
            if t <= watermark:  # behind the watermark: the versions it needs have come
                send(user, [click["event_id"], click["amount"], plan_at(user, t)])
                continue
            push(held, (t, p, offset, user, click["event_id"], click["amount"]))
            if t - _OUT_OF_ORDER_MS > newest[(topic, p)]:
                newest[(topic, p)] = t - _OUT_OF_ORDER_MS
        live = [ts for tp, ts in newest.items() if tp not in at_end]
        wm = min(live) if live else _MAX
        if wm > watermark:
            watermark = wm
            while held and held[0][0] <= watermark:
                t, _p, _o, user, event_id, amount = pop(held)
                send(user, [event_id, amount, plan_at(user, t)])
        io.tick(offsets)
    while held:
        t, _p, _o, user, event_id, amount = pop(held)
        send(user, [event_id, amount, plan_at(user, t)])
    io.tick(offsets, final=True)


def main() -> None:
    mode = sys.argv[1]
    if mode not in ("window", "join"):
        raise SystemExit(f"operator_loop.py: mode must be window or join, got {mode!r}")
    io = Transactions(mode)
    (window if mode == "window" else join)(io)
    io.consumer.close()


if __name__ == "__main__":
    main()
