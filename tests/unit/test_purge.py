"""Which channel records may be deleted (processor/runtime/task/purge.py): the floor of each task,
checked against what a restore of any retained checkpoint reads, across global and local
recoveries; and the worker's purger (one request per completed checkpoint, retries, off on a
broker without DeleteRecords)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from processor.runtime.task.purge import ChannelPurger, PurgeFloor
from processor.snapshot.store import SnapshotStore
from processor.wire import Barrier, GenerationStart
from tests.unit.test_task import P0, P2, Log, _acks, _state, _task

A, B = ("eosflow.j.a.b", 0), ("eosflow.j.a.b", 1)
SOURCE = ("clicks", 0)


def test_floor_is_the_oldest_retained_checkpoints_positions_when_newer_ones_exist() -> None:
    floor = PurgeFloor([A, B])
    floor.record(1, {A: 10, B: 5})
    floor.record(2, {A: 20, B: 9})
    floor.record(3, {A: 30, B: 9})
    assert floor.floor(1) == {A: 10, B: 5}  # 1, 2 and 3 in the store: not past 1's
    assert floor.floor(2) == {A: 20, B: 9}  # 1 gone: not 3's, a restore of 2 reads A from 20
    assert floor.floor(3) == {A: 30, B: 9}
    assert floor.floor(1) is None  # forgotten: the oldest retained checkpoint only grows


def test_floor_is_none_when_the_oldest_retained_checkpoint_predates_the_restored_one() -> None:
    """A task that just restored checkpoint 7 (global recovery, or its worker restarted alone
    under local recovery) does not know the positions of 5 and 6, still in the store."""
    floor = PurgeFloor([A])
    floor.record(7, {A: 70})  # restored
    floor.record(8, {A: 80})
    assert floor.floor(5) is None
    assert floor.floor(7) == {A: 70}


def test_floor_never_passes_a_later_snapshot_that_holds_a_lower_position() -> None:
    floor = PurgeFloor([A])
    floor.record(4, {A: 40})
    floor.record(5, {A: 35})  # (positions only grow; the minimum guards anyway)
    assert floor.floor(4) == {A: 35}


def test_source_partitions_are_never_purged() -> None:
    floor = PurgeFloor([A])
    floor.record(1, {A: 10, SOURCE: 99, B: None})
    assert floor.floor(1) == {A: 10}


def test_unaligned_snapshot_keeps_the_in_flight_records_of_a_channel_when_purging(
    tmp_path: Path,
) -> None:
    """The task records what its snapshot holds: in unaligned mode a channel whose barrier
    had not come yet is recorded at its position then (its in-flight records, which a restore
    replays), not after the barrier."""
    log = Log()
    for tp in (P0, P2):
        log.ctl(tp, GenerationStart(1))
    log.ctl(P0, Barrier(1, 1, unaligned=True))
    log.data(P0, "a")
    log.data(P2, "b")
    task = _task(tmp_path, log, "unaligned")
    task.open(None, {"in": 2})
    task.step(0.0, 100)
    log.ctl(P2, Barrier(1, 1, unaligned=True))
    task.step(0.0, 100)
    assert _acks(task) == [1]
    assert task.purge_floor.floor(1) == {P0: 2, P2: 0}


def test_restored_task_knows_only_the_restored_checkpoint_when_purging(tmp_path: Path) -> None:
    log = Log()
    task = _task(tmp_path, log, "aligned", generation=2)
    task.open(_state(6, {P0: 4, P2: 7}, [P0, P2]), {"in": 2})
    assert task.purge_floor.floor(5) is None
    assert task.purge_floor.floor(6) == {P0: 4, P2: 7}


# -- the rule against a model of the store, across restarts ---------------------------------


@settings(max_examples=300, deadline=None)
@given(
    keep=st.integers(1, 4),
    steps=st.lists(
        st.tuples(
            st.sampled_from(["complete", "abort", "global", "local"]),
            st.integers(0, 5),
            st.integers(0, 5),
        ),
        min_size=1,
        max_size=40,
    ),
)
def test_no_retained_checkpoint_reads_below_the_floor_when_checkpoints_restarts_interleave(
    keep: int, steps: list[tuple[str, int, int]]
) -> None:
    """A model of one task reading A and B: checkpoints complete or abort, the store keeps
    the newest ``keep``, and a restart (global, or the task's worker alone under local
    recovery: the same for this task) restores the newest completed one. After every
    completion, what the purger would delete must lie below the position of every
    checkpoint in the store: a restore of any of them reads everything it needs."""
    store: dict[int, dict[Any, int]] = {}  # completed checkpoints in the store
    purged: dict[Any, int] = {A: 0, B: 0}
    pos = {A: 0, B: 0}
    floor = PurgeFloor([A, B])
    next_id = 1
    for action, da, db in steps:
        if action in ("global", "local"):
            if store:  # restore the newest completed one, in a new incarnation
                newest = max(store)
                pos = dict(store[newest])
                floor = PurgeFloor([A, B])
                floor.record(newest, pos)
            continue
        pos = {A: pos[A] + da, B: pos[B] + db}
        chk, next_id = next_id, next_id + 1
        floor.record(chk, pos)
        if action == "abort":
            continue
        store[chk] = dict(pos)
        for old in sorted(store)[:-keep]:
            del store[old]
        below = floor.floor(min(store))
        for tp, offset in (below or {}).items():
            purged[tp] = max(purged[tp], offset)  # DeleteRecords never moves back
        for positions in store.values():
            for tp, offset in positions.items():
                assert purged[tp] <= offset, (keep, steps, store, purged)


# -- the worker's purger ---------------------------------------------------------------------


class Deleting:
    """The transport side of purging: records DeleteRecords requests; its futures are set by
    the test (a broker that answers later, or fails)."""

    def __init__(self, supported: bool = True) -> None:
        self.supported = supported
        self.asked = 0
        self.requests: list[dict[Any, int]] = []
        self.futures: list[dict[Any, Future[object]]] = []

    def purge_supported(self) -> bool:
        self.asked += 1
        return self.supported

    def purge(self, before: Mapping[Any, int]) -> dict[Any, Future[object]]:
        self.requests.append(dict(before))
        futures: dict[Any, Future[object]] = {tp: Future() for tp in before}
        self.futures.append(futures)
        return futures

    def answer(self, error: Exception | None = None) -> None:
        for future in self.futures[-1].values():
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)


class FloorTask:
    def __init__(self, name: str, channels: list[Any]) -> None:
        self.name = name
        self.purge_floor = PurgeFloor(channels)


def _complete(store: SnapshotStore, chk: int, keep: int = 2) -> None:
    handle = store.write_task_snapshot("j", chk, "t.0", {"positions": {}})
    store.complete("j", chk, {"t.0": handle}, {})
    store.retain("j", keep)


def test_one_request_per_completed_checkpoint_below_the_oldest_retained(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path.as_uri())
    transport = Deleting()
    task = FloorTask("t.0", [A, B])
    purger = ChannelPurger(transport, store, "j", [task, FloorTask("src.0", [])])
    for chk, (a, b) in enumerate([(10, 5), (20, 5), (30, 8)], start=1):
        task.purge_floor.record(chk, {A: a, B: b})
        _complete(store, chk)
        sent = len(transport.requests)
        purger.completed(chk)
        if len(transport.requests) > sent:
            transport.answer()
    # keep=2: after 2 the store holds 1 and 2 (purge below 1's), after 3 it holds 2 and 3
    assert transport.requests == [{A: 10, B: 5}, {A: 20}]
    assert purger.requests == 2
    task.purge_floor.record(4, {A: 30, B: 8})
    _complete(store, 4)
    purger.completed(4)  # oldest is 3: A 30, B 8; B has not moved since
    assert transport.requests[-1] == {A: 30, B: 8}
    transport.answer()
    task.purge_floor.record(5, {A: 30, B: 8})
    _complete(store, 5)
    purger.completed(5)  # nothing advanced: no request
    assert len(transport.requests) == 3 and transport.asked == 1


def test_a_purge_in_flight_skips_the_next_and_a_failed_one_is_tried_again(
    tmp_path: Path, caplog: Any
) -> None:
    store = SnapshotStore(tmp_path.as_uri())
    transport = Deleting()
    task = FloorTask("t.0", [A])
    purger = ChannelPurger(transport, store, "j", [task])
    task.purge_floor.record(1, {A: 10})
    _complete(store, 1, keep=1)
    purger.completed(1)
    task.purge_floor.record(2, {A: 20})
    _complete(store, 2, keep=1)
    purger.completed(2)  # the first request has no answer yet
    assert transport.requests == [{A: 10}]
    transport.answer(RuntimeError("broker said no"))
    task.purge_floor.record(3, {A: 30})
    _complete(store, 3, keep=1)
    with caplog.at_level(logging.WARNING, logger="processor.runtime.task.purge"):
        purger.completed(3)
    assert "purging channel eosflow.j.a.b[0] below offset 10 failed" in caplog.text
    assert transport.requests == [{A: 10}, {A: 30}]


def test_nothing_is_purged_and_one_line_says_so_when_the_broker_cannot_delete_records(
    tmp_path: Path, caplog: Any
) -> None:
    store = SnapshotStore(tmp_path.as_uri())
    transport = Deleting(supported=False)
    task = FloorTask("t.0", [A])
    purger = ChannelPurger(transport, store, "j", [task])
    with caplog.at_level(logging.INFO, logger="processor.runtime.task.purge"):
        for chk in (1, 2, 3):
            task.purge_floor.record(chk, {A: chk * 10})
            _complete(store, chk, keep=1)
            purger.completed(chk)
    assert transport.requests == [] and transport.asked == 1
    assert caplog.text.count("are not purged") == 1
    assert task.purge_floor.floor(3) is None  # positions are not kept for nothing


def test_a_delete_records_probe_that_crashes_costs_the_probe_not_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The probe's DeleteRecords request runs in a child process: a native crash there (as
    the client's failure path once did in the runner, SIGSEGV) answers "not purged", with the
    exit in the notes, and this process goes on."""
    from connectors import KafkaSettings, probe

    monkeypatch.setattr(probe, "_CHILD", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    notes: list[str] = []
    settings = KafkaSettings("127.0.0.1:1")
    assert probe._try_delete_records_apart(settings, "t", notes, 1.0) is False
    assert notes == ["DeleteRecords probe failed (exit -11): channel topics are not purged"]
