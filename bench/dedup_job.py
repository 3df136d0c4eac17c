"""What ``dedup`` costs in the reference job: the same job with and without it, same input.

    python bench/dedup_job.py [--records 100000] [--duplicates 0.10] [--repeats 3] [--shuffle]
        [--profile DIR] [--table results/dedup-job-<time>.json]

The job is ``pipelines/keyed_count.py`` as ``bench/peers.py`` runs it (JSON clicks in 8
partitions keyed by user; parse, keep ``amount > 0``, running (count, amount sum) per user, one
output per record into a transactional ``KafkaSink``; 1 worker, aligned 1 s checkpoints, until
idle), by default with the keyed source (no shuffle; ``--shuffle``: ``key_by`` through a channel
topic). The variants:

* ``no-dedup``: the job as it is;
* ``dedup``: the same job with ``DEDUP=1``: a per-user ``dedup`` step on the click's
  ``event_id`` (horizon 5 min of event time) before the aggregate: Bloom filters in front of
  Redis (embedded, on loopback, unless ``EOSFLOW_REDIS_URL`` names one), with the C accelerator
  of :mod:`dedup.native` where it was built;
* ``dedup-python``: ``dedup`` without the C accelerator (``EOSFLOW_NATIVE=0``), as on a
  machine where ``pip install`` found no compiler.

**The input** (one topic, read by every run from its start): ``--records`` distinct clicks
(``examples/clicks.py``) plus re-sent copies, so that ``--duplicates`` of the records in the
topic are copies (a copy repeats a click 1 to 2,000 clicks later: same ``event_id``, a later
offset, as an at-least-once producer re-sending). **What is compared**: both variants read the
same records; the rate is records read per second, from the launch until an independent
``read_committed`` reader has every output. The dedup job writes one output per distinct click
(its copies dropped), the other one output per record read (copies counted twice); so the dedup
job also writes ``--duplicates`` fewer outputs. Each output is checked against an expectation
computed from the generator, never from the engine: the distinct clicks' running totals for
``dedup``, the copies' too for ``no-dedup`` (``peers.check_output``).

**Redis round trips** are counted twice: the deduplicator's own counter (each ``lookup``,
``insert``, ``verify`` or GC call is one round trip; the worker logs it when the step closes),
and the commands Redis executed during the run (``INFO commandstats`` before and after, the
benchmark's own ``INFO`` calls left out). Redis's CPU (``INFO cpu``) is reported apart from the
job's and the broker's.

Runs alternate (no-dedup, dedup, then dedup, no-dedup, ...). The table and a JSON go to
``bench/results/dedup-job-<time>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import peers  # noqa: E402
import profiles  # noqa: E402
from clicks import click_events, produce_clicks, with_duplicates  # noqa: E402  (peers' path)
from peers import Outcome, create_input, expected_outputs  # noqa: E402

from connectors import KafkaSettings  # noqa: E402
from dedup.store import redis_client  # noqa: E402
from processor.embedded import servers  # noqa: E402

VARIANTS = ("no-dedup", "dedup", "dedup-python")
LABELS = {
    "no-dedup": "{job}, no dedup (copies counted)",
    "dedup": "{job} + dedup(event_id, within 5 min), Bloom + Redis",
    "dedup-python": "{job} + dedup, without the C accelerator (EOSFLOW_NATIVE=0)",
}
_CLOSED = re.compile(r"dedup closed step=(\S+) (.*?) round_trips=(\d+)")


def _say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def resend_rate(share: float) -> float:
    """The probability of re-sending a click that makes ``share`` of the stream copies."""
    if not 0 <= share < 1:
        raise ValueError(f"--duplicates must be in [0, 1), got {share}")
    return share / (1 - share)


def redis_counters(client: Any) -> dict[str, float]:
    """Commands executed per command name, and Redis's CPU seconds so far."""
    stats = client.info("commandstats")
    out: dict[str, float] = {
        name.removeprefix("cmdstat_"): float(v["calls"]) for name, v in stats.items()
    }
    cpu = client.info("cpu")
    out["~cpu_s"] = float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])
    return out


