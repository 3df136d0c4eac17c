"""``eosflow run --takeover``: hand a running job to this runner, with nothing twice and no gap
longer than the old runner's final checkpoint and this one's start-up (issue 48, item 3).

A rolling deploy starts the new runner while the old one still runs (Kubernetes
``RollingUpdate``, a second host, a systemd unit started before the old one is stopped). Without
``--takeover`` the newcomer is refused (the lease of a shared store, or the job's history in
Kafka) and says who holds the job. With it:

1. **Who holds the job.** The job's claim in Kafka names the runner that checkpointed last (host,
   pid, snapshot store: :func:`~processor.runtime.supervision.identity.holder_text`); the lease
   of this runner's own store names one that runs on the same store but has not checkpointed
   yet. Neither: nothing to take over, the run starts as usual.
2. **Stop it at a savepoint.** The request goes where the holder polls for it, its snapshot
   store (:func:`~processor.runtime.shape.savepoints.request_savepoint` with ``stop``): the
   holder takes its final aligned checkpoint, waits until its sinks committed it and its source
   offsets are in the job's group, copies it as a savepoint, answers and exits.
3. **Start from it.** Holder on the same store: this run restores the store's newest checkpoint
   (that final one) once the holder released the lease. On another store: this run restores
   the savepoint (``--from-savepoint``), which must be readable here (a store both runners
   reach: S3, a shared filesystem); a ``file://`` store that is not on this machine is refused
   at once, with the manual way.

Correctness does not rest on the wait: if the old runner were still running when this one
takes the job, the claim's fencing stops it before it commits anything more
(:mod:`processor.runtime.supervision.identity`). The wait only keeps the handover clean: the
old runner's last checkpoint is committed, and it exits 0.

Every wait is bounded by ``--takeover-timeout``; a holder that does not answer in time is left
running, and this start fails with what to do.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from typing import Any

from processor.errors import ConfigError, JobNotFoundError, JobRunningError
from processor.runtime.shape.savepoints import post_savepoint_request, savepoint_answer
from processor.runtime.supervision.identity import holder_text
from processor.snapshot.lease import LEASE_FILE, JobLease, describe, lease_holder
from processor.snapshot.store import SnapshotStore

__all__ = ["Takeover"]

log = logging.getLogger(__name__)

_POLL_S = 0.2
#: After the holder's answer, how long its ``stopped`` claim record is waited for (it writes it
#: as it exits; a holder that died after answering never does, and fencing covers it).
_STOPPED_WAIT_S = 15.0


class Takeover:
    """One start's takeover of ``job`` (module docstring), within ``timeout`` seconds."""

    def __init__(
        self,
        job: str,
        store: SnapshotStore,
        *,
        timeout: float,
        say: Callable[[str], None],
        redis_url: Callable[[str], str | None] | None = None,
    ) -> None:
        self.job, self.store, self._say = job, store, say
        self._redis_url = redis_url  # each dedup step's Redis, for a copied checkpoint's IDs
        self.timeout = timeout
        self._deadline = time.monotonic() + timeout
        self._asked: set[str] = set()  # the stores asked to stop their runner

    def _left(self) -> float:
        return max(0.0, self._deadline - time.monotonic())

    def from_claim(self, transport: Any) -> str | None:
        """Stops the live runner the job's claim names; returns the savepoint to start from
        when it ran on another snapshot store (``None``: this store's newest checkpoint, once
        :meth:`acquire` took the lease).

        Raises:
            ConfigError: the holder's store is not reachable here, or it did not stop in time.
        """
        make = getattr(transport, "job_claim", None)
        if make is None:
            return None
        claim = make(self.job)
        try:
            record = claim.last()
            running = holder_text(self.job, record, time.time())
            if not running:
                return self._from_stopped(claim, record)
            assert record is not None
            theirs = str(record.get("store") or "")
            if theirs.startswith("file:") and record.get("host") != socket.gethostname():
                raise self._unreachable(running, theirs)  # a path of another machine's disk
            if theirs == self.store.url:  # acquire() waits for its lease
                self._ask(self.store, running)
                return None
            return self._from_other_store(claim, theirs, running)
        finally:
            claim.close()

    def _from_stopped(self, claim: Any, record: dict[str, Any] | None) -> str | None:
        """No running holder. Its runner stopped before this start looked (a bounded run that
        finished, a SIGTERM just before the takeover): on another snapshot store reachable here
        that holds the job, its newest checkpoint, copied as a savepoint, as when it stops
        without answering; a runner starting on that store (its lease held, the claim not
        naming it yet) is asked to stop. Else ``None``: a usual start (the history check
        refuses one without the job's state)."""
        url = str((record or {}).get("store") or "")
        if not record or not record.get("stopped") or not url or url == self.store.url:
            self._say(f"--takeover: the claim of job {self.job!r} names no running runner")
            return None
        who = (
            f"the runner of job {self.job!r} on host {record.get('host', '?')}, pid "
            f"{record.get('pid', '?')}, stopped before this takeover (snapshot store {url})"
        )
        if url.startswith("file:") and (
            record.get("host") != socket.gethostname() or not _has_job(SnapshotStore(url), self.job)
        ):  # not reachable here: the usual start's checks decide (this store's own state)
            self._say(f"--takeover: {who}, which is not reachable from here; starting as usual")
            return None
        copied = self._copy_stopped(url, who)
        if copied is None:  # the lease is held: the stopped runner exiting, or a new one
            return self._from_other_store(
                claim, url, f"the lease of {url} is still held (the runner that stopped may "
                "still be exiting, or another is starting there)",
            )  # fmt: skip
        return copied

    def _from_other_store(self, claim: Any, url: str, running: str) -> str:
        """The savepoint of the holder on store ``url``: its answer, or (it stopped without one:
        SIGTERMed as the request came, or its final checkpoint failed) its newest checkpoint."""
        store = SnapshotStore(url) if url else None
        if store is None or (url.startswith("file:") and not _has_job(store, self.job)):
            raise self._unreachable(running, url)
        request_id = self._ask(store, running)
        started, next_look = time.monotonic(), 0.0
        while self._left() > 0:
            failed = ""
            try:
                path = savepoint_answer(store, self.job, request_id)
            except ConfigError as exc:
                path, failed = None, str(exc)
            if path is not None:
                self._say(f"--takeover: it stopped at a savepoint in "
                          f"{time.monotonic() - started:.1f}s: {path}")  # fmt: skip
                self._await_stopped(claim)
                return path
            if failed or time.monotonic() >= next_look:
                # gone without an answer (SIGTERMed, killed, its final checkpoint failed): its
                # lease is free then, and its newest checkpoint is the one to start from
                next_look = time.monotonic() + 1.0
                why = f"it stopped without answering ({failed or 'stopped meanwhile'})"
                copied = self._copy_stopped(url, why)
                if copied is not None:
                    return copied
            time.sleep(_POLL_S)
        raise ConfigError(self._not_stopped(f"the runner holding job {self.job!r}"))

    def _not_stopped(self, who: str) -> str:
        return (
            f"--takeover: {who} did not stop within {self.timeout:g}s; it was left running. "
            "Raise --takeover-timeout (its final checkpoint must complete and its sinks "
            "commit), or see its log"
        )

    def _unreachable(self, running: str, url: str) -> ConfigError:
        return ConfigError(
            f"--takeover: {running}, on snapshot store {url or '(not recorded)'}, which is not "
            "reachable from here: the stop request and its savepoint must go through a store "
            "both runners reach (--snapshot-url s3://... or a shared filesystem). Or move the "
            f"job by hand: 'eosflow savepoint {self.job} --stop --path URL' where it runs, "
            "then 'eosflow run ... --from-savepoint URL' here (docs/deployment.md)"
        )

    def _copy_stopped(self, url: str, why: str) -> str | None:
        """The stopped holder's newest checkpoint as a savepoint (``None``: it still holds its
        lease, exiting)."""
        from processor.admin.jobs import JobAdmin  # the admin layer: imported where used

        try:
            copied = JobAdmin().copy_checkpoint(
                self.job, snapshot_url=url, redis_url=self._redis_url
            )
        except JobRunningError:
            return None
        except JobNotFoundError:  # gone before its first checkpoint: nothing to go on from
            self._say("--takeover: it stopped before its first checkpoint; starting afresh")
            return ""
        self._say(
            f"--takeover: {why}; its checkpoint {copied.checkpoint_id} copied as a savepoint: "
            f"{copied.path}"
        )
        return copied.path

    def acquire(self, lease: JobLease) -> None:
        """Takes ``lease``; while a runner of this store holds it, asks that runner to stop
        (once) and waits for it to release the lease, until the deadline.

        Raises:
            JobRunningError: the holder did not stop in time (it was left running).
        """
        while True:
            try:
                lease.acquire()
                return
            except JobRunningError:
                holder = describe(lease_holder(self.store, self.job))
                if self.store.url not in self._asked:
                    self._ask(self.store, f"{holder} holds job {self.job!r} in this store")
                elif self._left() <= 0:
                    raise JobRunningError(self._not_stopped(holder)) from None
            time.sleep(_POLL_S)

    def _ask(self, store: SnapshotStore, running: str) -> str:
        """Asks the runner polling ``store`` to stop at a savepoint; returns the request's id."""
        self._asked.add(store.url)
        self._say(
            f"--takeover: {running}; asked it to stop at a savepoint (waiting at most "
            f"{self._left():.0f}s)"
        )
        return post_savepoint_request(store, self.job, stop=True, path=None)

    def _await_stopped(self, claim: Any) -> None:
        """Waits (bounded) for the holder's ``stopped`` claim record, written as it exits."""
        until = time.monotonic() + min(_STOPPED_WAIT_S, self._left())
        while time.monotonic() < until:
            if not holder_text(self.job, claim.last(), time.time()):
                return
            time.sleep(_POLL_S)
        log.info("job=%s: no 'stopped' claim record yet; fencing covers the old runner", self.job)


def _has_job(store: SnapshotStore, job: str) -> bool:
    """A ``file://`` store on this machine holds the job (its checkpoints or job files)."""
    if store.read_job_file(job, LEASE_FILE) is not None:
        return True
    return store.latest_completed(job) is not None
