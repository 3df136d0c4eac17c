"""PostgreSQL sink: two-phase commit with ``PREPARE TRANSACTION`` (DESIGN.md, "Sinks: two-phase
commit").

One writer per sink subtask, one connection per writer. An epoch's rows are buffered in memory
and written at the barrier, in one transaction that also writes a marker row, and is then
``PREPARE``-d under a global id; ``COMMIT PREPARED`` runs when the checkpoint completes::

    write(values)   rows buffered (upsert mode: the last row per key)
    prepare(n)      BEGIN; COPY / INSERT .. ON CONFLICT; marker row; PREPARE TRANSACTION 'gid'
    commit(n)       COMMIT PREPARED 'gid'   (gone: the marker row says whether it committed)
    recover(p)      commit p's transactions, ROLLBACK PREPARED this writer's other ones

Global ids: ``eosflow:<job>:<step>:<subtask>:<checkpoint_id>`` (job and step hashed if the id
would pass PostgreSQL's 199 bytes). Markers live in ``eosflow_sink_commits`` (one row per
prepared transaction, keyed by job, step, subtask and checkpoint id, holding a random ``txn``
nonce that the committable carries too): a prepared transaction that is no longer in
``pg_prepared_xacts`` committed iff its marker with its nonce is visible.

Prepared transactions keep their row locks until ``COMMIT PREPARED``. Epoch ``n + 1`` may reach
its barrier before checkpoint ``n``'s completion reaches the writer, or after ``n`` aborted; a
write then waits for a lock that only this same thread would release. So before writing, the
writer settles its earlier prepared epochs: it commits those a completed checkpoint covers (the
snapshot store says which), and folds those of aborted checkpoints into the new transaction
(``ROLLBACK PREPARED``, then their rows are written again, with the new epoch's). The
committable lists the checkpoints a transaction covers, so ``commit`` of a folded epoch commits
the transaction that carries it. Anything else that holds a lock (another job, a session, a
second writer of the same key) makes the write fail after ``lock_timeout`` with an error naming
the lock; the worker restarts and recovery settles every prepared transaction of the job.

See docs/sink-postgres.md for the table layout, server settings and the guarantees.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from processor.contracts import SinkContext
from processor.errors import (
    ConfigError,
    DefinitionError,
    EosflowError,
    SerializationError,
    SnapshotError,
)

if TYPE_CHECKING:
    import psycopg
    from psycopg import sql

__all__ = ["COMMITS_TABLE", "DSN_ENV", "PostgresSink", "PostgresSinkWriter", "global_id"]

log = logging.getLogger(__name__)

#: Environment variable holding the DSN when ``PostgresSink(dsn=None)``.
DSN_ENV = "EOSFLOW_POSTGRES_DSN"
#: Default name of the bookkeeping table (one marker row per prepared transaction).
COMMITS_TABLE = "eosflow_sink_commits"
_MODES = ("append", "upsert")
_MAX_GID_BYTES = 199  # PostgreSQL's GIDSIZE (200) minus the terminating NUL
_MAX_CHECKPOINT_ID = 10**10
_PREPARED_OFF = "prepared transactions are disabled"
_PREPARED_FULL = "maximum number of prepared transactions reached"


def _psycopg() -> Any:
    """psycopg 3, imported on first use: the sink's module must import without it."""
    try:
        import psycopg
    except ImportError as exc:
        raise ConfigError(
            "PostgresSink needs psycopg 3, which is not installed: pip install 'eosflow[postgres]'"
        ) from exc
    return psycopg


def global_id(job: str, step: str, subtask: int, checkpoint_id: int) -> str:
    """The prepared transaction's global id, ``eosflow:<job>:<step>:<subtask>:<checkpoint_id>``.

    Job and step are replaced by a BLAKE2b hash of both when the id would not fit PostgreSQL's
    199 bytes (the prefix stays the same for every checkpoint of the writer).
    """
    return f"{_gid_prefix(job, step, subtask)}{checkpoint_id}"


def _gid_prefix(job: str, step: str, subtask: int) -> str:
    prefix = f"eosflow:{job}:{step}:{subtask}:"
    if len(prefix.encode()) + len(str(_MAX_CHECKPOINT_ID)) > _MAX_GID_BYTES:
        digest = hashlib.blake2b(f"{job}\0{step}".encode(), digest_size=12).hexdigest()
        prefix = f"eosflow:h-{digest}:{subtask}:"
    return prefix


