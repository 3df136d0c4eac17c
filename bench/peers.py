"""eosflow against its Python peers on the reference job, every output checked, in one run.

    python bench/peers.py [--records 200000] [--keep-venvs]
        [--systems eosflow1,eosflow2,loop,loop-txn,quix,bytewax]

The job is the reference job (bench/README.md, "The reference job"): JSON clicks in 8
partitions keyed by user; parse, keep ``amount > 0``, key by user, running (count, amount sum)
per user, one JSON output per input (key user, value ``[count, amount]``) to an 8-partition
topic. What one run does:

1. starts the embedded broker (Tansu), or uses ``EOSFLOW_KAFKA_BROKERS``, and probes it (does
   ``read_committed`` hide aborted transactions?);
2. creates (once, cached in ``bench/.venvs/``) a virtual environment per peer with pinned
   versions (their pins conflict with eosflow's);
3. writes ``--records`` clicks to one input topic, and computes the expected output from the
   generated clicks (``examples/clicks.py``), never from a system;
4. runs each system as a subprocess (``bench/peer_jobs/``, ``pipelines/keyed_count.py``)
   reading that topic from the start into an output topic of its own. The clock runs from the
   launch until an independent ``read_committed`` reader in this process has seen every output
   (start-up included, as a user would see it). CPU is the subprocess's and its reaped
   children's (``RUSAGE_CHILDREN``), and the broker's (``/proc``);
5. checks each output topic, read ``read_committed`` to its end: the multiset of
   ``(user, count, amount)`` must equal the expectation (so: one output per input, none
   missing, none twice, and every user's final totals right). A failing system is reported, not
   timed;
6. prints a Markdown table: records/s, CPU-µs per record, ratios to the best peer (Quix, Bytewax)
   and to the transactional loop, all from this run.

On a broker whose ``read_committed`` shows records of aborted transactions (Tansu), a duplicate
left by an aborted transaction cannot be told from a real one; the check is the same, and the
output says so.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(BENCH))

import profiles  # noqa: E402
from clicks import click_events, produce_clicks  # noqa: E402
from jobs import broker_cpu_s  # noqa: E402

from connectors import KafkaSettings, TopicAdmin  # noqa: E402
from processor.embedded import servers  # noqa: E402

PARTITIONS = 8
SYSTEMS = (
    "eosflow1",
    "eosflow2",
    "eosflow1-keyed",
    "eosflow2-keyed",
    "eosflow1-keyed-ids",
    "eosflow2-keyed-ids",
    "loop",
    "loop-txn",
    "loop-txn2",
    "quix",
    "bytewax",
    "bytewax-recovery",
)
#: The peers "x best peer" divides by: those with a delivery guarantee (Bytewax without a
#: recovery store has none; its row is shown, not counted).
PEERS = ("quix", "bytewax-recovery")
JOBS = BENCH / "peer_jobs"
#: Pinned peers (the versions of issue 22), each in its own virtual environment.
#: Systems run in another system's virtual environment.
VENV_OF = {"bytewax-recovery": "bytewax"}
VENVS = {
    "quix": ["quixstreams==3.28.0", "orjson==3.13.0"],
    "bytewax": ["bytewax[kafka]==0.21.1", "orjson==3.13.0"],
}
LABELS = {
    "eosflow1": "eosflow, 1 worker (shuffle via Kafka, txn KafkaSink, 1 s checkpoints)",
    "eosflow2": "eosflow, 2 workers (same)",
    "eosflow1-keyed": "eosflow, 1 worker, keyed source (no shuffle; txn KafkaSink, 1 s "
    "checkpoints)",
    "eosflow2-keyed": "eosflow, 2 workers, keyed source (same)",
    "eosflow1-keyed-ids": "eosflow, 1 worker, keyed source, KafkaSink(record_ids=True): an ID "
    "header per record",
    "eosflow2-keyed-ids": "eosflow, 2 workers, keyed source, KafkaSink(record_ids=True)",
    "loop": "hand-written loop, at-least-once, orjson, 1 process",
    "loop-txn": "hand-written loop, transactions every 1 s, orjson, 1 process",
    "loop-txn2": "hand-written loop, transactions every 1 s, orjson, 2 processes (4 partitions "
    "each): the 2-core ceiling",
    "quix": f"Quix Streams {VENVS['quix'][0].split('==')[1]}, exactly-once, 1 process "
    "(session.timeout.ms=6000)",
    "bytewax": f"Bytewax {VENVS['bytewax'][0].split('==')[1]} (no recovery store: no guarantee), "
    "1 process",
    "bytewax-recovery": f"Bytewax {VENVS['bytewax'][0].split('==')[1]}, at-least-once (recovery "
    "store, 1 s snapshots), 1 process",
}


def _say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


@dataclass
class Outcome:
    system: str
    status: str = "not run"  # "ok", or what failed
    seconds: float | None = None  # launch -> every output seen by the reader
    first_output_s: float | None = None
    steady_per_s: float | None = None  # outputs per second from 10% to 90% of them seen
    cpu_s: float | None = None
    broker_cpu_s: float | None = None
    outputs: int = 0
    notes: list[str] = field(default_factory=list)

    def rate(self, records: int) -> float | None:
        return records / self.seconds if self.ok and self.seconds else None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def ensure_venv(name: str, cache: Path) -> Path:
    """The python of ``name``'s virtual environment, created with its pins on first use."""
    pins = VENVS[name]
    tag = hashlib.sha256(" ".join(pins).encode()).hexdigest()[:8]
    home = cache / f"{name}-{tag}"
    python = home / "bin" / "python"
    if (home / ".ready").exists():
        _say(f"venv {name}: cached in {home}")
        return python
    shutil.rmtree(home, ignore_errors=True)
    _say(f"venv {name}: creating {home} with {' '.join(pins)} (pip, a minute or so)")
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(home)], check=True)
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *pins],
        check=True,
    )
    frozen = subprocess.run(
        [str(python), "-m", "pip", "freeze"], capture_output=True, text=True, check=True
    ).stdout
    (home / ".ready").write_text(frozen)
    return python


