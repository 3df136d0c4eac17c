"""Key groups and the rewrite of a checkpoint into another parallelism (issue 24): the wire
math (ranges, owners, which old subtasks may hold a new subtask's keys), the job's topology,
the refusals, and how source positions and channels move (processor.runtime.shape.rescale)."""

from __future__ import annotations

import zlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from processor.compiler import channel_inputs, channel_partitions, compile_flow
from processor.dataflow import Dataflow
from processor.errors import ConfigError
from processor.runtime.shape.rescale import _restart_channels, check_rescalable, new_states
from processor.runtime.shape.topology import TOPOLOGY_FILE, Topology, current_topology, new_topology
from processor.runtime.task.channels import ChannelOut
from processor.runtime.topics import start_positions
from processor.snapshot.store import SnapshotStore
from processor.wire import (
    default_key_groups,
    key_group_range,
    key_owner,
    key_to_downstream,
    owner_of,
    route_table,
    shared_keys,
)

JOB = "rescale-unit"


# -- key groups ------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 300), st.data())
def test_key_group_ranges_are_contiguous_cover_every_group_and_agree_with_the_owner(
    groups: int, data: st.DataObject
) -> None:
    parallelism = data.draw(st.integers(1, groups))
    ranges = [key_group_range(i, parallelism, groups) for i in range(parallelism)]
    assert [g for r in ranges for g in r] == list(range(groups))  # contiguous, in order
    assert all(len(r) >= 1 for r in ranges)  # no subtask without keys
    for i, r in enumerate(ranges):
        assert {owner_of(g, parallelism, groups) for g in r} == {i}
    assert route_table(parallelism, groups) == [
        owner_of(g, parallelism, groups) for g in range(groups)
    ]


def test_key_groups_default_to_128_and_grow_with_the_parallelism() -> None:
    assert [default_key_groups(p) for p in (1, 2, 64, 85, 86, 200, 30000)] == [
        128, 128, 128, 128, 256, 512, 32768,
    ]  # fmt: skip
    with pytest.raises(ConfigError, match="above the job's 4 key groups"):
        route_table(5, 4)


@given(st.binary(max_size=40), st.integers(1, 16))
def test_a_job_without_key_groups_routes_as_before_when_it_has_as_many_as_subtasks(
    key: bytes, parallelism: int
) -> None:
    """A checkpoint written before key groups is read as G = P: crc32 % P is the old route."""
    assert key_owner(key, parallelism, parallelism) == key_to_downstream(key, parallelism)


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 6), st.sampled_from([4, 8, 128, 6]), st.integers(1, 6),
    st.sampled_from([4, 8, 128, 256]), st.lists(st.binary(max_size=12), max_size=300),
)  # fmt: skip
def test_every_key_of_a_new_subtask_was_held_by_one_of_its_shared_old_subtasks(
    p_old: int, g_old: int, p_new: int, g_new: int, keys: list[bytes]
) -> None:
    if p_old > g_old or p_new > g_new:
        return
    shared = shared_keys(p_old, g_old, p_new, g_new)
    for key in keys:
        assert key_owner(key, p_old, g_old) in shared[key_owner(key, p_new, g_new)]
    if g_old == g_new:  # ranges: only the overlapping old subtasks
        for i, olds in enumerate(shared):
            mine = set(key_group_range(i, p_new, g_new))
            assert olds == {s for s in range(p_old) if mine & set(key_group_range(s, p_old, g_old))}


# -- topology --------------------------------------------------------------------------------


def _flow(*, shuffle: bool = True) -> Dataflow:
    flow = Dataflow(JOB)
    clicks = flow.source("clicks", "clicks")
    if shuffle:
        clicks.key_by("by-user", lambda c: c["user"]).aggregate(
            "totals", init=lambda: 0, add=lambda a, c: a + 1
        ).sink("out", _NoSink())
    else:
        clicks.map("tag", lambda c: c).sink("out", _NoSink())
    return flow


class _NoSink:
    def open(self, ctx: Any) -> Any:  # never opened here
        raise AssertionError