def _identifier(name: str, what: str) -> tuple[str, ...]:
    """``"schema.table"`` or ``"table"`` as identifier parts (quoted by psycopg, never
    interpolated)."""
    parts = tuple(name.split(".")) if isinstance(name, str) else ()
    if not 1 <= len(parts) <= 2 or not all(parts):
        raise ConfigError(
            f"PostgresSink {what} {name!r} is not a table name: expected 'table' or "
            "'schema.table' (unquoted; names with dots are not supported)"
        )
    return parts


def _redacted(dsn: str) -> str:
    """Where a DSN points, without its password (for messages and logs)."""
    try:
        from psycopg.conninfo import conninfo_to_dict

        info = conninfo_to_dict(dsn)
    except Exception:
        return "<unparsable DSN>"
    return f"{info.get('host', 'localhost')}:{info.get('port', 5432)}/{info.get('dbname', '')}"


@dataclass(frozen=True)
class _Txn:
    """A prepared transaction: its checkpoint, global id, nonce and the checkpoints whose rows
    it holds (its own last; earlier ones were folded in after their checkpoints aborted)."""

    checkpoint_id: int
    gid: str
    nonce: str
    covers: tuple[int, ...]

    def committable(self) -> dict[str, Any]:
        return {"gid": self.gid, "txn": self.nonce, "covers": list(self.covers)}


