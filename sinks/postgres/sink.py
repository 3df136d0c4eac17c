"""The PostgreSQL sink's configuration and its start-up checks: prepared transactions are
enabled, and the table and the markers' table exist (created on request) and fit the sink."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from processor.contracts import SinkContext
from processor.errors import ConfigError
from sinks.postgres.prepared import (
    _COMMITS_DDL,
    COMMITS_TABLE,
    _gid_prefix,
    _psycopg,
    _sql_with_literal,
)
from sinks.postgres.writer import PostgresSinkWriter

if TYPE_CHECKING:
    import psycopg
    from psycopg import sql

__all__ = ["DSN_ENV", "PostgresSink"]

log = logging.getLogger(__name__)

#: Environment variable holding the DSN when ``PostgresSink(dsn=None)``.
DSN_ENV = "EOSFLOW_POSTGRES_DSN"
_MODES = ("append", "upsert")


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
        commit_timeout: the statement timeout of ``COMMIT PREPARED`` / ``ROLLBACK PREPARED``
            (a server that does not finish one, e.g. waiting for a synchronous standby, fails
            the writer instead of holding it, and a stop, for ever; the recovery commits the
            transaction again). Keep it under ``--stop-timeout`` (120 s by default).

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
        commit_timeout: timedelta = timedelta(seconds=30),
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
        if not isinstance(commit_timeout, timedelta) or commit_timeout <= timedelta(0):
            raise ConfigError(
                f"PostgresSink commit_timeout must be a positive timedelta, got {commit_timeout!r}"
            )
        if isinstance(keep_markers, bool) or not isinstance(keep_markers, int) or keep_markers < 1:
            raise ConfigError(f"PostgresSink keep_markers must be >= 1, got {keep_markers!r}")
        self.dsn = dsn
        self.mode = mode
        self.row = row
        self.lock_timeout = lock_timeout
        self.commit_timeout = commit_timeout
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

    def recorded_commits(self, job: str, step: str, subtasks: int = 1) -> list[str]:
        """What ``eosflow reset`` clears here: the job's prepared transactions of ``step``
        (subtasks ``0..subtasks-1``: they hold row locks, and a new run's checkpoint ids would
        meet their global ids) and its marker rows, said in lines; ``[]`` when none."""
        with self.connect(application_name=f"eosflow {job} reset") as conn:
            gids, markers = self._job_rows(conn, job, step, subtasks)
        name = ".".join(self.table)
        found = [f"PostgreSQL {name}: prepared transaction {gid} (rolled back)" for gid in gids]
        if markers:
            found.append(
                f"PostgreSQL {'.'.join(self.commits_table)}: {markers} marker rows of step {step!r}"
            )
        return found

    def forget_commits(self, job: str, step: str, subtasks: int = 1) -> list[str]:
        """``eosflow reset``: rolls back the job's prepared transactions of ``step`` and deletes
        its marker rows; returns what it cleared (:meth:`recorded_commits`)."""
        from psycopg import sql

        found = self.recorded_commits(job, step, subtasks)
        with self.connect(application_name=f"eosflow {job} reset") as conn:
            conn.autocommit = True
            gids, markers = self._job_rows(conn, job, step, subtasks)
            for gid in gids:
                with contextlib.suppress(_psycopg().errors.UndefinedObject):  # finished meanwhile
                    conn.execute(_sql_with_literal("ROLLBACK PREPARED {}", gid))
            if markers:
                conn.execute(
                    sql.SQL("DELETE FROM {} WHERE job = %s AND step = %s").format(
                        sql.Identifier(*self.commits_table)
                    ),
                    [job, step],
                )
        return found

    def _job_rows(
        self, conn: psycopg.Connection[Any], job: str, step: str, subtasks: int
    ) -> tuple[list[str], int]:
        """The job's prepared global ids of ``step`` and the count of its marker rows."""
        from psycopg import sql

        gids: list[str] = []
        for subtask in range(subtasks):
            gids += [
                str(gid)
                for (gid,) in conn.execute(
                    "SELECT gid FROM pg_prepared_xacts WHERE database = current_database() "
                    "AND starts_with(gid, %s) ORDER BY gid",
                    [_gid_prefix(job, step, subtask)],
                ).fetchall()
            ]
        commits = ".".join(self.commits_table)
        (exists,) = conn.execute("SELECT to_regclass(%s) IS NOT NULL", [commits]).fetchone() or (
            False,
        )
        markers = 0
        if exists:
            row = conn.execute(
                sql.SQL("SELECT count(*) FROM {} WHERE job = %s AND step = %s").format(
                    sql.Identifier(*self.commits_table)
                ),
                [job, step],
            ).fetchone()
            markers = int(row[0]) if row else 0
        return gids, markers

    def open(self, ctx: SinkContext) -> PostgresSinkWriter:
        """A writer for subtask ``ctx.subtask``: connects, checks the server and the tables."""
        return PostgresSinkWriter(self, ctx)
