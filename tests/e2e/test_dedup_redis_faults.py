"""The dedup step's Redis fails while the job runs (issue 17, docs/failures.md, "The failure
model").

Each job has a Redis of its own (embedded, append-only file on), which the test kills by PID
and starts again on the same port:

* **restarted empty** (its files deleted: a Redis without persistence, a lost disk): the IDs the
  checkpoints rely on are gone. The job must not let copies through: it fails, naming Redis and
  what to do, and no committed line holds a copy.
* **down for a while, then back with its data**: the job waits (records stay unchecked, never
  passed) and goes on by itself; the output is exact.

The expectation comes from the click generator alone (``examples/clicks.py``), never from the
engine.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from processor.runtime.job import JobFailed
from processor.runtime.supervision.runner import Runner
from processor.testing import FaultProxy
from processor.testing.chaos import input_read
from processor.testing.redis import kill_redis, private_redis, restart_redis
from sinks import read_jsonl
from tests.e2e.harness import (
    assert_exactly_once,
    canonical,
    chaos_seed,
    expected,
    expected_window_counts,
    run_chaos,
)

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

RECORDS = 60_000
# Many Bloom hits go to Redis (see test_dedup.py): copies of clicks read before the restored
# checkpoint are decided there, not by the IDs the run still remembers.
ENV = {"DEDUP_FP_RATE": "0.4", "DEDUP_EXPECTED_IDS": "2000", "DEDUP_BUCKET_S": "60"}
# When a fault starts: the share of the input read and the checkpoints completed. Early enough
# that the job cannot finish while Redis is away (at 0.6 and 4 the rest of the input took less
# than the 5 s outage once in CI: "the outage missed the job").
FAULT_AT = (0.35, 3)


def _progressed(runner: Runner, share: float, checkpoints: int) -> bool:
    read = input_read(runner, RECORDS)
    return read is not None and read >= share and runner.coordinator.stats.completed >= checkpoints


def _wait(runner: Runner, share: float, checkpoints: int, stop: threading.Event) -> bool:
    while not stop.is_set():
        if _progressed(runner, share, checkpoints):
            return True
        time.sleep(0.02)
    return False


class RedisFault:
    """The ``during=`` hook: once the job read ``share`` of its input and completed a few
    checkpoints, kill Redis, keep it down ``down_s``, start it again (``empty`` or with its
    data) and, if ``kill_worker``, SIGKILL worker 0 (a crash makes the workers restore, and
    the restored filters send copies of the older clicks to the store)."""

    def __init__(self, server: Any, *, empty: bool, down_s: float, kill_worker: bool) -> None:
        self.server, self.empty, self.down_s, self.kill_worker = server, empty, down_s, kill_worker
        self.stop = threading.Event()
        self.back_at: float | None = None
        self.unfinished_when_back = False
        self.runner: Runner | None = None
        self.error: str | None = None  # the fault itself went wrong: the test fails saying so

    def __call__(self, runner: Runner) -> None:
        self.runner = runner
        try:
            self._fault(runner)
        except BaseException as exc:  # not a hang of the job waiting for a Redis that never came
            self.error = f"the Redis fault failed: {type(exc).__name__}: {exc}"
            runner.stop_for(self.error)
            raise

    def _fault(self, runner: Runner) -> None:
        if not _wait(runner, *FAULT_AT, self.stop):
            return
        kill_redis(self.server)
        time.sleep(self.down_s)
        self.server = restart_redis(self.server, empty=self.empty)
        self.back_at = time.monotonic()
        # Not finished yet: the final checkpoint (if triggered while Redis was down, as on a
        # loaded machine) cannot complete without Redis, so it has not.
        final = runner.final_chk
        self.unfinished_when_back = final is None or runner.coordinator.stats.last_completed < final
        if self.kill_worker:
            pid = runner.workers[0].pid
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
        # The kernel stops an owned server when the thread that started it ends (its
        # parent-death signal): this thread lives until the test is done with Redis, and
        # stops the job if Redis dies meanwhile (once in CI the restarted Redis was gone, no
        # line in its log, and the job waited for it until the restart budget ran out).
        popen = self.server.process.popen
        while not self.stop.wait(0.5):
            code = popen.poll() if popen is not None else None
            if code is not None:
                self.error = f"the test's Redis (pid {popen.pid}) ended with status {code}"
                runner.stop_for(self.error)
                return


def _run(brokers: str, tmp_path: Path, fault: RedisFault, seed: int) -> Any:
    return run_chaos(
        "dedup_window_count.py",
        brokers=brokers,
        tmp=tmp_path,
        records=RECORDS,
        seed=seed,
        mode="aligned",
        interval=0.5,
        duplicates=0.10,
        env={"EOSFLOW_REDIS_URL": fault.server.url, **ENV},
        during=fault,
    )


def test_no_copy_is_committed_and_the_job_fails_naming_redis_when_redis_restarts_empty(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    """Regression (issue 17): after a crash, the restored filters sent copies of the clicks read
    before the checkpoint to a Redis that had come back empty; it answered "absent", and the
    copies were counted again (the job finished with too high counts)."""
    seed = chaos_seed()
    server = private_redis(tmp_path / "redis")
    fault = RedisFault(server, empty=True, down_s=0.5, kill_worker=True)
    started = time.monotonic()
    failed: JobFailed | None = None
    try:
        _run(kafka_endpoint[0], tmp_path, fault, seed)
    except JobFailed as exc:
        failed = exc
    finally:
        fault.stop.set()
        kill_redis(fault.server, clean=True)
    ended = time.monotonic()
    assert fault.error is None, fault.error
    runner = fault.runner
    assert runner is not None and fault.back_at is not None, "Redis was never restarted"
    print(f"seed={seed}; the job ended {ended - fault.back_at:.1f}s after Redis came back empty")
    print(f"restart causes: {runner.restart_causes}")
    print(f"JobFailed: {failed}")
    # Whatever was committed (before the failure): lines of whole windows, each exactly as the
    # distinct clicks count it; a copy let through makes a count too high.
    want = expected(expected_window_counts, RECORDS, seed)
    got = Counter(canonical(item) for item in read_jsonl(str(tmp_path / "output")))
    leaked = got - want
    assert not leaked, f"seed={seed}: {sum(leaked.values())} committed lines hold copies: {leaked}"
    assert failed is not None, "the job went on over a Redis that had lost its IDs"
    message = str(failed)
    assert "RedisDataLost: dedup ID store" in message
    assert f"on Redis at {fault.server.url} lost record IDs this job relies on" in message
    assert "EOSFLOW_DEDUP_ON_LOST_IDS=accept" in message
    first = runner.restart_causes[1]  # [0] is the test's own SIGKILL
    assert "RedisDataLost" in first, "the first restart after the fault should name the loss"
    assert started < fault.back_at


def test_the_job_waits_for_redis_and_stays_exact_when_redis_comes_back_with_its_data(
    kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    """SIGKILL, 5 s down, then the same Redis (its append-only file had every acknowledged
    write: Redis writes it before it answers) on the same port."""
    seed = chaos_seed()
    server = private_redis(tmp_path / "redis")
    fault = RedisFault(server, empty=False, down_s=5.0, kill_worker=False)
    try:
        run = _run(kafka_endpoint[0], tmp_path, fault, seed)
    finally:
        fault.stop.set()
        kill_redis(fault.server, clean=True)
    assert fault.error is None, fault.error
    assert fault.back_at is not None and fault.unfinished_when_back, "the outage missed the job"
    print(f"seed={seed} restarts={run.result.restarts} causes={run.result.restart_causes}")
    logs = "\n".join(run.logs.values())
    assert "dedup store unreachable, retrying" in logs, "no task waited for Redis"
    assert "RedisDataLost" not in logs
    assert_exactly_once(expected(expected_window_counts, RECORDS, seed), run.output, seed=seed)


class RedisPartition(RedisFault):
    """The ``during=`` hook: the same placement, but Redis is cut off by a black-holing proxy
    (connections stay open, nothing moves, as in a network partition) for ``down_s``; Redis
    itself keeps running with its data."""

    def __init__(self, server: Any, proxy: FaultProxy, *, down_s: float) -> None:
        super().__init__(server, empty=False, down_s=down_s, kill_worker=False)
        self.proxy = proxy

    def __call__(self, runner: Runner) -> None:
        self.runner = runner
        if not _wait(runner, *FAULT_AT, self.stop):
            return
        self.proxy.black_hole(self.down_s)
        self.proxy.wait_healed(self.down_s + 30)
        self.back_at = time.monotonic()
        final = runner.final_chk
        self.unfinished_when_back = final is None or runner.coordinator.stats.last_completed < final


@pytest.mark.parametrize(
    "down_s", [pytest.param(5.0, id="5s"), pytest.param(45.0, id="45s", marks=pytest.mark.slow)]
)
def test_a_dedup_job_stays_exact_when_redis_is_partitioned_away(
    kafka_endpoint: tuple[str, str], tmp_path: Path, down_s: float
) -> None:
    """A network partition between the job and Redis: requests hang instead of failing. Shorter
    than the client's 10 s socket timeout, they complete once it heals; longer, they time out
    and the store retries (its records wait; it gives up after 300 s and the task restarts).
    Either way no record passes unchecked: the output is exact."""
    seed = chaos_seed()
    server = private_redis(tmp_path / "redis")
    proxy = FaultProxy("127.0.0.1", server.port).start()
    fault = RedisPartition(server, proxy, down_s=down_s)
    url = f"redis://{proxy.address}/0"
    try:
        run = run_chaos(
            "dedup_window_count.py",
            brokers=kafka_endpoint[0],
            tmp=tmp_path,
            records=RECORDS,
            seed=seed,
            mode="aligned",
            interval=0.5,
            duplicates=0.10,
            env={"EOSFLOW_REDIS_URL": url, **ENV},
            during=fault,
        )
    finally:
        fault.stop.set()
        proxy.stop()
        kill_redis(fault.server, clean=True)
    assert fault.back_at is not None and fault.unfinished_when_back, "the partition missed the job"
    print(f"seed={seed} restarts={run.result.restarts} causes={run.result.restart_causes}")
    logs = "\n".join(run.logs.values())
    assert "RedisDataLost" not in logs
    if down_s > 10:  # past the socket timeout: a request timed out and was retried
        assert "dedup store unreachable, retrying" in logs
    assert_exactly_once(expected(expected_window_counts, RECORDS, seed), run.output, seed=seed)
