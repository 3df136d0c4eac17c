"""A worker: subtask ``i`` of every stage, in one process, driven by the coordinator.

Started by the local runner as ``python -m processor.runtime.supervision.worker SPEC.json``; the
same loop runs in a Spark task (:mod:`processor.runtime.supervision.spark`). The loop polls each
task in turn, serves the coordinator's messages between batches (trigger, complete, abort, stop) and
acknowledges snapshots as their uploads finish.

Fault injection (for crash tests): the spec's ``faults`` lists ``[point, n, action]``; the
``n``-th time the worker reaches ``point`` (one of :data:`processor.runtime.job.FAULT_POINTS`)
it SIGKILLs itself (``kill``) or holds there (``hold``): it creates ``<point>.w<worker>.reached``
in the hold directory and blocks until ``<point>.w<worker>.release`` appears (at most 300 s, then
it goes on and says so). The directory is ``$EOSFLOW_FAULT_DIR``, else ``faults/`` in the job's
directory (:func:`hold_paths`). The heartbeat thread keeps beating while the worker holds.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from processor.compiler import compile_flow
from processor.errors import ConfigError
from processor.runtime.control import ControlClient
from processor.runtime.job import DEFAULT_MAX_IDS
from processor.runtime.pipeline import load_flow, load_object
from processor.runtime.supervision.alignment import others_watermark
from processor.runtime.task import Task, TaskEnv
from processor.runtime.task.purge import ChannelPurger
from processor.runtime.waits import WAITS, waiting
from processor.snapshot.store import SnapshotStore

__all__ = [
    "hold_paths",
    "log_format",
    "main",
    "run_logged",
    "run_worker",
]

log = logging.getLogger(__name__)

#: A held worker goes on by itself after this long: a test that died must not leave it forever.
HOLD_MAX_S = 300.0
_STATS_EVERY_S = 1.0
_ALIGN_EVERY_S = 0.02
_HEARTBEAT_EVERY_S = 1.0
#: How long a worker waits for the coordinator to admit it after its hello.
_ADMIT_TIMEOUT_S = 60.0


def hold_paths(directory: str | Path, point: str, worker: int) -> tuple[Path, Path]:
    """The files of a ``hold`` fault: ``(reached, release)``. The worker creates ``reached``
    when it holds at ``point``, and goes on once ``release`` exists."""
    stem = Path(directory) / f"{point}.w{worker}"
    return Path(f"{stem}.reached"), Path(f"{stem}.release")


def _hold(directory: Path, point: str, worker: int) -> None:
    reached, release = hold_paths(directory, point, worker)
    directory.mkdir(parents=True, exist_ok=True)
    release.unlink(missing_ok=True)  # a release left by an earlier hold is not this one's
    tmp = reached.with_name(reached.name + ".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "time": time.time()}))
    tmp.replace(reached)  # atomic: the test never sees it half written
    log.critical("fault injection: HOLD worker=%d point=%s until %s", worker, point, release)
    start = time.monotonic()
    while not release.exists():
        if time.monotonic() - start > HOLD_MAX_S:
            log.error("fault injection: HOLD worker=%d point=%s not released in %.0fs; going on",
                      worker, point, HOLD_MAX_S)  # fmt: skip
            return
        time.sleep(0.02)
    log.critical("fault injection: RELEASED worker=%d point=%s after %.1fs",
                 worker, point, time.monotonic() - start)  # fmt: skip


def _fault_hook(worker: int, faults: list[list[Any]], hold_dir: Path) -> Callable[[str], None]:
    wanted = {str(f[0]): (int(f[1]), str(f[2]) if len(f) > 2 else "kill") for f in faults}
    seen: dict[str, int] = {}

    def fault(point: str) -> None:
        if point not in wanted:
            return
        seen[point] = seen.get(point, 0) + 1
        nth, action = wanted[point]
        if seen[point] != nth:
            return
        if action == "hold":
            _hold(hold_dir, point, worker)
            return
        log.critical("fault injection: SIGKILL worker=%d point=%s", worker, point)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)

    return fault


#: Python's cyclic GC thresholds in a worker (``EOSFLOW_GC_THRESHOLDS``: three ints, or
#: ``default`` for Python's 700,10,10). A worker holds large containers (windows, sessions,
#: records waiting in a join) while it allocates a tuple per record: at the default, young
#: collections ran every 700 allocations and the full ones walked every held object, 20-30 %
#: of a session or join worker's time. Measured in bench/RESULTS.md, "The workers' GC".
GC_THRESHOLDS = (100_000, 50, 1000)


def tune_gc(environ: Any = os.environ) -> tuple[int, int, int]:
    """Sets the worker's GC thresholds; returns them."""
    import gc

    text = environ.get("EOSFLOW_GC_THRESHOLDS", "")
    if text == "default":
        return gc.get_threshold()
    try:
        wanted = tuple(int(x) for x in text.split(",")) if text else GC_THRESHOLDS
        if len(wanted) != 3 or min(wanted) < 1:
            raise ValueError
    except ValueError:
        raise ConfigError(
            f"EOSFLOW_GC_THRESHOLDS={text!r}: give three positive ints (e.g. 100000,50,1000) "
            "or 'default'"
        ) from None
    gc.set_threshold(*wanted)
    return gc.get_threshold()


