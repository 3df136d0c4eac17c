"""One runner per job: an exclusive lease in the job's snapshot store.

Two coordinators of one job (a second ``eosflow run``, a second Spark driver attempt) would
share its generations, channel topics, transactional ids and checkpoints: each would take the
other's ``GenerationStart`` markers and barriers for its own. The runner therefore takes the
job's lease before it touches the broker, holds it while it runs, and gives it back at the end.

* On a local store (``file://``, the default) the lease is an ``flock`` on ``<job>/_LOCK``:
  the kernel releases it when the runner dies, however it dies, so a crashed job restarts at
  once, and two runners on one machine can never both hold it.
* ``<job>/_LEASE`` (JSON: token, host, pid, since, renewed) says who holds it, for the message
  a refused runner prints and for ``eosflow jobs``. On a remote store (``s3://``) it is the
  lease itself, written only with the store's conditional writes
  (:mod:`processor.snapshot.conditional`): created with ``If-None-Match: *``; taken over, once
  not renewed for ``ttl`` seconds or released, with ``If-Match`` on the version read; renewed
  every ``ttl / 3`` seconds and released with ``If-Match`` on the version this runner wrote.
  Of runners racing for it, the store lets exactly one write succeed. A holder whose renewal
  is refused lost the lease (it was frozen past ``ttl`` and another runner took it over): it
  raises :class:`~processor.errors.JobRunningError` and the runner stops its workers. A store
  without conditional writes cannot hold a remote lease: :class:`~processor.errors.ConfigError`
  at start, never a check-then-write.

Invariants:
    On a remote store, no write of ``_LEASE`` is unconditional; at most one runner's token is
    in it at a time, and a runner holds the lease only while its last write is the current
    version.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from typing import Any

from processor.errors import JobRunningError
from processor.snapshot.conditional import ConditionFailed
from processor.snapshot.store import SnapshotStore

__all__ = ["LEASE_FILE", "JobLease", "lease_holder"]

log = logging.getLogger(__name__)

LEASE_FILE = "_LEASE"
LOCK_FILE = "_LOCK"
#: Where a remote store's conditional writes are checked before its first lease.
PROBE_FILE = "_LEASE_PROBE"


def lease_holder(store: SnapshotStore, job: str) -> dict[str, Any] | None:
    """The lease file's content (who runs or last ran ``job``), or ``None``."""
    data = store.read_job_file(job, LEASE_FILE)
    return _parse(data) if data is not None else None


