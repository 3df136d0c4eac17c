"""What a running job tells its user (issue 37, "honest status"): the progress line, status.json
and the run's result from one tally of counters and lag, across restarts, with honest rates,
repeated restart causes shown once, and what the workers wait on. No job runs: worker stats and
heartbeats are fed by hand, with a manual clock."""

from __future__ import annotations

import io
import json
import re
import threading
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from processor.compiler import compile_flow
from processor.dataflow import Dataflow
from processor.runtime.checkpoints.coordinator import CheckpointCoordinator
from processor.runtime.control import Connection
from processor.runtime.job import Generation, JobFailed, RunOptions, WorkerHandle
from processor.runtime.observe.metrics import JobMetrics
from processor.runtime.observe.tally import Tally, describe_waits, waits
from processor.runtime.supervision.lifecycle import RestartBudget, collapse_causes, describe_cause
from processor.runtime.supervision.reporting import Reporter
from processor.runtime.waits import Waits
from processor.snapshot.store import SnapshotStore
from sinks import ConsoleSink


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _plan() -> Any:
    flow = Dataflow("report-job")
    (
        flow.source("clicks", "clicks-topic")
        .key_by("by-user", lambda v: v)
        .count("count")
        .sink("out", ConsoleSink())
    )
    return compile_flow(flow, 1)


def _stats(n_in: int, sunk: int, lag: int, channel: str) -> dict[str, Any]:
    """A source task's and a downstream sink task's stats, as a worker sends them."""
    return {
        "clicks.0": {"in": n_in, "sunk": 0, "lag": 0, "parts": [["clicks-topic", 0, lag]]},
        "count.0": {"in": n_in, "sunk": sunk, "dups": 2, "parts": [[channel, 0, 7]]},
    }


class _Setup:
    def __init__(self, tmp_path: Path, **options: Any) -> None:
        self.clock = Clock()
        self.out = io.StringIO()
        self.options = RunOptions(progress=self.out, **options)
        self.plan = _plan()
        self.current = Generation(tmp_path, 1)
        self.current.number = 1
        self.current.begin()
        self.budget = RestartBudget("report-job", self.options, tmp_path, clock=self.clock)
        self.reporter = Reporter(
            "report-job", tmp_path, self.options, runner="local", current=self.current,
            budget=self.budget, snapshot_url="file:///x", clock=self.clock,
        )  # fmt: skip
        store = SnapshotStore((tmp_path / "chk").as_uri())
        coordinator = CheckpointCoordinator(
            store, "report-job", ["clicks.0", "count.0"], interval_s=None
        )
        self.metrics = JobMetrics(self.plan, runner="local", mode="aligned", recovery="global")
        self.reporter.open(self.plan, coordinator, self.metrics, None)
        self.channel = next(iter(self.metrics.channels))
        self.dir = tmp_path

    def stats(self, worker: WorkerHandle, generation: int, n_in: int, sunk: int, lag: int) -> None:
        """What the runner does with a ``stats`` message."""
        worker.stats = _stats(n_in, sunk, lag, self.channel)
        self.metrics.on_stats(worker, generation, worker.stats)

    def status(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.dir / "status.json").read_text())
        return data

    def lines(self) -> list[str]:
        return self.out.getvalue().splitlines()


def test_totals_survive_a_restart_when_the_new_generation_reads_nothing(tmp_path: Path) -> None:
    """Regression: after a restart the final line read ``0 records in, 0 out`` although
    44,140 records were read and 1,050 written: only the current generation's workers counted."""
    s = _Setup(tmp_path)
    first = s.current.workers[0]
    first.pid = 100
    s.stats(first, 1, 44_140, 1_050, 0)
    s.current.number = 2
    s.current.begin()  # the new generation: its worker read nothing new (all was checkpointed)
    second = s.current.workers[0]
    second.pid = 101
    s.stats(second, 2, 0, 0, 0)
    s.reporter.status("finished")
    result = s.reporter.result()
    assert (result.records_in, result.records_out) == (44_140, 1_050)
    st = s.status()
    assert (st["records_in"], st["records_out"], st["duplicates_dropped"]) == (44_140, 1_050, 4)


