"""What :class:`JobAdmin` does: reads and changes jobs' status files, snapshot stores, internal
topics, Kafka sinks' transactional ids and Redis keys (see :mod:`processor.admin`)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
from processor.errors import JobNotFoundError, JobRunningError
from processor.runtime.job import default_snapshot_url, job_dir, jobs_dir
from processor.snapshot.lease import JobLease
from processor.snapshot.store import SnapshotStore
from processor.wire import job_topic_prefix

if TYPE_CHECKING:
    from connectors import KafkaSettings

__all__ = ["JobAdmin", "pid_alive"]


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs on this host (a zombie, killed but not reaped yet, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc (macOS): kill(0) is all there is
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


class JobAdmin:
    """Administration of the jobs recorded under a state directory.

    Args:
        state_dir: the state directory (default: ``$EOSFLOW_STATE_DIR``, else eosflow's).
        kafka: the broker of the jobs' internal topics and Kafka sinks (default:
            ``KafkaSettings.from_env()`` at each call).
        redis_url: the Redis of their dedup and record IDs (default: ``$EOSFLOW_REDIS_URL`` at
            each call; none: nothing to delete there).

    A job's snapshot store is the URL its last run recorded in its status, else the default
    under its directory; the methods that take ``snapshot_url`` use that one instead.
    """

    def __init__(
        self,
        state_dir: str | Path | None = None,
        *,
        kafka: KafkaSettings | None = None,
        redis_url: str | None = None,
    ) -> None:
        self._state = str(state_dir) if state_dir is not None else None
        self._kafka = kafka
        self._redis_url = redis_url

    @property
    def jobs_dir(self) -> Path:
        """Where jobs keep status, worker logs and (by default) checkpoints."""
        return jobs_dir(self._state)

    def snapshot_url(self, job: str, snapshot_url: str | None = None) -> str:
        """``snapshot_url``, else the store ``job`` last ran with, else its default."""
        st = _read_status(job_dir(job, self._state) / "status.json") or {}
        return snapshot_url or st.get("snapshot_url") or default_snapshot_url(job, self._state)

    def store(self, job: str, snapshot_url: str | None = None) -> SnapshotStore:
        """The job's snapshot store (see :meth:`snapshot_url`)."""
        return SnapshotStore(self.snapshot_url(job, snapshot_url))

    @contextlib.contextmanager
    def holding(self, job: str, snapshot_url: str | None = None) -> Iterator[SnapshotStore]:
        """Holds ``job``'s lease (the job cannot start meanwhile) and yields its snapshot store.

        Raises:
            JobRunningError: the job is running; the message names its runner.
        """
        store = self.store(job, snapshot_url)
        lease = JobLease(store, job)
        lease.acquire()
        try:
            yield store
        finally:
            lease.release()

    def status(self, job: str | None = None) -> JobStatus:
        """``job``'s status, or the most recently updated job's.

        Raises:
            JobNotFoundError: no job is recorded, or ``job`` has no status.
        """
        base = self.jobs_dir
        if job:
            path = base / job / "status.json"
        else:
            found = sorted(base.glob("*/status.json"), key=lambda p: p.stat().st_mtime)
            if not found:
                raise JobNotFoundError(f"no jobs recorded under {base}")
            path = found[-1]
        st = _read_status(path)
        if st is None:
            raise JobNotFoundError(f"no status for job {job!r} (looked for {path})")
        alive = _alive(st)
        for w in st["workers"]:
            w["state"] = _worker_state(w, alive)
        workers = tuple(
            WorkerStatus(w["worker"], w.get("pid"), w.get("host"), w["state"])
            for w in st["workers"]
        )
        return JobStatus(st["job"], st["state"], alive, st["updated_ms"], workers, path, st)

    def list_jobs(self) -> list[JobSummary]:
        """Every job recorded under the state directory, by name: state, last checkpoint."""
        rows = []
        for directory in sorted(p for p in self.jobs_dir.glob("*") if p.is_dir()):
            st = _read_status(directory / "status.json") or {}
            job = directory.name
            url = st.get("snapshot_url") or default_snapshot_url(job, self._state)
            latest = SnapshotStore(url).latest_completed(job)
            if not st:
                state = "never ran"
            elif _alive(st):
                state = "running"
            else:
                state = st["state"] if st["state"] != "running" else "died"
            # a bounded run drained its watermark: the job takes no new input
            # (runtime.checkpoints.drain)
            drained = latest is not None and latest.metadata.get("drained") is not None
            rows.append(
                JobSummary(
                    job=job,
                    state=state,
                    snapshot_url=url,
                    last_checkpoint=None if latest is None else latest.checkpoint_id,
                    last_checkpoint_ms=None if latest is None else latest.created_ms,
                    drained=drained,
                    records_out=st["records_out"] if st else None,
                    runner_pid=st.get("pid"),
                )
            )
        return rows

    def savepoint(
        self,
        job: str,
        *,
        stop: bool = False,
        path: str | None = None,
        timeout: float = 300.0,
        snapshot_url: str | None = None,
    ) -> Savepoint:
        """A running job's savepoint (an aligned checkpoint it takes now; ``stop``: it stops
        after it), or a stopped job's newest completed checkpoint, copied where retention keeps
        it (``path``, default ``<snapshot store>/_savepoints/<job>/``).

        Raises:
            JobNotFoundError: the job is stopped and has no completed checkpoint.
            ConfigError: the checkpoint is unaligned, or the running job answered with an error
                or not within ``timeout`` seconds.
        """
        try:
            return self.copy_checkpoint(job, path=path, snapshot_url=snapshot_url)
        except JobRunningError:
            return self.request_savepoint(
                job, stop=stop, path=path, timeout=timeout, snapshot_url=snapshot_url
            )

    def copy_checkpoint(
        self,
        job: str,
        *,
        path: str | None = None,
        snapshot_url: str | None = None,
        redis_url: Callable[[str], str | None] | None = None,
    ) -> Savepoint:
        """The stopped job's newest completed checkpoint, copied as a savepoint;
        ``redis_url(step)``: each dedup step's Redis (default: this admin's, the same for all).

        Raises:
            JobRunningError: the job is running (see :meth:`request_savepoint`).
            JobNotFoundError: it has no completed checkpoint.
            ConfigError: that checkpoint is unaligned.
        """
        from processor.runtime.shape.savepoints import final_committed, write_savepoint

        url = self.snapshot_url(job, snapshot_url)
        with self.holding(job, url) as store:  # stopped: nothing can change its checkpoints
            latest = store.latest_completed(job)
            if latest is None:
                raise JobNotFoundError(f"job {job!r} has no completed checkpoint in {url}")
            # its sinks committed it (a clean stop's final checkpoint): a restore after a reset,
            # whose commit markers are gone, must not publish its last epoch again
            committed = final_committed(store, job) == latest.checkpoint_id
            written = write_savepoint(
                store,
                latest,
                path=_where(path),
                redis_url=redis_url or self._redis,
                committed=committed,
            )
        return Savepoint(job, written, latest.checkpoint_id)

    def request_savepoint(
        self,
        job: str,
        *,
        stop: bool = False,
        path: str | None = None,
        timeout: float = 300.0,
        snapshot_url: str | None = None,
    ) -> Savepoint:
        """Asks the running job for a savepoint and waits at most ``timeout`` seconds.

        Raises:
            ConfigError: the runner answered with an error, or did not answer in time.
        """
        from processor.runtime.shape.savepoints import request_savepoint

        store = self.store(job, snapshot_url)
        written = request_savepoint(store, job, stop=stop, path=_where(path), timeout=timeout)
        return Savepoint(job, written, None)

    def reset_plan(
        self,
        job: str,
        *,
        pipeline: str | None = None,
        snapshot_url: str | None = None,
        workers: int = 8,
    ) -> ResetPlan:
        """What :meth:`reset` would delete (it lists the job's internal topics)."""
        prefix = job_topic_prefix(job)
        url = self.snapshot_url(job, snapshot_url)
        records: list[str] = []
        if pipeline:
            subtasks = max(workers, self.sink_subtasks(job, workers, self.store(job, url)))
            for step, sink in self.recording_sinks(pipeline):
                records += sink.recorded_commits(job, step, subtasks)
        return ResetPlan(
            job=job,
            snapshot_url=url,
            directory=job_dir(job, self._state),
            topic_prefix=prefix,
            topics=tuple(self._topic_admin().list_topics(prefix)),
            pipeline=pipeline,
            group=self._group(job),
            sink_records=tuple(records),
        )

    def recording_sinks(self, pipeline: str) -> list[tuple[str, Any]]:
        """The sink steps of a pipeline file that keep records of the job's runs of their own
        (``recorded_commits`` / ``forget_commits``: Iceberg, Delta, PostgreSQL), by step."""
        from processor.runtime.pipeline import load_flow

        flow = load_flow(pipeline)
        return [
            (s.name, s.params["sink"])
            for s in flow.steps.values()
            if s.kind == "sink" and hasattr(s.params["sink"], "forget_commits")
        ]

    def reset(
        self,
        job: str,
        *,
        pipeline: str | None = None,
        workers: int = 8,
        snapshot_url: str | None = None,
        confirm: Callable[[ResetPlan], bool] | None = None,
        force: bool = False,
    ) -> ResetResult | None:
        """Deletes a stopped job's checkpoints, job files, internal topics, consumer group (its
        committed source offsets), dedup IDs and state directory; given its ``pipeline``,
        fences its Kafka sinks' transactional ids (at least ``workers`` subtasks, more if it
        ran wider) first, which aborts their open transactions.
        Its next run starts afresh.

        ``confirm`` is shown the plan while the job's lease is held; ``False`` deletes nothing
        and returns ``None``.

        Raises:
            JobRunningError: the job is running: here (its lease), or elsewhere by its claim in
                Kafka (another host or state directory; unless ``force``).
        """
        with self.holding(job, snapshot_url) as store:
            running = "" if force else self.running_elsewhere(job, leased=store.url)
            if running:
                raise JobRunningError(
                    f"{running}. A reset now would delete the channel topics and the consumer "
                    "group it works with, under it; stop it first (Ctrl-C or SIGTERM where it "
                    f"runs, or 'eosflow savepoint {job} --stop' on its snapshot store), or pass "
                    "--force"
                )
            plan = self.reset_plan(job, pipeline=pipeline, snapshot_url=store.url, workers=workers)
            if confirm is not None and not confirm(plan):
                return None
            fenced: tuple[FencedSink, ...] = ()
            cleared: list[str] = []
            if pipeline:
                subtasks = self.sink_subtasks(job, workers, store)
                fenced = self._fence(self.transactional_sinks(pipeline).steps, subtasks)
                # the sinks' own records of the job's runs: its next run's checkpoint ids
                # start again at 1 (sinks.lake.writer refuses a table ahead of them)
                for step, sink in self.recording_sinks(pipeline):
                    cleared += sink.forget_commits(job, step, subtasks)
            deleted = store.delete_job(job)
            if plan.topics:
                self._topic_admin().delete_topics(plan.topics)
            keys = self._delete_redis_keys(job)
            # The job's history in Kafka: without it the next run may start afresh
            # (processor.runtime.supervision.identity refuses a start without state while it
            # exists).
            group = self._delete_group(job)
            shutil.rmtree(plan.directory, ignore_errors=True)
        store.delete_job(job)  # the lease file that the release just wrote
        return ResetResult(job, fenced, deleted, plan.topics, keys, group, tuple(cleared))

    def transactional_sinks(self, pipeline: str) -> TransactionalSinks:
        """The job name and the transactional Kafka sink steps of a pipeline file (it runs)."""
        from processor.runtime.pipeline import load_flow

        flow = load_flow(pipeline)
        steps = tuple(
            s
            for s in flow.steps.values()
            if s.kind == "sink" and getattr(s.params["sink"], "mode", None) == "transactional"
        )
        return TransactionalSinks(flow.name, pipeline, steps)

    def sink_subtasks(self, job: str, workers: int, store: SnapshotStore | None = None) -> int:
        """Sink subtasks whose transactional ids to cover: ``workers``, or more when the job ran
        at a higher parallelism before a rescale (job file ``_SINK_SUBTASKS``): the ids of
        removed subtasks exist on the broker too."""
        from processor.runtime.shape.topology import recorded_parallelism

        return max(workers, recorded_parallelism(store or self.store(job), job))

    def transactions(
        self, sinks: TransactionalSinks | str, *, workers: int = 2
    ) -> list[SinkTransactions]:
        """The transactional ids, commit markers and pending epochs of a pipeline's
        transactional Kafka sinks (a pipeline file, or :meth:`transactional_sinks`)."""
        from sinks.kafka import read_transaction_markers, transactional_ids

        if isinstance(sinks, str):
            sinks = self.transactional_sinks(sinks)
        if not sinks.steps:
            return []
        job = sinks.job
        settings = self._settings()
        store = self.store(job)
        latest = store.latest_completed(job)
        subtasks = self.sink_subtasks(job, workers, store)
        found = []
        for step in sinks.steps:
            sink = step.params["sink"]
            ids = tuple(
                tuple(transactional_ids(sink.prefix, step.name, subtask, sink.pool_size))
                for subtask in range(subtasks)
            )
            markers = tuple(read_transaction_markers(settings, job, step.name))
            pending = []
            if latest is not None:
                for task, handle in sorted(latest.tasks.items()):
                    state = store.read_task_snapshot(handle)
                    for chk, c in state.get("sinks", {}).get(step.name, []):
                        pending.append(PendingEpoch(task, c["epoch"], chk, c["tid"], c["count"]))
            found.append(
                SinkTransactions(
                    job=job,
                    step=step.name,
                    topic=sink.topic,
                    subtask_ids=ids,
                    markers=markers,
                    checkpoint_id=None if latest is None else latest.checkpoint_id,
                    pending=tuple(pending),
                )
            )
        return found

    def abort_transactions(
        self, sinks: TransactionalSinks | str, *, workers: int = 2, force: bool = False
    ) -> list[FencedSink]:
        """Fences the transactional ids of a pipeline's transactional Kafka sinks: their open
        transactions abort. Pending epochs of the last checkpoint are re-published from the log
        when the job next starts.

        Raises:
            JobRunningError: the job is running and not ``force``: fencing would fence its
                producers and force a recovery.
        """
        if isinstance(sinks, str):
            sinks = self.transactional_sinks(sinks)
        if force:
            store = self.store(sinks.job)
            return list(self._fence(sinks.steps, self.sink_subtasks(sinks.job, workers, store)))
        # held while aborting: a job started meanwhile would have its producers fenced
        with self.holding(sinks.job) as store:
            subtasks = self.sink_subtasks(sinks.job, workers, store)
            return list(self._fence(sinks.steps, subtasks))

    def _fence(self, steps: tuple[Any, ...], workers: int) -> tuple[FencedSink, ...]:
        from sinks.kafka import abort_lingering

        settings = self._settings()
        fenced = []
        for step in steps:
            sink = step.params["sink"]
            done = abort_lingering(settings, sink.prefix, step.name, workers)
            fenced.append(FencedSink(step.name, tuple(done)))
        return tuple(fenced)

    def _settings(self) -> KafkaSettings:
        from connectors import KafkaSettings

        return self._kafka if self._kafka is not None else KafkaSettings.from_env()

    def running_elsewhere(self, job: str, leased: str = "") -> str:
        """ "job J is running now: runner on host H, pid P, ..." when the job's claim in Kafka
        says a runner holds it (its newest record is recent and not a stop), else ``""``;
        ``leased``: the snapshot store whose lease the caller holds (a runner there is gone)."""
        import time

        from connectors.claim import KafkaJobClaim, claim_topic
        from processor.runtime.supervision.identity import holder_text

        if not self._topic_admin().exists(claim_topic(job)):
            return ""
        record = KafkaJobClaim(self._settings(), job).last()
        return holder_text(job, record, time.time(), leased=leased)

    def _group(self, job: str) -> str:
        from connectors import job_group

        return job_group(job)

    def _delete_group(self, job: str) -> str | None:
        from connectors import delete_job_group

        return self._group(job) if delete_job_group(self._settings(), job) else None

    def group_offsets(self, job: str) -> dict[tuple[str, int], int]:
        """The source offsets committed to the job's consumer group (where the job's last
        checkpoint is, as ``kafka-consumer-groups --describe`` shows it); empty if none."""
        from connectors import job_group_offsets

        return job_group_offsets(self._settings(), job)

    def _topic_admin(self) -> Any:
        from connectors import TopicAdmin

        return TopicAdmin(self._settings(), timeout=10.0)

    def _redis(self, _step: str = "") -> str | None:
        """The Redis of the jobs' dedup IDs (``redis_url``, else ``$EOSFLOW_REDIS_URL``)."""
        return self._redis_url or os.environ.get("EOSFLOW_REDIS_URL")

    def _delete_redis_keys(self, job: str) -> int | None:
        url = self._redis()
        if not url:
            return None
        from dedup.store import redis_client

        client = redis_client(url, name="eosflow-reset")
        count = 0
        batch: list[Any] = []
        for key in client.scan_iter(match=f"eosflow:{job}:*", count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                count += client.delete(*batch)
                batch = []
        if batch:
            count += client.delete(*batch)
        return int(count)


def _where(path: str | None) -> str | None:
    """A savepoint path as the runner must read it: its directory is not this one."""
    if path is not None and "://" not in path:
        return str(Path(path).resolve())
    return path


def _read_status(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _alive(status: dict[str, Any]) -> bool:
    return status.get("state") == "running" and pid_alive(int(status["pid"]))


def _worker_state(worker: dict[str, Any], job_alive: bool) -> str:
    """``alive`` / ``dead`` for a worker on this host; ``unknown`` on another (Spark)."""
    local = worker.get("host") in (None, "", socket.gethostname(), "localhost", "127.0.0.1")
    if not job_alive:
        return "stopped"
    if not local or not worker.get("pid"):
        return "connected" if worker.get("connected") else "not connected"
    if not pid_alive(int(worker["pid"])):
        return "dead"
    return "alive, connected" if worker.get("connected") else "alive, not connected"