def describe(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "another runner"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since_ms", 0) / 1000))
    return f"runner pid {holder.get('pid')} on host {holder.get('host')} (since {since})"


class JobLease:
    """The exclusive lease of ``job`` in ``store`` (see the module docstring)."""

    def __init__(
        self,
        store: SnapshotStore,
        job: str,
        *,
        ttl: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store, self.job, self.ttl, self._clock = store, job, ttl, clock
        self.token = secrets.token_hex(8)
        self._fd: int | None = None
        self._since_ms = 0
        self._renewed = 0.0
        self._version: str | None = None  # remote: the version of _LEASE this runner wrote

    def _refuse(self, holder: dict[str, Any] | None, why: str) -> JobRunningError:
        return JobRunningError(
            f"job {self.job!r} is already running: {describe(holder)} holds its lease in "
            f"{self.store.url} ({why}). Two runners of one job would mix their generations, "
            "channels and transactions. To replace it (a rolling deploy), run this one with "
            "--takeover: that runner stops at a savepoint and this one starts from it. Or stop "
            "it first (Ctrl-C or SIGTERM to its pid; 'eosflow status' shows it), or give this "
            "job another name"
        )

    def acquire(self) -> None:
        """Takes the lease, or raises :class:`JobRunningError` naming its holder.

        Raises:
            JobRunningError: another runner holds it.
            ConfigError: the store is remote and offers no conditional writes.
        """
        path = self.store.local_job_path(self.job, LOCK_FILE)
        if path is None:
            self._acquire_remote()
        else:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise self._refuse(lease_holder(self.store, self.job), "locked") from None
            self._fd = fd
            self._since_ms = int(self._clock() * 1000)
            self.store.write_job_file(self.job, LEASE_FILE, self._document())
            self._renewed = self._clock()
        log.info("lease of job %s taken (token %s)", self.job, self.token)

    def _acquire_remote(self) -> None:
        files = self.store.conditional_files()
        # a probe of its own: racing runners' probes must not meet (one deletes its probe)
        files.check(f"{self.store.job_file(self.job, PROBE_FILE)}.{self.token}")
        path = self.store.job_file(self.job, LEASE_FILE)
        holder: dict[str, Any] | None = None
        for _attempt in range(5):
            current = files.read(path)
            holder = _parse(current.data) if current is not None else None
            if current is not None and holder is not None and holder.get("token") == self.token:
                # our own write, whose answer was lost (the client retried it: 412)
                self._version, self._renewed = current.version, self._clock()
                return
            if holder is not None and not holder.get("released"):
                age = self._clock() - holder.get("renewed_ms", 0) / 1000
                if age < self.ttl:
                    raise self._refuse(holder, f"renewed {age:.0f}s ago, stale after {self.ttl:g}s")
            self._since_ms = int(self._clock() * 1000)
            now, document = self._clock(), self._document()
            try:
                if current is None:
                    self._version = files.create(path, document)
                else:  # stale or released: taken over only if still the version read
                    self._version = files.replace(path, document, current.version)
            except ConditionFailed:
                continue  # another runner wrote first: read who, and decide again
            self._renewed = now
            return
        raise self._refuse(holder, "taken at the same moment")

    def _document(self, **extra: Any) -> bytes:
        holder = {
            "token": self.token,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "since_ms": self._since_ms,
            "renewed_ms": int(self._clock() * 1000),
            "ttl_s": self.ttl,
            **extra,
        }
        return json.dumps(holder).encode()

    def _lost(self, holder: dict[str, Any] | None) -> JobRunningError:
        whom = (
            f"{describe(holder)}, token {holder.get('token')}"
            if holder
            else "nobody: its lease file is gone (was the job reset?)"
        )
        return JobRunningError(
            f"job {self.job!r}: this runner (token {self.token}) lost the job's lease to "
            f"{whom} in {self.store.url}: it was not renewed for more than {self.ttl:g}s "
            "(was this process frozen, or the store unreachable?). Stopping this runner's "
            "workers; the other runner continues the job"
        )

    def renew(self) -> None:
        """Renews the lease when a third of ``ttl`` passed; raises :class:`JobRunningError` if
        another runner took it."""
        if self._clock() - self._renewed < self.ttl / 3:
            return
        if self._fd is not None:  # local: the flock is the lease, the file says who
            holder = lease_holder(self.store, self.job)
            if not holder or holder.get("token") != self.token:
                raise self._lost(holder)
            self.store.write_job_file(self.job, LEASE_FILE, self._document())
            self._renewed = self._clock()
            return
        self._replace_own()

    def _replace_own(self, **extra: Any) -> None:
        """Rewrites ``_LEASE`` if this runner's write is still its current version."""
        files = self.store.conditional_files()
        path = self.store.job_file(self.job, LEASE_FILE)
        for _attempt in range(3):
            if self._version is None:  # never taken, or given back
                raise self._lost(lease_holder(self.store, self.job))
            now, document = self._clock(), self._document(**extra)
            try:
                self._version = files.replace(path, document, self._version)
                self._renewed = now
                return
            except ConditionFailed:
                current = files.read(path)
                holder = _parse(current.data) if current is not None else None
                if current is None or holder is None or holder.get("token") != self.token:
                    raise self._lost(holder) from None
                # still ours (a retried write that landed, a 409 conflict): try again on it
                self._version = current.version
        raise self._lost(lease_holder(self.store, self.job))

    def release(self) -> None:
        """Gives the lease back (the file stays, marked released, for ``eosflow jobs``)."""
        with contextlib.suppress(Exception):
            if self._fd is None:
                if self._version is not None:
                    self._replace_own(released=True)
            else:
                holder = lease_holder(self.store, self.job)
                if holder and holder.get("token") == self.token:
                    self.store.write_job_file(self.job, LEASE_FILE, self._document(released=True))
        self._version = None
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def _parse(data: bytes) -> dict[str, Any] | None:
    try:
        holder = json.loads(data)
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None
