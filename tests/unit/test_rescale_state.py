"""Keyed operator state after a change of parallelism
(:mod:`processor.runtime.shape.rescale_state`).

The core is one property per state kind: records ``xs`` routed over ``P_old`` subtasks by a real
:class:`~processor.runtime.task.channels.ChannelOut`, a snapshot of each through the codec, the
states redistributed over ``P_new`` subtasks as the runner does (``shared_keys``, ``keep`` by
``key_owner(key_bytes(k))``), restored into fresh operators that then take ``ys``; every
watermark is broadcast to every subtask. The union of all outputs must equal what one operator
gives for ``xs + ys``, and every key must sit in exactly one new subtask, the one that owns it.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import find, given, settings
from hypothesis import strategies as st

from processor.dataflow import Dataflow, Session, Sliding, Tumbling
from processor.runtime.operators.core import MAX_WATERMARK, MIN_WATERMARK, Operator, Record
from processor.runtime.operators.process import ProcessContext
from processor.runtime.operators.registry import build_operator
from processor.runtime.operators.state_map import state_kind
from processor.runtime.shape.rescale_state import KINDS, key_bytes, redistribute
from processor.runtime.task.channels import ChannelOut
from processor.snapshot import codec
from processor.wire import key_owner, shared_keys
from sinks import ConsoleSink

Item = tuple[Any, ...]  # ("r", side, key, value, ts) | ("w", watermark) | ("p", now_ms)

KEYS = ["a", "b", "c", "d", "e", "f", "g", 1, 2, ("x", 1), ("y", 2)]


# -- steps of each kind -----------------------------------------------------------------------


def _keyed(flow: Dataflow, name: str = "s") -> Any:
    return flow.source(name, name).key_by(f"by-{name}", lambda v: v)


def _aggregate(draw: Any) -> Any:
    flow = Dataflow("job")
    ttl = draw(st.sampled_from([None, timedelta(milliseconds=15)]))
    _keyed(flow).reduce("agg", lambda a, b: a + b, ttl=ttl)
    return flow.steps["agg"]


def _window_aggregate(draw: Any) -> Any:
    flow = Dataflow("job")
    ms = timedelta(milliseconds=1)
    window = draw(st.sampled_from([Tumbling(10 * ms), Sliding(20 * ms, 10 * ms)]))
    emit = draw(st.sampled_from(["close", "update"]))
    late = draw(st.sampled_from([0, 5])) * ms
    _keyed(flow).reduce("agg", lambda a, b: a + b, window=window, allowed_lateness=late, emit=emit)
    return flow.steps["agg"]


def _session_aggregate(draw: Any) -> Any:
    flow = Dataflow("job")
    late = timedelta(milliseconds=draw(st.sampled_from([0, 5])))
    window = Session(timedelta(milliseconds=10))
    _keyed(flow).reduce("agg", lambda a, b: a + b, window=window, allowed_lateness=late)
    return flow.steps["agg"]


def _temporal_join(draw: Any) -> Any:
    flow = Dataflow("job", dead_letters=ConsoleSink())
    how = draw(st.sampled_from(["inner", "left"]))
    _keyed(flow).join("j", flow.table("t", "t"), how=how).sink("out", ConsoleSink())
    return flow.steps["j"]


def _table_join(draw: Any) -> Any:
    flow = Dataflow("job")
    how = draw(st.sampled_from(["inner", "left"]))
    flow.table("a", "a").join("j", flow.table("b", "b"), how=how).sink("out", ConsoleSink())
    return flow.steps["j"]


def _interval_join(draw: Any) -> Any:
    flow = Dataflow("job", dead_letters=ConsoleSink())
    lower = draw(st.integers(-10, 10))
    upper = lower + draw(st.integers(0, 15))
    ms = timedelta(milliseconds=1)
    _keyed(flow, "a").interval_join("j", _keyed(flow, "b"), lower=lower * ms, upper=upper * ms)
    return flow.steps["j"]


def _on_record(ctx: ProcessContext, value: Any) -> None:
    """``[action, n]``: add n to the key's state (emitting it), clear it, or register or delete
    a timer at n."""
    action, n = value
    if action == "add":
        total = ctx.state.get(0) + n
        ctx.state.set(total)
        ctx.emit(["sum", total])
    elif action == "clear":
        ctx.state.delete()
    elif action == "reg":
        ctx.timers.register_event_time(n)
    elif action == "del":
        ctx.timers.delete_event_time(n)
    else:
        ctx.timers.register_processing_time(n)


def _on_timer(ctx: ProcessContext, ts: int, kind: str) -> None:
    ctx.emit(["timer", kind, ts, ctx.state.get(), ctx.watermark_ms])
    if ts % 3 == 0 and kind == "event_time":  # a timer that registers the next one
        ctx.timers.register_event_time(ts + 7)


def _process(draw: Any) -> Any:
    flow = Dataflow("job", dead_letters=ConsoleSink())
    _keyed(flow).process("proc", _on_record, on_timer=_on_timer)
    return flow.steps["proc"]


ints = st.integers(0, 9)
rows = st.one_of(st.none(), ints)  # a table's row, or a tombstone
actions = st.tuples(st.sampled_from(["add", "add", "clear", "reg", "reg", "del", "preg"]), ints)
timer_times = st.tuples(st.sampled_from(["reg", "del", "preg"]), st.integers(0, 120))

#: kind -> (step factory, value strategy per side, records may be late, processing time)
CASES: dict[str, tuple[Callable[[Any], Any], list[Any], bool, bool]] = {
    # ttl: the sweep mark is not in snapshots, so a restored operator sweeps at its first
    # watermark; a record behind the watermark may then restart a key the single operator
    # has not swept yet (a restore difference, not a rescaling one): no late records here.
    "aggregate": (_aggregate, [ints], False, False),
    "window-aggregate": (_window_aggregate, [ints], True, False),
    "session-aggregate": (_session_aggregate, [ints], True, False),
    "temporal-join": (_temporal_join, [ints, rows], True, False),
    "table-join": (_table_join, [rows, rows], True, False),
    "interval-join": (_interval_join, [ints, ints], True, False),
    "process": (_process, [st.one_of(actions, timer_times)], True, True),
}


# -- driving subtasks ---------------------------------------------------------------------------


class _Sent:
    def __init__(self) -> None:
        self.partitions: list[int] = []

    def write(
        self, topic: str, partition: int, value: bytes, key: Any = None, headers: Any = None
    ) -> None:
        self.partitions.append(partition)


def _route(key: Any, parallelism: int, groups: int) -> int:
    """The downstream subtask a real channel sends ``key`` to (upstream subtask 0)."""
    # Cached by repr: ``True == 1`` (one dict key), but a channel routes them apart.
    return _channel_route(repr(key), key, parallelism, groups)


_routes: dict[tuple[str, int, int], int] = {}


def _channel_route(name: str, key: Any, parallelism: int, groups: int) -> int:
    found = _routes.get((name, parallelism, groups))
    if found is None:
        sent = _Sent()
        edge: Any = SimpleNamespace(topic="t", shuffle=True, loop=False)
        writer: Any = sent
        ChannelOut(edge, 0, parallelism, writer, key_groups=groups).process([(key, None, 0)])
        (found,) = sent.partitions
        _routes[name, parallelism, groups] = found
    return found


def _run(ops: list[Operator], parents: list[str], script: list[Item], groups: int) -> list[Record]:
    out: list[Record] = []
    for item in script:
        if item[0] == "r":
            _r, side, k, v, t = item
            op = ops[_route(k, len(ops), groups)]
            out += op.input(parents[side]).process([(k, v, t)])
        elif item[0] == "w":  # broadcast, as every upstream subtask writes it to every partition
            for op in ops:
                out += op.on_watermark(item[1])
        else:
            for op in ops:
                out += op.on_processing_time(item[1])
    return out


def _keep(subtask: int, parallelism: int, groups: int) -> Callable[[Any], bool]:
    """The runner's predicate: new subtask ``subtask`` owns the key."""
    return lambda key: key_owner(key_bytes(key), parallelism, groups) == subtask


