"""Keyed sources (``Dataflow.source(..., keyed=True)``): where the compiler fuses keyed steps
without a shuffle, the start-up checks that fusion rests on (co-partitioned topics, partition
counts pinned at the first start, a checkpoint's tasks, their state and its parallelism), and
how a source task keys records by their message key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest

from connectors.serde import JsonSerde
from processor.compiler import Plan, compile_flow
from processor.contracts import SinkContext
from processor.dataflow import Dataflow, KeyedStream, Stream
from processor.errors import ConfigError, DefinitionError, DeserializationError
from processor.runtime.shape.rescale import check_rescalable
from processor.runtime.shape.topology import Topology, current_topology
from processor.runtime.supervision.local import LocalRunner, RunOptions
from processor.runtime.supervision.recovery import Supervisor
from processor.runtime.task import Task
from processor.runtime.task.sources import message_key_decoder
from processor.runtime.topics import KEYED_FILE, check_graph, check_keyed_sources
from processor.snapshot.store import SnapshotStore
from tests.unit.test_dead_letters import Recorder, _env, produce
from tests.unit.test_task import Log

JOB = "job"


class _Sink:
    def open(self, ctx: SinkContext) -> Any:
        raise AssertionError("not opened in these tests")


def _total(stream: KeyedStream, name: str = "totals") -> KeyedStream:
    return stream.aggregate(name, init=lambda: 0, add=lambda a, v: a + v["n"])


def _keyed_total(parallelism: int = 2, *, keyed: bool = True) -> Plan:
    """``clicks`` (topic ``clicks``) -> ``totals``, keyed by the message key or by ``key_by``."""
    flow = Dataflow(JOB)
    clicks = flow.source("clicks", "clicks", keyed=keyed)
    keyed_stream = clicks if isinstance(clicks, KeyedStream) else clicks.key_by("by-user", str)
    _total(keyed_stream).sink("out", _Sink())
    return compile_flow(flow, parallelism)


def _stages(plan: Plan) -> dict[str, tuple[str, ...]]:
    return {s.name: s.steps for s in plan.stages}


# -- compiler ------------------------------------------------------------------------------------


def test_keyed_steps_fuse_into_the_source_stage_when_the_source_is_keyed() -> None:
    flow = Dataflow(JOB)
    clicks = flow.source("clicks", "clicks", serde=JsonSerde(), keyed=True)
    assert isinstance(clicks, KeyedStream)
    valid = clicks.filter("valid", lambda v: v["n"] > 0).map("double", lambda v: v)
    assert isinstance(valid, KeyedStream)  # the key survives forward steps
    _total(valid).sink("out", _Sink())
    plan = compile_flow(flow, 2)
    assert _stages(plan) == {"clicks": ("clicks", "valid", "double", "totals", "out")}
    assert plan.edges == ()
    assert plan.copartitioned == (("clicks",),)
    assert plan.task_names() == ["clicks.0", "clicks.1"]


def test_aggregation_shuffles_when_a_keyed_source_is_re_keyed_with_key_by() -> None:
    flow = Dataflow(JOB)
    clicks = flow.source("clicks", "clicks", keyed=True)
    _total(clicks.key_by("by-page", lambda v: v["page"])).sink("out", _Sink())
    plan = compile_flow(flow, 2)
    assert _stages(plan) == {"clicks": ("clicks", "by-page"), "totals": ("totals", "out")}
    ((edge,),) = [plan.edges]
    assert (edge.src_step, edge.dst_step, edge.shuffle) == ("by-page", "totals", True)
    assert plan.copartitioned == ()  # nothing relies on the topic's partitioning


def test_aggregation_of_a_union_of_keyed_sources_fuses_and_copartitions_them() -> None:
    flow = Dataflow(JOB)
    b = flow.source("b", "topic-b", keyed=True)  # added first: the group is still sorted
    a = flow.source("a", "topic-a", keyed=True)
    both = b.union("both", a)
    assert isinstance(both, KeyedStream)
    _total(both).sink("out", _Sink())
    plan = compile_flow(flow, 2)
    assert _stages(plan) == {"b": ("b", "a", "both", "totals", "out")}
    assert plan.edges == ()
    assert plan.copartitioned == (("topic-a", "topic-b"),)


def test_aggregation_shuffles_when_a_keyed_source_meets_a_key_by_stream() -> None:
    """Kafka's partitioner and eosflow's key routing send a key to different subtasks: the
    union of a keyed source and a ``key_by`` stream is not partitioned by key."""
    flow = Dataflow(JOB)
    a = flow.source("a", "topic-a", keyed=True)
    b = flow.source("b", "topic-b").key_by("by-user", lambda v: v["user"])
    _total(a.union("both", b)).sink("out", _Sink())
    plan = compile_flow(flow, 2)
    assert _stages(plan) == {"a": ("a", "b", "by-user", "both"), "totals": ("totals", "out")}
    assert [(e.src_step, e.dst_step, e.shuffle) for e in plan.edges] == [("both", "totals", True)]
    assert plan.copartitioned == ()


def test_aggregation_shuffles_when_a_keyed_source_meets_a_shuffled_keyed_stream() -> None:
    """An aggregate's output is partitioned by the shuffle's routing (hashed), the keyed
    source's by Kafka's partitioner: merged, the stream is partitioned by neither."""
    flow = Dataflow(JOB)
    a = flow.source("a", "topic-a", keyed=True)
    b = _total(flow.source("b", "topic-b").key_by("by-user", lambda v: v["user"]), "b-totals")
    _total(a.union("both", b)).sink("out", _Sink())
    plan = compile_flow(flow, 2)
    assert _stages(plan) == {
        "a": ("a",),
        "b": ("b", "by-user"),
        "b-totals": ("b-totals",),
        "both": ("both",),
        "totals": ("totals", "out"),
    }
    assert sorted((e.src_step, e.dst_step, e.shuffle) for e in plan.edges) == [
        ("a", "both", False),
        ("b-totals", "both", False),
        ("both", "totals", True),
        ("by-user", "b-totals", True),
    ]
    assert plan.copartitioned == ()


def test_aggregation_of_an_aggregation_over_a_keyed_source_stays_in_the_source_stage() -> None:
    flow = Dataflow(JOB)
    totals = _total(flow.source("clicks", "clicks", keyed=True))
    totals.reduce("max", max).sink("out", _Sink())
    plan = compile_flow(flow, 2)
    assert _stages(plan) == {"clicks": ("clicks", "totals", "max", "out")}
    assert plan.edges == ()
    assert plan.copartitioned == (("clicks",),)


def test_keyed_dedup_and_windowed_count_fuse_into_the_source_stage_when_the_source_is_keyed() -> (
    None
):
    flow = Dataflow(JOB)
    clicks = flow.source("clicks", "clicks", keyed=True)
    unique = clicks.dedup("unique", lambda v: v["id"], within=timedelta(minutes=5))
    assert isinstance(unique, KeyedStream)
    unique.count("per-user").sink("out", _Sink())
    plan = compile_flow(flow, 2)
    assert _stages(plan) == {"clicks": ("clicks", "unique", "per-user", "out")}
    assert plan.edges == ()
    assert plan.copartitioned == (("clicks",),)


def test_an_unkeyed_source_stays_an_unkeyed_stream_when_keyed_is_not_given() -> None:
    flow = Dataflow(JOB)
    clicks = flow.source("clicks", "clicks")
    assert type(clicks) is Stream and not hasattr(clicks, "aggregate")
    assert flow.steps["clicks"].params["keyed"] is False


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"key_serde": JsonSerde()},
            r"source 'clicks': key_serde decodes the message keys of a keyed source; add "
            r"keyed=True",
        ),
        (
            {"keyed": False, "key_serde": JsonSerde()},
            r"source 'clicks': key_serde decodes the message keys of a keyed source",
        ),
        ({"keyed": "yes"}, r"source 'clicks': keyed must be True or False, got 'yes'"),
        ({"keyed": 1}, r"source 'clicks': keyed must be True or False, got 1"),
        (
            {"keyed": True, "key_serde": "json"},
            r"source 'clicks': key_serde 'json' does not implement processor\.contracts\.Serde",
        ),
    ],
)
def test_source_refuses_key_options_when_they_are_invalid(
    kwargs: dict[str, Any], message: str
) -> None:
    flow = Dataflow(JOB)
    with pytest.raises(DefinitionError, match=message) as info:
        flow.source("clicks", "clicks", **kwargs)
    assert isinstance(info.value, ValueError)
    assert "clicks" not in flow.steps  # nothing half-added


# -- check_keyed_sources -------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> SnapshotStore:
    return SnapshotStore(tmp_path.as_uri())


def _pinned(store: SnapshotStore) -> dict[str, int] | None:
    saved = store.read_job_file(JOB, KEYED_FILE)
    return None if saved is None else dict(json.loads(saved))


def test_first_start_records_the_partition_counts_and_a_later_start_with_them_passes(
    store: SnapshotStore,
) -> None:
    plan = _keyed_total()
    check_keyed_sources(plan, store, {"clicks": 8})
    assert _pinned(store) == {"clicks": 8}
    check_keyed_sources(plan, store, {"clicks": 8})
    assert _pinned(store) == {"clicks": 8}


@pytest.mark.parametrize("now", [12, 4])
def test_start_is_refused_when_a_keyed_source_topic_changed_its_partition_count(
    store: SnapshotStore, now: int
) -> None:
    plan = _keyed_total()
    check_keyed_sources(plan, store, {"clicks": 8})
    with pytest.raises(ConfigError, match=rf"'clicks' from 8 to {now}\)") as info:
        check_keyed_sources(plan, store, {"clicks": now})
    assert f"job {JOB!r}" in str(info.value)
    assert "new job name" in str(info.value)  # says how to get going again
    assert _pinned(store) == {"clicks": 8}  # the first start's counts stay the reference


def test_start_is_refused_when_copartitioned_topics_have_different_partition_counts(
    store: SnapshotStore,
) -> None:
    flow = Dataflow(JOB)
    a = flow.source("a", "topic-a", keyed=True)
    _total(a.union("both", flow.source("b", "topic-b", keyed=True))).sink("out", _Sink())
    plan = compile_flow(flow, 2)
    with pytest.raises(ConfigError, match="same number of partitions") as info:
        check_keyed_sources(plan, store, {"topic-a": 8, "topic-b": 4})
    assert "{'topic-a': 8, 'topic-b': 4}" in str(info.value)
    assert _pinned(store) is None  # a refused start pins nothing
    check_keyed_sources(plan, store, {"topic-a": 6, "topic-b": 6})
    assert _pinned(store) == {"topic-a": 6, "topic-b": 6}


def test_partition_counts_are_neither_recorded_nor_checked_when_nothing_relies_on_them(
    store: SnapshotStore,
) -> None:
    plan = _keyed_total(keyed=False)  # key_by: shuffled
    check_keyed_sources(plan, store, {"clicks": 8})
    check_keyed_sources(plan, store, {"clicks": 12})
    assert _pinned(store) is None


def test_a_keyed_source_added_to_a_job_is_pinned_from_its_first_start(
    store: SnapshotStore,
) -> None:
    check_keyed_sources(_keyed_total(), store, {"clicks": 8})
    flow = Dataflow(JOB)
    _total(flow.source("clicks", "clicks", keyed=True)).sink("out", _Sink())
    _total(flow.source("more", "more", keyed=True), "more-totals").sink("more-out", _Sink())
    plan = compile_flow(flow, 2)
    assert plan.copartitioned == (("clicks",), ("more",))
    check_keyed_sources(plan, store, {"clicks": 8, "more": 4})
    assert _pinned(store) == {"clicks": 8, "more": 4}
    with pytest.raises(ConfigError, match=r"'more' from 4 to 16\)"):
        check_keyed_sources(plan, store, {"clicks": 8, "more": 16})


# -- check_graph ---------------------------------------------------------------------------------


def _checkpoint(store: SnapshotStore, plan: Plan) -> list[str]:
    """Completes a checkpoint of every task of ``plan``, each snapshot holding the state of its
    stage's aggregations; returns the tasks the runner reads back from the store."""
    steps = plan.flow.steps
    handles = {}
    for stage in plan.stages:
        held = {n: {"u1": 1} for n in stage.steps if steps[n].kind in ("aggregate", "dedup")}
        for i in range(plan.parallelism):
            state = {"operators": held}
            handles[stage.task(i)] = store.write_task_snapshot(JOB, 1, stage.task(i), state)
    store.complete(JOB, 1, handles, {"generation": 1})
    latest = store.latest_completed(JOB)
    assert latest is not None
    return list(latest.tasks)


