"""Recovery time: SIGKILL one worker of a running job and time the way back to committed output.

    python bench/recovery.py [--records 600000] [--kills 3] [--sinks kafka,file]
        [--recoveries global,local] [--kill-after 3]

The job (``bench/pipelines/keyed_count.py``, 2 workers, aligned 1 s checkpoints) runs on the
local runner in this process's main thread; a monitor thread waits until the first generation
is connected plus ``kill_after`` seconds, then until the victim has just sent its counters (so
the input it had read is known to within a few ms), SIGKILLs it and polls (every 5 ms) for,
each measured from the kill:

* ``detect_s``: the runner noticed the death and started a restart (``runner.restarts``);
* ``spawned_s``: the new worker processes exist (global: a new generation of every worker;
  local: the victim alone); from ``detect_s`` this is stopping the others, the restart
  backoff (none before the first restart in a window, then ``RunOptions``'s 0.5 s doubling)
  and the spawn;
* ``connected_s``: every new worker said hello: Python started, imported the engine and the
  pipeline, compiled it, made its clients and read the restored manifest;
* ``opened_s``: every new worker sent its first counters: it restored its tasks' snapshots,
  its sinks recovered (the Kafka sink's ``init_transactions`` of all its transactional ids)
  and its sources and channels are open and reading;
* ``triggered_s`` / ``completed_s``: the first checkpoint after the restart was triggered /
  completed; ``committed_s``: every task reported its sinks' commit of it;
* ``first_output_s``: new output is visible to readers again. File sink: the first part file
  of a checkpoint above the restored one. Kafka sink (``--sinks kafka``): the first record an
  independent ``read_committed`` reader of the output topic sees from a transaction of the new
  incarnation (its ``eosflow-id`` header's generation is above the killed one's).

The new workers' own log line (``startup_s=... open_s=...``, written by
``processor/runtime/supervision/worker.py``) splits their part: compile, clients, admission,
and each task's open. ``reread`` is the input the restarted sources read again: what they had
read when killed (their last counters, extrapolated to the kill at their last rate) minus the
restored checkpoint's source offsets of their partitions (the job reads its input from offset
0, so an offset is a count).

Every run's committed output is checked against the click generator (each click once).
Results: ``bench/results/recovery-<date>.json`` and the Markdown table of ``bench/RESULTS.md``
("Recovery on Apache Kafka (issue 38)"). ``measure_recovery`` is also used by
``throughput.py`` and ``spark.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT / "examples"))

from jobs import drop_channel_topics, make_runner  # noqa: E402

from processor.runtime.supervision.local import RunOptions  # noqa: E402
from processor.runtime.supervision.runner import Runner  # noqa: E402
from processor.wire import source_partitions_for  # noqa: E402

__all__ = ["measure_recovery"]

PIPELINE = BENCH / "pipelines" / "keyed_count.py"
PARTITIONS = 8
_PART = re.compile(r"part-\d{5,}-(\d{10})\.jsonl\Z")
_STARTUP = re.compile(r"generation=(\d+) .*startup_s=(\S+) open_s=(\S+)")
_POLL_S = 0.005
#: The phases, in order, as the table shows them.
PHASES = (
    "detect_s",
    "spawned_s",
    "connected_s",
    "opened_s",
    "triggered_s",
    "completed_s",
    "committed_s",
    "first_output_s",
)


def _committed_ids(directory: str) -> set[int]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return set()
    return {int(m.group(1)) for m in map(_PART.match, names) if m}


class _OutputWatcher(threading.Thread):
    """An independent ``read_committed`` reader of the output topic from the ends it has at the
    kill: notes when it first sees a record of an incarnation above ``generation``."""

    def __init__(self, brokers: str, topic: str) -> None:
        super().__init__(name="bench-recovery-output", daemon=True)
        from confluent_kafka import Consumer

        self.topic = topic
        self.consumer: Any = Consumer(
            {
                "bootstrap.servers": brokers,
                "group.id": f"bench-recovery-{uuid.uuid4().hex[:8]}",
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
                # the visibility lag of a commit is this reader's, not the job's: poll often
                "fetch.wait.max.ms": 10,
            }
        )
        self.armed = threading.Event()
        self.stop = threading.Event()
        self.generation = 0
        self.first_new: float | None = None
        self.first_any: float | None = None
        self.error: str | None = None

    def arm(self, generation: int) -> None:
        """The kill happened: watch for output of an incarnation above ``generation``."""
        self.generation = generation
        self.armed.set()

    def run(self) -> None:
        try:
            self._run()
        except Exception as exc:  # reported with the result
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.consumer.close()

    def _run(self) -> None:
        from confluent_kafka import TopicPartition

        while not self.armed.wait(0.05):
            if self.stop.is_set():
                return
        # Everything a new incarnation commits lies after the ends at the kill.
        parts = []
        for p in range(PARTITIONS):
            _low, high = self.consumer.get_watermark_offsets(
                TopicPartition(self.topic, p), timeout=10, cached=False
            )
            parts.append(TopicPartition(self.topic, p, high))
        self.consumer.assign(parts)
        while not self.stop.is_set() and self.first_new is None:
            for msg in self.consumer.consume(1000, 0.01):
                if msg.error() is not None:
                    continue
                now = time.monotonic()
                if self.first_any is None:
                    self.first_any = now
                if _generation_of(msg.headers() or []) > self.generation:
                    self.first_new = now
                    return


def _generation_of(headers: list[tuple[str, bytes]]) -> int:
    """The sink incarnation of a record: ``eosflow-id`` is ``<subtask>.<generation>.<n>.<seq>``
    (the run sets ``record_ids=True``), ``eosflow-txn`` (``record_ids=False`` before issue 38)
    ``<job>/<step>|<subtask>.<generation>.<n>``."""
    for name, value in headers:
        if name == "eosflow-id":
            return int(value.split(b".")[1])
        if name == "eosflow-txn":
            return int(value.rsplit(b"|", 1)[1].split(b".")[1])
    return -1


def _source_in(stats: dict[str, Any], sources: set[str]) -> int:
    """Records a worker's source tasks (``<stage>.<subtask>``) read, from its counters."""
    return sum(int(s["in"]) for task, s in stats.items() if task.rsplit(".", 1)[0] in sources)


