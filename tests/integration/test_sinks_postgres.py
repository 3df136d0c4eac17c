"""Integration tests for sinks.postgres against a real PostgreSQL (the ``postgres_dsn`` fixture:
embedded unless EOSFLOW_POSTGRES_DSN or ``eosflow dev up`` names one).

Every test uses its own job name and table, so tests share the server, never prepared
transactions or rows.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from processor.contracts import Sink, SinkContext, SinkWriter, preflight_sink
from processor.embedded._process import free_port, spawn, stop, wait_until
from processor.embedded.servers import find_binary
from processor.errors import ConfigError, EosflowError, SerializationError, SnapshotError
from processor.snapshot.store import SnapshotStore
from sinks.postgres import COMMITS_TABLE, PostgresSink, PostgresSinkWriter, global_id

COLUMNS = {"user_id": "text", "clicks": "bigint", "amount": "bigint"}


def totals_row(kv: Any) -> tuple[Any, ...]:
    """A keyed running-total value ``(user, (count, amount))`` as a row."""
    user, (count, amount) = kv
    return (user, count, amount)


@pytest.fixture
def db(postgres_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """An observer's autocommit connection (sees committed rows only)."""
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        yield conn


@pytest.fixture
def names(db: psycopg.Connection[Any]) -> Iterator[tuple[str, str]]:
    """A unique (job, table); afterwards, none of the job's transactions may stay prepared."""
    tag = uuid.uuid4().hex[:8]
    job, table = f"pg-test-{tag}", f"pg_test_{tag}"
    yield job, table
    left = prepared(db, job)
    for gid in left:  # never leave prepared transactions behind on a shared server
        db.execute(psycopg.sql.SQL("ROLLBACK PREPARED {}").format(psycopg.sql.Literal(gid)))
    db.execute(psycopg.sql.SQL("DROP TABLE IF EXISTS {}").format(psycopg.sql.Identifier(table)))
    assert left == [], f"prepared transactions left behind: {left}"


def prepared(db: psycopg.Connection[Any], job: str) -> list[str]:
    rows = db.execute(
        "SELECT gid FROM pg_prepared_xacts WHERE starts_with(gid, %s) ORDER BY gid",
        [f"eosflow:{job}:"],
    ).fetchall()
    return [r[0] for r in rows]


def visible(db: psycopg.Connection[Any], table: str) -> list[tuple[Any, ...]]:
    query = psycopg.sql.SQL("SELECT user_id, clicks, amount FROM {} ORDER BY 1, 2, 3")
    return db.execute(query.format(psycopg.sql.Identifier(table))).fetchall()


def markers(db: psycopg.Connection[Any], job: str) -> list[int]:
    rows = db.execute(
        f"SELECT checkpoint_id FROM {COMMITS_TABLE} WHERE job = %s ORDER BY 1", [job]
    ).fetchall()
    return [r[0] for r in rows]


def context(
    job: str,
    *,
    subtask: int = 0,
    generation: int = 1,
    snapshot_url: str | None = None,
    fault: Callable[[str], None] | None = None,
) -> SinkContext:
    return SinkContext(
        job,
        "out",
        subtask,
        2,
        generation,
        checkpoint_interval=1.0,
        snapshot_url=snapshot_url,
        fault=fault or (lambda point: None),
    )


def sink(dsn: str, table: str, *, mode: str = "append", **kw: Any) -> PostgresSink:
    key = ("user_id",) if mode == "upsert" else ()
    return PostgresSink(table, COLUMNS, dsn=dsn, mode=mode, key=key, row=totals_row, **kw)


def clicks(*items: tuple[str, int, int]) -> list[Any]:
    return [(user, (count, amount)) for user, count, amount in items]


# -- the protocol --------------------------------------------------------------------------------


