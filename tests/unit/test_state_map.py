"""A restore refuses to lose, misplace or misread operator state (issue 24): a renamed or
removed stateful step, a changed kind, ``--map-state`` and ``--allow-dropped-state``.

Regression: a stateful step that was renamed and was not the first step of its stage had its
state skipped by ``TaskCheckpoints._restore`` without a word, while the sources went on from
the checkpoint's offsets (silent data loss)."""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from processor.compiler import Plan, compile_flow
from processor.dataflow import Dataflow, Tumbling
from processor.errors import ConfigError
from processor.runtime.job import RunOptions, parse_map_state
from processor.runtime.operators.state_map import (
    STATE_KEY,
    check_state,
    restore_sources,
    state_kind,
    state_layout,
)
from processor.runtime.task import Task
from processor.snapshot.store import Manifest, SnapshotStore
from processor.wire import Barrier, GenerationStart
from tests.unit.test_task import ListSink, Log, _env

# subtask 0's channels from upstream 0 and 1 (P = 2)
P0, P2 = ("eosflow.job.by-user.seen", 0), ("eosflow.job.by-user.seen", 2)


def _plan(step: str = "per-user", kind: str = "count", extra: str | None = None) -> Plan:
    """clicks -> key_by -> count "seen" -> map "tag" -> ``kind`` ``step`` [-> count ``extra``]
    -> sink: ``step`` is not the first step of its stage (named "seen"), so renaming it does
    not rename the stage (which check_graph refuses)."""
    flow = Dataflow("job")
    keyed = flow.source("clicks", "in").key_by("by-user", lambda v: v).count("seen")
    tagged = keyed.map("tag", lambda v: v)
    if kind == "count":
        out = tagged.count(step)
    elif kind == "window":
        out = tagged.count(step, window=Tumbling(timedelta(seconds=10)))
    else:
        out = tagged.process(step, lambda ctx, v: None)
    if extra is not None:
        out = out.count(extra)
    out.sink("out", ListSink())
    return compile_flow(flow, 2)


def _checkpoint(
    store: SnapshotStore, plan: Plan, *, recorded: bool = True, kinds: bool = True
) -> Manifest:
    """Completes checkpoint 1 of ``plan`` as its tasks and coordinator write it; ``recorded``:
    with the layout in the manifest, ``kinds``: with kinds in the snapshots (older eosflow
    wrote neither)."""
    handles = {}
    for task in plan.task_names():
        stage = plan.stages[[s.name for s in plan.stages].index(task.rpartition(".")[0])]
        ops = {n: k for n, k in state_layout(plan)[stage.name].items()}
        state: dict[str, Any] = {"operators": {n: {} for n in ops}}
        if kinds:
            state["kinds"] = ops
        handles[task] = store.write_task_snapshot(plan.job, 1, task, state)
    metadata = {STATE_KEY: state_layout(plan)} if recorded else {}
    store.complete(plan.job, 1, handles, {"generation": 1, **metadata})
    return store.load(plan.job, 1)


@pytest.fixture
def store(tmp_path: Path) -> SnapshotStore:
    return SnapshotStore(tmp_path.as_uri())


def _check(plan: Plan, store: SnapshotStore, manifest: Manifest | None, **kw: Any) -> None:
    check_state(plan, store, manifest, kw.get("map_state", {}), kw.get("allow_dropped", False))


@pytest.mark.parametrize("recorded", [True, False], ids=["manifest", "old-manifest"])
def test_a_renamed_stateful_step_is_refused_naming_step_checkpoint_and_fixes(
    store: SnapshotStore, recorded: bool
) -> None:
    manifest = _checkpoint(store, _plan("per-user"), recorded=recorded, kinds=recorded)
    with pytest.raises(ConfigError) as err:
        _check(_plan("per-user-v2"), store, manifest)
    text = str(err.value)
    assert "'per-user': no longer in the pipeline" in text
    assert "checkpoint 1 of job 'job'" in text and store.url in text
    for fix in ("Rename the step back", "--map-state OLD=NEW", "--allow-dropped-state"):
        assert fix in text


def test_the_same_pipeline_restores_without_a_word(store: SnapshotStore) -> None:
    _check(_plan(), store, _checkpoint(store, _plan()))


