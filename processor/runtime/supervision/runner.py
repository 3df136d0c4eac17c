"""The runner: compiles the pipeline, wires its collaborators in one place, and runs the
coordinator loop (options and results: :mod:`processor.runtime.job`).

A runner compiles the pipeline, creates the channel topics, starts ``N`` workers of a
generation, triggers checkpoints on the interval, and supervises: when a worker dies, every
worker of the generation is stopped (so no zombie can write after the new generation's
markers), a new generation starts from the latest completed checkpoint, with exponential
backoff, up to ``max_restarts`` times. Each restart is logged with its cause.

:class:`Runner` owns, and builds in :meth:`Runner.__init__` and :meth:`Runner.run`:

* the :class:`~processor.runtime.job.Generation` (``current``): the generation's number and
  its workers' handles, which the control plane admits workers into;
* a :class:`~processor.runtime.supervision.recovery.WorkerLauncher` (``launcher``): how workers are
  started, watched and stopped (:class:`processor.runtime.supervision.local.LocalWorkers`: OS
  processes; :class:`processor.runtime.supervision.spark.SparkWorkers`: one Spark barrier job per
  generation);
* :class:`~processor.runtime.supervision.lifecycle.RestartBudget` (``budget``): the restart
  strategy;
* :class:`~processor.runtime.supervision.lifecycle.StopController` (``stop``): stop signals, the
  final
  checkpoint and its bounded wait;
* :class:`~processor.runtime.supervision.reporting.Reporter` (``reporter``): progress,
  ``status.json``,
  the metrics' snapshot, the :class:`RunResult`;
* once the run built them: the :class:`CheckpointCoordinator`, the :class:`ControlServer`, the
  :class:`~processor.runtime.supervision.recovery.Supervisor` (``supervisor``: generations, failed
  workers, recovery) and the savepoint requests.

The loop itself is the runner's: handle the workers' messages, hand a failed worker to the
supervisor, drive the coordinator (and the final checkpoint), report. Both launchers' workers
speak to it over the same TCP control plane (:mod:`processor.runtime.control`).

``until_idle`` runs a bounded job: it ends when every source partition reached the end offset it
had when the job started, the sources drained their watermark, and a final checkpoint committed.
SIGINT/SIGTERM stop the job the same way: final checkpoint, commits, then the workers exit.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from processor.compiler import Plan, compile_flow
from processor.errors import ConfigError
from processor.runtime.checkpoints.coordinator import CheckpointCoordinator
from processor.runtime.checkpoints.drain import check_drained
from processor.runtime.control import Connection, ControlServer
from processor.runtime.job import (
    Fault,
    Generation,
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
    FINAL_COMMITTED,
    SavepointRequests,
    restore_savepoint,
    undo_restore,
)
from processor.runtime.shape.settle import settle_checkpoint
from processor.runtime.supervision.alignment import SourceAlignment
from processor.runtime.supervision.identity import JobIdentity
from processor.runtime.supervision.lifecycle import RestartBudget, StopController
from processor.runtime.supervision.preflight import check_local_recovery, extra_environ, preflight
from processor.runtime.supervision.recovery import Supervisor, WorkerLauncher
from processor.runtime.supervision.reporting import Reporter
from processor.runtime.supervision.startup import StartTimes
from processor.runtime.supervision.takeover import Takeover
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


class Runner:
    """Runs ``pipeline`` (a file path) with :class:`RunOptions`, its workers started by
    ``launcher`` (:class:`processor.runtime.supervision.local.LocalRunner` and
    :class:`processor.runtime.supervision.spark.SparkRunner` choose one)."""

    def __init__(self, pipeline: str | Path, options: RunOptions, launcher: WorkerLauncher) -> None:
        self.start_times = StartTimes()  # where the start goes (status.json "startup")
        options.validate()
        self.pipeline = str(Path(pipeline).resolve())
        self.options = options
        with extra_environ(options.environ):  # the workers see the same variables
            self.plan: Plan = compile_flow(
                load_flow(self.pipeline), options.workers, combine=options.recovery != "local"
            )
        if options.recovery == "local":
            check_local_recovery(self.plan)
        self.job = self.start_times.job = self.plan.job
        self.start_times.mark("compiled")
        self.dir = job_dir(self.job, options.state_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        url = options.snapshot_url or default_snapshot_url(self.job, options.state_dir)
        self.store = SnapshotStore(url)
        self.lease = JobLease(self.store, self.job)
        # Only workers given this token are heard: the control port may be reachable by others.
        self.token = secrets.token_hex(16)
        self.purge = False  # the broker deletes channel records on request (runtime.purge)
        self.starts: list[list[Any]] = []  # a fresh job's start positions (runtime.topics)
        self.source_counts: dict[str, int] = {}  # partitions per source topic
        self.end_offsets: list[list[Any]] | None = None  # a bounded run's (runtime.topics)
        # The collaborators, wired here: each gets what it reads, none gets the runner.
        self.launcher = launcher
        self.runner = launcher.name
        self.current = Generation(self.dir, options.workers)
        self.budget = RestartBudget(self.job, options, self.dir)
        self.reporter = Reporter(
            self.job,
            self.dir,
            options,
            runner=self.runner,
            current=self.current,
            budget=self.budget,
            snapshot_url=self.store.url,
            start=self.start_times,
        )
        self.stop = StopController(
            self.job, options, say=self.reporter.say, last_completed=self._last_completed
        )
        # Built by run(), once the checks passed:
        self.metrics: JobMetrics | None = None  # metrics and the job page (runtime.metrics)
        self.web: WebServer | None = None
        self.supervisor: Supervisor | None = None
        self.savepoints: SavepointRequests | None = None
        self.identity = JobIdentity(self.job, None)  # the job's claim in the broker, once taken
        self.alignment: SourceAlignment | None = None  # --watermark-alignment, once serving

    # -- what tests, the test kit and benchmarks read ---------------------------------------------

    @property
    def generation(self) -> int:
        return self.current.number

    @generation.setter
    def generation(self, number: int) -> None:
        self.current.number = number

    @property
    def workers(self) -> list[WorkerHandle]:
        return self.current.workers

    @workers.setter
    def workers(self, handles: list[WorkerHandle]) -> None:
        self.current.workers = handles

    @property
    def restarts(self) -> int:
        return self.budget.restarts

    @property
    def restart_causes(self) -> list[str]:
        return self.budget.causes

    @property
    def final_chk(self) -> int | None:
        return self.stop.final

    @property
    def ready_s(self) -> float | None:
        return self.reporter.ready_s

    def stop_for(self, reason: str, more: str = "") -> None:
        """Stop after a final, aligned checkpoint (:meth:`StopController.stop_for`)."""
        self.stop.stop_for(reason, more)

    # -- setup -----------------------------------------------------------------------------------

    def _worker_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.options.environ)
        return env

    def _spec(
        self, worker: int, restore: int, stale_through: int = 0, sink_generation: int | None = None
    ) -> dict[str, Any]:
        """Worker ``worker``'s start-up spec (JSON-able), for the current generation and attempt."""
        host, port = self.advertised
        attempt = self.budget.restarts
        return {
            "pipeline": self.pipeline,
            "worker": worker,
            "workers": self.options.workers,
            "key_groups": self.plan.key_groups,
            "epoch": self.plan.epoch,
            "generation": self.current.number,
            "token": self.token,
            "fingerprint": self.plan.fingerprint(),
            "restore": restore,
            "coordinator": [host, port],
            "snapshot_url": self.store.url,
            "mode": "aligned" if self.options.mode == "none" else self.options.mode,
            "checkpoint_interval": self._interval(),
            "end_offsets": self.end_offsets,
            "drain": self.options.drain,
            "start_positions": self.starts,
            "purge": self.purge,
            "source_counts": self.source_counts,
            "transport": self.options.transport,
            "max_records": self.options.max_records,
            "max_rate": self.options.max_rate,
            "watermark_drift_ms": self.options.watermark_drift_ms(),
            "log_level": self.options.log_level,
            "log_path": str(self.current.log_path(worker)),
            "recovery": self.options.recovery,
            "on_deleted_records": self.options.on_deleted_records,
            "recovery_max_ids": self.options.recovery_max_ids,
            "stale_through": stale_through,
            "sink_generation": sink_generation,
            "map_state": self.options.map_state,
            "faults": [
                [f.point, f.nth, f.action]
                for f in self.options.faults
                if f.attempt == attempt and f.worker == worker
            ],
        }

    def _checkpoint_metadata(self) -> dict[str, Any]:
        p = self.plan
        topology = {"parallelism": p.parallelism, "key_groups": p.key_groups, "epoch": p.epoch}
        return {STATE_KEY: state_layout(p), "topology": topology}

    def _interval(self) -> float | None:
        return None if self.options.mode == "none" else self.options.checkpoint_interval

    def _last_completed(self) -> int:
        return self.coordinator.stats.last_completed if hasattr(self, "coordinator") else 0

    # -- main loop -------------------------------------------------------------------------------

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
        prepared = False
        try:
            # Workers started ahead (spares), importing while the checks, the lease and the
            # claim run: a refused start stops them again. They write nothing of the job's.
            prepare = getattr(self.launcher, "prepare", None)
            if prepare is not None:
                prepared = True
                prepare(self.options.workers, self.dir, (self.options.transport, self.pipeline))
            preflight(self.plan, self.options, self._interval())
            if self.options.takeover:  # the running holder stops at a savepoint first
                self._take_over(transport)
            else:
                self.lease.acquire()  # before anything writes to the job's topics or checkpoints
            # A savepoint request written since is for this run (not --takeover's own request)
            started_ms = int(time.time() * 1000)
            self.start_times.mark("checked")
        except BaseException:  # refused (a second run of the job): no sharing left behind
            sharing.close()
            if prepared:
                self.launcher.close()
            raise
        handlers: dict[int, Any] = {}
        reporter = self.reporter
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
            # Whether the broker deletes channel records on request: probed once per run, here,
            # not in every worker process (runtime.purge); a scratch topic's round trips (0.55 s
            # on Kafka 4.3.1), so in a thread while the topics are prepared and the job claimed.
            probe = getattr(transport, "purge_supported", None)
            if probe is None or not self.plan.edges:
                probe = lambda: False  # noqa: E731 (no channels, or a transport that cannot)
            probing = ThreadPoolExecutor(1, thread_name_prefix="eosflow-probe")
            purge = probing.submit(probe)
            probing.shutdown(wait=False)  # the thread ends with the probe
            counts, self.end_offsets = prepare_topics(
                self.plan, transport, until_idle=self.options.until_idle, run_dir=self.dir
            )
            self.source_counts = counts
            check_keyed_sources(self.plan, self.store, counts)
            self.start_times.mark("topics")
            # Refuses lost or stale state, then fences every earlier runner of the job anywhere
            # (runtime.identity).
            self.identity = JobIdentity.take(
                self.job, transport, latest, start_over=o.start_over, force=o.force,
                rewind=o.rewinds(), store_url=self.store.url, say=reporter.say,
                interval_s=self._interval() or 0.0,
            )  # fmt: skip
            self.start_times.mark("claimed")
            # Above every generation another runner of the job used (its channel records).
            self.store.raise_generation(self.job, self.identity.prior_generation)
            if latest is None:
                self.starts = start_positions(self.plan, self.store, transport, counts)
            self.purge = bool(purge.result())
            sharing.close()
            self.metrics = metrics = JobMetrics(
                self.plan,
                runner=self.runner,
                mode=self.options.mode,
                recovery=self.options.recovery,
            )
            self.coordinator = CheckpointCoordinator(
                self.store,
                self.job,
                self.plan.task_names(),
                # None with --mode none: only the final checkpoint (0.0 there, from issue 48
                # until 51, checkpointed back to back)
                interval_s=self._interval(),
                timeout_s=self.options.checkpoint_timeout,
                keep=self.options.keep_checkpoints,
                observer=metrics.on_checkpoint,
                metadata=self._checkpoint_metadata(),
                aligned=self.options.mode != "unaligned",
            )
            address = self.options.metrics_address()
            if address is not None:
                self.web = WebServer(metrics, address)
                reporter.say(f"job page and metrics: {self.web.url} (/metrics)")
            reporter.open(self.plan, self.coordinator, metrics, self.web)
            reporter.publish("starting", force=True)
            control = self.launcher.open(self.job, self.pipeline, reporter.say)
            # After open: SparkContext installs its own SIGINT handler (cancel every job).
            handlers = self.stop.install_signals()
            self.server = ControlServer(*control.bind)
            self.identity.wake = self.server.wake  # a completion notice goes out at once
            if self.options.watermark_drift_ms() is not None:
                self.alignment = SourceAlignment(self.server.broadcast)
            port = self.server.address[1]
            self.advertised = (control.advertise or control.bind[0], port)
            self.supervisor = supervisor = Supervisor(
                job=self.job,
                plan=self.plan,
                options=self.options,
                store=self.store,
                current=self.current,
                launcher=self.launcher,
                server=self.server,
                coordinator=self.coordinator,
                budget=self.budget,
                stop=self.stop,
                identity=self.identity,
                metrics=metrics,
                spec=self._spec,
                pump=self._pump,
                say=reporter.say,
            )
            supervisor.start_generation()
            self.start_times.mark("launched")
            self.savepoints = savepoints = SavepointRequests(
                self.store,
                self.job,
                self.coordinator,
                ready=self._ready,
                broadcast=self.server.broadcast,
                stop=self.stop.stop_for,
                say=reporter.say,
                renew=self.lease.renew,
                committed=lambda c: self.stop.committed.get(c, set()) >= self.coordinator.tasks,
                redis_url=redis_urls(self.plan.flow, self.options.environ),
                since_ms=started_ms,
            )
            while True:
                self.lease.renew()
                # a checkpoint due sooner than the usual 50 ms is triggered on time (at 100 ms
                # checkpoints the wait added 25 ms to the interval on average)
                self._pump(min(0.05, max(0.002, self.coordinator.due_in())))
                for chk in self.identity.ready():  # its offsets are in the job's group
                    self.server.broadcast({"t": "complete", "chk": chk})
                failed = supervisor.failed()
                if failed is not None:
                    supervisor.recover(*failed)
                    continue
                if self._finished():
                    break
                self._check_stop()
                self._drive()
                savepoints.tick()
                reporter.report()
                reporter.publish()
            # Every sink committed the final checkpoint: a savepoint copied of it later, from
            # the stopped job, says so (a restore after a reset, whose commit markers are gone,
            # must not publish its last epoch again: processor.admin.jobs.copy_checkpoint).
            if self.stop.final:
                self.store.write_job_file(
                    self.job, FINAL_COMMITTED, json.dumps({"checkpoint": self.stop.final}).encode()
                )
            savepoints.finished(self.stop.final)
            # "finished": a bounded run read its input to the end; "stopped": a stop request
            # (a signal, savepoint --stop, --takeover) ended it, maybe with input unread.
            reporter.status("stopped" if self.stop.stopping is not None else "finished")
            return reporter.result()
        except Exception:
            if reporter.opened:  # not "running" with no runner: the job and its page say so
                reporter.status("failed")
            raise
        finally:
            self.stop.ended = True  # a stop signal during the clean-up is said, not obeyed
            try:
                sharing.close()
                if self.savepoints is not None:
                    self.savepoints.abandon("the job ended before the savepoint completed")
                if self.web is not None:
                    self.web.close()
                if self.supervisor is not None:
                    self.supervisor.stop_all()
                if hasattr(self, "server"):
                    self.server.close()
                if hasattr(self, "coordinator") or prepared:
                    self.launcher.close()
                self.identity.close()
                self.lease.release()
            finally:
                StopController.restore_signals(handlers)

    def _take_over(self, transport: Any) -> None:
        """``--takeover``: the runner holding the job stops at a savepoint, this one takes the
        lease and starts from it (:mod:`processor.runtime.supervision.takeover`)."""
        o = self.options
        takeover = Takeover(
            self.job, self.store, timeout=o.takeover_timeout, say=self.reporter.say,
            redis_url=redis_urls(self.plan.flow, o.environ),
        )  # fmt: skip
        path = takeover.from_claim(transport)  # the runner that checkpointed last
        takeover.acquire(self.lease)  # and one on this store that has not checkpointed yet
        if path:
            o.from_savepoint = path

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

    def _handle(self, conn: Connection | None, msg: dict[str, Any] | None) -> None:
        if msg is None or conn is None:  # a closed connection, or a wake-up (ControlServer.wake)
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
        if kind == "hb":  # what it waits on (processor.runtime.waits), if anything
            sender.waits, sender.waits_at = list(msg.get("waits") or ()), sender.last_seen
        elif kind == "ack":
            path, size, checksum = msg["handle"]
            handle = SnapshotHandle(path, int(size), str(checksum))
            log_n = int(msg.get("log", 0))
            align = float(msg.get("align", 0.0))
            drained = msg.get("drained", False)  # False: not a source task (runtime.drain)
            chk_id, task_name = int(msg["chk"]), str(msg["task"])
            sources = msg.get("sources")
            self.coordinator.on_sunk(chk_id, task_name, msg.get("sunk") or ())
            if self.coordinator.on_ack(chk_id, task_name, handle, log_n, align, drained, sources):
                self.start_times.mark("first_completed")
                # its completion notice once the job's group has its offsets (runtime.identity)
                self.identity.completed(chk_id, self.coordinator.stats.last_sources)
        elif kind == "decline":
            chk = self.coordinator.decline(int(msg["chk"]), str(msg["task"]), str(msg["reason"]))
            if chk is not None:
                self.server.broadcast({"t": "abort", "chk": chk, "reason": msg["reason"]})
        elif kind == "committed":
            chk_id = int(msg["chk"])
            self.stop.on_committed(chk_id, str(msg["task"]))
            if self.stop.committed[chk_id] >= self.coordinator.tasks:
                self.start_times.mark("first_committed")  # the first output is visible
        elif kind == "stats":
            sender.stats, sender.stats_at = msg["tasks"], float(msg.get("at") or 0.0)
            sender.drained = bool(msg["drained"])
            if self.metrics is not None:
                self.metrics.on_stats(sender, self.current.number, sender.stats)
        elif kind == "align_wm" and self.alignment is not None:
            self.alignment.on_report(msg["tasks"])

    def _ready(self) -> bool:
        ready = self.current.connected()
        if ready:
            self.reporter.mark_ready()
            self.start_times.mark("connected")
        return ready

    def _drive(self) -> None:
        if not self._ready():
            return
        if self.alignment is not None:
            self.alignment.send()  # again every second: a restarted worker learns it too
        coordinator, stop = self.coordinator, self.stop
        aborted = coordinator.expired()
        if aborted is not None:
            self.server.broadcast({"t": "abort", "chk": aborted, "reason": "timeout"})
        if stop.final is None and stop.wants_final(all(w.drained for w in self.workers)):
            # A checkpoint triggered before the drain may not cover everything: take a new one.
            if coordinator.pending is None:
                final = coordinator.trigger_now()
                stop.final_triggered(final)
                # Aligned even in unaligned mode: records in flight behind an unaligned barrier
                # would fall into an epoch that never commits (found by bench/throughput.py).
                self.server.broadcast({"t": "trigger", "chk": final, "aligned": True})
                self.start_times.mark("first_trigger")
                self.reporter.say(f"final checkpoint {final} triggered")
                self.reporter.mark_final_trigger()
            return
        chk = None
        if stop.final is None:
            first = self.supervisor.first_checkpoint() if self.supervisor else "periodic"
            periodic = coordinator.interval_s is not None
            if first == "now" and periodic:  # every restarted worker reads (Supervisor)
                chk = coordinator.trigger_now(aligned=coordinator.aligned)
            elif first == "periodic":
                chk = coordinator.due()
        if chk is not None:
            self.server.broadcast({"t": "trigger", "chk": chk})
            self.start_times.mark("first_trigger")
        if (
            stop.final is not None
            and coordinator.pending is None
            and coordinator.stats.last_completed < stop.final
        ):  # the final checkpoint was aborted: take another
            stop.retry_final()

    def _check_stop(self) -> None:
        """A stop whose final checkpoint cannot complete ends after ``--stop-timeout``."""
        if self.stop.stopping is None:
            return
        pending = self.coordinator.pending
        unacked = sorted(self.coordinator.tasks - set(pending.acks)) if pending else []
        self.stop.check_deadline(unacked, self.budget.last_cause)

    def _finished(self) -> bool:
        stop, st = self.stop, self.coordinator.stats
        if not stop.final_committed(self.coordinator.tasks, st.last_completed):
            return False
        if stop.stopping is None and st.last_completed == stop.final and st.last_loop_log:
            # Records were still going around a loop when the heads took their snapshots: the
            # input is drained but the job is not idle. The next checkpoint looks again; one
            # that finds every back-edge empty proves nothing is left in flight.
            self.reporter.say(
                f"checkpoint {stop.final}: {st.last_loop_log:,} records still in loops; "
                "checking again"
            )
            stop.retry_final()
            return False
        self.server.broadcast({"t": "stop"})
        self.launcher.await_exit(30.0)
        deadline = time.monotonic() + 2.0  # read the workers' final counters up to their EOF
        while time.monotonic() < deadline and any(
            w.conn is not None and not w.conn.closed for w in self.workers
        ):
            self._pump(0.05)
        while not self.server.inbox.empty():
            self._handle(*self.server.inbox.get_nowait())
        self.reporter.report(force=True, final=True)
        return True