def test_rows_are_visible_only_after_commit_when_epoch_is_prepared(
    postgres_dsn: str, db: psycopg.Connection[Any], names: tuple[str, str]
) -> None:
    job, table = names
    pg_sink = sink(postgres_dsn, table)
    writer = pg_sink.open(context(job, subtask=3))
    assert isinstance(pg_sink, Sink)
    assert isinstance(writer, SinkWriter)
    writer.write(clicks(("u1", 1, 10), ("u2", 1, 5)))
    writer.write(clicks(("u1", 2, 30)))
    assert visible(db, table) == []
    committable = writer.prepare(7)
    assert committable is not None
    assert committable["gid"] == global_id(job, "out", 3, 7) == f"eosflow:{job}:out:3:7"
    assert committable["covers"] == [7]
    assert prepared(db, job) == [f"eosflow:{job}:out:3:7"]
    assert visible(db, table) == []
    assert markers(db, job) == []  # the marker commits with the rows
    writer.commit(7, committable)
    assert visible(db, table) == [("u1", 1, 10), ("u1", 2, 30), ("u2", 1, 5)]
    assert prepared(db, job) == []
    assert markers(db, job) == [7]
    writer.close()


def test_commit_does_nothing_when_called_twice_or_with_none(
    postgres_dsn: str, db: psycopg.Connection[Any], names: tuple[str, str]
) -> None:
    job, table = names
    writer = sink(postgres_dsn, table).open(context(job))
    writer.write(clicks(("u1", 1, 1)))
    committable = writer.prepare(1)
    writer.commit(1, committable)
    writer.commit(1, committable)
    writer.commit(2, None)
    writer.recover([(1, committable)])
    assert visible(db, table) == [("u1", 1, 1)]
    assert writer.prepare(2) is None  # nothing written: no transaction
    assert prepared(db, job) == []
    writer.close()


def test_upsert_keeps_last_row_per_key_when_keys_repeat_within_and_across_epochs(
    postgres_dsn: str, db: psycopg.Connection[Any], names: tuple[str, str]
) -> None:
    job, table = names
    writer = sink(postgres_dsn, table, mode="upsert").open(context(job))
    writer.write(clicks(("u1", 1, 10), ("u2", 1, 5), ("u1", 2, 12)))
    writer.commit(1, writer.prepare(1))
    assert visible(db, table) == [("u1", 2, 12), ("u2", 1, 5)]
    writer.write(clicks(("u2", 2, 9), ("u3", 1, 1), ("u2", 3, 20)))
    writer.commit(2, writer.prepare(2))
    assert visible(db, table) == [("u1", 2, 12), ("u2", 3, 20), ("u3", 1, 1)]
    writer.close()


def test_next_epoch_commits_completed_epoch_first_when_its_commit_has_not_arrived_yet(
    postgres_dsn: str, db: psycopg.Connection[Any], names: tuple[str, str], tmp_path: Path
) -> None:
    """Regression: epoch 2 rewrote a key that epoch 1's prepared transaction still locked, and
    commit(1) runs on the same thread: the writer waited for itself. Now prepare(2) commits 1
    first, because the snapshot store says checkpoint 1 completed."""
    job, table = names
    store = SnapshotStore(f"file://{tmp_path}/checkpoints")
    pg_sink = sink(postgres_dsn, table, mode="upsert", lock_timeout=timedelta(seconds=2))
    writer = pg_sink.open(context(job, snapshot_url=store.url))
    writer.write(clicks(("u1", 1, 10), ("u2", 1, 5)))
    c1 = writer.prepare(1)
    store.complete(job, 1, {}, {})  # completed; the engine's commit(1) is still on its way
    writer.write(clicks(("u1", 2, 11)))
    started = time.monotonic()
    c2 = writer.prepare(2)
    assert time.monotonic() - started < 1.5, "prepare(2) waited for a lock"
    assert visible(db, table) == [("u1", 1, 10), ("u2", 1, 5)]  # 1 committed, 2 prepared
    assert prepared(db, job) == [f"eosflow:{job}:out:0:2"]
    writer.commit(1, c1)  # the engine's commit: a no-op now
    writer.commit(2, c2)
    assert visible(db, table) == [("u1", 2, 11), ("u2", 1, 5)]
    assert markers(db, job) == [1, 2]
    writer.close()


