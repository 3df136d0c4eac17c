"""Time to rescale: stop a job, start it at another ``--workers``, and time the way to its first
new committed output, against a plain restart at the same parallelism in the same run.

The job is ``pipelines/keyed_count.py`` (a running count and sum per user, part files), over
clicks of ``--users`` distinct users, so the state to move holds that many keys. Per repeat:

1. run on 2 workers until every click is read, then ``eosflow savepoint --stop`` (``stop_s``:
   the request to the runner's return, a final aligned checkpoint committed);
2. write ``--more`` new clicks, start on 3 workers (a rescale), time it, stop the same way;
3. the same to 1 worker (a rescale);
4. the same on 1 worker again: a plain restart, the baseline.

For each start: ``rewrite_s`` (the runner's rewrite of the checkpoint into the new shape,
settling the old sinks included: the manifest's ``duration_ms``), ``first_output_s`` (from the
runner's start to the first part file of a checkpoint after the restored one: new results are
visible), and the state size (snapshot bytes). The ratio that matters is ``first_output_s`` of a
rescale over that of the plain restart, measured in the same run.

Runs on the embedded broker, or on ``EOSFLOW_KAFKA_BROKERS``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import tempfile
import threading
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

from processor.embedded import servers
from processor.runtime.shape.savepoints import request_savepoint
from processor.runtime.supervision.local import RunOptions
from processor.snapshot.store import SnapshotStore
from processor.testing.chaos import input_read

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent / "examples"))
sys.path.insert(0, str(BENCH))

from clicks import produce_clicks  # noqa: E402
from jobs import make_runner  # noqa: E402

PIPELINE = BENCH / "pipelines" / "keyed_count.py"
_PART = re.compile(r"part-\d{5,}-(\d{10})\.jsonl\Z")


def _committed(directory: Path) -> set[int]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return set()
    return {int(m.group(1)) for m in map(_PART.match, names) if m}


def run_phase(
    env: dict[str, str], state: str, workers: int, records: int, *, runner: str = "local"
) -> dict[str, Any]:
    """Starts the job on ``workers``, waits for its first new output and for every record read,
    stops it with a savepoint; returns the timings."""
    options = RunOptions(
        workers=workers,
        checkpoint_interval=1.0,
        environ=env,
        state_dir=state,
        metrics="off",
        keep_checkpoints=1000,  # the rescaled checkpoint stays to be read back here
    )
    output = Path(env["OUTPUT_DIR"])
    before = max(_committed(output), default=0)
    job = make_runner(runner, PIPELINE, options)
    started = time.monotonic()
    thread = threading.Thread(target=job.run, daemon=True)
    thread.start()
    first = None
    while thread.is_alive():
        if first is None and max(_committed(output), default=0) > before:
            first = time.monotonic() - started
        read = input_read(job, records)
        if first is not None and read is not None and read >= 1.0:
            break
        time.sleep(0.01)
    store = SnapshotStore(job.store.url)
    latest = store.latest_completed(env["JOB_NAME"])
    stopping = time.monotonic()
    request_savepoint(store, env["JOB_NAME"], stop=True, path=None, timeout=300)
    thread.join(300)
    stop_s = time.monotonic() - stopping
    rescaled = None
    for chk in store.completed_ids(env["JOB_NAME"]):
        manifest = store.load(env["JOB_NAME"], chk)
        if manifest.metadata.get("rescaled_from") and chk > before:
            rescaled = manifest
            break
    return {
        "workers": workers,
        "rescale": rescaled is not None,
        "rewrite_s": rescaled.metadata["duration_ms"] / 1000 if rescaled else 0.0,
        "state_bytes": sum(h.size for h in rescaled.tasks.values()) if rescaled else None,
        "first_output_s": round(first or float("nan"), 3),
        "stop_s": round(stop_s, 3),
        "checkpoint_bytes": sum(h.size for h in latest.tasks.values()) if latest else None,
    }


def markdown(runs: list[dict[str, Any]]) -> str:
    lines = [
        "| repeat | from -> to | rescale | rewrite s | first output s | stop s | state MB |",
        "|---:|---|---|---:|---:|---:|---:|",
    ]
    for r in runs:
        size = r["state_bytes"] or r["checkpoint_bytes"] or 0
        lines.append(
            f"| {r['repeat']} | {r['from']} -> {r['workers']} | {'yes' if r['rescale'] else 'no'} "
            f"| {r['rewrite_s']:.2f} | {r['first_output_s']:.2f} | {r['stop_s']:.2f} "
            f"| {size / 1e6:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=300_000)
    parser.add_argument("--users", type=int, default=100_000)
    parser.add_argument("--more", type=int, default=2_000, help="clicks written before a start")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--runner", choices=["local", "spark"], default="local")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    runs: list[dict[str, Any]] = []
    with servers(["kafka"]) as endpoints, tempfile.TemporaryDirectory() as tmp:
        brokers = os.environ.get("EOSFLOW_KAFKA_BROKERS") or endpoints.kafka_brokers
        assert brokers is not None
        for repeat in range(args.repeats):
            run_id = uuid.uuid4().hex[:8]
            topic = f"bench-rescale-clicks-{run_id}"
            produce_clicks(brokers, topic, args.records, users=args.users, seed=args.seed)
            env = {
                "JOB_NAME": f"bench-rescale-{run_id}",
                "CLICKS_TOPIC": topic,
                "OUTPUT_DIR": f"{tmp}/out-{run_id}",
                "EOSFLOW_KAFKA_BROKERS": brokers,
            }
            state = f"{tmp}/state-{run_id}"
            total = args.records
            run_phase(env, state, 2, total, runner=args.runner)
            previous = 2
            for workers in (3, 1, 1):
                produce_clicks(
                    brokers, topic, args.more, users=args.users, seed=args.seed + total
                )  # appended: the same topic, more partitions' worth of new clicks
                total += args.more
                run = run_phase(env, state, workers, total, runner=args.runner)
                run.update(repeat=repeat, runner=args.runner)
                run["from"] = previous
                previous = workers
                runs.append(run)
                print(markdown([run]).splitlines()[-1], flush=True)
    print(markdown(runs))
    out = BENCH / "results" / f"rescale-{datetime.now():%Y-%m-%d-%H%M%S}.json"
    out.parent.mkdir(exist_ok=True)
    meta = {"args": vars(args), "cpus": os.cpu_count(), "loadavg": os.getloadavg()}
    out.write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