def _round_trip(state: Any) -> Any:
    return codec.loads(codec.dumps(state))


def _keys(kind: str, state: Any) -> list[Any]:
    """Every key ``state`` holds something for (with repeats: one per place)."""
    if state is None:
        return []
    if kind == "aggregate":
        return list(state) if isinstance(state, dict) else [e[0] for e in state]
    if kind == "window-aggregate":
        return [k for bucket in state["windows"].values() for k in bucket]
    if kind == "session-aggregate":
        return [k for k, _ in state["sessions"]]
    if kind == "interval-join":
        return [k for side in state["held"] for k, _ in side]
    if kind == "process":
        timers = [k for entries in state["timers"].values() for _t, k in entries]
        return [k for k, _ in state["state"]] + timers
    tables = [state["table"]] if kind == "temporal-join" else state["sides"]
    rows = [k for table in tables for k, _ in table[1]]
    heap = state["waiting"] if kind == "temporal-join" else state["changes"]
    return rows + [e[2] for e in heap] + list(state.get("last", []))


keys = st.one_of(st.sampled_from(KEYS), st.sampled_from(KEYS[-3:]))  # half on 3 hot keys


def _script(draw: Any, values: list[Any], processing: bool, min_size: int) -> list[Item]:
    """Items with relative times (made absolute by :func:`_timed`): a record at the watermark
    plus -25..30 ms (late at 0 or less), a watermark advanced by 0..20 ms, a processing time
    advanced by 0..20 ms."""
    record = st.integers(0, len(values) - 1).flatmap(
        lambda side: st.tuples(
            st.just("r"), st.just(side), keys, values[side], st.integers(-25, 30)
        )
    )
    items = [record, record, record, st.tuples(st.just("w"), st.integers(0, 20))]
    if processing:
        items.append(st.tuples(st.just("p"), st.integers(0, 20)))
    script: list[Item] = draw(st.lists(st.one_of(*items), min_size=min_size, max_size=30))
    return script


