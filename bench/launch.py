"""The fixed cost of an eosflow run: launch -> first output -> exit, on a small bounded input.

Runs the reference job (``pipelines/keyed_count.py``, keyed source, transactional
``KafkaSink``, as ``bench/peers.py`` runs it) on 1,000 clicks, once per tree and round,
alternating between the trees (compare within one run only: the machine is shared)::

    python bench/launch.py --brokers 127.0.0.1:9092 --trees ../wt-base,. --rounds 8

Each tree runs its own code (``PYTHONPATH=<tree>``, and ``<tree>`` as the working directory: a
worker, started as ``python -m``, imports from its working directory first). An independent
``read_committed`` reader notes the first output (its clock polls every 50 ms); ``exit`` is
when the job's process ended.
The runner's own marks of the start (``status.json``'s ``startup``: the pipeline compiled, the
checks, the topics, the claim, the workers launched and connected, the first checkpoint
triggered, completed and committed; ``process_s``: the interpreter and imports before the
runner) are kept beside them, as ``runner.<mark>`` (seconds since the runner was built).
The raw timings go to ``bench/results/launch-<time>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent / "examples")]

from clicks import produce_clicks  # noqa: E402
from peers import PARTITIONS, Reader, create_input  # noqa: E402

from connectors.admin import TopicAdmin  # noqa: E402
from connectors.config import KafkaSettings  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--brokers", default=os.environ.get("EOSFLOW_KAFKA_BROKERS"))
    parser.add_argument("--trees", default=".", help="comma-separated checkouts to compare")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--records", type=int, default=1000)
    args = parser.parse_args()
    if not args.brokers:
        parser.error("--brokers or EOSFLOW_KAFKA_BROKERS (e.g. from 'eosflow dev up')")
    trees = [str(Path(t).resolve()) for t in args.trees.split(",")]
    settings = KafkaSettings.from_env(brokers=args.brokers)
    admin = TopicAdmin(settings)
    source = f"launch-clicks-{uuid.uuid4().hex[:8]}"
    create_input(args.brokers, source)
    produce_clicks(args.brokers, source, args.records, partitions=PARTITIONS)
    runs: dict[str, list[dict[str, float | None]]] = {t: [] for t in trees}
    for _ in range(args.rounds):
        for tree in trees:
            run_id = uuid.uuid4().hex[:8]
            output = f"launch-out-{run_id}"
            admin.ensure_topic(output, PARTITIONS)
            reader = Reader(settings, output, args.records)
            reader.start()
            time.sleep(0.3)  # the reader is assigned before the launch
            env = dict(
                os.environ,
                PYTHONPATH=tree,
                EOSFLOW_KAFKA_BROKERS=args.brokers,
                JOB_NAME=f"launch-{run_id}",
                CLICKS_TOPIC=source,
                OUTPUT_TOPIC=output,
                TXN_PREFIX=f"launch-{run_id}",
                STATE_DIR=tempfile.mkdtemp(prefix="eosflow-launch-"),
            )
            command = [sys.executable, f"{tree}/bench/peers.py", "--child-eosflow"]
            start = time.monotonic()
            # cwd=tree as well: workers start as ``python -m processor...``, which puts the
            # working directory first on sys.path, before PYTHONPATH (run from another checkout,
            # every tree's workers ran that checkout's code)
            subprocess.run(
                [*command, str(args.workers), "--keyed-source"], env=env, check=True, cwd=tree
            )
            exited = time.monotonic() - start
            reader.join(30)
            row: dict[str, float | None] = {
                "first_output_s": reader.first - start if reader.first else None,
                "every_output_s": reader.done - start if reader.done else None,
                "exit_s": exited,
            }
            row.update(_startup(Path(env["STATE_DIR"]), env["JOB_NAME"]))
            runs[tree].append(row)
            print(tree, {k: round(v, 3) if v else v for k, v in row.items()}, flush=True)
    for tree, rows in runs.items():
        keys = [k for k in rows[0] if all(k in r for r in rows)]
        medians = {k: statistics.median(r[k] or 0.0 for r in rows) for k in keys}
        print(tree, "medians:", {k: round(v, 3) for k, v in medians.items()})
    out = BENCH / "results" / f"launch-{time.strftime('%Y%m%d-%H%M%S')}.json"
    meta = {"records": args.records, "workers": args.workers, "brokers": args.brokers}
    out.write_text(json.dumps({**meta, "runs": runs}, indent=1))
    print(f"raw data: {out}")


def _startup(state: Path, job: str) -> dict[str, float | None]:
    """The runner's own marks of the start (``status.json``'s ``startup``, seconds since the
    runner was built; ``process_s``: the interpreter and imports before it), prefixed
    ``runner.``; none from a tree whose runner does not write them."""
    path = state / "jobs" / job / "status.json"
    try:
        marks = json.loads(path.read_text()).get("startup") or {}
    except (OSError, ValueError):
        return {}
    return {f"runner.{k}": float(v) for k, v in marks.items()}


if __name__ == "__main__":
    main()
