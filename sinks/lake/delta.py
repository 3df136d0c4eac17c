"""Delta Lake sink on delta-rs (``deltalake``): :class:`DeltaSink` (docs/sink-lakehouse.md).

Data files are Parquet written by pyarrow at the barrier, with Hive-style partition directories;
the commit on checkpoint completion adds them with one ``create_write_transaction`` whose
``CommitProperties`` carry the application transaction ``txn(appId="eosflow:<job>:<step>",
version=<checkpoint>)``. Delta's own idempotency mechanism then decides: the committer reads
``transaction_version(appId)`` on the table version it commits against, and delta-rs refuses a
concurrent commit of the same ``appId`` (conflict), so an epoch is never added twice.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import logging
import os
import time
import urllib.parse
import uuid
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from processor.contracts import SinkContext
from processor.errors import ConfigError
from sinks.lake.records import check_schema
from sinks.lake.writer import (
    LOCAL_RECOVERY_UNSUPPORTED,
    CommitConflict,
    LakeWriter,
    forget_commits,
    recorded_commits,
)

__all__ = ["DeltaSink", "read_delta"]

log = logging.getLogger(__name__)

_NULL_DIR = "__HIVE_DEFAULT_PARTITION__"  # a null partition value's directory (Hive's)


def _deltalake() -> Any:
    try:
        import deltalake
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError(
            "DeltaSink needs the deltalake package: pip install 'eosflow[delta]'"
        ) from exc
    return deltalake


def _fsspec_options(storage_options: dict[str, str]) -> dict[str, Any]:
    """delta-rs's object-store keys (AWS_*) as s3fs options, so the data files go where
    delta-rs looks."""
    opts = {k.upper(): v for k, v in storage_options.items()}
    out: dict[str, Any] = {}
    if "AWS_ACCESS_KEY_ID" in opts:
        out["key"] = opts["AWS_ACCESS_KEY_ID"]
    if "AWS_SECRET_ACCESS_KEY" in opts:
        out["secret"] = opts["AWS_SECRET_ACCESS_KEY"]
    if "AWS_SESSION_TOKEN" in opts:
        out["token"] = opts["AWS_SESSION_TOKEN"]
    endpoint = opts.get("AWS_ENDPOINT_URL") or opts.get("AWS_ENDPOINT")
    if endpoint:
        out["endpoint_url"] = endpoint
    if "AWS_REGION" in opts:
        out["client_kwargs"] = {"region_name": opts["AWS_REGION"]}
    return out


def _partition_value(value: Any) -> str | None:
    """A partition value as the Delta protocol serializes it ("Partition Value Serialization")."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, datetime.datetime):
        moment: datetime.datetime = value
        if moment.tzinfo is not None:
            moment = moment.astimezone(datetime.timezone.utc).replace(tzinfo=None)
        return moment.strftime("%Y-%m-%d %H:%M:%S.%f")
    if isinstance(value, datetime.date):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.decode("latin-1")
    return f"{value}"