def _timed(script: list[Item]) -> list[Item]:
    out: list[Item] = []
    watermark = now = 0
    for item in script:
        if item[0] == "r":
            out.append((*item[:4], max(0, watermark + item[4])))
        elif item[0] == "w":
            watermark += item[1]
            out.append(("w", watermark))
        else:
            now += item[1]
            out.append(("p", now))
    return out


def _on_time(script: list[Item]) -> list[Item]:
    """Every watermark lowered below the records after it: no record is late."""
    out, low = [], MAX_WATERMARK
    for item in reversed(script):
        if item[0] == "r":
            low = min(low, item[4] - 1)
        elif item[0] == "w":
            item = ("w", min(item[1], low))
        out.append(item)
    return out[::-1]


def _event_time(op: Any) -> list[Any]:
    """An operator's watermark and its tables' prune marks (what is not per key)."""
    tables = [op.table] if hasattr(op, "table") else list(getattr(op, "sides", []))
    return [getattr(op, "watermark", None), *(t.pruned_at for t in tables)]


def _canon(records: list[Record]) -> Counter[Any]:
    return Counter((repr(k), repr(v), t) for k, v, t in records)


# -- the properties -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(CASES))
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_rescaled_subtasks_give_the_output_of_one_operator_when_parallelism_changes(
    kind: str, data: Any
) -> None:
    factory, values, late_ok, processing = CASES[kind]
    step = factory(data.draw)
    assert state_kind(step) == kind
    groups = data.draw(st.sampled_from([4, 8, 128]), label="G")
    p_old = data.draw(st.integers(1, min(5, groups)), label="P_old")
    p_new = data.draw(st.integers(1, min(5, groups)), label="P_new")
    cut = len(xs := _script(data.draw, values, processing, 8))
    both = _timed(xs + _script(data.draw, values, processing, 0))
    if not late_ok:
        both = _on_time(both)
    xs, ys = both[:cut], [*both[cut:], ("w", MAX_WATERMARK)]

    old = [build_operator(step) for _ in range(p_old)]
    got = _run(old, step.parents, xs, groups)
    states = [_round_trip(op.snapshot()) for op in old]
    untouched = copy.deepcopy(states)
    shared = shared_keys(p_old, groups, p_new, groups)
    new = []
    for i in range(p_new):
        merged = redistribute(kind, [states[s] for s in sorted(shared[i])], _keep(i, p_new, groups))
        op = build_operator(step)
        op.restore(_round_trip(merged))
        new.append(op)
        held = _keys(kind, op.snapshot())
        assert all(_route(k, p_new, groups) == i for k in held), (i, held)
    assert states == untouched  # each new subtask's merge reads the same old states
    # Nothing lost, nothing doubled: each key's entries are all in its new owner.
    assert Counter(map(repr, (k for op in new for k in _keys(kind, op.snapshot())))) == Counter(
        map(repr, (k for s in states for k in _keys(kind, s)))
    )
    single = build_operator(step)
    want = _run([single], step.parents, xs, groups)
    # Every new subtask goes on at the job's event time (at an aligned barrier every subtask
    # of a shuffled stage has the same one).
    assert all(_event_time(op) == _event_time(single) for op in new)
    got += _run(new, step.parents, ys, groups)
    want += _run([single], step.parents, ys, groups)
    assert _canon(got) == _canon(want)