def test_copies_the_replay_checks_dropped_count_over_every_worker_process_of_a_local_recovery(
    tmp_path: Path,
) -> None:
    """Regression: under local recovery, a task's ``replayed`` (copies its replay check dropped)
    went back to 0 when its own worker was killed later, so ``status.json`` showed none after
    a run with seven kills (a test that needed copies to have come failed in CI). The run's
    count is over every worker process, like the other counters."""
    s = _Setup(tmp_path)
    survivor = s.current.workers[0]
    survivor.pid = 100
    survivor.stats = {"count.0": {"in": 50, "sunk": 50, "replayed": 7}}
    s.metrics.on_stats(survivor, 1, survivor.stats)
    survivor.pid = 102  # killed later itself: its new process dropped 3 more copies
    survivor.stats = {"count.0": {"in": 10, "sunk": 10, "replayed": 3}}
    s.metrics.on_stats(survivor, 1, survivor.stats)
    s.reporter.report(force=True)
    assert "copies_dropped=10" in s.lines()[-1]
    s.reporter.status("finished")
    assert s.status()["replay_copies_dropped"] == 10
    scrape = generate_latest(s.metrics.registry).decode()
    assert re.search(r"^eosflow_replay_copies_dropped_total\{[^}]*\} 10\.0$", scrape, re.M), scrape


def test_source_lag_is_shown_in_an_unbounded_run_from_the_readers_per_partition_lag(
    tmp_path: Path,
) -> None:
    """Regression: ``eosflow status`` said ``source lag 0`` while ``/metrics`` showed about
    36,000: the progress line and status.json counted lag only with ``--until-idle``."""
    s = _Setup(tmp_path)  # unbounded: no --until-idle
    w = s.current.workers[0]
    w.pid = 100
    s.stats(w, 1, 500, 10, 36_000)
    s.reporter.report(force=True)
    assert "lag=36,000" in s.lines()[-1]  # the channel's 7 queued records are not source lag
    assert s.status()["source_lag"] == 36_000
    snap = s.metrics.snapshot
    assert [p for p in snap.parts if p[0] == "clicks-topic"] == [("clicks-topic", 0, 36_000)]


def test_the_rate_is_never_computed_over_a_tiny_interval_and_the_final_line_is_the_average(
    tmp_path: Path,
) -> None:
    """Regression: the last progress line of a ``--max-rate 1500`` run showed ``(13,441/s)``:
    the forced final report came 0.1 s after the previous one, with the workers' last second of
    counters."""
    s = _Setup(tmp_path)
    s.reporter.mark_ready()
    w = s.current.workers[0]
    w.pid = 100
    for second in range(1, 11):  # 1,500 records a second, counters sent once a second
        s.clock.now += 1.0
        s.stats(w, 1, 1_500 * second, 0, 0)
        s.reporter.report(force=True)
    assert "(1,500/s)" in s.lines()[-1]
    s.clock.now += 0.1  # the final counts come just after the last report
    s.stats(w, 1, 1_500 * 11, 0, 0)
    s.reporter.report(force=True)
    rate = float(s.lines()[-1].split("(")[1].split("/s")[0].replace(",", ""))
    assert 1_400 <= rate <= 1_800, s.lines()[-1]  # over the last 5 s, not the last 0.1 s
    s.reporter.report(force=True, final=True)
    assert "(1,634/s average)" in s.lines()[-1]  # 16,500 records in 10.1 s