@pytest.mark.parametrize("mode", ["append", "upsert"])
def test_next_epoch_carries_aborted_epoch_when_its_checkpoint_did_not_complete(
    postgres_dsn: str,
    db: psycopg.Connection[Any],
    names: tuple[str, str],
    tmp_path: Path,
    mode: str,
) -> None:
    job, table = names
    store = SnapshotStore(f"file://{tmp_path}/checkpoints")
    pg_sink = sink(postgres_dsn, table, mode=mode, lock_timeout=timedelta(seconds=2))
    writer = pg_sink.open(context(job, snapshot_url=store.url))
    writer.write(clicks(("u1", 1, 10), ("u2", 1, 5)))
    c1 = writer.prepare(1)  # checkpoint 1 aborts: never completed
    writer.write(clicks(("u1", 2, 11)))
    c2 = writer.prepare(2)
    assert c2 is not None
    assert c2["covers"] == [1, 2]
    assert prepared(db, job) == [f"eosflow:{job}:out:0:2"]  # 1 was rolled back, rows moved
    assert visible(db, table) == []
    store.complete(job, 2, {}, {})
    writer.commit(1, c1)  # commits the transaction of 2, which carries 1's rows
    writer.commit(2, c2)
    expected = {
        "append": [("u1", 1, 10), ("u1", 2, 11), ("u2", 1, 5)],
        "upsert": [("u1", 2, 11), ("u2", 1, 5)],
    }[mode]
    assert visible(db, table) == expected
    writer.close()


def test_recover_commits_carried_epoch_through_the_transaction_that_holds_it_after_restart(
    postgres_dsn: str, db: psycopg.Connection[Any], names: tuple[str, str], tmp_path: Path
) -> None:
    job, table = names
    store = SnapshotStore(f"file://{tmp_path}/checkpoints")
    pg_sink = sink(postgres_dsn, table)
    before = pg_sink.open(context(job, snapshot_url=store.url, generation=1))
    before.write(clicks(("u1", 1, 10)))
    c1 = before.prepare(1)  # aborted
    before.write(clicks(("u1", 2, 11)))
    c2 = before.prepare(2)  # completed; crash before any commit
    before.close()
    after = pg_sink.open(context(job, snapshot_url=store.url, generation=2))
    after.recover([(1, c1), (2, c2)])
    assert visible(db, table) == [("u1", 1, 10), ("u1", 2, 11)]
    assert prepared(db, job) == []
    after.close()


def test_recover_commits_pending_and_rolls_back_own_orphans_when_restarted_after_crash(
    postgres_dsn: str, db: psycopg.Connection[Any], names: tuple[str, str]
) -> None:
    job, table = names
    pg_sink = sink(postgres_dsn, table)
    before = pg_sink.open(context(job, subtask=0))
    other = pg_sink.open(context(job, subtask=1))
    before.write(clicks(("u1", 1, 1)))
    c1 = before.prepare(1)  # checkpoint 1 completes, crash before commit
    before.write(clicks(("u1", 2, 2)))
    before.prepare(2)  # checkpoint 2 never completes: a prepared orphan
    before.write(clicks(("u1", 3, 3)))  # never prepared: gone with the process
    other.write(clicks(("u9", 1, 1)))
    c_other = other.prepare(2)  # another subtask's pending transaction: not ours to touch
    before.close()
    mine, theirs = f"eosflow:{job}:out:0:", f"eosflow:{job}:out:1:"
    assert prepared(db, job) == [f"{mine}1", f"{mine}2", f"{theirs}2"]

    after = pg_sink.open(context(job, subtask=0, generation=2))
    after.recover([(1, c1)])
    assert visible(db, table) == [("u1", 1, 1)]
    assert prepared(db, job) == [f"{theirs}2"]
    after.write(clicks(("u1", 2, 2)))  # the replayed epoch
    after.commit(2, after.prepare(2))
    other.commit(2, c_other)
    assert visible(db, table) == [("u1", 1, 1), ("u1", 2, 2), ("u9", 1, 1)]
    for w in (after, other):
        w.close()


