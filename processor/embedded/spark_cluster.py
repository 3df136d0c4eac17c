"""A Spark standalone cluster from the installed ``pyspark`` package: a master and N workers,
each its own JVM, started on an address of this machine (as the embedded Kafka and Redis are).

The ``pyspark`` wheel carries Spark's jars and ``spark-class``; its launcher
(``org.apache.spark.launcher.Main``, what ``spark-class`` runs) builds each daemon's Java
command line (class path, the ``--add-opens`` Java 17 needs), and the daemon is then started
directly, so its PID is the JVM's: a test can SIGKILL a worker JVM, or the executor JVM that
runs a given Python worker (:meth:`SparkCluster.worker_of`, :meth:`SparkCluster.executor_of`).

A worker may run in a network namespace (``netns``: a separate host with its own address, see
:mod:`processor.testing.hosts`); the master then listens on an address the namespaces reach.

Readiness is the master's own view: its status JSON (the web UI's ``/json/``) lists the
workers ``ALIVE``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from processor.embedded._process import ServerProcess, free_port, is_running, spawn, stop
from processor.errors import InfrastructureError, ServerNotFoundError

__all__ = ["SparkCluster", "SparkWorker", "spark_home", "start_spark_cluster"]

log = logging.getLogger(__name__)

_MASTER = "org.apache.spark.deploy.master.Master"
_WORKER = "org.apache.spark.deploy.worker.Worker"
_EXECUTOR = "CoarseGrainedExecutorBackend"
_START_TIMEOUT = 90.0  # JVMs on a loaded 2-core machine


def spark_home() -> Path:
    """The Spark distribution inside the installed ``pyspark`` package.

    Raises:
        ServerNotFoundError: no ``pyspark``, or no Java to run it, with the fix.
    """
    try:
        import pyspark
    except ImportError as exc:
        raise ServerNotFoundError("pyspark is not installed. Fix: pip install eosflow") from exc
    home = Path(pyspark.__file__).parent
    if not (home / "jars").is_dir():
        raise ServerNotFoundError(f"{home} has no jars/: reinstall pyspark (pip install pyspark)")
    if _java() is None:
        raise ServerNotFoundError(
            "no Java to run Spark: install OpenJDK 17 (apt-get install openjdk-17-jre-headless) "
            "or set JAVA_HOME"
        )
    return home


def _java() -> str | None:
    java_home = os.environ.get("JAVA_HOME")
    if java_home and os.access(Path(java_home, "bin", "java"), os.X_OK):
        return str(Path(java_home, "bin", "java"))
    return shutil.which("java")


def _output(argv: list[str], env: dict[str, str], what: str) -> bytes:
    """``argv``'s standard output; :class:`InfrastructureError` with its stderr if it fails."""
    out = subprocess.run(argv, env=env, capture_output=True, timeout=60, check=False)
    if out.returncode != 0:
        raise InfrastructureError(f"{what} failed: {out.stderr.decode(errors='replace')}")
    return out.stdout


@functools.cache
def _spark_env(home: Path) -> tuple[tuple[str, str], ...]:
    """What ``load-spark-env.sh`` sets (``SPARK_SCALA_VERSION``, ``conf/spark-env.sh``): the
    daemons need it too (a worker builds its executors' command line with the launcher)."""
    stdout = _output(
        ["bash", "-c", '. "$SPARK_HOME/bin/load-spark-env.sh" >/dev/null && env -0'],
        {**os.environ, "SPARK_HOME": str(home)},
        f"{home}/bin/load-spark-env.sh",
    )
    pairs = (item.decode().partition("=") for item in stdout.split(b"\0") if item)
    return tuple((k, v) for k, _, v in pairs if k.startswith("SPARK_"))


@functools.cache
def _command(home: Path, main_class: str) -> tuple[str, ...]:
    """The Java command line ``spark-class main_class`` would exec (no arguments yet)."""
    java = _java()
    assert java is not None
    stdout = _output(
        [java, "-Xmx128m", "-cp", f"{home}/jars/*", "org.apache.spark.launcher.Main", main_class],
        {**os.environ, **dict(_spark_env(home))},
        f"Spark's launcher for {main_class}",
    )
    # The launcher's output to spark-class: a NUL, then the NUL-terminated words.
    words = [w.decode().strip("\n") for w in stdout.split(b"\0")[1:]]
    return tuple(w for w in words if w)


