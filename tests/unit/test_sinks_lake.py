"""The lakehouse sinks' protocol on local tables (no server): Delta (delta-rs) and Iceberg
(pyiceberg, SQL catalog on SQLite). Read back with the formats' own readers.

Covers: one table commit per checkpoint for all subtasks, idempotent commit and recover, orphan
clean-up, misfits rejected (dead letters) without widening the schema, a restarted job without
snapshots refused, and two committers of one table racing with an injected conflict.
"""

from __future__ import annotations

import datetime
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pa = pytest.importorskip("pyarrow")
pytest.importorskip("deltalake")
pytest.importorskip("pyiceberg")

from processor.contracts import SinkContext  # noqa: E402
from processor.errors import ConfigError, RecordsRejected  # noqa: E402
from sinks.lake import DeltaSink, IcebergSink, read_delta, read_iceberg  # noqa: E402
from sinks.lake.writer import LakeWriter  # noqa: E402

SCHEMA = pa.schema([("user", pa.string()), ("n", pa.int64()), ("day", pa.date32())])
DAY = datetime.date(2026, 11, 27)


class Lake:
    """One table of one format, its sink and its independent reader."""

    def __init__(self, fmt: str, tmp: Path, *, schema: Any = SCHEMA) -> None:
        self.fmt = fmt
        self.tmp = tmp
        self.snapshots = f"file://{tmp}/snapshots"
        if fmt == "delta":
            self.sink: Any = DeltaSink(tmp / "delta", schema=schema, partition_by=["day"])
        else:
            self.catalog = {
                "type": "sql",
                "uri": f"sqlite:///{tmp}/catalog.db",
                "warehouse": f"file://{tmp}/warehouse",
            }
            self.sink = IcebergSink(
                "ns.t", catalog=self.catalog, schema=schema, partition_by=[("day", "day")]
            )

    def writer(self, subtask: int, parallelism: int = 2, generation: int = 1, job: str = "j"):
        ctx = SinkContext(job, "out", subtask, parallelism, generation, snapshot_url=self.snapshots)
        return self.sink.open(ctx)

    def rows(self) -> Counter[tuple[Any, ...]]:
        if self.fmt == "delta":
            table = read_delta(str(self.tmp / "delta"))
        else:
            table = read_iceberg("ns.t", catalog=self.catalog)
        return Counter((r["user"], r["n"]) for r in table.to_pylist())

    def commits(self) -> list[int]:
        """The checkpoint of each table commit that added data."""
        if self.fmt == "delta":
            import deltalake

            history = deltalake.DeltaTable(str(self.tmp / "delta")).history()
            return sorted(
                int(h["eosflow.checkpoint"]) for h in history if "eosflow.checkpoint" in h
            )
        from pyiceberg.catalog import load_catalog

        table = load_catalog("default", **self.catalog).load_table("ns.t")
        assert "commit.retry.num-retries" not in table.properties  # in memory only
        return sorted(int(s.summary["eosflow.checkpoint"]) for s in table.snapshots())


FORMATS = ["delta", "iceberg"]


def _rows(user: str, count: int, start: int = 0) -> list[dict[str, Any]]:
    return [
        {"user": user, "n": start + i, "day": DAY + datetime.timedelta(i % 2)} for i in range(count)
    ]


@pytest.mark.parametrize("fmt", FORMATS)
def test_one_table_commit_holds_every_subtasks_epoch_when_a_checkpoint_completes(
    fmt: str, tmp_path: Path
) -> None:
    lake = Lake(fmt, tmp_path)
    ws = [lake.writer(s, 3) for s in range(3)]
    for w in ws:
        w.recover([])
    ws[0].write(_rows("a", 5))
    ws[2].write(_rows("c", 3))  # subtask 1 wrote nothing this epoch
    cs = [w.prepare(1) for w in ws]
    assert all(c is not None for c in cs), "an empty epoch still has a committable"
    _complete(lake, 1)
    for w in reversed(ws):
        w.commit(1, cs[ws.index(w)])
    assert lake.rows() == Counter([("a", i) for i in range(5)] + [("c", i) for i in range(3)])
    assert lake.commits() == [1]
    for w, c in zip(ws, cs, strict=False):  # idempotent: again, and a recovery of the same snapshot
        w.commit(1, c)
        w.recover([(1, c)])
    assert lake.commits() == [1]
    assert sum(lake.rows().values()) == 8