class PostgresSink:
    """Writes rows to a PostgreSQL table, exactly once, with two-phase commit.

    Args:
        table: ``"table"`` or ``"schema.table"``.
        columns: the columns a row fills, in order. A mapping ``{column: SQL type}`` also lets
            the sink create the table if it does not exist (with ``PRIMARY KEY (key)`` in upsert
            mode); a sequence of names requires an existing table.
        dsn: libpq connection string or URL; default: ``$EOSFLOW_POSTGRES_DSN``, read when the
            sink is checked or opened (in the workers), never at import.
        mode: ``"append"`` (every value is a new row, written with ``COPY``) or ``"upsert"``
            (``INSERT .. ON CONFLICT (key) DO UPDATE``: the table holds the last row per key).
        key: upsert mode: the columns of the table's primary key or unique constraint. Give
            every key to one subtask (key the stream by it): two writers of one key would
            wait for each other's prepared transactions.
        row: turns a stream value into a row: a tuple in ``columns`` order or a dict by column
            name. Default: the value itself (on a keyed stream, ``(key, value)``).
        commits_table: the bookkeeping table of markers, created if missing.
        lock_timeout: how long an epoch's write waits for a row lock held by another
            transaction before the writer fails (and its worker restarts).
        keep_markers: markers of a writer older than this many checkpoints are deleted (a
            restore never reaches that far back).

    Raises:
        ConfigError: a bad mode, key, column list, row function or timeout.
    """

    def __init__(
        self,
        table: str,
        columns: Sequence[str] | Mapping[str, str],
        *,
        dsn: str | None = None,
        mode: str = "append",
        key: Sequence[str] = (),
        row: Callable[[Any], Sequence[Any] | Mapping[str, Any]] | None = None,
        commits_table: str = COMMITS_TABLE,
        lock_timeout: timedelta = timedelta(seconds=10),
        keep_markers: int = 10_000,
    ) -> None:
        self.table = _identifier(table, "table")
        self.commits_table = _identifier(commits_table, "commits_table")
        if isinstance(columns, str) or not columns:
            raise ConfigError(
                f"PostgresSink columns must be a non-empty list of column names or a mapping "
                f"{{name: SQL type}}, got {columns!r}"
            )
        self.types: dict[str, str] | None = dict(columns) if isinstance(columns, Mapping) else None
        self.columns = tuple(columns)
        if len(set(self.columns)) != len(self.columns) or not all(
            isinstance(c, str) and c for c in self.columns
        ):
            raise ConfigError(f"PostgresSink columns must be distinct names, got {self.columns}")
        if mode not in _MODES:
            raise ConfigError(f"PostgresSink mode {mode!r}: expected one of {_MODES}")
        self.key = (key,) if isinstance(key, str) else tuple(key)
        if mode == "upsert" and not self.key:
            raise ConfigError(
                "PostgresSink mode='upsert' needs key=(<column>, ...): the columns of the "
                "table's primary key or unique constraint"
            )
        if mode == "append" and self.key:
            raise ConfigError("PostgresSink key= is for mode='upsert'; append mode has no key")
        unknown = [k for k in self.key if k not in self.columns]
        if unknown:
            raise ConfigError(f"PostgresSink key columns {unknown} are not in columns")
        if row is not None and not callable(row):
            raise ConfigError(
                f"PostgresSink row must be a function value -> tuple or dict, got "
                f"{type(row).__name__}"
            )
        if not isinstance(lock_timeout, timedelta) or lock_timeout <= timedelta(0):
            raise ConfigError(
                f"PostgresSink lock_timeout must be a positive timedelta, got {lock_timeout!r}"
            )
        if isinstance(keep_markers, bool) or not isinstance(keep_markers, int) or keep_markers < 1:
            raise ConfigError(f"PostgresSink keep_markers must be >= 1, got {keep_markers!r}")
        self.dsn = dsn
        self.mode = mode
        self.row = row
        self.lock_timeout = lock_timeout
        self.keep_markers = keep_markers

    def __repr__(self) -> str:
        return f"PostgresSink({'.'.join(self.table)!r}, mode={self.mode!r})"

    def resolve_dsn(self) -> str:
        """The DSN to connect with: ``dsn=`` or ``$EOSFLOW_POSTGRES_DSN``.

        Raises:
            ConfigError: neither is set.
        """
        dsn = self.dsn or os.environ.get(DSN_ENV)
        if not dsn:
            raise ConfigError(
                f"PostgresSink for table {'.'.join(self.table)!r} has no database: pass "
                f"dsn='postgresql://user@host:5432/db' or set {DSN_ENV}"
            )
        return dsn

    def connect(self, *, application_name: str = "eosflow") -> psycopg.Connection[Any]:
        """An autocommit connection to the sink's database (the writer opens transactions
        itself)."""
        dsn = self.resolve_dsn()
        try:
            conn: psycopg.Connection[Any] = _psycopg().connect(
                dsn, autocommit=True, application_name=application_name, connect_timeout=10
            )
        except _psycopg().OperationalError as exc:
            raise ConfigError(
                f"PostgresSink could not connect to {_redacted(dsn)}: {exc}".rstrip()
            ) from exc
        return conn

    def preflight(self, *, job: str, checkpoint_interval: float | None) -> None:
        """Start-up check, once per job: prepared transactions are enabled, and the tables
        exist (created when ``columns`` gives types).

        Raises:
            ConfigError: no DSN, no connection, ``max_prepared_transactions`` is 0, or the table
                is missing or does not match ``columns`` / ``key``.
        """
        with self.connect(application_name=f"eosflow {job} preflight") as conn:
            self.check_database(conn)
        log.info(
            "preflight ok table=%r mode=%s job=%r checkpoint_interval=%s",
            ".".join(self.table),
            self.mode,
            job,
            checkpoint_interval,
        )

    def check_database(self, conn: psycopg.Connection[Any]) -> None:
        """Refuses a server without prepared transactions; creates or checks the tables."""
        value = conn.execute("SHOW max_prepared_transactions").fetchone()
        if value is None or int(value[0]) == 0:
            raise ConfigError(
                "PostgreSQL has prepared transactions disabled (max_prepared_transactions = 0), "
                "which the PostgresSink's two-phase commit needs: set max_prepared_transactions "
                "to at least 2 x workers x PostgreSQL sink steps (e.g. 64) in postgresql.conf "
                "and restart PostgreSQL"
            )
        from psycopg import sql

        commits = sql.Identifier(*self.commits_table)
        table = sql.Identifier(*self.table)
        missing = conn.execute(
            "SELECT to_regclass(%s) IS NULL, to_regclass(%s) IS NULL",
            [commits.as_string(conn), table.as_string(conn)],
        ).fetchone()
        assert missing is not None
        if missing[0] or (missing[1] and self.types is not None):
            # Workers open at the same moment; CREATE TABLE IF NOT EXISTS alone can still fail
            # with a duplicate pg_type row when two sessions race, so serialize the DDL.
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(hashtext('eosflow-sink-ddl'))")
                conn.execute(sql.SQL(_COMMITS_DDL).format(commits))
                if self.types is not None:
                    conn.execute(self._create_table_sql(table))
        self._check_table(conn, table)

    def _create_table_sql(self, table: sql.Identifier) -> sql.Composed:
        from psycopg import sql

        assert self.types is not None
        parts = [
            sql.SQL("{} {}").format(sql.Identifier(c), sql.SQL(t)) for c, t in self.types.items()
        ]
        if self.key:
            parts.append(
                sql.SQL("PRIMARY KEY ({})").format(
                    sql.SQL(", ").join(map(sql.Identifier, self.key))
                )
            )
        return sql.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(
            table, sql.SQL(", ").join(parts)
        )

    def _check_table(self, conn: psycopg.Connection[Any], table: sql.Identifier) -> None:
        name = ".".join(self.table)
        found = conn.execute(
            "SELECT attname::text FROM pg_attribute WHERE attrelid = to_regclass(%s) "
            "AND attnum > 0 AND NOT attisdropped",
            [table.as_string(conn)],
        ).fetchall()
        if not found:
            raise ConfigError(
                f"PostgresSink table {name!r} does not exist: create it, or give columns as "
                "{name: SQL type} so that the sink creates it"
            )
        missing = [c for c in self.columns if c not in {r[0] for r in found}]
        if missing:
            raise ConfigError(f"PostgresSink table {name!r} has no column(s) {missing}")
        if self.mode == "upsert":
            uniques = conn.execute(
                "SELECT ARRAY(SELECT a.attname::text FROM unnest(i.indkey) AS k(n) "
                "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.n) "
                "FROM pg_index i WHERE i.indrelid = to_regclass(%s) AND i.indisunique "
                "AND i.indpred IS NULL AND i.indexprs IS NULL",
                [table.as_string(conn)],
            ).fetchall()
            if not any(set(cols) == set(self.key) for (cols,) in uniques):
                raise ConfigError(
                    f"PostgresSink upsert into {name!r} needs a primary key or unique constraint "
                    f"on exactly {list(self.key)} (INSERT .. ON CONFLICT needs one); found "
                    f"unique column sets {[list(c) for (c,) in uniques]}. Add it: ALTER TABLE "
                    f"{name} ADD PRIMARY KEY ({', '.join(self.key)})"
                )

    def open(self, ctx: SinkContext) -> PostgresSinkWriter:
        """A writer for subtask ``ctx.subtask``: connects, checks the server and the tables."""
        return PostgresSinkWriter(self, ctx)


