"""What a loop costs: checkpoint duration and back-edge log size with records circulating.

    python bench/iterate.py [--records 40000] [--repeats 2] [--interval 0.5]

One run starts the embedded broker (or uses ``EOSFLOW_KAFKA_BROKERS``), writes ``--records``
clicks, and runs the loop pipeline of the crash tests (``tests/e2e/pipelines/loop_hops.py``:
every click goes around a loop through a shuffle and a keyed pass counter ``amount % HOPS_MOD``
times) on the local runner with 2 workers, in four configurations per repeat, interleaved:

* ``HOPS_MOD=1``: the same graph, nothing fed back (the back-edge carries only barriers and
  markers): the baseline;
* ``HOPS_MOD=6``: 0 to 5 hops per click (2.5 on average; 5 exceeds ``max_iterations=4`` and is
  a dead letter), so 3.4 passes per click;

each in aligned and unaligned mode. Measured per run: clicks and loop passes per second
(``records / (seconds - ready_s)``), completed checkpoints, their duration (median, p90), the
back-edge log per checkpoint (median, max records), and the time from the final trigger to the
end (``--until-idle`` takes checkpoints until one finds the loop empty). Every run's committed
output is compared with the answer computed from the click generator.

Results go to ``bench/results/iterate-<date>.json`` and the Markdown table is printed
(``bench/RESULTS.md``, "Loops").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import sys
import tempfile
import uuid
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
PIPELINE = ROOT / "tests" / "e2e" / "pipelines" / "loop_hops.py"
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(PIPELINE.parent))

from clicks import canonical, produce_clicks  # noqa: E402
from jobs import drop_channel_topics  # noqa: E402
from loop_hops import MAX_ITERATIONS, expected_hops  # noqa: E402

from processor.embedded import servers  # noqa: E402
from processor.runtime.supervision.local import LocalRunner, RunOptions  # noqa: E402
from sinks import read_jsonl  # noqa: E402


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, -(-9 * len(ordered) // 10) - 1)]


def run_once(brokers: str, topic: str, records: int, hops_mod: int, mode: str, args: Any) -> dict:
    work = Path(tempfile.mkdtemp(prefix="eosflow-bench-iterate-"))
    environ = {
        "JOB_NAME": f"bench-iterate-{uuid.uuid4().hex[:8]}",
        "CLICKS_TOPIC": topic,
        "OUTPUT_DIR": str(work / "output"),
        "DEAD_LETTER_DIR": str(work / "dead"),
        "HOPS_MOD": str(hops_mod),
        "EOSFLOW_KAFKA_BROKERS": brokers,
    }
    options = RunOptions(
        workers=2,
        checkpoint_interval=args.interval,
        mode=mode,
        until_idle=True,
        environ=environ,
        state_dir=str(work / "state"),
    )
    job = LocalRunner(PIPELINE, options)
    result = job.run()
    with contextlib.suppress(Exception):
        drop_channel_topics(job)
    want, want_dead = expected_hops(records, args.seed, hops_mod)
    got = Counter(canonical(x) for x in read_jsonl(environ["OUTPUT_DIR"]))
    dead = Counter(
        canonical([d["step"], d["error_type"], d["value"]]) for d in read_jsonl(work / "dead")
    )
    exact = got == want and dead == want_dead
    passes = sum(hops + 1 for hops in _hops(records, args.seed, hops_mod))
    steady = result.seconds - result.ready_s
    logs = [n for _c, n, _s in result.loop_logs]
    ms = [s * 1000 for _c, _n, s in result.loop_logs]
    return {
        "hops_mod": hops_mod,
        "mode": mode,
        "records": records,
        "passes": passes,
        "clicks_per_s": records / steady,
        "passes_per_s": passes / steady,
        "checkpoints": len(logs),
        "checkpoint_ms_median": statistics.median(ms),
        "checkpoint_ms_p90": _p90(ms),
        "log_median": statistics.median(logs),
        "log_max": max(logs),
        "final_s": result.seconds - result.final_trigger_s,
        "loop_logs": result.loop_logs,
        "output": "exactly once" if exact else f"WRONG ({sum(got.values())} lines)",
    }


def _hops(records: int, seed: int, hops_mod: int) -> list[int]:
    from clicks import click_events

    hops = [int(str(c["amount"])) % hops_mod for c in click_events(records, seed=seed)]
    return [min(h, MAX_ITERATIONS) for h in hops]  # more: dropped after MAX_ITERATIONS + 1 passes


def markdown(runs: list[dict[str, Any]]) -> str:
    lines = [
        "| loop traffic | mode | clicks/s | passes/s | checkpoints | checkpoint ms median (p90) "
        "| back-edge log median (max) | final trigger → end s | output |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in runs:
        traffic = "none (HOPS_MOD=1)" if r["hops_mod"] == 1 else f"HOPS_MOD={r['hops_mod']}"
        lines.append(
            f"| {traffic} | {r['mode']} | {r['clicks_per_s']:,.0f} | {r['passes_per_s']:,.0f} "
            f"| {r['checkpoints']} | {r['checkpoint_ms_median']:.0f} ({r['checkpoint_ms_p90']:.0f})"
            f" | {r['log_median']:,.0f} ({r['log_max']:,}) | {r['final_s']:.1f} | {r['output']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=40_000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--interval", type=float, default=0.5, help="checkpoint interval, s")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    runs: list[dict[str, Any]] = []
    with servers(["kafka"]) as endpoints:
        brokers = endpoints.kafka_brokers
        assert brokers is not None
        topic = f"bench-iterate-clicks-{uuid.uuid4().hex[:8]}"
        produce_clicks(brokers, topic, args.records, seed=args.seed)
        for repeat in range(args.repeats):
            for mode in ("aligned", "unaligned"):
                for hops_mod in (1, 6):
                    run = run_once(brokers, topic, args.records, hops_mod, mode, args)
                    run["repeat"] = repeat
                    runs.append(run)
                    print(markdown([run]).splitlines()[-1], flush=True)
    print(markdown(runs))
    out = BENCH / "results" / f"iterate-{datetime.now():%Y-%m-%d}.json"
    out.parent.mkdir(exist_ok=True)
    meta = {"args": vars(args), "cpus": os.cpu_count(), "loadavg": os.getloadavg()}
    out.write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
