"""The job lease (processor.snapshot.lease): one runner per job, on local and remote stores."""

from __future__ import annotations

import contextlib
import threading
import uuid
from pathlib import Path

import pytest

from processor.errors import ConfigError, JobRunningError
from processor.snapshot.lease import JobLease, lease_holder
from processor.snapshot.store import SnapshotStore


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_a_local_lease_refuses_a_second_holder_until_the_first_lets_go(tmp_path: Path) -> None:
    store = SnapshotStore(f"file://{tmp_path}")
    first, second = JobLease(store, "job"), JobLease(store, "job")
    first.acquire()
    with pytest.raises(JobRunningError, match=r"job 'job' is already running: runner pid \d+"):
        second.acquire()
    first.release()
    assert lease_holder(store, "job")["released"] is True  # type: ignore[index]
    second.acquire()  # free again
    second.release()


def test_a_local_lease_is_free_as_soon_as_its_holder_dies(tmp_path: Path) -> None:
    """The flock goes with the process: a crashed runner's job restarts at once (no TTL wait),
    though its lease file still names it and was never marked released."""
    import subprocess
    import sys

    code = (
        "import os, sys; from processor.snapshot.store import SnapshotStore; "
        "from processor.snapshot.lease import JobLease; "
        f"JobLease(SnapshotStore('file://{tmp_path}'), 'job').acquire(); os._exit(9)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 9
    store = SnapshotStore(f"file://{tmp_path}")
    assert lease_holder(store, "job") is not None
    lease = JobLease(store, "job")
    lease.acquire()
    lease.release()


def test_a_remote_lease_is_held_while_renewed_and_taken_over_once_stale() -> None:
    store = SnapshotStore(f"memory://lease-{uuid.uuid4().hex}")
    clock = Clock()
    first = JobLease(store, "job", ttl=30, clock=clock)
    second = JobLease(store, "job", ttl=30, clock=clock)
    first.acquire()
    clock.now += 25
    with pytest.raises(JobRunningError, match="renewed 25s ago, stale after 30s"):
        second.acquire()
    first.renew()  # 25 s > ttl / 3: written again
    clock.now += 29
    with pytest.raises(JobRunningError):
        second.acquire()
    clock.now += 31  # the first runner froze: its lease went stale
    second.acquire()
    with pytest.raises(JobRunningError, match="lost the job's lease"):
        first.renew()
    first.release()  # not its lease any more: leaves it alone
    assert lease_holder(store, "job")["token"] == second.token  # type: ignore[index]
    second.release()
    JobLease(store, "job", ttl=30, clock=clock).acquire()  # released: free at once


def test_a_remote_lease_refuses_a_store_without_conditional_writes() -> None:
    """Regression (issue 35, item 7): on a store with no conditional writes the lease was
    check-then-write; it is now refused at start with a message that says what works."""
    store = SnapshotStore(f"dir::memory://lease-{uuid.uuid4().hex}")
    with pytest.raises(ConfigError, match=r"offers no conditional writes .* Use an s3:// store"):
        JobLease(store, "job").acquire()
    assert lease_holder(store, "job") is None


def _race(leases: list[JobLease]) -> list[JobLease]:
    """Every lease's ``acquire`` at once (a barrier releases the threads together); who won."""
    barrier = threading.Barrier(len(leases))
    won: list[JobLease] = []

    def run(lease: JobLease) -> None:
        barrier.wait()
        with contextlib.suppress(JobRunningError):
            lease.acquire()
            won.append(lease)

    threads = [threading.Thread(target=run, args=(lease,)) for lease in leases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return won


def test_exactly_one_of_many_racing_runners_takes_a_remote_lease() -> None:
    store = SnapshotStore(f"memory://lease-{uuid.uuid4().hex}")
    for round_ in range(50):
        won = _race([JobLease(store, f"job-{round_}") for _ in range(6)])
        assert len(won) == 1, f"round {round_}: {len(won)} holders"
        assert lease_holder(store, f"job-{round_}")["token"] == won[0].token  # type: ignore[index]