def test_a_removed_step_is_dropped_and_logged_with_allow_dropped_state(
    store: SnapshotStore, caplog: pytest.LogCaptureFixture
) -> None:
    manifest = _checkpoint(store, _plan(extra="twice"))
    with pytest.raises(ConfigError, match="'twice': no longer in the pipeline"):
        _check(_plan(), store, manifest)
    with caplog.at_level(logging.WARNING):
        _check(_plan(), store, manifest, allow_dropped=True)
    assert "dropping state step=twice checkpoint_id=1" in caplog.text


def test_a_step_that_no_longer_keeps_state_is_refused(store: SnapshotStore) -> None:
    flow = Dataflow("job")
    keyed = flow.source("clicks", "in").key_by("by-user", lambda v: v).count("seen")
    keyed.map("per-user", lambda v: v).sink("out", ListSink())
    with pytest.raises(ConfigError, match="'per-user': now a map step, keeping no state"):
        _check(compile_flow(flow, 2), store, _checkpoint(store, _plan()))


def test_a_new_stateful_step_starts_empty_with_a_log_line(
    store: SnapshotStore, caplog: pytest.LogCaptureFixture
) -> None:
    manifest = _checkpoint(store, _plan())
    with caplog.at_level(logging.INFO):
        _check(_plan(extra="twice"), store, manifest)
    assert "new stateful step starts empty step=twice kind=aggregate" in caplog.text


@pytest.mark.parametrize(
    ("before", "after", "said"),
    [("count", "process", "was aggregate, is process"),
     ("count", "window", "was aggregate, is window-aggregate")],
)  # fmt: skip
def test_a_changed_kind_under_the_same_name_is_refused(
    store: SnapshotStore, before: str, after: str, said: str
) -> None:
    manifest = _checkpoint(store, _plan(kind=before))
    with pytest.raises(ConfigError, match=said):
        _check(_plan(kind=after), store, manifest, allow_dropped=True)


def test_old_snapshots_without_kinds_skip_the_kind_check(store: SnapshotStore) -> None:
    manifest = _checkpoint(store, _plan(kind="count"), recorded=False, kinds=False)
    _check(_plan(kind="process"), store, manifest)  # nothing says what it was
    _check(_plan("renamed", kind="process"), store, manifest, map_state={"per-user": "renamed"})


def test_old_snapshots_with_kinds_still_check_them(store: SnapshotStore) -> None:
    manifest = _checkpoint(store, _plan(kind="count"), recorded=False, kinds=True)
    with pytest.raises(ConfigError, match="was aggregate, is process"):
        _check(_plan(kind="process"), store, manifest)


def test_map_state_accepts_a_rename_onto_a_stateful_step_of_the_same_kind(
    store: SnapshotStore, caplog: pytest.LogCaptureFixture
) -> None:
    manifest = _checkpoint(store, _plan("per-user"))
    with caplog.at_level(logging.INFO):
        _check(_plan("per-user-v2"), store, manifest, map_state={"per-user": "per-user-v2"})
    assert "mapping state old=per-user new=per-user-v2 checkpoint_id=1" in caplog.text
    assert "starts empty" not in caplog.text


@pytest.mark.parametrize(
    ("mapping", "plan", "said"),
    [
        ({"nope": "per-user-v2"}, _plan("per-user-v2"),
         "holds no state of step 'nope' \\(it holds state of: per-user, seen\\)"),
        ({"per-user": "ghost"}, _plan("per-user-v2"), "the pipeline has no such step"),
        ({"per-user": "tag"}, _plan("per-user-v2"), "has it as a map step"),
        ({"per-user": "per-user-v2"}, _plan("per-user-v2", kind="process"),
         "'per-user' kept aggregate state, 'per-user-v2' is a process"),
        ({"per-user": "twice"}, _plan(extra="twice"), "still has the stateful step 'per-user'"),
    ],
    ids=["unknown-old", "unknown-new", "stateless-new", "other-kind", "old-still-there"],
)  # fmt: skip
def test_map_state_is_refused_when(
    store: SnapshotStore, mapping: dict[str, str], plan: Plan, said: str
) -> None:
    manifest = _checkpoint(store, _plan("per-user"))
    with pytest.raises(ConfigError, match=said):
        _check(plan, store, manifest, map_state=mapping, allow_dropped=True)