def test_recover_does_nothing_more_when_called_again_after_crash_during_recovery(
    postgres_dsn: str, db: psycopg.Connection[Any], names: tuple[str, str]
) -> None:
    job, table = names
    pg_sink = sink(postgres_dsn, table)
    before = pg_sink.open(context(job))
    before.write(clicks(("u1", 1, 1)))
    c1 = before.prepare(1)
    before.write(clicks(("u1", 2, 2)))
    c2 = before.prepare(2)
    before.write(clicks(("u1", 3, 3)))
    before.prepare(3)  # orphan
    before.close()

    class Killed(Exception):
        pass

    points: list[str] = []

    def fault(point: str) -> None:
        points.append(point)
        raise Killed(point)

    first = pg_sink.open(context(job, generation=2, fault=fault))
    with pytest.raises(Killed):
        first.recover([(1, c1), (2, c2)])
    first.close()
    assert points == ["mid-sink-recover"]
    assert visible(db, table) == [("u1", 1, 1)]  # 1 committed, 2 and the orphan still prepared
    assert len(prepared(db, job)) == 2

    second = pg_sink.open(context(job, generation=3))
    second.recover([(1, c1), (2, c2)])
    assert visible(db, table) == [("u1", 1, 1), ("u1", 2, 2)]
    assert prepared(db, job) == []
    second.close()


def test_commit_raises_clear_error_when_prepared_transaction_was_rolled_back_by_someone_else(
    postgres_dsn: str, db: psycopg.Connection[Any], names: tuple[str, str]
) -> None:
    job, table = names
    writer = sink(postgres_dsn, table).open(context(job))
    writer.write(clicks(("u1", 1, 1)))
    committable = writer.prepare(4)
    assert committable is not None
    db.execute(
        psycopg.sql.SQL("ROLLBACK PREPARED {}").format(psycopg.sql.Literal(committable["gid"]))
    )
    with pytest.raises(SnapshotError, match="output of checkpoint 4 is missing") as info:
        writer.commit(4, committable)
    assert info.value.reason == "missing"
    assert committable["gid"] in str(info.value)
    writer.close()


def test_commit_raises_when_committable_is_not_this_writers(
    postgres_dsn: str, names: tuple[str, str]
) -> None:
    job, table = names
    pg_sink = sink(postgres_dsn, table)
    writer = pg_sink.open(context(job, subtask=0))
    foreign = {"gid": global_id(job, "out", 1, 1), "txn": "x", "covers": [1]}
    for committable in (["gid"], {"gid": global_id(job, "out", 0, 1)}, foreign):
        with pytest.raises(SnapshotError, match="not one of this writer's") as info:
            writer.commit(1, committable)
        assert info.value.reason == "corrupt"
    writer.close()


def test_markers_older_than_keep_markers_checkpoints_are_deleted(
    postgres_dsn: str, db: psycopg.Connection[Any], names: tuple[str, str]
) -> None:
    job, table = names
    writer = sink(postgres_dsn, table, keep_markers=2).open(context(job))
    for chk in range(1, 6):
        writer.write(clicks(("u1", chk, chk)))
        writer.commit(chk, writer.prepare(chk))
    assert markers(db, job) == [3, 4, 5]
    writer.close()


def test_long_job_and_step_names_give_a_global_id_postgres_accepts(
    postgres_dsn: str, db: psycopg.Connection[Any], names: tuple[str, str]
) -> None:
    job, table = names
    long_job = job + "-" + "x" * 190
    writer = PostgresSinkWriter(sink(postgres_dsn, table), context(long_job))
    writer.write(clicks(("u1", 1, 1)))
    committable = writer.prepare(9_999_999_999)
    assert committable is not None
    assert len(committable["gid"].encode()) <= 199
    writer.commit(9_999_999_999, committable)
    assert visible(db, table) == [("u1", 1, 1)]
    writer.recover([])
    writer.close()


