"""Rows/s into an Iceberg table and a Delta table against the file sink on the same job, and
the commit latency per checkpoint (docs/sink-lakehouse.md, "Measurements").

Two parts:

1. **job**: ``bench/pipelines/lake_sink.py`` (every click one row) on the local runner,
   ``--workers`` workers, aligned checkpoints every ``--interval`` s, until idle, once per sink
   (``file``: JSON lines, ``iceberg``, ``delta``), interleaved over ``--repeats`` rounds (reversed
   on odd rounds). Rows/s = clicks / wall time of the run. Each table is read back by its own
   reader and must hold every click once.
2. **commit**: the sinks' writers driven directly (no engine): two subtasks, epochs of
   ``--epoch`` rows (half each), per epoch ``write``, ``prepare`` on both (what a barrier does),
   then ``commit`` on both (subtask 0 commits the table). Prints the median and 90th percentile
   of ``prepare`` (data files + manifest) and ``commit`` per checkpoint.

Starts an embedded broker unless ``EOSFLOW_KAFKA_BROKERS`` is set.

    python bench/lakehouse.py --records 200000 --repeats 2
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

from clicks import click_events, produce_clicks  # noqa: E402

from processor.contracts import SinkContext  # noqa: E402
from processor.embedded import servers  # noqa: E402
from processor.runtime.supervision.local import LocalRunner, RunOptions  # noqa: E402

SINKS = ("file", "iceberg", "delta")
PIPELINE = str(ROOT / "bench" / "pipelines" / "lake_sink.py")


def run_job(kind: str, brokers: str, topic: str, work: Path, args: argparse.Namespace) -> dict:
    run_id = uuid.uuid4().hex[:6]
    lake = work / f"{kind}-{run_id}"
    env = {
        "JOB_NAME": f"bench-lake-{kind}-{run_id}",
        "CLICKS_TOPIC": topic,
        "LAKE_DIR": str(lake),
        "LAKE_SINK": kind,
        "EOSFLOW_KAFKA_BROKERS": brokers,
    }
    os.environ.update(env)
    options = RunOptions(
        workers=args.workers,
        checkpoint_interval=args.interval,
        mode="aligned",
        until_idle=True,
        environ=env,
        state_dir=str(work / "state"),
        metrics="off",
    )
    result = LocalRunner(PIPELINE, options).run()
    got = read_back(kind, lake)
    want = Counter(c["event_id"] for c in click_events(args.records))
    exact = got == want
    rate = result.records_in / result.seconds
    print(
        f"job sink={kind:8s} {result.records_in:,} rows in {result.seconds:.1f}s "
        f"({rate:,.0f} rows/s) checkpoints={result.checkpoints} exact={exact}",
        flush=True,
    )
    return {"sink": kind, "rows": result.records_in, "seconds": result.seconds,
            "rows_per_s": rate, "checkpoints": result.checkpoints, "exact": exact}  # fmt: skip


def read_back(kind: str, lake: Path) -> Counter[str]:
    from sinks import read_delta, read_iceberg, read_jsonl

    if kind == "file":
        return Counter(r["event_id"] for r in read_jsonl(str(lake / "files")))
    if kind == "iceberg":
        catalog = {"type": "sql", "uri": f"sqlite:///{lake}/catalog.db"}
        table = read_iceberg("bench.clicks", catalog=catalog)
    else:
        table = read_delta(str(lake / "delta"))
    return Counter(table["event_id"].to_pylist())


def commit_latency(kind: str, work: Path, args: argparse.Namespace) -> dict:
    """Two subtasks' writers: per epoch write, prepare both, commit both; times in ms."""
    sys.path.insert(0, str(ROOT / "bench" / "pipelines"))
    lake = work / f"writer-{kind}-{uuid.uuid4().hex[:6]}"
    os.environ.update(LAKE_DIR=str(lake), LAKE_SINK=kind, JOB_NAME="bench", CLICKS_TOPIC="x")
    import importlib

    import lake_sink

    importlib.reload(lake_sink)
    sink = lake_sink.sink()
    if hasattr(sink, "preflight"):
        sink.preflight(job="bench", checkpoint_interval=1.0)
    snapshots = f"file://{lake}/snapshots"
    writers = [sink.open(SinkContext("bench", "out", s, 2, 1, snapshot_url=snapshots))
               for s in range(2)]  # fmt: skip
    for w in writers:
        w.recover([])
    rows = list(click_events(args.epoch * args.epochs))  # the sink's to_record makes the row
    prepare_ms, commit_ms = [], []
    began = time.perf_counter()
    for n in range(1, args.epochs + 1):
        epoch = rows[(n - 1) * args.epoch : n * args.epoch]
        half = len(epoch) // 2
        writers[0].write(epoch[:half])
        writers[1].write(epoch[half:])
        t0 = time.perf_counter()
        committables = [w.prepare(n) for w in writers]
        t1 = time.perf_counter()
        for w, c in zip(writers, committables, strict=True):
            w.commit(n, c)
        t2 = time.perf_counter()
        prepare_ms.append((t1 - t0) * 1000)
        commit_ms.append((t2 - t1) * 1000)
    total = time.perf_counter() - began
    out = {
        "sink": kind,
        "epoch_rows": args.epoch,
        "epochs": args.epochs,
        "rows_per_s": args.epoch * args.epochs / total,
        "prepare_ms_median": statistics.median(prepare_ms),
        "prepare_ms_p90": sorted(prepare_ms)[int(0.9 * (len(prepare_ms) - 1))],
        "commit_ms_median": statistics.median(commit_ms),
        "commit_ms_p90": sorted(commit_ms)[int(0.9 * (len(commit_ms) - 1))],
    }
    print(
        f"writer sink={kind:8s} {out['rows_per_s']:,.0f} rows/s  prepare median "
        f"{out['prepare_ms_median']:.1f} ms (p90 {out['prepare_ms_p90']:.1f})  commit median "
        f"{out['commit_ms_median']:.1f} ms (p90 {out['commit_ms_p90']:.1f})",
        flush=True,
    )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--interval", type=float, default=1.0, help="checkpoint interval, s")
    parser.add_argument("--epoch", type=int, default=20_000, help="rows per epoch (commit part)")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--skip-job", action="store_true")
    args = parser.parse_args()
    jobs: list[dict[str, Any]] = []
    writers: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="eosflow-bench-lake-") as tmp:
        work = Path(tmp)
        if not args.skip_job:
            with servers(["kafka"]) as endpoints:
                brokers = endpoints.kafka_brokers
                assert brokers is not None
                topic = f"bench-lake-clicks-{uuid.uuid4().hex[:6]}"
                produce_clicks(brokers, topic, args.records)
                for r in range(args.repeats):
                    for kind in SINKS if r % 2 == 0 else tuple(reversed(SINKS)):
                        jobs.append(run_job(kind, brokers, topic, work, args))
        for kind in SINKS:
            writers.append(commit_latency(kind, work, args))
    summary = {
        k: statistics.median(j["rows_per_s"] for j in jobs if j["sink"] == k)
        for k in SINKS
        if any(j["sink"] == k for j in jobs)
    }
    if summary:
        print("\n| sink | rows/s (median) | vs file sink |\n|---|---|---|")
        for k, rate in summary.items():
            print(f"| {k} | {rate:,.0f} | {rate / summary['file']:.2f} |")
    print("\n| sink | writer rows/s | prepare ms median (p90) | commit ms median (p90) |")
    print("|---|---|---|---|")
    for w in writers:
        print(
            f"| {w['sink']} | {w['rows_per_s']:,.0f} | {w['prepare_ms_median']:.1f} "
            f"({w['prepare_ms_p90']:.1f}) | {w['commit_ms_median']:.1f} "
            f"({w['commit_ms_p90']:.1f}) |"
        )
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = ROOT / "bench" / "results" / f"lakehouse-{stamp}.json"
    out.write_text(json.dumps({"args": vars(args), "jobs": jobs, "writers": writers,
                               "cpus": os.cpu_count()}, indent=1))  # fmt: skip
    print(f"\nwrote {out}")
    return 0 if all(j["exact"] for j in jobs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
