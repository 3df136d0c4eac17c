"""The values :class:`processor.admin.JobAdmin` returns: frozen dataclasses, no I/O."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "FencedSink",
    "JobStatus",
    "JobSummary",
    "PendingEpoch",
    "ResetPlan",
    "ResetResult",
    "Savepoint",
    "SinkTransactions",
    "TransactionalSinks",
    "WorkerStatus",
]


@dataclass(frozen=True)
class WorkerStatus:
    """One worker of a job, as its ``status.json`` records it and this host sees it.

    Attributes:
        state: ``alive, connected``, ``alive, not connected`` or ``dead`` for a worker on this
            host; ``connected`` or ``not connected`` on another (Spark); ``stopped`` when the
            job does not run.
    """

    worker: int
    pid: int | None
    host: str | None
    state: str


@dataclass(frozen=True)
class JobStatus:
    """A job's progress (``eosflow status``).

    Attributes:
        job: the job's name.
        state: the state the runner recorded (``running``, ``finished``, ``failed``, ...).
        alive: the runner is running, on this host.
        updated_ms: when the runner last wrote the status.
        workers: its workers, with their state seen from here.
        path: the ``status.json`` read.
        data: the whole ``status.json`` (checkpoint, records, generation, restarts, ...), each
            worker with its ``state``.
    """

    job: str
    state: str
    alive: bool
    updated_ms: int
    workers: tuple[WorkerStatus, ...]
    path: Path
    data: Mapping[str, Any]

    def as_dict(self) -> dict[str, Any]:
        """``status.json`` plus ``alive`` (``eosflow status --json``)."""
        return {**self.data, "alive": self.alive}


@dataclass(frozen=True)
class JobSummary:
    """One job recorded under the state directory (``eosflow jobs``).

    Attributes:
        state: ``running``; ``died`` (recorded running, its runner gone); ``never ran`` (no
            status); else the state its runner recorded last.
        last_checkpoint, last_checkpoint_ms: the newest completed checkpoint and when it was
            taken (``None``: none).
        drained: a bounded run drained its watermark: the job takes no new input.
        records_out, runner_pid: from its status (``None``: never ran).
    """

    job: str
    state: str
    snapshot_url: str
    last_checkpoint: int | None
    last_checkpoint_ms: int | None
    drained: bool
    records_out: int | None
    runner_pid: int | None


@dataclass(frozen=True)
class Savepoint:
    """A savepoint written (``eosflow savepoint``).

    Attributes:
        path: where it is (``eosflow run --from-savepoint PATH``).
        checkpoint_id: the stopped job's checkpoint copied; ``None`` when the running job took
            it.
    """

    job: str
    path: str
    checkpoint_id: int | None


@dataclass(frozen=True)
class ResetPlan:
    """What :meth:`JobAdmin.reset` deletes, shown before it does."""

    job: str
    snapshot_url: str
    directory: Path
    topic_prefix: str
    topics: tuple[str, ...]
    pipeline: str | None
    #: the job's consumer group (its sources' committed offsets, the job's history in Kafka)
    group: str = ""
    #: what the pipeline's sinks keep of the job's runs (a lakehouse table's record of its
    #: last checkpoint, PostgreSQL prepared transactions and markers), a line each; cleared
    #: by the reset (given the pipeline)
    sink_records: tuple[str, ...] = ()


@dataclass(frozen=True)
class FencedSink:
    """A transactional Kafka sink step whose ids were fenced (their open transactions abort)."""

    step: str
    transactional_ids: tuple[str, ...]


@dataclass(frozen=True)
class ResetResult:
    """What :meth:`JobAdmin.reset` deleted.

    Attributes:
        redis_keys: the Redis keys deleted; ``None`` when no Redis is set.
        group: the consumer group deleted (its committed offsets), ``None`` if it had none.
    """

    job: str
    fenced: tuple[FencedSink, ...]
    checkpoints: int
    topics: tuple[str, ...]
    redis_keys: int | None
    group: str | None = None
    #: what the reset cleared in the pipeline's sinks (:attr:`ResetPlan.sink_records`)
    sink_records: tuple[str, ...] = ()


@dataclass(frozen=True)
class TransactionalSinks:
    """A pipeline's job name and its transactional Kafka sink steps (its file is run once)."""

    job: str
    pipeline: str
    steps: tuple[Any, ...]


@dataclass(frozen=True)
class PendingEpoch:
    """A sink epoch of the latest completed checkpoint, committed or re-published when the job
    next starts."""

    task: str
    epoch: int
    checkpoint: int
    transactional_id: str
    records: int


@dataclass(frozen=True)
class SinkTransactions:
    """A transactional Kafka sink step's ids, commit markers and pending epochs
    (``eosflow txn list``).

    Attributes:
        subtask_ids: each sink subtask's pool of ``transactional.id`` (spare slots not shown).
        markers: every commit marker, oldest first.
        checkpoint_id: the latest completed checkpoint (``None``: none, nothing pending).
    """

    job: str
    step: str
    topic: str
    subtask_ids: tuple[tuple[str, ...], ...]
    markers: tuple[dict[str, Any], ...]
    checkpoint_id: int | None
    pending: tuple[PendingEpoch, ...]