@pytest.mark.parametrize("fmt", FORMATS)
def test_recover_commits_the_restored_epoch_once_and_deletes_orphans_when_killed_around_commit(
    fmt: str, tmp_path: Path
) -> None:
    """Checkpoint 1 completed but the committer died before committing; epoch 2 was
    prepared but never completed (orphan). Recovery from 1 commits 1 exactly once, drops 2."""
    lake = Lake(fmt, tmp_path)
    ws = [lake.writer(s) for s in range(2)]
    for w in ws:
        w.recover([])
    ws[0].write(_rows("a", 4))
    ws[1].write(_rows("b", 2))
    c1 = [w.prepare(1) for w in ws]
    ws[0].write(_rows("a", 3, start=100))
    ws[1].write(_rows("b", 3, start=100))
    [w.prepare(2) for w in ws]  # never completes
    # Restart (generation 2) from checkpoint 1: nothing of 2 may land.
    again = [lake.writer(s, generation=2) for s in range(2)]
    _complete(lake, 1)
    for w, c in zip(again, c1, strict=False):
        w.recover([(1, c)])
    want = Counter([("a", i) for i in range(4)] + [("b", i) for i in range(2)])
    assert lake.rows() == want
    assert [m.name for m in again[0].staging.manifests()] == []  # committed, cleaned; orphans gone
    for w, c in zip(again, c1, strict=False):  # a second recovery of the same snapshot
        w.recover([(1, c)])
    assert lake.rows() == want
    assert lake.commits() == [1]


def _complete(lake: Lake, checkpoint_id: int, generation: int = 1, job: str = "j") -> None:
    """The job's snapshot store says ``checkpoint_id`` completed in ``generation``, as the
    coordinator records it (the history check; which generation's manifests may land)."""
    from processor.snapshot.store import SnapshotStore

    store = SnapshotStore(lake.snapshots)
    handle = store.write_task_snapshot(job, checkpoint_id, "t.0", {"x": 1})
    store.complete(job, checkpoint_id, {"t.0": handle}, {"generation": generation})


def _land(lake: Lake, writer: Any, n: int) -> None:
    """Checkpoint ``n`` as the engine runs it: the barrier's prepare, completion, commit."""
    c = writer.prepare(n)
    _complete(lake, n)
    writer.commit(n, c)