def expected_outputs(
    records: int, events: Iterable[dict[str, object]] | None = None
) -> tuple[Counter[tuple[str, int, int]], dict[str, tuple]]:
    """Every ``(user, count, amount)`` output the job must write, and each user's final totals,
    from the generated clicks (the same generator that wrote the input): ``click_events
    (records)``, or ``events`` (e.g. the clicks with re-sent copies, for a job that counts
    them)."""
    acc: dict[str, tuple[int, int]] = {}
    want: Counter[tuple[str, int, int]] = Counter()
    for click in click_events(records) if events is None else events:
        amount = int(str(click["amount"]))
        if amount <= 0:
            continue
        user = str(click["user"])
        count, total = acc.get(user, (0, 0))
        acc[user] = (count + 1, total + amount)
        want[(user, count + 1, total + amount)] += 1
    return want, acc


class Reader(threading.Thread):
    """An independent ``read_committed`` reader of one output topic: notes when it has seen
    the first output and ``expected`` outputs (the clock of a run)."""

    def __init__(self, settings: KafkaSettings, topic: str, expected: int) -> None:
        super().__init__(daemon=True)
        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

        from processor.testing.outputs import reader_config

        self.expected = expected
        self.seen = 0
        self.first: float | None = None
        self.done: float | None = None
        # when 10% and 90% of the outputs had been seen: the steady rate, start-up and the
        # last commit left out
        self.t10: float | None = None
        self.t90: float | None = None
        self.stop = threading.Event()
        self.consumer: Any = Consumer(reader_config(settings, committed=True))
        self.consumer.assign(
            [TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(PARTITIONS)]
        )

    def run(self) -> None:
        try:
            while not self.stop.is_set() and self.seen < self.expected:
                n = sum(1 for m in self.consumer.consume(10_000, 0.05) if m.error() is None)
                if n and self.first is None:
                    self.first = time.monotonic()
                self.seen += n
                if self.t10 is None and self.seen >= 0.1 * self.expected:
                    self.t10 = time.monotonic()
                if self.t90 is None and self.seen >= 0.9 * self.expected:
                    self.t90 = time.monotonic()
            if self.seen >= self.expected:
                self.done = time.monotonic()
        finally:
            self.consumer.close()