def test_graph_check_passes_when_there_is_no_checkpoint() -> None:
    check_graph(_keyed_total(), [])
    check_graph(_keyed_total(3, keyed=False), [])


@pytest.mark.parametrize("keyed", [True, False])
def test_graph_check_passes_when_the_plan_is_unchanged(store: SnapshotStore, keyed: bool) -> None:
    tasks = _checkpoint(store, _keyed_total(keyed=keyed))
    check_graph(_keyed_total(keyed=keyed), tasks)


def test_start_is_refused_when_a_task_of_the_checkpoint_is_gone(store: SnapshotStore) -> None:
    """``key_by`` replaced by ``keyed=True``: the aggregate moves into the source's task, and
    the state of the old ``totals`` tasks would be dropped."""
    tasks = _checkpoint(store, _keyed_total(keyed=False))
    assert sorted(tasks) == ["clicks.0", "clicks.1", "totals.0", "totals.1"]
    with pytest.raises(ConfigError, match=r"stages no longer there: \['totals'\]") as info:
        check_graph(_keyed_total(keyed=True), tasks)
    assert "new stages: none" in str(info.value)
    assert "new job name" in str(info.value)


@pytest.mark.parametrize("workers", [1, 3])
def test_another_parallelism_is_refused_for_keyed_sources_read_without_a_shuffle(
    store: SnapshotStore, workers: int
) -> None:
    """Their keyed state sits where Kafka's partitioner put each key, not by key group: a
    rescale (processor.runtime.shape.rescale) cannot move it. The stages are unchanged, so the graph
    check passes; the rescale check names the keyed sources and the way out."""
    tasks = _checkpoint(store, _keyed_total(2))
    check_graph(_keyed_total(workers), tasks)
    latest = store.latest_completed(JOB)
    assert latest is not None
    old = current_topology(store, JOB, latest)
    assert old == Topology(2, 2, 0)  # a checkpoint without a topology: crc32 % P routing
    with pytest.raises(ConfigError, match=r"keyed steps read keyed sources") as info:
        check_rescalable(_keyed_total(workers), latest, old, "global")
    assert "--workers 2" in str(info.value)


