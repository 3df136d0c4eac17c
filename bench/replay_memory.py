"""Local recovery's replay check over a long run: the IDs it holds stay bounded by checkpoints,
whatever the event time does (issue 49).

    python bench/replay_memory.py [--minutes 10] [--rate 5000] [--kill-every 60]

Starts the embedded broker (or uses ``EOSFLOW_KAFKA_BROKERS``), writes ``rate * minutes * 60``
clicks one second of event time apart (a backfill: the job reads ``rate`` seconds of event time
per second), and runs the running aggregate after a shuffle
(``tests/e2e/pipelines/backlog_total.py``, no windows) under ``--recovery local`` with 2
workers, aligned 1 s checkpoints, paced at ``rate`` records a second (``--max-rate rate/2``).
Every ``--kill-every`` seconds a worker is SIGKILLed (1, 0, 1, ...), and only it restarts.

Every second it samples each task's ``replay_ids`` (the IDs its replay check holds) and each
worker's resident memory. At the end it checks the committed output against the answer computed
from the click generator, and prints the distribution of the samples: the IDs held should stay
within a few checkpoint intervals of records (``rate`` per second per the job), not grow with
the run. Results go to ``bench/results/replay-memory-<date>.json`` (``bench/RESULTS.md``,
"Local recovery").
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT / "examples"))

from clicks import (  # noqa: E402
    click_events,
    compare_outputs,
    expected_running_totals,
    produce_json,
)
from jobs import drop_channel_topics  # noqa: E402

from processor.embedded import servers  # noqa: E402
from processor.runtime.supervision.local import LocalRunner, RunOptions  # noqa: E402

PIPELINE = str(ROOT / "tests" / "e2e" / "pipelines" / "backlog_total.py")


def _say(text: str) -> None:
    print(f"[{datetime.now():%H:%M:%S}] {text}", file=sys.stderr, flush=True)


def spaced_clicks(records: int) -> Iterator[dict[str, Any]]:
    for i, event in enumerate(click_events(records)):
        yield {**event, "ts_ms": 1_700_000_000_000 + i * 1000}


def _rss_mb(pid: int | None) -> float:
    if pid is None:
        return 0.0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class _Sampler(threading.Thread):
    """Once a second: the replay IDs held per task, the workers' memory; kills on schedule."""

    def __init__(self, runner: LocalRunner, kill_every: float) -> None:
        super().__init__(name="bench-sampler", daemon=True)
        self.runner, self.kill_every = runner, kill_every
        self.samples: list[dict[str, Any]] = []
        self.kills: list[tuple[float, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        runner = self.runner
        while runner.ready_s is None:
            if self.stop.wait(0.05):
                return
        started = time.monotonic()
        next_kill, victim = self.kill_every, 1
        while not self.stop.wait(1.0):
            t = time.monotonic() - started
            workers = list(runner.workers)
            held = {
                task: int(s.get("replay_ids", 0))
                for w in workers
                for task, s in (w.stats or {}).items()
            }
            source_in = sum(
                int(s.get("in", 0))
                for w in workers
                for task, s in (w.stats or {}).items()
                if task.startswith("clicks.")
            )
            pinned = max(
                (int(s.get("replay_pinned", 0)) for w in workers for s in (w.stats or {}).values()),
                default=0,
            )
            self.samples.append(
                {
                    "pinned_max": pinned,
                    "t": round(t, 1),
                    "ids_max": max(held.values(), default=0),
                    "ids_total": sum(held.values()),
                    "rss_mb": [round(_rss_mb(w.pid), 1) for w in workers],
                    "runner_rss_mb": round(_rss_mb(os.getpid()), 1),
                    "source_in": source_in,
                }
            )
            if t >= next_kill and runner.final_chk is None:
                pid = workers[victim].pid
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    self.kills.append((round(t, 1), victim))
                    _say(f"SIGKILL worker {victim} at {t:.0f}s")
                next_kill += self.kill_every
                victim = 1 - victim


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rate", type=int, default=5000, help="the job's records/s (paced)")
    parser.add_argument("--kill-every", type=float, default=60.0, help="s between SIGKILLs")
    parser.add_argument("--interval", type=float, default=1.0, help="checkpoint interval, s")
    parser.add_argument("--out", type=Path, default=BENCH / "results")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    started = datetime.now()
    records = int(args.rate * args.minutes * 60)
    work = Path(tempfile.mkdtemp(prefix="eosflow-bench-replay-"))
    try:
        with servers(["kafka"]) as endpoints:
            assert endpoints.kafka_brokers is not None
            topic = f"bench-clicks-replay-{uuid.uuid4().hex[:6]}"
            took = produce_json(
                endpoints.kafka_brokers, topic, spaced_clicks(records),
                key=lambda e: str(e["user"]), total=records,
            )  # fmt: skip
            hours = records / 3600
            _say(f"wrote {records:,} clicks ({hours:,.0f} hours of event time) in {took:.0f}s")
            job = f"b-replay-{uuid.uuid4().hex[:6]}"
            env = {
                "JOB_NAME": job,
                "CLICKS_TOPIC": topic,
                "OUTPUT_DIR": str(work / "output"),
                "EOSFLOW_KAFKA_BROKERS": endpoints.kafka_brokers,
                "WORK_US": "0",
            }
            runner = LocalRunner(
                PIPELINE,
                RunOptions(
                    workers=2,
                    checkpoint_interval=args.interval,
                    mode="aligned",
                    until_idle=True,
                    environ=env,
                    state_dir=str(work / "state"),
                    recovery="local",
                    max_rate=args.rate / 2,  # per worker
                    progress=None,
                ),
            )
            sampler = _Sampler(runner, args.kill_every)
            sampler.start()
            try:
                result = runner.run()
            finally:
                sampler.stop.set()
                sampler.join(5)
            _say(
                f"job done in {result.seconds:.0f}s (runner RSS {_rss_mb(os.getpid()):.0f} MB); "
                "checking its output"
            )
            # Line by line (the sink writes each value as canonical JSON): read_jsonl's
            # decoded values of 3M lines took the checker past 20 GB, and the OOM killer
            # stopped the first 10-minute run.
            got: Counter[bytes] = Counter()
            for part in sorted(Path(env["OUTPUT_DIR"]).rglob("part-*.jsonl")):
                with open(part, "rb") as f:
                    got.update(line.rstrip(b"\n") for line in f)
            runner_mb = _rss_mb(os.getpid())
            _say(f"read {sum(got.values()):,} output lines (runner RSS {runner_mb:.0f} MB)")
            missing, extra = compare_outputs(expected_running_totals(spaced_clicks(records)), got)
            drop_channel_topics(runner)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    samples = sampler.samples
    ids = [s["ids_max"] for s in samples]
    rss = [max(s["rss_mb"], default=0.0) for s in samples]
    third = len(samples) // 3
    summary = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "records": records,
        "seconds": round(result.seconds, 1),
        "restarts": result.restarts,
        "restart_causes": result.restart_causes,
        "kills": sampler.kills,
        "missing": missing,
        "extra": extra,
        "ids_max_per_task": {
            "p50": statistics.median(ids) if ids else 0,
            "p99": sorted(ids)[int(len(ids) * 0.99)] if ids else 0,
            "max": max(ids, default=0),
            "first_third_max": max(ids[:third], default=0),
            "last_third_max": max(ids[-third:], default=0) if third else 0,
        },
        "worker_rss_mb": {
            "first_third_max": max(rss[:third], default=0.0),
            "last_third_max": max(rss[-third:], default=0.0) if third else 0.0,
        },
        "samples": samples,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"replay-memory-{started:%Y-%m-%d-%H%M%S}.json"
    path.write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "samples"}, indent=1))
    _say(f"results: {path}")
    return 0 if missing == extra == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
