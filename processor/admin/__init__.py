"""Job administration as a library: what ``eosflow jobs|status|reset|savepoint|txn`` do, for a
user's own tooling and for tests (Flink's ``ClusterClient``, Kafka's ``Admin``).

A job is known by its directory under the state directory (``$EOSFLOW_STATE_DIR/jobs/<job>``:
``status.json``, worker logs) and by its snapshot store (checkpoints, generation, start
positions, lease; :mod:`processor.snapshot.lease`). :class:`JobAdmin` reads and changes both,
and the job's Kafka side (internal topics, the transactional ids of its Kafka sinks) and Redis
keys. It returns values and raises :mod:`processor.errors`; it prints nothing (the CLI,
:mod:`processor.cli_jobs`, renders what it returns)::

    from processor.admin import JobAdmin

    admin = JobAdmin()                      # $EOSFLOW_STATE_DIR, Kafka and Redis from the env
    for job in admin.list_jobs():
        print(job.job, job.state, job.last_checkpoint)
    admin.reset("clicks", pipeline="clicks.py")   # refused (JobRunningError) while it runs
"""

from processor.admin.jobs import JobAdmin, pid_alive
from processor.admin.values import (
    FencedSink,
    JobStatus,
    JobSummary,
    PendingEpoch,
    ResetPlan,
    ResetResult,
    Savepoint,
    SinkTransactions,
    TransactionalSinks,
    WorkerStatus,
)

__all__ = [
    "FencedSink",
    "JobAdmin",
    "JobStatus",
    "JobSummary",
    "PendingEpoch",
    "ResetPlan",
    "ResetResult",
    "Savepoint",
    "SinkTransactions",
    "TransactionalSinks",
    "WorkerStatus",
    "pid_alive",
]
