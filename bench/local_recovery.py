"""Local against global recovery: what ``--recovery local`` costs without failures, and what it
saves when a worker dies.

    python bench/local_recovery.py [--records 200000] [--repeats 2] [--kill-after 3]

One run starts the embedded broker (or uses ``EOSFLOW_KAFKA_BROKERS``), writes ``--records``
clicks, and runs the two-shuffle pipeline of the local-recovery tests
(``tests/e2e/pipelines/two_level_count.py``: counts per page and 10 s window, then per window)
on the local runner with 2 workers and aligned 1 s checkpoints, in four configurations per
repeat, interleaved (global/local alternate, so a noisy minute hits both alike):

* ``no failure``: throughput, ``records / (seconds - ready_s)``;
* ``one kill``: worker 1 is SIGKILLed ``--kill-after`` seconds after start-up. Measured: the
  job's total time, the time from the kill until worker 1 is connected again, and how many
  records worker 0's source task read between the kill and that moment (under global recovery
  worker 0 is restarted too, so it reads none of the input while it waits).

Every run's committed output is compared with the answer computed from the click generator.
Results go to ``bench/results/local-recovery-<date>.json`` and the Markdown table is printed
(``bench/RESULTS.md``, "Local recovery"). ``--work-us`` (default 100) is the pipeline's CPU work
per click; ``--work-us 0 --no-kill`` shows the bare per-record overhead of local recovery.
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
from datetime import datetime
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT / "examples"))

from clicks import (  # noqa: E402
    canonical,
    click_events,
    compare_outputs,
    expected_two_level_counts,
    produce_clicks,
    read_two_level_output,
)
from jobs import drop_channel_topics  # noqa: E402

from processor.embedded import servers  # noqa: E402
from processor.runtime.supervision.local import LocalRunner, RunOptions  # noqa: E402

PIPELINE = ROOT / "tests" / "e2e" / "pipelines" / "two_level_count.py"


def _say(text: str) -> None:
    print(f"[{datetime.now():%H:%M:%S}] {text}", file=sys.stderr, flush=True)


def _source_reads(runner: LocalRunner, worker: int) -> int:
    stats = runner.workers[worker].stats
    return sum(int(s["in"]) for task, s in stats.items() if task.startswith("clicks."))


class _Killer(threading.Thread):
    """SIGKILLs worker 1 ``after`` s after start-up; measures its way back."""

    def __init__(self, runner: LocalRunner, after: float) -> None:
        super().__init__(name="bench-killer", daemon=True)
        self.runner, self.after = runner, after
        self.found: dict[str, Any] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        runner = self.runner
        while runner.ready_s is None:
            if self.stop.wait(0.005):
                return
        if self.stop.wait(self.after):
            return
        if runner.final_chk is not None:
            self.found["error"] = "the input was drained before the kill: raise --records"
            return
        survivor_pid = runner.workers[0].pid
        before = _source_reads(runner, 0)
        pid = runner.workers[1].pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        while runner.restarts == 0 or not all(
            w.conn is not None and not w.conn.closed for w in list(runner.workers)
        ):
            if self.stop.wait(0.005):
                return
        self.found["back_s"] = time.monotonic() - killed
        # worker 0's stats of its own run (local: the survivor's counter kept growing;
        # global: a new worker 0 whose counter starts at 0 after the restored checkpoint)
        same = runner.workers[0].pid == survivor_pid
        self.found["survivor_kept_running"] = same
        reads = _source_reads(runner, 0) - before if same else 0
        self.found["survivor_reads_during_outage"] = reads


def _run(
    args: argparse.Namespace, environ: dict[str, str], work: Path, recovery: str, kill: bool
) -> dict[str, Any]:
    job = f"b-{recovery}-{'kill' if kill else 'ok'}-{uuid.uuid4().hex[:6]}"
    env = {**environ, "JOB_NAME": job, "OUTPUT_DIR": str(work / job / "output")}
    options = RunOptions(
        workers=2,
        checkpoint_interval=1.0,
        mode="aligned",
        until_idle=True,
        environ=env,
        state_dir=str(work / job / "state"),
        recovery=recovery,
        progress=sys.stderr if args.verbose else None,
    )
    runner = LocalRunner(PIPELINE, options)
    killer = _Killer(runner, args.kill_after) if kill else None
    if killer is not None:
        killer.start()
    try:
        result = runner.run()
    finally:
        if killer is not None:
            killer.stop.set()
            killer.join(5)
    got = Counter(canonical(x) for x in read_two_level_output(env["OUTPUT_DIR"]))
    missing, extra = compare_outputs(args.want, got)
    drop_channel_topics(runner)
    shutil.rmtree(work / job, ignore_errors=True)
    return {
        "recovery": recovery,
        "kill": kill,
        "seconds": result.seconds,
        "ready_s": result.ready_s,
        "records_per_s": args.records / (result.seconds - result.ready_s),
        "restarts": result.restarts,
        "checkpoints": result.checkpoints,
        "missing": missing,
        "extra": extra,
        **(killer.found if killer is not None else {}),
    }


def _table(runs: list[dict[str, Any]]) -> str:
    def med(recovery: str, kill: bool, key: str) -> float:
        xs = [r[key] for r in runs if r["recovery"] == recovery and r["kill"] == kill and key in r]
        return statistics.median(xs) if xs else float("nan")

    lines = [
        "| recovery | records/s, no failure | job s, no failure | job s, one kill | "
        "kill → worker back (s) | survivor reads during outage | output |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for rec in ("global", "local"):
        ok = all(r["missing"] == r["extra"] == 0 for r in runs if r["recovery"] == rec)
        lines.append(
            f"| {rec} | {med(rec, False, 'records_per_s'):,.0f} | "
            f"{med(rec, False, 'seconds'):.1f} | {med(rec, True, 'seconds'):.1f} | "
            f"{med(rec, True, 'back_s'):.2f} | "
            f"{med(rec, True, 'survivor_reads_during_outage'):,.0f} | "
            f"{'exactly once' if ok else 'WRONG'} |"
        )
    g, loc = med("global", False, "records_per_s"), med("local", False, "records_per_s")
    lines.append(f"\nlocal / global throughput without failures: {loc / g:.2f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--kill-after", type=float, default=3.0, help="s after start-up")
    parser.add_argument(
        "--work-us", type=int, default=100, help="CPU work per click in the pipeline (WORK_US)"
    )
    parser.add_argument("--no-kill", action="store_true", help="only the runs without failure")
    parser.add_argument(
        "--recoveries", default="global,local",
        help="which recoveries to run (default both; one alone: for a profiler)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=BENCH / "results")
    parser.add_argument("-v", "--verbose", action="store_true", help="the runner's progress")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    started = datetime.now()
    work = Path(tempfile.mkdtemp(prefix="eosflow-bench-local-"))
    runs: list[dict[str, Any]] = []
    try:
        with servers(["kafka"]) as endpoints:
            assert endpoints.kafka_brokers is not None
            topic = f"bench-clicks-local-{uuid.uuid4().hex[:6]}"
            took = produce_clicks(endpoints.kafka_brokers, topic, args.records)
            _say(f"wrote {args.records:,} clicks in {took:.1f}s")
            args.want = expected_two_level_counts(click_events(args.records))
            environ = {
                "CLICKS_TOPIC": topic,
                "EOSFLOW_KAFKA_BROKERS": endpoints.kafka_brokers,
                "WORK_US": str(args.work_us),
            }
            for rep in range(args.repeats):
                chosen = args.recoveries.split(",")
                order = chosen if rep % 2 == 0 else chosen[::-1]
                for kill in (False,) if args.no_kill else (False, True):
                    for recovery in order:
                        r = _run(args, environ, work, recovery, kill)
                        runs.append(r)
                        _say(
                            f"{recovery:6} {'one kill' if kill else 'no failure':10} "
                            f"{r['seconds']:.1f}s {r['records_per_s']:,.0f} records/s "
                            f"restarts={r['restarts']} back_s={r.get('back_s', float('nan')):.2f} "
                            f"survivor_reads={r.get('survivor_reads_during_outage', '-')} "
                            f"missing={r['missing']} extra={r['extra']}"
                            + (f" error={r['error']}" if "error" in r else "")
                        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"local-recovery-{started:%Y-%m-%d-%H%M%S}.json"
    command = " ".join([Path(sys.executable).name, *sys.argv])
    results = {"command": command, "records": args.records, "work_us": args.work_us, "runs": runs}
    path.write_text(json.dumps(results, indent=1))
    print(_table(runs))
    _say(f"results: {path}")
    return 0 if all(r["missing"] == r["extra"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