def run_worker(spec: dict[str, Any]) -> int:
    """Runs until the coordinator says stop (0) or goes away (1)."""
    tune_gc()
    began = time.monotonic()
    worker, parallelism = int(spec["worker"]), int(spec["workers"])
    flow = load_flow(spec["pipeline"])
    recovery = str(spec.get("recovery", "global"))
    plan = compile_flow(
        flow,
        parallelism,
        combine=recovery != "local",
        key_groups=spec.get("key_groups"),
        epoch=int(spec.get("epoch", 0)),
    )
    wanted = spec.get("fingerprint")
    if wanted is not None and plan.fingerprint() != wanted:
        raise ConfigError(
            f"the pipeline compiled differently in worker {worker} than in the runner:\n"
            f"{plan.describe()}\nIt probably reads environment variables that differ here. "
            "On Spark, forward them to the executors with --env NAME (eosflow run)"
        )
    compiled = time.monotonic()
    transport = load_object(spec["transport"])()
    store = SnapshotStore(spec["snapshot_url"])
    restore = int(spec["restore"])
    manifest = store.load(plan.job, restore) if restore else None
    host, port = spec["coordinator"]
    client = ControlClient(host, int(port))
    writer = transport.writer(client_id=f"eosflow-{plan.job}-worker-{worker}")
    ends = spec.get("end_offsets")
    end_offsets = {(t, int(p)): int(o) for t, p, o in ends} if ends is not None else None
    starts = {(t, int(p)): int(o) for t, p, o in spec.get("start_positions") or []}
    uploads = ThreadPoolExecutor(1, thread_name_prefix="snapshot-upload")
    env = TaskEnv(
        plan=plan,
        generation=int(spec["generation"]),
        mode=spec["mode"],
        writer=writer,
        reader_factory=lambda group: transport.reader(
            group_id=group, deleted=str(spec.get("on_deleted_records", "fail"))
        ),
        store=store,
        uploads=uploads,
        fault=_fault_hook(worker, spec.get("faults", []), _hold_dir(spec)),
        end_offsets=end_offsets,
        start_positions=starts,
        checkpoint_interval=spec.get("checkpoint_interval"),
        recovery=recovery,
        recovery_max_ids=int(spec.get("recovery_max_ids", DEFAULT_MAX_IDS)),
        stale_through=int(spec.get("stale_through", 0)),
        sink_generation=spec.get("sink_generation"),
        map_state=dict(spec.get("map_state") or {}),
        drain=bool(spec.get("drain", True)),
        watermark_drift_ms=spec.get("watermark_drift_ms"),
    )
    hello = time.monotonic()
    client.send(
        {
            "t": "hello",
            "worker": worker,
            "generation": env.generation,
            "token": spec.get("token"),
            "pid": os.getpid(),
            "host": socket.gethostname(),
        }
    )
    # Nothing is restored, recovered or written before the coordinator admits this worker: a
    # worker of a generation the coordinator already left (a Spark task started late, a zombie)
    # must not roll back or delete what the live generation's sinks prepared (issue 19).
    admitted = _admitted(client, worker, env.generation)
    welcome = time.monotonic()
    if admitted is not None:
        uploads.shutdown(wait=False)
        client.close()
        return admitted
    beat = _Heartbeat(client)
    tasks: list[Task] = []
    purger: ChannelPurger | None = None
    try:
        tasks += [Task(env, stage, worker) for stage in plan.stages]
        built = time.monotonic()
        counts = {str(k): int(v) for k, v in spec["source_counts"].items()}
        opened: list[str] = []
        for task in tasks:
            state = None
            started = time.monotonic()
            if manifest is not None:
                state = store.read_task_snapshot(manifest.tasks[task.name])
            task.open(state, counts)
            opened.append(f"{task.name}:{time.monotonic() - started:.3f}")
        sources = [t for t in tasks if t.is_source]
        purger = ChannelPurger(transport, store, plan.job, tasks, supported=spec.get("purge"))
        # Where a (re)start's time goes (bench/recovery.py reads it): the pipeline's import and
        # compile, the clients and the restored manifest, the coordinator's admission, building
        # the tasks (their readers and sinks' writers), and each task's open (its snapshot read
        # and restore, its sinks' recover, its inputs' opening).
        log.info(
            "worker=%d generation=%d pid=%d python=%s restored_checkpoint=%d tasks=%d recovery=%s "
            "startup_s=compile:%.3f,clients:%.3f,admit:%.3f,build:%.3f,open:%.3f open_s=%s",
            worker, env.generation, os.getpid(), sys.executable, restore, len(tasks), recovery,
            compiled - began, hello - compiled, welcome - hello, built - welcome,
            time.monotonic() - built,
            ",".join(opened),
        )  # fmt: skip
        max_records = int(spec.get("max_records", 5000))
        pace = _Pace(float(spec.get("max_rate") or 0.0))
        aligning = _AlignReport(client, sources) if env.watermark_drift_ms and sources else None
        idle = False
        # The first counters go once the worker read records (or after a second): they tell
        # the runner to trigger the first checkpoint of a start or a recovery
        # (Supervisor.first_checkpoint), whose commit is then the first output.
        next_stats = time.monotonic() + _STATS_EVERY_S
        reported = False
        drained = False
        inbox = client.inbox

        def urgent() -> bool:  # a step ends early for a message to serve or an ack to send,
            # or, until the first counters went, after its first batch: they let the runner
            # trigger the first checkpoint, a step's whole budget (50 ms) earlier
            return (
                not reported or not inbox.empty() or any(t.checkpoints.upload_done() for t in tasks)
            )

        while True:
            read = 0
            timeout = 0.005 if idle else 0.0
            stop = None
            for task in tasks:
                # before each task: under watermark alignment a backfill's pace is one exchange
                # of watermarks per drift of event time, so none waits for a whole loop
                stop = _serve(client, tasks, sources, worker, purger)
                if stop is not None:
                    break
                if task.is_source and pace.rate:
                    allowed = pace.allowed(max_records)
                    if allowed:
                        n = task.step(timeout, max_records, limit=allowed, urgent=urgent)
                        pace.took(n)
                        read += n
                else:
                    read += task.step(timeout, max_records, urgent=urgent)
                if aligning is not None and task.is_source:
                    aligning.report(time.monotonic())
            if stop is None and not tasks:
                stop = _serve(client, tasks, sources, worker, purger)
            if stop is not None:
                if stop == 0:
                    with waiting("the broker (the last channel records' delivery)"):
                        writer.flush()
                    client.send(_stats(worker, tasks, sources))  # the final counts
                return stop
            idle = read == 0
            writer.poll()
            send_acks(client, tasks, env.fault)
            now = time.monotonic()
            # The drain is told at once, not at the next tick: the runner triggers the final
            # checkpoint on it, and a bounded job would otherwise end up to a tick later.
            if not drained and sources and all(t.drained for t in sources):
                drained, next_stats = True, 0.0
            if now >= next_stats or (read and not reported):
                next_stats, reported = now + _STATS_EVERY_S, True
                client.send(_stats(worker, tasks, sources))
    finally:
        beat.stop.set()
        if purger is not None:
            purger.close()
        for task in tasks:
            task.close()
        uploads.shutdown(wait=False)
        client.close()


