"""Dead-letter routing in the task runtime, on an in-memory transport: what goes there, with
which origin, in which epoch, and what happens without a dead-letter destination."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson
import pytest

from connectors.serde import JsonSerde
from processor.compiler import compile_flow
from processor.contracts import SinkContext
from processor.dataflow import Dataflow
from processor.errors import ConfigError, UserFunctionError
from processor.runtime.supervision.local import LocalRunner, RunOptions
from processor.runtime.task import Task, TaskEnv
from processor.runtime.task.dead_letters import DeadLetters, jsonable
from processor.snapshot.store import SnapshotStore
from processor.wire import GenerationStart, Watermark, bundle_records
from tests.unit.test_task import Log, Msg, Reader, Writer

IN = ("in", 0)  # subtask 0 of 2 reads partition 0 of the source topic
CHANNEL = "eosflow.job.k.sum"
P0, P2 = (CHANNEL, 0), (CHANNEL, 2)  # subtask 0's channels from upstream 0 and 1


class SrcMsg(Msg):
    """A source record with a Kafka key and timestamp."""

    def __init__(self, tp: tuple[str, int], offset: int, value: bytes, key: bytes | None) -> None:
        super().__init__(tp, offset, value, None)
        self._key = key

    def key(self) -> Any:
        return self._key

    def timestamp(self) -> tuple[int, int]:
        return (1, 1_000 + self._offset)


def produce(log: Log, tp: tuple[str, int], value: bytes, key: bytes | None = None) -> int:
    part = log.parts.setdefault(tp, [])
    part.append(SrcMsg(tp, len(part), value, key))
    return len(part) - 1


class Recorder:
    """A two-phase-commit sink that remembers every call, per writer."""

    writers: list[Recorder] = []

    def __init__(self) -> None:
        self.ctx: SinkContext | None = None
        self.epoch: list[Any] = []
        self.prepared: dict[int, list[Any]] = {}
        self.committed: list[Any] = []
        self.recovered: list[Any] = []

    def open(self, ctx: SinkContext) -> Recorder:
        writer = Recorder()
        writer.ctx = ctx
        Recorder.writers.append(writer)
        return writer

    def write(self, values: Sequence[Any]) -> None:
        orjson.dumps(list(values))  # entries must be JSON as they are
        self.epoch += values

    def prepare(self, checkpoint_id: int) -> Any:
        epoch, self.epoch = self.epoch, []
        return epoch or None

    def commit(self, checkpoint_id: int, committable: Any) -> None:
        self.committed += committable

    def recover(self, pending: Sequence[tuple[int, Any]]) -> None:
        self.recovered.append(list(pending))
        for chk, committable in pending:
            self.commit(chk, committable)

    def close(self) -> None:
        pass


def _env(tmp_path: Path, flow: Dataflow, log: Log) -> TaskEnv:
    Recorder.writers = []
    return TaskEnv(
        plan=compile_flow(flow, 2),
        generation=1,
        mode="aligned",
        writer=Writer(log),
        reader_factory=lambda _group: Reader(log),
        store=SnapshotStore(tmp_path.as_uri()),
        uploads=ThreadPoolExecutor(1),
        fault=lambda _point: None,
        end_offsets=None,
    )


def _dead(task: Task) -> Recorder:
    assert task.chain.dead is not None
    writer = task.chain.dead.writer
    assert isinstance(writer, Recorder)
    return writer


def _check(v: Any) -> Any:
    if v.get("poison"):
        raise ValueError(f"poison {v['id']}")
    return v


def _source_flow(dead_letters: bool = True) -> Dataflow:
    flow = Dataflow("job", dead_letters=Recorder() if dead_letters else None)
    src = flow.source("s", "in", serde=JsonSerde(), timestamp=lambda v: v["ts"])
    keyed = src.map("check", _check).key_by("k", lambda v: v["user"])
    keyed.aggregate("sum", init=lambda: 0, add=lambda a, v: a + v["n"]).sink("out", Recorder())
    src.filter("odd", lambda v: v["id"] % 2 == 1).map("inverse", lambda v: 1 / v["n"]).sink(
        "out2", Recorder()
    )
    return flow


def _click(i: int, **extra: Any) -> bytes:
    return orjson.dumps({"id": i, "user": f"u{i % 2}", "n": i, "ts": 100 + i, **extra})


def test_source_failures_go_to_dead_letters_with_their_exact_origin(tmp_path: Path) -> None:
    log = Log()
    produce(log, IN, _click(1), b"u1")
    bad_json = produce(log, IN, b"\xff{not json", b"k\xff")
    no_ts = produce(log, IN, orjson.dumps({"id": 3, "user": "u1", "n": 3}))
    produce(log, IN, _click(5))
    poison = produce(log, IN, _click(6, poison=True))
    no_user = produce(log, IN, orjson.dumps({"id": 8, "n": 8, "ts": 1}))
    zero = produce(log, IN, _click(0, id=9))  # odd, n == 0: "inverse" divides by zero
    produce(log, IN, _click(10))
    task = Task(_env(tmp_path, _source_flow(), log), compile_flow(_source_flow(), 2).stages[0], 0)
    task.open(None, {"in": 2})
    task.step(0.0, 100)
    entries = {e["offset"]: e for e in _dead(task).epoch}
    assert set(entries) == {bad_json, no_ts, poison, no_user, None}

    undecodable = entries[bad_json]
    assert undecodable["step"] == "s" and undecodable["error_type"] == "DeserializationError"
    assert (undecodable["topic"], undecodable["partition"]) == IN
    assert undecodable["value"] is None and "value_utf8" not in undecodable
    assert undecodable["value_b64"] == "/3tub3QganNvbg=="
    assert undecodable["key_b64"] == "a/8=" and undecodable["ts_ms"] == 1_000 + bad_json
    assert "invalid JSON" in undecodable["cause"] and undecodable["task"] == "s.0"

    assert entries[no_ts]["error_type"] == "KeyError" and entries[no_ts]["step"] == "s"
    assert entries[no_ts]["value"] == {"id": 3, "user": "u1", "n": 3}  # decoded: its value

    assert entries[poison]["step"] == "check" and entries[poison]["cause"] == "poison 6"
    assert entries[poison]["value"]["id"] == 6 and entries[poison]["ts_ms"] == 106
    # key_by fails after a map: the map keeps indexes, so the origin is still exact
    assert entries[no_user]["step"] == "k" and entries[no_user]["error_type"] == "KeyError"

    # after a filter, the index of a record no longer says where it came from
    after_filter = entries[None]
    assert after_filter["step"] == "inverse" and after_filter["value"]["id"] == 9
    assert after_filter["topic"] is None and after_filter["partition"] is None
    assert zero not in entries

    shuffled = [  # channel records, one by one or in bundles (processor.wire)
        r[1]["id"]
        for _t, _p, v, h in log.written
        if h is None
        for r in bundle_records(v) or [orjson.loads(v)]
    ]
    assert sorted(shuffled) == [1, 5, 9, 10]  # the good records are unaffected
    assert task.stats()["dead"] == 5 and task.stats()["bad"] == 0


def test_dead_letters_are_prepared_at_the_barrier_and_committed_on_completion(
    tmp_path: Path,
) -> None:
    log = Log()
    produce(log, IN, b"garbage")
    flow = _source_flow()
    task = Task(_env(tmp_path, flow, log), compile_flow(flow, 2).stages[0], 0)
    task.open(None, {"in": 2})
    dead = _dead(task)
    assert dead.recovered == [[]]
    task.step(0.0, 100)
    task.trigger(1)
    produce(log, IN, b"more garbage")  # the next epoch
    task.step(0.0, 100)
    assert dead.committed == [] and len(dead.epoch) == 1
    deadline = time.monotonic() + 5
    while not (acks := task.ready_acks()) and time.monotonic() < deadline:
        time.sleep(0.01)
    ((_chk, handle),) = acks
    snap = task.env.store.read_task_snapshot(handle.path)
    assert [e["value_utf8"] for e in snap["sinks"]["dead-letters"][0][1]] == ["garbage"]
    task.complete(1)
    assert [e["value_utf8"] for e in dead.committed] == ["garbage"]

    # a restart restores the snapshot: its pending dead letters are recovered (committed)
    restarted = Task(_env(tmp_path, flow, Log()), compile_flow(flow, 2).stages[0], 0)
    restarted.open(snap, {"in": 2})
    assert [[(c, [e["offset"] for e in x]) for c, x in p] for p in _dead(restarted).recovered] == [
        [(1, [0])]
    ]


def test_every_task_opens_its_own_dead_letter_writer_with_a_unique_index(tmp_path: Path) -> None:
    flow = _source_flow()
    env = _env(tmp_path, flow, Log())
    plan = env.plan
    tasks = [Task(env, stage, i) for stage in plan.stages for i in range(2)]
    contexts = [t.chain.dead.writer.ctx for t in tasks]  # type: ignore[union-attr]
    assert {c.step for c in contexts} == {"dead-letters"}
    assert sorted(c.subtask for c in contexts) == [0, 1, 2, 3]
    assert {c.parallelism for c in contexts} == {4}


def _channel_flow() -> Dataflow:
    flow = Dataflow("job", dead_letters=Recorder())

    def add(acc: int, v: Any) -> int:
        if v["k"].startswith("bad"):
            raise ValueError(f"cannot add {v['k']}")
        return acc + 1

    flow.source("s", "in").key_by("k", lambda v: v).aggregate("sum", init=int, add=add).sink(
        "out", Recorder()
    )
    return flow


def test_channel_failures_carry_the_channel_record_origin_across_control_records(
    tmp_path: Path,
) -> None:
    log = Log()
    for tp in (P0, P2):
        log.ctl(tp, GenerationStart(1))
    log.data(P0, "a")
    log.data(P0, "bad-1")  # P0 offset 2
    log.ctl(P0, Watermark(5))
    log.data(P0, "bad-2")  # P0 offset 4, after a control record
    log.data(P2, "bad-3")  # P2 offset 1
    log.data(P2, "b")
    flow = _channel_flow()
    task = Task(_env(tmp_path, flow, log), compile_flow(flow, 2).stage_of("sum"), 0)
    task.open(None, {"in": 2})
    task.step(0.0, 100)
    got = {e["key"]: (e["topic"], e["partition"], e["offset"]) for e in _dead(task).epoch}
    assert got == {"bad-1": (*P0, 2), "bad-2": (*P0, 4), "bad-3": (*P2, 1)}
    assert dict(task.chain.ops["sum"].snapshot()) == {"a": 1, "b": 1}
    entry = _dead(task).epoch[0]
    assert entry["step"] == "sum" and entry["value"] == {"k": "bad-1"}
    assert entry["cause"] == "cannot add bad-1" and entry["task"] == "sum.0"


def test_without_a_destination_bad_input_is_skipped_and_a_failing_function_fails(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = Log()
    produce(log, IN, b"not json")
    produce(log, IN, _click(1))
    flow = _source_flow(dead_letters=False)
    task = Task(_env(tmp_path, flow, log), compile_flow(flow, 2).stages[0], 0)
    assert task.chain.dead is None and [n for n, _w in task.chain.committers] == ["out2"]
    task.open(None, {"in": 2})
    with caplog.at_level(logging.ERROR):
        task.step(0.0, 100)
    assert task.stats()["bad"] == 1 and task.stats()["dead"] == 0
    assert "bad record skipped" in caplog.text and "offset=0" in caplog.text
    produce(log, IN, _click(2, poison=True))
    # Fails the task, naming the step, the record's origin and the exception.
    with pytest.raises(
        UserFunctionError,
        match=r"step 'check' \(task s.0\) raised ValueError: poison 2 on the record from "
        r"in\[0\] at offset 2\. Fix the function, or give the Dataflow a dead-letter",
    ) as failed:
        task.step(0.0, 100)
    assert failed.value.step == "check" and failed.value.origin == ("in", 0, 2)
    assert isinstance(failed.value.__cause__, ValueError)


def test_dead_letters_are_counted_and_logged_first_20_then_every_10000th(
    caplog: pytest.LogCaptureFixture,
) -> None:
    writer = Recorder()
    dead = DeadLetters(writer, "s.0")
    with caplog.at_level(logging.WARNING, logger="processor.runtime.task.dead_letters"):
        for i in range(20_000):
            dead.function_failed("m", (None, i, 0), ValueError("no"), None)
    assert dead.count == 20_000
    assert len(caplog.records) == 22
    assert "count=10000" in caplog.records[20].getMessage()
    dead.flush()
    assert len(writer.epoch) == 20_000


def test_entries_are_json_whatever_the_failing_value_is() -> None:
    class Opaque:
        def __repr__(self) -> str:
            return "<opaque>"

    value = {"set": {1}, "obj": Opaque(), "tuple": (1, 2), 3: "int key", "big": 2**70}
    assert jsonable(value) == repr(value)  # an int orjson cannot encode: the repr
    del value["big"]
    assert jsonable(value) == {"set": "{1}", "obj": "<opaque>", "tuple": [1, 2], "3": "int key"}
    writer = Recorder()
    dead = DeadLetters(writer, "s.0")
    dead.function_failed("m", (("a", 1), value, 5), KeyError("x"), None)
    dead.function_failed("m", (None, None, 5), ValueError(), None)
    dead.flush()
    assert writer.epoch[0]["key"] == ["a", 1] and writer.epoch[0]["cause"] == "'x'"
    assert writer.epoch[1]["cause"] == "ValueError()"


def test_runner_preflights_the_dead_letter_destination_before_anything_starts(
    tmp_path: Path,
) -> None:
    pipeline = tmp_path / "pipeline.py"
    pipeline.write_text(
        "from processor.dataflow import Dataflow\n"
        "from processor.errors import ConfigError\n"
        "class Refusing:\n"
        "    def open(self, ctx): raise AssertionError('never opened')\n"
        "    def preflight(self, *, job, checkpoint_interval):\n"
        "        raise ConfigError(f'dead letters of {job} refused at {checkpoint_interval}s')\n"
        "class Fine(Refusing):\n"
        "    def preflight(self, *, job, checkpoint_interval): pass\n"
        "flow = Dataflow('preflight-job', dead_letters=Refusing())\n"
        "flow.source('s', 'in').sink('out', Fine())\n"
    )
    options = RunOptions(checkpoint_interval=2.0, state_dir=str(tmp_path / "state"))
    runner = LocalRunner(pipeline, options)
    with pytest.raises(ConfigError, match=r"dead letters of preflight-job refused at 2\.0s"):
        runner.run()


def test_runner_warns_at_start_when_there_is_no_dead_letter_destination(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pipeline = tmp_path / "pipeline.py"
    pipeline.write_text(
        "from processor.dataflow import Dataflow\n"
        "from processor.errors import ConfigError\n"
        "class Refusing:\n"
        "    def open(self, ctx): raise AssertionError('never opened')\n"
        "    def preflight(self, *, job, checkpoint_interval): raise ConfigError('stop here')\n"
        "flow = Dataflow('no-dead-letters')\n"
        "flow.source('s', 'in').sink('out', Refusing())\n"
    )
    runner = LocalRunner(pipeline, RunOptions(state_dir=str(tmp_path / "state")))
    with caplog.at_level(logging.WARNING), pytest.raises(ConfigError, match="stop here"):
        runner.run()
    assert "job=no-dead-letters has no dead-letter destination" in caplog.text
