"""Savepoints (:mod:`processor.runtime.shape.savepoints`): the copy out of the checkpoints,
the copy back when retention (or a user) deleted the checkpoint, every refusal, and checkpoint ids
that never go back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from processor.errors import ConfigError, SnapshotError
from processor.runtime.checkpoints.coordinator import LAST_CHECKPOINT, CheckpointCoordinator
from processor.runtime.shape.savepoints import restore_savepoint, write_savepoint
from processor.snapshot.store import SnapshotStore

JOB = "sp-job"


def _checkpoint(store: SnapshotStore, chk: int, value: int) -> None:
    handles = {
        task: store.write_task_snapshot(JOB, chk, task, {"count": {"u": value}, "task": task})
        for task in ("src.0", "src.1")
    }
    store.complete(JOB, chk, handles, {"generation": 1})
    store.write_job_file(JOB, LAST_CHECKPOINT, str(chk).encode())


def _store(tmp_path: Path) -> SnapshotStore:
    return SnapshotStore((tmp_path / "store").as_uri())


def test_a_savepoint_restores_after_its_checkpoint_was_deleted(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _checkpoint(store, 7, 42)
    path = write_savepoint(store, store.load(JOB, 7), stop=True)
    assert path.endswith(f"/_savepoints/{JOB}/sp-0000000007")
    marker = json.loads((Path(path.removeprefix("file://")) / "_SAVEPOINT").read_text())
    assert marker["checkpoint_id"] == 7 and marker["stop"] is True
    store.delete_job(JOB)  # every checkpoint and job file (eosflow reset), not the savepoints
    assert store.latest_completed(JOB) is None
    assert restore_savepoint(store, JOB, path) == (7, True)
    latest = store.latest_completed(JOB)
    assert latest is not None and latest.checkpoint_id == 7
    assert store.read_task_snapshot(latest.tasks["src.1"]) == {"count": {"u": 42}, "task": "src.1"}
    # the checkpoint is still there: restoring again changes nothing
    assert restore_savepoint(store, JOB, path) == (7, False)


def test_a_savepoint_elsewhere_restores_into_the_store(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _checkpoint(store, 3, 1)
    path = write_savepoint(store, store.load(JOB, 3), path=str(tmp_path / "elsewhere"))
    other = SnapshotStore((tmp_path / "other-store").as_uri())
    assert restore_savepoint(other, JOB, path) == (3, True)
    assert other.completed_ids(JOB) == [3]


def test_restores_that_would_not_be_the_jobs_newest_state_are_refused(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _checkpoint(store, 5, 1)
    path = write_savepoint(store, store.load(JOB, 5))
    with pytest.raises(ConfigError, match="of job 'sp-job', not 'other'"):
        restore_savepoint(store, "other", path)
    _checkpoint(store, 6, 2)
    with pytest.raises(ConfigError, match=r"completed checkpoints \[6\] newer than savepoint"):
        restore_savepoint(store, JOB, path)
    store.delete_job(JOB)
    store.write_job_file(JOB, LAST_CHECKPOINT, b"6")  # 6 committed output, then was deleted
    with pytest.raises(ConfigError, match="--allow-rewind"):
        restore_savepoint(store, JOB, path)
    assert restore_savepoint(store, JOB, path, allow_rewind=True) == (5, True)
    coordinator = CheckpointCoordinator(store, JOB, ["src.0", "src.1"], interval_s=1.0)
    assert coordinator.next_id == 7  # ids never go back: sinks key output by checkpoint id


def test_an_interrupted_or_damaged_savepoint_is_refused_and_never_becomes_a_checkpoint(
    tmp_path: Path,
) -> None:
    store = _store(tmp_path)
    _checkpoint(store, 2, 1)
    path = Path(write_savepoint(store, store.load(JOB, 2)).removeprefix("file://"))
    (path / "_SAVEPOINT").unlink()
    with pytest.raises(ConfigError, match="not a complete savepoint"):
        restore_savepoint(store, JOB, str(path))
    path = Path(write_savepoint(store, store.load(JOB, 2)).removeprefix("file://"))
    snap = next(path.glob("src.0*.snap"))
    snap.write_bytes(snap.read_bytes()[:-3] + b"xyz")
    store.delete_job(JOB)
    with pytest.raises(SnapshotError):
        restore_savepoint(store, JOB, str(path))
    assert store.completed_ids(JOB) == []  # no manifest: not a completed checkpoint


def test_the_savepoint_command_copies_a_stopped_jobs_newest_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from processor.cli import main

    monkeypatch.setenv("EOSFLOW_STATE_DIR", str(tmp_path / "state"))
    store = _store(tmp_path)
    assert main(["savepoint", JOB, "--snapshot-url", store.url]) == 1
    assert "has no completed checkpoint" in capsys.readouterr().err
    _checkpoint(store, 4, 9)
    _checkpoint(store, 5, 10)
    assert main(["savepoint", JOB, "--snapshot-url", store.url]) == 0
    out = capsys.readouterr().out
    assert "is not running: savepoint of its checkpoint 5" in out
    path = out.strip().splitlines()[-1]
    assert path.endswith("sp-0000000005")
    store.delete_job(JOB)
    assert restore_savepoint(store, JOB, path) == (5, True)


def test_a_reset_job_restores_a_savepoint_only_into_its_own_checkpoint_and_ids_go_on(
    tmp_path: Path,
) -> None:
    """Regressions (review): a new run's checkpoint with the savepoint's id was taken for the
    savepoint's; after a reset, ids started again below the savepoint's newest."""
    store = _store(tmp_path)
    _checkpoint(store, 5, 1)
    _checkpoint(store, 6, 2)
    path = write_savepoint(store, store.load(JOB, 5))
    store.delete_job(JOB)  # eosflow reset
    _checkpoint(store, 5, 99)  # a new run of the job, up to the same id
    with pytest.raises(ConfigError, match="is not savepoint"):
        restore_savepoint(store, JOB, path)
    store.delete_job(JOB)
    assert restore_savepoint(store, JOB, path, allow_rewind=True) == (5, True)
    coordinator = CheckpointCoordinator(store, JOB, ["src.0", "src.1"], interval_s=1.0)
    assert coordinator.next_id == 7  # after 6, the newest the job had when it was saved


def test_an_unaligned_checkpoint_is_not_a_savepoint(tmp_path: Path) -> None:
    store = _store(tmp_path)
    handle = store.write_task_snapshot(JOB, 2, "src.0", {})
    store.complete(JOB, 2, {"src.0": handle}, {"aligned": False})
    with pytest.raises(ConfigError, match="is unaligned"):
        write_savepoint(store, store.load(JOB, 2))


def test_the_default_savepoint_of_a_jobs_own_store_is_outside_the_job_directory(
    tmp_path: Path,
) -> None:
    """Regression (review): the default store lives in the job's directory, which
    ``eosflow reset`` deletes, and the savepoints went with it."""
    from processor.runtime.job import default_snapshot_url
    from processor.runtime.shape.savepoints import default_path

    store = SnapshotStore(default_snapshot_url(JOB, str(tmp_path / "state")))
    assert default_path(store, JOB, 3) == (tmp_path / "state").resolve().as_uri() + (
        f"/savepoints/{JOB}/sp-0000000003"
    )
