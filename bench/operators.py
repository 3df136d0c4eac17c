"""What a window and a join cost: eosflow against a hand-written loop doing the same (issue 38).

    python bench/operators.py [--records 100000] [--systems keyed-loop,keyed-eosflow,...]

The input is ``peers.py``'s: ``examples/clicks.py`` clicks (JSON, 8 partitions keyed by user,
1,000 users). Three jobs, each run by eosflow (1 worker, ``LocalRunner``, aligned 1 s
checkpoints, until idle, transactional ``KafkaSink``) and by a hand-written confluent-kafka +
orjson loop (transactions every 1 s, ``peer_jobs/``):

* ``keyed``: the plain keyed job, the baseline (``peers.py``'s ``eosflow1-keyed`` and
  ``loop-txn``): running (count, amount) per user, one output per click;
* ``window``: (count, amount sum) per user and tumbling 10 s event-time window, the watermark
  from the clicks' ``ts_ms`` (1 s out of order), one output per (user, window) when the window
  closes; the windows open at the end of the input fire then (a bounded eosflow run ends with
  the maximum watermark; the loop flushes them) (``pipelines/window_count.py``,
  ``peer_jobs/operator_loop.py window``);
* ``join``: every click enriched with its user's plan as of the click's time, an event-time
  temporal join (left) with the user table of ``examples/users.py`` (profiles written a minute
  before the clicks or during them, plan changes, deletions; about 1.8 rows per user,
  deterministic), the enrichment a user would write (``stream.join(name, table)``); an interval
  join pairs events of two streams, not a stream with reference data. Both inputs are keyed
  sources partitioned alike, so eosflow joins without a shuffle; the loop reads both topics
  in one consumer and holds each click until the watermark passes it, as the join does
  (``pipelines/temporal_join.py``, ``peer_jobs/operator_loop.py join``).

Each system runs as a subprocess over the same input; the clock runs from its launch until an
independent ``read_committed`` reader (``peers.Reader``) has seen every output. CPU is the
subprocess's with its reaped children, and the broker's (``jobs.broker_cpu_s``). Every output
topic is then read ``read_committed`` to its end and compared, as a multiset, with the answer
computed from the generators alone (``click_events``, ``user_versions``/``RowsAt``); a system
whose output differs is reported, not timed. Results: ``bench/results/operators-<date>.json``.

Flink's published per-core numbers, for context (not this machine, not this job): the Nexmark
suite's README (https://github.com/nexmark/nexmark, "Benchmark Results": Flink 1.13, 3 workers
of 8 cores, datagen source, blackhole sink, RocksDB, exactly-once checkpoints every 3 min) gives
per core 155 K records/s for q0 (pass-through), 75.7 K/s for q12 (count per bidder in a
processing-time tumbling window), 22.1 K/s for q5 (sliding-window count, then max), 146 K/s
for q8 (tumbling-window join of persons and auctions), 130.7 K/s for q13 (a stream joined with
a bounded side input: enrichment) and 12.3 K/s for q7 (window max joined back to the bids).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import orjson

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(BENCH))

import profiles  # noqa: E402
from clicks import click_events, produce_clicks  # noqa: E402
from jobs import broker_cpu_s  # noqa: E402
from peers import (  # noqa: E402
    PARTITIONS,
    Outcome,
    Reader,
    _cpu_children,
    _say,
    create_input,
    dispatch,
    expected_outputs,
    notes_and_profiles,
)
from users import RowsAt, produce_users, user_versions  # noqa: E402

from connectors import KafkaSettings, TopicAdmin  # noqa: E402

JOBS = BENCH / "peer_jobs"
OPERATORS = ("keyed", "window", "join")
SYSTEMS = tuple(f"{op}-{who}" for op in OPERATORS for who in ("loop", "eosflow"))
PIPELINES = {"window": "window_count.py", "join": "temporal_join.py"}
WINDOW_MS = 10_000
LABELS = {
    "keyed": "running count+sum per user (the plain keyed job)",
    "window": "tumbling 10 s window count+sum per user",
    "join": "temporal join with the user table (left)",
}

#: (multiset of expected outputs, decoder of one output message into such an item)
Expectation = tuple[Counter[Any], Callable[[Any], Any]]


def cpu_us(outcome: Outcome, records: int) -> tuple[float, float] | None:
    """CPU µs per input record: the job's (with its reaped children) and the broker's."""
    if outcome.cpu_s is None:
        return None
    return 1e6 * outcome.cpu_s / records, 1e6 * (outcome.broker_cpu_s or 0.0) / records


def expected_keyed(records: int) -> Expectation:
    want, _finals = expected_outputs(records)  # peers.check_output's answer, as a multiset

    def decode(msg: Any) -> Any:
        count, amount = orjson.loads(msg.value())
        return (msg.key().decode(), count, amount)

    return want, decode


def expected_windows(records: int) -> Expectation:
    acc: dict[tuple[str, int], tuple[int, int]] = {}
    for click in click_events(records):
        ts = int(str(click["ts_ms"]))
        key = (str(click["user"]), ts - ts % WINDOW_MS)
        count, total = acc.get(key, (0, 0))
        acc[key] = (count + 1, total + int(str(click["amount"])))
    want = Counter((u, s, s + WINDOW_MS, n, a) for (u, s), (n, a) in acc.items())

    def decode(msg: Any) -> Any:
        w = orjson.loads(msg.value())
        return (msg.key().decode(), w["start_ms"], w["end_ms"], *w["value"])

    return want, decode


def expected_joins(records: int) -> Expectation:
    rows = RowsAt(user_versions(records))
    want: Counter[Any] = Counter()
    for click in click_events(records):
        user, ts = str(click["user"]), int(str(click["ts_ms"]))
        row = rows.at(user, ts)
        want[(user, click["event_id"], click["amount"], None if row is None else row["plan"])] += 1

    def decode(msg: Any) -> Any:
        return (msg.key().decode(), *orjson.loads(msg.value()))

    return want, decode


def check(settings: KafkaSettings, topic: str, expectation: Expectation) -> tuple[str, int]:
    """``("ok", outputs)`` or what is wrong with the committed output of ``topic``."""
    from processor.testing.outputs import scan_topic

    want, decode = expectation
    got: Counter[Any] = Counter()
    undecodable = 0
    for msg in scan_topic(settings, topic, committed=True, timeout=120):
        try:
            got[decode(msg)] += 1
        except Exception:
            undecodable += 1
    outputs = sum(got.values()) + undecodable
    missing, extra = sum((want - got).values()), sum((got - want).values())
    if not (missing or extra or undecodable):
        return "ok", outputs
    return (
        f"FAILED: {outputs:,} outputs for {sum(want.values()):,} expected; {missing:,} missing, "
        f"{extra:,} duplicated or unexpected, {undecodable:,} undecodable"
    ), outputs


def command(system: str) -> list[str]:
    operator, who = system.split("-")
    me = sys.executable
    if who == "loop":
        if operator == "keyed":
            return [me, str(JOBS / "loop.py"), "transactional"]
        return [me, str(JOBS / "operator_loop.py"), operator]
    if operator == "keyed":  # peers.py's own child: keyed_count.py, keyed source
        return [me, str(BENCH / "peers.py"), "--child-eosflow", "1", "--keyed-source"]
    return [me, str(Path(__file__)), "--child", PIPELINES[operator]]


def measure(
    system: str, env: dict[str, str], expectation: Expectation, args: argparse.Namespace
) -> Outcome:
    """Runs ``system`` into a fresh output topic, times it with a ``read_committed`` reader,
    then checks the whole output."""
    outcome = Outcome(system)
    settings = KafkaSettings.from_env(brokers=env["BROKERS"])
    admin = TopicAdmin(settings)
    out = env["OUTPUT_TOPIC"] = f"{env['RUN_ID']}-out"
    admin.ensure_topic(out, PARTITIONS)
    reader = Reader(settings, out, sum(expectation[0].values()))
    log_path = Path(env["STATE_DIR"]) / "log.txt"
    cpu0, broker0 = _cpu_children(), broker_cpu_s()
    _say(f"{system}: launching; log {log_path}")
    start = time.monotonic()
    with open(log_path, "wb") as log:
        argv = command(system)
        if args.profile is not None:
            argv = profiles.wrap(argv, args.profile / f"{system}.raw")
        proc = subprocess.Popen(argv, env=env, cwd=JOBS, stdout=log, stderr=subprocess.STDOUT)
        reader.start()
        deadline = start + args.timeout
        while time.monotonic() < deadline and proc.poll() is None and reader.done is None:
            time.sleep(0.05)
        if reader.done is None and proc.returncode == 0:  # exited: let the reader catch up
            reader.join(min(30.0, max(1.0, deadline - time.monotonic())))
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(1.0, deadline - time.monotonic()))
        if proc.poll() is None:
            outcome.notes.append("killed: still running at the end")
            proc.kill()
            proc.wait()
    reader.stop.set()
    reader.join(10)
    outcome.cpu_s, outcome.broker_cpu_s = _cpu_children() - cpu0, broker_cpu_s() - broker0
    if reader.first is not None:
        outcome.first_output_s = reader.first - start
    status, outcome.outputs = check(settings, out, expectation)
    if status != "ok":
        outcome.status = status
    elif reader.done is None:
        outcome.status = f"INCOMPLETE: {reader.seen:,} outputs seen in {args.timeout:g}s"
    else:
        outcome.status, outcome.seconds = "ok", reader.done - start
        # shorter than 2 s, the span measures commit bursts and the reader (as in peers.py)
        if reader.t10 is not None and reader.t90 is not None and reader.t90 - reader.t10 >= 2:
            outcome.steady_per_s = 0.8 * args.records / (reader.t90 - reader.t10)
    if proc.returncode != 0 or outcome.status != "ok":
        outcome.notes.append(f"exit code {proc.returncode}; log tail:")
        outcome.notes += log_path.read_text(errors="replace").strip().splitlines()[-12:]
    with contextlib.suppress(Exception):
        admin.delete_topics([out])
    rate = outcome.rate(args.records)
    _say(
        f"{system}: {outcome.status}"
        + (f", {rate:,.0f} records/s, CPU {outcome.cpu_s:.1f}s" if rate else "")
    )
    return outcome


def table(outcomes: list[Outcome], records: int) -> str:
    """The Markdown table of one run: rates, CPU per input record, eosflow/loop, and the CPU
    each operator adds to the keyed job of the same system."""
    by = {o.system: o for o in outcomes}
    rows = [
        "| job | system | records/s | s to all outputs (first) | steady records/s (10-90% of "
        "outputs) | CPU-µs/record: job + broker "
        "| job CPU-µs/record over keyed | eosflow/loop (records/s) | outputs | output |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for o in outcomes:
        operator, who = o.system.split("-")
        rate, cpu = o.rate(records), cpu_us(o, records)
        base = by.get(f"keyed-{who}")
        base_cpu = cpu_us(base, records) if base is not None and base.ok else None
        over = "-"
        if operator != "keyed" and cpu and base_cpu and o.ok:
            over = f"{cpu[0] - base_cpu[0]:+.1f}"
        loop = by.get(f"{operator}-loop")
        loop_rate = loop.rate(records) if loop is not None else None
        ratio = f"{rate / loop_rate:.2f}" if who == "eosflow" and rate and loop_rate else "-"
        timed = o.seconds is not None and o.first_output_s is not None
        rows.append(
            f"| {LABELS[operator]} | {who} | {f'{rate:,.0f}' if rate else '-'} "
            f"| {f'{o.seconds:.1f} ({o.first_output_s:.1f})' if timed else '-'} "
            f"| {f'{o.steady_per_s:,.0f}' if o.ok and o.steady_per_s else '-'} "
            f"| {f'{cpu[0]:.1f} + {cpu[1]:.1f}' if cpu else '-'} | {over} | {ratio} "
            f"| {o.outputs:,} | {'exactly once' if o.ok else o.status} |"
        )
    return "\n".join(rows)


def child(pipeline: str) -> None:
    """Runs ``pipelines/<pipeline>`` until idle, 1 worker, aligned 1 s checkpoints (in the
    subprocess of a run, as ``peers.child_eosflow`` runs the keyed job)."""
    from processor.runtime.supervision.local import LocalRunner, RunOptions

    names = ("EOSFLOW_KAFKA_BROKERS", "JOB_NAME", "CLICKS_TOPIC", "OUTPUT_TOPIC", "TXN_PREFIX")
    options = RunOptions(
        workers=1,
        checkpoint_interval=1.0,
        mode="aligned",
        until_idle=True,
        environ={name: os.environ[name] for name in names},
        state_dir=os.environ["STATE_DIR"],
    )
    result = LocalRunner(BENCH / "pipelines" / pipeline, options).run()
    print(
        f"eosflow {pipeline}: {result.records_in:,} in, {result.records_out:,} out, "
        f"{result.seconds:.1f}s (ready after {result.ready_s:.1f}s), {result.checkpoints} "
        f"checkpoints, {result.restarts} restarts"
    )


def expectations(records: int, operators: set[str]) -> Iterator[tuple[str, Expectation]]:
    makers = {"keyed": expected_keyed, "window": expected_windows, "join": expected_joins}
    for operator in OPERATORS:
        if operator in operators:
            yield operator, makers[operator](records)


def run(args: argparse.Namespace, systems: list[str], brokers: str, origin: str) -> None:
    from connectors.probe import probe_broker

    hides = probe_broker(KafkaSettings.from_env(brokers=brokers)).read_committed_hides_aborted
    _say(f"broker probe: read_committed hides aborted transactions: {hides}")
    run_id = uuid.uuid4().hex[:8]
    clicks = f"operators-clicks-{run_id}"
    create_input(brokers, clicks)
    took = produce_clicks(brokers, clicks, args.records, partitions=PARTITIONS)
    _say(f"wrote {args.records:,} clicks to {clicks} in {took:.1f}s")
    if any(s.startswith("join-") for s in systems):
        versions = user_versions(args.records)
        took = produce_users(brokers, f"{clicks}-users", versions, partitions=PARTITIONS)
        _say(f"wrote {len(versions):,} user rows to {clicks}-users in {took:.1f}s")
    wanted = dict(expectations(args.records, {s.split("-")[0] for s in systems}))
    work = Path(tempfile.mkdtemp(prefix="eosflow-operators-"))
    outcomes, loads = [], {}
    for system in systems:
        loads[system] = round(os.getloadavg()[0], 2)  # a shared machine: say how busy it was
        state = work / system
        state.mkdir(parents=True)
        env = {
            **os.environ,
            "BROKERS": brokers,
            "EOSFLOW_KAFKA_BROKERS": brokers,
            "INPUT_TOPIC": clicks,
            "CLICKS_TOPIC": clicks,
            "USERS_TOPIC": f"{clicks}-users",
            "RUN_ID": f"operators-{system}-{run_id}",
            "JOB_NAME": f"operators-{system}-{run_id}",
            "TXN_PREFIX": f"operators-{system}-{run_id}",
            "STATE_DIR": str(state),
            "PYTHONPATH": os.pathsep.join([str(JOBS), str(ROOT)]),
        }
        outcomes.append(measure(system, env, wanted[system.split("-")[0]], args))
    with contextlib.suppress(Exception):
        TopicAdmin(KafkaSettings.from_env(brokers=brokers)).delete_topics(
            [clicks, f"{clicks}-users"]
        )
    saved = BENCH / "results" / f"operators-{time.strftime('%Y%m%d-%H%M%S')}.json"
    saved.write_text(
        json.dumps(
            {
                "records": args.records,
                "cores": os.cpu_count(),
                "broker": origin,
                "read_committed_hides_aborted": hides,
                "loadavg_1m_before": loads,
                "outcomes": [asdict(o) for o in outcomes],
            },
            indent=2,
        )
    )
    print(
        f"\n{args.records:,} records, {os.cpu_count()} cores, broker: {origin}; {saved}; "
        f"1-min load average before each system: {min(loads.values()):.1f} to "
        f"{max(loads.values()):.1f}"
    )
    print(table(outcomes, args.records))
    notes_and_profiles(outcomes, args.profile, systems)
    if all(o.ok for o in outcomes) and not args.keep_logs:
        shutil.rmtree(work, ignore_errors=True)
    else:
        _say(f"logs and state of the systems kept in {work}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--timeout", type=float, default=600.0, help="per system, seconds")
    parser.add_argument(
        "--keep-logs", action="store_true",
        help="keep each system's log and eosflow's checkpoints even when all pass",
    )  # fmt: skip
    parser.add_argument(
        "--table", type=Path, metavar="RESULTS.json", help="print the table of a saved run and exit"
    )
    parser.add_argument(
        "--profile", type=Path, metavar="DIR",
        help="run every system under py-spy (as peers.py --profile): DIR/<system>.raw and "
        "DIR/<system>-top.txt; such a run's timings are not comparable with a plain one's",
    )  # fmt: skip
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    if args.child:
        child(args.child)
        return
    dispatch(parser, args, SYSTEMS, table, run)


if __name__ == "__main__":
    main()
