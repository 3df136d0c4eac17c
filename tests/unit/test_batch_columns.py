"""A source task's batch as columns (the fast path of ``SourceInputs``) against the same batch
record by record: the same records reach the operators, the same event-time progress per
partition, and a batch holding a bad record is taken record by record (dead letter or count,
the others pass)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest

from connectors.serde import JsonSerde
from processor.compiler import compile_flow
from processor.dataflow import Dataflow
from processor.runtime.task import Task
from tests.unit.test_task import ListSink, Log, Msg, Reader, _env


class Stamped(Msg):
    def timestamp(self) -> tuple[int, int]:
        return (1, 1_000 + self.offset())


def _source_task(tmp_path: Path, *, keyed: bool, timestamp: bool) -> tuple[Task, ListSink]:
    flow = Dataflow("job")
    sink = ListSink()
    source = flow.source(
        "s", "in", serde=JsonSerde(), keyed=keyed,
        timestamp=(lambda v: v["ts"]) if timestamp else None,
        max_out_of_orderness=timedelta(milliseconds=5),
    )  # fmt: skip
    source.filter("f", lambda v: v["n"] % 3 != 0).sink("out", sink)
    plan = compile_flow(flow, 1)
    log = Log()
    task = Task(_env(tmp_path, log, plan, reader=Reader(log)), plan.stage_of("f"), 0)
    task.open(None, {"in": 3})
    return task, sink


def _batch(n: int, *, bad: int | None = None, keyless: int | None = None) -> list[Any]:
    """``n`` records over 3 partitions in runs (as a consume() batch holds them), with event
    times out of order within a partition."""
    out = []
    for i in range(n):
        value = orjson.dumps({"n": i, "ts": 10_000 + (i * 7919) % 1_000})
        if i == bad:
            value = b"{not json"
        key = None if i == keyless else f"u{i % 4}".encode()
        out.append(Stamped(("in", (i // 5) % 3), i, value, None, key))
    return out


@pytest.mark.parametrize("keyed", [True, False])
@pytest.mark.parametrize("timestamp", [True, False])
def test_a_batch_as_columns_gives_what_the_records_one_by_one_give(
    tmp_path: Path, keyed: bool, timestamp: bool
) -> None:
    fast, fast_sink = _source_task(tmp_path / "fast", keyed=keyed, timestamp=timestamp)
    slow, slow_sink = _source_task(tmp_path / "slow", keyed=keyed, timestamp=timestamp)
    assert fast.inputs._fast is not None  # the fast path applies to this source
    slow.inputs._fast = None  # the record-by-record path
    fast.inputs._source_batch(_batch(40))
    slow.inputs._source_batch(_batch(40))
    assert fast_sink.epoch == slow_sink.epoch
    assert len(fast_sink.epoch) == 26  # 40 less the 14 multiples of 3
    assert fast.inputs.max_ts == slow.inputs.max_ts
    assert fast.inputs.records_in == slow.inputs.records_in == 40


def test_a_batch_with_a_bad_record_is_taken_record_by_record(tmp_path: Path) -> None:
    task, sink = _source_task(tmp_path, keyed=True, timestamp=True)
    task.inputs._source_batch(_batch(20, bad=4, keyless=7))
    assert task.inputs.bad_records == 2  # the malformed value, the keyed record without a key
    assert [v["n"] for _k, v in sink.epoch] == [n for n in range(20) if n % 3 and n not in (4, 7)]


def _channel_task(tmp_path: Path, log: Log, *, columns: bool) -> Task:
    from tests.unit.test_task import _task

    task = _task(tmp_path, log, "aligned")
    if not columns:
        task.inputs._live_batch = lambda _msgs: False  # type: ignore[method-assign]
    task.open(None, {"in": 2})
    return task


def test_a_live_channel_batch_as_columns_gives_what_the_records_one_by_one_give(
    tmp_path: Path,
) -> None:
    """Channel records of live channels, interleaved over two partitions, after the
    generation start (control records: the record-by-record path), then as columns."""
    from processor.wire import GenerationStart
    from tests.unit.test_task import P0, P2, _counts

    log = Log()
    for tp in (P0, P2):
        log.ctl(tp, GenerationStart(1))
    tasks = [_channel_task(tmp_path / n, log, columns=n == "fast") for n in ("fast", "slow")]
    for task in tasks:
        task.step(0.0, 100)  # the generation starts: the channels are live
    taken: list[bool] = []
    live_batch = tasks[0].inputs._live_batch
    tasks[0].inputs._live_batch = lambda msgs: taken.append(live_batch(msgs)) or taken[-1]  # type: ignore[method-assign]
    for i in range(30):
        log.data(P0 if i % 3 else P2, f"k{i % 4}", ts=i)
    for task in tasks:
        task.step(0.0, 100)
    assert taken == [True]  # the batch went as columns
    assert _counts(tasks[0]) == _counts(tasks[1]) == {"k0": 8, "k1": 8, "k2": 7, "k3": 7}
    assert tasks[0].inputs.pos == tasks[1].inputs.pos == {P0: 21, P2: 11}
    assert tasks[0].inputs.records_in == tasks[1].inputs.records_in == 30


def test_a_channel_batch_with_a_control_record_or_a_zombie_key_goes_record_by_record(
    tmp_path: Path,
) -> None:
    from processor.wire import Barrier, GenerationStart
    from tests.unit.test_task import P0, P2

    log = Log()
    for tp in (P0, P2):
        log.ctl(tp, GenerationStart(1))
    task = _channel_task(tmp_path, log, columns=True)
    task.step(0.0, 100)
    log.data(P0, "a")
    log.data(P2, "b", incarnation=7)  # another incarnation's key: not live
    assert task.inputs._live_batch(log.parts[P0][1:] + log.parts[P2][1:]) is False
    assert task.inputs._live_batch(log.parts[P2][1:]) is False  # the zombie's alone
    log.ctl(P0, Barrier(1, 1))
    assert task.inputs._live_batch(log.parts[P0][1:]) is False
    assert task.inputs.records_in == 0 and task.inputs.pos == {P0: 1, P2: 1}


def test_bundles_keep_the_order_and_split_by_count_and_size() -> None:
    from processor import wire

    records = [(f"k{i}", {"n": i}, i) for i in range(1_203)]
    values = wire.encode_bundles(records)
    assert [len(wire.bundle_records(v) or [None]) for v in values] == [500, 500, 203]
    decoded = [tuple(r) for v in values for r in wire.bundle_records(v) or []]
    assert decoded == [(k, v, t) for k, v, t in records]
    big = [("k", "x" * 100_000, i) for i in range(5)]  # 500 KB: over BUNDLE_BYTES
    values = wire.encode_bundles(big)
    assert all(len(v) <= wire.BUNDLE_BYTES for v in values)
    assert [r[2] for v in values for r in wire.bundle_records(v) or [orjson.loads(v)]] == [
        0, 1, 2, 3, 4,
    ]  # fmt: skip
    assert wire.bundle_records(wire.encode_bundles([("k", 1, 2)])[0]) is None  # one: plain


def _bundle(log: Log, tp: Any, records: list[Any]) -> None:
    from processor import wire

    for value in wire.encode_bundles(records):
        log._append(tp, value, None)


def test_bundled_channel_records_count_once_on_every_read_path(tmp_path: Path) -> None:
    """Bundles and single records, with a barrier in the batch (the record-by-record path) and
    without (columns): every record counted once, positions per message."""
    from processor.wire import Barrier, GenerationStart
    from tests.unit.test_task import P0, P2, _counts

    log = Log()
    for tp in (P0, P2):
        log.ctl(tp, GenerationStart(1))
    _bundle(log, P0, [(f"k{i % 3}", {}, i) for i in range(10)])
    log.data(P2, "k0")
    log.ctl(P2, Barrier(1, 1))  # in the first batch: record by record
    _bundle(log, P2, [(f"k{i % 3}", {}, i) for i in range(7)])
    tasks = [_channel_task(tmp_path / n, log, columns=n == "fast") for n in ("fast", "slow")]
    for task in tasks:
        task.step(0.0, 100)
    log.ctl(P0, Barrier(1, 1))
    for task in tasks:
        task.step(0.0, 100)
    _bundle(log, P0, [(f"k{i % 3}", {}, i) for i in range(5)])  # a batch of bundles only
    for task in tasks:
        task.step(0.0, 100)
        assert _counts(task) == {"k0": 4 + 1 + 3 + 2, "k1": 3 + 2 + 2, "k2": 3 + 2 + 1}
        assert task.inputs.records_in == 10 + 1 + 7 + 5
        assert task.inputs.pos == {P0: 4, P2: 4}  # messages, not records


def test_bundled_records_get_distinct_ids_from_their_place_under_local_recovery(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bundle written before a switch to local recovery has no record IDs: each record's ID
    comes from the bundle's offset and its index, so a copy of the bundle is dropped whole and
    its records are not taken for copies of each other."""
    from processor.wire import GenerationStart
    from tests.unit.test_task import P0, P2, _counts, _local_task

    log = Log()
    for tp in (P0, P2):
        log.ctl(tp, GenerationStart(1))
    _bundle(log, P0, [("a", {}, 0), ("a", {}, 1), ("b", {}, 2)])
    task = _local_task(tmp_path, log, monkeypatch)
    task.open(None, {"in": 2})
    task.step(0.0, 100)
    assert _counts(task) == {"a": 2, "b": 1}
    task.close()