class DeltaSink:
    """Appends every value, as one row, to a Delta table, exactly once.

    Args:
        uri: the table's location: a local path, ``file://``, or ``s3://bucket/path``.
        schema: the rows' ``pyarrow.Schema``. ``None``: the existing table's, or (new table)
            inferred from the first batch and then kept. The table is created if missing; an
            existing table's schema is never changed: a given schema must equal it.
        partition_by: partition columns of a new table (e.g. ``["day"]``, a column the
            ``to_record`` function fills from the event time). An existing table keeps its own.
        to_record: value -> dict of column values (needed on keyed streams, whose values are
            ``(key, value)`` tuples).
        storage_options: delta-rs object-store options (``AWS_ENDPOINT_URL``,
            ``AWS_ACCESS_KEY_ID``, ``AWS_ALLOW_HTTP``...); also used to write the data files.
        compact_every: run delta-rs ``optimize.compact()`` after every this many committed
            checkpoints (on the committer); ``None``: never (see docs/sink-lakehouse.md).

    A value that does not fit the schema goes to the dataflow's dead letters with the cause.
    """

    #: ``--recovery local`` is refused at start-up with this reason (docs/sink-lakehouse.md).
    local_recovery_unsupported = LOCAL_RECOVERY_UNSUPPORTED

    def __init__(
        self,
        uri: str | os.PathLike[str],
        *,
        schema: pa.Schema | None = None,
        partition_by: list[str] | None = None,
        to_record: Callable[[Any], Any] | None = None,
        storage_options: dict[str, str] | None = None,
        compact_every: int | None = None,
    ) -> None:
        if schema is not None and not isinstance(schema, pa.Schema):
            raise ConfigError(f"DeltaSink schema must be a pyarrow.Schema, got {schema!r}")
        if to_record is not None and not callable(to_record):
            raise ConfigError("DeltaSink to_record must be a function value -> dict")
        if compact_every is not None and compact_every < 1:
            raise ConfigError(f"DeltaSink compact_every={compact_every!r}: expected >= 1 or None")
        self.uri = os.fspath(uri)
        if "://" not in self.uri:
            self.uri = os.path.abspath(self.uri)
        self.schema = schema
        self.partition_by = list(partition_by or [])
        if schema is not None:
            missing = [c for c in self.partition_by if c not in schema.names]
            if missing:
                raise ConfigError(f"DeltaSink partition_by {missing} are not columns of {schema}")
        self.to_record = to_record
        self.storage_options = dict(storage_options or {})
        self.compact_every = compact_every

    def __repr__(self) -> str:
        return f"DeltaSink({self.uri!r})"

    def preflight(self, *, job: str, checkpoint_interval: float | None) -> None:
        """Creates the table (given a schema) or checks the given schema against it, before
        any worker starts.

        Raises:
            ConfigError: the table's schema differs from the given one.
        """
        _deltalake()
        ops = _DeltaTable(self, SinkContext(job, "preflight", 0, 1, 0))
        current = ops.table_schema()
        if current is None and self.schema is not None:
            ops.create(self.schema)

    def open(self, ctx: SinkContext) -> LakeWriter:
        """A writer for subtask ``ctx.subtask``."""
        return LakeWriter(_DeltaTable(self, ctx), ctx, schema=self.schema, to_record=self.to_record)

    def recorded_commits(self, job: str, step: str, subtasks: int = 1) -> list[str]:
        """What ``eosflow reset`` clears here (:func:`~sinks.lake.writer.recorded_commits`;
        one record per step, whatever the ``subtasks``)."""
        return recorded_commits(_DeltaTable(self, SinkContext(job, step, 0, 1, 0)))

    def forget_commits(self, job: str, step: str, subtasks: int = 1) -> list[str]:
        """``eosflow reset``: the table forgets the job's commits of ``step`` (rows stay)."""
        return forget_commits(_DeltaTable(self, SinkContext(job, step, 0, 1, 0)))

    def certify_redirect(self, rewrite: Any, step: str) -> DeltaSink:
        """``eosflow certify``: a copy writing a table of the run's own, under the run's
        outputs directory (local, removed with certify's work directory)."""
        out = copy.copy(self)
        out.uri = os.path.abspath(os.path.join(rewrite.outputs, step, "delta"))
        out.storage_options = {}
        return out

    def read_output(self) -> list[dict[str, Any]]:
        """The committed rows (``eosflow certify``, ``processor.testing.read_output``)."""
        return list(read_delta(self.uri, storage_options=self.storage_options).to_pylist())