def dedup_closed(log: Path) -> dict[str, int]:
    """The deduplicator's counters from a worker log (summed over its incarnations)."""
    total: dict[str, int] = {}
    if not log.exists():
        return total
    for match in _CLOSED.finditer(log.read_text(errors="replace")):
        pairs = [kv.split("=", 1) for kv in match[2].split()]
        for key, value in [*pairs, ["round_trips", match[3]]]:
            total[key] = total.get(key, 0) + int(value)
    return total


class DedupBench(peers.Bench):
    """``peers.Bench`` over one input with copies, for the two variants; a system is named
    ``<variant>-<repeat>`` (each run its own job, output topic and state)."""

    def __init__(self, args: argparse.Namespace, brokers: str, work: Path, redis: Any) -> None:
        super().__init__(args, brokers, work)  # self.want: the distinct clicks' outputs
        self.redis = redis
        self.rate = resend_rate(args.duplicates)
        sent = list(with_duplicates(click_events(args.records), self.rate))
        self.distinct, self.inputs = args.records, len(sent)
        self.expect = {
            "dedup": (self.want, self.finals),
            "dedup-python": (self.want, self.finals),
            "no-dedup": expected_outputs(0, events=sent),
        }
        # records read per run (what the rate and the progress lines count)
        self.args = argparse.Namespace(**{**vars(args), "records": self.inputs})
        self.input = f"dedup-job-clicks-{self.run_id}"
        self.runs: list[dict[str, Any]] = []

    def produce(self) -> float:
        create_input(self.brokers, self.input)
        return produce_clicks(
            self.brokers, self.input, self.distinct, partitions=peers.PARTITIONS,
            duplicates=self.rate,
        )  # fmt: skip

    def label(self, system: str) -> str:
        variant, repeat = system.rsplit("-", 1)
        return f"{_label(variant, self.args.shuffle)}, run {repeat}"

    def command(self, system: str) -> list[str]:
        variant = system.rsplit("-", 1)[0]
        return [
            sys.executable, str(BENCH / "peers.py"), "--child-eosflow", "1",
            *([] if self.args.shuffle else ["--keyed-source"]),
            *(["--dedup"] if variant != "no-dedup" else []),
        ]  # fmt: skip

    def run(self, system: str) -> Outcome:
        variant, repeat = system.rsplit("-", 1)
        self.want, self.finals = self.expect[variant]
        before = redis_counters(self.redis)
        native = os.environ.pop("EOSFLOW_NATIVE", None)
        if variant == "dedup-python":  # the job's processes inherit it
            os.environ["EOSFLOW_NATIVE"] = "0"
        try:
            outcome = super().run(system)
        finally:
            os.environ.pop("EOSFLOW_NATIVE", None)
            if native is not None:
                os.environ["EOSFLOW_NATIVE"] = native
        after = redis_counters(self.redis)
        commands = {
            k: int(after[k] - before.get(k, 0))
            for k in after
            if not k.startswith("~") and k != "info" and after[k] > before.get(k, 0)
        }
        log = self.work / system / "jobs" / f"peers-{system}-{self.run_id}" / "worker-0.log"
        stats = dedup_closed(log)
        if variant != "no-dedup" and not stats:
            outcome.notes.append(f"no 'dedup closed' line in {log}: round trips unknown")
        n = self.inputs
        self.runs.append(
            {
                **asdict(outcome),
                "variant": variant,
                "repeat": int(repeat),
                "inputs": n,
                "records_per_s": outcome.rate(n),
                "cpu_us_per_record": 1e6 * (outcome.cpu_s or 0) / n,
                "broker_cpu_us_per_record": 1e6 * (outcome.broker_cpu_s or 0) / n,
                "redis_cpu_us_per_record": 1e6 * (after["~cpu_s"] - before["~cpu_s"]) / n,
                "redis_commands": commands,
                "redis_commands_per_1000": 1000 * sum(commands.values()) / n,
                "dedup": stats,
                "round_trips_per_1000": 1000 * stats["round_trips"] / n if stats else None,
            }
        )
        if stats:
            _say(f"{system}: dedup {stats}; Redis commands {commands}")
        return outcome


