"""Settling the sinks of a job's old shape before it restarts at another parallelism (issue 24,
step 6; :mod:`processor.runtime.shape.settle`), against real servers.

Every test plays the same story per sink. The old shape (``P_old`` writers, generation 1) runs
checkpoints 1 and 2; checkpoint 3 is prepared by some writers but never completes; then every
writer is abandoned as a SIGKILL would leave it (no commit, no close). The old subtasks play
three roles:

* ``committed``: committed 1 and 2 (2 is still in its snapshot: the engine had not recorded
  the commit), then prepared 3 (an orphan) and wrote an epoch it never prepared;
* ``pending``: committed 1, prepared 2 and crashed before committing it (the snapshot holds
  it: settle must commit it), then wrote an epoch it never prepared;
* ``idle``: committed 1, wrote nothing in 2 (no pending entry), prepared 3 (an orphan only
  ``recover([])`` with the old context cleans up).

Then :func:`settle_old_shape` runs with the old shape, and the new shape (``P_new`` writers,
generation 3, shape epoch 1, restored with no pending) writes checkpoint 3 and commits it. The
committed output, read independently of the sink, must be exactly checkpoints 1 and 2 of the
old shape plus the new shape's records; per key, old before new where the sink keeps an order.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
import redis

from connectors import KafkaSettings
from connectors.admin import TopicAdmin
from processor.contracts import Sink, SinkContext
from processor.dataflow import Dataflow
from processor.errors import EosflowError
from processor.runtime.shape.settle import settle_old_shape
from processor.snapshot.store import SnapshotStore
from sinks.files import FileSink, read_jsonl
from sinks.kafka import KafkaSink, marker_topic, read_transaction_markers
from sinks.postgres import PostgresSink
from sinks.redis import RedisSink
from tests.integration.test_sinks_kafka import read_topic

Record = tuple[str, int, int]  # (key, n, writer): n = checkpoint * 10 + i, or 100 + i (new)


class Crash(Exception):
    """Stands for a SIGKILL at a fault point."""


@dataclass
class Case:
    """One sink under test: how to build it, read its committed output and find leftovers."""

    sink: Sink
    read: Callable[[], list[Record]]
    leftovers: Callable[[], list[Any]] = lambda: []
    ordered: bool = True  # per key, the reader sees the sink's commit order
    aborted_visible: bool = False  # Tansu: records of aborted transactions stay visible
    teardown: list[Callable[[], None]] = field(default_factory=list)


def value(key: str, n: int, writer: int) -> Any:
    return (key, [n, writer])  # a keyed pair, as a keyed stream hands it to a sink


def row(kv: Any) -> tuple[Any, ...]:
    return (kv[0], kv[1][0], kv[1][1])


# -- the story -----------------------------------------------------------------------------------


@dataclass
class Story:
    job: str
    url: str
    old: int
    new: int
    roles: list[str]
    abandoned: list[Any] = field(default_factory=list)  # writers kept alive, never closed

    @property
    def store(self) -> SnapshotStore:
        return SnapshotStore(self.url)

    def ctx(self, subtask: int, parallelism: int, generation: int, epoch: int) -> SinkContext:
        return SinkContext(
            self.job, "out", subtask, parallelism, generation, snapshot_url=self.url, epoch=epoch
        )

    def run_old_shape(self, sink: Sink) -> dict[str, dict[str, Any]]:
        """Checkpoints 1-2 (and an orphan 3) of the old shape; returns its snapshot states."""
        writers = [sink.open(self.ctx(s, self.old, 1, 0)) for s in range(self.old)]
        for w in writers:
            w.recover([])
        c1 = [self._epoch(w, s, 1) for s, w in enumerate(writers)]
        self.store.complete(self.job, 1, {}, {})
        for s, w in enumerate(writers):
            w.commit(1, c1[s])
        pending: dict[int, list[Any]] = {}
        c2 = {s: self._epoch(w, s, 2) for s, w in enumerate(writers) if self.roles[s] != "idle"}
        self.store.complete(self.job, 2, {}, {})
        for s, w in enumerate(writers):
            role = self.roles[s]
            if role == "committed":
                w.commit(2, c2[s])
            if role != "idle":
                pending[s] = [[2, c2[s]]]
            if role in ("committed", "idle"):
                self._epoch(w, s, 3)  # prepared; checkpoint 3 never completes
            if role in ("committed", "pending"):
                w.write([value(f"k{s}", 40, s)])  # an epoch never prepared
        self.abandoned.extend(writers)
        return {
            f"src.{s}": {"checkpoint": 2, "sinks": {"out": pending[s]} if s in pending else {}}
            for s in range(self.old)
        }

    def _epoch(self, writer: Any, s: int, checkpoint: int) -> Any:
        writer.write([value(f"k{s}", checkpoint * 10, s)])
        writer.write([value(f"k{s}", checkpoint * 10 + 1, s)])
        return writer.prepare(checkpoint)

    def settle(self, flow: Dataflow, states: dict[str, dict[str, Any]], **kw: Any) -> int:
        return settle_old_shape(
            flow, states, parallelism=self.old, stage_names=["src"], epoch=0, generation=2,
            snapshot_url=self.url, checkpoint_interval=None, **kw,
        )  # fmt: skip

    def run_new_shape(self, sink: Sink) -> None:
        """Checkpoint 3 of the new shape: every key of the old shape, on its new owner."""
        writers = [sink.open(self.ctx(i, self.new, 3, 1)) for i in range(self.new)]
        for w in writers:
            w.recover([])  # restored with no pending: settled
        keys = [f"k{s}" for s in range(max(self.old, self.new))]
        committables = []
        for i, w in enumerate(writers):
            mine = [k for j, k in enumerate(keys) if j % self.new == i]
            w.write([value(k, 100 + n, 100 + i) for k in mine for n in range(2)])
            committables.append(w.prepare(3))
        self.store.complete(self.job, 3, {}, {})
        for w, c in zip(writers, committables, strict=True):
            w.commit(3, c)
            w.close()

    def expected(self) -> list[Record]:
        out: list[Record] = []
        for s, role in enumerate(self.roles):
            out += [(f"k{s}", n, s) for n in (10, 11)]
            if role != "idle":
                out += [(f"k{s}", n, s) for n in (20, 21)]
        keys = [f"k{s}" for s in range(max(self.old, self.new))]
        for j, k in enumerate(keys):
            out += [(k, 100 + n, 100 + j % self.new) for n in range(2)]
        return out

    def aborted(self) -> list[Record]:
        """The old shape's records that must never be committed (orphan epochs)."""
        out: list[Record] = []
        for s, role in enumerate(self.roles):
            if role in ("committed", "idle"):
                out += [(f"k{s}", 30, s), (f"k{s}", 31, s)]
            if role in ("committed", "pending"):
                out.append((f"k{s}", 40, s))
        return out