def check_output(
    settings: KafkaSettings, topic: str, want: Counter, finals: dict[str, tuple]
) -> tuple[str, int]:
    """``("ok", outputs)`` or what is wrong with the committed output of ``topic``."""
    import orjson

    from processor.testing.outputs import scan_topic

    got: Counter[tuple[str, int, int]] = Counter()
    last: dict[str, tuple[int, int]] = {}
    undecodable = 0
    for msg in scan_topic(settings, topic, committed=True, timeout=120):
        try:
            user = msg.key().decode()
            count, amount = orjson.loads(msg.value())
        except Exception:
            undecodable += 1
            continue
        got[(user, count, amount)] += 1
        if count > last.get(user, (0, 0))[0]:
            last[user] = (count, amount)
    outputs = sum(got.values()) + undecodable
    missing = sum((want - got).values())
    extra = sum((got - want).values())
    wrong_finals = sum(1 for u, t in finals.items() if last.get(u) != t)
    if not (missing or extra or undecodable or wrong_finals):
        return "ok", outputs
    return (
        f"FAILED: {outputs:,} outputs for {sum(want.values()):,} inputs; {missing:,} missing, "
        f"{extra:,} duplicated or unexpected, {undecodable:,} undecodable, "
        f"{wrong_finals:,} users with wrong final totals"
    ), outputs


def create_input(brokers: str, topic: str) -> None:
    """Creates the input topic with its retention set explicitly (unlimited). Tansu's
    DescribeConfigs returns only the settings a topic was created with, none of the defaults,
    and Quix Streams derives its changelog topics' settings from the input topic's
    ``retention.ms`` (a KeyError without it). On Apache Kafka this changes nothing the job sees.
    """
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": brokers})
    config = {"retention.ms": "-1", "retention.bytes": "-1"}
    admin.create_topics([NewTopic(topic, PARTITIONS, 1, config=config)])[topic].result(60)