def test_start_is_refused_when_a_stage_was_added(store: SnapshotStore) -> None:
    """A new branch has no snapshot to start from and no start positions: the workers failed
    on ``KeyError: 'per-page.0'`` until the restart budget ran out (found by this suite)."""
    tasks = _checkpoint(store, _keyed_total())
    flow = Dataflow(JOB)
    clicks = flow.source("clicks", "clicks", keyed=True)
    _total(clicks).sink("out", _Sink())
    _total(clicks.key_by("by-page", lambda v: v["page"]), "per-page").sink("pages", _Sink())
    plan = compile_flow(flow, 2)
    assert set(plan.task_names()) == set(tasks) | {"per-page.0", "per-page.1"}
    with pytest.raises(ConfigError, match=r"new stages: \['per-page'\]"):
        check_graph(plan, tasks)


def test_start_is_refused_when_a_stateful_step_moved_out_of_a_task_of_the_checkpoint(
    store: SnapshotStore,
) -> None:
    """Regression: ``keyed=True`` replaced by ``key_by`` adds a shuffle before ``totals``,
    which moves from the source's tasks into new ``totals.*`` tasks. No task of the checkpoint
    was gone, so a check of gone tasks only let the job start with the totals' state in tasks
    that no longer run them (the workers then failed on ``KeyError: 'totals.0'`` until the
    restart budget ran out)."""
    tasks = _checkpoint(store, _keyed_total(keyed=True))
    assert sorted(tasks) == ["clicks.0", "clicks.1"]
    with pytest.raises(ConfigError, match=r"new stages: \['totals'\]") as info:
        check_graph(_keyed_total(keyed=False), tasks)
    assert "keyed= changed on a source" in str(info.value)