class _AlignReport:
    """Watermark alignment: the source tasks' lowest watermarks of the partitions with records
    to read, to the runner at most every 20 ms when they changed, and every second anyway
    (:mod:`processor.runtime.supervision.alignment`)."""

    def __init__(self, client: ControlClient, sources: list[Task]) -> None:
        self.client, self.sources = client, sources
        self.sent: dict[str, int | None] | None = None
        self.checked = self.sent_at = float("-inf")

    def report(self, now: float) -> None:
        if now - self.checked < _ALIGN_EVERY_S:
            return
        self.checked = now
        marks = {t.name: t.local_watermark() for t in self.sources}
        if marks != self.sent or now - self.sent_at >= _STATS_EVERY_S:
            self.sent, self.sent_at = marks, now
            self.client.send({"t": "align_wm", "tasks": marks})


class _Pace:
    """``--max-rate``: how many records the worker's sources may read now, to read at most
    ``rate`` records per second in all (0: no limit).

    A token bucket holding a tenth of a second of the rate: a stall (a frozen Redis, a slow
    sink, a checkpoint) builds no credit beyond it, so no second of reading, stall or not,
    exceeds 1.1 times the rate (issue 50: the average since the start let a 25 s Redis freeze
    turn into 52,000 records in 2 s against a cap of 2,000/s)."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.clock = clock
        self.burst = max(rate / 10, 1.0)  # 0.1 s of the rate (and at least one record)
        self.tokens = 0.0
        self.at = clock()

    def allowed(self, most: int) -> int:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + self.rate * (now - self.at))
        self.at = now
        return max(0, min(most, int(self.tokens)))

    def took(self, records: int) -> None:
        self.tokens -= records


def send_acks(client: ControlClient, tasks: list[Task], fault: Callable[[str], None]) -> None:
    """Declines and acks of the tasks' checkpoints that are ready.

    No ack over a hole (issue 17): the worker loop calls ``writer.poll()`` just before this,
    and it raises a failed delivery; the channel producers are gapless with no local message
    timeout, so a barrier never reaches the log after a failed record of its channel (the
    writer's docstring, ``connectors/transport.py``). A flush before every ack would also close
    it, at 43 % of the throughput (bench/RESULTS.md, "Delivery before ack").
    """
    for task in tasks:
        for chk, reason in task.declined:
            client.send({"t": "decline", "chk": chk, "task": task.name, "reason": reason})
        task.declined.clear()
        for chk, handle in task.ready_acks():
            fault("after-snapshot-before-ack")
            ack = {
                "t": "ack",
                "chk": chk,
                "task": task.name,
                "handle": [handle.path, handle.size, handle.checksum],
                "log": task.loop_log.pop(chk, 0),  # a loop head's back-edge log
                "align": round(task.alignment_of(chk), 6),  # metrics: alignment (s)
                # records its sinks got in the epochs this checkpoint commits (committed=)
                "sunk": task.checkpoints.sunk_through(chk),
            }
            if task.is_source:  # its positions if it drained its watermark, else null
                ack["drained"] = task.drained_at.pop(chk, None)
                ack["sources"] = task.sources_at.pop(chk, [])  # for the job's consumer group
            client.send(ack)


def _hold_dir(spec: dict[str, Any]) -> Path:
    explicit = os.environ.get("EOSFLOW_FAULT_DIR")
    return Path(explicit) if explicit else Path(spec.get("log_path", ".")).parent / "faults"


def _admitted(client: ControlClient, worker: int, generation: int) -> int | None:
    """Waits for the coordinator's answer to the hello: ``None`` when admitted, else the exit
    code (0: told to stop, a worker of an older generation; 1: the coordinator went away)."""
    try:
        msg = client.inbox.get(timeout=_ADMIT_TIMEOUT_S)
    except queue.Empty:
        log.error("worker=%d: no answer to its hello in %.0fs; exiting", worker, _ADMIT_TIMEOUT_S)
        return 1
    if msg is None:
        log.error("worker=%d lost the coordinator before it was admitted; exiting", worker)
        return 1
    if msg.get("t") == "welcome":
        return None
    log.warning(
        "worker=%d generation=%d not admitted (%s): the job runs a newer generation; exiting "
        "without touching its state",
        worker, generation, msg.get("t"),
    )  # fmt: skip
    return 0


class _Heartbeat(threading.Thread):
    """Tells the coordinator every second that this process is alive, also while a task is
    busy (restoring, a long batch). A stopped or frozen process, or one cut off from the
    coordinator, falls silent, and the runner restarts it (``heartbeat_timeout``).

    It also says what the process waits on (:mod:`processor.runtime.waits`): the task loop,
    blocked in a Redis retry or a sink's commit, sends no counters meanwhile."""

    def __init__(self, client: ControlClient) -> None:
        super().__init__(name="heartbeat", daemon=True)
        self.client = client
        self.stop = threading.Event()
        self.start()

    def run(self) -> None:
        while not self.stop.wait(_HEARTBEAT_EVERY_S):
            msg: dict[str, Any] = {"t": "hb"}
            found = WAITS.report()
            if found:
                msg["waits"] = found
            if not self.client.send(msg):
                return


def _stats(worker: int, tasks: list[Task], sources: list[Task]) -> dict[str, Any]:
    return {
        "t": "stats",
        "worker": worker,
        "at": time.time(),  # when the counts were taken (rates between two messages)
        "tasks": {t.name: t.stats() for t in tasks},
        "drained": bool(sources) and all(t.drained for t in sources),
    }


def _serve(
    client: ControlClient,
    tasks: list[Task],
    sources: list[Task],
    worker: int,
    purger: ChannelPurger | None = None,
) -> int | None:
    """Handles the coordinator's queued messages; an exit code when the worker must stop."""
    while not client.inbox.empty():
        msg = client.inbox.get_nowait()
        if msg is None:
            log.error("worker=%d lost the coordinator; exiting", worker)
            return 1
        kind = msg.get("t")
        if kind == "trigger":
            for task in sources:
                task.trigger(int(msg["chk"]), aligned=bool(msg.get("aligned", False)))
        elif kind == "complete":
            chk = int(msg["chk"])
            for task in tasks:
                task.complete(chk)
                client.send({"t": "committed", "chk": chk, "task": task.name})
            if purger is not None:  # channel records no retained checkpoint needs
                purger.completed(chk)
        elif kind == "abort":
            for task in tasks:
                task.abort(int(msg["chk"]), str(msg.get("reason", "aborted")))
        elif kind == "align":  # the source tasks' watermarks (watermark alignment)
            for task in sources:
                task.align(others_watermark(msg["wm"], task.name))
        elif kind == "stop":
            log.info("worker=%d stopping on request", worker)
            return 0
    return None


def log_format(worker: int) -> str:
    return f"%(asctime)s worker-{worker} %(levelname)s %(name)s: %(message)s"


def run_logged(spec: dict[str, Any], *, reraise: bool = False) -> int:
    """:func:`run_worker`, logging a failure as one ERROR line (the runner quotes it as the
    restart cause) and its traceback on stderr; then 1, or the exception if ``reraise``."""
    try:
        return run_worker(spec)
    except Exception as exc:
        log.error("worker=%s failed: %s: %s", spec.get("worker"), type(exc).__name__, exc)
        log.debug("traceback", exc_info=True)
        if reraise:
            raise
        sys.stderr.write(traceback.format_exc())
        return 1


def _spare_spec(preload: list[str]) -> str | None:
    """A spare worker (``--spare TRANSPORT PIPELINE``,
    :class:`~processor.runtime.supervision.local.LocalWorkers`): started before it is needed,
    it imports the engine, the transport's module and the pipeline's (its sinks, serdes and
    client library: what the worker would import first), then waits for the path of its spec
    on stdin (``None``: end of input, the runner stopped or died) and writes its output to the
    spec's log, as a worker started with that spec would. A pipeline that fails to load here
    fails again, said in the worker's own log, once the spec came."""
    transport, pipeline = preload
    with contextlib.suppress(Exception):
        load_object(transport)
        load_flow(pipeline)
    line = sys.stdin.readline().strip()
    if not line:
        return None
    log_path = json.loads(Path(line).read_text()).get("log_path")
    if log_path:
        sys.stdout.flush()
        sys.stderr.flush()
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    return line


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not faulthandler.is_enabled():  # a native crash leaves every thread's stack in its log
        with contextlib.suppress(OSError, ValueError):
            faulthandler.enable()
    if args[:1] == ["--spare"] and len(args) == 3:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the runner decides when workers stop
        path = _spare_spec(args[1:])
        if path is None:
            return 0
        args = [path]
    if len(args) != 1:
        print(
            "usage: python -m processor.runtime.supervision.worker SPEC.json | --spare "
            "TRANSPORT PIPELINE",
            file=sys.stderr,
        )
        return 2
    spec = json.loads(Path(args[0]).read_text())
    logging.basicConfig(level=spec.get("log_level", "INFO"), format=log_format(spec["worker"]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the runner decides when workers stop
    return run_logged(spec)


if __name__ == "__main__":
    sys.exit(main())
