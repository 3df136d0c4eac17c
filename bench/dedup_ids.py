"""Dedup throughput (IDs per second per core) and Redis round trips per 1,000 records.

One :class:`dedup.Deduplicator` checks ``--ids`` record IDs in batches of ``--batch`` (the
engine's batch size) against a real Redis (embedded unless ``EOSFLOW_REDIS_URL`` is set), with
a checkpoint (``prepare`` + ``commit``) every ``--epoch`` IDs and the watermark advancing with
the records' timestamps, for 0 %, 1 % and 10 % duplicates (a copy repeats an ID of the last
``--dup-distance`` records, as a re-sending producer does). Strategies, interleaved per repeat:

* ``bloom``: the deduplicator (Bloom filters, recent-ID set, one store round trip per batch for
  the remaining filter hits, IDs written once per epoch);
* ``batched``: no filter: every ID of every batch looked up in Redis (one round trip per batch),
  new IDs written once per epoch;
* ``per-id``: no filter, no batching: one lookup round trip per ID (counted on a sample: it is
  what the round-trip target compares with).

IDs/s per core = IDs / CPU seconds of this process (``time.process_time``), so Redis's own CPU
on the shared machine is not charged to the deduplicator; wall-clock rates are printed too.
Hashing business IDs (``value_id``) is measured apart.

    python bench/dedup_ids.py --ids 500000 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import timeit
import uuid
from pathlib import Path
from typing import Any

from dedup import Deduplicator, RedisIdStore, value_id
from dedup.store import encode_tag, redis_client
from processor.embedded import servers

DUP_RATES = (0.0, 0.01, 0.10)
BASE_TS = 1_700_000_000_000
RATE = 1000  # IDs per second of event time: a run of 300,000 IDs spans 5 horizons of 60 s
WITHIN_MS = 60_000


def workload(ids: int, dup: float, distance: int, seed: int) -> tuple[list[int], list[int]]:
    """IDs with a share ``dup`` of copies of recent ones, and their timestamps (``RATE`` per
    second of event time)."""
    rng = random.Random(seed)
    out: list[int] = []
    stamps: list[int] = []
    for i in range(ids):
        if out and rng.random() < dup:
            j = max(0, len(out) - 1 - rng.randrange(distance))
            out.append(out[j])
            stamps.append(stamps[j])
        else:
            out.append(rng.getrandbits(127))
            stamps.append(BASE_TS + i * 1000 // RATE)
    return out, stamps


def run_bloom(
    client: Any, data: tuple[list[int], list[int]], batch: int, epoch: int, bucket_ms: int
) -> dict:
    store = RedisIdStore(client, f"bench:dedup:{uuid.uuid4().hex[:8]}")
    # filters sized for what a bucket really holds, so their false-positive rate is the target
    d = Deduplicator(
        store, within_ms=WITHIN_MS, bucket_ms=bucket_ms, expected_ids=RATE * bucket_ms // 1000
    )
    ids, stamps = data
    dropped = 0
    cpu, wall = time.process_time(), time.perf_counter()
    checkpoint = 0
    for start in range(0, len(ids), batch):
        new = d.check(ids[start : start + batch], stamps[start : start + batch])
        dropped += new.count(False)
        d.advance(stamps[min(start + batch, len(ids)) - 1] - 1000)
        if (start + batch) % epoch < batch:
            checkpoint += 1
            d.prepare(checkpoint)
            d.snapshot()
            d.commit(checkpoint)
    checkpoint += 1
    d.prepare(checkpoint)
    result = _result(len(ids), dropped, store.round_trips, d.stats.lookups, cpu, wall)
    store.clear()
    return result


def run_batched(
    client: Any, data: tuple[list[int], list[int]], batch: int, epoch: int, bucket_ms: int
) -> dict:
    """Every ID looked up in the store: one HMGET round trip per batch, writes per epoch."""
    store = RedisIdStore(client, f"bench:dedup:{uuid.uuid4().hex[:8]}")
    ids, stamps = data
    tag = encode_tag(1, 1)
    pending: dict[int, list[int]] = {}
    pending_set: set[int] = set()
    dropped = lookups = 0
    cpu, wall = time.process_time(), time.perf_counter()
    for start in range(0, len(ids), batch):
        chunk, ts = ids[start : start + batch], stamps[start : start + batch]
        low = ts[-1] - WITHIN_MS - 1000
        live = sorted({t - t % bucket_ms for t in ts} | {b for b in pending if b >= low})
        lookups += len(chunk)
        found = store.lookup(live, chunk)
        for x, t, tags in zip(chunk, ts, found, strict=True):
            if tags or x in pending_set:
                dropped += 1
                continue
            pending.setdefault(t - t % bucket_ms, []).append(x)
            pending_set.add(x)
        if (start + batch) % epoch < batch:
            store.insert(pending, tag)
            pending, pending_set = {}, set()
    store.insert(pending, tag)
    result = _result(len(ids), dropped, store.round_trips, lookups, cpu, wall)
    store.clear()
    return result


def _result(n: int, dropped: int, trips: int, lookups: int, cpu: float, wall: float) -> dict:
    cpu_s = time.process_time() - cpu
    wall_s = time.perf_counter() - wall
    return {
        "ids": n,
        "dropped": dropped,
        "ids_per_cpu_s": n / cpu_s,
        "ids_per_wall_s": n / wall_s,
        "round_trips_per_1000": trips * 1000 / n,
        "ids_sent_per_1000": lookups * 1000 / n,
    }


def per_id_round_trip_us(client: Any, sample: int = 2000) -> float:
    """Latency of one lookup round trip (what the per-ID strategy pays for every record)."""
    key = f"bench:dedup:{uuid.uuid4().hex[:8]}"
    fields = [random.getrandbits(127).to_bytes(16, "little") for _ in range(sample)]
    start = time.perf_counter()
    for f in fields:
        client.hmget(key, [f])
    return (time.perf_counter() - start) / sample * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ids", type=int, default=300_000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--epoch", type=int, default=100_000, help="IDs per checkpoint")
    parser.add_argument("--dup-distance", type=int, default=5_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-s", type=int, default=30, help="dedup bucket (within: 60 s)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    hash_ns = timeit.timeit(lambda: value_id("c-7-123456"), number=200_000) / 200_000 * 1e9
    runs: list[dict] = []
    with servers(["redis"]) as endpoints:
        client = redis_client(endpoints.redis_url)
        rtt_us = per_id_round_trip_us(client)
        for repeat in range(args.repeats):
            for dup in DUP_RATES if repeat % 2 == 0 else DUP_RATES[::-1]:
                data = workload(args.ids, dup, args.dup_distance, seed=repeat)
                for name, fn in (("bloom", run_bloom), ("batched", run_batched)):
                    r = fn(client, data, args.batch, args.epoch, args.bucket_s * 1000)
                    r.update(strategy=name, dup=dup, repeat=repeat)
                    runs.append(r)
                    print(
                        f"repeat={repeat} dup={dup:.0%} {name:8s} "
                        f"{r['ids_per_cpu_s']:>10,.0f} IDs/cpu-s {r['ids_per_wall_s']:>10,.0f} "
                        f"IDs/s  round trips/1000={r['round_trips_per_1000']:.3f} "
                        f"IDs sent/1000={r['ids_sent_per_1000']:.1f} dropped={r['dropped']}",
                        file=sys.stderr,
                    )
        client.close()
    print(f"\nvalue_id hashing: {hash_ns:.0f} ns per ID; one lookup round trip: {rtt_us:.0f} us\n")
    print(
        "| duplicates | strategy | IDs/s per core (median) | IDs/s wall | round trips / 1,000 "
        "| IDs sent to Redis / 1,000 | vs per-ID round trips |"
    )
    print("|---|---|---|---|---|---|---|")
    for dup in DUP_RATES:
        for name in ("bloom", "batched"):
            rs = [r for r in runs if r["dup"] == dup and r["strategy"] == name]
            trips = statistics.median(r["round_trips_per_1000"] for r in rs)
            print(
                f"| {dup:.0%} | {name} | {statistics.median(r['ids_per_cpu_s'] for r in rs):,.0f} "
                f"| {statistics.median(r['ids_per_wall_s'] for r in rs):,.0f} | {trips:.2f} "
                f"| {statistics.median(r['ids_sent_per_1000'] for r in rs):.1f} "
                f"| {100 * (1 - trips / 1000):.1f} % fewer |"
            )
        print(
            f"| {dup:.0%} | per-id | (one {rtt_us:.0f} us round trip per ID) | "
            f"{1e6 / rtt_us:,.0f} | 1000 | 1000 | - |"
        )
    os.makedirs(args.out, exist_ok=True)
    path = Path(args.out) / f"dedup-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(
        json.dumps(
            {"args": vars(args), "hash_ns": hash_ns, "rtt_us": rtt_us, "runs": runs}, indent=1
        )
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
