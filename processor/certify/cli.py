"""The ``eosflow certify`` command line."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from processor.certify.core import CertifyOptions, certify
from processor.certify.plan import FAULT_KINDS
from processor.errors import ConfigError
from processor.runtime.job import parse_duration

__all__ = ["add_parser", "command"]

EPILOG = """\
Input: each source topic is copied once (a snapshot every run reads alike) from the broker named
by EOSFLOW_KAFKA_BROKERS, or loaded from a JSON-lines file with --input TOPIC=FILE (then certify
may start its own broker). Without EOSFLOW_KAFKA_BROKERS / EOSFLOW_REDIS_URL certify starts
its own broker (behind a fault proxy) and Redis, which lets it cut the network and restart Redis.

Exit status: 0 PASS, 1 FAIL (or a fault-free run failed), 3 NONDETERMINISTIC, 2 bad usage.
Example:
  eosflow certify examples/running_total.py --input clicks=clicks.jsonl --input-key user
"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "certify",
        help="prove a pipeline exactly-once: runs it under faults, compares the outputs",
        description=(
            "Runs PIPELINE twice without faults (the reference output, and a check that the "
            "pipeline is deterministic), then --runs times with injected faults, every run "
            "on the same snapshot of the input and into outputs of its own, and compares "
            "each run's committed output with the reference."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("pipeline", help="a Python file that defines `flow = Dataflow(...)`")
    p.add_argument(
        "--runs", type=int, metavar="N",
        help="fault runs (default: one per fault kind possible here); kinds are taken in turn",
    )  # fmt: skip
    p.add_argument(
        "--faults", default=",".join(FAULT_KINDS), metavar="KINDS",
        help=f"comma-separated, among {','.join(FAULT_KINDS)} (default: all)",
    )  # fmt: skip
    p.add_argument("--runner", default="local", choices=["local", "spark"])
    p.add_argument("--workers", type=int, default=2, help="workers of every run (default 2)")
    p.add_argument(
        "--checkpoint-interval", type=parse_duration, default=0.5, metavar="DURATION",
        help="checkpoint interval of every run (default 500ms: more checkpoints, more faults "
        "between them)",
    )  # fmt: skip
    p.add_argument("--mode", default="aligned", choices=["aligned", "unaligned"])
    p.add_argument("--recovery", default="global", choices=["global", "local"])
    p.add_argument("--kills", type=int, default=3, help="SIGKILLs of a 'kill' run (default 3)")
    p.add_argument(
        "--outage", type=parse_duration, default=5.0, metavar="DURATION",
        help="how long a broker partition or Redis restart lasts (default 5s)",
    )  # fmt: skip
    p.add_argument(
        "--pace", type=parse_duration, default=10.0, metavar="DURATION",
        help="a fault run reads its input at a pace that takes this long, so that faults land "
        "while records flow (default 10s; 0: full speed)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, help="the seed of the fault plan (printed; rerun with it)")
    p.add_argument(
        "--input", action="append", default=[], metavar="TOPIC=FILE",
        help="read source TOPIC from a JSON-lines file instead of the broker (repeatable)",
    )  # fmt: skip
    p.add_argument(
        "--input-key", metavar="FIELD",
        help="--input lines are JSON objects keyed by FIELD: records keyed and partitioned by "
        "it, as a keyed producer writes them (default: unkeyed, round robin)",
    )  # fmt: skip
    p.add_argument(
        "--partitions", type=int, default=4,
        help="partitions of a topic loaded from --input (default 4)",
    )  # fmt: skip
    p.add_argument(
        "--side-output", action="append", default=[], type=Path, metavar="FILE",
        help="a file the pipeline appends to outside its sinks; compared like a sink "
        "(repeatable)",
    )  # fmt: skip
    p.add_argument("--json", type=Path, metavar="FILE", help="write the report as JSON")
    p.add_argument("--junit", type=Path, metavar="FILE", help="write JUnit XML (one case a run)")
    p.add_argument("--workdir", type=Path, help="keep the runs' state and logs here")
    p.add_argument("--keep", action="store_true", help="keep the runs' files, topics and tables")
    p.add_argument("--progress", action="store_true", help="show every run's progress lines")
    p.set_defaults(func=command)


def _inputs(items: list[str]) -> dict[str, Path]:
    found = {}
    for item in items:
        topic, sep, file = item.partition("=")
        if not sep or not topic or not file:
            raise ConfigError(f"--input {item!r}: expected TOPIC=FILE (a JSON-lines file)")
        found[topic] = Path(file)
    return found


def command(args: argparse.Namespace) -> int:
    if not args.progress and not args.verbose:  # the runs' restarts are the point: say them once
        for name in ("processor", "sinks", "connectors", "dedup"):
            logging.getLogger(name).setLevel(logging.ERROR)
    options = CertifyOptions(
        pipeline=args.pipeline,
        runs=args.runs,
        faults=tuple(f.strip() for f in args.faults.split(",") if f.strip()),
        runner=args.runner,
        workers=args.workers,
        checkpoint_interval=args.checkpoint_interval,
        mode=args.mode,
        recovery=args.recovery,
        kills=args.kills,
        outage_s=args.outage,
        pace_s=args.pace,
        seed=args.seed,
        inputs=_inputs(args.input),
        partitions=args.partitions,
        input_key=args.input_key,
        side_outputs=list(args.side_output),
        workdir=args.workdir,
        keep=args.keep,
        verbose=args.progress,
    )
    report = certify(options)
    print(report.text(), flush=True)
    if args.json:
        report.write_json(args.json)
    if args.junit:
        report.write_junit(args.junit)
    sys.stdout.flush()
    return report.exit_code
