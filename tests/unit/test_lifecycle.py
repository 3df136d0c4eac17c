"""How a run ends (processor.runtime.supervision.lifecycle): the restart budget and the stop
controller, each built alone from run options and a manual clock, without a runner."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from processor.runtime.job import JobFailed, RunOptions
from processor.runtime.supervision.lifecycle import (
    RestartBudget,
    StopController,
    same_cause,
    same_kind,
)

LOST = (
    "worker {w} exit code 1 (worker={w} failed: DataLossError: clicks[{p}]: the checkpoint's "
    "position {o} is beyond the partition's end 50: the topic or the broker was recreated)"
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _budget(clock: Clock, **options: float) -> RestartBudget:
    return RestartBudget("j", RunOptions(**options), Path("/state/j"), clock=clock)  # type: ignore[arg-type]


def _stop(clock: Clock, said: list[str], last: int = 0, **options: float) -> StopController:
    return StopController(
        "j",
        RunOptions(**options),  # type: ignore[arg-type]
        say=said.append,
        last_completed=lambda: last,
        clock=clock,
    )


def test_a_deterministic_failure_is_the_same_whichever_worker_or_partition_shows_it_first() -> None:
    """Seen in CI: the workers race, so one generation fails on clicks[3] in worker 1 and the
    next on clicks[6] in worker 0; a comparison by worker number only kept restarting (49 s)."""
    first, second = LOST.format(w=1, p=3, o=512), LOST.format(w=0, p=6, o=498)
    assert not same_cause(first, second)
    assert same_kind(first, second)
    other = first.replace("DataLossError", "KafkaClientError")
    assert not same_kind(first, other)


# -- the restart budget --------------------------------------------------------------------------


def test_a_configuration_a_worker_refuses_twice_fails_the_job_after_one_restart() -> None:
    """Seen running the README example after ``eosflow reset``: a file sink refusing another
    run's part files (a ConfigError in every worker's start) restarted 10 times over 60 s."""
    clock = Clock()
    budget = _budget(clock)
    refused = (
        "worker {w} exit code 1 (worker={w} failed: ConfigError: file sink step='out' "
        "subtask={w}: out/running-total holds part files up to checkpoint 1, but the newest "
        "completed checkpoint of job 'running-total' is none)"
    )
    budget.count(refused.format(w=0))
    budget.check_start(refused.format(w=0), True)  # the workers all started, then refused
    budget.check(refused.format(w=0), 0)  # once: one restart is tried
    budget.count(refused.format(w=1))
    budget.check_start(refused.format(w=1), True)
    with pytest.raises(JobFailed, match=r"the same failure again after a restart.*ConfigError"):
        budget.check(refused.format(w=1), 0)
    # Before the workers all started, the start-up rule (3 in a row) decides instead.
    early = _budget(clock)
    for _ in range(2):
        early.count(refused.format(w=0))
        early.check_start(refused.format(w=0), False)
        early.check(refused.format(w=0), 0)


def test_restarts_are_limited_per_window_not_per_lifetime() -> None:
    """(Was an e2e test reaching the budget through a runner.)"""
    clock = Clock()
    budget = _budget(clock, max_restarts=1)
    budget.count("worker 0 exit code 1 (SIGKILL)")
    budget.check("worker 0 exit code 1 (SIGKILL)", 0)
    budget.count("worker 1 exit code 1 (disk full)")
    with pytest.raises(JobFailed, match=r"2 restarts within 300s \(at most --max-restarts 1"):
        budget.check("worker 1 exit code 1 (disk full)", 1)
    clock.now += 301  # the earlier restarts are out of the window
    budget.count("worker 0 exit code 1 (SIGKILL)")
    budget.check("worker 0 exit code 1 (SIGKILL)", 2)
    assert budget.restarts == 3 and budget.restart_count() == "1/1"


def test_restarts_in_a_row_without_a_checkpoint_fail_the_job_however_slowly_they_come() -> None:
    """Broke (issue 35, item 8): a broker answering NOT_COORDINATOR for ever (Kafka 2.3 after
    a ZooKeeper session expiry) failed each attempt after 30 s of retries, so the restarts
    never filled the 300 s window and the job looped for 7 minutes showing restart=11/10.
    (Was an e2e test reaching the budget through a runner.)"""
    clock = Clock()
    budget = _budget(clock, max_restarts=2)
    cause = "worker 0: init_transactions: Broker: Not coordinator (code=NOT_COORDINATOR)"
    for n in (1, 2):
        budget.count(cause)
        budget.check(cause, 0)
        clock.now += 1000  # each restart came long after the one before
        assert budget.restart_count() == f"{n}/2"
    budget.count(cause)
    with pytest.raises(JobFailed, match=r"3 restarts in a row completed no checkpoint.*NOT_COORD"):
        budget.check(cause, 0)


def test_a_completed_checkpoint_between_restarts_starts_the_count_in_a_row_again() -> None:
    clock = Clock()
    budget = _budget(clock, max_restarts=2)
    for completed in (0, 4, 9, 12):  # each restart after a new checkpoint completed
        budget.count("worker 1 exit code 1")
        budget.check("worker 1 exit code 1", completed)
        clock.now += 1000
    assert budget.restart_count() == "1/2" and budget.restarts == 4


def test_the_same_deterministic_failure_right_after_a_restart_fails_at_once() -> None:
    budget = _budget(Clock(), max_restarts=10)
    first, second = LOST.format(w=1, p=3, o=512), LOST.format(w=0, p=6, o=498)
    budget.count(first)
    budget.check(first, 0)
    budget.count(second)
    with pytest.raises(JobFailed, match="the same failure again after a restart"):
        budget.check(second, 0)


def test_the_same_failure_three_times_before_the_workers_started_fails_the_job() -> None:
    budget = _budget(Clock(), max_restarts=10)
    cause = "worker {w} exit code 1 (compiled differently in worker {w})"
    for w in (0, 1):
        budget.count(cause.format(w=w))
        budget.check_start(cause.format(w=w), started=False)
    budget.count(cause.format(w=0))
    with pytest.raises(JobFailed, match=r"failed 3 times in a row before they all started"):
        budget.check_start(cause.format(w=0), started=False)
    # A generation whose workers all started resets the count.
    again = _budget(Clock(), max_restarts=10)
    for started in (False, False, True, False, False):
        again.count(cause.format(w=0))
        again.check_start(cause.format(w=0), started=started)


def test_the_first_restart_is_immediate_and_the_backoff_doubles_from_the_second_to_its_cap() -> (
    None
):
    """Regression (issue 38): a single SIGKILLed worker waited the whole 0.5 s backoff before
    its replacement was spawned, a quarter of the 2 s recovery goal."""
    clock = Clock()
    budget = _budget(clock, max_restarts=10, restart_backoff=0.5, max_backoff=3.0)
    waits = []
    for n in range(5):
        budget.count("x")
        budget.check("x", n)
        waits.append(budget.backoff())
    assert waits == [0.0, 0.5, 1.0, 2.0, 3.0]
    clock.now += 301  # the window forgot them: a failure alone again
    budget.count("x")
    budget.check("x", 9)
    assert budget.backoff() == 0.0


# -- the stop controller -------------------------------------------------------------------------


def test_a_stop_asks_once_for_a_final_checkpoint_and_says_how_long_it_waits() -> None:
    said: list[str] = []
    stop = _stop(Clock(), said, stop_timeout=30.0)
    assert stop.stopping is None and not stop.wants_final(drained=False)
    stop.stop_for("SIGTERM")
    stop.stop_for("savepoint --stop")  # the first reason stands
    assert stop.stopping == "SIGTERM" and stop.wants_final(drained=False)
    assert said == ["SIGTERM: stopping after a final checkpoint (waiting at most 30s)"]


def test_a_bounded_run_wants_its_final_checkpoint_once_every_source_drained() -> None:
    options = RunOptions(until_idle=True)
    stop = StopController("j", options, say=lambda _t: None, last_completed=lambda: 0)
    assert not stop.wants_final(drained=False) and stop.wants_final(drained=True)
    options.until_idle = False  # read as the run goes (the test kit holds a final this way)
    assert not stop.wants_final(drained=True)


def test_a_stop_whose_final_checkpoint_does_not_complete_fails_after_the_stop_timeout() -> None:
    clock, said = Clock(), []
    stop = _stop(clock, said, last=5, stop_timeout=25.0)
    stop.check_deadline(["a.0"], None)  # not stopping: nothing to wait for
    stop.stop_for("SIGINT")
    clock.now += 10
    stop.check_deadline(["a.0"], None)
    assert said[-1] == "SIGINT: still waiting for the final checkpoint (15s left)"
    clock.now += 15
    with pytest.raises(JobFailed) as failed:
        stop.check_deadline(["a.0"], "worker 1 exit code 1")
    assert str(failed.value) == (
        "SIGINT: the final checkpoint did not complete within --stop-timeout 25s; no ack from "
        "['a.0'] (last restart: worker 1 exit code 1): stopping without the final checkpoint; "
        "nothing is lost or duplicated: the output since checkpoint 5 is not committed, and the "
        "next run of this job resumes from checkpoint 5"
    )


def test_a_final_commit_that_never_comes_fails_the_run_after_the_stop_timeout() -> None:
    """Broke (issue 35, item 5): a run waited for every task's ``committed`` with no deadline
    once its final checkpoint completed (a PostgreSQL ``COMMIT PREPARED`` stuck for ever held
    ``--until-idle`` while heartbeats kept flowing)."""
    clock = Clock()
    stop = _stop(clock, [], stop_timeout=0.0)
    stop.final_triggered(7)
    stop.on_committed(7, "a")
    assert not stop.final_committed({"a", "b"}, 7)  # the deadline starts
    clock.now += 0.1
    with pytest.raises(JobFailed, match=r"final checkpoint 7 completed, but tasks \['b'\]"):
        stop.final_committed({"a", "b"}, 7)
    # not completed yet: no deadline runs
    assert not stop.final_committed({"a", "b"}, 6)
    clock.now += 1
    assert not stop.final_committed({"a", "b"}, 6)


def test_the_run_ends_when_every_task_committed_the_final_checkpoint_and_a_restart_forgets_it() -> (
    None
):
    stop = _stop(Clock(), [])
    assert not stop.final_committed({"a", "b"}, 0)  # no final checkpoint yet
    stop.final_triggered(3)
    stop.on_committed(3, "a")
    stop.on_committed(2, "b")  # an earlier checkpoint's commit does not count
    assert not stop.final_committed({"a", "b"}, 3)
    stop.restarted()
    assert stop.final is None and stop.committed == {}
    stop.final_triggered(4)
    stop.on_committed(4, "a")
    stop.on_committed(4, "b")
    assert stop.final_committed({"a", "b"}, 4)


def test_a_second_signal_stops_at_once_without_the_final_checkpoint() -> None:
    said: list[str] = []
    stop = _stop(Clock(), said, last=9)
    old = stop.install_signals()  # pytest runs tests on the main thread
    try:
        assert set(old) == {signal.SIGINT, signal.SIGTERM}
        signal.raise_signal(signal.SIGTERM)
        assert stop.stopping == "SIGTERM"
        assert said[-1].endswith("(waiting at most 120s; SIGTERM again stops at once without it)")
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)
        assert said[-1].startswith("SIGTERM again: stopping without the final checkpoint")
        assert "since checkpoint 9 is not committed" in said[-1]
    finally:
        StopController.restore_signals(old)
    assert signal.getsignal(signal.SIGTERM) == old[signal.SIGTERM]
