"""The Spark runner: the workers run as one Spark barrier-mode job, the driver supervises.

The driver (this process) hosts the checkpoint coordinator and the TCP control plane of the
local runner. A generation of ``N`` workers is one Spark job: ``parallelize(range(N), N)
.barrier().mapPartitions(...)``, so Spark gang-schedules ``N`` long-running tasks (all or none),
and task ``i`` runs the same worker loop as the local runner's process ``i``
(:func:`processor.runtime.supervision.worker.run_worker`). Workers connect back to the driver; no
Spark mechanism (``allGather``, accumulators, RDD results) carries control messages.

Supervision: Spark does not retry a failed barrier result stage, it aborts the job. When the
job fails (a worker's Python process died, an executor was lost, a worker raised) or a worker
loses its connection, the driver cancels the job group, waits until no worker of that
generation is connected, and submits a new job: a new generation that restores the latest
completed checkpoint. A task re-executed by Spark (attempt > 0) refuses to run, so only the
driver starts workers, each with a fresh generation; side effects are keyed by
(epoch, worker) and stale generations are fenced, as on the local runner.

Settings the runner forces: ``spark.speculation=false`` (a speculative copy of a worker would
be a second live worker for the same subtask; refused if configured true) and
``spark.python.worker.reuse=false`` (a worker task runs for the life of a generation). On a
``local[...]`` master it also defaults ``SPARK_LOCAL_IP``, the driver address and the UI to
loopback/off, and the executors' Python to this interpreter.

What the executors get: the job's environment (``RunOptions.environ``, ``eosflow run --env``)
as ``spark.executorEnv.NAME`` and, with the driver's ``EOSFLOW_*`` variables, in each task.
Before the first barrier job, a short check job runs on them
(:mod:`processor.runtime.supervision.spark_check`): a Python without eosflow, or a variable the
pipeline reads that did not reach them, fails the run in seconds with the fix named.

:class:`SparkWorkers` is that :class:`~processor.runtime.supervision.recovery.WorkerLauncher`;
:class:`SparkRunner` is a :class:`~processor.runtime.supervision.runner.Runner` that uses it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from processor.errors import ConfigError
from processor.runtime.job import Generation
from processor.runtime.supervision.preflight import extra_environ
from processor.runtime.supervision.recovery import ControlAddress, Failure
from processor.runtime.supervision.runner import Runner, RunOptions
from processor.runtime.supervision.spark_check import check_executors

__all__ = ["SparkOptions", "SparkRunner", "SparkWorkers", "local_slots", "spark_cause"]

log = logging.getLogger(__name__)

_KILL_AFTER_S = 10.0  # a cancelled worker on the driver's host still connected: SIGKILL it
_DRAIN_S = 60.0  # after this, the next generation starts anyway (with an error logged)
_FORCED = {"spark.speculation": "false", "spark.python.worker.reuse": "false"}


@dataclass
class SparkOptions:
    """Where and how Spark runs the workers.

    Args:
        master: ``local[N]``, ``spark://host:7077``, ``k8s://...``, ``yarn``. Default: the
            master ``spark-submit`` gave, else ``local[W]`` for ``W`` workers.
        conf: extra Spark settings (``spark.archives``, ``spark.executorEnv.*``, ...).
        control_host: the address executors use to reach the driver's control port. Default:
            loopback on a local master, else Spark's ``spark.driver.host``.
    """

    master: str | None = None
    conf: dict[str, str] = field(default_factory=dict)
    control_host: str | None = None

    @staticmethod
    def parse_conf(items: list[str]) -> dict[str, str]:
        conf = {}
        for item in items:
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise ConfigError(
                    f"--conf {item!r}: expected KEY=VALUE, e.g. spark.executor.cores=2"
                )
            conf[key.strip()] = value.strip()
        return conf


def local_slots(master: str) -> int | None:
    """Task slots of a ``local`` master (``local``: 1, ``local[4]``: 4, ``local[*]``: cores,
    ``local[4,2]``: 4); ``None`` for any other master."""
    if master == "local":
        return 1
    m = re.fullmatch(r"local\[(\*|\d+)(?:,\s*\d+)?\]", master)
    if m is None:
        return None
    return os.cpu_count() or 1 if m.group(1) == "*" else int(m.group(1))


def spark_cause(text: str) -> str:
    """A one-line restart cause from a Spark job failure's message."""
    task = re.search(r"ResultTask\(\d+, (\d+)\)", text)
    who = f"worker {task.group(1)}" if task else "a worker task"
    if "Python worker exited unexpectedly" in text:
        return f"{who}: its Python process died (killed or crashed)"
    if "ExecutorLostFailure" in text or "executor lost" in text.lower():
        return f"{who}: its executor was lost"
    errors = re.findall(r"^(\w+(?:\.\w+)*(?:Error|Exception)): (.*)$", text, re.MULTILINE)
    if errors:
        name, message = errors[-1]
        return f"{who} failed: {name}: {message.strip()[:300]}"
    first = text.strip().splitlines()[0] if text.strip() else "unknown error"
    return f"{who}: Spark job failed: {first[:300]}"


