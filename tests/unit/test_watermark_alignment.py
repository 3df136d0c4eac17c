"""Watermark alignment of a source task's partitions (issue 37, FLIP-182/217): which partitions
are paused, when, and when they are read again (``SourceInputs._align``); and the option."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from connectors.serde import JsonSerde
from processor.compiler import compile_flow
from processor.dataflow import Dataflow
from processor.errors import ConfigError
from processor.runtime.job import RunOptions, parse_alignment
from processor.runtime.task import Task
from tests.unit.test_task import ListSink, Log, Msg, Reader, _env

TP0, TP1, TP2 = ("in", 0), ("in", 1), ("in", 2)
DRIFT_MS = 10_000


class LagReader(Reader):
    """The test reader, with the lag the broker would report: records left per partition."""

    def cached_lag(self) -> dict[tuple[str, int], int]:
        return {tp: len(self.log.parts.get(tp, [])) - n for tp, n in self.next.items()}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _records(log: Log, tp: tuple[str, int], stamps: list[int]) -> None:
    part = log.parts.setdefault(tp, [])
    for ts in stamps:
        part.append(Msg(tp, len(part), orjson.dumps({"ts": ts}), None, None))


class HoldingReader(LagReader):
    """Hands out at most ``chunk`` records per partition per poll (librdkafka gives a
    partition's fetch at once), and takes records back as ``PartitionReader.hold`` does: the
    partition is paused and read again from the first of them."""

    def __init__(self, log: Log, chunk: int = 1_000_000) -> None:
        super().__init__(log)
        self.chunk = chunk
        self.held: list[tuple[tuple[str, int], int, int]] = []  # (tp, first offset, count)

    def poll(self, max_records: int = 10_000, timeout: float = 0.0) -> list[Any]:
        out: list[Any] = []
        for tp in sorted(self.next):
            if tp not in self.paused:
                part = self.log.parts.get(tp, [])
                out += part[self.next[tp] : self.next[tp] + self.chunk]
                self.next[tp] = min(len(part), self.next[tp] + self.chunk)
        return out

    def hold(self, tp: tuple[str, int], records: list[Any]) -> None:
        assert records and tp not in self.paused
        assert records[-1].offset() == self.next[tp] - 1, "the tail of what was delivered"
        self.pause([tp])
        self.next[tp] = records[0].offset()
        self.held.append((tp, records[0].offset(), len(records)))


def _task(
    tmp_path: Path,
    log: Log,
    clock: Clock,
    drift: int | None = DRIFT_MS,
    reader: LagReader | None = None,
) -> Task:
    flow = Dataflow("job")
    flow.source("s", "in", serde=JsonSerde(), timestamp=lambda v: v["ts"]).sink("out", ListSink())
    plan = compile_flow(flow, 1)
    reader = reader if reader is not None else LagReader(log)
    env = _env(tmp_path, log, plan, reader=reader, clock=clock, watermark_drift_ms=drift)
    task = Task(env, plan.stage_of("out"), 0)
    task.open(None, {"in": 3})
    return task


def _tick(task: Task, clock: Clock, seconds: float) -> None:
    """A poll that gave nothing, ``seconds`` later (a watermark tick: alignment decides)."""
    clock.now += seconds
    task.inputs.polled([])


def test_a_partition_over_the_limit_for_a_second_is_paused_until_the_slowest_catches_up(
    tmp_path: Path,
) -> None:
    log, clock = Log(), Clock()
    _records(log, TP0, [0, 1_000])  # the slowest: 1 s of event time so far
    _records(log, TP1, [0, 60_000])  # 59 s ahead of it, past the 10 s drift
    _records(log, TP2, [0, 5_000])  # within the drift
    task = _task(tmp_path, log, clock)
    reader = task.reader
    _records(log, TP0, [2_000])  # still records to read: TP0 is not idle
    _records(log, TP1, [61_000])
    _records(log, TP2, [6_000])
    reader.next = {TP0: 2, TP1: 2, TP2: 2}  # read the first two of each
    task.inputs.max_ts.update({TP0: 1_000, TP1: 60_000, TP2: 5_000})
    _tick(task, clock, 0.25)
    assert reader.paused == set(), "not at once: a full-speed reader evens out by itself"
    _tick(task, clock, 1.0)
    assert reader.paused == {TP1}
    assert task.inputs.watermark_parts(reader.cached_lag())[1][4] == "ahead"
    # The slowest catches up to within the drift of TP1 and TP2 is read to its end (idle): TP1
    # is read again at the next tick.
    _records(log, TP0, [52_000, 53_000])
    task.inputs.read([log.parts[TP0][2], log.parts[TP0][3], log.parts[TP2][2]])
    reader.next.update({TP0: 4, TP2: 3})
    _tick(task, clock, 0.25)
    assert reader.paused == set()


def test_while_a_partition_gave_nothing_yet_the_others_pause_at_once(tmp_path: Path) -> None:
    log, clock = Log(), Clock()
    _records(log, TP0, [50_000, 51_000])
    _records(log, TP1, [40_000])
    _records(log, TP2, [45_000])
    task = _task(tmp_path, log, clock)
    reader = task.reader
    task.inputs.read([log.parts[TP0][0]])  # TP0 first, as librdkafka hands out one partition
    reader.next[TP0] = 1
    _tick(task, clock, 0.25)
    assert reader.paused == {TP0}  # TP1 and TP2 have records and gave none: lead unknown


def test_caught_up_partitions_neither_hold_the_others_back_nor_are_paused(
    tmp_path: Path,
) -> None:
    log, clock = Log(), Clock()
    _records(log, TP0, [1_000])  # read to its end: idle
    _records(log, TP1, [90_000, 91_000])
    _records(log, TP2, [95_000, 96_000])
    task = _task(tmp_path, log, clock)
    reader = task.reader
    task.inputs.read([log.parts[TP0][0], log.parts[TP1][0], log.parts[TP2][0]])
    reader.next = {TP0: 1, TP1: 1, TP2: 1}  # TP1 and TP2 still have one record each
    _tick(task, clock, 2.0)
    _tick(task, clock, 2.0)
    assert reader.paused == set()
    assert task.inputs.local_watermark() == 90_000  # TP0 is idle: not the slowest
    states = {(p[0], p[1]): p[4] for p in task.inputs.watermark_parts(reader.cached_lag())}
    assert states == {TP0: "idle", TP1: "reading", TP2: "reading"}
    # Everything read (a live job caught up): nothing to align on, nothing paused.
    task.inputs.read([log.parts[TP1][1], log.parts[TP2][1]])
    reader.next = {TP0: 1, TP1: 2, TP2: 2}
    _tick(task, clock, 2.0)
    assert reader.paused == set() and task.inputs.local_watermark() is None


def test_the_other_source_tasks_hold_a_task_ahead_of_them(tmp_path: Path) -> None:
    log, clock = Log(), Clock()
    for tp in (TP0, TP1, TP2):
        _records(log, tp, [100_000, 101_000, 102_000])
    task = _task(tmp_path, log, clock)
    reader = task.reader
    task.inputs.read([log.parts[tp][0] for tp in (TP0, TP1, TP2)])
    reader.next = {TP0: 1, TP1: 1, TP2: 1}
    task.align(20_000)  # another task's slowest partition is 80 s behind
    _tick(task, clock, 0.25)
    _tick(task, clock, 1.0)
    assert reader.paused == {TP0, TP1, TP2}
    task.align(95_000)  # it caught up: within the drift
    _tick(task, clock, 0.25)
    assert reader.paused == set()


def test_without_alignment_nothing_is_paused(tmp_path: Path) -> None:
    log, clock = Log(), Clock()
    _records(log, TP0, [0, 1_000])
    _records(log, TP1, [500_000, 600_000])
    task = _task(tmp_path, log, clock, drift=None)
    task.inputs.read([log.parts[TP1][0]])
    for _ in range(10):
        _tick(task, clock, 1.0)
    assert task.reader.paused == set()


def test_the_option_auto_aligns_paced_runs_only() -> None:
    assert RunOptions(max_rate=400).watermark_drift_ms() == 30_000  # auto, the default
    assert RunOptions().watermark_drift_ms() is None  # full speed: off
    assert RunOptions(watermark_alignment=5.0).watermark_drift_ms() == 5_000
    assert RunOptions(max_rate=400, watermark_alignment=None).watermark_drift_ms() is None
    assert parse_alignment("2m") == 120.0
    assert parse_alignment("auto") == "auto"
    assert parse_alignment("off") is None
    with pytest.raises(ConfigError, match="auto or off"):
        RunOptions(watermark_alignment="sometimes").validate()


def test_a_batch_holding_an_hour_of_one_partition_is_cut_at_the_drift(tmp_path: Path) -> None:
    """Issue 50: librdkafka hands a task a partition's whole fetch (thousands of records, hours
    of a backfill's event time); alignment between ticks let one partition run 22 minutes
    ahead of the slowest in the same worker. The rest of the partition goes back to the
    reader, unprocessed, and comes again once the slowest caught up."""
    log, clock = Log(), Clock()
    _records(log, TP0, list(range(0, 60_000, 1_000)))
    _records(log, TP1, list(range(0, 3_600_000, 1_000)))  # an hour, all in one fetch
    _records(log, TP2, list(range(0, 60_000, 1_000)))
    reader = HoldingReader(log, chunk=11)
    task = _task(tmp_path, log, clock, reader=reader)
    batch = log.parts[TP0][:11] + log.parts[TP1] + log.parts[TP2][:11]
    reader.next = {TP0: 11, TP1: 3_600, TP2: 11}
    task.inputs.read(batch)
    # The slowest is at 10 s after the batch: TP1 stops at 20 s, its 21 s record is next.
    assert reader.held == [(TP1, 21, 3_600 - 21)]
    assert reader.paused == {TP1} and reader.next[TP1] == 21
    assert task.inputs.max_ts[TP1] == 20_000
    assert task.inputs.records_in == 11 + 21 + 11
    states = {(p[0], p[1]): p[4] for p in task.inputs.watermark_parts(reader.cached_lag())}
    assert states == {TP0: "reading", TP1: "ahead", TP2: "reading"}
    assert task.inputs.local_watermark() == 10_000
    # The others catch up to 20 s: TP1's next record (21 s) is within the drift again, and it
    # goes on after the next poll, not at the next watermark tick.
    reader.next.update({TP0: 21, TP2: 21})
    task.inputs.read(log.parts[TP0][11:21] + log.parts[TP2][11:21])
    clock.now += 0.03
    task.inputs.polled([])
    assert reader.paused == set() and task.inputs.held_next == {}


@pytest.mark.parametrize("chunk", [7, 500])
def test_partitions_read_by_one_task_stay_within_the_drift_and_every_record_is_read_once(
    tmp_path: Path, chunk: int
) -> None:
    """Three partitions with different densities over two hours of event time, fetched
    ``chunk`` records at a time: while they all have records to read, no partition's
    watermark is more than the drift (plus the sparsest partition's gap between records:
    what it reads next is unknown until it is read) ahead of the slowest; the slowest is
    never held (no deadlock, whatever the gaps); every record is read once."""
    log, clock = Log(), Clock()
    hours = 2 * 3_600_000
    gaps = {TP0: 1_000, TP1: 100, TP2: 10_000}
    for tp, gap in gaps.items():
        _records(log, tp, list(range(0, hours, gap)))
    _records(log, TP0, [hours + 5_000_000])  # a jump: TP0 is busy and far ahead at its end
    total = sum(len(p) for p in log.parts.values())
    reader = HoldingReader(log, chunk=chunk)
    task = _task(tmp_path, log, clock, reader=reader)
    worst = 0
    for _ in range(200_000):
        clock.now += 0.01
        task.step(0.0, 10_000)
        lag = reader.cached_lag()
        busy = [tp for tp in gaps if lag[tp] > 0]
        if len(busy) > 1:
            marks = [task.inputs.max_ts[tp] for tp in busy]
            if min(marks) > 0:
                worst = max(worst, max(marks) - min(marks))
        if not any(lag.values()):
            break
    else:
        pytest.fail(f"not read to the end: lag {reader.cached_lag()}")
    assert task.inputs.records_in == total
    assert worst <= DRIFT_MS + max(gaps.values()), worst
    assert reader.held, "the batches were cut"
