"""The job lease on a real S3 API (moto's server on loopback, reached by s3fs over HTTP).

Issue 35, item 7: the remote lease was check-then-write (read ``_LEASE``, see nobody live,
write it, wait, read it back), so two runners whose writes were far enough apart both believed
they held the job. It now uses S3's conditional writes: ``If-None-Match: *`` to create the
lease, ``If-Match: <etag>`` to take over a stale one, renew and release it.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable

import pytest

from processor.errors import ConfigError, JobRunningError
from processor.snapshot.lease import JobLease, lease_holder
from processor.snapshot.store import SnapshotStore
from tests.integration.s3_server import S3Server, s3_server

__all__ = ["s3_server"]  # the fixture, imported to be used here

TTL = 3.0


class Clock:
    """A manual clock shared by the runners of one test (they only read it)."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _store(server: S3Server, bucket: str) -> SnapshotStore:
    return SnapshotStore(f"s3://{bucket}/eosflow", **server.storage_options())


def _race(contenders: list[Callable[[], None]]) -> list[bool]:
    """Runs every contender at once (a barrier releases them together); which succeeded."""
    barrier = threading.Barrier(len(contenders))
    won = [False] * len(contenders)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        barrier.wait()
        try:
            contenders[i]()
            won[i] = True
        except JobRunningError:
            pass
        except BaseException as exc:  # anything else fails the test, with its cause
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(contenders))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return won


@pytest.mark.parametrize("latency", [0.0, 2.0], ids=["fast", "slow-writes"])
def test_exactly_one_of_racing_runners_takes_a_new_lease_when_they_start_together(
    s3_server: S3Server, latency: float
) -> None:
    """Regression: with writes that take up to two seconds (a slow bucket), the check-then-write
    lease let two runners both hold one job: one read "free" before the other's write, and
    wrote after the other had read its own write back (it waited ``ttl / 10``, 0.3 s here).

    The clock stands still: a lease is never stale here, however slow the machine."""
    s3_server.write_latency = latency
    bucket = s3_server.bucket()
    clock = Clock()
    rounds, jobs, runners = (2, 6, 3) if latency else (3, 4, 3)
    for r in range(rounds):
        names = [f"race-{r}-{j}" for j in range(jobs)]
        leases = [
            JobLease(_store(s3_server, bucket), n, ttl=TTL, clock=clock) for n in names * runners
        ]
        won = _race([lease.acquire for lease in leases])
        holders = {
            job: [x for x, w in zip(leases, won, strict=True) if w and x.job == job]
            for job in names
        }
        wrong = {job: len(w) for job, w in holders.items() if len(w) != 1}
        assert not wrong, (
            f"round {r}: runners holding the lease, by job: {wrong} (seed {s3_server.seed})"
        )
        for job, (winner,) in holders.items():
            holder = lease_holder(_store(s3_server, bucket), job)
            assert holder is not None and holder["token"] == winner.token


def test_exactly_one_runner_takes_over_a_stale_lease_and_its_old_holder_learns_it(
    s3_server: S3Server,
) -> None:
    bucket = s3_server.bucket()
    clock = Clock()
    for r in range(3):
        job = f"stale-{r}"
        old = JobLease(_store(s3_server, bucket), job, ttl=TTL, clock=clock)
        old.acquire()
        clock.now += TTL + 1  # the holder froze: its lease went stale
        leases = [JobLease(_store(s3_server, bucket), job, ttl=TTL, clock=clock) for _ in range(4)]
        won = _race([lease.acquire for lease in leases])
        assert sum(won) == 1, f"round {r}: {sum(won)} runners took the stale lease"
        with pytest.raises(JobRunningError, match="lost the job's lease to runner pid"):
            old.renew()
        winner = leases[won.index(True)]
        old.release()  # not its lease any more: leaves it alone
        holder = lease_holder(_store(s3_server, bucket), job)
        assert holder is not None and holder["token"] == winner.token
        assert not holder.get("released")
        clock.now += TTL  # a third of the ttl passed: the winner renews, unchallenged
        winner.renew()
        winner.release()
        assert lease_holder(_store(s3_server, bucket), job)["released"] is True  # type: ignore[index]


def test_a_renewal_racing_a_takeover_leaves_exactly_one_holder(s3_server: S3Server) -> None:
    """The holder wakes up after ``ttl`` and renews while others take its stale lease over:
    either its renewal lands first (the others are refused) or a takeover does (it is told)."""
    s3_server.write_latency = 0.05
    bucket = s3_server.bucket()
    clock = Clock()
    outcomes = set()
    for r in range(6):
        job = f"renew-race-{r}"
        holder = JobLease(_store(s3_server, bucket), job, ttl=TTL, clock=clock)
        holder.acquire()
        clock.now += TTL + 1
        others = [JobLease(_store(s3_server, bucket), job, ttl=TTL, clock=clock) for _ in range(2)]
        won = _race([holder.renew] + [lease.acquire for lease in others])
        assert sum(won) == 1, f"round {r}: renewed={won[0]}, takeovers={won[1:]}"
        outcomes.add("renewed" if won[0] else "taken")
    print(f"outcomes seen: {sorted(outcomes)}")


def test_a_store_that_ignores_conditional_writes_cannot_hold_a_lease(
    s3_server: S3Server,
) -> None:
    """An S3-compatible store that drops ``If-None-Match`` / ``If-Match`` would make the lease
    check-then-write again: eosflow refuses it rather than lease on it."""
    s3_server.ignore_conditions = True
    store = _store(s3_server, s3_server.bucket())
    with pytest.raises(ConfigError, match="ignored a conditional write"):
        JobLease(store, "job", ttl=TTL).acquire()
    assert lease_holder(store, "job") is None


def test_a_released_lease_is_taken_at_once_and_reset_deletes_it(s3_server: S3Server) -> None:
    bucket = s3_server.bucket()
    clock = Clock()
    first = JobLease(_store(s3_server, bucket), "job", ttl=TTL, clock=clock)
    first.acquire()
    with pytest.raises(JobRunningError, match=r"already running: runner pid \d+ .* in s3://"):
        JobLease(_store(s3_server, bucket), "job", ttl=TTL, clock=clock).acquire()
    first.release()
    second = JobLease(_store(s3_server, bucket), "job", ttl=TTL, clock=clock)
    second.acquire()
    _store(s3_server, bucket).delete_job("job")  # what 'eosflow reset' does, holding the lease
    second.release()  # the lease file is gone: nothing to release
    assert lease_holder(_store(s3_server, bucket), "job") is None
    job = f"job-{uuid.uuid4().hex[:6]}"
    third = JobLease(_store(s3_server, bucket), job, ttl=TTL)
    third.acquire()
    third.release()
