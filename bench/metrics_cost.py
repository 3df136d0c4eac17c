"""What metrics cost: the reference job with the metrics server off, on and scraped, in one run.

    python bench/metrics_cost.py [--records 500000] [--rounds 3] [--workers 2]
        [--old-tree PATH]

The job is ``pipelines/keyed_count.py`` (bench/README.md, "The reference job": JSON clicks,
filter, key by user, running count and sum, one output per input, through a shuffle into part
files), run until idle on the same pre-produced input by three variants, alternating,
``--rounds`` times:

* ``off``: ``--metrics off``. The workers still count what the metrics need (per step, per
  partition, commit times): that part has no switch, it is in every variant;
* ``on``: the default, and a scraper in the runner's process that reads ``/metrics`` and
  ``/api/job`` every second (Prometheus scrapes every 15 s by default: this is the harsh case);
* ``before`` (with ``--old-tree``, a checkout from before the metrics, e.g.
  ``git worktree add /tmp/before 36ca1ae``): the same job on that code, which counts none of
  it. ``before`` against ``off`` is the cost of the workers' counting.

Each run is a subprocess; its CPU (with its workers', reaped) is read from ``RUSAGE_CHILDREN``.
The rate is records over the run's steady part (start-up left out, as ``bench/jobs.py``).
Only ratios within one run mean anything: the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path[:0] = [str(ROOT / "examples")]
PIPELINE = BENCH / "pipelines" / "keyed_count.py"
PARTITIONS = 8


def _say(text: str) -> None:
    print(f"[{datetime.now():%H:%M:%S}] {text}", file=sys.stderr, flush=True)


def child(variant: str, topic: str, brokers: str, workers: int, work: Path) -> None:
    """One run (in a subprocess): prints one JSON line."""
    from jobs import check_output

    from processor.runtime.supervision.local import LocalRunner, RunOptions

    name = f"metrics-cost-{uuid.uuid4().hex[:6]}"
    out = work / name
    environ = {
        "EOSFLOW_KAFKA_BROKERS": brokers,
        "JOB_NAME": name,
        "CLICKS_TOPIC": topic,
        "OUTPUT_DIR": str(out),
    }
    if variant != "before":  # the old code has no --metrics; its default serves nothing
        os.environ["EOSFLOW_METRICS"] = "off" if variant == "off" else "127.0.0.1:0"
    options = RunOptions(
        workers=workers,
        checkpoint_interval=1.0,
        mode="aligned",
        until_idle=True,
        environ=environ,
        state_dir=str(work / "state"),
    )
    runner = LocalRunner(PIPELINE, options)
    scrapes = [0]
    if variant == "on":
        threading.Thread(target=_scrape, args=(runner, scrapes), daemon=True).start()
    result = runner.run()
    steady = result.seconds - result.ready_s
    print(
        json.dumps(
            {
                "records_in": result.records_in,
                "seconds": result.seconds,
                "steady_s": steady,
                "rate": result.records_in / steady,
                "scrapes": scrapes[0],
                "check": check_output(PIPELINE.stem, str(out), result.records_in),
            }
        )
    )


def _scrape(runner: Any, scrapes: list[int]) -> None:
    while getattr(runner, "web", None) is None:
        time.sleep(0.05)
    url = runner.web.url
    while True:
        time.sleep(1.0)
        try:
            for path in ("metrics", "api/job"):
                with urllib.request.urlopen(url + path, timeout=5) as r:
                    r.read()
            scrapes[0] += 1
        except OSError:
            return


def _run(variant: str, args: argparse.Namespace, topic: str, brokers: str, work: Path) -> dict:
    env = dict(os.environ)
    if variant == "before":
        env["PYTHONPATH"] = str(Path(args.old_tree).resolve())
    else:
        env["PYTHONPATH"] = str(ROOT)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    command = [sys.executable, __file__, "--child", variant, "--topic", topic]
    command += ["--brokers", brokers, "--workers", str(args.workers), "--work", str(work)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{done.stderr[-3000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    row |= {"variant": variant, "cpu_s": cpu, "cpu_us_per_record": 1e6 * cpu / row["records_in"]}
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=500_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--old-tree", help="a checkout from before the metrics (variant before)")
    parser.add_argument("--out", type=Path, default=BENCH / "results")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--topic", help=argparse.SUPPRESS)
    parser.add_argument("--brokers", help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.topic, args.brokers, args.workers, args.work)
        return 0
    from clicks import produce_clicks

    from processor.embedded import servers

    variants = ["off", "on"] + (["before"] if args.old_tree else [])
    rows: list[dict[str, Any]] = []
    started = datetime.now()
    with servers(["kafka"]) as endpoints, tempfile.TemporaryDirectory() as tmp:
        brokers = endpoints.kafka_brokers
        assert brokers is not None
        topic = f"metrics-cost-{uuid.uuid4().hex[:6]}"
        took = produce_clicks(brokers, topic, args.records, partitions=PARTITIONS)
        _say(f"wrote {args.records:,} clicks to {topic} in {took:.1f}s")
        for rnd in range(args.rounds):
            order = variants if rnd % 2 == 0 else variants[::-1]  # no variant always first
            for variant in order:
                row = _run(variant, args, topic, brokers, Path(tmp)) | {"round": rnd}
                rows.append(row)
                _say(
                    f"round {rnd} {variant}: {row['rate']:,.0f} records/s, "
                    f"{row['cpu_us_per_record']:.2f} CPU-µs/record, scrapes {row['scrapes']}, "
                    f"output {row['check']}"
                )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"metrics-cost-{started:%Y%m%d-%H%M%S}.json"
    path.write_text(
        json.dumps({"args": vars(args) | {"out": str(args.out)}, "runs": rows}, indent=1)
    )
    off = statistics.median(r["rate"] for r in rows if r["variant"] == "off")
    print("\n| variant | records/s (median) | x off | CPU µs/record (median) | runs |")
    print("|---|---:|---:|---:|---|")
    for variant in variants:
        mine = [r for r in rows if r["variant"] == variant]
        rate = statistics.median(r["rate"] for r in mine)
        cpu = statistics.median(r["cpu_us_per_record"] for r in mine)
        each = ", ".join(f"{r['rate']:,.0f}" for r in mine)
        print(f"| {variant} | {rate:,.0f} | {rate / off:.3f} | {cpu:.2f} | {each} |")
    _say(f"results: {path}")
    return 0 if all(r["check"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