def _label(variant: str, shuffle: bool) -> str:
    return LABELS[variant].format(job="shuffled job (key_by)" if shuffle else "keyed job")


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def _cpu_per_record(runs: list[dict[str, Any]]) -> float | None:
    """Median CPU-µs per record read: the job's, the broker's and Redis's together."""
    totals = [
        r["cpu_us_per_record"] + r["broker_cpu_us_per_record"] + r["redis_cpu_us_per_record"]
        for r in runs
    ]
    return statistics.median(totals) if totals else None


def table(runs: list[dict[str, Any]], shuffle: bool = False) -> str:
    """The Markdown table: one row per variant (medians over the repeats, every run listed).
    "x no-dedup by CPU" divides the CPU per record (job, broker and Redis) of the job without
    dedup by the one with it: the rate ratio on a machine the two jobs have to themselves,
    which a shared machine's wall clock blurs."""
    ok = [r for r in runs if r["status"] == "ok"]
    base = _median([r for r in ok if r["variant"] == "no-dedup"], "records_per_s")
    base_cpu = _cpu_per_record([r for r in ok if r["variant"] == "no-dedup"])
    rows = [
        "| job (1 worker) | records/s, median (each run) | x no-dedup | CPU-µs/record: job + "
        "broker + Redis | x no-dedup by CPU | Redis round trips / 1,000 records | Redis "
        "commands / 1,000 records | copies dropped | outputs |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for variant in VARIANTS:
        mine = [r for r in runs if r["variant"] == variant]
        good = [r for r in mine if r["status"] == "ok"]
        rate = _median(good, "records_per_s")
        each = ", ".join(f"{r['records_per_s']:,.0f}" for r in good)
        cpu = "-"
        if good:
            cpu = " + ".join(
                f"{_median(good, k):.1f}"
                for k in (
                    "cpu_us_per_record",
                    "broker_cpu_us_per_record",
                    "redis_cpu_us_per_record",
                )
            )
        total_cpu = _cpu_per_record(good)
        trips = _median(good, "round_trips_per_1000")
        commands = _median(good, "redis_commands_per_1000")
        drops = [r["dedup"].get("duplicates", 0) for r in good if r["dedup"]]
        failed = [r["status"] for r in mine if r["status"] != "ok"]
        rows.append(
            f"| {_label(variant, shuffle)} | {f'{rate:,.0f} ({each})' if rate else '-'} "
            f"| {f'{rate / base:.2f}' if rate and base else '-'} | {cpu} "
            f"| {f'{base_cpu / total_cpu:.2f}' if base_cpu and total_cpu else '-'} "
            f"| {f'{trips:.2f}' if trips is not None else '-'} "
            f"| {f'{commands:.2f}' if commands is not None else '-'} "
            f"| {f'{statistics.median(drops):,.0f}' if drops else '-'} "
            f"| {'exactly once, ' + str(len(good)) + ' runs' if not failed else failed[0]} |"
        )
    return "\n".join(rows)


def pair_ratios(runs: list[dict[str, Any]]) -> list[float]:
    """dedup / no-dedup rate of each repeat (the two runs of a repeat are neighbours)."""
    out = []
    for repeat in sorted({r["repeat"] for r in runs}):
        rates = {r["variant"]: r["records_per_s"] for r in runs if r["repeat"] == repeat}
        if rates.get("dedup") and rates.get("no-dedup"):
            out.append(rates["dedup"] / rates["no-dedup"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=100_000, help="distinct clicks")
    parser.add_argument(
        "--duplicates", type=float, default=0.10, help="share of the input that is copies"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shuffle", action="store_true", help="key_by through a channel topic")
    parser.add_argument("--timeout", type=float, default=600.0, help="per run, seconds")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated, e.g. dedup"
    )
    parser.add_argument(
        "--profile", type=Path, metavar="DIR",
        help="run under py-spy (subprocesses too): DIR/<variant>-<repeat>.raw and -top.txt; "
        "such a run's rates are not comparable with an unprofiled one's",
    )  # fmt: skip
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument(
        "--table", type=Path, metavar="RESULTS.json", help="print the table of a saved run and exit"
    )
    args = parser.parse_args()
    if args.table:
        saved = json.loads(args.table.read_text())
        print(table(saved["runs"], saved.get("shuffle", False)))
        return
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if set(variants) - set(VARIANTS):
        parser.error(f"--variants: expected some of {','.join(VARIANTS)}")
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    with servers(["kafka", "redis"]) as endpoints:
        assert endpoints.kafka_brokers is not None and endpoints.redis_url is not None
        os.environ["EOSFLOW_REDIS_URL"] = endpoints.redis_url  # the child's dedup step
        brokers = endpoints.kafka_brokers
        origin = endpoints.origin
        _say(f"kafka: {brokers} ({origin['kafka']}); redis: {endpoints.redis_url} "
             f"({origin['redis']})")  # fmt: skip
        client = redis_client(endpoints.redis_url, name="bench-dedup-job")
        try:
            run(args, variants, brokers, origin, client)
        finally:
            client.close()


def run(
    args: argparse.Namespace, variants: list[str], brokers: str, origin: dict, client: Any
) -> None:
    from connectors.probe import probe_broker

    hides = probe_broker(KafkaSettings.from_env(brokers=brokers)).read_committed_hides_aborted
    _say(f"broker probe: read_committed hides aborted transactions: {hides}")
    work = Path(tempfile.mkdtemp(prefix="eosflow-dedup-job-"))
    bench = DedupBench(args, brokers, work, client)
    took = bench.produce()
    copies = bench.inputs - args.records
    _say(
        f"wrote {bench.inputs:,} clicks ({args.records:,} distinct + {copies:,} copies, "
        f"{copies / bench.inputs:.1%}) to {bench.input} in {took:.1f}s"
    )
    for repeat in range(args.repeats):
        for variant in variants if repeat % 2 == 0 else variants[::-1]:
            bench.run(f"{variant}-{repeat}")
    runs = bench.runs
    ratios = pair_ratios(runs)
    saved = BENCH / "results" / f"dedup-job-{time.strftime('%Y%m%d-%H%M%S')}.json"
    summary = {
        "records_distinct": args.records,
        "records_in": bench.inputs,
        "copies": copies,
        "duplicates_share": copies / bench.inputs,
        "shuffle": args.shuffle,
        "cores": os.cpu_count(),
        "broker": origin["kafka"],
        "brokers": brokers,
        "redis": origin["redis"],
        "read_committed_hides_aborted": hides,
        "pair_ratios": ratios,
        "profiled": args.profile is not None,
    }
    saved.write_text(json.dumps({**summary, "runs": runs}, indent=1))
    print()
    print(
        f"{bench.inputs:,} records read per run ({args.records:,} distinct clicks + {copies:,} "
        f"copies = {copies / bench.inputs:.1%}), {os.cpu_count()} cores, broker: "
        f"{origin['kafka']} ({brokers}), Redis: {origin['redis']}; {saved}"
    )
    print(table(runs, args.shuffle))
    if ratios:
        print(
            f"\ndedup / no-dedup per repeat: {', '.join(f'{r:.2f}' for r in ratios)} "
            f"(median {statistics.median(ratios):.2f})"
        )
    for r in runs:
        for note in r["notes"]:
            print(f"- {r['system']}: {note}")
    if args.profile is not None:
        for r in runs:
            raw = args.profile / f"{r['system']}.raw"
            if raw.exists():
                summary_text = profiles.top(raw, 30)
                (args.profile / f"{r['system']}-top.txt").write_text(summary_text + "\n")
                print(f"\n{summary_text}")
    if all(r["status"] == "ok" for r in runs) and not args.keep_logs:
        shutil.rmtree(work, ignore_errors=True)
    else:
        _say(f"logs kept in {work}")


if __name__ == "__main__":
    main()