def check(case: Case, story: Story) -> None:
    expected = story.expected()
    got = _read_until_complete(case, Counter(expected))
    if case.aborted_visible:  # Tansu: no loss, no duplicate, aborted orphans may show
        extra = Counter(got) - Counter(expected)
        assert Counter(got) - extra == Counter(expected)
        assert not extra - Counter(story.aborted())
    else:
        assert Counter(got) == Counter(expected)
    if case.ordered:  # per key: the old shape's records, in order, before the new shape's
        for key in {k for k, _n, _w in expected}:
            ns = [n for k, n, _w in got if k == key and n not in (30, 31, 40)]
            assert ns == sorted(ns), f"key {key}: {ns}"
    assert case.leftovers() == []


def _read_until_complete(case: Case, want: Counter[Record], timeout: float = 15.0) -> list[Record]:
    """The output, read again (up to ``timeout``) while some expected record is not visible
    yet: a read_committed reader reaches a committed transaction's records once its markers
    are written, which Kafka does after EndTxn returned. A record really lost stays missing,
    and the assertions after this say so."""
    deadline = time.monotonic() + timeout
    while True:
        got = case.read()
        if not want - Counter(got) or time.monotonic() >= deadline:
            return got
        time.sleep(0.5)


def flow_of(job: str, sink: Sink) -> Dataflow:
    flow = Dataflow(job)
    flow.source("src", "in").sink("out", sink)
    return flow