# -- the runner calls both checks before any worker starts ----------------------------------------


class FakeTransport:
    """Source topics of :data:`FakeTransport.partitions` partitions; nothing else."""

    partitions: Mapping[str, int] = {}

    def __init__(self, _environ: Mapping[str, str]) -> None:
        pass

    def partition_count(self, topic: str) -> int:
        return self.partitions[topic]

    def ensure_topics(self, partitions: Mapping[str, int]) -> None:
        assert not partitions, f"a keyed-source job creates no channel topic: {partitions}"

    def end_offsets(self, tps: Any) -> dict[Any, int]:
        return {tp: 0 for tp in tps}


def _runner(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    partitions: int,
    workers: int,
    *,
    key_by: bool = False,
) -> LocalRunner:
    """The runner of ``clicks`` -> ``per-user`` (a count) keyed by the message key, or by
    ``key_by`` (a shuffle), on a transport whose topic ``clicks`` has ``partitions``."""
    keyed = (
        "flow.source('clicks', 'clicks').key_by('by-user', str)"
        if key_by
        else "flow.source('clicks', 'clicks', keyed=True)"
    )
    pipeline = tmp_path / "pipeline.py"
    pipeline.write_text(
        "from processor.dataflow import Dataflow\n"
        "from sinks import FileSink\n"
        f"flow = Dataflow({JOB!r})\n"
        f"({keyed}.count('per-user')\n"
        f"    .sink('out', FileSink({str(tmp_path / 'out')!r})))\n"
    )
    monkeypatch.setattr(FakeTransport, "partitions", {"clicks": partitions})

    def no_workers(*_args: Any) -> None:
        raise AssertionError("the start-up checks let the job start its workers")

    monkeypatch.setattr(Supervisor, "start_generation", no_workers)
    options = RunOptions(
        workers=workers,
        state_dir=str(tmp_path / "state"),
        transport=f"{__name__}:FakeTransport",
        max_restarts=0,
    )
    return LocalRunner(pipeline, options)