_COMMITS_DDL = """CREATE TABLE IF NOT EXISTS {} (
    job text NOT NULL,
    step text NOT NULL,
    subtask integer NOT NULL,
    checkpoint_id bigint NOT NULL,
    gid text NOT NULL,
    txn text NOT NULL,
    target text NOT NULL,
    row_count bigint NOT NULL,
    prepared_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job, step, subtask, checkpoint_id)
)"""


class PostgresSinkWriter:
    """One subtask's writer of a :class:`PostgresSink`.

    Committable of an epoch: ``{"gid": <global id>, "txn": <nonce>, "covers": [<checkpoint
    id>, ...]}`` (``covers`` ends with the epoch's own checkpoint; earlier ids were folded in).

    Invariants:
        Nothing is visible before ``commit``: rows are written only inside a transaction that
        is prepared, never committed, by ``prepare``.
        ``commit`` and ``recover`` are idempotent: a transaction no longer prepared counts as
        committed only if its marker (same checkpoint, same nonce) is visible; otherwise they
        raise ``SnapshotError("missing")`` rather than lose its rows silently.
        A transaction is committed only when a completed checkpoint covers it (the engine's
        ``commit``, or the snapshot store's manifests before an early commit in ``prepare``).
        At most one transaction of this writer is prepared after ``prepare`` returns (given a
        snapshot store in the context, which tells completed from aborted checkpoints).
        ``recover`` rolls back every other prepared transaction with this writer's global-id
        prefix (orphans of checkpoints that never completed).
        ``write`` is all or nothing per call: a value that cannot be turned into a row leaves
        the buffer as it was.
    """

    def __init__(self, sink: PostgresSink, ctx: SinkContext) -> None:
        from psycopg import sql

        self.sink = sink
        self.ctx = ctx
        self.prefix = _gid_prefix(ctx.job, ctx.step, ctx.subtask)
        self._append: list[tuple[Any, ...]] = []
        self._upsert: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        self._prepared: dict[int, tuple[_Txn, list[tuple[Any, ...]]]] = {}
        self._absorbed_by: dict[int, _Txn] = {}
        self._done: set[int] = set()
        self._key_idx = tuple(sink.columns.index(k) for k in sink.key)
        self._store: Any = None
        table, cols = sql.Identifier(*sink.table), [sql.Identifier(c) for c in sink.columns]
        col_list = sql.SQL(", ").join(cols)
        self._copy_sql = sql.SQL("COPY {} ({}) FROM STDIN").format(table, col_list)
        others = [c for c in sink.columns if c not in sink.key]
        action = (
            sql.SQL("DO UPDATE SET {}").format(
                sql.SQL(", ").join(
                    sql.SQL("{0} = EXCLUDED.{0}").format(sql.Identifier(c)) for c in others
                )
            )
            if others
            else sql.SQL("DO NOTHING")
        )
        self._upsert_sql = sql.SQL("INSERT INTO {} ({}) VALUES ({}) ON CONFLICT ({}) {}").format(
            table,
            col_list,
            sql.SQL(", ").join(sql.Placeholder() * len(cols)),
            sql.SQL(", ").join(map(sql.Identifier, sink.key)),
            action,
        )
        commits = sql.Identifier(*sink.commits_table)
        self._marker_sql = sql.SQL(
            "INSERT INTO {} (job, step, subtask, checkpoint_id, gid, txn, target, row_count) "
            "VALUES (%s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (job, step, subtask, "
            "checkpoint_id) DO UPDATE SET gid = EXCLUDED.gid, txn = EXCLUDED.txn, "
            "target = EXCLUDED.target, row_count = EXCLUDED.row_count, prepared_at = now()"
        ).format(commits)
        self._gc_sql = sql.SQL(
            "DELETE FROM {} WHERE job = %s AND step = %s AND subtask = %s AND checkpoint_id < %s"
        ).format(commits)
        self._lookup_sql = sql.SQL(
            "SELECT txn FROM {} WHERE job = %s AND step = %s AND subtask = %s "
            "AND checkpoint_id = %s"
        ).format(commits)
        self.conn = sink.connect(
            application_name=f"eosflow {ctx.job} {ctx.step}/{ctx.subtask}"[:63]
        )
        try:
            sink.check_database(self.conn)
        except BaseException:
            self.conn.close()
            raise

    def __repr__(self) -> str:
        ctx = self.ctx
        table = ".".join(self.sink.table)
        return f"PostgresSinkWriter({table!r}, step={ctx.step!r}, subtask={ctx.subtask})"

    # -- epoch -----------------------------------------------------------------------------------

    def write(self, values: Sequence[Any]) -> None:
        """Buffers ``values`` as rows of the current epoch (upsert: the last row per key).

        Raises:
            SerializationError: a value does not give a row of ``columns`` (nothing of this
                call is buffered).
        """
        rows = [self._row(value) for value in values]
        if self.sink.mode == "append":
            self._append.extend(rows)
        else:
            idx = self._key_idx
            self._upsert.update((tuple(r[i] for i in idx), r) for r in rows)

    def prepare(self, checkpoint_id: int) -> dict[str, Any] | None:
        """Writes the epoch's rows in a transaction and prepares it; returns its committable,
        or ``None`` when the epoch wrote nothing.

        Earlier prepared epochs of this writer are settled first (module docstring): committed
        when a completed checkpoint covers them, folded into this transaction otherwise.

        Raises:
            EosflowError: a row lock stayed taken for ``lock_timeout``.
            SerializationError: the database refused a value (type, range, constraint).
            ConfigError: prepared transactions are disabled or all in use.
        """
        _check_checkpoint_id(checkpoint_id)
        rows = self._append if self.sink.mode == "append" else list(self._upsert.values())
        if not rows:
            return None
        carried, covers = self._settle_earlier(checkpoint_id)
        if carried:
            rows = self._merge(carried, rows)
        txn = _Txn(
            checkpoint_id,
            f"{self.prefix}{checkpoint_id}",
            uuid.uuid4().hex[:16],
            (*covers, checkpoint_id),
        )
        started = time.perf_counter()
        self._write_transaction(txn, rows)
        took_ms = (time.perf_counter() - started) * 1000
        self._prepared[checkpoint_id] = (txn, rows)
        for folded in covers:
            self._absorbed_by[folded] = txn
        self._append, self._upsert = [], {}
        log.info(
            "prepared checkpoint_id=%d step=%r subtask=%d gid=%s rows=%d folded=%s took_ms=%.1f",
            checkpoint_id,
            self.ctx.step,
            self.ctx.subtask,
            txn.gid,
            len(rows),
            list(covers),
            took_ms,
        )
        return txn.committable()

    def commit(self, checkpoint_id: int, committable: Any) -> None:
        """``COMMIT PREPARED`` the epoch's transaction (or the one it was folded into).
        Idempotent; ``None`` is a no-op.

        Raises:
            SnapshotError: ``missing`` when the transaction is neither prepared nor committed
                (someone rolled it back: its rows are lost); ``corrupt`` when ``committable``
                is not one of this writer's.
        """
        if committable is None:
            return
        self._settle(checkpoint_id, self._parse(checkpoint_id, committable))
        # The engine commits in checkpoint order: nothing at or below this id comes again.
        self._done = {c for c in self._done if c > checkpoint_id}
        self._absorbed_by = {c: t for c, t in self._absorbed_by.items() if c > checkpoint_id}

    def recover(self, pending: Sequence[tuple[int, Any]]) -> None:
        """Commits ``pending`` in order, then rolls back this writer's other prepared
        transactions (orphans of checkpoints that never completed). Idempotent.

        Raises:
            SnapshotError: as :meth:`commit`.
        """
        txns = [(c, self._parse(c, x)) for c, x in pending if x is not None]
        for _chk, txn in txns:  # later transactions win: they carry everything folded before
            for folded in txn.covers[:-1]:
                self._absorbed_by[folded] = txn
        for i, (chk, txn) in enumerate(txns):
            self._settle(chk, txn)
            if i == 0:
                self.ctx.fault("mid-sink-recover")
        orphans = self._rows(
            "SELECT gid FROM pg_prepared_xacts WHERE database = current_database() "
            "AND starts_with(gid, %s) ORDER BY gid",
            [self.prefix],
        )
        psycopg = _psycopg()
        rolled_back = 0
        for (gid,) in orphans:
            if not gid[len(self.prefix) :].isdigit():
                continue  # another writer whose prefix merely starts like ours
            try:
                self.conn.execute(_sql_with_literal("ROLLBACK PREPARED {}", gid))
            except psycopg.errors.UndefinedObject:
                continue  # settled by someone else meanwhile
            rolled_back += 1
            log.info(
                "rolled back orphan step=%r subtask=%d gid=%s", self.ctx.step, self.ctx.subtask, gid
            )
        self._prepared.clear()
        self._done.clear()
        self._absorbed_by.clear()
        log.info(
            "recovered step=%r subtask=%d generation=%d pending=%d orphans_rolled_back=%d",
            self.ctx.step,
            self.ctx.subtask,
            self.ctx.generation,
            len(txns),
            rolled_back,
        )

    def close(self) -> None:
        """Closes the connection. Prepared transactions stay for ``recover``; rows buffered
        for an unprepared epoch are dropped (the epoch will be replayed)."""
        self.conn.close()
        self._append, self._upsert = [], {}

    # -- transactions ----------------------------------------------------------------------------

    def _write_transaction(self, txn: _Txn, rows: list[tuple[Any, ...]]) -> None:
        psycopg = _psycopg()
        ctx, conn = self.ctx, self.conn
        timeout_ms = max(1, int(self.sink.lock_timeout.total_seconds() * 1000))
        try:
            conn.execute("BEGIN")
            # Only this transaction waits for locks this long; the session default stays.
            conn.execute("SELECT set_config('lock_timeout', %s, true)", [f"{timeout_ms}ms"])
            with conn.cursor() as cur:
                if self.sink.mode == "append":
                    with cur.copy(self._copy_sql) as copy:
                        for row in rows:
                            copy.write_row(row)
                else:
                    cur.executemany(self._upsert_sql, rows)
                target = ".".join(self.sink.table)
                cur.execute(
                    self._marker_sql,
                    [ctx.job, ctx.step, ctx.subtask, txn.checkpoint_id, txn.gid, txn.nonce,
                     target, len(rows)],
                )  # fmt: skip
                horizon = txn.checkpoint_id - self.sink.keep_markers
                if horizon > 0:
                    cur.execute(self._gc_sql, [ctx.job, ctx.step, ctx.subtask, horizon])
            conn.execute(_sql_with_literal("PREPARE TRANSACTION {}", txn.gid))
        except BaseException as exc:
            if (
                not conn.closed
                and conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE
            ):
                # If this fails too, the server rolls back when the session ends.
                with contextlib.suppress(psycopg.Error):
                    conn.execute("ROLLBACK")
            if isinstance(exc, psycopg.Error):
                raise self._explain(exc, txn, len(rows)) from exc
            raise

    def _explain(self, exc: Any, txn: _Txn, rows: int) -> Exception:
        psycopg = _psycopg()
        ctx = self.ctx
        where = (
            f"PostgreSQL sink step={ctx.step!r} subtask={ctx.subtask} table="
            f"{'.'.join(self.sink.table)!r} checkpoint_id={txn.checkpoint_id} ({rows} rows)"
        )
        message = str(exc).strip()
        if isinstance(exc, psycopg.errors.LockNotAvailable):
            return EosflowError(
                f"{where}: a row lock stayed taken for lock_timeout="
                f"{self.sink.lock_timeout.total_seconds():g}s ({message}). Another transaction "
                "holds rows this epoch writes: a prepared transaction of another job or writer "
                "(see pg_prepared_xacts), a second writer of the same key (key the stream by the "
                "upsert key), or a long session (see pg_locks). The worker restarts and recovery "
                "settles this job's prepared transactions"
            )
        if _PREPARED_OFF in message:
            return ConfigError(
                f"{where}: {message}: set max_prepared_transactions to at least 2 x workers x "
                "PostgreSQL sink steps in postgresql.conf and restart PostgreSQL"
            )
        if _PREPARED_FULL in message:
            return ConfigError(
                f"{where}: {message}: every slot holds a prepared transaction (see "
                "pg_prepared_xacts). Each writer keeps at most one, plus orphans of crashed "
                "workers until recovery: raise max_prepared_transactions (at least 2 x workers "
                "x PostgreSQL sink steps, summed over the jobs sharing the server)"
            )
        if isinstance(exc, psycopg.DataError | psycopg.IntegrityError):
            return SerializationError(
                f"{where}: the database refused a row: {message}. Convert values in the row "
                "function or a map step before the sink"
            )
        return EosflowError(f"{where}: {type(exc).__name__}: {message}")

    def _settle(self, checkpoint_id: int, txn: _Txn, *, early: bool = False) -> None:
        """Makes checkpoint ``checkpoint_id``'s rows committed, through ``txn`` or the later
        transaction it was folded into."""
        if checkpoint_id in self._done:
            return
        holder = self._absorbed_by.get(checkpoint_id, txn)
        ctx = self.ctx
        if self._commit_prepared(holder.gid):
            outcome = "committed early" if early else "committed"
        elif self._marker(holder.checkpoint_id) == holder.nonce:
            outcome = "already committed"
        else:
            raise SnapshotError(
                f"PostgreSQL sink step={ctx.step!r} subtask={ctx.subtask}: the output of "
                f"checkpoint {checkpoint_id} is missing: prepared transaction {holder.gid!r} is "
                f"neither in pg_prepared_xacts nor committed (no marker with txn="
                f"{holder.nonce!r} in {'.'.join(self.sink.commits_table)}). It was rolled back "
                "by someone else, or the sink points at another database than before the "
                "restart; its rows are lost. Committing would hide that: restore the database "
                "or rerun the job from scratch",
                reason="missing",
            )
        self._done.update(holder.covers)
        self._prepared.pop(holder.checkpoint_id, None)
        log.info(
            "%s checkpoint_id=%d step=%r subtask=%d gid=%s",
            outcome,
            checkpoint_id,
            ctx.step,
            ctx.subtask,
            holder.gid,
        )

    def _settle_earlier(self, checkpoint_id: int) -> tuple[list[tuple[Any, ...]], list[int]]:
        """Before epoch ``checkpoint_id`` writes: commit earlier prepared epochs that a
        completed checkpoint covers, fold the others (aborted) into the new transaction.

        Returns the folded rows (oldest first) and the checkpoints they cover.
        """
        carried: list[tuple[Any, ...]] = []
        covers: list[int] = []
        if not self._prepared:
            return carried, covers
        newest = self._newest_completed(below=checkpoint_id)
        if newest is None:  # no snapshot store to ask: rely on lock_timeout
            return carried, covers
        psycopg = _psycopg()
        for earlier in sorted(self._prepared):
            txn, rows = self._prepared[earlier]
            if earlier <= newest:
                # Completed, but its completion has not reached this task yet: commit now
                # (the engine's commit later is a no-op), or this epoch waits for its locks.
                self._settle(earlier, txn, early=True)
                continue
            # Every checkpoint since ``earlier`` aborted (at most one is pending at a time):
            # no restore will ever commit it alone, so its rows move into this transaction.
            with contextlib.suppress(psycopg.errors.UndefinedObject):  # its rows are in memory
                self.conn.execute(_sql_with_literal("ROLLBACK PREPARED {}", txn.gid))
            del self._prepared[earlier]
            carried = self._merge(carried, rows) if carried else rows
            covers.extend(txn.covers)
            log.info(
                "folded aborted checkpoint_id=%d into checkpoint_id=%d step=%r subtask=%d",
                earlier,
                checkpoint_id,
                self.ctx.step,
                self.ctx.subtask,
            )
        return carried, covers

    def _newest_completed(self, *, below: int) -> int | None:
        """The newest completed checkpoint below ``below`` (-1: none), ``None`` if unknown."""
        if self.ctx.snapshot_url is None:
            return None
        if self._store is None:
            from processor.snapshot.store import SnapshotStore

            self._store = SnapshotStore(self.ctx.snapshot_url)
        ids = [c for c in self._store.completed_ids(self.ctx.job) if c < below]
        return ids[-1] if ids else -1

    def _commit_prepared(self, gid: str) -> bool:
        """``COMMIT PREPARED gid``; False if no such prepared transaction exists."""
        try:
            self.conn.execute(_sql_with_literal("COMMIT PREPARED {}", gid))
        except _psycopg().errors.UndefinedObject:
            return False
        return True

    def _marker(self, checkpoint_id: int) -> str | None:
        ctx = self.ctx
        found = self._rows(self._lookup_sql, [ctx.job, ctx.step, ctx.subtask, checkpoint_id])
        return str(found[0][0]) if found else None

    def _rows(self, query: Any, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        return list(self.conn.execute(query, params).fetchall())

    # -- helpers ---------------------------------------------------------------------------------

    def _merge(
        self, older: list[tuple[Any, ...]], newer: list[tuple[Any, ...]]
    ) -> list[tuple[Any, ...]]:
        if self.sink.mode == "append":
            return older + newer
        idx = self._key_idx
        merged = {tuple(r[i] for i in idx): r for r in older}
        merged.update((tuple(r[i] for i in idx), r) for r in newer)
        return list(merged.values())

    def _row(self, value: Any) -> tuple[Any, ...]:
        sink = self.sink
        try:
            row = sink.row(value) if sink.row is not None else value
        except Exception as exc:
            why = f"row function raised {type(exc).__name__}: {exc}"
            raise self._unwritable(value, why) from exc
        if isinstance(row, Mapping):
            missing = [c for c in sink.columns if c not in row]
            if missing:
                raise self._unwritable(value, f"its row has no {missing}")
            return tuple(row[c] for c in sink.columns)
        if not isinstance(row, list | tuple):
            raise self._unwritable(value, f"its row is a {type(row).__name__}, not tuple/dict")
        if len(row) != len(sink.columns):
            raise self._unwritable(
                value, f"its row has {len(row)} fields for {len(sink.columns)} columns"
            )
        return tuple(row)

    def _unwritable(self, value: Any, why: str) -> SerializationError:
        columns = ", ".join(self.sink.columns)
        return SerializationError(
            f"PostgreSQL sink step={self.ctx.step!r} subtask={self.ctx.subtask} could not turn "
            f"a value of type {type(value).__name__} ({value!r:.80}) into a row ({columns}): "
            f"{why}. Give PostgresSink a row= function returning a tuple in column order or a "
            "dict by column name"
        )

    def _parse(self, checkpoint_id: int, committable: Any) -> _Txn:
        c = committable if isinstance(committable, dict) else {}
        gid, nonce, covers = c.get("gid"), c.get("txn"), c.get("covers")
        if (
            not isinstance(gid, str)
            or gid != f"{self.prefix}{checkpoint_id}"
            or not isinstance(nonce, str)
            or not isinstance(covers, list | tuple)
            or not covers
            or covers[-1] != checkpoint_id
            or not all(isinstance(x, int) and x <= checkpoint_id for x in covers)
        ):
            raise SnapshotError(
                f"PostgreSQL sink step={self.ctx.step!r} subtask={self.ctx.subtask}: committable "
                f"{committable!r} of checkpoint {checkpoint_id} is not one of this writer's "
                f"(expected {{'gid': '{self.prefix}{checkpoint_id}', 'txn': <nonce>, 'covers': "
                f"[..., {checkpoint_id}]}}); was the step's sink replaced since the snapshot "
                "was taken?",
                reason="corrupt",
            )
        return _Txn(checkpoint_id, gid, nonce, tuple(covers))


def _sql_with_literal(template: str, value: str) -> sql.Composed:
    # PREPARE / COMMIT PREPARED / ROLLBACK PREPARED take a string literal, not a parameter.
    from psycopg import sql

    return sql.SQL(template).format(sql.Literal(value))


def _check_checkpoint_id(checkpoint_id: int) -> None:
    if isinstance(checkpoint_id, bool) or not isinstance(checkpoint_id, int):
        raise DefinitionError(f"checkpoint id must be an int, got {checkpoint_id!r}")
    if not 0 <= checkpoint_id < _MAX_CHECKPOINT_ID:
        raise DefinitionError(f"checkpoint id {checkpoint_id} is outside [0, 10**10)")