# -- the sinks -----------------------------------------------------------------------------------


@pytest.fixture
def job() -> str:
    return f"settle-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"file://{tmp_path}/checkpoints"


def files_case(tmp_path: Path) -> Case:
    out = tmp_path / "out"

    def read() -> list[Record]:
        return [(k, n, w) for k, (n, w) in read_jsonl(out)] if out.exists() else []

    def leftovers() -> list[Any]:
        return sorted(p.name for p in out.glob(".part-*.inprogress"))

    return Case(FileSink(out), read, leftovers, ordered=False)


def postgres_case(dsn: str, job: str) -> Case:
    table = f"settle_{job[-10:]}"
    db = psycopg.connect(dsn, autocommit=True)
    columns = {"user_id": "text", "clicks": "bigint", "amount": "bigint"}

    def read() -> list[Record]:
        q = psycopg.sql.SQL("SELECT user_id, clicks, amount FROM {}")
        return [tuple(r) for r in db.execute(q.format(psycopg.sql.Identifier(table)))]

    def prepared() -> list[Any]:
        q = "SELECT gid FROM pg_prepared_xacts WHERE starts_with(gid, %s)"
        return [r[0] for r in db.execute(q, [f"eosflow:{job}:"])]

    def teardown() -> None:
        for gid in prepared():  # never leave prepared transactions on a shared server
            db.execute(psycopg.sql.SQL("ROLLBACK PREPARED {}").format(psycopg.sql.Literal(gid)))
        db.execute(psycopg.sql.SQL("DROP TABLE IF EXISTS {}").format(psycopg.sql.Identifier(table)))
        db.close()

    sink = PostgresSink(table, columns, dsn=dsn, row=row)
    return Case(sink, read, prepared, ordered=False, teardown=[teardown])


def redis_case(redis_url: str, job: str) -> Case:
    client = redis.Redis.from_url(redis_url)
    target = f"test:{job}:out"

    def read() -> list[Record]:
        return [tuple(orjson.loads(v)) for v in client.lrange(target, 0, -1)]

    def leftovers() -> list[Any]:
        return sorted(client.scan_iter(match=f"eosflow:sink:{job}:*:stage:*"))

    def teardown() -> None:
        for key in [target, *client.scan_iter(match=f"eosflow:sink:{job}:*")]:
            client.delete(key)
        client.close()

    sink = RedisSink("list", key=target, value=lambda kv: [kv[0], *kv[1]], url=redis_url)
    return Case(sink, read, leftovers, teardown=[teardown])


def kafka_case(settings: KafkaSettings, topic: str, caps: Any, *, staged: bool = False) -> Case:
    TopicAdmin(settings).ensure_topic(topic, 3)
    hides = bool(caps.read_committed_hides_aborted)

    # The reader's isolation level comes from the broker probe. Where read_committed hides
    # aborted records (Apache Kafka), read_committed: a transaction the settle left open holds
    # the new shape's output back and fails the test. Where it shows them anyway (Tansu), it
    # returns the same records, cut at a last stable offset that Tansu 0.6 can freeze for
    # good: concurrent aborts (the settle's init_transactions) can leave a transaction marked
    # Aborted with a produced range, and every later transaction in that partition then stays
    # PrepareCommit (dynostore.rs txn_end: "overlaps.iter().all(is_prepared)"). The new
    # shape's committed output stayed hidden so, with plain producers too. There the log
    # itself is read: a record never published or published twice still fails the test; a
    # transaction the settle left open is caught on Apache Kafka only (CI's Kafka tier and the
    # release checks run this test there).
    committed = hides or staged

    def read() -> list[Record]:
        msgs = read_topic(settings, topic, committed=committed, dedup=staged)
        return [(m.key().decode(), *orjson.loads(m.value())) for m in msgs]

    if staged:
        sink = KafkaSink(topic, mode="staged", settings=settings)
        return Case(sink, read)
    sink = KafkaSink(topic, transactional_id_prefix=f"p-{topic}", settings=settings)
    return Case(sink, read, aborted_visible=not hides)


SINKS = ["files", "postgres", "redis", "kafka", "kafka-staged"]