def _startup_line(path: Path, since: int) -> dict[str, Any] | None:
    """The split of a restarted worker's start-up: its log's last ``startup_s=`` line after byte
    ``since``."""
    try:
        with path.open("rb") as f:
            f.seek(since)
            text = f.read().decode(errors="replace")
    except FileNotFoundError:
        return None
    found = _STARTUP.findall(text)
    if not found:
        return None
    _gen, startup, opened = found[-1]
    parts = dict(kv.split(":") for kv in startup.split(","))
    tasks = dict(kv.rsplit(":", 1) for kv in opened.split(","))
    return {
        **{k: float(v) for k, v in parts.items()},
        "open_tasks": {k: float(v) for k, v in tasks.items()},
    }


class _Monitor(threading.Thread):
    def __init__(
        self,
        runner: Runner,
        *,
        kill_after: float,
        victim: int,
        output: str | None,
        watcher: _OutputWatcher | None,
        timeout: float,
    ) -> None:
        super().__init__(name="bench-recovery-monitor", daemon=True)
        self.runner, self.kill_after, self.victim = runner, kill_after, victim
        self.output, self.watcher, self.timeout = output, watcher, timeout
        self.found: dict[str, Any] = {}
        self.error: str | None = None
        self.stop = threading.Event()
        self.sources = {s.name for s in runner.plan.stages if s.sources}
        # per worker: (when the bench saw its counters change, source records read), last two
        self.samples: dict[int, list[tuple[float, int]]] = {}
        self._seen: dict[int, int] = {}

    def _sample(self) -> None:
        for w in list(self.runner.workers):
            if w.stats and id(w.stats) != self._seen.get(w.index):
                self._seen[w.index] = id(w.stats)
                got = self.samples.setdefault(w.index, [])
                got.append((time.monotonic(), _source_in(w.stats, self.sources)))
                del got[:-2]

    def _wait(self, condition: Any, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not condition():
            if self.stop.is_set() or time.monotonic() > deadline:
                return False
            time.sleep(_POLL_S)
        return True

    def run(self) -> None:
        try:
            self._run()
        except Exception as exc:  # reported with the result, never a silent thread death
            self.error = f"{type(exc).__name__}: {exc}"

    def _read_at(self, worker: int, at: float) -> float:
        """Source records worker ``worker`` had read at ``at``: its last counters plus its
        last rate times their age."""
        got = self.samples.get(worker, [])
        if not got:
            return float("nan")
        t1, n1 = got[-1]
        rate = (n1 - got[0][1]) / (t1 - got[0][0]) if len(got) == 2 and t1 > got[0][0] else 0.0
        return n1 + rate * (at - t1)

    def _run(self) -> None:
        runner = self.runner
        if not self._wait(lambda: runner.ready_s is not None, 120):
            self.error = "the job never became ready"
            return
        deadline = time.monotonic() + self.kill_after
        while time.monotonic() < deadline:
            self._sample()
            if self.stop.wait(_POLL_S):
                return
        # Kill just after the victim's counters came: what it had read is then known.
        n = len(self.samples.get(self.victim, []))
        got = self.samples.get(self.victim, [(0.0, 0)])[-1]
        if not self._wait(lambda: (self._sample(), self.samples[self.victim][-1] != got)[1], 5):
            self.error = f"no counters from worker {self.victim} (samples={n})"
            return
        if runner.final_chk is not None or any(w.drained for w in runner.workers):
            self.error = "the input was drained before the kill: raise --records"
            return
        old = {w.pid for w in runner.workers}
        before = runner.coordinator.stats.last_completed
        generation = runner.generation
        pid = runner.workers[self.victim].pid
        if pid is None:
            self.error = "the victim's pid is unknown"
            return
        logs = [runner.current.log_path(i) for i in range(runner.options.workers)]
        sizes = [p.stat().st_size if p.exists() else 0 for p in logs]
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        if self.watcher is not None:
            self.watcher.arm(generation)
        found = self.found
        found.update(victim=self.victim, last_completed_before_kill=before)
        read_at_kill = {w: self._read_at(w, killed) for w in self.samples}
        found["stats_age_s"] = {w: round(killed - s[-1][0], 3) for w, s in self.samples.items()}
        local = runner.options.recovery == "local"
        restarted = [self.victim] if local else list(range(runner.options.workers))

        def new_workers() -> list[Any]:
            workers = list(runner.workers)
            return [w for w in workers if w.index in restarted]

        def spawned() -> bool:
            if len(runner.workers) != runner.options.workers:
                return False
            if not local and runner.generation == generation:
                return False
            return all(w.pid is not None and w.pid not in old for w in new_workers())

        if self._wait(lambda: runner.restarts > 0, self.timeout):
            found["detect_s"] = time.monotonic() - killed
        if not self._wait(spawned, self.timeout):
            self.error = "no new worker started"
            return
        found["spawned_s"] = time.monotonic() - killed
        stale = runner.coordinator.next_id - 1
        latest = runner.store.latest_completed(runner.job)
        restored = latest.checkpoint_id if latest is not None else 0
        found["restored_checkpoint"] = restored
        offsets = {
            int(p): int(o) for _t, p, o in (latest.metadata.get("sources", []) if latest else [])
        }
        workers = runner.options.workers
        found["reread"] = round(
            sum(
                read_at_kill.get(w, float("nan"))
                - sum(offsets.get(p, 0) for p in source_partitions_for(w, workers, PARTITIONS))
                for w in restarted
            )
        )
        first = stale + 1  # the first checkpoint the new incarnation takes
        coordinator, tasks = runner.coordinator, runner.coordinator.tasks
        watcher, output = self.watcher, self.output
        # Polled together, each noted the first time it holds: the phases may overlap (the
        # first checkpoint is triggered on the interval, perhaps before every worker opened).
        conditions = {
            "connected_s": lambda: all(w.conn is not None for w in new_workers()),
            "opened_s": lambda: all(w.stats for w in new_workers()),
            "triggered_s": lambda: coordinator.next_id - 1 >= first,
            "completed_s": lambda: coordinator.stats.last_completed >= first,
            # every task reported its sinks' commit of a new checkpoint
            "committed_s": lambda: any(
                c >= first and done >= tasks for c, done in list(runner.stop.committed.items())
            ),
            "first_output_s": (
                (lambda: watcher.first_new is not None)
                if watcher is not None
                else lambda: max(_committed_ids(str(output)), default=0) > restored
            ),
        }
        deadline = time.monotonic() + 60
        while conditions and time.monotonic() < deadline and not self.stop.is_set():
            now = time.monotonic()
            for name, holds in list(conditions.items()):
                if holds():
                    found[name] = now - killed
                    del conditions[name]
            time.sleep(_POLL_S)
        if watcher is not None:
            if watcher.first_new is not None:  # the reader's own clock, not this loop's
                found["first_output_s"] = watcher.first_new - killed
            if watcher.first_any is not None:
                found["first_any_output_s"] = watcher.first_any - killed
        found["workers"] = {w: _startup_line(logs[w], sizes[w]) for w in restarted if w < len(logs)}


def measure_recovery(
    pipeline: Path,
    *,
    environ: dict[str, str],
    state_dir: str,
    kill_after: float,
    victim: int,
    workers: int = 2,
    interval: float = 1.0,
    runner: str = "local",
    recovery: str = "global",
    **options: Any,
) -> dict[str, Any]:
    """Runs ``pipeline`` until idle with aligned checkpoints, killing worker ``victim`` once.

    ``environ`` holds ``JOB_NAME``, ``CLICKS_TOPIC``, ``OUTPUT_DIR`` (file sink) or
    ``OUTPUT_TOPIC`` (transactional Kafka sink) and the broker; the runner applies it in this
    process too while it loads the pipeline. ``options``: more :class:`RunOptions`.
    """
    run_options = RunOptions(
        workers=workers,
        checkpoint_interval=interval,
        mode="aligned",
        until_idle=True,
        environ=environ,
        state_dir=state_dir,
        progress=None,
        recovery=recovery,
        **options,
    )
    job = make_runner(runner, pipeline, run_options)
    topic = environ.get("OUTPUT_TOPIC")
    watcher = _OutputWatcher(environ["EOSFLOW_KAFKA_BROKERS"], topic) if topic else None
    monitor = _Monitor(
        job,
        kill_after=kill_after,
        victim=victim,
        output=None if topic else environ["OUTPUT_DIR"],
        watcher=watcher,
        timeout=120,
    )
    if watcher is not None:
        watcher.start()
    monitor.start()
    try:
        result = job.run()
    finally:
        monitor.stop.set()
        monitor.join(65)
        if watcher is not None:
            watcher.stop.set()
            watcher.join(5)
    with contextlib.suppress(Exception):  # cleanup only
        drop_channel_topics(job)
    error = monitor.error or (watcher.error if watcher is not None else None)
    return {
        **monitor.found,
        "error": error,
        "restarts": result.restarts,
        "restart_causes": result.restart_causes,
        "seconds": result.seconds,
        "checkpoints": result.checkpoints,
        "job": job.job,
        "runner": runner,
        "recovery": recovery,
        "sink": "kafka" if topic else "file",
        "kill_after_s": kill_after,
        "restart_backoff_s": run_options.restart_backoff,
    }


# -- the command line: every configuration, several kills each, checked and tabled -------------


def _say(text: str) -> None:
    print(f"[{datetime.now():%H:%M:%S}] {text}", file=sys.stderr, flush=True)


def _check(sink: str, environ: dict[str, str], records: int) -> str:
    if sink == "file":
        from throughput import _check_running_totals

        return _check_running_totals(environ["OUTPUT_DIR"], records)
    from peers import check_output, expected_outputs

    from connectors import KafkaSettings

    settings = KafkaSettings.from_env(environ=environ)
    from connectors.probe import probe_broker

    if not probe_broker(settings).read_committed_hides_aborted:
        # Tansu shows aborted transactions to read_committed readers: a killed worker's
        # aborted epoch would read as duplicates. Check the file sink on such a broker.
        return "not checked: this broker shows aborted records to read_committed readers"
    want, finals = expected_outputs(records)
    return check_output(settings, environ["OUTPUT_TOPIC"], want, finals)[0]


def _median_max(xs: list[float]) -> str:
    xs = [x for x in xs if x == x]
    return f"{statistics.median(xs):.2f} / {max(xs):.2f}" if xs else "-"


def table(runs: list[dict[str, Any]]) -> str:
    """Median / max of each phase (s after the kill) and of the input re-read, per
    configuration."""
    heads = ["sink", "recovery", "kills", *(p.removesuffix("_s") for p in PHASES), "re-read"]
    lines = ["| " + " | ".join(heads) + " | output |", "|---" * (len(heads) + 1) + "|"]
    for sink in ("kafka", "file"):
        for rec in ("global", "local"):
            rs = [r for r in runs if r["sink"] == sink and r["recovery"] == rec]
            if not rs:
                continue
            cells = [_median_max([r.get(p, float("nan")) for r in rs]) for p in PHASES]
            reread = [float(r.get("reread", float("nan"))) for r in rs]
            ok = (
                "exactly once"
                if all(r["check"] == "ok" for r in rs)
                else "not checked (broker)"
                if all(r["check"].startswith("not checked") for r in rs)
                else "WRONG"
            )
            reread_s = [x for x in reread if x == x]
            rr = f"{statistics.median(reread_s):,.0f} / {max(reread_s):,.0f}" if reread_s else "-"
            lines.append(
                f"| {sink} | {rec} | {len(rs)} | " + " | ".join(cells) + f" | {rr} | {ok} |"
            )
    return "\n".join(lines)


def worker_table(runs: list[dict[str, Any]]) -> str:
    """Median of a restarted worker's own start-up split (its log line)."""
    keys = ("compile", "clients", "admit", "build", "open")
    lines = ["| sink | recovery | " + " | ".join(keys) + " | open per task |", "|---" * 8 + "|"]
    for sink in ("kafka", "file"):
        for rec in ("global", "local"):
            ws = [
                w
                for r in runs
                if r["sink"] == sink and r["recovery"] == rec
                for w in (r.get("workers") or {}).values()
                if w
            ]
            if not ws:
                continue
            cells = [f"{statistics.median(w[k] for w in ws):.3f}" for k in keys]
            tasks = sorted({t for w in ws for t in w["open_tasks"]})
            med = {
                t: statistics.median(w["open_tasks"][t] for w in ws if t in w["open_tasks"])
                for t in tasks
            }
            per = ", ".join(f"{t} {s:.3f}" for t, s in med.items())
            lines.append(f"| {sink} | {rec} | " + " | ".join(cells) + f" | {per} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=2_000_000)
    parser.add_argument("--kills", type=int, default=3, help="runs (one kill each) per config")
    parser.add_argument("--sinks", default="kafka,file")
    parser.add_argument("--recoveries", default="global,local")
    parser.add_argument("--kill-after", type=float, default=3.0, help="s after start-up")
    parser.add_argument("--out", type=Path, default=BENCH / "results")
    args = parser.parse_args()
    sys.path.insert(0, str(BENCH))
    from clicks import produce_clicks

    from connectors import KafkaSettings, TopicAdmin
    from processor.embedded import servers

    started = datetime.now()
    run_id = uuid.uuid4().hex[:6]
    work = Path(tempfile.mkdtemp(prefix=f"eosflow-bench-recovery-{run_id}-"))
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    runs: list[dict[str, Any]] = []
    configs = [(s, r) for s in args.sinks.split(",") for r in args.recoveries.split(",")]
    # Redis: local recovery's channel dedup
    with servers(["kafka", "redis"]) as endpoints:
        brokers = endpoints.kafka_brokers
        assert brokers is not None
        topic = f"bench-clicks-recovery-{run_id}"
        took = produce_clicks(brokers, topic, args.records, partitions=PARTITIONS)
        _say(f"kafka {brokers} ({endpoints.origin['kafka']}); wrote {args.records:,} clicks "
             f"in {took:.1f}s")  # fmt: skip
        admin = TopicAdmin(KafkaSettings.from_env(environ={"EOSFLOW_KAFKA_BROKERS": brokers}))
        for i in range(args.kills):
            for sink, rec in configs if i % 2 == 0 else configs[::-1]:  # interleaved
                job = f"b-rec-{sink}-{rec}-{i}-{run_id}"
                environ = {
                    "EOSFLOW_KAFKA_BROKERS": brokers,
                    "EOSFLOW_REDIS_URL": str(endpoints.redis_url),
                    "JOB_NAME": job,
                    "CLICKS_TOPIC": topic,
                    "OUTPUT_DIR": str(work / job / "output"),
                }
                if sink == "kafka":
                    environ["OUTPUT_TOPIC"] = f"{job}-out"
                    environ["TXN_PREFIX"] = job
                    # the ID header names the generation that wrote a record: how the watcher
                    # tells new output (the sink's default since issue 38 writes no header)
                    environ["RECORD_IDS"] = "1"
                    admin.ensure_topic(environ["OUTPUT_TOPIC"], PARTITIONS)
                r = measure_recovery(
                    PIPELINE,
                    environ=environ,
                    state_dir=str(work / job / "state"),
                    kill_after=args.kill_after,
                    victim=i % 2,
                    recovery=rec,
                )
                r["check"] = _check(sink, environ, args.records)
                runs.append(r)
                _say(
                    f"{sink} {rec} kill {i + 1}: "
                    + " ".join(
                        f"{p.removesuffix('_s')}={r.get(p, float('nan')):.2f}" for p in PHASES
                    )
                    + f" reread={r.get('reread')} output {r['check']}"
                    + (f" error: {r['error']}" if r["error"] else "")
                )
    results = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "started": started.isoformat(timespec="seconds"),
        "commit": commit,
        "brokers": brokers,
        "records": args.records,
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"recovery-{started:%Y-%m-%d-%H%M%S}.json"
    path.write_text(json.dumps(results, indent=1, default=str))
    print(table(runs))
    print()
    print(worker_table(runs))
    _say(f"results: {path}")
    checked = [r for r in runs if not r["check"].startswith("not checked")]
    return 0 if all(r["check"] == "ok" and not r["error"] for r in checked) else 1


if __name__ == "__main__":
    sys.exit(main())