class _DeltaTable:
    """The Delta side of :class:`~sinks.lake.writer.LakeWriter` for one writer."""

    def __init__(self, sink: DeltaSink, ctx: SinkContext) -> None:
        import fsspec

        self.dl = _deltalake()
        self.sink = sink
        self.ctx = ctx
        self.uri = sink.uri
        self.describe = f"Delta table {sink.uri}"
        self.app_id = f"eosflow:{ctx.job}:{ctx.step}"
        self.forget_hint = (
            f"reset the job with its pipeline ('eosflow reset {ctx.job} --pipeline FILE' "
            f"sets the table's application transaction {self.app_id!r} back to 0; the rows "
            "stay)"
        )
        self.fs, self.root = fsspec.core.url_to_fs(
            self.uri, **_fsspec_options(sink.storage_options)
        )
        self._table: Any = None
        self._partitions: list[str] | None = None  # the table's, once loaded or created
        self._commits = 0

    def _load(self) -> Any:
        try:
            return self.dl.DeltaTable(self.uri, storage_options=self.sink.storage_options or None)
        except self.dl.exceptions.TableNotFoundError:
            return None

    def _arrow_schema(self, table: Any) -> pa.Schema:
        return pa.schema(table.schema().to_arrow())

    def table_schema(self) -> pa.Schema | None:
        table = self._load()
        if table is None:
            return None
        schema = self._arrow_schema(table)
        if self.sink.schema is not None:
            try:
                check_schema(schema, self.sink.schema, where=self.describe)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        self._partitions = list(table.metadata().partition_columns)
        return schema

    def create(self, schema: pa.Schema) -> pa.Schema:
        try:
            table = self.dl.DeltaTable.create(
                self.uri,
                schema,
                mode="ignore",
                partition_by=self.sink.partition_by or None,
                storage_options=self.sink.storage_options or None,
            )
        except self.dl.exceptions.DeltaError as exc:
            # Two writers creating the table at once: the loser finds the winner's table.
            table = self._load()
            if table is None:
                raise ConfigError(f"{self.describe}: cannot create the table: {exc}") from exc
        self._partitions = list(table.metadata().partition_columns)
        return self._arrow_schema(table)

    # -- data files ------------------------------------------------------------------------------

    def write_files(self, data: pa.Table, prefix: str) -> list[Any]:
        if self._partitions is None:
            self.table_schema()
        parts = self._partitions
        if not parts:
            return [self._write_one(data, {}, prefix)]
        keys = data.select(parts).group_by(parts).aggregate([]).to_pylist()
        files = []
        for i, key in enumerate(keys):
            mask = None
            for col, value in key.items():
                cond = pc.is_null(data[col]) if value is None else pc.equal(data[col], value)
                mask = cond if mask is None else pc.and_(mask, cond)
            part = data.filter(mask).drop_columns(parts)
            values = {col: _partition_value(v) for col, v in key.items()}
            files.append(self._write_one(part, values, f"{prefix}-{i}"))
        return files

    def _write_one(self, data: pa.Table, values: dict[str, str | None], prefix: str) -> Any:
        dirs = "".join(
            f"{col}={urllib.parse.quote(v if v is not None else _NULL_DIR, safe='')}/"
            for col, v in values.items()
        )
        rel = f"{dirs}part-{prefix}-{uuid.uuid4().hex}.parquet"
        path = f"{self.root.rstrip('/')}/{rel}"
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        with self.fs.open(path, "wb") as f:
            pq.write_table(data, f, compression="snappy")
            size = f.tell()  # the file's size, without asking the store again
        null_count: dict[str, int] = {}
        for c, name in enumerate(data.column_names):
            if pa.types.is_nested(data.schema.field(name).type):
                continue
            null_count[name] = int(data.column(c).null_count)
        stats = {"numRecords": data.num_rows, "nullCount": null_count}
        return {
            # The log's path is a URI (Delta protocol, "Add File"): the file's name, escaped.
            "path": urllib.parse.quote(rel, safe="/="),
            "size": size,
            "partition_values": values,
            "modification_time": int(time.time() * 1000),
            "stats": stats,
        }

    def delete_files(self, files: list[Any]) -> None:
        for f in files:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(f"{self.root.rstrip('/')}/{urllib.parse.unquote(f['path'])}")

    # -- commits ---------------------------------------------------------------------------------

    def last_committed(self) -> int:
        self._table = self._load()
        if self._table is None:
            return 0
        version = self._table.transaction_version(self.app_id)
        return int(version) if version is not None else 0

    def forget(self) -> None:
        """An empty commit that sets the application transaction back to 0 (Delta cannot
        remove one; a version is just the latest the application set)."""
        dl = self.dl
        table = self._load()
        if table is None:
            return
        props = dl.CommitProperties(
            custom_metadata={"eosflow.job": self.ctx.job, "eosflow.step": self.ctx.step,
                             "eosflow.reset": "true"},
            app_transactions=[dl.Transaction(self.app_id, 0)],
        )  # fmt: skip
        table.create_write_transaction(
            [],
            mode="append",
            schema=table.schema(),
            partition_by=list(table.metadata().partition_columns) or None,
            commit_properties=props,
        )

    def commit(self, files: list[Any], checkpoint_id: int) -> None:
        import orjson

        dl = self.dl
        table = self._table
        if table is None:
            raise ConfigError(f"{self.describe}: the table does not exist at commit")
        actions = [
            dl.transaction.AddAction(
                path=f["path"],
                size=f["size"],
                partition_values=f["partition_values"],
                modification_time=f["modification_time"],
                data_change=True,
                stats=orjson.dumps(f["stats"]).decode(),
            )
            for f in files
        ]
        props = dl.CommitProperties(
            custom_metadata={"eosflow.job": self.ctx.job, "eosflow.step": self.ctx.step,
                             "eosflow.checkpoint": checkpoint_id},
            app_transactions=[dl.Transaction(self.app_id, checkpoint_id)],
            # Conflicts come back to the writer: its retry re-checks the txn version first.
            max_commit_retries=0,
        )  # fmt: skip
        try:
            table.create_write_transaction(
                actions,
                mode="append",
                schema=table.schema(),
                partition_by=list(table.metadata().partition_columns) or None,
                commit_properties=props,
            )
        except dl.exceptions.CommitFailedError as exc:
            raise CommitConflict(str(exc)) from exc
        self._commits += 1
        every = self.sink.compact_every
        if every is not None and self._commits % every == 0:
            self._compact()

    def _compact(self) -> None:
        began = time.monotonic()
        try:
            table = self._load()
            metrics = table.optimize.compact()
        except Exception as exc:  # compaction is housekeeping: the data is committed
            log.warning("delta compaction failed table=%s: %s", self.uri, exc)
            return
        log.info(
            "compacted table=%s added=%s removed=%s took_ms=%.0f", self.uri,
            metrics.get("numFilesAdded"), metrics.get("numFilesRemoved"),
            (time.monotonic() - began) * 1000,
        )  # fmt: skip


def read_delta(uri: str, *, storage_options: dict[str, str] | None = None) -> pa.Table:
    """The committed rows of a Delta table (delta-rs's reader)."""
    dl = _deltalake()
    return dl.DeltaTable(uri, storage_options=storage_options or None).to_pyarrow_table()
