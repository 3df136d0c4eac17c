"""A backfill with and without watermark alignment: how long it takes, when its windows are
committed, how far partitions run ahead of the slowest, and how much state it holds (issues 37
and 50).

    python bench/backfill.py [--records 200000] [--event-hours 2] [--max-rate 2500 20000]
                             [--repeats 1] [--drift 30s]

One run starts the embedded broker (or uses ``EOSFLOW_KAFKA_BROKERS``), writes ``--records``
clicks (``examples/clicks.py``, spread evenly over ``--event-hours`` of event time, 8
partitions keyed by user, so every partition spans the whole backlog), and runs
``pipelines/backfill_window.py`` (clicks per user and 10 s tumbling window, after a ``key_by``
shuffle, into a ``FileSink``) on the local runner with 2 workers, aligned 1 s checkpoints,
until idle, at each ``--max-rate`` (records/s per worker), with ``--watermark-alignment
DRIFT`` and ``off``:

* ``job s``: the runner's wall time; ``records/s``: ``records / (seconds - ready_s)``;
* ``windows at 50 %``: the share of the output (window rows) committed when half of the input
  had been read (the sources' lag, sampled every 50 ms); goal (issue 50) >= 0.40;
* ``windows before the end``: the share committed before the input was drained (the final
  checkpoint commits the rest);
* ``largest drift``: the most event time any busy partition (records left to read) was ahead
  of the slowest busy partition, from every stats message of every source task (once a
  second per worker): the task's own busy partitions against the lowest of its own and of the
  other source tasks' as the coordinator last told it (those are never newer than the truth,
  so this is an upper bound). Goal with alignment: <= drift + 1 s;
* ``peak state``: bytes of the largest completed checkpoint (the open windows' counts).

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
import time
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


def expected(records: int, spacing_ms: int) -> Counter[bytes]:
    """Every output line: clicks per user and 10 s window, from the generator alone."""
    counts: Counter[tuple[str, int]] = Counter()
    for click in click_events(records, spacing_ms=spacing_ms):
        ts = int(str(click["ts_ms"]))
        counts[(str(click["user"]), ts - ts % WINDOW_MS)] += 1
    return Counter(
        canonical([user, {"start_ms": s, "end_ms": s + WINDOW_MS, "value": n}])
        for (user, s), n in counts.items()
    )


class _Sampler(threading.Thread):
    """Every 50 ms: the share of the input read; the committed output when the first window
    came, when half of the input was read, and before the sources drained; and the drift of
    every new stats message of a source task."""

    def __init__(self, runner: Runner, output: Path, records: int) -> None:
        super().__init__(name="bench-sampler", daemon=True)
        self.runner, self.output, self.records = runner, output, records
        self.first_at: float | None = None
        self.at_half: int | None = None
        self.before_end = 0
        self.drift_ms = 0
        self.drifts: list[tuple[float, str, int]] = []  # (s since start, task, drift ms)
        self.began = time.monotonic()
        self.seen: set[int] = set()
        self.stop = threading.Event()

    def _committed(self) -> int:
        return len(read_jsonl(self.output)) if self.output.exists() else 0

    def run(self) -> None:
        while not self.stop.wait(0.05):
            self._drift()
            if self.runner.stop.final is not None:  # drained: the final checkpoint commits
                self.before_end = self._committed()  # the rest; what is committed came before
                if self.at_half is None:
                    self.at_half = self.before_end
                return
            share = input_read(self.runner, self.records)
            if share is None:
                continue
            if self.first_at is None and self._committed():
                self.first_at = share
            if self.at_half is None and share >= 0.5:
                self.at_half = self._committed()

    def _drift(self) -> None:
        sources = {s.name for s in self.runner.plan.stages if s.sources}
        for worker in list(getattr(self.runner, "workers", [])):
            for task, st in list(worker.stats.items()):
                if id(st) in self.seen or task.rsplit(".", 1)[0] not in sources:
                    continue
                self.seen.add(id(st))
                lag = {(t, p): n for t, p, n in st.get("parts", [])}
                busy = [
                    wm
                    for t, p, wm, _newest, state in st.get("wm_parts", [])
                    if wm is not None and state != "done" and lag.get((t, p), 1) > 0
                ]
                if not busy:
                    continue
                floor = min(busy)
                if st.get("align_others") is not None:
                    floor = min(floor, int(st["align_others"]))
                drift = max(busy) - floor
                self.drift_ms = max(self.drift_ms, drift)
                self.drifts.append((round(time.monotonic() - self.began, 2), task, drift))


def _run(
    args: argparse.Namespace,
    environ: dict[str, str],
    work: Path,
    drift: float | None,
    rate: float,
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
        max_rate=rate,
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
    total = max(1, sum(args.want.values()))
    run = {
        "alignment_s": drift,
        "max_rate": rate,
        "seconds": result.seconds,
        "ready_s": result.ready_s,
        "records_per_s": args.records / (result.seconds - result.ready_s),
        "first_window_at": sampler.first_at,
        "windows_at_half": None if sampler.at_half is None else sampler.at_half / total,
        "before_end": sampler.before_end / total,
        "largest_drift_s": sampler.drift_ms / 1000,
        "stats_seen": len(sampler.seen),
        "largest_drifts": sorted(sampler.drifts, key=lambda d: -d[2])[:5],
        "peak_state_bytes": result.peak_checkpoint_bytes,
        "checkpoints": result.checkpoints,
        "missing": missing,
        "extra": extra,
    }
    _say(json.dumps(run))
    return run


def _table(runs: list[dict[str, Any]], drift: float) -> str:
    def med(rate: float, on: bool, key: str) -> float:
        xs = [
            r[key]
            for r in runs
            if r["max_rate"] == rate and bool(r["alignment_s"]) == on and r[key] is not None
        ]
        return statistics.median(xs) if xs else float("nan")

    lines = [
        "| --max-rate | watermark alignment | job s | records/s | windows at 50 % read | "
        "windows before the end | largest drift (s) | peak state (checkpoint KB) | output |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for rate in sorted({r["max_rate"] for r in runs}):
        for on in (True, False):
            mine = [r for r in runs if r["max_rate"] == rate and bool(r["alignment_s"]) == on]
            ok = all(r["missing"] == r["extra"] == 0 for r in mine)
            lines.append(
                f"| {rate:,.0f} | {f'{drift:g}s' if on else 'off'} | "
                f"{med(rate, on, 'seconds'):.1f} | {med(rate, on, 'records_per_s'):,.0f} | "
                f"{med(rate, on, 'windows_at_half'):.2f} | {med(rate, on, 'before_end'):.2f} | "
                f"{med(rate, on, 'largest_drift_s'):,.1f} | "
                f"{med(rate, on, 'peak_state_bytes') / 1024:,.0f} | "
                f"{'exactly once' if ok else 'WRONG'} |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--event-hours", type=float, default=2.0, help="event time spanned")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--max-rate",
        type=float,
        nargs="+",
        default=[2_500.0, 20_000.0],
        help="records/s per worker, one run (per repeat and alignment) each (0: no limit)",
    )
    parser.add_argument("--drift", type=parse_alignment, default=30.0, help="alignment on (30s)")
    parser.add_argument("--out", type=Path, default=BENCH / "results")
    parser.add_argument("-v", "--verbose", action="store_true", help="the runner's progress")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    started = datetime.now()
    work = Path(tempfile.mkdtemp(prefix="eosflow-bench-backfill-"))
    runs: list[dict[str, Any]] = []
    args.spacing_ms = max(1, int(args.event_hours * 3_600_000 / args.records))
    args.want = expected(args.records, args.spacing_ms)
    try:
        with servers(["kafka"]) as endpoints:
            assert endpoints.kafka_brokers is not None
            topic = f"bench-backfill-{uuid.uuid4().hex[:6]}"
            took = produce_clicks(
                endpoints.kafka_brokers, topic, args.records, spacing_ms=args.spacing_ms
            )
            _say(f"wrote {args.records:,} clicks in {took:.1f}s")
            environ = {"CLICKS_TOPIC": topic, "EOSFLOW_KAFKA_BROKERS": endpoints.kafka_brokers}
            for i in range(args.repeats):
                for rate in args.max_rate:
                    for drift in (args.drift, None) if i % 2 == 0 else (None, args.drift):
                        runs.append(_run(args, environ, work, drift, rate))
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