def _cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class Bench:
    def __init__(self, args: argparse.Namespace, brokers: str, work: Path) -> None:
        self.args, self.brokers, self.work = args, brokers, work
        self.settings = KafkaSettings.from_env(brokers=brokers)
        self.admin = TopicAdmin(self.settings)
        self.run_id = uuid.uuid4().hex[:8]
        self.input = f"peers-clicks-{self.run_id}"
        self.want, self.finals = expected_outputs(args.records)
        self.pythons: dict[str, Path] = {}

    def label(self, system: str) -> str:
        return LABELS[system]

    def command(self, system: str) -> list[str]:
        me = sys.executable
        if system.startswith("eosflow"):
            keyed = ["--keyed-source"] if "-keyed" in system else []
            ids = ["--record-ids"] if system.endswith("-ids") else []
            return [me, str(Path(__file__)), "--child-eosflow", system[7], *keyed, *ids]
        if system == "loop":
            return [me, str(JOBS / "loop.py"), "at-least-once"]
        if system == "loop-txn":
            return [me, str(JOBS / "loop.py"), "transactional"]
        if system == "loop-txn2":
            return [me, str(JOBS / "loop.py"), "transactional", "2"]
        if system == "quix":
            return [str(self.pythons["quix"]), str(JOBS / "quix_job.py")]
        if system == "bytewax":
            return [str(self.pythons["bytewax"]), "-m", "bytewax.run", "bytewax_job:flow"]
        if system == "bytewax-recovery":
            store = self.work / system / "recovery"
            if not store.exists():  # one partition (one worker); Bytewax's own initializer
                store.mkdir(parents=True)
                python = str(self.pythons["bytewax"])
                subprocess.run([python, "-m", "bytewax.recovery", str(store), "1"], check=True)
            return [
                str(self.pythons["bytewax"]), "-m", "bytewax.run", "bytewax_job:flow",
                "-r", str(store), "-s", "1", "-b", "0",
            ]  # fmt: skip
        raise ValueError(f"unknown system {system!r}; expected one of {', '.join(SYSTEMS)}")

    def run(self, system: str) -> Outcome:
        outcome = Outcome(system)
        out = f"peers-out-{system}-{self.run_id}"
        self.admin.ensure_topic(out, PARTITIONS)
        state = self.work / system
        state.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "BROKERS": self.brokers,
            "EOSFLOW_KAFKA_BROKERS": self.brokers,
            "INPUT_TOPIC": self.input,
            "CLICKS_TOPIC": self.input,
            "OUTPUT_TOPIC": out,
            "RECORDS": str(self.args.records),
            "RUN_ID": f"{system}-{self.run_id}",
            "JOB_NAME": f"peers-{system}-{self.run_id}",
            "TXN_PREFIX": f"peers-{system}-{self.run_id}",
            "STATE_DIR": str(state),
            "PYTHONPATH": os.pathsep.join([str(JOBS), str(ROOT)]),
        }
        reader = Reader(self.settings, out, sum(self.want.values()))
        log_path = self.work / f"{system}.log"
        cpu0, broker0 = _cpu_children(), broker_cpu_s()
        _say(f"{system}: launching ({self.label(system)}); log {log_path}")
        start = time.monotonic()
        with open(log_path, "wb") as log:
            command = self.command(system)
            if self.args.profile is not None:
                command = profiles.wrap(command, self.args.profile / f"{system}.raw")
            proc = subprocess.Popen(
                command, env=env, cwd=JOBS, stdout=log, stderr=subprocess.STDOUT
            )
            reader.start()
            deadline = start + self.args.timeout
            while time.monotonic() < deadline and proc.poll() is None and reader.done is None:
                time.sleep(0.05)
            if reader.done is not None:  # every output seen; let the system stop by itself
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(max(1.0, deadline - time.monotonic()))
            elif proc.returncode == 0:  # exited: give the reader time to catch up
                reader.join(min(30.0, max(1.0, deadline - time.monotonic())))
            if proc.poll() is None:
                outcome.notes.append("killed: still running at the end")
                proc.kill()
                proc.wait()
        reader.stop.set()
        reader.join(10)
        outcome.cpu_s = _cpu_children() - cpu0
        outcome.broker_cpu_s = broker_cpu_s() - broker0
        if reader.first is not None:
            outcome.first_output_s = reader.first - start
        _say(f"{system}: checking the output ({out}, read_committed)")
        check, outcome.outputs = check_output(self.settings, out, self.want, self.finals)
        if check != "ok":
            outcome.status = check
        elif reader.done is None:
            outcome.status = f"INCOMPLETE: {reader.seen:,} outputs seen in {self.args.timeout:g}s"
        else:
            outcome.status = "ok"
            outcome.seconds = reader.done - start
            # shorter than 2 s, the span measures commit bursts and the reader, not the system
            if reader.t10 is not None and reader.t90 is not None and reader.t90 - reader.t10 >= 2:
                outcome.steady_per_s = 0.8 * reader.expected / (reader.t90 - reader.t10)
        if proc.returncode not in (0, -9):
            outcome.notes.append(f"exit code {proc.returncode}")
        if not outcome.ok or proc.returncode not in (0, -9):
            tail = log_path.read_text(errors="replace").strip().splitlines()[-15:]
            outcome.notes.append("log tail:\n      " + "\n      ".join(tail))
        with contextlib.suppress(Exception):
            self.admin.delete_topics([out])
        if outcome.ok:
            _say(
                f"{system}: {self.args.records:,} records, every output seen after "
                f"{outcome.seconds:.1f}s (first after {outcome.first_output_s:.1f}s) = "
                f"{outcome.rate(self.args.records):,.0f}/s; CPU {outcome.cpu_s:.1f}s, broker "
                f"{outcome.broker_cpu_s:.1f}s; output exactly once"
            )
        else:
            _say(f"{system}: {outcome.status}")
        return outcome