def test_runner_refuses_to_start_when_a_keyed_source_gained_partitions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = _runner(tmp_path, monkeypatch, partitions=12, workers=2)
    runner.store.write_job_file(JOB, KEYED_FILE, json.dumps({"clicks": 8}).encode())
    with pytest.raises(ConfigError, match=r"'clicks' from 8 to 12\)"):
        runner.run()


def test_runner_refuses_to_start_when_workers_differ_from_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: a job without channel topics restarted with another --workers re-read
    partitions from the start in the subtasks the checkpoint did not have (and lost the
    positions of those it dropped), silently."""
    runner = _runner(tmp_path, monkeypatch, partitions=8, workers=3)
    _checkpoint_of(runner.store, ["clicks.0", "clicks.1"])
    with pytest.raises(ConfigError, match=r"--workers 2\b"):
        runner.run()


def test_runner_refuses_to_start_when_a_shuffle_moved_keyed_state_out_of_the_source_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: the checkpoint of the keyed-source job holds the counts in ``clicks.*``;
    with ``key_by`` the count runs in new ``per-user.*`` tasks, and the runner started the
    workers (which then failed on ``KeyError: 'per-user.0'``) instead of saying why."""
    runner = _runner(tmp_path, monkeypatch, partitions=8, workers=2, key_by=True)
    _checkpoint_of(runner.store, ["clicks.0", "clicks.1"])
    with pytest.raises(ConfigError, match=r"new stages: \['per-user'\]"):
        runner.run()


def _checkpoint_of(store: SnapshotStore, tasks: list[str]) -> None:
    """A completed checkpoint of the keyed-source job of :func:`_runner`."""
    state = {"operators": {"per-user": {"u1": 3}}}
    handles = {t: store.write_task_snapshot(JOB, 1, t, state) for t in tasks}
    store.complete(JOB, 1, handles, {"generation": 1})


# -- the task: records keyed by their message key -------------------------------------------------


class _Key:
    """A source message with only what the key decoder reads."""

    def __init__(self, key: bytes | None) -> None:
        self._key = key

    def key(self) -> bytes | None:
        return self._key

    def topic(self) -> str:
        return "clicks"

    def partition(self) -> int:
        return 3

    def offset(self) -> int:
        return 42


def test_message_key_is_decoded_as_utf8_text_when_there_is_no_key_serde() -> None:
    key_of = message_key_decoder("clicks", None)
    assert key_of(_Key("user-ü".encode())) == "user-ü"  # type: ignore[arg-type]
    assert key_of(_Key(b"")) == ""  # type: ignore[arg-type]


def test_record_without_a_key_is_a_deserialization_error_with_its_location() -> None:
    key_of = message_key_decoder("clicks", None)
    with pytest.raises(DeserializationError) as info:
        key_of(_Key(None))  # type: ignore[arg-type]
    exc = info.value
    assert (exc.topic, exc.partition, exc.offset, exc.serde) == ("clicks", 3, 42, "key")
    assert "source 'clicks' is keyed by the message key (keyed=True)" in str(exc)
    assert "has no key" in str(exc) and "key_by" in str(exc)  # and how to fix it
    assert "topic='clicks' partition=3 offset=42" in str(exc)


