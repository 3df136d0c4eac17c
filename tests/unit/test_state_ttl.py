"""State TTL for unwindowed keyed aggregations (issue 23, item 5): expiry by the records' own
event time, deletion by the watermark, snapshots with and without TTL."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from processor.dataflow import Dataflow, Tumbling
from processor.errors import DefinitionError
from processor.runtime.operators.core import Aggregate
from processor.snapshot import codec

TTL = 10


def _op(ttl_ms: int | None = TTL) -> Aggregate:
    flow = Dataflow("job")
    ttl = None if ttl_ms is None else timedelta(milliseconds=ttl_ms)
    flow.source("s", "t").key_by("k", lambda v: v).count("count", ttl=ttl)
    return Aggregate(flow.steps["count"])


def test_a_record_ttl_after_the_keys_last_one_starts_over() -> None:
    op = _op()
    out = op.process([("a", 1, 0), ("a", 1, 9), ("b", 1, 5), ("a", 1, 19), ("a", 1, 29)])
    # 9 -> 19 is 10 ms: expired; 19 -> 29 too
    assert [v for _k, v, _t in out] == [1, 2, 1, 1, 1]
    assert op.expired == 2


def test_an_out_of_order_record_does_not_move_the_last_time_back() -> None:
    op = _op()
    op.process([("a", 1, 20), ("a", 1, 12)])  # 12 is older: last stays 20
    assert op.touched["a"] == 20
    assert op.process([("a", 1, 29)]) == [("a", 3, 29)]


def test_the_watermark_deletes_state_older_than_the_ttl() -> None:
    op = _op()
    op.process([("a", 1, 0), ("b", 1, 8)])
    op.on_watermark(10)  # a: 0 + 10 <= 10
    assert set(op.state) == {"b"} and set(op.touched) == {"b"}
    assert op.process([("a", 1, 30)]) == [("a", 1, 30)]


def test_snapshots_with_and_without_ttl_restore_into_either() -> None:
    op = _op()
    op.process([((1, "k"), 1, 0), ("b", 1, 3)])
    restored = _op()
    restored.restore(codec.loads(codec.dumps(op.snapshot())))
    assert restored.state == op.state and restored.touched == op.touched
    plain = _op(None)
    plain.restore(codec.loads(codec.dumps(op.snapshot())))  # ttl removed from the job
    assert plain.state == op.state
    turned_on = _op()
    turned_on.restore(codec.loads(codec.dumps(plain.snapshot())))  # ttl added to the job
    # no last time known: the state is kept until the key's next record
    assert turned_on.process([("b", 1, 1000)]) == [("b", 2, 1000)]
    assert turned_on.process([("b", 1, 2000)]) == [("b", 1, 2000)]


def test_ttl_needs_an_unwindowed_aggregation_and_a_positive_duration() -> None:
    keyed = Dataflow("job").source("s", "t").key_by("k", lambda v: v)
    with pytest.raises(DefinitionError, match="ttl must be positive"):
        keyed.count("c", window=Tumbling(timedelta(seconds=1)), ttl=timedelta(seconds=1))
    with pytest.raises(DefinitionError, match="ttl must be positive"):
        keyed.count("d", ttl=timedelta(0))


def _reference(records: list[tuple[str, int]]) -> list[int]:
    """Counts per record, in order: restart when a key's record is TTL after its last."""
    last: dict[str, int] = {}
    count: dict[str, int] = {}
    out = []
    for k, t in records:
        if k in last and t - last[k] >= TTL:
            count[k] = 0
        count[k] = count.get(k, 0) + 1
        last[k] = max(last.get(k, t), t) if count[k] > 1 else t
        out.append(count[k])
    return out


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from("ab"), st.integers(0, 100)), min_size=1, max_size=50),
    st.integers(1, 5),
    st.integers(0, 6),
)
def test_expiry_does_not_depend_on_batches_snapshots_or_watermark_sweeps(
    records: list[tuple[str, int]], batch: int, cut: int
) -> None:
    """Per key in time order (as a partition delivers a key's records), with the watermark
    behind the records, the counts are the reference's whatever the batching, a snapshot and
    restore at any point, and the sweeps in between."""
    records = sorted(records, key=lambda r: r[1])
    op = _op()
    got: list[Any] = []
    for i in range(0, len(records), batch):
        if i // batch == cut:
            fresh = _op()
            fresh.restore(codec.loads(codec.dumps(op.snapshot())))
            op = fresh
        got += [v for _k, v, _t in op.process([(k, 1, t) for k, t in records[i : i + batch]])]
        op.on_watermark(records[i][1] - 1)  # behind every record still to come
    assert got == _reference(records)