def _check_slots(master: str, workers: int) -> bool:
    """True for a ``local`` master; refuses one with fewer task slots than workers."""
    slots = local_slots(master)
    if slots is not None and slots < workers:
        raise ConfigError(
            f"master {master} has {slots} task slot(s) but the job has {workers} workers, and "
            f"a barrier job needs them all at once: use --master local[{workers}]"
        )
    return slots is not None


def _check_forced(conf: dict[str, str], source: str) -> None:
    for key, value in _FORCED.items():
        if key in conf and conf[key].lower() != value:
            raise ConfigError(
                f"{key}={conf[key]} in {source}: eosflow needs {key}={value} for its worker "
                "job (one live task per worker and generation); remove the setting"
            )


class _Job:
    """One generation's barrier job, collected in a thread of the driver."""

    def __init__(self, sc: Any, group: str, payload: dict[str, Any]) -> None:
        self.sc, self.group, self.payload = sc, group, payload
        self.done = threading.Event()
        self.error: str | None = None
        self.codes: list[int] = []
        self.thread = threading.Thread(target=self._run, name=f"spark-{group}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        n = len(self.payload["specs"])
        try:
            # Job groups are per thread (PySpark pins Python threads to JVM threads).
            self.sc.setJobGroup(self.group, "eosflow workers", interruptOnCancel=True)
            rdd = self.sc.parallelize(range(n), n).barrier()
            self.codes = rdd.mapPartitions(functools.partial(_task, self.payload)).collect()
        except Exception as exc:  # py4j/Spark errors carry the executor's traceback as text
            self.error = str(exc)
        finally:
            self.done.set()


def _task(payload: dict[str, Any], _partition: Iterator[Any]) -> Iterator[int]:
    """The body of worker task ``i`` (runs in a Python worker process on an executor)."""
    from pyspark import BarrierTaskContext, SparkFiles

    from processor.runtime.supervision.worker import log_format, run_logged

    ctx = BarrierTaskContext.get()
    if ctx.attemptNumber() > 0:
        # Only the driver starts workers, each generation once: a retry would reuse this one.
        raise RuntimeError("eosflow worker tasks are not retried by Spark; the driver restarts")
    spec = dict(payload["specs"][ctx.partitionId()])
    os.environ.update(payload["environ"])
    if not Path(spec["pipeline"]).is_file():  # on a cluster: the copy shipped by addFile
        spec["pipeline"] = SparkFiles.get(Path(spec["pipeline"]).name)
    root = logging.getLogger()
    handler: logging.Handler
    try:  # the job's log file when the executor shares the driver's file system
        handler = logging.FileHandler(spec["log_path"])
    except OSError:
        handler = logging.StreamHandler(sys.stderr)  # the executor's stderr log
    handler.setFormatter(logging.Formatter(log_format(spec["worker"])))
    root.addHandler(handler)
    root.setLevel(spec.get("log_level", "INFO"))
    try:
        # A worker that raises fails the task with its traceback: the driver's restart cause.
        code = run_logged(spec, reraise=True)
        if code != 0:
            raise RuntimeError(f"worker {spec['worker']} lost its coordinator connection")
        yield code
    finally:
        root.removeHandler(handler)
        handler.close()


def _driver_path() -> str:
    """``PYTHONPATH`` for local workers that run the driver's interpreter: its ``sys.path``
    (the pipeline's directory, a checkout that is not installed).

    Why the interpreter is set too: PySpark starts its Python workers with ``PYSPARK_PYTHON``,
    else the ``python3`` found on ``PATH``; the ``spark.pyspark.python`` setting is only read by
    ``spark-submit``. A driver started by the path of a virtualenv's interpreter, without the
    virtualenv activated (cron, systemd, an IDE), got workers without eosflow's dependencies
    (found by the release check on Apache Kafka). A ``PYSPARK_PYTHON`` the user set is kept,
    and then the path is theirs too.
    """
    paths = [p for p in sys.path if p and os.path.exists(p)]
    return os.pathsep.join(dict.fromkeys(paths))


class SparkRunner(Runner):
    """Runs ``pipeline`` with :class:`RunOptions` on Spark (:class:`SparkOptions`)."""

    def __init__(
        self, pipeline: str | Path, options: RunOptions, spark: SparkOptions | None = None
    ) -> None:
        if options.recovery == "local":
            raise ConfigError(
                "--recovery local restarts one worker while the others keep running, but the "
                "Spark runner's workers are one barrier job, which Spark restarts as a whole: "
                "use --recovery global with --runner spark, or --runner local"
            )
        self.spark = SparkWorkers(options, spark or SparkOptions())
        super().__init__(pipeline, options, self.spark)


class SparkWorkers:
    """Workers as one Spark barrier job per generation (a
    :class:`~processor.runtime.supervision.recovery.WorkerLauncher`); ``options``: the run's
    (``workers``, ``environ``)."""

    name = "spark"

    def __init__(self, options: RunOptions, spark: SparkOptions) -> None:
        self.options = options
        self.spark_options = spark
        conf = self.spark_options.conf
        _check_forced(conf, "--conf")  # before Spark starts; again after, with every source
        self.master = self.spark_options.master
        if self.master is None and not os.environ.get("PYSPARK_GATEWAY_PORT"):
            self.master = f"local[{options.workers}]"  # not under spark-submit: run locally
        self.local_master = _check_slots(self.master, options.workers) if self.master else False
        self.session: Any = None
        self._owns_session = False
        self._job: _Job | None = None
        self._name = ""  # the job's
        self.spark_start_s: float | None = None
        self.check_s: float | None = None  # the first-task check's time, once it passed
        self._say: Callable[[str], None] = lambda _: None

    # -- session ---------------------------------------------------------------------------------

    def open(self, job: str, pipeline: str, say: Callable[[str], None]) -> ControlAddress:
        started = time.monotonic()
        self._name, self._say = job, say
        if self.local_master:
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        from pyspark.sql import SparkSession

        self._owns_session = SparkSession.getActiveSession() is None
        builder = SparkSession.builder.appName(f"eosflow-{job}")
        if self.master is not None:
            builder = builder.master(self.master)
        settings = {"spark.ui.showConsoleProgress": "false", **_FORCED}
        if self.local_master:
            settings.update(
                {
                    "spark.ui.enabled": "false",
                    "spark.driver.host": "127.0.0.1",
                    "spark.driver.bindAddress": "127.0.0.1",
                }
            )
        # The job's own variables from the executors' start (the tasks set them again, with
        # the driver's EOSFLOW_*: a session spark-submit made already has its executorEnv).
        for key, value in self.options.environ.items():
            settings[f"spark.executorEnv.{key}"] = value
        python: dict[str, str] = {}
        chosen = os.environ.get("PYSPARK_PYTHON") or self.spark_options.conf.get(
            "spark.pyspark.python"
        )
        if chosen is None and self.local_master:
            python = {"PYSPARK_PYTHON": sys.executable}
            if "PYTHONPATH" not in self.options.environ:  # --env PYTHONPATH=... wins
                settings["spark.executorEnv.PYTHONPATH"] = _driver_path()
        elif chosen is not None and not os.environ.get("PYSPARK_PYTHON"):
            # spark.pyspark.python is only read by spark-submit; PySpark reads the variable.
            python = {"PYSPARK_PYTHON": chosen}
        settings.update(self.spark_options.conf)
        for key, value in settings.items():
            builder = builder.config(key, value)
        say(f"starting Spark (master {self.master or 'from spark-submit'})")
        with extra_environ(python):  # PySpark reads the workers' interpreter when it starts
            self.session = builder.getOrCreate()
        sc = self.session.sparkContext
        sc.setLogLevel(self.spark_options.conf.get("spark.log.level", "ERROR"))
        effective = sc.getConf()
        # Under spark-submit the master is only known now; spark-defaults.conf may set more.
        self.local_master = _check_slots(sc.master, self.options.workers)
        _check_forced(
            {k: effective.get(k) for k in _FORCED if effective.get(k) is not None},
            "the Spark configuration (--conf, spark-defaults.conf or spark-submit)",
        )
        control = ControlAddress()
        if not self.local_master:
            sc.addFile(pipeline)  # executors without the driver's file system
            control = ControlAddress(
                (self.spark_options.control_host or "0.0.0.0", 0),
                self.spark_options.control_host or effective.get("spark.driver.host"),
            )
        elif self.spark_options.control_host:
            control = ControlAddress((self.spark_options.control_host, 0))
        self.spark_start_s = time.monotonic() - started
        log.info(
            "spark master=%s app=%s started in %.1fs",
            sc.master, sc.applicationId, self.spark_start_s,
        )  # fmt: skip
        say(f"Spark {sc.version} on {sc.master} ready in {self.spark_start_s:.1f}s")
        return control

    def close(self) -> None:
        if self.session is not None and self._owns_session:
            self.session.stop()
        self.session = None

    # -- workers ---------------------------------------------------------------------------------

    def _worker_environ(self) -> dict[str, str]:
        """What the tasks add to the executor's environment: eosflow's variables and the job's."""
        env = {k: v for k, v in os.environ.items() if k.startswith("EOSFLOW_")}
        env.update(self.options.environ)
        return env

    def launch(self, specs: list[dict[str, Any]], current: Generation) -> None:
        environ = self._worker_environ()
        # Once per run, before the first barrier job; on a local master too, where it is
        # nearly redundant but costs 0.7 s (docs/spark.md, "The first-task check").
        if self.check_s is None:
            started = time.monotonic()
            sc = self.session.sparkContext
            try:
                self.check_s = check_executors(sc, specs[0], environ, local=self.local_master)
            except ConfigError:
                self._say(f"executor check failed in {time.monotonic() - started:.1f}s")
                raise
            log.info("spark executor check passed in %.2fs", self.check_s)
            self._say(f"executors checked in {self.check_s:.1f}s (Python, eosflow, pipeline)")
        payload = {"specs": specs, "environ": environ}
        group = f"eosflow-{self._name}-g{current.number}"
        self._job = _Job(self.session.sparkContext, group, payload)

    # Local recovery is refused for Spark (SparkRunner): a barrier job restarts as a whole, and
    # dead_worker never names a worker to restart alone.

    def relaunch(self, spec: dict[str, Any], current: Generation) -> None:
        raise NotImplementedError("a Spark barrier job restarts as a whole (--recovery global)")

    def stop_worker(self, index: int) -> None:
        raise NotImplementedError("a Spark barrier job restarts as a whole (--recovery global)")

    def await_exit(self, timeout: float) -> None:
        if self._job is not None and not self._job.done.wait(timeout):
            log.error("the worker job did not end %.0fs after stop; cancelling", timeout)

    def dead_worker(self, current: Generation) -> Failure | None:
        job = self._job
        if job is None:
            return None
        if job.done.is_set():
            return self._cause(job, current), None
        for w in current.workers:
            if w.conn is not None and w.conn.closed:
                # The job fails a moment after its task's connection closed: wait for the cause.
                job.done.wait(5.0)
                if job.done.is_set():
                    return self._cause(job, current), None
                return f"worker {w.index} lost its coordinator connection", None
        return None

    @staticmethod
    def _cause(job: _Job, current: Generation) -> str:
        if job.error is None:
            return f"the worker job ended before the job finished (exit codes {job.codes})"
        cause = spark_cause(job.error)
        m = re.match(r"worker (\d+)", cause)
        if m is not None:  # that worker's own last error line, when its log is readable here
            cause += current.last_error(int(m.group(1)))
        return cause

    def stop_all(self, current: Generation) -> None:
        job = self._job
        if job is None:
            return
        for w in current.workers:  # a worker exits within a batch of losing its coordinator:
            if w.conn is not None:  # much sooner than Spark kills a cancelled task's process
                w.conn.hangup()
        if not job.done.is_set():
            self.session.sparkContext.cancelJobGroup(job.group)
            if not job.done.wait(60.0):
                log.error("job group %s did not end 60s after cancel", job.group)
        # Cancelling ends the job at once; the tasks' Python processes die a moment later. No
        # new generation starts while one of them is still connected (it could still write
        # into a channel after the new generation's marker, see docs/checkpointing.md).
        here = socket.gethostname()
        started = time.monotonic()
        killed = False
        while True:
            alive = [w for w in current.workers if w.conn is not None and not w.conn.closed]
            if not alive:
                break
            waited = time.monotonic() - started
            if not killed and waited > _KILL_AFTER_S:
                killed = True  # a worker on this host that outlived its task: kill it here
                for w in alive:
                    if w.pid and w.host == here:
                        log.warning("worker=%d pid=%d outlived its task: SIGKILL", w.index, w.pid)
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(w.pid, signal.SIGKILL)
            if waited > _DRAIN_S:
                log.error(
                    "workers %s still connected %.0fs after their job was cancelled: starting "
                    "the next generation anyway; check those executors",
                    [(w.index, w.host, w.pid) for w in alive], _DRAIN_S,
                )  # fmt: skip
                break
            time.sleep(0.05)
        self._job = None
