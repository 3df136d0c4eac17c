"""What every runner shares: the coordinator loop and supervision (reporting:
:mod:`processor.runtime.observe.reporting`; options and results: :mod:`processor.runtime.job`).

A runner compiles the pipeline, creates the channel topics, starts ``N`` workers of a
generation, triggers checkpoints on the interval, and supervises: when a worker dies, every
worker of the generation is stopped (so no zombie can write after the new generation's
markers), a new generation starts from the latest completed checkpoint, with exponential
backoff, up to ``max_restarts`` times. Each restart is logged with its cause.

How workers are started, watched and stopped is the subclass's business
(:class:`processor.runtime.supervision.local.LocalRunner`: OS processes;
:class:`processor.runtime.supervision.spark.SparkRunner`: one Spark barrier job). Both speak to the
coordinator over the same TCP control plane (:mod:`processor.runtime.control`).

``until_idle`` runs a bounded job: it ends when every source partition reached the end offset it
had when the job started, the sources drained their watermark, and a final checkpoint committed.
SIGINT/SIGTERM stop the job the same way: final checkpoint, commits, then the workers exit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from pathlib import Path
from typing import Any

from processor.compiler import Plan, compile_flow
from processor.errors import ConfigError
from processor.runtime.checkpoints.coordinator import CheckpointCoordinator
from processor.runtime.checkpoints.drain import check_drained
from processor.runtime.control import Connection, ControlServer
from processor.runtime.job import (
    Fault,
    JobFailed,
    RunOptions,
    RunResult,
    WorkerHandle,
    default_snapshot_url,
    job_dir,
    jobs_dir,
)
from processor.runtime.observe.metrics import JobMetrics
from processor.runtime.observe.webui import WebServer
from processor.runtime.operators.state_map import STATE_KEY, check_state, state_layout
from processor.runtime.pipeline import load_flow, load_object
from processor.runtime.shape.rescale import prepare_shape
from processor.runtime.shape.savepoint_state import redis_urls
from processor.runtime.shape.savepoints import (
    SavepointRequests,
    restore_savepoint,
    undo_restore,
)
from processor.runtime.shape.settle import settle_checkpoint
from processor.runtime.shape.topology import check_shape
from processor.runtime.supervision.identity import JobIdentity
from processor.runtime.supervision.preflight import check_local_recovery, extra_environ, preflight
from processor.runtime.supervision.recovery import RunnerRecovery
from processor.runtime.topics import (
    check_graph,
    check_keyed_sources,
    prepare_topics,
    start_positions,
)
from processor.snapshot.lease import JobLease
from processor.snapshot.store import SnapshotHandle, SnapshotStore

__all__ = [
    "Fault",
    "JobFailed",
    "RunOptions",
    "RunResult",
    "Runner",
    "WorkerHandle",
    "default_snapshot_url",
    "job_dir",
    "jobs_dir",
]

log = logging.getLogger(__name__)


class Runner(RunnerRecovery):
    """Runs ``pipeline`` (a file path) with :class:`RunOptions`; subclasses start the workers.

    Subclasses implement :meth:`_launch`, :meth:`_dead_worker`, :meth:`_stop_workers` and
    :meth:`_await_exit`, and may override :meth:`_start` / :meth:`_close` for their own
    resources.
    """

    runner = "base"

    def __init__(self, pipeline: str | Path, options: RunOptions) -> None:
        options.validate()
        self.pipeline = str(Path(pipeline).resolve())
        self.options = options
        with extra_environ(options.environ):  # the workers see the same variables
            self.plan: Plan = compile_flow(
                load_flow(self.pipeline), options.workers, combine=options.recovery != "local"
            )
        if options.recovery == "local":
            check_local_recovery(self.plan)
        self.job = self.plan.job
        self.dir = job_dir(self.job, options.state_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        url = options.snapshot_url or default_snapshot_url(self.job, options.state_dir)
        self.store = SnapshotStore(url)
        self.lease = JobLease(self.store, self.job)
        self.workers: list[WorkerHandle] = []
        self.log_offsets: list[int] = []
        # Only workers given this token are heard: the control port may be reachable by others.
        self.token = secrets.token_hex(16)
        self.bind: tuple[str, int] = ("127.0.0.1", 0)  # the control plane's listening address
        self.advertise: str | None = None  # the host workers connect to (default: bind host)
        self.restarts = 0
        self.restart_causes: list[str] = []
        self.generation = 0
        self.stopping: str | None = None
        self._stop_deadline = self._stop_next_say = 0.0
        self._restart_times: list[float] = []
        self._stalled = (0, 0)  # (latest completed checkpoint at the last restart, restarts since)
        self.final_chk: int | None = None
        self._final_completed_at: float | None = None
        self.committed: dict[int, set[str]] = {}
        self.totals: dict[str, dict[str, Any]] = {}
        self._started = time.monotonic()
        self._progress_next = 0.0
        self._last_in = (0.0, 0)
        self.ready_s: float | None = None
        self.final_trigger_s: float | None = None
        self._unstarted = 0  # consecutive generations that failed before every worker connected
        self.purge = False  # the broker deletes channel records on request (runtime.purge)
        self.starts: list[list[Any]] = []  # a fresh job's start positions (runtime.topics)
        self.failed_worker: int | None = None  # set by _dead_worker when it knows which
        self.metrics: JobMetrics | None = None  # metrics and the job page (runtime.metrics)
        self.web: WebServer | None = None
        self.savepoints: SavepointRequests | None = None
        self.identity = JobIdentity(self.job, None)  # the job's claim in the broker, once taken
        self._publish_next = 0.0

    # -- setup -----------------------------------------------------------------------------------

    def _worker_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.options.environ)
        return env

    # -- workers ---------------------------------------------------------------------------------

    def _spec(
        self,
        i: int,
        restore: int,
        counts: dict[str, int],
        ends: list[list[Any]] | None,
        stale_through: int = 0,
        sink_generation: int | None = None,
    ) -> dict[str, Any]:
        """Worker ``i``'s start-up spec (JSON-able), for the current generation and attempt."""
        host, port = self.advertised
        attempt = self.restarts
        return {
            "pipeline": self.pipeline,
            "worker": i,
            "workers": self.options.workers,
            "key_groups": self.plan.key_groups,
            "epoch": self.plan.epoch,
            "generation": self.generation,
            "token": self.token,
            "fingerprint": self.plan.fingerprint(),
            "restore": restore,
            "coordinator": [host, port],
            "snapshot_url": self.store.url,
            "mode": "aligned" if self.options.mode == "none" else self.options.mode,
            "checkpoint_interval": self._interval(),
            "end_offsets": ends,
            "drain": self.options.drain,
            "start_positions": self.starts,
            "purge": self.purge,
            "source_counts": counts,
            "transport": self.options.transport,
            "max_records": self.options.max_records,
            "max_rate": self.options.max_rate,
            "log_level": self.options.log_level,
            "log_path": str(self._log_path(i)),
            "recovery": self.options.recovery,
            "on_deleted_records": self.options.on_deleted_records,
            "recovery_horizon_ms": int(self.options.recovery_horizon * 1000),
            "stale_through": stale_through,
            "sink_generation": sink_generation,
            "map_state": self.options.map_state,
            "faults": [
                [f.point, f.nth, f.action]
                for f in self.options.faults
                if f.attempt == attempt and f.worker == i
            ],
        }

    def _spawn_all(self, counts: dict[str, int], ends: list[list[Any]] | None) -> None:
        self.generation = self.store.next_generation(self.job)
        self.coordinator.start_generation(self.generation)
        latest = self.store.latest_completed(self.job)
        check_shape(self.plan, self.store, latest)
        restore = latest.checkpoint_id if latest else 0
        specs = [self._spec(i, restore, counts, ends) for i in range(self.options.workers)]
        self.workers = [WorkerHandle(i) for i in range(self.options.workers)]
        # Where this generation's lines start: the log files are shared by every generation.
        self.log_offsets = [
            self._log_path(i).stat().st_size if self._log_path(i).exists() else 0
            for i in range(self.options.workers)
        ]
        self._launch(specs)
        log.info(
            "started runner=%s generation=%d workers=%d restore_checkpoint=%d",
            self.runner, self.generation, len(self.workers), restore,
        )  # fmt: skip

    def _log_path(self, worker: int) -> Path:
        return self.dir / f"worker-{worker}.log"

    def _last_error(self, worker: int) -> str:
        """`` (the last ERROR/CRITICAL message)`` this generation logged for ``worker``, if its
        log is readable here (always on the local runner; on Spark when the file system is
        shared), else ``""``."""
        try:
            with open(self._log_path(worker), "rb") as f:
                f.seek(self.log_offsets[worker])
                text = f.read().decode(errors="replace")
        except (OSError, IndexError):
            return ""
        tail = [ln for ln in text.splitlines()[-200:] if "ERROR" in ln or "CRITICAL" in ln]
        return f" ({tail[-1].split(': ', 1)[-1]})" if tail else ""

    # -- main loop -------------------------------------------------------------------------------

    def _checkpoint_metadata(self) -> dict[str, Any]:
        p = self.plan
        topology = {"parallelism": p.parallelism, "key_groups": p.key_groups, "epoch": p.epoch}
        return {STATE_KEY: state_layout(p), "topology": topology}

    def _interval(self) -> float | None:
        return None if self.options.mode == "none" else self.options.checkpoint_interval

    def run(self) -> RunResult:
        try:
            transport = load_object(self.options.transport)(self._worker_env())
        except ConfigError:  # the pipeline's own checks come first: fix those first
            preflight(self.plan, self.options, self._interval())
            raise
        # The start-up checks share one admin client per cluster (each new client's first
        # request costs about 50 ms; bench/RESULTS.md, "Start-up and shut-down"): every check
        # still runs. Ended once the workers' spec is made.
        sharing = contextlib.ExitStack()
        share = getattr(transport, "sharing_clients", None)
        if share is not None:
            sharing.enter_context(share())
        try:
            preflight(self.plan, self.options, self._interval())
            self.lease.acquire()  # before anything writes to the job's topics or checkpoints
        except BaseException:  # refused (a second run of the job): no sharing left behind
            sharing.close()
            raise
        handlers: dict[int, Any] = {}
        try:
            check = getattr(transport, "check_reachable", None)
            if check is not None:  # before anything waits on the broker
                check()
            o = self.options
            restored = None
            if o.from_savepoint:
                restored = restore_savepoint(
                    self.store, self.job, o.from_savepoint, allow_rewind=o.allow_rewind,
                    transport=transport, redis_url=redis_urls(self.plan.flow, o.environ),
                )  # fmt: skip
            latest = self.store.latest_completed(self.job)
            try:
                check_graph(self.plan, list(latest.tasks) if latest is not None else [])
                # renamed or removed stateful steps (runtime.state_map)
                check_state(self.plan, self.store, latest, o.map_state, o.allow_dropped_state)
                # Compiled with the job's topology; rescaled first if --workers changed it.
                with extra_environ(o.environ):  # the old sinks open as the workers would
                    # a bounded run's drained watermark takes no new input (runtime.drain)
                    check_drained(
                        self.plan,
                        latest,
                        transport,
                        until_idle=o.until_idle,
                        local_recovery=o.recovery == "local",
                        settle=lambda: settle_checkpoint(
                            self.plan.flow,
                            self.store,
                            latest,
                            checkpoint_interval=self._interval(),
                        ),
                    )
                    self.plan, latest = prepare_shape(
                        self.plan,
                        self.store,
                        transport,
                        latest,
                        recovery=o.recovery,
                        metadata=self._checkpoint_metadata(),
                        checkpoint_interval=self._interval(),
                    )
            except ConfigError:
                if restored is not None and restored[1]:  # refused: the copy must not stay
                    undo_restore(self.store, self.job, restored[0])
                raise
            counts, ends = prepare_topics(
                self.plan, transport, until_idle=self.options.until_idle, run_dir=self.dir
            )
            check_keyed_sources(self.plan, self.store, counts)
            # Refuses lost or stale state, then fences every earlier runner of the job anywhere
            # (runtime.identity).
            self.identity = JobIdentity.take(
                self.job, transport, latest, start_over=o.start_over,
                rewind=o.from_savepoint is not None, store_url=self.store.url, say=self._say,
            )  # fmt: skip
            if latest is None:
                self.starts = start_positions(self.plan, self.store, transport, counts)
            # Whether the broker deletes channel records on request: probed once, here, not
            # in every worker process (runtime.purge).
            probe = getattr(transport, "purge_supported", None)
            self.purge = bool(probe()) if probe is not None and self.plan.edges else False
            sharing.close()
            self.metrics = JobMetrics(
                self.plan,
                runner=self.runner,
                mode=self.options.mode,
                recovery=self.options.recovery,
            )
            self.coordinator = CheckpointCoordinator(
                self.store,
                self.job,
                self.plan.task_names(),
                interval_s=self._interval(),
                timeout_s=self.options.checkpoint_timeout,
                keep=self.options.keep_checkpoints,
                observer=self.metrics.on_checkpoint,
                metadata=self._checkpoint_metadata(),
                aligned=self.options.mode != "unaligned",
            )
            address = self.options.metrics_address()
            if address is not None:
                self.web = WebServer(self.metrics, address)
                self._say(f"job page and metrics: {self.web.url} (/metrics)")
            self._publish("starting", force=True)
            self._start()
            # After _start: SparkContext installs its own SIGINT handler (cancel every job).
            handlers = self._install_signals()
            self.server = ControlServer(*self.bind)
            port = self.server.address[1]
            self.advertised = (self.advertise or self.bind[0], port)
            self._spawn_all(counts, ends)
            self.savepoints = savepoints = SavepointRequests(
                self.store,
                self.job,
                self.coordinator,
                ready=self._ready,
                broadcast=self.server.broadcast,
                stop=self.stop_for,
                say=self._say,
                renew=self.lease.renew,
                committed=lambda c: self.committed.get(c, set()) >= self.coordinator.tasks,
                redis_url=redis_urls(self.plan.flow, self.options.environ),
            )
            while True:
                self.lease.renew()
                self._pump()
                for chk in self.identity.ready():  # its offsets are in the job's group
                    self.server.broadcast({"t": "complete", "chk": chk})
                failed = self._dead_worker() or self._stuck_worker()
                if failed is not None:
                    self._recover(failed, counts, ends)
                    continue
                if self._finished():
                    break
                self._check_stop()
                self._drive()
                savepoints.tick()
                self._report()
                self._publish()
            savepoints.finished(self.final_chk)
            self._status("finished")
            return self._result()
        finally:
            sharing.close()
            if self.savepoints is not None:
                self.savepoints.abandon("the job ended before the savepoint completed")
            if self.web is not None:
                self.web.close()
            self._restore_signals(handlers)
            if hasattr(self, "server"):
                self._kill_all()
                self.server.close()
            if hasattr(self, "coordinator"):
                self._close()
            self.identity.close()
            self.lease.release()

    def _pump(self, timeout: float = 0.05) -> None:
        """Handle the workers' messages (waits up to ``timeout`` for the first)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                conn, msg = self.server.inbox.get(timeout=max(0.0, left))
            except Exception:  # queue.Empty
                return
            self._handle(conn, msg)
            if self.server.inbox.empty():
                return

    def _handle(self, conn: Connection, msg: dict[str, Any] | None) -> None:
        if msg is None:
            return
        kind = msg.get("t")
        if kind == "hello":
            if msg.get("token") != self.token:
                log.error("control connection from %s without this job's token: closed", conn.peer)
                conn.close()
                return
            if msg.get("generation") != self.generation:
                conn.send({"t": "stop"})  # a worker of an older generation: not ours any more
                return
            i = int(msg["worker"])
            conn.send({"t": "welcome"})  # first: only now may it restore its tasks and sinks
            conn.worker = i  # broadcasts reach it from here on
            hello = self.workers[i]
            hello.conn, hello.pid, hello.host = conn, msg.get("pid"), msg.get("host")
            hello.last_seen = time.monotonic()
            return
        sender = self.workers[conn.worker] if conn.worker is not None else None
        if sender is None or sender.conn is not conn:
            # Not a worker of this generation (a zombie of an older one, or a connection
            # that never said hello): nothing it says counts (issue 19, Spark zombies).
            if kind != "hb":
                log.warning(
                    "control message %r from %s ignored: not a worker of generation %d",
                    kind, conn.peer, self.generation,
                )  # fmt: skip
            return
        sender.last_seen = time.monotonic()
        if kind == "ack":
            path, size, checksum = msg["handle"]
            handle = SnapshotHandle(path, int(size), str(checksum))
            log_n = int(msg.get("log", 0))
            align = float(msg.get("align", 0.0))
            drained = msg.get("drained", False)  # False: not a source task (runtime.drain)
            chk_id, task_name = int(msg["chk"]), str(msg["task"])
            sources = msg.get("sources")
            if self.coordinator.on_ack(chk_id, task_name, handle, log_n, align, drained, sources):
                # its completion notice once the job's group has its offsets (runtime.identity)
                self.identity.completed(chk_id, self.coordinator.stats.last_sources)
        elif kind == "decline":
            chk = self.coordinator.decline(int(msg["chk"]), str(msg["task"]), str(msg["reason"]))
            if chk is not None:
                self.server.broadcast({"t": "abort", "chk": chk, "reason": msg["reason"]})
        elif kind == "committed":
            self.committed.setdefault(int(msg["chk"]), set()).add(str(msg["task"]))
        elif kind == "stats":
            sender.stats = msg["tasks"]
            sender.drained = bool(msg["drained"])
            if self.metrics is not None:
                self.metrics.on_stats(sender, self.generation, sender.stats)

    def _ready(self) -> bool:
        ready = all(w.conn is not None for w in self.workers)
        if ready and self.ready_s is None:
            self.ready_s = time.monotonic() - self._started
        return ready

    def _drive(self) -> None:
        if not self._ready():
            return
        coordinator = self.coordinator
        aborted = coordinator.expired()
        if aborted is not None:
            self.server.broadcast({"t": "abort", "chk": aborted, "reason": "timeout"})
        wants_final = self.stopping is not None or (
            self.options.until_idle and all(w.drained for w in self.workers)
        )
        if wants_final and self.final_chk is None:
            # A checkpoint triggered before the drain may not cover everything: take a new one.
            if coordinator.pending is None:
                self.final_chk = coordinator.trigger_now()
                # Aligned even in unaligned mode: records in flight behind an unaligned barrier
                # would fall into an epoch that never commits (found by bench/throughput.py).
                self.server.broadcast({"t": "trigger", "chk": self.final_chk, "aligned": True})
                self._say(f"final checkpoint {self.final_chk} triggered")
                self.final_trigger_s = time.monotonic() - self._started
            return
        chk = coordinator.due() if self.final_chk is None else None
        if chk is not None:
            self.server.broadcast({"t": "trigger", "chk": chk})
        if (
            self.final_chk is not None
            and coordinator.pending is None
            and coordinator.stats.last_completed < self.final_chk
        ):  # the final checkpoint was aborted: take another
            self.final_chk = None

    def _check_final_commit(self, done: set[str]) -> None:
        """The final checkpoint completed, but not every task reported its sinks' commit:
        wait at most ``stop_timeout``, then fail saying which tasks, instead of hanging while
        heartbeats keep flowing (issue 35: a PostgreSQL ``COMMIT PREPARED`` stuck for ever
        held ``--until-idle`` with no message). Nothing is lost: the checkpoint completed, and
        the next run commits what it left pending."""
        if self.coordinator.stats.last_completed != self.final_chk:
            self._final_completed_at = None
            return
        now = time.monotonic()
        if self._final_completed_at is None:
            self._final_completed_at = now
        elif now - self._final_completed_at > self.options.stop_timeout:
            missing = sorted(set(self.coordinator.tasks) - done)
            raise JobFailed(
                f"job {self.job!r}: final checkpoint {self.final_chk} completed, but tasks "
                f"{missing} did not report their sinks' commit within --stop-timeout "
                f"{self.options.stop_timeout:g}s (a sink's database or broker does not "
                "answer; see worker-*.log). Nothing is lost: the next run commits it"
            )

    def _finished(self) -> bool:
        if self.final_chk is None:
            return False
        done = self.committed.get(self.final_chk, set())
        if len(done) < len(self.coordinator.tasks):
            self._check_final_commit(done)
            return False
        self._final_completed_at = None
        st = self.coordinator.stats
        if self.stopping is None and st.last_completed == self.final_chk and st.last_loop_log:
            # Records were still going around a loop when the heads took their snapshots: the
            # input is drained but the job is not idle. The next checkpoint looks again; one
            # that finds every back-edge empty proves nothing is left in flight.
            self._say(
                f"checkpoint {self.final_chk}: {st.last_loop_log:,} records still in loops; "
                "checking again"
            )
            self.final_chk = None
            return False
        self.server.broadcast({"t": "stop"})
        self._await_exit(30.0)
        deadline = time.monotonic() + 2.0  # read the workers' final counters up to their EOF
        while time.monotonic() < deadline and any(
            w.conn is not None and not w.conn.closed for w in self.workers
        ):
            self._pump(0.05)
        while not self.server.inbox.empty():
            self._handle(*self.server.inbox.get_nowait())
        self._report(force=True)
        return True
