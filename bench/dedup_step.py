"""What the per-key ``dedup`` step costs per record, without I/O, and what bounds it.

The reference job's dedup step (``bench/dedup_job.py``: ``dedup(event_id)`` per user, a horizon
of 5 minutes of event time) does two things per record: the record's ID
(:func:`dedup.ids.pair_id`: orjson of ``[key, id]``, BLAKE2b-128) and the decision
(:meth:`dedup.Deduplicator.check`: Bloom probes, sets). This measures both in one process, on the
job's input shape: ``--records`` clicks of ``examples/clicks.py`` (10 ms of event time apart,
1,000 users) plus 10 % copies of a click 1 to 2,000 clicks earlier, in batches of ``--batch``,
with the watermark ``--lag-s`` behind the newest record (the job's watermark lags 500-660 s: its
source reads the 8 partitions unevenly) and a checkpoint every ``--epoch`` records, against the
in-memory ID store (Redis's CPU is measured by ``bench/dedup_job.py``).

Variants, interleaved per repeat:

* ``native``: the step as it runs where ``pip install`` could compile ``dedup/_native.c``
  (:mod:`dedup.native`): each batch's IDs in one C call, every live filter probed in one;
* ``python``: the step without the C accelerator (``EOSFLOW_NATIVE=0``, or no compiler at
  install): a ``pair_id`` call per record, rbloom filters hashing with ``int.__index__`` (so that
  they can be saved into snapshots), probed one Python call per filter;
* ``builtin-hash``: ``python`` with the filters probed through Python's built-in ``hash``,
  rbloom's fastest path, which rbloom refuses to save (``save_bytes``): the floor of any
  rbloom-based check.

With ``--job-us`` (the CPU per record of the job without dedup, measured by
``bench/dedup_job.py``), it prints the best ratio each variant allows: ``job / (job + ids +
check)``, the dedup step's other costs (its sets and Redis writes at checkpoints, the 10 % fewer
outputs) left out; and the best ratio of a decision that cost nothing, the IDs alone.

    python bench/dedup_step.py --records 300000 --repeats 3 --job-us 3.6
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from rbloom import Bloom

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from clicks import click_events, with_duplicates

import dedup.buckets as buckets
import dedup.native as accel
from dedup import Deduplicator
from dedup.core import MemoryIdStore
from dedup.ids import record_pair_ids
from processor.runtime.supervision.worker import tune_gc

Record = tuple[str, dict[str, Any], int]


def workload(records: int, copies: float, seed: int) -> list[Record]:
    """The job's clicks, keyed by user, with ``copies`` re-sent 1 to 2,000 clicks later (the
    generator ``bench/dedup_job.py`` writes)."""
    sent = with_duplicates(click_events(records, seed=seed), copies, seed=seed)
    return [(str(c["user"]), c, int(str(c["ts_ms"]))) for c in sent]


def run(data: list[Record], *, batch: int, epoch: int, lag_ms: int) -> tuple[float, float]:
    """CPU ns per record of the IDs (the step's ``id=`` function, :func:`record_pair_ids`) and
    of the decisions (:meth:`Deduplicator.check` and the watermark's :meth:`~Deduplicator.advance`,
    once per batch as in a worker; the checkpoints' ``prepare`` and ``commit`` are left out)."""
    dedup = Deduplicator(MemoryIdStore(), within_ms=300_000)
    fn = lambda click: click["event_id"]  # noqa: E731  (the job's id= function)
    ids_s = check_s = 0.0
    clock = time.process_time
    checkpoint = 0
    for start in range(0, len(data), batch):
        part = data[start : start + batch]
        t0 = clock()
        ids = record_pair_ids(part, fn)
        t1 = clock()
        dedup.check(ids, [ts for _k, _c, ts in part])
        dedup.advance(part[-1][2] - lag_ms)
        t2 = clock()
        ids_s += t1 - t0
        check_s += t2 - t1
        if (start + batch) // epoch > checkpoint:
            checkpoint += 1
            dedup.prepare(checkpoint)
            dedup.commit(checkpoint)
    return ids_s / len(data) * 1e9, check_s / len(data) * 1e9


def _builtin_filter(self: buckets.BloomBuckets) -> Bloom:
    return Bloom(self.expected_ids, self.filter_fp)  # hash_func: the built-in hash


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=300_000)
    parser.add_argument("--copies", type=float, default=0.10)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--epoch", type=int, default=50_000, help="records per checkpoint")
    parser.add_argument("--lag-s", type=int, default=600, help="watermark behind the newest")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--job-us", type=float, help="CPU us per record of the job without dedup")
    args = parser.parse_args()
    tune_gc()  # the worker's GC thresholds
    data = workload(args.records, args.copies, seed=7)
    print(f"{len(data):,} records ({args.records:,} distinct)", file=sys.stderr)
    product = buckets.BloomBuckets._new_filter
    variants = {  # name: (the filters' constructor, the C accelerator)
        "native": (product, accel.native),
        "python": (product, None),
        "builtin-hash": (_builtin_filter, None),
    }
    native = accel.native
    if native is None:
        print("dedup/_native.c: not built, or EOSFLOW_NATIVE=0: python only", file=sys.stderr)
        del variants["native"]
    found: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for repeat in range(args.repeats):
        names = list(variants) if repeat % 2 == 0 else list(variants)[::-1]
        for name in names:
            new_filter, accel.native = variants[name]
            buckets.BloomBuckets._new_filter = new_filter  # type: ignore[method-assign]
            gc.collect()
            ids_ns, check_ns = run(
                data, batch=args.batch, epoch=args.epoch, lag_ms=args.lag_s * 1000
            )
            found[name].append((ids_ns, check_ns))
            print(f"repeat={repeat} {name:13s} ids {ids_ns:6.0f} ns  check {check_ns:6.0f} ns",
                  file=sys.stderr)  # fmt: skip
    buckets.BloomBuckets._new_filter = product  # type: ignore[method-assign]
    accel.native = native
    print("| variant | ID ns/record (median) | check ns/record (median) | together | best ratio |")
    print("|---|---:|---:|---:|---:|")
    for name, runs in found.items():
        ids_ns = statistics.median(r[0] for r in runs)
        check_ns = statistics.median(r[1] for r in runs)
        total = ids_ns + check_ns
        bound = (
            f"{args.job_us / (args.job_us + total / 1000):.2f}" if args.job_us is not None else "-"
        )
        print(f"| {name} | {ids_ns:,.0f} | {check_ns:,.0f} | {total:,.0f} | {bound} |")
    if args.job_us is not None:
        for name, runs in found.items():
            ids_ns = statistics.median(r[0] for r in runs)
            print(
                f"\n{name}: the IDs alone ({ids_ns:,.0f} ns per record) allow at most "
                f"{args.job_us / (args.job_us + ids_ns / 1000):.2f}x, with decisions for free."
            )


if __name__ == "__main__":
    main()