def test_map_state_onto_a_step_with_state_of_its_own_drops_that_state_only_if_allowed(
    store: SnapshotStore,
) -> None:
    manifest = _checkpoint(store, _plan(extra="twice"))
    plan = _plan("twice-v0", extra="twice")  # per-user renamed; its state mapped onto twice
    mapping = {"per-user": "twice"}
    with pytest.raises(ConfigError, match="'twice': replaced by the state of 'per-user'"):
        _check(plan, store, manifest, map_state=mapping)
    _check(plan, store, manifest, map_state=mapping, allow_dropped=True)


def test_map_state_without_a_checkpoint_is_refused(store: SnapshotStore) -> None:
    with pytest.raises(ConfigError, match="no completed checkpoint"):
        _check(_plan(), store, None, map_state={"a": "per-user"})
    _check(_plan(), store, None)


@pytest.mark.parametrize(
    ("texts", "said"),
    [(["a"], "expected OLD=NEW"), (["=b"], "expected OLD=NEW"),
     (["a=b", "a=c"], "mapped twice"), (["a=c", "b=c"], "both mapped onto 'c'"),
     (["a=a"], "onto themselves")],
)  # fmt: skip
def test_map_state_options_are_refused_when_malformed(texts: list[str], said: str) -> None:
    with pytest.raises(ConfigError, match=said):
        parse_map_state(texts)


def test_run_options_validate_the_mapping() -> None:
    assert parse_map_state(["a=b", " c = d "]) == {"a": "b", "c": "d"}
    with pytest.raises(ConfigError, match="both mapped onto 'c'"):
        RunOptions(map_state={"a": "c", "b": "c"}).validate()


def test_restore_sources_give_new_the_state_of_old_and_drop_what_it_replaces() -> None:
    assert restore_sources(["a", "b"], {}) == {"a": "a", "b": "b"}
    assert restore_sources(["old", "x"], {"old": "new"}) == {"x": "x", "new": "old"}
    assert restore_sources(["old", "new"], {"old": "new"}) == {"new": "old"}
    assert restore_sources(["x"], {"old": "new"}) == {"x": "x"}  # a later checkpoint


def test_every_stateful_operator_has_a_state_kind_and_no_stateless_one_has() -> None:
    from processor.runtime.operators.registry import build_operator

    flow = Dataflow("job")
    keyed = flow.source("clicks", "in").key_by("k", lambda v: v)
    keyed.count("plain")
    keyed.count("windowed", window=Tumbling(timedelta(seconds=1)))
    keyed.process("proc", lambda ctx, v: None)
    keyed.dedup("kdedup", id=lambda v: v, within=timedelta(minutes=1))
    keyed.map("m", lambda v: v).filter("f", bool)
    for step in flow.steps.values():
        if step.kind in ("source", "sink"):
            continue
        assert (state_kind(step) is not None) == build_operator(step).stateful, step.name


def test_a_task_snapshots_kinds_and_restores_old_state_into_new_with_map_state(
    tmp_path: Path,
) -> None:
    """The task side: the snapshot records each operator's kind; ``map_state`` restores the
    state of the old name into the renamed operator (before: it started empty)."""
    log = Log()
    for tp in (P0, P2):
        log.ctl(tp, GenerationStart(1))
    log.data(P0, "a")
    log.data(P2, "b")
    log.data(P2, "b")
    for tp in (P0, P2):
        log.ctl(tp, Barrier(1, 1))
    old = _plan("per-user")
    task = Task(_env(tmp_path, log, old), old.stage_of("per-user"), 0)
    task.open(None, {"in": 2})
    task.step(0.0, 100)
    deadline = time.monotonic() + 5
    acks: list[int] = []
    while not acks and time.monotonic() < deadline:  # the upload runs on the pool
        acks = [chk for chk, _h in task.ready_acks()]
        time.sleep(0.01)
    assert acks == [1]
    snap = task.env.store.read_task_snapshot(str(tmp_path / "job/chk-0000000001/seen.0.g1.snap"))
    assert snap["kinds"] == {"seen": "aggregate", "per-user": "aggregate"}
    assert snap["operators"]["per-user"] == {"a": 1, "b": 2}
    new = _plan("per-user-v2")
    env = _env(tmp_path / "again", log, new, generation=2, map_state={"per-user": "per-user-v2"})
    renamed = Task(env, new.stage_of("per-user-v2"), 0)
    renamed.open(snap, {"in": 2})
    assert renamed.chain.ops["per-user-v2"].snapshot() == {"a": 1, "b": 2}
    assert renamed.chain.ops["seen"].snapshot() == {"a": 1, "b": 2}
