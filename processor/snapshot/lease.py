"""One runner per job: an exclusive lease in the job's snapshot store.

Two coordinators of one job (a second ``eosflow run``, a second Spark driver attempt) would
share its generations, channel topics, transactional ids and checkpoints: each would take the
other's ``GenerationStart`` markers and barriers for its own. The runner therefore takes the
job's lease before it touches the broker, holds it while it runs, and gives it back at the end.

* On a local store (``file://``, the default) the lease is an ``flock`` on ``<job>/_LOCK``:
  the kernel releases it when the runner dies, however it dies, so a crashed job restarts at
  once, and two runners on one machine can never both hold it.
* ``<job>/_LEASE`` (JSON: token, host, pid, since, renewed) says who holds it, for the message
  a refused runner prints and for ``eosflow jobs``. On a remote store (``s3://``, ...) it is
  the lease itself: the holder renews it every ``ttl / 3`` seconds; a lease not renewed for
  ``ttl`` seconds is stale and may be taken over. The holder checks on every renewal that the
  file still names it; if another runner took the lease (this one was frozen past ``ttl``), it
  raises :class:`~processor.errors.JobRunningError` and the runner stops its workers.
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
from processor.snapshot.store import SnapshotStore

__all__ = ["LEASE_FILE", "JobLease", "lease_holder"]

log = logging.getLogger(__name__)

LEASE_FILE = "_LEASE"
LOCK_FILE = "_LOCK"


def lease_holder(store: SnapshotStore, job: str) -> dict[str, Any] | None:
    """The lease file's content (who runs or last ran ``job``), or ``None``."""
    data = store.read_job_file(job, LEASE_FILE)
    if data is None:
        return None
    try:
        holder = json.loads(data)
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


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

    def _refuse(self, holder: dict[str, Any] | None, why: str) -> JobRunningError:
        return JobRunningError(
            f"job {self.job!r} is already running: {describe(holder)} holds its lease in "
            f"{self.store.url} ({why}). Two runners of one job would mix their generations, "
            "channels and transactions. Stop that runner first (Ctrl-C or SIGTERM to its pid; "
            "'eosflow status' shows it), or give this job another name"
        )

    def acquire(self) -> None:
        """Takes the lease, or raises :class:`JobRunningError` naming its holder."""
        path = self.store.local_job_path(self.job, LOCK_FILE)
        if path is not None:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise self._refuse(lease_holder(self.store, self.job), "locked") from None
            self._fd = fd
        else:
            holder = lease_holder(self.store, self.job)
            age = self._clock() - holder.get("renewed_ms", 0) / 1000 if holder else None
            if holder and not holder.get("released") and age is not None and age < self.ttl:
                raise self._refuse(holder, f"renewed {age:.0f}s ago, stale after {self.ttl:g}s")
        self._since_ms = int(self._clock() * 1000)
        self._write()
        if path is None:  # two runners may have written at once: the last write wins
            time.sleep(min(1.0, self.ttl / 10))
            holder = lease_holder(self.store, self.job)
            if not holder or holder.get("token") != self.token:
                raise self._refuse(holder, "taken at the same moment")
        log.info("lease of job %s taken (token %s)", self.job, self.token)

    def _write(self, **extra: Any) -> None:
        now = self._clock()
        holder = {
            "token": self.token,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "since_ms": self._since_ms,
            "renewed_ms": int(now * 1000),
            "ttl_s": self.ttl,
            **extra,
        }
        self.store.write_job_file(self.job, LEASE_FILE, json.dumps(holder).encode())
        self._renewed = now

    def renew(self) -> None:
        """Renews the lease when a third of ``ttl`` passed; raises :class:`JobRunningError` if
        another runner took it."""
        if self._clock() - self._renewed < self.ttl / 3:
            return
        holder = lease_holder(self.store, self.job)
        if not holder or holder.get("token") != self.token:
            raise JobRunningError(
                f"job {self.job!r}: this runner lost the job's lease to {describe(holder)} "
                f"(not renewed for more than {self.ttl:g}s: was this process frozen?). "
                "Stopping this runner's workers; the other runner continues the job"
            )
        self._write()

    def release(self) -> None:
        """Gives the lease back (the file stays, marked released, for ``eosflow jobs``)."""
        with contextlib.suppress(Exception):
            holder = lease_holder(self.store, self.job)
            if holder and holder.get("token") == self.token:
                self._write(released=True)
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
