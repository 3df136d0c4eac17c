"""What a run takes and gives: :class:`RunOptions` (and the parsing of what the command line
gives for them: :func:`parse_duration`, :func:`parse_map_state`, :func:`parse_address`),
:class:`Fault`, :class:`RunResult`, :class:`JobFailed`, the runner's view of a worker and of the
current generation of workers, and where a job keeps its files.

Light to import (no worker, no task runtime): the CLI builds its parser from it.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from processor.errors import ConfigError, EosflowError
from processor.runtime.control import Connection

#: Local recovery: the record IDs one task's replay check holds at most, by default
#: (``--recovery-max-ids``; processor.runtime.operators.replay).
DEFAULT_MAX_IDS = 2_000_000

__all__ = [
    "DEFAULT_ADDRESS",
    "DEFAULT_MAX_IDS",
    "FAULT_ACTIONS",
    "FAULT_POINTS",
    "MODES",
    "RECOVERIES",
    "Fault",
    "Generation",
    "JobFailed",
    "RunOptions",
    "RunResult",
    "WorkerHandle",
    "default_snapshot_url",
    "job_dir",
    "jobs_dir",
    "parse_address",
    "parse_duration",
    "parse_map_state",
]

MODES = ("aligned", "unaligned", "sync", "none")
RECOVERIES = ("global", "local")
#: Loopback, the first free port of Flink's Prometheus reporter's range.
DEFAULT_ADDRESS = "127.0.0.1:9249-9258"
#: Where a worker may act on a :class:`Fault` (the worker reaches each in its protocol) ...
FAULT_POINTS = (
    "mid-alignment",
    "before-prepare",
    "after-snapshot-before-ack",
    "after-completion-before-commit",
    "during-recovery",
    "mid-sink-recover",
    "mid-sink-commit",
)
#: ... and what it does there.
FAULT_ACTIONS = ("kill", "hold")


class JobFailed(EosflowError):
    """The job exhausted its restarts (the message holds the last cause)."""


@dataclass(frozen=True)
class Fault:
    """Act on worker ``worker`` the ``nth`` time it reaches ``point``, in start ``attempt``
    (0: the first start, 1: after the first restart...).

    ``action``: ``kill`` (default) SIGKILLs the worker there; ``hold`` pauses it there until
    the test releases it (see :func:`processor.runtime.supervision.worker.hold_paths`), so that a
    test can break the network exactly while a worker sits at a protocol point. Text form:
    ``ATTEMPT:WORKER:POINT[:N][:ACTION]``, e.g. ``0:1:mid-alignment:2:hold``.
    """

    attempt: int
    worker: int
    point: str
    nth: int = 1
    action: str = "kill"

    def __post_init__(self) -> None:
        if self.action not in FAULT_ACTIONS:
            raise ConfigError(f"fault action {self.action!r}: use one of {FAULT_ACTIONS}")

    @classmethod
    def parse(cls, text: str) -> Fault:
        parts = text.split(":")
        action = parts.pop() if len(parts) > 3 and parts[-1] in FAULT_ACTIONS else "kill"
        try:
            attempt, worker, point = int(parts[0]), int(parts[1]), parts[2]
            nth = int(parts[3]) if len(parts) > 3 else 1
            if len(parts) > 4:
                raise ValueError(text)
        except (IndexError, ValueError):
            raise ConfigError(
                f"fault {text!r}: expected ATTEMPT:WORKER:POINT[:N][:ACTION], e.g. "
                f"0:1:mid-alignment:2 or 0:1:mid-alignment:2:hold (ACTION: {FAULT_ACTIONS})"
            ) from None
        if point not in FAULT_POINTS:
            raise ConfigError(f"fault {text!r}: unknown point {point!r}; use one of {FAULT_POINTS}")
        return cls(attempt, worker, point, nth, action)


@dataclass
class RunOptions:
    """How to run a job. Durations in seconds."""

    workers: int = 2
    checkpoint_interval: float = 1.0
    mode: str = "aligned"
    until_idle: bool = False
    #: A bounded run (``until_idle``) ends with the maximum watermark: every window and timer
    #: fires (Flink's ``--drain``), and the job cannot take new input after it. ``False``
    #: (``--no-drain``): it stops at the end offsets with its watermark where the data put it,
    #: so a later run continues it (docs/engine.md, "Bounded runs").
    drain: bool = True
    snapshot_url: str | None = None
    checkpoint_timeout: float = 60.0
    #: A connected worker that sends nothing (not even its heartbeat, every second) for this
    #: long is stuck (stopped, frozen, partitioned away) and is restarted like a dead one.
    heartbeat_timeout: float = 30.0
    #: Checkpoints that may time out in a row before the job restarts (Flink's tolerable
    #: failed checkpoints): a task blocked in a user function still heartbeats, but never acks.
    tolerable_failed_checkpoints: int = 3
    #: A stop (SIGINT/SIGTERM) waits this long for its final checkpoint to commit, then stops
    #: without it (the next run resumes from the last completed checkpoint).
    stop_timeout: float = 120.0
    #: Records a reader must read were deleted by retention: ``fail`` (default) or ``skip``
    #: (counted and logged).
    on_deleted_records: str = "fail"
    keep_checkpoints: int = 3
    #: Restarts allowed within any ``restart_window`` seconds (Flink's failure-rate strategy).
    max_restarts: int = 10
    restart_window: float = 300.0
    restart_backoff: float = 0.5
    max_backoff: float = 10.0
    faults: list[Fault] = field(default_factory=list)
    transport: str = "connectors.transport:from_env"
    #: Variables every worker sees besides the runner's environment (``eosflow run --env``):
    #: the local runner's worker processes get them, and so do the Spark executors (which
    #: otherwise only get the driver's ``EOSFLOW_*`` variables; docs/spark.md).
    environ: dict[str, str] = field(default_factory=dict)
    state_dir: str | None = None
    progress: TextIO | None = None
    progress_every: float = 2.0
    max_records: int = 5000
    #: Records per second each worker's sources read at most (0: no limit): a replay or a
    #: backfill at a bounded pace, and ``eosflow certify``'s fault runs, whose faults must land
    #: while input still flows.
    max_rate: float = 0.0
    #: Watermark alignment (seconds of event time; ``None`` or 0: off): a source partition
    #: whose watermark runs this far ahead of the slowest partition with records to read, in
    #: any source task, is paused until that one catches up, so windows fire during a backfill
    #: and state stays bounded (docs/engine.md, "Watermark alignment"). ``"auto"``: 30 s with
    #: ``max_rate``, off without (reading at full speed, pauses cost throughput and, measured,
    #: bounded no state: bench/RESULTS.md, "Backfills and watermark alignment").
    watermark_alignment: float | str | None = "auto"
    log_level: str = "INFO"
    #: ``global``: every worker restarts from the latest completed checkpoint; ``local``: only
    #: the failed one (docs/local-recovery.md).
    recovery: str = "global"
    #: Local recovery: the record IDs one task's replay check may hold (in memory, about 90
    #: bytes each) while checkpoints have not released them; more recovers the job globally
    #: (processor.runtime.operators.replay).
    recovery_max_ids: int = DEFAULT_MAX_IDS
    #: Where the runner serves the job page, ``/api/job`` and Prometheus ``/metrics``:
    #: ``HOST:PORT``, ``HOST:FIRST-LAST`` (the first free port) or ``off``; ``None``: the
    #: ``EOSFLOW_METRICS`` variable, else ``127.0.0.1:9249-9258`` (docs/observability.md).
    metrics: str | None = None
    #: Restore this savepoint (a directory ``eosflow savepoint`` printed) before starting
    #: (processor/runtime/shape/savepoints.py); ``allow_rewind``: even when the job completed
    #: later checkpoints since (deleted), whose output is then committed again.
    from_savepoint: str | None = None
    allow_rewind: bool = False
    #: ``--map-state OLD=NEW``: restore the checkpoint's state of step OLD (no longer in the
    #: pipeline) into NEW, a stateful step of the same kind
    #: (:mod:`processor.runtime.operators.state_map`).
    map_state: dict[str, str] = field(default_factory=dict)
    #: ``--allow-dropped-state``: restore a checkpoint holding state of steps the pipeline no
    #: longer has, dropping it (logged); without it such a restore is refused.
    allow_dropped_state: bool = False
    #: ``--start-over``: start although the job's consumer group holds offsets that its state
    #: does not account for (no checkpoint: the state was lost; an older one: a stale copy),
    #: replacing them; the output since is committed again (runtime.identity).
    start_over: bool = False
    #: ``--force``: ``--start-over`` even while another runner holds the job (fencing it).
    force: bool = False
    #: ``--takeover``: a runner that holds the job now is asked to stop at a savepoint, and
    #: this run starts from it (:mod:`processor.runtime.supervision.takeover`), waiting at most
    #: ``takeover_timeout`` seconds.
    takeover: bool = False
    takeover_timeout: float = 120.0

    def rewinds(self) -> bool:
        """Whether this start restores a savepoint on purpose (``--from-savepoint``): the job's
        consumer group may then be ahead of it, and the output since is committed again, as
        asked. A takeover's savepoint (set here by ``--takeover``) is the holder's last state: a
        group ahead of it means another runner went on from newer state meanwhile, so the start
        is refused as any stale state is (:mod:`processor.runtime.supervision.identity`)."""
        return self.from_savepoint is not None and not self.takeover

    def watermark_drift_ms(self) -> int | None:
        """:attr:`watermark_alignment` in ms, ``None`` when off."""
        drift = self.watermark_alignment
        if drift == "auto":
            drift = AUTO_ALIGNMENT_S if self.max_rate > 0 else None
        return None if not drift else int(float(drift) * 1000)

    def metrics_address(self) -> str | None:
        """The address to serve on, ``None`` for off (checked: a bad one is a ConfigError)."""
        text = self.metrics or os.environ.get("EOSFLOW_METRICS") or DEFAULT_ADDRESS
        return text if parse_address(text) is not None else None

    @staticmethod
    def parse_env(items: list[str], environ: dict[str, str] | None = None) -> dict[str, str]:
        """``--env NAME=VALUE`` and ``--env NAME`` (this process's value; ``environ`` stands
        for ``os.environ`` in tests) as :attr:`environ` entries."""
        here = os.environ if environ is None else environ
        env: dict[str, str] = {}
        for item in items:
            name, sep, value = item.partition("=")
            name = name.strip()
            if not name or any(c.isspace() for c in name):
                raise ConfigError(f"--env {item!r}: expected NAME or NAME=VALUE, e.g. CHAOS_IN")
            if not sep:
                if name not in here:
                    raise ConfigError(
                        f"--env {name}: {name} is not set here, so there is no value to forward: "
                        f"set it, or give one with --env {name}=VALUE"
                    )
                value = here[name]
            env[name] = value
        return env

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode {self.mode!r}: choose one of {MODES}")
        if self.max_rate < 0:
            raise ConfigError(f"--max-rate must be 0 (no limit) or positive, got {self.max_rate}")
        drift = self.watermark_alignment
        if drift not in (None, "auto") and not (
            isinstance(drift, int | float) and not isinstance(drift, bool) and drift >= 0
        ):
            raise ConfigError(
                "--watermark-alignment must be a positive duration of event time (e.g. 30s), "
                f"auto or off, got {drift!r}"
            )
        if self.workers < 1:
            raise ConfigError(f"workers must be at least 1, got {self.workers}")
        if self.checkpoint_interval <= 0:
            raise ConfigError(
                f"checkpoint interval must be positive, got {self.checkpoint_interval}s"
            )
        if self.checkpoint_timeout <= self.checkpoint_interval / 10:
            raise ConfigError(
                f"--checkpoint-timeout {self.checkpoint_timeout:g}s is too short for "
                f"--checkpoint-interval {self.checkpoint_interval:g}s: a checkpoint may take up "
                "to a tenth of the interval or more. Raise --checkpoint-timeout above "
                f"{self.checkpoint_interval / 10:g}s, or shorten the interval"
            )
        if self.heartbeat_timeout < 2:
            raise ConfigError(
                f"heartbeat timeout must be at least 2s (workers beat every second), got "
                f"{self.heartbeat_timeout}s"
            )
        if self.restart_window <= 0 or self.max_restarts < 0:
            raise ConfigError(
                f"--max-restarts must be 0 or more and --restart-window positive, got "
                f"{self.max_restarts} and {self.restart_window}s"
            )
        if self.stop_timeout <= 0:
            raise ConfigError(f"--stop-timeout must be positive, got {self.stop_timeout}s")
        if self.takeover and (self.start_over or self.from_savepoint):
            raise ConfigError(
                "--takeover starts from the running job's own savepoint: drop --start-over and "
                "--from-savepoint (or drop --takeover)"
            )
        if self.takeover_timeout <= 0:
            raise ConfigError(f"--takeover-timeout must be positive, got {self.takeover_timeout}s")
        if self.tolerable_failed_checkpoints < 0:
            raise ConfigError(
                "tolerable failed checkpoints must be 0 or more, got "
                f"{self.tolerable_failed_checkpoints}"
            )
        if self.on_deleted_records not in ("fail", "skip"):
            raise ConfigError(
                f"on_deleted_records {self.on_deleted_records!r}: choose 'fail' or 'skip'"
            )
        if self.recovery not in RECOVERIES:
            raise ConfigError(f"recovery {self.recovery!r}: choose one of {RECOVERIES}")
        if self.recovery == "local" and self.mode in ("sync", "none"):
            raise ConfigError(
                f"--recovery local needs checkpoints in aligned or unaligned mode, not "
                f"--mode {self.mode}: a restarted worker restores the latest completed one"
            )
        self.metrics_address()
        if self.recovery_max_ids < 1000:
            raise ConfigError(
                f"--recovery-max-ids {self.recovery_max_ids}: a task's replay check must hold at "
                "least the records of one checkpoint interval; give 1000 or more (default "
                f"{DEFAULT_MAX_IDS:,})"
            )
        _check_map_state(self.map_state)


def parse_map_state(texts: list[str]) -> dict[str, str]:
    """``["OLD=NEW", ...]`` (``--map-state``, repeatable) as a dict.

    Raises:
        ConfigError: a text without ``=``, an empty name, a step mapped twice or two steps
            mapped onto one.
    """
    mapping: dict[str, str] = {}
    for text in texts:
        old, sep, new = (part.strip() for part in text.partition("="))
        if not sep or not old or not new:
            raise ConfigError(f"--map-state {text!r}: expected OLD=NEW (two step names)")
        if old in mapping:
            raise ConfigError(
                f"--map-state: step {old!r} is mapped twice ({old}={mapping[old]} and {text}); "
                "a step's state goes to one step"
            )
        mapping[old] = new
    _check_map_state(mapping)
    return mapping


def _check_map_state(mapping: dict[str, str]) -> None:
    same = sorted(old for old, new in mapping.items() if old == new)
    if same:
        raise ConfigError(f"--map-state: step(s) {same} mapped onto themselves; drop those")
    seen: dict[str, str] = {}
    for old, new in mapping.items():
        if new in seen:
            raise ConfigError(
                f"--map-state: steps {seen[new]!r} and {old!r} are both mapped onto {new!r}; a "
                "step restores the state of one step"
            )
        seen[new] = old


def parse_duration(text: str) -> float:
    """``"500ms"``, ``"1s"``, ``"2m"``, ``"1.5"`` (seconds) -> seconds."""
    units = (("ms", 0.001), ("s", 1.0), ("m", 60.0), ("h", 3600.0))
    raw = text.strip().lower()
    number, factor = raw, 1.0
    for suffix, unit in units:
        if raw.endswith(suffix) and not (suffix == "s" and raw.endswith("ms")):
            number, factor = raw[: -len(suffix)], unit
            break
    try:
        value = float(number) * factor
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration; write e.g. 500ms, 1s, 2m"
        ) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"duration {text!r} must be positive")
    return value


#: ``--watermark-alignment auto`` with ``--max-rate``: the drift, seconds of event time.
AUTO_ALIGNMENT_S = 30.0


def parse_alignment(text: str) -> float | str | None:
    """``--watermark-alignment``: a duration in seconds, ``auto``, or ``off``: ``None``."""
    word = text.strip().lower()
    if word in ("off", "none", "no", "false", "0"):
        return None
    if word == "auto":
        return "auto"
    return parse_duration(text)


def parse_address(text: str) -> tuple[str, list[int]] | None:
    """``HOST:PORT`` or ``HOST:FIRST-LAST`` (the first free port), ``off``: ``None``."""
    if text.strip().lower() in ("off", "none", "no", "false", "0"):
        return None
    host, sep, ports = text.rpartition(":")
    try:
        if not sep or not host:
            raise ValueError(text)
        first, _, last = ports.partition("-")
        lo, hi = int(first), int(last or first)
        if not (0 <= lo <= hi <= 65535) or (lo == 0 and hi != 0):
            raise ValueError(text)
    except ValueError:
        raise ConfigError(
            f"metrics address {text!r}: expected HOST:PORT, HOST:FIRST-LAST (the first free "
            "port of the range) or 'off', e.g. 127.0.0.1:9249 or 0.0.0.0:9249-9258"
        ) from None
    return host.strip("[]"), list(range(lo, hi + 1))


@dataclass
class RunResult:
    job: str
    generation: int
    restarts: int
    checkpoints: int
    last_checkpoint: int
    records_in: int
    records_out: int
    seconds: float
    restart_causes: list[str]
    checkpoint_durations: list[float]
    ready_s: float  # start-up: from run() until every worker of the first generation connected
    # until the final checkpoint was triggered (input drained, or stop requested); the rest of
    # ``seconds`` is that checkpoint, its commits and the workers' exit
    final_trigger_s: float = float("nan")
    #: loops: (checkpoint id, back-edge log records, duration s) of the completed checkpoints
    loop_logs: list[tuple[int, int, float]] = field(default_factory=list)
    #: bytes of the largest completed checkpoint (the job's peak state as checkpoints saw it)
    peak_checkpoint_bytes: int = 0
    #: records the sinks committed in this run: each epoch once, when its checkpoint
    #: completed (``records_out`` also counts what restarts wrote again)
    records_committed: int = 0


def jobs_dir(state: str | None = None) -> Path:
    """Where jobs keep status, worker logs and (by default) checkpoints."""
    if state:
        return Path(state) / "jobs"
    # here, not at the top: the embedded servers' package is 12 ms of every worker's start
    from processor.embedded.cluster import state_dir

    return state_dir() / "jobs"


def job_dir(job: str, state: str | None = None) -> Path:
    return jobs_dir(state) / job


def default_snapshot_url(job: str, state: str | None = None) -> str:
    """Where a job keeps its checkpoints unless ``--snapshot-url`` says otherwise."""
    return (job_dir(job, state) / "checkpoints").resolve().as_uri()


@dataclass
class WorkerHandle:
    """The runner's view of one worker of the current generation."""

    index: int
    pid: int | None = None  # the worker's process id (from its hello on Spark)
    host: str | None = None
    conn: Connection | None = None
    drained: bool = False
    stats: dict[str, Any] = field(default_factory=dict)
    #: the worker's clock (epoch seconds) when it took :attr:`stats`
    stats_at: float = 0.0
    last_seen: float = 0.0  # monotonic time of its last message (heartbeats included)
    #: What it waits on, from its last heartbeat (:mod:`processor.runtime.waits`), and when
    #: that heartbeat came (monotonic).
    waits: list[dict[str, Any]] = field(default_factory=list)
    waits_at: float = 0.0
    #: When the local runner started its process (monotonic; ``None`` on Spark, whose executor
    #: check and barrier job say why a worker does not come): a worker that has not said hello
    #: since is shown waiting on its start (``tally.waits``).
    started: float | None = None


