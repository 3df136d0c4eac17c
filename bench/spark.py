"""The Spark runner next to the local runner: start-up, recovery and steady-state throughput,
on ``local[2]`` and on a standalone cluster.

    python bench/spark.py [--records 1000000] [--repeats 3] [--recovery-records 1000000]
        [--no-cluster]

One run (ratios are only compared within one run: the machine is shared and noisy):

1. starts the embedded broker (or uses ``EOSFLOW_KAFKA_BROKERS``) and writes ``--records`` click
   events (8 partitions) for the throughput jobs and ``--recovery-records`` for the recovery jobs;
2. ``--repeats`` times, alternating the order of the runners, runs the keyed-count job
   (``pipelines/keyed_count.py``, aligned checkpoints every second, 2 workers) until idle on the
   local runner and on Spark (``local[2]``), and the recovery job (one worker SIGKILLed 3 s after
   start-up, ``recovery.py``) on both. Every job runs in a fresh Python process, as a user's
   ``eosflow run`` does, so Spark's start-up is a cold start (JVM launch included);
3. checks every job's output, writes ``bench/results/spark-<date>.json`` and prints the Markdown
   tables of ``bench/RESULTS.md``.

* start-up (``ready_s``): from the runner's construction until every worker of the first
  generation is connected (Spark: session start, job submission, tasks launched, pipeline
  imported, inputs opened);
* throughput: ``records / (seconds - ready_s)``, the steady state (``jobs.py``);
* recovery: from the SIGKILL to the new generation connected and to its first committed output.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent / "examples"))

from clicks import produce_clicks  # noqa: E402
from jobs import check_output, run_job  # noqa: E402
from recovery import measure_recovery  # noqa: E402

from processor.embedded import servers  # noqa: E402
from processor.embedded.spark_cluster import start_spark_cluster  # noqa: E402

PIPELINE = BENCH / "pipelines" / "keyed_count.py"
RUNNERS = ("local", "spark", "cluster")
PARTITIONS = 8


def _say(text: str) -> None:
    print(f"[{datetime.now():%H:%M:%S}] {text}", file=sys.stderr, flush=True)


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    """One measured job, in this (fresh) process."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    environ = spec["environ"]
    if spec["kind"] == "throughput":
        return run_job(
            PIPELINE,
            environ=environ,
            state_dir=spec["state_dir"],
            mode="aligned",
            interval=1.0,
            records=spec["records"],
            runner=spec.get("master") or spec["runner"],
        )
    r = measure_recovery(
        PIPELINE,
        environ=environ,
        state_dir=spec["state_dir"],
        kill_after=spec["kill_after"],
        victim=spec["victim"],
        runner=spec.get("master") or spec["runner"],
    )
    r["output_check"] = check_output("keyed_count", environ["OUTPUT_DIR"], spec["records"])
    return r


def _in_child(spec: dict[str, Any]) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        tail = "\n".join(out.stderr.splitlines()[-15:])
        raise RuntimeError(f"{spec['kind']} job on {spec['runner']} failed:\n{tail}")
    result: dict[str, Any] = json.loads(lines[-1])
    result["runner"] = spec["runner"]  # "cluster", not its master URL
    return result


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _ratios(
    runs: list[dict[str, Any]], key: str, other: str = "spark"
) -> tuple[float, list[float]]:
    """``other``/local of the medians of ``key``, and per repeat (runs alternate within a
    repeat)."""
    local = [r[key] for r in runs if r["runner"] == "local"]
    spark = [r[key] for r in runs if r["runner"] == other]
    overall = _median(spark) / _median(local) if local and spark else float("nan")
    return overall, [s / x for x, s in zip(local, spark, strict=False)]