@pytest.mark.parametrize("fmt", FORMATS)
def test_racing_committers_commit_an_epoch_once_when_a_conflict_is_injected(
    fmt: str, tmp_path: Path
) -> None:
    """Two committers of one checkpoint (a zombie of the old generation and the recovering
    one): the second's commit is raced by the first's (injected between its read of the last
    committed checkpoint and its commit). The loser's retry sees the epoch landed."""
    lake = Lake(fmt, tmp_path)
    ws = [lake.writer(s) for s in range(2)]
    for w in ws:
        w.recover([])
    ws[0].write(_rows("a", 5))
    ws[1].write(_rows("b", 5))
    cs = [w.prepare(1) for w in ws]
    _complete(lake, 1, generation=1)
    zombie = lake.writer(0, generation=1)
    racer: LakeWriter = lake.writer(0, generation=2)
    original = racer.ops.commit
    injected = []

    def commit_after_the_zombie(files: list[Any], checkpoint_id: int) -> None:
        if not injected:
            injected.append(checkpoint_id)
            zombie.commit(checkpoint_id, cs[0])  # wins the race
        original(files, checkpoint_id)

    racer.ops.commit = commit_after_the_zombie  # type: ignore[method-assign]
    racer.commit(1, cs[0])
    assert injected == [1]
    assert lake.rows() == Counter([("a", i) for i in range(5)] + [("b", i) for i in range(5)])
    assert lake.commits() == [1]


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_epoch_lands_once_when_another_writer_appends_between_read_and_commit(
    fmt: str, tmp_path: Path
) -> None:
    """Another job's commit to the same table lands while this committer commits: optimistic
    concurrency makes it retry; both jobs' rows are there once."""
    lake = Lake(fmt, tmp_path)
    mine = [lake.writer(s) for s in range(2)]
    other = lake.writer(0, parallelism=1, job="other-job")
    for w in [*mine, other]:
        w.recover([])
    for w in mine:
        w.write(_rows(f"m{w.ctx.subtask}", 4))
    other.write(_rows("o", 3))
    cs = [w.prepare(7) for w in mine]
    oc = other.prepare(1)
    _complete(lake, 7)
    _complete(lake, 1, job="other-job")
    original = mine[0].ops.commit
    fired = []

    def commit_after_other(files: list[Any], checkpoint_id: int) -> None:
        if not fired:
            fired.append(1)
            other.commit(1, oc)
        original(files, checkpoint_id)

    mine[0].ops.commit = commit_after_other  # type: ignore[method-assign]
    mine[0].commit(7, cs[0])
    want = Counter(
        [("m0", i) for i in range(4)] + [("m1", i) for i in range(4)] + [("o", i) for i in range(3)]
    )
    assert lake.rows() == want
    assert lake.commits() == [1, 7]


