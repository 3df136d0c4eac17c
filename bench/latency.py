"""End-to-end latency of the reference job, eosflow against the hand-written transactional loop
(issue 51): how long a click takes from its produce call to the moment an independent
``read_committed`` reader sees its output.

    EOSFLOW_KAFKA_BROKERS=127.0.0.1:39092 python bench/latency.py [--rate 10000] [--seconds 60]
        [--systems loop-0.1,loop-1,keyed-0.1,keyed-1,shuffled-0.1,shuffled-1,...]

A system may carry its own rate, ``SYSTEM@RATE`` (``--systems loop-0.1@207000,keyed-0.1@133000``):
the issue's second load point is half of each system's own maximum (bench/peers.py's
records/s), which differs per system.

Needs a real Kafka (``EOSFLOW_KAFKA_BROKERS``): Tansu shows a transaction's records to a
``read_committed`` reader before the commit is complete, which is no latency to report.

The job is the reference job (bench/README.md, "The reference job"; ``pipelines/keyed_count.py``:
parse, keep ``amount > 0`` (all clicks), key by user, running (count, amount) per user, one
output per input, transactional ``KafkaSink``). For each system, one after the other:

1. an input topic (8 partitions) and an output topic of its own; the system is started on them
   and given 8 s to start (its start-up is not latency);
2. clicks (``examples/clicks.py``'s generator, keyed by user) are produced at ``--rate`` per
   second for ``--seconds``, in 10 ms slices; the produce call's time is each click's start;
3. a ``read_committed`` consumer in this process reads the output topic: an output ``(user,
   [count, amount])`` is the ``count``-th click of ``user``, so its latency is the time it was
   read minus that click's produce time. Every output must come exactly once (the multiset of
   ``(user, count, amount)`` equals the generator's), else the system is reported wrong;
4. the system is stopped (SIGTERM), its topics deleted.

Systems: ``keyed-X`` / ``shuffled-X``: eosflow, 1 worker, keyed source (no shuffle) or a
``key_by`` shuffle through Kafka, aligned checkpoints every X s (``eosflow run``);
``loop-X``: ``peer_jobs/loop.py transactional`` with a transaction every X s (what Kafka
Streams' exactly-once does); ``quix-X``: Quix Streams, exactly-once, ``commit_interval`` X s;
``bytewax-X``: Bytewax with its recovery store, snapshots every X s (its Kafka sink is not
transactional: outputs are visible when written, at-least-once). The peers run in their own
virtual environments (``bench/peers.py``'s, created on first use with pip). Prints a
Markdown table (p50, p99, max, the records/s the system kept up with)
and writes ``results/latency-<date>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka import Consumer, Producer, TopicPartition

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT / "examples"))

sys.path.insert(0, str(BENCH))

from clicks import click_events  # noqa: E402
from peers import ensure_venv  # noqa: E402

from connectors.admin import TopicAdmin  # noqa: E402
from connectors.config import KafkaSettings  # noqa: E402

PARTITIONS = 8
START_S = 8.0


def _say(text: str) -> None:
    print(f"[{datetime.now():%H:%M:%S}] {text}", file=sys.stderr, flush=True)


def _command(system: str, env: dict[str, str], venvs: Path) -> list[str]:
    kind, interval = system.rsplit("-", 1)
    if kind == "quix":  # Quix Streams, exactly-once, its commit interval
        env["QUIX_COMMIT_S"] = interval
        env["LOOP_FOREVER"] = "1"
        env["STATE_DIR"] = env["EOSFLOW_STATE_DIR"]
        return [str(ensure_venv("quix", venvs)), str(BENCH / "peer_jobs" / "quix_job.py")]
    if kind == "bytewax":  # Bytewax with its recovery store, an epoch (snapshot) every `interval` s
        env["LOOP_FOREVER"] = "1"
        python = ensure_venv("bytewax", venvs)
        store = Path(env["EOSFLOW_STATE_DIR"]) / "recovery"
        store.mkdir(parents=True)
        subprocess.run([str(python), "-m", "bytewax.recovery", str(store), "1"], check=True)
        env["BYTEWAX_EPOCH_S"], env["BYTEWAX_RECOVERY_DIR"] = interval, str(store)
        return [str(python), str(BENCH / "peer_jobs" / "bytewax_job.py")]
    if kind == "loop":
        env["LOOP_COMMIT_S"] = interval
        env["LOOP_FOREVER"] = "1"
        return [sys.executable, str(BENCH / "peer_jobs" / "loop.py"), "transactional"]
    if kind == "keyed":
        env["KEYED_SOURCE"] = "1"
    return [
        sys.executable, "-m", "processor.cli", "run", str(BENCH / "pipelines" / "keyed_count.py"),
        "--workers", "1", "--checkpoint-interval", interval, "--metrics", "off",
    ]  # fmt: skip


class _Reader(threading.Thread):
    """Reads the output topic ``read_committed`` from the start; each output's read time."""

    def __init__(self, brokers: str, topic: str) -> None:
        super().__init__(name="latency-reader", daemon=True)
        self.consumer = Consumer(
            {
                "bootstrap.servers": brokers,
                "group.id": f"latency-{uuid.uuid4().hex[:6]}",
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
                "fetch.wait.max.ms": 10,
                "fetch.queue.backoff.ms": 1,
            }
        )
        self.consumer.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
        self.seen: list[tuple[str, int, int, float]] = []  # (user, count, amount, read at)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for m in self.consumer.consume(10_000, 0.01):
                if m.error() is None:
                    count, amount = orjson.loads(m.value())  # type: ignore[arg-type]
                    key = m.key()
                    assert key is not None
                    self.seen.append((key.decode(), count, amount, time.time()))
        self.consumer.close()


