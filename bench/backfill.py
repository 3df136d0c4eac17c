"""A backfill with and without watermark alignment: how long it takes, when its windows fire,
and how much state it holds (issue 37).

    python bench/backfill.py [--records 200000] [--repeats 2] [--max-rate 0] [--drift 30s]

One run starts the embedded broker (or uses ``EOSFLOW_KAFKA_BROKERS``), writes ``--records``
clicks (``examples/clicks.py``: 10 ms of event time apart, 8 partitions keyed by user, so every
partition spans the whole backlog), and runs ``pipelines/backfill_window.py`` (clicks per user
and 10 s tumbling window, after a ``key_by`` shuffle, into a ``FileSink``) on the local runner
with 2 workers, aligned 1 s checkpoints, until idle, at ``--max-rate`` records/s per worker (0:
as fast as it goes), alternately with ``--watermark-alignment DRIFT`` and ``off``:

* ``job s``: the runner's wall time; ``records/s``: ``records / (seconds - ready_s)``;
* ``first window at``: the share of the backlog read (``1 - lag / records``, from the source
  tasks' lag, sampled every 50 ms) when the first window was committed;
* ``windows before the end``: the share of the output committed before the input was drained
  (the final checkpoint commits the rest);
* ``peak state``: bytes of the largest completed checkpoint (``RunResult.peak_checkpoint_bytes``:
  the task snapshots, mostly the open windows' counts).

Every run's committed output is compared with the counts computed from the click generator.
Results go to ``bench/results/backfill-<date>.json`` and the Markdown table is printed
(``bench/RESULTS.md``, "Backfills and watermark alignment").
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import tempfile
import threading
import uuid
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT / "examples"))

from clicks import canonical, click_events, compare_outputs, produce_clicks  # noqa: E402
from jobs import drop_channel_topics  # noqa: E402

from processor.embedded import servers  # noqa: E402
from processor.runtime.job import parse_alignment  # noqa: E402
from processor.runtime.supervision.local import LocalRunner, RunOptions  # noqa: E402
from processor.runtime.supervision.runner import Runner  # noqa: E402
from processor.testing.chaos import input_read  # noqa: E402
from sinks import read_jsonl  # noqa: E402

PIPELINE = BENCH / "pipelines" / "backfill_window.py"
WINDOW_MS = 10_000


def _say(text: str) -> None:
    print(f"[{datetime.now():%H:%M:%S}] {text}", file=sys.stderr, flush=True)


def expected(records: int) -> Counter[bytes]:
    """Every output line: clicks per user and 10 s window, from the generator alone."""
    counts: Counter[tuple[str, int]] = Counter()
    for click in click_events(records):
        ts = int(str(click["ts_ms"]))
        counts[(str(click["user"]), ts - ts % WINDOW_MS)] += 1
    return Counter(
        canonical([user, {"start_ms": s, "end_ms": s + WINDOW_MS, "value": n}])
        for (user, s), n in counts.items()
    )


class _Sampler(threading.Thread):
    """Read progress when the first window is committed, and the output committed before the
    sources drained."""

    def __init__(self, runner: Runner, output: Path, records: int) -> None:
        super().__init__(name="bench-sampler", daemon=True)
        self.runner, self.output, self.records = runner, output, records
        self.first_at: float | None = None
        self.before_end = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.05):
            if self.runner.stop.final is not None:  # drained: the final checkpoint commits
                if self.output.exists():  # the rest; what is committed now came before it
                    self.before_end = len(read_jsonl(self.output))
                return
            if self.first_at is not None:
                continue
            share = input_read(self.runner, self.records)
            if share is not None and self.output.exists() and read_jsonl(self.output):
                self.first_at = share


def _run(
    args: argparse.Namespace, environ: dict[str, str], work: Path, drift: float | None
) -> dict[str, Any]:
    job = f"b-backfill-{'on' if drift else 'off'}-{uuid.uuid4().hex[:6]}"
    output = work / job / "output"
    env = {**environ, "JOB_NAME": job, "OUTPUT_DIR": str(output)}
    options = RunOptions(
        workers=2,
        checkpoint_interval=1.0,
        mode="aligned",
        until_idle=True,
        environ=env,
        state_dir=str(work / job / "state"),
        max_rate=args.max_rate,
        watermark_alignment=drift,
        metrics="off",
        progress=sys.stderr if args.verbose else None,
    )
    runner = LocalRunner(PIPELINE, options)
    sampler = _Sampler(runner, output, args.records)
    sampler.start()
    try:
        result = runner.run()
    finally:
        sampler.stop.set()
        sampler.join(5)
    got = Counter(canonical(x) for x in read_jsonl(output))
    missing, extra = compare_outputs(args.want, got)
    drop_channel_topics(runner)
    shutil.rmtree(work / job, ignore_errors=True)
    run = {
        "alignment_s": drift,
        "seconds": result.seconds,
        "ready_s": result.ready_s,
        "records_per_s": args.records / (result.seconds - result.ready_s),
        "first_window_at": sampler.first_at,
        "before_end": sampler.before_end / max(1, sum(args.want.values())),
        "peak_state_bytes": result.peak_checkpoint_bytes,
        "checkpoints": result.checkpoints,
        "missing": missing,
        "extra": extra,
    }
    _say(json.dumps(run))
    return run


def _table(runs: list[dict[str, Any]], drift: float) -> str:
    def med(on: bool, key: str) -> float:
        xs = [r[key] for r in runs if bool(r["alignment_s"]) == on and r[key] is not None]
        return statistics.median(xs) if xs else float("nan")

    lines = [
        "| watermark alignment | job s | records/s | first window at (share read) | "
        "windows before the end | peak state (checkpoint KB) | output |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for on in (True, False):
        ok = all(r["missing"] == r["extra"] == 0 for r in runs if bool(r["alignment_s"]) == on)
        lines.append(
            f"| {f'{drift:g}s' if on else 'off'} | {med(on, 'seconds'):.1f} | "
            f"{med(on, 'records_per_s'):,.0f} | {med(on, 'first_window_at'):.2f} | "
            f"{med(on, 'before_end'):.2f} | {med(on, 'peak_state_bytes') / 1024:,.0f} | "
            f"{'exactly once' if ok else 'WRONG'} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--max-rate", type=float, default=0.0, help="records/s per worker (0: no limit)"
    )
    parser.add_argument("--drift", type=parse_alignment, default=30.0, help="alignment on (30s)")
    parser.add_argument("--out", type=Path, default=BENCH / "results")
    parser.add_argument("-v", "--verbose", action="store_true", help="the runner's progress")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    started = datetime.now()
    work = Path(tempfile.mkdtemp(prefix="eosflow-bench-backfill-"))
    runs: list[dict[str, Any]] = []
    args.want = expected(args.records)
    try:
        with servers(["kafka"]) as endpoints:
            assert endpoints.kafka_brokers is not None
            topic = f"bench-backfill-{uuid.uuid4().hex[:6]}"
            took = produce_clicks(endpoints.kafka_brokers, topic, args.records)
            _say(f"wrote {args.records:,} clicks in {took:.1f}s")
            environ = {"CLICKS_TOPIC": topic, "EOSFLOW_KAFKA_BROKERS": endpoints.kafka_brokers}
            for i in range(args.repeats):
                for drift in (args.drift, None) if i % 2 == 0 else (None, args.drift):
                    runs.append(_run(args, environ, work, drift))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"backfill-{started:%Y%m%d-%H%M%S}.json"
    config = {k: v for k, v in vars(args).items() if k not in ("out", "want")}
    path.write_text(json.dumps({"config": config, "runs": runs}, indent=1, default=str))
    print(_table(runs, args.drift or 0.0))
    print(f"\nresults: {path}")
    return 0 if all(r["missing"] == r["extra"] == 0 for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