# -- unit tests ---------------------------------------------------------------------------------


def _count_step() -> Any:
    flow = Dataflow("job")
    _keyed(flow).count("count")
    return flow.steps["count"]


@pytest.mark.parametrize("p_new", [1, 2, 3, 5])
def test_a_key_lands_in_exactly_one_new_subtask_when_spread_over_the_new_parallelism(
    p_new: int,
) -> None:
    groups, p_old = 8, 3
    step = _count_step()
    old = [build_operator(step) for _ in range(p_old)]
    keys = [f"k{n}" for n in range(200)] + [n for n in range(50)] + [("t", n) for n in range(50)]
    for k in keys:
        old[_route(k, p_old, groups)].process([(k, 1, 0)])
    states = [_round_trip(op.snapshot()) for op in old]
    shared = shared_keys(p_old, groups, p_new, groups)
    placed: Counter[Any] = Counter()
    for i in range(p_new):
        merged = redistribute(
            "aggregate",
            [states[s] for s in sorted(shared[i])],
            _keep(i, p_new, groups),
        )
        placed.update(merged)
        assert all(_route(k, p_new, groups) == i for k in merged)
    assert placed == Counter(keys)


def test_key_bytes_are_the_bytes_a_channel_hashes_when_keys_went_through_the_codec() -> None:
    assert key_bytes("é") == "é".encode()
    assert key_bytes(7) == b"7"
    assert key_bytes(("x", 1)) == key_bytes(["x", 1]) == b'["x",1]'
    restored = codec.loads(codec.dumps({("x", 1): 0}))  # the codec keeps tuples
    assert list(restored) == [("x", 1)]
    for k in ["a", 3, 2.5, True, None, ("x", 1), ("y", ("z", 2))]:
        for p in (2, 3, 5):
            assert key_owner(key_bytes(k), p, 128) == _route(k, p, 128)