def test_message_key_that_is_not_utf8_is_a_deserialization_error_when_no_key_serde() -> None:
    key_of = message_key_decoder("clicks", None)
    with pytest.raises(DeserializationError, match="not UTF-8 text") as info:
        key_of(_Key(b"\xff\xfeuser"))  # type: ignore[arg-type]
    exc = info.value
    assert (exc.topic, exc.partition, exc.offset) == ("clicks", 3, 42)
    assert exc.data == b"\xff\xfeuser" and "give the keyed source a key_serde" in str(exc)


def test_message_key_is_decoded_by_the_key_serde_when_one_is_given() -> None:
    key_of = message_key_decoder("clicks", JsonSerde())
    assert key_of(_Key(b'{"user": 7}')) == {"user": 7}  # type: ignore[arg-type]
    assert key_of(_Key(b"7")) == 7  # type: ignore[arg-type]
    with pytest.raises(DeserializationError, match="invalid JSON") as info:
        key_of(_Key(b"user-7"))  # type: ignore[arg-type]
    assert (info.value.topic, info.value.partition, info.value.offset) == ("clicks", 3, 42)
    with pytest.raises(DeserializationError, match="has no key"):
        key_of(_Key(None))  # type: ignore[arg-type]


IN = ("in", 0)  # subtask 0 of 2 reads partition 0 of the source topic


def _source_task(tmp_path: Path, log: Log, *, dead_letters: bool, **source: Any) -> Task:
    flow = Dataflow(JOB, dead_letters=Recorder() if dead_letters else None)
    clicks = flow.source("s", "in", serde=JsonSerde(), keyed=True, **source)
    clicks.map("n", lambda v: v["n"]).reduce("sum", lambda a, b: a + b).sink("out", Recorder())
    env = _env(tmp_path, flow, log)
    (stage,) = env.plan.stages
    task = Task(env, stage, 0)
    task.open(None, {"in": 2})
    return task


def _writer(task: Task, step: str) -> Recorder:
    (writer,) = [w for name, w in task.chain.committers if name == step]
    assert isinstance(writer, Recorder)
    return writer


def _click(n: int) -> bytes:
    return orjson.dumps({"n": n})


def test_source_task_aggregates_by_message_key_and_dead_letters_a_record_without_one(
    tmp_path: Path,
) -> None:
    log = Log()
    produce(log, IN, _click(1), b"u1")
    produce(log, IN, _click(2), b"u2")
    no_key = produce(log, IN, _click(100), None)
    produce(log, IN, _click(3), b"u1")
    task = _source_task(tmp_path, log, dead_letters=True)
    task.step(0.0, 100)
    assert _writer(task, "out").epoch == [("u1", 1), ("u2", 2), ("u1", 4)]
    assert log.written == []  # nothing went through a channel
    ((entry,),) = [_writer(task, "dead-letters").epoch]
    assert (entry["step"], entry["error_type"]) == ("s", "DeserializationError")
    assert (entry["topic"], entry["partition"], entry["offset"]) == (*IN, no_key)
    assert "has no key" in entry["cause"] and entry["key"] is None
    assert entry["value_utf8"] == '{"n":100}'
    assert task.stats()["dead"] == 1


def test_record_without_a_key_is_counted_and_skipped_when_there_are_no_dead_letters(
    tmp_path: Path,
) -> None:
    log = Log()
    produce(log, IN, _click(1), None)
    produce(log, IN, _click(2), b"u1")
    produce(log, IN, _click(3), b"\xff")
    produce(log, IN, _click(4), b"u1")
    task = _source_task(tmp_path, log, dead_letters=False)
    task.step(0.0, 100)
    assert _writer(task, "out").epoch == [("u1", 2), ("u1", 6)]
    assert task.stats()["bad"] == 2


def test_source_task_keys_records_with_the_key_serde_when_one_is_given(tmp_path: Path) -> None:
    log = Log()
    produce(log, IN, _click(1), b"7")
    produce(log, IN, _click(2), b"8")
    produce(log, IN, _click(3), b"7")
    task = _source_task(tmp_path, log, dead_letters=True, key_serde=JsonSerde())
    task.step(0.0, 100)
    assert _writer(task, "out").epoch == [(7, 1), (8, 2), (7, 4)]