class Generation:
    """The current generation of workers: its number, the workers' handles and where this
    generation's lines start in their log files (shared by every generation).

    The one piece of state the runner's collaborators share: the supervisor
    (:mod:`processor.runtime.supervision.recovery`) starts generations and replaces a worker; the
    control plane admits workers into their handles; the worker launcher sets their pids and reads
    their connections; the reporter reads their counters.
    """

    def __init__(self, run_dir: Path, count: int) -> None:
        self.dir = run_dir
        self.count = count
        self.number = 0
        self.workers: list[WorkerHandle] = []
        self._log_offsets: list[int] = []

    def log_path(self, worker: int) -> Path:
        return self.dir / f"worker-{worker}.log"

    def begin(self) -> None:
        """Fresh handles for generation :attr:`number`; its log lines start here."""
        self.workers = [WorkerHandle(i) for i in range(self.count)]
        self._log_offsets = [self._log_size(i) for i in range(self.count)]

    def restart(self, worker: int) -> None:
        """A fresh handle for ``worker`` alone (local recovery), its log lines starting here."""
        self.workers[worker] = WorkerHandle(worker)
        self._log_offsets[worker] = self._log_size(worker)

    def connected(self) -> bool:
        """Every worker of the generation said hello."""
        return all(w.conn is not None for w in self.workers)

    def last_error(self, worker: int) -> str:
        """`` (the last ERROR/CRITICAL message)`` this generation logged for ``worker``, if its
        log is readable here (always on the local runner; on Spark when the file system is
        shared), else ``""``."""
        try:
            with open(self.log_path(worker), "rb") as f:
                f.seek(self._log_offsets[worker])
                text = f.read().decode(errors="replace")
        except (OSError, IndexError):
            return ""
        tail = [ln for ln in text.splitlines()[-200:] if "ERROR" in ln or "CRITICAL" in ln]
        return f" ({tail[-1].split(': ', 1)[-1]})" if tail else ""

    def _log_size(self, worker: int) -> int:
        path = self.log_path(worker)
        return path.stat().st_size if path.exists() else 0
