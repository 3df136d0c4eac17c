"""The job-administration API (:mod:`processor.admin`) called directly, as a user's tooling
does: status, list, savepoints and reset's refusal, on a state directory of the test's own (no
broker: nothing here reaches Kafka or Redis)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from processor.admin import JobAdmin, JobStatus, pid_alive
from processor.errors import JobNotFoundError, JobRunningError
from processor.runtime.job import default_snapshot_url, job_dir
from processor.snapshot.lease import JobLease
from processor.snapshot.store import SnapshotStore


def _dead_pid() -> int:
    """The pid of a process that ran and was reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _record(state_dir: Path, job: str, *, state: str, pid: int, **extra: Any) -> Path:
    """A ``status.json`` as the runner writes it
    (:mod:`processor.runtime.supervision.reporting`)."""
    status = {
        "job": job,
        "state": state,
        "pid": pid,
        "updated_ms": int(time.time() * 1000),
        "generation": 2,
        "restarts": 1,
        "restart_causes": ["worker 1 died"],
        "mode": "aligned",
        "runner": "local",
        "workers": [
            {"worker": 0, "pid": pid, "host": None, "connected": True},
            {"worker": 1, "pid": 99, "host": "elsewhere", "connected": False},
        ],
        "checkpoint": {
            "last_completed": 4,
            "last_duration_ms": 12,
            "completed": 4,
            "aborted": 0,
            "pending": None,
        },
        "records_in": 10,
        "records_out": 7,
        "source_lag": 0,
        "snapshot_url": default_snapshot_url(job, str(state_dir)),
        **extra,
    }
    directory = job_dir(job, str(state_dir))
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "status.json"
    path.write_text(json.dumps(status))
    return path


def _checkpoint(state_dir: Path, job: str, chk: int, **metadata: Any) -> SnapshotStore:
    store = SnapshotStore(default_snapshot_url(job, str(state_dir)))
    handle = store.write_task_snapshot(job, chk, "src.0", {"count": {"u": chk}})
    store.complete(job, chk, {"src.0": handle}, {"generation": 1, **metadata})
    return store


def test_status_reports_a_stopped_runner_and_its_workers_when_its_pid_is_gone(
    tmp_path: Path,
) -> None:
    path = _record(tmp_path, "clicks", state="running", pid=_dead_pid())
    found = JobAdmin(tmp_path).status("clicks")
    assert isinstance(found, JobStatus)
    assert (found.job, found.state, found.alive, found.path) == ("clicks", "running", False, path)
    assert [w.state for w in found.workers] == ["stopped", "stopped"]
    as_json = found.as_dict()
    assert as_json["alive"] is False and as_json["records_out"] == 7
    assert [w["state"] for w in as_json["workers"]] == ["stopped", "stopped"]


def test_status_tells_local_workers_from_remote_ones_when_the_runner_runs(
    tmp_path: Path,
) -> None:
    _record(tmp_path, "clicks", state="running", pid=os.getpid())
    found = JobAdmin(tmp_path).status("clicks")
    assert found.alive and pid_alive(os.getpid())
    assert [(w.worker, w.state) for w in found.workers] == [
        (0, "alive, connected"),
        (1, "not connected"),  # on another host: only the runner's connection tells
    ]


def test_status_without_a_name_is_the_most_recently_updated_job(tmp_path: Path) -> None:
    older = _record(tmp_path, "older", state="finished", pid=_dead_pid())
    _record(tmp_path, "newer", state="failed", pid=_dead_pid())
    os.utime(older, (time.time() - 60, time.time() - 60))
    found = JobAdmin(tmp_path).status()
    assert (found.job, found.state, found.alive) == ("newer", "failed", False)


def test_status_raises_job_not_found_when_nothing_or_not_that_job_is_recorded(
    tmp_path: Path,
) -> None:
    admin = JobAdmin(tmp_path)
    with pytest.raises(JobNotFoundError, match="no jobs recorded under"):
        admin.status()
    _record(tmp_path, "clicks", state="finished", pid=_dead_pid())
    with pytest.raises(LookupError, match="no status for job 'other'"):
        admin.status("other")


def test_list_jobs_gives_each_jobs_state_and_last_checkpoint_by_name(tmp_path: Path) -> None:
    _record(tmp_path, "b-finished", state="finished", pid=_dead_pid())
    _checkpoint(tmp_path, "b-finished", 3)
    _checkpoint(tmp_path, "b-finished", 4, drained=123)
    _record(tmp_path, "c-died", state="running", pid=_dead_pid())
    job_dir("a-never", str(tmp_path)).mkdir(parents=True)
    jobs = {j.job: j for j in JobAdmin(tmp_path).list_jobs()}
    assert list(jobs) == ["a-never", "b-finished", "c-died"]
    never, done, died = jobs.values()
    assert (never.state, never.last_checkpoint, never.records_out, never.runner_pid) == (
        "never ran", None, None, None,
    )  # fmt: skip
    assert never.snapshot_url == default_snapshot_url("a-never", str(tmp_path))
    assert (done.state, done.last_checkpoint, done.drained, done.records_out) == (
        "finished", 4, True, 7,
    )  # fmt: skip
    assert done.last_checkpoint_ms is not None
    assert (died.state, died.last_checkpoint, died.drained) == ("died", None, False)


def test_list_jobs_is_empty_when_no_job_is_recorded(tmp_path: Path) -> None:
    admin = JobAdmin(tmp_path)
    assert admin.list_jobs() == []
    assert admin.jobs_dir == tmp_path / "jobs"


def test_a_stopped_jobs_savepoint_copies_its_newest_checkpoint(tmp_path: Path) -> None:
    _record(tmp_path, "clicks", state="finished", pid=_dead_pid())
    _checkpoint(tmp_path, "clicks", 5)
    _checkpoint(tmp_path, "clicks", 6)
    taken = JobAdmin(tmp_path).savepoint("clicks", path=str(tmp_path / "sp"))
    assert (taken.job, taken.checkpoint_id) == ("clicks", 6)
    assert taken.path == str((tmp_path / "sp").resolve())
    assert (tmp_path / "sp" / "_SAVEPOINT").exists()


def test_a_savepoint_raises_job_not_found_when_the_job_has_no_checkpoint(tmp_path: Path) -> None:
    _record(tmp_path, "clicks", state="finished", pid=_dead_pid())
    with pytest.raises(JobNotFoundError, match="job 'clicks' has no completed checkpoint in"):
        JobAdmin(tmp_path).copy_checkpoint("clicks")


def test_reset_is_refused_and_deletes_nothing_when_the_job_runs(tmp_path: Path) -> None:
    _record(tmp_path, "clicks", state="running", pid=os.getpid())
    store = _checkpoint(tmp_path, "clicks", 2)
    lease = JobLease(store, "clicks")  # the running job's runner
    lease.acquire()
    asked: list[object] = []
    try:
        with pytest.raises(JobRunningError, match="is already running"):
            JobAdmin(tmp_path).reset("clicks", confirm=lambda plan: asked.append(plan) or True)
    finally:
        lease.release()
    assert asked == []  # refused before anything is listed or asked
    assert store.completed_ids("clicks") == [2]
    assert (job_dir("clicks", str(tmp_path)) / "status.json").exists()