# -- failures ------------------------------------------------------------------------------------


def test_write_fails_with_clear_error_when_a_row_lock_stays_taken(
    postgres_dsn: str, db: psycopg.Connection[Any], names: tuple[str, str]
) -> None:
    job, table = names
    pg_sink = sink(postgres_dsn, table, mode="upsert", lock_timeout=timedelta(milliseconds=300))
    writer = pg_sink.open(context(job))
    writer.write(clicks(("u1", 1, 1)))
    writer.commit(1, writer.prepare(1))
    with psycopg.connect(postgres_dsn) as holder:  # a session that sits on u1's row
        holder.execute(
            psycopg.sql.SQL("SELECT 1 FROM {} WHERE user_id = 'u1' FOR UPDATE").format(
                psycopg.sql.Identifier(table)
            )
        )
        writer.write(clicks(("u1", 2, 2)))
        with pytest.raises(EosflowError, match=r"lock_timeout=0.3s") as info:
            writer.prepare(2)
        assert "pg_prepared_xacts" in str(info.value)
        assert "step='out'" in str(info.value)
        holder.rollback()
    assert prepared(db, job) == []
    writer.close()


def test_database_refusal_of_a_value_is_a_serialization_error_naming_the_table(
    postgres_dsn: str, db: psycopg.Connection[Any], names: tuple[str, str]
) -> None:
    job, table = names
    writer = sink(postgres_dsn, table).open(context(job))
    writer.write([("u1", ("not a number", 1))])
    with pytest.raises(SerializationError, match=rf"table='{table}'.*refused a row"):
        writer.prepare(1)
    assert prepared(db, job) == []
    writer.close()


def test_write_raises_and_buffers_nothing_when_a_value_is_not_a_row(
    postgres_dsn: str, db: psycopg.Connection[Any], names: tuple[str, str]
) -> None:
    job, table = names
    pg_sink = PostgresSink(table, COLUMNS, dsn=postgres_dsn, row=lambda v: v)
    writer = pg_sink.open(context(job))
    writer.write([("u1", 1, 1), {"user_id": "u2", "clicks": 1, "amount": 2, "extra": 0}])
    for bad, why in ((("u3", 1), "2 fields for 3 columns"), ({"user_id": "u3"}, "no \\['clicks'")):
        with pytest.raises(SerializationError, match=why):
            writer.write([("u4", 1, 1), bad])
    with pytest.raises(SerializationError, match="row function raised ZeroDivisionError"):
        PostgresSink(table, COLUMNS, dsn=postgres_dsn, row=lambda v: 1 / 0).open(
            context(job, subtask=1)
        ).write([1])
    writer.commit(1, writer.prepare(1))
    assert visible(db, table) == [("u1", 1, 1), ("u2", 1, 2)]
    writer.close()


# -- start-up checks -----------------------------------------------------------------------------


def test_preflight_creates_tables_when_columns_have_types(
    postgres_dsn: str, db: psycopg.Connection[Any], names: tuple[str, str]
) -> None:
    job, table = names
    preflight_sink(sink(postgres_dsn, table, mode="upsert"), job=job, checkpoint_interval=1.0)
    key = db.execute(
        "SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid "
        "AND a.attnum = ANY(i.indkey) WHERE i.indrelid = %s::regclass AND i.indisprimary",
        [table],
    ).fetchall()
    assert key == [("user_id",)]
    assert db.execute("SELECT to_regclass(%s) IS NOT NULL", [COMMITS_TABLE]).fetchone() == (True,)