def _complete(store: SnapshotStore, tasks: dict[str, dict[str, Any]], **meta: Any) -> Any:
    handles = {t: store.write_task_snapshot(JOB, 7, t, s) for t, s in tasks.items()}
    store.complete(JOB, 7, handles, {"generation": 3, **meta})
    return store.latest_completed(JOB)


def test_the_topology_comes_from_the_manifest_then_the_job_file_then_legacy_task_names(
    tmp_path: Any,
) -> None:
    store = SnapshotStore(tmp_path.as_uri())
    assert current_topology(store, JOB, None) is None
    store.write_job_file(JOB, TOPOLOGY_FILE, b'{"parallelism": 2, "key_groups": 128, "epoch": 1}')
    assert current_topology(store, JOB, None) == Topology(2, 128, 1)
    legacy = _complete(store, {"clicks.0": {}, "clicks.1": {}, "clicks.2": {}})
    assert current_topology(store, JOB, legacy) == Topology(3, 3, 0)
    topo = {"parallelism": 3, "key_groups": 256, "epoch": 2}
    recorded = SnapshotStore((tmp_path / "b").as_uri())
    manifest = _complete(recorded, {"clicks.0": {}}, topology=topo)
    assert current_topology(recorded, JOB, manifest) == Topology(3, 256, 2)


def test_a_new_shape_keeps_the_key_groups_and_takes_the_next_epoch() -> None:
    assert new_topology(None, 3) == Topology(3, 128, 0)
    assert new_topology(Topology(2, 128, 0), 2) == Topology(2, 128, 0)
    assert new_topology(Topology(2, 128, 0), 3) == Topology(3, 128, 1)
    assert new_topology(Topology(2, 2, 0), 1, legacy=True) == Topology(1, 128, 1)
    assert new_topology(Topology(2, 4, 3), 6) == Topology(6, 128, 4)


def test_channel_topics_of_another_epoch_are_other_topics() -> None:
    a = compile_flow(_flow(), 2)
    b = compile_flow(_flow(), 3, key_groups=128, epoch=1)
    assert [e.topic for e in a.edges] == [f"eosflow.{JOB}.by-user.totals"]
    assert [e.topic for e in b.edges] == [f"eosflow.{JOB}.by-user.totals.r1"]
    assert len(channel_partitions(b)) == 9


def _mixed_flow(start: str = "earliest") -> Dataflow:
    """A shuffle into ``count``, then forward edges into ``mixed`` from two stages."""
    flow = Dataflow(JOB)
    clicks = flow.source("clicks", "clicks", start=start)
    counted = clicks.key_by("by-user", lambda c: c["user"]).count("count")
    counted.union("mixed", clicks.key_by("by-page", lambda c: c["page"])).sink("out", _NoSink())
    return flow


@pytest.mark.parametrize("parallelism", [1, 2, 3])
def test_a_subtask_reads_the_channels_written_to_it_when_edges_shuffle_or_forward(
    parallelism: int,
) -> None:
    """The layout the tasks read (TaskBase.input_partitions) and the rescale rewrites: subtask
    ``i`` reads ``u*P + i`` of a shuffle from every upstream ``u``, and ``i*P + i`` of a
    forward edge; each partition an upstream ChannelOut writes is read by one subtask."""
    P = parallelism
    plan = compile_flow(_mixed_flow(), P)
    assert {e.shuffle for e in plan.edges} == {True, False}
    writer: Any = object()  # never written to here
    written = {
        (e.topic, p)
        for e in plan.edges
        for u in range(P)
        for p in ChannelOut(e, u, P, writer).partitions
    }
    read: list[tuple[str, int]] = []
    for stage in plan.stages:
        for i in range(P):
            mine = channel_inputs(plan, stage, i)
            assert mine == [
                (e.topic, u * P + i if e.shuffle else i * P + i)
                for e in stage.inputs
                for u in (range(P) if e.shuffle else [i])
            ]
            read += mine
    assert sorted(read) == sorted(set(read)) == sorted(written)
    assert sorted(channel_partitions(plan)) == sorted(read)
    if P == 3:
        count, mixed = plan.stage_of("count"), plan.stage_of("mixed")
        assert [p for _t, p in channel_inputs(plan, count, 1)] == [1, 4, 7]
        assert [p for _t, p in channel_inputs(plan, mixed, 1)] == [4, 4]


