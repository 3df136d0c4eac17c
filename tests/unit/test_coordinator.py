"""The checkpoint coordinator with a manual clock and a real (file) snapshot store."""

from __future__ import annotations

from pathlib import Path

import pytest

from processor.runtime.checkpoints.coordinator import CheckpointCoordinator
from processor.snapshot.store import SnapshotStore


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _coordinator(tmp_path: Path, clock: Clock, **kw: object) -> CheckpointCoordinator:
    store = SnapshotStore(tmp_path.as_uri(), clock=lambda: 1.0)
    c = CheckpointCoordinator(
        store,
        "job",
        ["a.0", "b.0"],
        interval_s=1.0,
        timeout_s=5.0,
        clock=clock,
        **kw,  # type: ignore[arg-type]
    )
    c.start_generation(1)
    return c


def _ack(c: CheckpointCoordinator, chk: int, task: str) -> bool:
    handle = c.store.write_task_snapshot("job", chk, task, {"task": task})
    return c.on_ack(chk, task, handle)


def test_checkpoint_completes_only_when_every_task_acked(tmp_path: Path) -> None:
    clock = Clock()
    c = _coordinator(tmp_path, clock)
    assert c.due() is None
    clock.now = 1.0
    assert c.due() == 1
    assert c.due() is None  # one pending at a time
    assert not _ack(c, 1, "a.0")
    assert c.store.latest_completed("job") is None
    assert _ack(c, 1, "b.0")
    manifest = c.store.latest_completed("job")
    assert manifest is not None and manifest.checkpoint_id == 1
    assert manifest.metadata["generation"] == 1
    assert c.stats.completed == 1


def test_pending_checkpoint_is_aborted_when_it_times_out(tmp_path: Path) -> None:
    clock = Clock()
    c = _coordinator(tmp_path, clock)
    clock.now = 1.0
    chk = c.due()
    assert chk == 1
    _ack(c, 1, "a.0")
    clock.now = 5.9
    assert c.expired() is None
    clock.now = 6.1
    assert c.expired() == 1
    assert not _ack(c, 1, "b.0")  # late ack of an aborted checkpoint
    assert c.store.latest_completed("job") is None
    clock.now = 7.2
    assert c.due() == 2


def test_checkpoint_ids_keep_growing_when_a_new_coordinator_starts(tmp_path: Path) -> None:
    clock = Clock()
    c = _coordinator(tmp_path, clock)
    clock.now = 1.0
    c.due()
    _ack(c, 1, "a.0")  # checkpoint 1 stays pending: a directory without a manifest
    again = _coordinator(tmp_path, clock)
    assert again.trigger_now() == 2
    assert again.stats.last_completed == 0


def test_old_checkpoints_are_deleted_when_more_than_keep_completed(tmp_path: Path) -> None:
    clock = Clock()
    c = _coordinator(tmp_path, clock, keep=2)
    for chk in range(1, 5):
        assert c.trigger_now() == chk
        _ack(c, chk, "a.0")
        _ack(c, chk, "b.0")
    assert c.store.completed_ids("job") == [3, 4]


def test_new_generation_voids_the_pending_checkpoint(tmp_path: Path) -> None:
    clock = Clock()
    c = _coordinator(tmp_path, clock)
    assert c.trigger_now() == 1
    c.start_generation(2)
    assert c.pending is None and c.stats.aborted == 1
    assert c.trigger_now() == 2


def test_timeouts_in_a_row_are_counted_until_a_checkpoint_completes(tmp_path: Path) -> None:
    """What the runner's stuck-worker rule reads (processor/runtime/supervision/health.py)."""
    clock = Clock()
    c = _coordinator(tmp_path, clock)
    for n in (1, 2):
        clock.now += 1.1
        assert c.due() == n
        _ack(c, n, "a.0")
        clock.now += 5.1
        assert c.expired() == n
    assert c.timed_out == ["timed out after 5s; no ack from ['b.0']"] * 2
    clock.now += 1.1
    assert c.due() == 3
    _ack(c, 3, "a.0")
    assert _ack(c, 3, "b.0")
    assert c.timed_out == []
    clock.now += 1.1
    assert c.due() == 4
    clock.now += 5.1
    assert c.expired() == 4
    c.start_generation(2)  # a restart answers them
    assert c.timed_out == []


def test_committed_records_count_each_epoch_once_when_checkpoints_complete(
    tmp_path: Path,
) -> None:
    """The committed-output figure: what the acks of a completed checkpoint report, each
    task's epoch once (an aborted checkpoint's epoch is reported again with the next one);
    the epochs of an aborted checkpoint never count unless a completion covers them."""
    clock = Clock()
    c = _coordinator(tmp_path, clock)
    clock.now = 1.0
    assert c.due() == 1
    c.on_sunk(1, "a.0", [[1, 10]])
    _ack(c, 1, "a.0")
    clock.now = 6.1
    assert c.expired() == 1  # b.0 never acked: nothing of checkpoint 1 counts
    assert c.stats.committed_records == 0
    clock.now = 7.2
    assert c.due() == 2
    c.on_sunk(2, "a.0", [[1, 10], [2, 4]])  # epoch 1 commits with checkpoint 2
    _ack(c, 2, "a.0")
    c.on_sunk(2, "b.0", [[2, 7]])
    assert _ack(c, 2, "b.0")
    assert c.stats.committed_records == 21
    clock.now = 9.0
    assert c.due() == 3
    # a.0 had not heard of checkpoint 2's completion yet: its epoch 2 again, not counted twice
    c.on_sunk(3, "a.0", [[2, 4], [3, 5]])
    _ack(c, 3, "a.0")
    assert _ack(c, 3, "b.0")
    assert c.stats.committed_records == 26


def test_the_interval_runs_from_trigger_to_trigger_with_a_pause_after_a_slow_checkpoint(
    tmp_path: Path,
) -> None:
    clock = Clock()
    c = _coordinator(tmp_path, clock)  # interval 1 s
    assert c.due_in() == 1.0
    clock.now = 1.0
    assert c.due() == 1
    assert c.due_in() == float("inf")  # pending
    clock.now = 1.2
    _ack(c, 1, "a.0")
    assert _ack(c, 1, "b.0")
    # a fast checkpoint: the next one is due an interval after this one's trigger, not after
    # its end (the commit's latency was the interval plus the checkpoint's duration)
    assert c.due_in() == pytest.approx(0.8)
    clock.now = 1.99
    assert c.due() is None
    clock.now = 2.0
    assert c.due() == 2
    clock.now = 3.7  # took 1.7 s: longer than half the interval
    _ack(c, 2, "a.0")
    assert _ack(c, 2, "b.0")
    assert c.due_in() == pytest.approx(0.5)  # a pause of half the interval, not back to back
    clock.now = 4.2
    assert c.due() == 3
    clock.now = 10.0  # times out: aborted, then a whole interval
    assert c.expired() == 3
    assert c.due_in() == 1.0
