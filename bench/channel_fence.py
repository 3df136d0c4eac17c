"""What the zombie fence costs per channel record (issue 35, item 6): a micro-benchmark.

Measures, in the tree it runs in (``PYTHONPATH`` decides; run it in two trees to compare):

* ``read``: a channel task's data path, :meth:`ChannelInputs.read` of a live channel's batch
  of real ``confluent_kafka.Message`` objects (1,000 records, keyed as that tree's writer keys
  them), through a running count into a no-op sink: ns per record;
* ``check``: the fast path's test alone, before (``headers is None and tp not in modes``) and
  now (``headers is None and m.key() == live.get(tp, NOT_LIVE)``), on the same messages in one
  process, so that both see the same machine (minimum over rounds: the noise only adds);
* ``produce``: ``Producer.produce(topic, value, key, partition)`` with ``key=None`` (what the
  channel writer passed before) and with a one-byte key (what it passes now), into librdkafka's
  local queue (no broker: the queue is purged between rounds): ns per record.

``python bench/channel_fence.py [--rounds 15]``; medians of the rounds. Used for
bench/RESULTS.md, "Zombie fencing".
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import orjson
from confluent_kafka import Message, Producer

from processor.compiler import compile_flow
from processor.contracts import SinkContext
from processor.dataflow import Dataflow
from processor.runtime.task import Task, TaskEnv
from processor.snapshot.store import SnapshotStore
from processor.wire import GenerationStart, encode_control

BATCH = 1_000
GENERATION = 3


class _NoSink:
    def open(self, ctx: SinkContext) -> _NoSink:
        return self

    def write(self, values: Sequence[Any]) -> None:
        pass

    def prepare(self, checkpoint_id: int) -> None:
        return None

    def commit(self, checkpoint_id: int, committable: Any) -> None:
        pass

    def recover(self, pending: Sequence[tuple[int, Any]]) -> None:
        pass

    def close(self) -> None:
        pass


class _Reader:
    def open(self, positions: Any, **_kw: Any) -> None:
        self.next = {tp: 0 for tp in positions}

    def positions(self) -> dict[Any, int]:
        return dict(self.next)

    def pause(self, tps: Any) -> None:
        pass

    def resume(self, tps: Any) -> None:
        pass

    def close(self) -> None:
        pass


class _Writer:
    def write(self, *args: Any, **kw: Any) -> None:
        pass


def _key() -> bytes | None:
    """The key this tree's channel writer gives generation ``GENERATION``'s records."""
    try:
        from processor.wire import channel_key  # type: ignore[attr-defined,unused-ignore]
    except ImportError:  # before the fence: no key
        return None
    return channel_key(GENERATION)  # type: ignore[no-any-return,unused-ignore]


def bench_read(rounds: int) -> float:
    flow = Dataflow("bench")
    flow.source("s", "in").key_by("k", lambda v: v).count("count").sink("out", _NoSink())
    plan = compile_flow(flow, 1)
    with TemporaryDirectory() as tmp:
        env = TaskEnv(
            plan=plan,
            generation=GENERATION,
            mode="aligned",
            writer=_Writer(),  # type: ignore[arg-type]
            reader_factory=lambda _group: _Reader(),  # type: ignore[arg-type,return-value]
            store=SnapshotStore(Path(tmp).as_uri()),
            uploads=ThreadPoolExecutor(1),
            fault=lambda _point: None,
            end_offsets=None,
        )
        task = Task(env, plan.stage_of("count"), 0)
        task.open(None, {"in": 1})
        topic = plan.stage_of("count").inputs[0].topic
        key = _key()
        value, headers = encode_control(GenerationStart(GENERATION))
        marker = Message(topic=topic, partition=0, offset=0, key=key, value=value, headers=headers)
        task.inputs.read([marker])  # type: ignore[list-item]
        msgs = [
            Message(
                topic=topic,
                partition=0,
                offset=i + 1,
                key=key,
                value=orjson.dumps([f"user-{i % 1000}", i, 1_700_000_000_000 + i]),
            )
            for i in range(BATCH)
        ]
        assert not task.inputs.modes, "the channel must be live"
        samples = []
        for _ in range(rounds):
            start = time.perf_counter_ns()
            for _ in range(20):
                task.inputs.read(msgs)  # type: ignore[arg-type]
            samples.append((time.perf_counter_ns() - start) / (20 * BATCH))
        assert task.inputs.records_in == 20 * BATCH * rounds, "records were dropped"
        return statistics.median(samples)


def bench_check(rounds: int) -> tuple[float, float]:
    """ns per record of the old and the new fast-path test (loop included in both)."""
    key = bytes([GENERATION])
    tp = ("eosflow.bench.k.count", 0)
    msgs = [Message(topic=tp[0], partition=0, offset=i, key=key, value=b"[]") for i in range(BATCH)]
    modes: dict[Any, int] = {}
    live = {tp: key}
    not_live = object()

    def old() -> int:
        n = 0
        for m in msgs:
            t = (m.topic(), m.partition())
            headers = m.headers()
            if headers is None and t not in modes:
                n += 1
        return n

    def new() -> int:
        n = 0
        for m in msgs:
            t = (m.topic(), m.partition())
            headers = m.headers()
            k = m.key()
            if headers is None and k == live.get(t, not_live):
                n += 1
        return n

    best = {old: float("inf"), new: float("inf")}
    for _ in range(rounds):
        for fn in (old, new):
            start = time.perf_counter_ns()
            for _ in range(20):
                assert fn() == BATCH
            best[fn] = min(best[fn], (time.perf_counter_ns() - start) / (20 * BATCH))
    return best[old], best[new]


def bench_produce(rounds: int, key: bytes | None) -> float:
    producer = Producer(
        {
            "bootstrap.servers": "127.0.0.1:9",  # nothing listens: records stay queued
            "queue.buffering.max.messages": 1_000_000,
            "log_level": 0,
        }
    )
    value = orjson.dumps(["user-1", {"amount": 12, "page": "/a"}, 1_700_000_000_000])
    produce = producer.produce
    samples = []
    for _ in range(rounds):
        start = time.perf_counter_ns()
        for _ in range(20 * BATCH):
            produce("bench-channel", value, key, 0)
        samples.append((time.perf_counter_ns() - start) / (20 * BATCH))
        producer.purge()
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    tree = Path(inspect.getfile(Task)).parents[3]
    print(f"tree {tree} key={_key()!r}")
    print(f"read   ns/record {bench_read(args.rounds):8.1f}")
    old, new = bench_check(args.rounds)
    print(f"check  ns/record before {old:6.1f} now {new:6.1f} (+{new - old:.1f})")
    print(f"produce ns/record key=None {bench_produce(args.rounds, None):8.1f}")
    keyed = bench_produce(args.rounds, bytes([GENERATION]))
    print(f"produce ns/record key=1 B  {keyed:8.1f}")


if __name__ == "__main__":
    main()