def table(outcomes: list[Outcome], records: int) -> str:
    """The Markdown table of one run, ratios within it."""
    rates = {o.system: o.rate(records) for o in outcomes}
    peer_rates = [r for s, r in rates.items() if s in PEERS and r]
    best_peer = max(peer_rates) if peer_rates else None
    loop, loop2 = rates.get("loop-txn"), rates.get("loop-txn2")
    rows = [
        "| system | records/s | s to all (to first) output | steady records/s (10-90% of outputs) "
        "| CPU-µs/record: system + broker | x best peer | x loop-txn | x loop-txn2 | output |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for o in outcomes:
        rate = rates[o.system]
        cpu = "-"
        if o.cpu_s is not None:
            cpu = f"{1e6 * o.cpu_s / records:.1f} + {1e6 * (o.broker_cpu_s or 0) / records:.1f}"
        timed = rate and o.seconds is not None and o.first_output_s is not None
        after = o.steady_per_s if o.ok else None
        rows.append(
            f"| {LABELS[o.system]} | {f'{rate:,.0f}' if rate else '-'} "
            f"| {f'{o.seconds:.1f} ({o.first_output_s:.1f})' if timed else '-'} "
            f"| {f'{after:,.0f}' if after else '-'} | {cpu} "
            f"| {f'{rate / best_peer:.2f}' if rate and best_peer else '-'} "
            f"| {f'{rate / loop:.2f}' if rate and loop else '-'} "
            f"| {f'{rate / loop2:.2f}' if rate and loop2 else '-'} "
            f"| {'exactly once' if o.ok else o.status} |"
        )
    return "\n".join(rows)


def child_eosflow(
    workers: int, keyed_source: bool, record_ids: bool = False, dedup: bool = False
) -> None:
    """Runs ``pipelines/keyed_count.py`` until idle (in the subprocess of a run);
    ``keyed_source``: keyed by the message key, without a shuffle; ``dedup``: with its
    ``dedup`` step (Redis at ``EOSFLOW_REDIS_URL``; ``bench/dedup_job.py``)."""
    from processor.runtime.supervision.local import LocalRunner, RunOptions

    options = RunOptions(
        workers=workers,
        checkpoint_interval=float(os.environ.get("BENCH_CHECKPOINT_S", "1.0")),  # issue 51
        mode="aligned",
        until_idle=True,
        environ={
            k: os.environ[k]
            for k in (
                "EOSFLOW_KAFKA_BROKERS",
                "JOB_NAME",
                "CLICKS_TOPIC",
                "OUTPUT_TOPIC",
                "TXN_PREFIX",
            )
        }
        | {"KEYED_SOURCE": "1" if keyed_source else "0"}
        | ({"RECORD_IDS": "1"} if record_ids else {})  # else the sink's default
        | ({"DEDUP": "1", "EOSFLOW_REDIS_URL": os.environ["EOSFLOW_REDIS_URL"]} if dedup else {}),
        state_dir=os.environ["STATE_DIR"],
    )
    result = LocalRunner(BENCH / "pipelines" / "keyed_count.py", options).run()
    print(
        f"eosflow: {result.records_in:,} in, {result.seconds:.1f}s (ready after "
        f"{result.ready_s:.1f}s), {result.checkpoints} checkpoints, {result.restarts} restarts"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument(
        "--keep-venvs", action="store_true",
        help="keep the peers' virtual environments in --venvs after the run, to be reused by "
        "the next one (default: a venv found there is reused, then removed at the end)",
    )  # fmt: skip
    parser.add_argument(
        "--keep-logs", action="store_true", help="keep the systems' logs even when all pass"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="per system, seconds")
    parser.add_argument("--venvs", type=Path, default=BENCH / ".venvs")
    parser.add_argument(
        "--table", type=Path, metavar="RESULTS.json", help="print the table of a saved run and exit"
    )
    parser.add_argument(
        "--profile", type=Path, metavar="DIR",
        help="run every system under py-spy (its subprocesses too) and write DIR/<system>.raw "
        "and DIR/<system>-top.txt (the top 15 functions); the timings of such a run are not "
        "comparable with an unprofiled one",
    )  # fmt: skip
    parser.add_argument("--child-eosflow", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--keyed-source", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--record-ids", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dedup", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    if args.child_eosflow:
        child_eosflow(args.child_eosflow, args.keyed_source, args.record_ids, args.dedup)
        return
    dispatch(parser, args, SYSTEMS, table, run)


def notes_and_profiles(outcomes: list[Outcome], profile: Path | None, systems: list[str]) -> None:
    """After a run's table: each system's notes, and (``--profile``) each system's top
    functions, also written to ``<profile>/<system>-top.txt``."""
    for o in outcomes:
        for note in o.notes:
            print(f"- {o.system}: {note}")
    if profile is not None:
        for system in systems:
            raw = profile / f"{system}.raw"
            if raw.exists():
                summary = profiles.top(raw)
                (profile / f"{system}-top.txt").write_text(summary + "\n")
                print(f"\n{summary}")


def dispatch(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    known: tuple[str, ...],
    table: Callable[[list[Outcome], int], str],
    run: Callable[[argparse.Namespace, list[str], str, str], None],
) -> None:
    """The rest of a bench's ``main`` (this one's and ``operators.py``'s): ``--table`` prints a
    saved run; otherwise the ``--systems`` are checked and run against the broker
    (``EOSFLOW_KAFKA_BROKERS``, or the embedded one)."""
    if args.table:
        saved = json.loads(args.table.read_text())
        print(table([Outcome(**o) for o in saved["outcomes"]], saved["records"]))
        return
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in known]
    if unknown:
        parser.error(f"unknown systems {unknown}; expected some of {','.join(known)}")
    repeated = sorted({s for s in systems if systems.count(s) > 1})
    if repeated:  # a second run of a system would be its job's restart, with nothing to read
        parser.error(
            f"systems {repeated} are named twice; a system runs once per run (run the bench "
            "again to repeat it)"
        )
    with servers(["kafka"]) as endpoints:
        brokers = endpoints.kafka_brokers
        assert brokers is not None
        _say(f"kafka: {brokers} ({endpoints.origin['kafka']})")
        run(args, systems, brokers, endpoints.origin["kafka"])


def run(args: argparse.Namespace, systems: list[str], brokers: str, origin: str) -> None:
    from connectors.probe import probe_broker

    caps = probe_broker(KafkaSettings.from_env(brokers=brokers))
    hides = caps.read_committed_hides_aborted
    _say(f"broker probe: read_committed hides aborted transactions: {hides}")
    work = Path(tempfile.mkdtemp(prefix="eosflow-peers-"))
    bench = Bench(args, brokers, work)
    for name in sorted({VENV_OF.get(s, s) for s in systems} & set(VENVS)):
        try:
            bench.pythons[name] = ensure_venv(name, args.venvs)
        except subprocess.CalledProcessError as exc:
            _say(f"venv {name}: FAILED ({exc}); {name} is skipped")
    create_input(brokers, bench.input)
    took = produce_clicks(brokers, bench.input, args.records, partitions=PARTITIONS)
    _say(f"wrote {args.records:,} clicks to {bench.input} in {took:.1f}s")
    outcomes = []
    for system in systems:
        venv = VENV_OF.get(system, system)
        if venv in VENVS and venv not in bench.pythons:
            outcomes.append(Outcome(system, status="venv could not be created"))
            continue
        outcomes.append(bench.run(system))
    saved = BENCH / "results" / f"peers-{time.strftime('%Y%m%d-%H%M%S')}.json"
    saved.parent.mkdir(exist_ok=True)
    saved.write_text(
        json.dumps(
            {
                "records": args.records,
                "cores": os.cpu_count(),
                "broker": origin,
                "read_committed_hides_aborted": hides,
                "venvs": {
                    n: (p.parent.parent / ".ready").read_text() for n, p in bench.pythons.items()
                },
                "outcomes": [asdict(o) for o in outcomes],
            },
            indent=2,
        )
    )
    print()
    print(
        f"{args.records:,} records, {os.cpu_count()} cores, broker: {origin} ({brokers}); {saved}"
    )
    print(table(outcomes, args.records))
    if not hides:
        print(
            "\nThis broker's read_committed shows records of aborted transactions: a duplicate "
            "left by an aborted transaction cannot be told from a real one here (the check "
            "counts both as duplicates)."
        )
    notes_and_profiles(outcomes, args.profile, systems)
    if all(o.ok for o in outcomes) and not args.keep_logs:
        shutil.rmtree(work, ignore_errors=True)
    else:
        _say(f"logs of the systems kept in {work}")
    if not args.keep_venvs:
        for python in bench.pythons.values():
            shutil.rmtree(python.parent.parent, ignore_errors=True)
        _say(f"removed the peer venvs (--keep-venvs keeps them in {args.venvs} for the next run)")


if __name__ == "__main__":
    main()