class _Ends:
    """A transport whose partitions all end at ``100 + partition``."""

    def __init__(self) -> None:
        self.created: dict[str, int] = {}

    def ensure_topics(self, partitions: dict[str, int]) -> None:
        self.created.update(partitions)

    def end_offsets(self, tps: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
        return {tp: 100 + tp[1] for tp in tps}


def test_a_fresh_start_and_a_shape_change_before_any_checkpoint_name_the_same_channel_ends(
    tmp_path: Any,
) -> None:
    """``start_positions`` and ``_restart_channels`` share ``end_positions``: the "latest"
    sources first, then every channel partition a task reads, at its end."""
    flow = _mixed_flow(start="latest")
    store, transport = SnapshotStore(tmp_path.as_uri()), _Ends()
    plan = compile_flow(flow, 2)
    starts = start_positions(plan, store, transport, {"clicks": 3})
    channels = [[t, p, 100 + p] for t, p in channel_partitions(plan)]
    assert starts == [["clicks", p, 100 + p] for p in range(3)] + channels
    wider = compile_flow(flow, 3, epoch=1)
    _restart_channels(wider, store, transport)
    assert transport.created == {e.topic: 9 for e in wider.edges}
    again = start_positions(wider, store, transport, {"clicks": 3})  # read back from _START
    wide = [[t, p, 100 + p] for t, p in channel_partitions(wider)]
    assert again == [["clicks", p, 100 + p] for p in range(3)] + wide


# -- refusals --------------------------------------------------------------------------------


def _manifest(tmp_path: Any, **meta: Any) -> Any:
    store = SnapshotStore(tmp_path.as_uri())
    plan = compile_flow(_flow(), 2)
    return _complete(store, {t: {} for t in plan.task_names()}, **meta)


def test_an_unaligned_checkpoint_is_refused_with_the_savepoint_command(tmp_path: Any) -> None:
    latest = _manifest(tmp_path, aligned=False)
    with pytest.raises(ConfigError, match=rf"eosflow savepoint {JOB} --stop"):
        check_rescalable(compile_flow(_flow(), 3), latest, Topology(2, 128), "global")


def test_local_recovery_is_refused_for_the_rescale(tmp_path: Any) -> None:
    latest = _manifest(tmp_path, aligned=True)
    with pytest.raises(ConfigError, match="--recovery global"):
        check_rescalable(compile_flow(_flow(), 3), latest, Topology(2, 128), "local")
    check_rescalable(compile_flow(_flow(), 3), latest, Topology(2, 128), "global")


# -- the new snapshots -----------------------------------------------------------------------


def _source_state(task: str, parts: list[int]) -> dict[str, Any]:
    return {
        "task": task,
        "positions": {("clicks", p): 100 + p for p in parts},
        "max_ts": {("clicks", p): 1000 + p for p in parts},
        "watermark": 900,
        "operators": {},
        "sinks": {"out": [[7, {"x": 1}]]},
    }


@pytest.mark.parametrize(("p_old", "p_new"), [(2, 3), (3, 1), (1, 2), (4, 4)])
def test_source_partitions_move_by_partition_and_channels_start_fresh(
    p_old: int, p_new: int
) -> None:
    old = Topology(p_old, 128)
    plan = compile_flow(_flow(), p_new, key_groups=128, epoch=1)
    states: dict[str, dict[str, Any]] = {}
    for s in range(p_old):
        states[f"clicks.{s}"] = _source_state(f"clicks.{s}", list(range(s, 8, p_old)))
        states[f"totals.{s}"] = {**_source_state(f"totals.{s}", []), "watermark": 800 + s}
    starts = {tp: 5 for tp in channel_partitions(plan)}
    built = new_states(plan, old, states, checkpoint_id=8, generation=4, channel_starts=starts)
    assert sorted(built) == sorted(plan.task_names())
    moved: dict[Any, int] = {}
    for i in range(p_new):
        source = built[f"clicks.{i}"]
        assert {p for _t, p in source["positions"]} == set(range(i, 8, p_new))
        assert source["max_ts"] == {tp: 900 + o for tp, o in source["positions"].items()}
        assert source["sinks"] == {} and source["checkpoint"] == 8 and source["generation"] == 4
        moved.update(source["positions"])
        down = built[f"totals.{i}"]
        reads = {tp for tp in down["positions"]}
        topic = plan.edges[0].topic
        assert reads == {(topic, u * p_new + i) for u in range(p_new)}
        assert set(down["barrier_seen"]) == reads  # nothing to replay
        assert set(down["positions"].values()) == {5}
        assert down["watermark"] == min(800 + s for s in shared_keys(p_old, 128, p_new, 128)[i])
    assert moved == {("clicks", p): 100 + p for p in range(8)}  # each partition exactly once
    assert zlib.crc32(b"") == 0  # (the key bytes hashed are the channel's: see rescale_state)


def test_epochs_never_repeat_and_an_older_shape_is_rewritten_even_at_its_parallelism() -> None:
    """A rescale killed after it created the topics of epoch 1, then a start at another
    parallelism: epoch 2, not 1 again (its topics have another partition count). A savepoint of
    epoch 0 restored after the job ran epoch 1, at its own parallelism: rewritten into epoch 2
    (the channels of epoch 0 are gone)."""
    assert new_topology(Topology(2, 128, 0), 4, highest=1) == Topology(4, 128, 2)
    assert new_topology(Topology(2, 128, 0), 2, highest=1) == Topology(2, 128, 2)
    assert new_topology(Topology(2, 128, 1), 2, highest=1) == Topology(2, 128, 1)


def test_a_job_from_before_key_groups_takes_the_default_count_at_any_rescale() -> None:
    """A checkpoint taken after the upgrade records G = P: a later change of parallelism still
    moves it to the default count (4 -> 3 with G = 4 would give one subtask half the keys)."""
    assert new_topology(Topology(4, 4, 0), 3) == Topology(3, 128, 1)
    assert route_table(3, 4) == [0, 0, 1, 2]  # what it would have been


def test_a_replay_check_of_local_recovery_is_not_carried_into_the_new_shape() -> None:
    old = Topology(2, 128)
    plan = compile_flow(_flow(), 3, key_groups=128, epoch=1)
    states: dict[str, dict[str, Any]] = {}
    for s in range(2):
        states[f"clicks.{s}"] = _source_state(f"clicks.{s}", list(range(s, 8, 2)))
        replay = {"operators": {"~replay-totals": {"ids": [1, 2]}}, "kinds": {}}
        states[f"totals.{s}"] = {**_source_state(f"totals.{s}", []), **replay}
    built = new_states(plan, old, states, checkpoint_id=8, generation=4, channel_starts={})
    assert all(not s["operators"] for s in built.values())


def test_a_checkpoint_whose_barriers_were_not_all_seen_is_refused(tmp_path: Any) -> None:
    """A checkpoint from before manifests said whether they were aligned: its snapshots say."""
    from processor.runtime.shape.rescale import _check_channels_done

    plan = compile_flow(_flow(), 3, key_groups=128, epoch=1)
    old_plan = compile_flow(_flow(), 2)
    topic = old_plan.edges[0].topic
    seen = {f"totals.{s}": [(topic, u * 2 + s) for u in range(2)] for s in range(2)}
    states = {t: {"barrier_seen": tps} for t, tps in seen.items()}
    states.update({f"clicks.{s}": {"barrier_seen": []} for s in range(2)})
    _check_channels_done(plan, Topology(2, 128), states, 5)
    states["totals.1"]["barrier_seen"] = seen["totals.1"][:1]
    with pytest.raises(
        ConfigError, match=r"task totals.1 of checkpoint 5 had not seen the barrier"
    ):
        _check_channels_done(plan, Topology(2, 128), states, 5)


def test_a_restart_refuses_a_checkpoint_of_another_shape(tmp_path: Any) -> None:
    from processor.runtime.shape.topology import check_shape

    store = SnapshotStore(tmp_path.as_uri())
    topo = {"parallelism": 2, "key_groups": 128, "epoch": 0}
    latest = _complete(store, {"clicks.0": {}, "clicks.1": {}}, topology=topo)
    check_shape(compile_flow(_flow(), 2), store, latest)
    with pytest.raises(ConfigError, match="start the job again"):
        check_shape(compile_flow(_flow(), 3, epoch=1), store, latest)
