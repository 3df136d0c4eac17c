"""Prepared transactions of the PostgreSQL sink: global ids, markers and the writer's SQL; and
what the writer reads of the sink's configuration (:class:`PostgresSinkConfig`).

Global ids: ``eosflow:<job>:<step>:<subtask>:<checkpoint_id>`` (job and step hashed if the id
would pass PostgreSQL's 199 bytes). Markers live in ``eosflow_sink_commits`` (one row per
prepared transaction, keyed by job, step, subtask and checkpoint id, holding a random ``txn``
nonce that the committable carries too): a prepared transaction that is no longer in
``pg_prepared_xacts`` committed iff its marker with its nonce is visible.

:class:`_Database` holds a writer's connection and is the only code that runs its SQL: it writes
an epoch's rows with their marker and prepares the transaction, commits and rolls back prepared
transactions by global id, and reads markers.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

from processor.contracts import SinkContext
from processor.errors import ConfigError, DefinitionError, EosflowError, SerializationError

if TYPE_CHECKING:
    import psycopg
    from psycopg import sql

__all__ = ["COMMITS_TABLE", "PostgresSinkConfig", "global_id"]

#: Default name of the bookkeeping table (one marker row per prepared transaction).
COMMITS_TABLE = "eosflow_sink_commits"
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


class PostgresSinkConfig(Protocol):
    """What the writer reads of its :class:`~sinks.postgres.sink.PostgresSink` (which
    implements it; the attributes are documented there). The sink's module opens the writer,
    so the writer knows it by this protocol rather than by importing that module."""

    table: tuple[str, ...]
    commits_table: tuple[str, ...]
    columns: tuple[str, ...]
    key: tuple[str, ...]
    mode: str
    row: Callable[[Any], Sequence[Any] | Mapping[str, Any]] | None
    lock_timeout: timedelta
    commit_timeout: timedelta
    keep_markers: int

    def connect(self, *, application_name: str = "eosflow") -> psycopg.Connection[Any]: ...

    def check_database(self, conn: psycopg.Connection[Any]) -> None: ...


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


class _Database:
    """A writer's connection to the sink's database, and the statements it runs there.

    Connects and checks the server and the tables (:meth:`PostgresSink.check_database`) when
    created; the connection is in autocommit mode and opens its transactions itself.
    """

    def __init__(self, sink: PostgresSinkConfig, ctx: SinkContext) -> None:
        from psycopg import sql

        self.sink = sink
        self.ctx = ctx
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

    def prepare(self, txn: _Txn, rows: list[tuple[Any, ...]]) -> None:
        """Writes ``rows`` and ``txn``'s marker in one transaction and prepares it as ``txn.gid``
        (markers older than ``keep_markers`` checkpoints are deleted in it too).

        Raises:
            EosflowError, SerializationError, ConfigError: as :meth:`_explain` says; the
                transaction is rolled back first.
        """
        psycopg = _psycopg()
        ctx, conn = self.ctx, self.conn
        timeout_ms = max(1, self.sink.lock_timeout // timedelta(milliseconds=1))
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

    def commit_prepared(self, gid: str) -> bool:
        """``COMMIT PREPARED gid``; False if no such prepared transaction exists."""
        return self._finish_prepared("COMMIT PREPARED {}", gid)

    def rollback_prepared(self, gid: str) -> bool:
        """``ROLLBACK PREPARED gid``; False if no such prepared transaction exists."""
        return self._finish_prepared("ROLLBACK PREPARED {}", gid)

    def _finish_prepared(self, template: str, gid: str) -> bool:
        """Runs ``template`` for ``gid`` within the sink's ``commit_timeout`` (a session
        setting: COMMIT PREPARED runs outside a transaction block). A server that waits for a
        synchronous standby cancels the wait then: the transaction is done locally.

        Raises:
            EosflowError: the server did not finish it within ``commit_timeout``.
        """
        timeout_ms = max(1, self.sink.commit_timeout // timedelta(milliseconds=1))
        self.conn.execute("SELECT set_config('statement_timeout', %s, false)", [f"{timeout_ms}ms"])
        try:
            self.conn.execute(_sql_with_literal(template, gid))
        except _psycopg().errors.UndefinedObject:
            return False
        except _psycopg().errors.QueryCanceled as exc:
            raise EosflowError(
                f"PostgresSink {'.'.join(self.sink.table)}: {template.split()[0]} PREPARED "
                f"{gid} did not finish within commit_timeout="
                f"{self.sink.commit_timeout.total_seconds():g}s ({exc}); the recovery finishes "
                "it (see pg_stat_activity)"
            ) from exc
        finally:
            with contextlib.suppress(Exception):
                self.conn.execute("RESET statement_timeout")
        return True

    def marker(self, checkpoint_id: int) -> str | None:
        """The nonce of this writer's marker of ``checkpoint_id``; ``None`` if it has none."""
        ctx = self.ctx
        found = self._rows(self._lookup_sql, [ctx.job, ctx.step, ctx.subtask, checkpoint_id])
        return str(found[0][0]) if found else None

    def prepared_gids(self, prefix: str) -> list[str]:
        """Global ids of this database's prepared transactions that start with ``prefix``."""
        found = self._rows(
            "SELECT gid FROM pg_prepared_xacts WHERE database = current_database() "
            "AND starts_with(gid, %s) ORDER BY gid",
            [prefix],
        )
        return [gid for (gid,) in found]

    def close(self) -> None:
        """Closes the connection; prepared transactions stay on the server."""
        self.conn.close()

    def _rows(self, query: Any, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        return list(self.conn.execute(query, params).fetchall())


def _sql_with_literal(template: str, value: str) -> sql.Composed:
    # PREPARE / COMMIT PREPARED / ROLLBACK PREPARED take a string literal, not a parameter.
    from psycopg import sql

    return sql.SQL(template).format(sql.Literal(value))


def _check_checkpoint_id(checkpoint_id: int) -> None:
    if isinstance(checkpoint_id, bool) or not isinstance(checkpoint_id, int):
        raise DefinitionError(f"checkpoint id must be an int, got {checkpoint_id!r}")
    if not 0 <= checkpoint_id < _MAX_CHECKPOINT_ID:
        raise DefinitionError(f"checkpoint id {checkpoint_id} is outside [0, 10**10)")