def _markdown(results: dict[str, Any]) -> str:
    runs, rec = results["runs"], results["recovery"]
    rows = [
        "| runner | start-up s (median, min-max) | records/s after start-up | records/s while "
        "reading input | recovery: connected s | recovery: first new output s |",
        "|---|---|---|---|---|---|",
    ]
    for runner in dict.fromkeys(r["runner"] for r in runs):
        these = [r for r in runs if r["runner"] == runner]
        ready = [r["ready_s"] for r in these]
        mine = [r for r in rec if r["runner"] == runner]
        conn = _median([r["connected_s"] for r in mine if "connected_s" in r])
        first = _median([r["first_output_s"] for r in mine if "first_output_s" in r])
        rows.append(
            f"| {runner} | {_median(ready):.1f} ({min(ready):.1f}-{max(ready):.1f}) | "
            f"{_median([r['records_per_s'] for r in these]):,.0f} | "
            f"{_median([r['input_records_per_s'] for r in these]):,.0f} | "
            f"{conn:.2f} | {first:.2f} |"
        )
    rows.append("")
    for other in [r for r in ("spark", "cluster") if any(x["runner"] == r for x in runs)]:
        for key, what in (
            ("records_per_s", "after start-up (final checkpoint and shutdown included)"),
            ("input_records_per_s", "while reading input"),
        ):
            overall, pairs = _ratios(runs, key, other)
            rows.append(
                f"{other}/local throughput {what}: {overall:.2f} (ratio of medians); per "
                "repeat: " + ", ".join(f"{p:.2f}" for p in pairs)
            )
    if results.get("cluster_start_s") is not None:
        rows.append(
            f"standalone cluster (master + {results['cluster_workers']} worker JVMs) started "
            f"in {results['cluster_start_s']:.1f}s, once for the run"
        )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--recovery-records", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kill-after", type=float, default=3.0, help="seconds after start-up")
    parser.add_argument("--out", type=Path, default=BENCH / "results")
    parser.add_argument(
        "--no-cluster", action="store_true", help="local runner and Spark local[2] only"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(json.loads(args.child))))
        return 0
    started = datetime.now()
    run_id = uuid.uuid4().hex[:6]
    work = Path(tempfile.mkdtemp(prefix=f"eosflow-bench-spark-{run_id}-"))
    results: dict[str, Any] = {
        "started": started.isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "records": args.records,
        "recovery_records": args.recovery_records,
        "cpus": os.cpu_count(),
        "runs": [],
        "recovery": [],
    }
    wall = time.monotonic()
    runners = RUNNERS[:2] if args.no_cluster else RUNNERS
    cluster = None
    try:
        if not args.no_cluster:
            cluster = start_spark_cluster(2, cores=2, workdir=work / "spark")
            results["cluster_start_s"] = round(cluster.startup_seconds, 2)
            results["cluster_workers"] = len(cluster.workers)
            _say(f"standalone cluster {cluster.master_url} in {cluster.startup_seconds:.1f}s")
        with servers(["kafka"]) as endpoints:
            brokers = endpoints.kafka_brokers
            assert brokers is not None
            topics = {
                "throughput": f"bench-spark-clicks-{run_id}",
                "recovery": f"bench-spark-recovery-{run_id}",
            }
            counts = {"throughput": args.records, "recovery": args.recovery_records}
            for kind, topic in topics.items():
                took = produce_clicks(brokers, topic, counts[kind], partitions=PARTITIONS)
                _say(f"wrote {counts[kind]:,} clicks to {topic} in {took:.1f}s")
            for rep in range(args.repeats):
                order = runners if rep % 2 == 0 else runners[::-1]
                for kind in ("throughput", "recovery"):
                    for runner in order:
                        job = f"b-spark-{kind[:4]}-{runner}-{rep}-{run_id}"
                        spec = {
                            "kind": kind,
                            "runner": runner,
                            "master": cluster.master_url
                            if runner == "cluster" and cluster
                            else None,
                            "records": counts[kind],
                            "kill_after": args.kill_after,
                            "victim": rep % 2,
                            "state_dir": str(work / job / "state"),
                            "environ": {
                                **endpoints.as_env(),
                                "JOB_NAME": job,
                                "CLICKS_TOPIC": topics[kind],
                                "OUTPUT_DIR": str(work / job / "output"),
                            },
                        }
                        r = _in_child(spec)
                        if kind == "throughput":
                            results["runs"].append(r)
                            _say(
                                f"{rep + 1}/{args.repeats} {runner}: "
                                f"{r['records_per_s']:,.0f} records/s, start-up "
                                f"{r['ready_s']:.1f}s, output {r['output_check']}"
                            )
                        else:
                            results["recovery"].append(r)
                            nan = float("nan")
                            _say(
                                f"{rep + 1}/{args.repeats} {runner} recovery: connected "
                                f"{r.get('connected_s', nan):.2f}s, first output "
                                f"{r.get('first_output_s', nan):.2f}s, output "
                                f"{r['output_check']}"
                                + (f"; error: {r['error']}" if r.get("error") else "")
                            )
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    results["wall_s"] = time.monotonic() - wall
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"spark-{started.strftime('%Y-%m-%d-%H%M%S')}.json"
    path.write_text(json.dumps(results, indent=1))
    print(_markdown(results))
    _say(f"results: {path}; took {results['wall_s']:.0f}s")
    ok = all(r["output_check"] == "ok" for r in results["runs"] + results["recovery"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