def test_a_restart_cause_that_repeats_is_shown_once_with_its_count(tmp_path: Path) -> None:
    """Regression: a job that failed after 11 restarts repeated the same 900-character cause
    10 times, in status.json and ``eosflow status``."""
    s = _Setup(tmp_path, max_restarts=10, restart_window=3600.0)
    cause = "worker {w} exit code 1 (worker={w} failed: KafkaException: " + "x" * 900 + ")"
    s.budget.count("worker 0 killed by signal SIGKILL")
    for i in range(11):
        s.clock.now += 1
        s.budget.count(cause.format(w=i % 2))
    s.reporter.status("running")
    listed = s.status()["restart_causes"]
    assert [c["count"] for c in listed] == [1, 11]
    assert listed[1]["cause"] == cause.format(w=0) and listed[1]["first_ms"] <= listed[1]["last_ms"]
    assert describe_cause(listed[1]).startswith("11 times (")
    assert s.budget.said(cause.format(w=0)).startswith("the same failure again (11 in a row)")
    with pytest.raises(JobFailed) as failed:
        for _ in range(12):
            s.budget.check(cause.format(w=1), 0)
    message = str(failed.value)
    assert message.count("x" * 900) == 1, message
    assert "this failure 11 times" in message and "1 times: worker 0 killed" in message


def test_collapse_keeps_different_failures_apart_in_the_order_they_first_came() -> None:
    got = collapse_causes(["a 1", "b", "a 2", "a 3"], [10, 20, 30, 40])
    assert got == [
        {"cause": "a 3", "count": 3, "first_ms": 10, "last_ms": 40},
        {"cause": "b", "count": 1, "first_ms": 20, "last_ms": 20},
    ]


def test_what_a_worker_waits_on_shows_in_the_progress_line_and_status(tmp_path: Path) -> None:
    s = _Setup(tmp_path)
    w = s.current.workers[0]
    w.pid, w.conn = 100, Connection.__new__(Connection)  # connected (never used)
    on = "the dedup store of step 'unique' (redis://127.0.0.1:6379/0)"
    w.waits = [{"on": on, "since_ms": 1_764_000_000_000, "for_s": 1.5}]
    w.waits_at = s.clock.now
    s.clock.now += 2.0  # the heartbeat came 2 s ago: the wait is 3.5 s old now
    s.reporter.report(force=True)
    assert s.lines()[-1].endswith(f"waiting: worker 0 on {on} for 4 s"), s.lines()[-1]
    assert s.status()["waiting"] == [
        {"worker": 0, "on": on, "since_ms": 1_764_000_000_000, "for_s": 3.5}
    ]
    w.waits = []  # the next heartbeat says nothing waits
    s.reporter.report(force=True)
    assert "waiting" not in s.lines()[-1] and s.status()["waiting"] == []


def test_the_waits_registry_reports_only_waits_that_last_and_forgets_them_on_exit() -> None:
    clock = Clock()
    registry = Waits(clock=clock, wall=lambda: 1_764_000_000.0)
    with registry.waiting("the broker"):
        assert registry.report(at_least_s=0.5) == []  # short waits are normal work
        clock.now += 0.6
        with registry.waiting("sink 'out' (its commit of checkpoint 3)"):
            clock.now += 1.0
            got = registry.report(at_least_s=0.5)
        assert [(w["on"], w["for_s"]) for w in got] == [
            ("the broker", 1.6),
            ("sink 'out' (its commit of checkpoint 3)", 1.0),
        ]
        assert got[0]["since_ms"] == 1_764_000_000_000
    with pytest.raises(ValueError), registry.waiting("the dedup store"):
        raise ValueError("a failed call leaves no wait behind")
    assert registry.current() == []


def test_a_wait_in_another_thread_is_seen_while_it_blocks() -> None:
    """The heartbeat thread reads what the task loop's thread waits on, while it waits."""
    registry = Waits()
    entered, release = threading.Event(), threading.Event()

    def blocked() -> None:
        with registry.waiting("the dedup store"):
            entered.set()
            release.wait(5)

    t = threading.Thread(target=blocked)
    t.start()
    assert entered.wait(5)
    assert [w.on for w in registry.current()] == ["the dedup store"]
    release.set()
    t.join(5)
    assert registry.current() == []


def test_waits_of_a_disconnected_worker_are_not_shown() -> None:
    w = WorkerHandle(1, pid=5)
    w.waits, w.waits_at = [{"on": "x", "since_ms": 0, "for_s": 9.0}], 0.0
    assert waits([w], now=1.0) == [] and describe_waits([]) == ""