def _produce(brokers: str, topic: str, rate: int, seconds: float) -> dict[tuple[str, int], Any]:
    """Produces ``rate * seconds`` clicks at ``rate`` per second; ``(user, n)`` -> ``[produce
    time, the user's amount sum after its n-th click]`` (what the n-th output must say).

    Every click is generated and encoded before the clock starts, and the timed loop only
    calls ``produce``, 10 ms slices at a time: generating and encoding in the loop (and a
    clock read per click) held the producer at ~55,000 clicks/s on this machine, a quarter of
    the loop's half-maximum rate it was asked for. A click's produce time is its slice's start
    (a slice of 2,000 clicks is produced in about 3 ms)."""
    producer = Producer(
        {
            "bootstrap.servers": brokers,
            "linger.ms": 1,
            "enable.idempotence": True,
            "queue.buffering.max.messages": 1_000_000,
        }
    )
    # Connected and with its producer id before the clock starts: the first clicks' latency
    # was the bench producer's own start-up (640-680 ms in second 0, for every system alike).
    producer.produce(f"{topic}-warm-up", b"warm-up")
    producer.flush(30)
    payloads: list[tuple[bytes, bytes]] = []
    expect: list[tuple[str, int, int]] = []  # (user, n, the user's sum after its n-th click)
    per_user: Counter[str] = Counter()
    sums: Counter[str] = Counter()
    for click in click_events(int(rate * seconds), spacing_ms=1):
        user = str(click["user"])
        per_user[user] += 1
        sums[user] += int(str(click["amount"]))
        payloads.append((orjson.dumps(click), user.encode()))
        expect.append((user, per_user[user], sums[user]))
    total = len(payloads)
    stamps = [0.0] * total
    per_slice = rate / 100
    produce = producer.produce
    began = time.time()
    done = 0
    n = 0
    while done < total:
        n += 1
        upto = min(total, round(n * per_slice))
        now = time.time()
        for value, key in payloads[done:upto]:
            while True:
                try:
                    produce(topic, value, key)
                    break
                except BufferError:  # librdkafka's queue is full: let it drain
                    producer.poll(0.005)
        stamps[done:upto] = [now] * (upto - done)
        done = upto
        producer.poll(0)
        wait = began + n * 0.01 - time.time()
        if wait > 0:
            time.sleep(wait)
    producer.flush(30)
    return {(u, c): [stamps[i], total_sum] for i, (u, c, total_sum) in enumerate(expect)}