def _daemon(home: Path, main_class: str, settings: tuple[str, ...]) -> list[str]:
    """The daemon's command line with ``-Dkey=value`` ``settings`` before its class."""
    command = list(_command(home, main_class))
    at = command.index(main_class)
    return [*command[:at], *settings, *command[at:]]


@dataclass
class SparkWorker:
    """One worker JVM: its process, its host address and its network namespace."""

    index: int
    process: ServerProcess
    host: str
    cores: int
    workdir: Path
    netns: str | None = None


@dataclass
class SparkCluster:
    """A running standalone cluster. Stop it with :meth:`stop` (or use it as a context)."""

    master_url: str
    master: ServerProcess
    ui_url: str
    workers: list[SparkWorker]
    workdir: Path
    host: str
    startup_seconds: float
    home: Path
    memory: str = "2g"
    owned: bool = True
    settings: tuple[str, ...] = ()

    # -- what the master sees ---------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The master's status JSON: ``workers`` (with ``state``), ``activeapps``, ..."""
        with urllib.request.urlopen(f"{self.ui_url}/json/", timeout=5) as answer:
            found: dict[str, Any] = json.load(answer)
        return found

    def alive_workers(self) -> int:
        return sum(1 for w in self.state().get("workers", []) if w.get("state") == "ALIVE")

    def wait_alive(self, count: int, timeout: float = _START_TIMEOUT) -> float:
        """Waits until the master counts ``count`` ALIVE workers; returns the seconds it took."""
        started = time.monotonic()
        seen = -1
        while time.monotonic() - started < timeout and is_running(self.master):
            with contextlib.suppress(OSError, ValueError):
                seen = self.alive_workers()
                if seen == count:
                    return time.monotonic() - started
            time.sleep(0.2)
        tails = "\n".join(f"-- worker {w.index}:\n{w.process.log_tail(8)}" for w in self.workers)
        raise InfrastructureError(
            f"the Spark master counted {seen} ALIVE workers, not {count}, after {timeout:.0f}s; "
            f"master log:\n{self.master.log_tail(8)}\n{tails}"
        )

    # -- faults -------------------------------------------------------------------------------
    def executors(self) -> list[int]:
        """PIDs of the executor JVMs this cluster's workers started (their working directories
        are under the cluster's)."""
        return [
            pid
            for pid in _pids()
            if _EXECUTOR in " ".join(_cmdline(pid)) and _cwd(pid).startswith(f"{self.workdir}/")
        ]

    def executor_of(self, pid: int) -> int | None:
        """The executor JVM that ``pid`` (a Python worker of a task) runs under: what a test's
        :class:`~processor.testing.Killer` SIGKILLs with ``target=cluster.executor_of``."""
        return _ancestor(pid, lambda p: _EXECUTOR in " ".join(_cmdline(p)))

    def worker_of(self, pid: int) -> SparkWorker | None:
        """The worker whose JVM ``pid`` (a task's Python process) runs under."""
        by_pid = {w.process.pid: w for w in self.workers}
        found = _ancestor(pid, by_pid.__contains__)
        return by_pid.get(found) if found is not None else None

    def restart_worker(self, index: int) -> float:
        """Starts worker ``index`` again (after its JVM was killed); returns the seconds until
        the master counted every worker ALIVE."""
        old = self.workers[index]
        stop(old.process)  # reaps it if it is dead already
        self.workers[index] = _start_worker(
            self.home, self.master_url, index, old.host, old.cores, self.memory, self.workdir,
            old.netns, owned=self.owned, settings=self.settings,
        )  # fmt: skip
        return self.wait_alive(len(self.workers))

    # -- life -----------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stops the workers (their executors with them) and the master; removes the work
        directory."""
        for worker in self.workers:
            stop(worker.process, timeout=5.0)
        stop(self.master, timeout=5.0)
        for pid in self.executors():  # one whose worker JVM was SIGKILLed alone may linger
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> SparkCluster:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _cwd(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return ""


def _ancestor(pid: int, found: Callable[[int], bool]) -> int | None:
    """The nearest ancestor of ``pid`` (itself included) for which ``found`` holds."""
    current: int | None = pid
    for _ in range(20):
        if current is None or current <= 1:
            return None
        if found(current):
            return current
        current = _parent(current)
    return None


def _env(home: Path, host: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARK_", "PYSPARK_"))}
    env.update(_spark_env(home))
    env.update(SPARK_LOCAL_IP=host, SPARK_NO_DAEMONIZE="1")
    return env


def _start_worker(
    home: Path,
    master_url: str,
    index: int,
    host: str,
    cores: int,
    memory: str,
    workdir: Path,
    netns: str | None,
    *,
    owned: bool,
    settings: tuple[str, ...] = (),
) -> SparkWorker:
    here = workdir / f"worker-{index}"
    here.mkdir(parents=True, exist_ok=True)
    argv = [
        *_daemon(home, _WORKER, settings), master_url,
        "--host", host, "--cores", str(cores), "--memory", memory,
        "--webui-port", "0", "--work-dir", str(here / "work"),
    ]  # fmt: skip
    process = spawn(
        f"spark-worker-{index}", argv, log_path=here / "worker.log", owned=owned,
        env=_env(home, host), cwd=here, netns=netns,
    )  # fmt: skip
    return SparkWorker(index, process, host, cores, here, netns)


def start_spark_cluster(
    workers: int = 2,
    *,
    cores: int = 1,
    memory: str = "2g",
    host: str = "127.0.0.1",
    worker_hosts: list[tuple[str, str | None]] | None = None,
    workdir: Path | None = None,
    owned: bool = True,
    conf: dict[str, str] | None = None,
) -> SparkCluster:
    """Starts a master on ``host`` and ``workers`` worker JVMs with ``cores`` cores and
    ``memory`` each; waits until the master counts them ALIVE.

    ``worker_hosts``: per worker, ``(address, network namespace)`` (default: ``host``, this
    namespace); the master must then listen on a ``host`` those namespaces reach.
    ``owned``: the JVMs die with this process (the default; see
    :mod:`processor.embedded._process`). ``conf``: settings of the master and worker JVMs
    (e.g. ``spark.worker.timeout``, the seconds before the master drops a silent worker, which
    also sets how often the workers send heartbeats: a quarter of it; default 60).

    Raises:
        ServerNotFoundError: no pyspark or no Java.
        InfrastructureError: a JVM exited or the workers did not register in time.
    """
    home = spark_home()
    started = time.monotonic()
    workdir = Path(workdir or tempfile.mkdtemp(prefix="eosflow-spark-"))
    workdir.mkdir(parents=True, exist_ok=True)
    port, ui_port = free_port(), free_port()
    settings = tuple(f"-D{key}={value}" for key, value in (conf or {}).items())
    argv = [
        *_daemon(home, _MASTER, settings),
        "--host", host, "--port", str(port), "--webui-port", str(ui_port),
    ]  # fmt: skip
    master = spawn(
        "spark-master", argv, log_path=workdir / "master.log", owned=owned,
        env=_env(home, host), cwd=workdir,
    )  # fmt: skip
    master_url = f"spark://{host}:{port}"
    hosts = worker_hosts or [(host, None)] * workers
    cluster = SparkCluster(
        master_url, master, f"http://{host}:{ui_port}", [], workdir, host, 0.0, home, memory,
        owned, settings,
    )  # fmt: skip
    try:
        for index, (address, netns) in enumerate(hosts):
            cluster.workers.append(
                _start_worker(
                    home,
                    master_url,
                    index,
                    address,
                    cores,
                    memory,
                    workdir,
                    netns,
                    owned=owned,
                    settings=settings,
                )
            )
        cluster.wait_alive(len(hosts))
    except BaseException:
        cluster.stop()
        raise
    cluster.startup_seconds = time.monotonic() - started
    log.info(
        "spark cluster %s: %d workers x %d cores ready in %.1fs",
        master_url, len(hosts), cores, cluster.startup_seconds,
    )  # fmt: skip
    return cluster