def _fed_step(kind: str) -> tuple[Any, list[Item]]:
    """A step of ``kind`` and a script that leaves state of every sort in it."""
    fixed = {
        "aggregate": _aggregate,
        "window-aggregate": _window_aggregate,
        "session-aggregate": _session_aggregate,
        "temporal-join": _temporal_join,
        "table-join": _table_join,
        "interval-join": _interval_join,
        "process": _process,
    }[kind]
    step = fixed(lambda strategy: find(strategy, lambda _x: True))  # the simplest choices
    script: list[Item] = []
    for n, k in enumerate(KEYS):
        script += [("r", 0, k, ("reg", 50 + n) if kind == "process" else n, 40 + n)]
        if len(step.parents) == 2:
            script += [("r", 1, k, n, 42 + n), ("r", 1, k, n + 1, 30)]
    return step, [*script, ("w", 35)]


@pytest.mark.parametrize("kind", list(CASES))
def test_one_old_state_kept_whole_restores_like_the_state_itself(kind: str) -> None:
    step, script = _fed_step(kind)
    op = build_operator(step)
    _run([op], step.parents, script, 8)
    state = _round_trip(op.snapshot())
    plain, merged = build_operator(step), build_operator(step)
    plain.restore(state)
    merged.restore(_round_trip(redistribute(kind, [state], lambda _k: True)))
    assert _keys(kind, state), "the script leaves state"
    assert _unnumbered(merged.snapshot()) == _unnumbered(plain.snapshot())
    rest = [("r", 0, "a", ("reg", 90) if kind == "process" else 5, 60), ("w", MAX_WATERMARK)]
    assert _canon(_run([merged], step.parents, rest, 8)) == _canon(
        _run([plain], step.parents, rest, 8)
    )


def _unnumbered(state: Any) -> Any:
    """A join's snapshot without its sequence numbers (renumbered by a merge) and heap order."""
    if not isinstance(state, dict) or "seq" not in state:
        return state
    heap = "waiting" if "waiting" in state else "changes"
    entries = sorted(((e[0], *e[2:]) for e in state[heap]), key=repr)
    return {**{f: v for f, v in state.items() if f != "seq"}, heap: entries}


def test_watermarks_merge_to_the_minimum_when_old_subtasks_differ() -> None:
    """An old subtask ahead of another must not make the other's on-time records late."""
    states: list[Any] = [{"watermark": w, "windows": {}} for w in (30, 10, 20)]
    assert redistribute("window-aggregate", states, lambda _k: True)["watermark"] == 10
    joined = [
        {"watermark": w, "table": [w, []], "waiting": [], "seq": 4} for w in (7, MIN_WATERMARK)
    ]
    merged = redistribute("temporal-join", joined, lambda _k: True)
    assert merged["watermark"] == merged["table"][0] == MIN_WATERMARK
    assert merged["seq"] == 0


def test_heaps_are_renumbered_in_time_then_old_subtask_order_when_merged() -> None:
    a = {"watermark": 0, "sides": [[0, []], [0, []]], "last": [], "seq": 9,
         "changes": [(5, 3, "a"), (7, 9, "a"), (5, 8, "b")]}  # fmt: skip
    b = {"watermark": 0, "sides": [[0, []], [0, []]], "last": [], "seq": 2,
         "changes": [(5, 1, "c"), (1, 2, "c")]}  # fmt: skip
    merged = redistribute("table-join", [a, b], lambda k: k != "b")
    assert merged["changes"] == [(1, 1, "c"), (5, 2, "a"), (5, 3, "c"), (7, 4, "a")]
    assert merged["seq"] == 4


def test_no_old_state_restores_as_a_fresh_start() -> None:
    assert redistribute("process", [None, None], lambda _k: True) is None
    assert redistribute("aggregate", [], lambda _k: True) is None


@pytest.mark.parametrize("kind", ["dedup", "keyed-dedup"])
def test_dedup_state_is_refused_when_redistributed_by_key(kind: str) -> None:
    with pytest.raises(ValueError, match="dedup"):
        redistribute(kind, [{}], lambda _k: True)


def test_an_unknown_kind_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"'count'.*aggregate, window-aggregate"):
        redistribute("count", [{}], lambda _k: True)
    assert set(KINDS) == set(CASES)