def test_preflight_refuses_missing_table_and_upsert_without_unique_key(
    postgres_dsn: str, db: psycopg.Connection[Any], names: tuple[str, str]
) -> None:
    job, table = names
    named = PostgresSink(table, list(COLUMNS), dsn=postgres_dsn, mode="upsert", key=["user_id"])
    with pytest.raises(ConfigError, match=rf"table '{table}' does not exist"):
        named.preflight(job=job, checkpoint_interval=1.0)
    db.execute(f"CREATE TABLE {table} (user_id text, clicks bigint, amount bigint)")
    with pytest.raises(ConfigError, match=r"needs a primary key or unique constraint.*ADD PRIMARY"):
        named.preflight(job=job, checkpoint_interval=1.0)
    db.execute(f"ALTER TABLE {table} ADD UNIQUE (user_id)")
    named.preflight(job=job, checkpoint_interval=1.0)
    extra = PostgresSink(table, [*COLUMNS, "page"], dsn=postgres_dsn)
    with pytest.raises(ConfigError, match=r"has no column\(s\) \['page'\]"):
        extra.preflight(job=job, checkpoint_interval=1.0)


def test_preflight_refuses_unreachable_database_with_where_it_tried(names: tuple[str, str]) -> None:
    job, table = names
    dsn = f"postgresql://postgres:secret@127.0.0.1:{free_port()}/nowhere"
    with pytest.raises(ConfigError, match=r"could not connect to 127\.0\.0\.1:\d+/nowhere") as info:
        sink(dsn, table).preflight(job=job, checkpoint_interval=1.0)
    assert "secret" not in str(info.value)


@pytest.fixture(scope="module")
def postgres_without_prepared_transactions() -> Iterator[str]:
    """A second embedded server started with max_prepared_transactions=0."""
    bindir = Path(find_binary("postgres")).parent
    # Not under pytest's tmp_path: its 0700 root-owned parents would keep the postgres account out.
    workdir = Path(tempfile.mkdtemp(prefix="eosflow-pg-no-2pc-"))
    datadir = workdir / "pgdata"
    datadir.mkdir(mode=0o700)
    uid = gid = None
    if os.geteuid() == 0:  # PostgreSQL refuses to run as root
        account = pwd.getpwnam(os.environ.get("EOSFLOW_PG_USER", "postgres"))
        uid, gid = account.pw_uid, account.pw_gid
        os.chmod(workdir, 0o755)
        for path in (workdir, datadir):
            os.chown(path, uid, gid)

    def as_owner() -> None:
        if uid is not None and gid is not None:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)

    subprocess.run(
        [str(bindir / "initdb"), "-D", str(datadir), "-U", "postgres", "-A", "trust",
         "--no-sync", "--locale=C", "-E", "UTF8"],
        check=True, capture_output=True, preexec_fn=as_owner, cwd=workdir,
    )  # fmt: skip
    port = free_port()
    proc = spawn(
        "postgres",
        [str(bindir / "postgres"), "-D", str(datadir), "-p", str(port),
         "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={workdir}",
         "-c", "max_prepared_transactions=0", "-c", "fsync=off"],
        log_path=workdir / "postgres.log", owned=True, cwd=workdir, uid=uid, gid=gid,
    )  # fmt: skip
    dsn = f"postgresql://postgres@127.0.0.1:{port}/postgres"

    def accepting() -> bool:
        try:
            psycopg.connect(dsn, connect_timeout=2).close()
        except psycopg.OperationalError:
            return False
        return True

    try:
        wait_until(proc, accepting, timeout=30, what="accept connections")
        yield dsn
    finally:
        stop(proc)
        shutil.rmtree(workdir, ignore_errors=True)


def test_preflight_refuses_server_without_prepared_transactions_and_says_how_to_fix_it(
    postgres_without_prepared_transactions: str, names: tuple[str, str]
) -> None:
    job, table = names
    pg_sink = sink(postgres_without_prepared_transactions, table)
    with pytest.raises(ConfigError, match="max_prepared_transactions = 0") as info:
        preflight_sink(pg_sink, job=job, checkpoint_interval=1.0)
    assert "postgresql.conf and restart PostgreSQL" in str(info.value)
    with pytest.raises(ConfigError, match="max_prepared_transactions = 0"):
        pg_sink.open(context(job))  # a writer opened without the runner's preflight refuses too


