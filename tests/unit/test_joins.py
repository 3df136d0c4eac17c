"""Joins (:mod:`processor.runtime.operators.joins`): the temporal (stream-table), table-table and
interval joins, their definition errors, and a property for each: any interleaving of the two
inputs, any batching and any snapshot/restore points give the answer computed here without the
engine, as long as no record is late."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from processor.compiler import compile_flow
from processor.dataflow import Dataflow, Table
from processor.errors import DefinitionError
from processor.runtime.operators.core import MAX_WATERMARK, Operator, Record
from processor.runtime.operators.joins import IntervalJoin, TableJoin, TemporalJoin
from processor.runtime.operators.registry import build_operator
from processor.snapshot import codec
from sinks import ConsoleSink

Event = tuple[int, Any, Any, int]  # (side, key, value, ts)


def _flow() -> tuple[Dataflow, Any, Table]:
    flow = Dataflow("job", dead_letters=ConsoleSink())
    clicks = flow.source("clicks", "clicks").key_by("by-user", lambda c: c["user"])
    users = flow.table("users", "users")
    return flow, clicks, users


def _built(flow: Dataflow, name: str = "j") -> Operator:
    return build_operator(flow.steps[name])


def _sides(op: Operator) -> tuple[Operator, Operator]:
    parents = op.parents  # type: ignore[attr-defined]
    return op.input(parents[0]), op.input(parents[1])


def _drive(op: Operator, events: list[Event], cuts: set[int], snaps: set[int]) -> list[Record]:
    """Feeds ``events`` in order, each side's batch cut at ``cuts``; the watermark trails the
    slower side's newest timestamp by 1 ms (so no record is late); at ``snaps`` the operator is
    snapshotted through the codec and replaced by a restored copy."""
    out: list[Record] = []
    newest = [None, None]
    pending: list[list[Record]] = [[], []]
    inputs = _sides(op)

    def push(side: int) -> None:
        if pending[side]:
            out.extend(inputs[side].process(pending[side]))
            pending[side] = []

    for i, (side, k, v, t) in enumerate(events):
        pending[side].append((k, v, t))
        if i in cuts or i == len(events) - 1 or events[i + 1][0] != side:
            push(side)
            newest[side] = t
            if None not in newest:
                out.extend(op.on_watermark(min(newest) - 1))  # type: ignore[type-var]
        if i in snaps and not any(pending):
            state = codec.loads(codec.dumps(op.snapshot()))
            fresh = build_operator(op.step)  # type: ignore[attr-defined]
            fresh.restore(state)
            op, inputs = fresh, _sides(fresh)
    out.extend(op.on_watermark(MAX_WATERMARK))
    return out


def _interleavings(draw: Any, left: list[tuple[Any, Any, int]], right: list[tuple[Any, Any, int]]):
    """Both sides in time order (each is one source partition), interleaved at random."""
    left, right = sorted(left, key=lambda r: r[2]), sorted(right, key=lambda r: r[2])
    order = draw(st.permutations([0] * len(left) + [1] * len(right)))
    it = [iter(left), iter(right)]
    return [(side, *next(it[side])) for side in order]


records = st.lists(
    st.tuples(st.sampled_from("abc"), st.integers(0, 99), st.integers(0, 60)), max_size=25
)
rows = st.lists(
    st.tuples(st.sampled_from("abc"), st.one_of(st.none(), st.integers(0, 99)), st.integers(0, 60)),
    max_size=15,
)


def _cuts(draw: Any, n: int) -> tuple[set[int], set[int]]:
    cuts = draw(st.sets(st.integers(0, max(n - 1, 0))))
    snaps = draw(st.sets(st.integers(0, max(n - 1, 0))))
    return cuts, snaps


# -- temporal join (stream with table) ----------------------------------------------------------


def _temporal(how: str = "inner") -> TemporalJoin:
    flow, clicks, users = _flow()
    clicks.join("j", users, how=how).sink("out", ConsoleSink())
    op = _built(flow)
    assert isinstance(op, TemporalJoin)
    return op


def _row_at(updates: list[tuple[Any, Any, int]], key: Any, t: int) -> Any:
    """The row of ``key`` at ``t``: the last update (in input order) of the newest timestamp
    at or before ``t``."""
    best = None
    for k, row, ts in updates:
        if k == key and ts <= t and (best is None or ts >= best[0]):
            best = (ts, row)
    return None if best is None else best[1]


@settings(max_examples=150, deadline=None)
@given(st.data(), records, rows, st.sampled_from(["inner", "left"]))
def test_a_temporal_join_gives_each_record_its_row_as_of_its_time_in_any_interleaving(
    data: Any, stream: list[Any], table: list[Any], how: str
) -> None:
    events = _interleavings(data.draw, stream, table)
    table_order = [(k, row, t) for side, k, row, t in events if side == 1]
    cuts, snaps = _cuts(data.draw, len(events))
    out = _drive(_temporal(how), events, cuts, snaps)
    want = Counter()
    for k, v, t in stream:
        row = _row_at(table_order, k, t)
        if row is not None or how == "left":
            want[(k, repr([v, row]), t)] += 1
    assert Counter((k, repr(v), t) for k, v, t in out) == want


def test_a_record_waits_for_the_watermark_and_joins_the_row_of_its_time() -> None:
    op = _temporal()
    clicks, users = _sides(op)
    users.process([("u1", {"plan": "free"}, 10)])
    assert clicks.process([("u1", "c1", 15), ("u1", "c2", 30)]) == []  # waiting
    users.process([("u1", {"plan": "pro"}, 20), ("u1", None, 40)])  # a tombstone at 40
    clicks.process([("u1", "c3", 45)])
    assert op.on_watermark(29) == [("u1", ["c1", {"plan": "free"}], 15)]
    assert op.on_watermark(100) == [("u1", ["c2", {"plan": "pro"}], 30)]  # c3: row deleted
    assert op.table.rows == {}  # pruned: the tombstone is behind the watermark


def test_a_record_behind_the_watermark_joins_at_once() -> None:
    op = _temporal(how="left")
    clicks, users = _sides(op)
    users.process([("u1", "a", 10), ("u1", "b", 20)])
    op.on_watermark(25)  # prunes the version at 10
    assert clicks.process([("u1", "late", 22), ("u2", "late", 5)]) == [
        ("u1", ["late", "b"], 22),
        ("u2", ["late", None], 5),
    ]


def test_a_failing_joiner_sends_the_record_to_the_handler_and_the_others_go_on() -> None:
    flow, clicks, users = _flow()
    clicks.join("j", users, lambda v, row: 1 // v).sink("out", ConsoleSink())
    op = _built(flow)
    failed: list[Any] = []
    op.on_error = lambda o, batch, i, exc: failed.append((batch[i], type(exc)))
    c, u = _sides(op)
    u.process([("k", "row", 0)])
    c.process([("k", 0, 5), ("k", 1, 6)])
    assert op.on_watermark(10) == [("k", 1, 6)]
    assert failed == [(("k", 0, 5), ZeroDivisionError)]


# -- table join ---------------------------------------------------------------------------------


def _table_join(how: str = "inner") -> TableJoin:
    flow = Dataflow("job")
    a, b = flow.table("a", "ta"), flow.table("b", "tb")
    a.join("j", b, how=how).sink("out", ConsoleSink())
    op = _built(flow)
    assert isinstance(op, TableJoin)
    return op


def _expected_table_join(events: list[Event], how: str) -> Counter[Any]:
    sides: list[list[tuple[Any, Any, int]]] = [[], []]
    for side, k, row, t in events:
        sides[side].append((k, row, t))
    want: Counter[Any] = Counter()
    for key in {k for _s, k, _r, _t in events}:
        had = False
        for t in sorted({t for _s, k, _r, t in events if k == key}):
            left, right = _row_at(sides[0], key, t), _row_at(sides[1], key, t)
            if left is not None and (right is not None or how == "left"):
                want[(key, repr([left, right]), t)] += 1
                had = True
            elif had:
                want[(key, repr(None), t)] += 1
                had = False
    return want


@settings(max_examples=150, deadline=None)
@given(st.data(), rows, rows, st.sampled_from(["inner", "left"]))
def test_a_table_join_emits_the_joined_row_at_every_change_in_any_interleaving(
    data: Any, left: list[Any], right: list[Any], how: str
) -> None:
    events = _interleavings(data.draw, left, right)
    cuts, snaps = _cuts(data.draw, len(events))
    out = _drive(_table_join(how), events, cuts, snaps)
    assert Counter((k, repr(v), t) for k, v, t in out) == _expected_table_join(events, how)


def test_a_table_join_emits_a_tombstone_when_the_joined_row_goes() -> None:
    op = _table_join()
    a, b = _sides(op)
    a.process([("k", 1, 10)])
    b.process([("k", 2, 20)])
    a.process([("k", None, 30)])
    assert op.on_watermark(100) == [("k", [1, 2], 20), ("k", None, 30)]


# -- interval join ------------------------------------------------------------------------------


def _interval(lower: int, upper: int) -> IntervalJoin:
    flow, clicks, _users = _flow()
    views = flow.source("views", "views").key_by("view-user", lambda v: v["user"])
    clicks.interval_join(
        "j", views, lower=timedelta(milliseconds=lower), upper=timedelta(milliseconds=upper)
    ).sink("out", ConsoleSink())
    op = _built(flow)
    assert isinstance(op, IntervalJoin)
    return op


@settings(max_examples=150, deadline=None)
@given(st.data(), records, records, st.integers(-20, 20), st.integers(0, 20))
def test_an_interval_join_emits_every_matching_pair_once_in_any_interleaving(
    data: Any, left: list[Any], right: list[Any], lower: int, width: int
) -> None:
    upper = lower + width
    events = _interleavings(data.draw, left, right)
    cuts, snaps = _cuts(data.draw, len(events))
    op = _interval(lower, upper)
    out = _drive(op, events, cuts, snaps)
    want = Counter(
        (ka, repr([va, vb]), max(ta, tb))
        for ka, va, ta in left
        for kb, vb, tb in right
        if ka == kb and ta + lower <= tb <= ta + upper
    )
    assert Counter((k, repr(v), t) for k, v, t in out) == want


def test_an_interval_join_forgets_records_no_future_record_can_match() -> None:
    op = _interval(-5, 10)
    a, b = _sides(op)
    a.process([("k", "a1", 100)])  # matches b in [95, 110]
    b.process([("k", "b1", 104)])  # matches a in [94, 109]
    op.on_watermark(108)
    assert op.held == ({"k": [(100, "a1")]}, {"k": [(104, "b1")]})
    op.on_watermark(109)  # b1: 104 + 5 <= 109, and a record still to come is after 109
    assert op.held == ({"k": [(100, "a1")]}, {})
    op.on_watermark(110)  # a1: 100 + 10 <= 110
    assert op.held == ({}, {})
    assert a.process([("k", "late", 90)]) == [] and op.late_dropped == 1


# -- definitions and compilation ----------------------------------------------------------------


def test_join_definitions_are_checked_when_built() -> None:
    _, clicks, users = _flow()
    with pytest.raises(DefinitionError, match="must be a Table"):
        clicks.join("j", clicks)
    with pytest.raises(DefinitionError, match="how must be one of"):
        clicks.join("j", users, how="outer")
    with pytest.raises(DefinitionError, match="a table joins another Table"):
        users.join("j", clicks)  # type: ignore[arg-type]
    with pytest.raises(DefinitionError, match=r"lower .* is after upper"):
        clicks.interval_join("j", clicks.map("m", str), lower=timedelta(1), upper=timedelta(0))
    with pytest.raises(DefinitionError, match="second input must be a keyed stream"):
        clicks.interval_join("j", users, lower=timedelta(0), upper=timedelta(1))
    with pytest.raises(DefinitionError, match="joined with itself"):
        clicks.interval_join("j", clicks, lower=timedelta(0), upper=timedelta(1))


def test_a_join_of_two_shuffled_inputs_gets_a_stage_with_a_shuffle_from_each() -> None:
    flow, clicks, users = _flow()
    clicks.join("j", users).sink("out", ConsoleSink())
    plan = compile_flow(flow, 2)
    stage = plan.stage_of("j")
    assert {(e.src_step, e.shuffle) for e in stage.inputs} == {("by-user", True), ("users", True)}
    assert len(plan.stages) == 3


def test_a_join_of_two_keyed_sources_runs_in_one_stage_and_needs_them_copartitioned() -> None:
    flow = Dataflow("job")
    clicks = flow.source("clicks", "clicks", keyed=True)
    clicks.join("j", flow.table("users", "users")).sink("out", ConsoleSink())
    plan = compile_flow(flow, 2)
    assert len(plan.stages) == 1 and not plan.edges
    assert plan.copartitioned == (("clicks", "users"),)


# -- the table's watermark ----------------------------------------------------------------------


def test_a_table_holds_the_watermark_back_until_it_has_caught_up_with_its_end(
    tmp_path: Path,
) -> None:
    """A quiet table must not stop the join forever, and a loading one must hold it: with the
    exclusion always on, the e2e join test still passed on Tansu (its clicks' watermark lags
    anyway), so the rule is checked here."""
    from processor.runtime.task import Task
    from tests.unit.test_task import ListSink, Log, Reader, _env

    class LaggingReader(Reader):
        lag: dict[tuple[str, int], int] = {}

        def cached_lag(self) -> dict[tuple[str, int], int]:
            return dict(self.lag)

    flow = Dataflow("job")
    clicks = flow.source("clicks", "clicks", keyed=True)
    clicks.join("j", flow.table("users", "users")).sink("out", ListSink())
    views = flow.source("views", "views").key_by("v", lambda v: v)
    views.join("j2", flow.table("plans", "plans").map("m", str).to_table("t")).sink(
        "o2", ListSink()
    )
    flow.table("prices", "prices").sink("prices-out", ListSink())  # a changelog, not a join
    plan = compile_flow(flow, 2)
    log = Log()
    reader = LaggingReader(log)
    env = _env(tmp_path, log, plan, reader=reader)

    def watermark(task: Task, lag: dict[tuple[str, int], int]) -> int:
        reader.lag = lag
        task.inputs._last_wm_emit = float("-inf")
        task.inputs._source_watermark()
        return task.watermark

    counts = {"clicks": 1, "users": 1, "plans": 1, "views": 1, "prices": 1}
    joined = Task(env, plan.stage_of("j"), 0)
    joined.open(None, counts)
    joined.inputs.max_ts.update({("clicks", 0): 500, ("users", 0): 100})
    assert watermark(joined, {}) == 100  # not fetched yet: loading
    assert watermark(joined, {("users", 0): 3}) == 100
    assert watermark(joined, {("users", 0): 0}) == 500  # caught up: the clicks decide
    alone = Task(env, plan.stage_of("plans"), 0)
    alone.open(None, counts)
    assert watermark(alone, {("plans", 0): 1}) < 0
    assert watermark(alone, {("plans", 0): 0}) == MAX_WATERMARK - 1
    # A table whose changelog goes anywhere else (a sink, a window, a table join) is a source
    # like any other: a watermark there of "everything" would make every later record late.
    changelog = Task(env, plan.stage_of("prices"), 0)
    changelog.open(None, counts)
    changelog.inputs.max_ts[("prices", 0)] = 7
    assert watermark(changelog, {("prices", 0): 0}) == 7


def test_a_deletion_wins_over_an_earlier_row_that_arrives_after_it() -> None:
    """Regression (review): a tombstone for a key without rows was thrown away, so a row at an
    earlier time arriving after it (from another channel) lived for ever."""
    op = _temporal()
    clicks, users = _sides(op)
    users.process([("k", None, 20)])
    users.process([("k", "A", 10)])
    clicks.process([("k", "c1", 15), ("k", "c2", 30)])
    assert op.on_watermark(100) == [("k", ["c1", "A"], 15)]


def test_a_failing_joiner_on_a_late_table_change_is_a_dead_letter_and_emits_no_tombstone() -> None:
    """Regression (review): the late path of a table join called fn outside the dead-letter
    handling, and marked the row emitted before fn ran."""
    flow = Dataflow("job")
    a, b = flow.table("a", "ta"), flow.table("b", "tb")
    a.join("j", b, lambda x, y: x // y).sink("out", ConsoleSink())
    op = _built(flow)
    failed: list[Any] = []
    op.on_error = lambda o, batch, i, exc: failed.append(batch[i])
    left, right = _sides(op)
    op.on_watermark(50)
    left.process([("k", 1, 10)])
    assert right.process([("k", 0, 20), ("k2", 1, 21)]) == []
    assert failed == [("k", 0, 20)]
    assert left.process([("k", None, 30)]) == []  # no tombstone for a row never emitted


def test_durations_convert_to_exact_milliseconds() -> None:
    """Regression (review): ``int(total_seconds() * 1000)`` made 1001 ms 1000 (1482 of the
    values in 0..200 s were off by one)."""
    from processor.windows import duration_ms

    assert all(duration_ms("d", timedelta(milliseconds=ms)) == ms for ms in range(200_000))
    _, clicks, _users = _flow()
    step = clicks.interval_join(
        "j", clicks.map("m", str), lower=timedelta(milliseconds=-65526), upper=timedelta(0)
    ).step
    assert step.params["lower_ms"] == -65526


def test_worker_gc_thresholds_are_tuned_and_can_be_set_back() -> None:
    import gc

    from processor.errors import ConfigError
    from processor.runtime.supervision.worker import GC_THRESHOLDS, tune_gc

    before = gc.get_threshold()
    try:
        assert tune_gc({}) == GC_THRESHOLDS
        assert tune_gc({"EOSFLOW_GC_THRESHOLDS": "5000,20,30"}) == (5000, 20, 30)
        assert tune_gc({"EOSFLOW_GC_THRESHOLDS": "default"}) == (5000, 20, 30)  # left as is
        with pytest.raises(ConfigError, match="three positive ints"):
            tune_gc({"EOSFLOW_GC_THRESHOLDS": "1,2"})
    finally:
        gc.set_threshold(*before)


def test_a_tables_tombstones_are_read_whatever_the_table_feeds(tmp_path: Path) -> None:
    """Regression: the tombstone rule (no decoding, the Kafka timestamp) was tied to the tables
    that may leave the watermark; a table feeding a table join had its tombstones skipped as
    bad records (its timestamp function ran on None), and deleted rows lived on."""
    from processor.runtime.task import Task
    from tests.unit.test_task import ListSink, Log, Msg, Reader, _env

    class Keyed(Msg):
        def key(self) -> bytes:  # type: ignore[override]
            return b"u1"

        def timestamp(self) -> tuple[int, int]:
            return (1, 40)

    flow = Dataflow("job")
    users = flow.table("users", "users", timestamp=lambda row: 10)
    users.join("j", flow.table("plans", "plans")).sink("out", ListSink())
    plan = compile_flow(flow, 1)
    log = Log()
    task = Task(_env(tmp_path, log, plan, reader=Reader(log)), plan.stage_of("j"), 0)
    task.open(None, {"users": 1, "plans": 1})
    task.inputs._source_batch(
        [Keyed(("users", 0), 0, b"row", None), Keyed(("users", 0), 1, None, None)]
    )
    assert task.inputs.bad_records == 0
    assert task.chain.ops["j"].sides[0].rows == {"u1": [(10, b"row"), (40, None)]}


def test_a_late_table_change_emits_the_joined_row_from_now_on() -> None:
    """Regression (review): a late change was joined at its own time with versions that were
    not valid then (the older ones pruned)."""
    op = _table_join()
    a, b = _sides(op)
    a.process([("k", "L1", 10)])
    b.process([("k", "R1", 10)])
    a.process([("k", "L2", 15)])
    assert op.on_watermark(20) == [("k", ["L1", "R1"], 10), ("k", ["L2", "R1"], 15)]
    assert b.process([("k", "R2", 12)]) == [("k", ["L2", "R2"], 21)]