@pytest.mark.parametrize("fmt", FORMATS)
def test_values_that_do_not_fit_the_table_are_rejected_and_the_schema_is_kept(
    fmt: str, tmp_path: Path
) -> None:
    lake = Lake(fmt, tmp_path)
    w = lake.writer(0, 1)
    w.recover([])
    with pytest.raises(RecordsRejected) as caught:
        w.write([
            {"user": "a", "n": 1, "day": DAY},
            {"user": "b", "n": "two", "day": DAY},
            {"user": "c", "n": 3, "day": DAY, "extra": True},
            "not a dict",
            {"user": "d", "n": 4, "day": DAY},
        ])  # fmt: skip
    failures = caught.value.failures
    assert [i for i, _e in failures] == [1, 2, 3]
    assert "'extra'" in str(failures[1][1]) and "never widens" in str(failures[1][1])
    _land(lake, w, 1)
    assert lake.rows() == Counter([("a", 1), ("d", 4)])
    reread = lake.writer(0, 1).ops.table_schema()
    assert reread is not None and reread.names == ["user", "n", "day"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_given_schema_that_differs_from_the_tables_is_refused(fmt: str, tmp_path: Path) -> None:
    Lake(fmt, tmp_path).sink.preflight(job="j", checkpoint_interval=1.0)
    wider = SCHEMA.append(pa.field("extra", pa.string()))
    with pytest.raises(ConfigError, match="never changes a table's schema"):
        Lake(fmt, tmp_path, schema=wider).sink.preflight(job="j", checkpoint_interval=1.0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_schema_is_inferred_from_the_first_batch_then_enforced(
    fmt: str, tmp_path: Path
) -> None:
    lake = Lake(fmt, tmp_path, schema=None)
    w = lake.writer(0, 1)
    w.recover([])
    w.write(_rows("a", 2))
    with pytest.raises(RecordsRejected):
        w.write([{"user": "b", "n": 1, "day": DAY, "new": 1}])
    _land(lake, w, 1)
    assert lake.rows() == Counter([("a", 0), ("a", 1)])


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_run_without_the_jobs_snapshots_is_refused_when_the_table_has_newer_commits(
    fmt: str, tmp_path: Path
) -> None:
    lake = Lake(fmt, tmp_path)
    w = lake.writer(0, 1)
    w.recover([])
    w.write(_rows("a", 1))
    _land(lake, w, 3)
    from processor.snapshot.store import SnapshotStore

    SnapshotStore(lake.snapshots).delete_job("j")  # the job's snapshots are lost
    _complete(lake, 1)
    with pytest.raises(ConfigError, match="another run of the job") as refused:
        lake.writer(0, 1, generation=5).recover([])
    assert "eosflow reset" in str(refused.value)
    if fmt == "iceberg":  # the way out it names works: the table forgets the job's commits
        from pyiceberg.catalog import load_catalog

        table = load_catalog("default", **lake.catalog).load_table("ns.t")
        assert "'eosflow.checkpoint.j.out'" in str(refused.value)
        with table.transaction() as txn:
            txn.remove_properties("eosflow.checkpoint.j.out")
        w = lake.writer(0, 1, generation=5)
        w.recover([])
        w.write(_rows("new", 1))
        c = w.prepare(2)
        _complete(lake, 2, generation=5)
        w.commit(2, c)
        assert lake.rows() == Counter([("a", 0), ("new", 0)])


def test_delta_compacts_after_every_nth_commit_when_asked(tmp_path: Path) -> None:
    """compact_every=3: the committer runs delta-rs optimize.compact() after its 3rd commit;
    the rows stay the same, the table has fewer files, and the epochs' idempotency is kept."""
    import deltalake

    sink = DeltaSink(tmp_path / "delta", schema=SCHEMA, partition_by=["day"], compact_every=3)
    lake = Lake("delta", tmp_path)
    lake.sink = sink
    ws = [lake.writer(s) for s in range(2)]
    for w in ws:
        w.recover([])
    want: Counter[tuple[Any, ...]] = Counter()
    for chk in (1, 2, 3):
        for w in ws:
            rows = _rows(f"u{w.ctx.subtask}", 10, start=chk * 100)
            w.write(rows)
            want.update((r["user"], r["n"]) for r in rows)
        cs = [w.prepare(chk) for w in ws]
        _complete(lake, chk)
        for w, c in zip(ws, cs, strict=True):
            w.commit(chk, c)
    table = deltalake.DeltaTable(str(tmp_path / "delta"))
    assert len(table.file_uris()) == 2  # one per day partition, from 12
    assert lake.rows() == want
    assert table.transaction_version("eosflow:j:out") == 3
    ws[0].commit(3, cs[0])  # a re-commit after compaction is still a no-op
    assert lake.rows() == want


def test_the_sink_step_hands_each_rejected_value_to_the_error_handler_and_writes_the_rest(
    tmp_path: Path,
) -> None:
    """RecordsRejected from a writer: the sink step (SinkOp) calls the task's error handler
    (dead letters) once per misfit with its index and cause; the rest is written."""
    from processor.runtime.operators.core import SinkOp
    from processor.steps import Step

    lake = Lake("delta", tmp_path)
    writer = lake.writer(0, 1)
    writer.recover([])
    op = SinkOp(Step("out", "sink", ("src",), False), writer, keyed=False)
    seen: list[tuple[int, str]] = []
    op.on_error = lambda _op, batch, i, exc: seen.append((i, str(exc)))
    good = {"user": "a", "n": 1, "day": DAY}
    op.process([(None, good, 0), (None, {"user": "b", "n": "x", "day": DAY}, 0), (None, good, 0)])
    assert [i for i, _ in seen] == [1] and "ArrowInvalid" in seen[0][1]
    assert op.written == 2
    _land(lake, writer, 1)
    assert lake.rows() == Counter([("a", 1), ("a", 1)])


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_zombies_late_manifest_is_not_committed_when_its_checkpoint_was_rolled_back(
    fmt: str, tmp_path: Path
) -> None:
    """Regression: the committer committed every manifest of a checkpoint in (last, n],
    whoever wrote it. A zombie of generation 1 (SIGSTOPped inside prepare(2), checkpoint 2
    never completed) wrote its manifest of 2 after generation 2 had recovered from 1 (and
    deleted the orphans it could see); generation 2 replayed the epoch into checkpoint 3, and
    the committer of 3 committed the zombie's rows too: every replayed row twice."""
    lake = Lake(fmt, tmp_path)
    g1 = [lake.writer(s, generation=1) for s in range(2)]
    for w in g1:
        w.recover([])
    g1[0].write(_rows("a", 2))
    g1[1].write(_rows("b", 2))
    c1 = [w.prepare(1) for w in g1]
    _complete(lake, 1, generation=1)
    for w, c in zip(g1, c1, strict=True):
        w.commit(1, c)
    g1[1].write(_rows("b", 3, start=100))  # the epoch that checkpoint 2 never completes
    g2 = [lake.writer(s, generation=2) for s in range(2)]
    for w, c in zip(g2, c1, strict=True):
        w.recover([(1, c)])
    g1[1].prepare(2)  # the zombie wakes up: its manifest of 2 lands after the recovery
    g2[1].write(_rows("b", 3, start=100))  # the replayed epoch
    c3 = [w.prepare(3) for w in g2]  # checkpoint ids never go back
    _complete(lake, 3, generation=2)
    for w, c in zip(g2, c3, strict=True):
        w.commit(3, c)
    want = Counter(
        [("a", i) for i in range(2)] + [("b", i) for i in range(2)]
        + [("b", 100 + i) for i in range(3)]
    )  # fmt: skip
    assert lake.rows() == want
    assert lake.commits() == [1, 3]
    assert g2[0].staging.manifests() == [], "the zombie's manifest is cleaned up"


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_zombie_committer_does_not_commit_an_aborted_epoch_when_it_wakes_up(
    fmt: str, tmp_path: Path
) -> None:
    """A fenced committer of generation 1 that wakes up with checkpoint 2 pending (aborted:
    generation 2 restored 1) and is told of a completion must not commit its epoch 2; nor
    may it delete generation 2's manifest of a checkpoint that has not completed yet."""
    lake = Lake(fmt, tmp_path)
    g1 = [lake.writer(s, generation=1) for s in range(2)]
    for w in g1:
        w.recover([])
    c1 = [w.prepare(1) for w in g1]
    _complete(lake, 1, generation=1)
    g2 = [lake.writer(s, generation=2) for s in range(2)]
    for w, c in zip(g2, c1, strict=True):
        w.recover([(1, c)])
    g1[0].write(_rows("zombie", 3))
    zc = g1[0].prepare(2)  # after generation 2's recovery: not deleted as an orphan
    g2[1].write(_rows("b", 2))
    c3 = g2[1].prepare(3)  # checkpoint 3 of generation 2, not completed yet
    g1[0].commit(2, zc)
    assert lake.rows() == Counter()
    g2[0].write(_rows("a", 1))
    c3 = [g2[0].prepare(3), c3]
    _complete(lake, 3, generation=2)
    for w, c in zip(g2, c3, strict=True):
        w.commit(3, c)
    assert lake.rows() == Counter([("a", 0), ("b", 0), ("b", 1)])


@pytest.mark.parametrize("fmt", FORMATS)
def test_local_recovery_is_refused_at_start_up_when_a_lakehouse_sink_is_used(
    fmt: str, tmp_path: Path
) -> None:
    """Regression: docs/sink-lakehouse.md said ``--recovery local`` is not covered, but a job
    started with it: a worker restarted alone deletes staged epochs the committer commits,
    and its writers' sink generation is not the checkpoints' (their epochs would never land).
    Now refused before anything runs, saying what to use; global recovery starts."""
    from processor.runtime.supervision.local import LocalRunner, RunOptions

    pipeline = tmp_path / "lake_job.py"
    sink = (
        f"DeltaSink({str(tmp_path / 'delta')!r})"
        if fmt == "delta"
        else f"IcebergSink('ns.t', catalog={Lake('iceberg', tmp_path).catalog!r})"
    )
    pipeline.write_text(
        "from processor.dataflow import Dataflow\n"
        "from sinks.lake import DeltaSink, IcebergSink\n"
        "flow = Dataflow('lake-job')\n"
        f"flow.source('clicks', 't').sink('table', {sink})\n"
    )
    options = RunOptions(recovery="local", state_dir=str(tmp_path / "state"))
    with pytest.raises(ConfigError, match=r"--recovery local cannot keep sink step 'table'") as e:
        LocalRunner(pipeline, options)
    assert "Use --recovery global" in str(e.value)
    LocalRunner(pipeline, RunOptions(state_dir=str(tmp_path / "state")))  # global: fine


@pytest.mark.parametrize("fmt", FORMATS)
def test_one_table_commit_covers_an_aborted_checkpoint_when_the_next_one_completes(
    fmt: str, tmp_path: Path
) -> None:
    """Regression: checkpoint 1 aborted (its committables stay pending), 2 completed: the
    engine calls commit(1) then commit(2), and the committer made a table commit for each,
    recording 1, which never completed. Now one commit, recording 2, holds both epochs."""
    lake = Lake(fmt, tmp_path)
    ws = [lake.writer(s) for s in range(2)]
    for w in ws:
        w.recover([])
    pending: list[list[tuple[int, Any]]] = [[], []]
    for chk in (1, 2):
        for w, p in zip(ws, pending, strict=True):
            w.write(_rows(f"u{w.ctx.subtask}", 2, start=chk * 10))
            p.append((chk, w.prepare(chk)))
    _complete(lake, 2)
    for w, p in zip(ws, pending, strict=True):
        for chk, c in p:  # as SubtaskCheckpoints.complete does: every pending one, in order
            w.commit(chk, c)
    assert lake.commits() == [2]
    assert sum(lake.rows().values()) == 8


def _one_commit(lake: Lake) -> None:
    w = lake.writer(0, 1)
    w.recover([])
    w.write(_rows("a", 3))
    c = w.prepare(1)
    _complete(lake, 1)
    w.commit(1, c)


def test_the_tables_open_with_pyicebergs_and_deltalakes_defaults(tmp_path: Path) -> None:
    """Issue 50: IcebergSink named its catalog "eosflow", and a SQL catalog keeps that name
    with each table: ``SqlCatalog("default", ...)`` (pyiceberg's default) said
    NoSuchNamespaceError. Delta needs no catalog: ``DeltaTable(path)``."""
    import deltalake
    from pyiceberg.catalog.sql import SqlCatalog

    iceberg, delta = Lake("iceberg", tmp_path / "i"), Lake("delta", tmp_path / "d")
    for lake in (iceberg, delta):
        _one_commit(lake)
    props = {k: v for k, v in iceberg.catalog.items() if k != "type"}
    table = SqlCatalog("default", **props).load_table("ns.t")
    assert table.scan().to_arrow().num_rows == 3
    assert deltalake.DeltaTable(str(tmp_path / "d" / "delta")).to_pyarrow_table().num_rows == 3


def test_a_table_an_older_eosflow_created_under_its_catalog_name_is_written_there(
    tmp_path: Path,
) -> None:
    from pyiceberg.catalog import load_catalog

    lake = Lake("iceberg", tmp_path)
    legacy = load_catalog("eosflow", **lake.catalog)
    legacy.create_namespace("ns")
    legacy.create_table("ns.t", schema=SCHEMA)
    _one_commit(lake)
    assert not load_catalog("default", **lake.catalog).table_exists("ns.t")  # no second table
    rows = legacy.load_table("ns.t").scan().to_arrow()
    assert rows.num_rows == 3
    assert read_iceberg("ns.t", catalog=lake.catalog).num_rows == 3  # found there too