_KILLED_WORKER = """
import json, os, signal, sys
import sinks.postgres as pg
from processor.contracts import SinkContext

dsn, table, job = sys.argv[1:4]
real = pg.prepared._sql_with_literal

def killing(template, value):
    if template.startswith("PREPARE") and value.endswith(":3"):
        os.kill(os.getpid(), signal.SIGKILL)  # inside epoch 3's transaction, before PREPARE
    return real(template, value)

pg.prepared._sql_with_literal = killing
columns = {"user_id": "text", "clicks": "bigint", "amount": "bigint"}
writer = pg.PostgresSink(table, columns, dsn=dsn).open(SinkContext(job, "out", 0, 1, 1))
writer.recover([])
committables = {}
for chk in (1, 2, 3):
    writer.write([(f"u{chk}", chk, chk)])
    committables[chk] = writer.prepare(chk)
    print(json.dumps(committables[chk]), flush=True)
"""


def test_prepared_transactions_survive_a_sigkilled_worker_and_recover_settles_them(
    postgres_dsn: str, db: psycopg.Connection[Any], names: tuple[str, str]
) -> None:
    """Checkpoint 1 completed, 2 did not, 3 was being written when SIGKILL came."""
    job, table = names
    child = subprocess.run(
        [sys.executable, "-c", _KILLED_WORKER, postgres_dsn, table, job],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    c1, _c2 = (json.loads(line) for line in child.stdout.splitlines())
    deadline = time.monotonic() + 10
    while db.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
        [f"eosflow {job} out/0"],
    ).fetchone() != (0,):  # the server ends the dead worker's session, and its transaction
        assert time.monotonic() < deadline, "the killed worker's session stayed open"
        time.sleep(0.05)
    assert prepared(db, job) == [f"eosflow:{job}:out:0:1", f"eosflow:{job}:out:0:2"]
    assert visible(db, table) == []

    writer = sink(postgres_dsn, table).open(context(job, generation=2))
    writer.recover([(1, c1)])
    assert prepared(db, job) == []
    assert visible(db, table) == [("u1", 1, 1)]
    writer.close()


def test_commit_prepared_returns_within_commit_timeout_when_the_server_waits_for_a_standby(
    postgres_dsn: str, db: psycopg.Connection[Any], names: tuple[str, str]
) -> None:
    """Issue 48 item 5: ``COMMIT PREPARED`` had no deadline. A server that waits for a
    synchronous standby that never answers (``synchronous_standby_names`` naming none that
    runs; the writer's session set to ``synchronous_commit=on`` for it) held the commit, and a
    stop, for ever. With ``commit_timeout`` the server cancels the wait: the commit is done
    locally (PostgreSQL says so in a warning) and the writer goes on."""
    job, table = names
    db.execute("ALTER SYSTEM SET synchronous_standby_names = 'eosflow_absent_standby'")
    db.execute("SELECT pg_reload_conf()")
    try:
        time.sleep(0.5)  # the reload reaches the backends
        writer = sink(postgres_dsn, table, commit_timeout=timedelta(seconds=1)).open(context(job))
        writer.write(clicks(("u1", 1, 10)))
        committable = writer.prepare(1)
        # only the COMMIT PREPARED waits for the standby (the server's default is off)
        writer._db.conn.execute("SET synchronous_commit = on")
        started = time.monotonic()
        committing = threading.Thread(target=writer.commit, args=(1, committable), daemon=True)
        committing.start()
        committing.join(60)  # without the deadline: still waiting (the reset below frees it)
        took = time.monotonic() - started
        assert not committing.is_alive(), "COMMIT PREPARED still waits after 60 s"
        writer.close()
    finally:
        db.execute("ALTER SYSTEM RESET synchronous_standby_names")
        db.execute("SELECT pg_reload_conf()")
    print(f"COMMIT PREPARED returned after {took:.1f}s")
    assert visible(db, table) == [("u1", 1, 10)]
    assert prepared(db, job) == []