@pytest.fixture(params=SINKS)
def case(request: pytest.FixtureRequest, tmp_path: Path, job: str) -> Iterator[Case]:
    kind = request.param
    if kind == "files":
        made = files_case(tmp_path)
    elif kind == "postgres":
        made = postgres_case(request.getfixturevalue("postgres_dsn"), job)
    elif kind == "redis":
        made = redis_case(request.getfixturevalue("redis_url"), job)
    else:
        settings = request.getfixturevalue("kafka_settings")
        caps = request.getfixturevalue("broker_caps")
        topic = request.getfixturevalue("topic_name")
        made = kafka_case(settings, topic, caps, staged=kind == "kafka-staged")
    yield made
    for step in made.teardown:
        step()


# -- tests ---------------------------------------------------------------------------------------


def test_output_is_exact_when_old_shape_of_three_is_settled_before_one_new_writer(
    case: Case, job: str, url: str
) -> None:
    story = Story(job, url, old=3, new=1, roles=["committed", "pending", "idle"])
    states = story.run_old_shape(case.sink)
    flow = flow_of(job, case.sink)
    assert story.settle(flow, states) == 2
    assert story.settle(flow, states) == 2  # idempotent: the runner may settle again
    story.run_new_shape(case.sink)
    check(case, story)


def test_output_is_exact_when_settle_is_interrupted_mid_recover_and_run_again(
    case: Case, job: str, url: str
) -> None:
    if case.aborted_visible:
        # Tansu (read_committed shows aborted records, the broker probe says): twice in four
        # runs on 2026-11-28 the new shape's committed records stayed hidden from a
        # read_committed reader for 15 s after the interrupted settle (a transaction the crash
        # left open, not aborted by the next init_transactions as Kafka does). Not decidable
        # there; it runs fully on Apache Kafka (CI's Kafka tier, the release check).
        pytest.skip("broker lacks: init_transactions aborting an interrupted settle's open txn")
    story = Story(job, url, old=3, new=1, roles=["committed", "pending", "idle"])
    states = story.run_old_shape(case.sink)
    flow = flow_of(job, case.sink)

    def crash(point: str) -> None:
        if point == "mid-sink-recover":
            raise Crash(point)

    with pytest.raises(EosflowError, match=r"sink 'out' old subtask 1 of 3 .*checkpoint 2") as err:
        story.settle(flow, states, fault=crash)
    assert isinstance(err.value.__cause__, Crash)
    assert story.settle(flow, states) == 2
    story.run_new_shape(case.sink)
    check(case, story)


def test_output_is_exact_when_one_old_writer_is_settled_before_three_new_writers(
    case: Case, job: str, url: str
) -> None:
    story = Story(job, url, old=1, new=3, roles=["pending"])
    states = story.run_old_shape(case.sink)
    assert story.settle(flow_of(job, case.sink), states) == 1
    story.run_new_shape(case.sink)
    check(case, story)


def test_kafka_marker_topic_of_the_old_shape_serves_the_new_one_when_parallelism_grows(
    kafka_settings: KafkaSettings, broker_caps: Any, topic_name: str, job: str, url: str
) -> None:
    """The marker topic was created with the old parallelism and refused any other count: the
    writers of the new shape failed to open (regression, issue 24). Now it is grown (or, where
    the broker refuses, shared: subtask % count) and every marker names its own subtask."""
    case = kafka_case(kafka_settings, topic_name, broker_caps)
    story = Story(job, url, old=1, new=3, roles=["pending"])
    states = story.run_old_shape(case.sink)
    story.settle(flow_of(job, case.sink), states)
    story.run_new_shape(case.sink)
    check(case, story)
    count = len(TopicAdmin(kafka_settings).partitions(marker_topic(job, "out")))
    hides = bool(broker_caps.read_committed_hides_aborted)
    markers = read_transaction_markers(kafka_settings, job, "out", read_committed=hides)
    new = {(m["subtask"], m["partition"]) for m in markers if m["epoch"] == "3.0"}
    assert new == {(i, i % count) for i in range(3)}
    print(f"marker topic partitions after growing from 1 to 3: {count}")
