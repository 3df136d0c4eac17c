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