def _percentile(xs: list[float], p: float) -> float:
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def _run(system: str, brokers: str, rate: int, seconds: float, venvs: Path) -> dict[str, Any]:
    run = uuid.uuid4().hex[:6]
    inp, out = f"lat-in-{run}", f"lat-out-{run}"
    admin = TopicAdmin(KafkaSettings(brokers=brokers))
    admin.ensure_topic(inp, PARTITIONS)
    admin.ensure_topic(f"{inp}-warm-up", 1)
    admin.ensure_topic(out, PARTITIONS)
    env = {
        **os.environ,
        "EOSFLOW_KAFKA_BROKERS": brokers,
        "BROKERS": brokers,
        "JOB_NAME": f"lat-{system.replace('.', '')}-{run}",
        "CLICKS_TOPIC": inp,
        "INPUT_TOPIC": inp,
        "OUTPUT_TOPIC": out,
        "TXN_PREFIX": f"lat-{run}",
        "RUN_ID": run,
        "EOSFLOW_STATE_DIR": str(Path(os.environ.get("TMPDIR", "/tmp")) / f"lat-{run}"),
    }
    cmd = _command(system, env, venvs)
    log = open(Path(env["EOSFLOW_STATE_DIR"] + ".log"), "w")  # noqa: SIM115
    cwd = BENCH / "peer_jobs" if system.startswith("bytewax") else ROOT
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
    reader = _Reader(brokers, out)
    reader.start()
    try:
        time.sleep(START_S)
        if proc.poll() is not None:
            raise RuntimeError(f"{system} exited at start (code {proc.returncode}): {log.name}")
        began = time.time()
        sent = _produce(brokers, inp, rate, seconds)
        times = [t for t, _sum in sent.values()]
        produced_s = max(times) - min(times)  # the producer's warm-up not included
        deadline = time.time() + 60
        while len(reader.seen) < len(sent) and time.time() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # anything extra (a duplicate) shows in the count
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        reader.stop.set()
        reader.join(10)
        log.close()
    got = Counter((u, c, a) for u, c, a, _t in reader.seen)
    want = Counter((u, c, a) for (u, c), (_t, a) in sent.items())
    missing, extra = sum((want - got).values()), sum((got - want).values())
    lat = sorted(t - sent[(u, c)][0] for u, c, _a, t in reader.seen if (u, c) in sent)
    # where the tail is: each second of producing's p99 and max (a stall shows as one second)
    by_second: dict[int, list[float]] = {}
    for u, c, _a, t in reader.seen:
        if (u, c) in sent:
            at = sent[(u, c)][0]
            by_second.setdefault(int(at - began), []).append(t - at)
    seconds_p99 = [
        [s, round(1000 * _percentile(sorted(xs), 0.99), 1), round(1000 * max(xs), 1)]
        for s, xs in sorted(by_second.items())
    ]
    result = {
        "system": system,
        "rate": rate,
        "seconds": seconds,
        "produced_per_s": len(sent) / produced_s,
        "outputs": len(reader.seen),
        "missing": missing,
        "extra": extra,
        "p50_ms": 1000 * _percentile(lat, 0.50) if lat else None,
        "p99_ms": 1000 * _percentile(lat, 0.99) if lat else None,
        "max_ms": 1000 * lat[-1] if lat else None,
        "mean_ms": 1000 * statistics.fmean(lat) if lat else None,
        "per_second": seconds_p99,  # [second of producing, p99 ms, max ms]
    }
    worst = sorted(seconds_p99, key=lambda x: -x[2])[:3]
    _say(f"{system}: worst seconds [second, p99 ms, max ms]: {worst}")
    try:
        admin.delete_topics([inp, out, f"{inp}-warm-up"])
    except Exception as exc:  # a bench leaves a topic behind, no more
        _say(f"could not delete {inp}, {out}: {exc}")
    _say(json.dumps(result))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument(
        "--systems",
        default="loop-0.1,loop-1,keyed-0.1,keyed-0.25,keyed-1,shuffled-0.1,shuffled-0.25,shuffled-1",
    )
    parser.add_argument("--out", type=Path, default=BENCH / "results")
    parser.add_argument(
        "--venvs", type=Path, default=BENCH / ".venvs", help="the peers' virtual environments"
    )
    args = parser.parse_args()
    brokers = os.environ.get("EOSFLOW_KAFKA_BROKERS")
    if not brokers:
        parser.error("set EOSFLOW_KAFKA_BROKERS to a real Kafka (../shared/kafka/4.3.1/start.sh)")
    started = datetime.now()
    runs = []
    for named in args.systems.split(","):
        system, _, rate = named.partition("@")
        runs.append(_run(system, brokers, int(rate or args.rate), args.seconds, args.venvs))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"latency-{started:%Y%m%d-%H%M%S}.json"
    config = {k: str(v) for k, v in vars(args).items()}
    path.write_text(json.dumps({"config": config, "runs": runs}, indent=1))
    print("| system | rate | p50 ms | p99 ms | max ms | kept up (records/s) | output |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in runs:
        ok = (
            "exactly once"
            if r["missing"] == r["extra"] == 0
            else (f"WRONG: {r['missing']} missing, {r['extra']} extra")
        )
        print(
            f"| {r['system']} | {r['rate']:,} | {r['p50_ms'] or float('nan'):,.0f} | "
            f"{r['p99_ms'] or float('nan'):,.0f} | {r['max_ms'] or float('nan'):,.0f} | "
            f"{r['produced_per_s']:,.0f} | {ok} |"
        )
    print(f"\nresults: {path}")
    return 0 if all(r["missing"] == r["extra"] == 0 for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