def test_the_tally_counts_every_incarnation_and_the_current_workers_lag() -> None:
    plan = _plan()
    tally = Tally(plan)
    channel = next(e.topic for e in plan.edges)
    tally.on_stats(1, 0, 100, _stats(10, 4, 3, channel))
    tally.on_stats(1, 0, 101, _stats(5, 1, 2, channel))  # local recovery: another process
    totals = tally.totals()
    assert (totals["in"], totals["sunk"], totals["dups"]) == (15, 5, 4)
    now = WorkerHandle(0, pid=101, stats=_stats(5, 1, 2, channel))
    assert tally.source_lag([now]) == 2
    assert tally.parts([now]) == sorted([("clicks-topic", 0, 2), (channel, 0, 7)])


def test_eosflow_status_prints_each_cause_once_and_what_the_workers_wait_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    from processor import cli_jobs

    monkeypatch.setenv("EOSFLOW_STATE_DIR", str(tmp_path))
    monkeypatch.setattr(cli_jobs, "_print_group", lambda _job: None)  # no broker here
    directory = tmp_path / "jobs" / "report-job"
    directory.mkdir(parents=True)
    s = _Setup(directory)
    for _ in range(10):
        s.budget.count("worker 1 exit code 1 (" + "y" * 900 + ")")
    w = s.current.workers[0]
    w.pid, w.conn = 100, Connection.__new__(Connection)
    on = "sink 'out' (its commit of checkpoint 7)"
    w.waits, w.waits_at = [{"on": on, "since_ms": 1_764_000_000_000, "for_s": 2.0}], s.clock.now
    s.stats(w, 1, 500, 10, 36_000)
    s.reporter.status("running")
    assert cli_jobs.status(argparse.Namespace(job="report-job", json=False)) == 0
    out = capsys.readouterr().out
    assert out.count("y" * 900) == 1 and "restart    10 times (" in out, out
    assert f"waiting    worker 0 on {on} since " in out and "source lag 36,000" in out, out


def test_a_checkpoint_pending_for_long_is_named_with_the_tasks_it_waits_for(
    tmp_path: Path,
) -> None:
    """A barrier or a commit that does not get through (a broker cut off while the channel
    writers hold records): the progress line says which checkpoint, for how long, and whose
    ack is missing, instead of only the last completed one."""
    s = _Setup(tmp_path)
    coordinator = s.reporter.coordinator
    coordinator.clock = s.clock
    chk = coordinator.trigger_now()
    s.reporter.report(force=True)
    assert "pending=" not in s.lines()[-1]  # a checkpoint in progress is normal
    s.clock.now += 12.0
    s.reporter.report(force=True)
    assert s.lines()[-1].endswith(f" pending={chk} for 12 s (no ack from clicks.0, count.0)")


def test_a_worker_without_hello_shows_waiting_on_its_start(tmp_path: Path) -> None:
    """A local worker whose process started but has not said hello (the pipeline file's
    imports, a model loaded at its top level) is named once past a usual start, then not once
    it connected."""
    s = _Setup(tmp_path)
    w = s.current.workers[0]
    w.pid, w.started = 100, s.clock.now  # what the local runner sets when it starts it
    s.clock.now += 4.0
    s.reporter.report(force=True)
    assert "waiting" not in s.lines()[-1] and s.status()["waiting"] == []
    s.clock.now += 8.0
    s.reporter.report(force=True)
    on = "its start (no hello yet; see worker-0.log)"
    assert s.lines()[-1].endswith(f"waiting: worker 0 on {on} for 12 s"), s.lines()[-1]
    assert [(x["worker"], x["on"], x["for_s"]) for x in s.status()["waiting"]] == [(0, on, 12.0)]
    w.conn = Connection.__new__(Connection)  # it said hello
    s.reporter.report(force=True)
    assert "waiting" not in s.lines()[-1] and s.status()["waiting"] == []
