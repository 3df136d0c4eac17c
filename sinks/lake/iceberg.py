"""Apache Iceberg sink on pyiceberg: :class:`IcebergSink` (docs/sink-lakehouse.md).

Data files are written at the barrier by pyiceberg's own writer (``_dataframe_to_data_files``,
what ``Table.append`` uses: field ids, partition split, target file size, the table's Parquet
properties) into the table's location. The commit on checkpoint completion is one transaction:
a ``fast_append`` of every subtask's files, with ``eosflow.job``/``eosflow.step``/
``eosflow.checkpoint`` in the snapshot summary, plus the table property
``eosflow.checkpoint.<job>.<step>`` set to the checkpoint. The committer reads that property
on the metadata it commits against; the catalog's compare-and-swap of the metadata (the SQL
catalog's ``UPDATE .. WHERE metadata_location = <read>``) refuses the commit if anyone committed
in between (``CommitFailedException``), and the retry reads the property again: an epoch lands
once (what Flink's Iceberg committer does with the max committed checkpoint id in the summary).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import uuid
from collections.abc import Callable
from typing import Any

import pyarrow as pa

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

__all__ = ["IcebergSink", "read_iceberg"]

log = logging.getLogger(__name__)

_PROPERTY = "eosflow.checkpoint.{job}.{step}"


def _catalog(name: str, properties: dict[str, str]) -> Any:
    try:
        from pyiceberg.catalog import load_catalog
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError("IcebergSink needs pyiceberg: pip install 'eosflow[iceberg]'") from exc
    uri = properties.get("uri", "")
    if uri.startswith("sqlite:///") and uri != "sqlite:///:memory:":
        # SQLite creates the file, not its directory: a fresh local catalog just works.
        os.makedirs(os.path.dirname(uri[len("sqlite:///") :]) or ".", exist_ok=True)
    return load_catalog(name, **properties)


#: The catalog name IcebergSink used before issue 50. A SQL catalog stores it with each table,
#: so a table it created is invisible to a catalog of another name (pyiceberg's default is
#: ``"default"``, what ``load_catalog()`` and ``SqlCatalog("default", ...)`` give).
_LEGACY_NAME = "eosflow"


def _table_catalog(name: str | None, properties: dict[str, str], table: str) -> Any:
    """The catalog of ``table``: named ``name``, or (``None``) pyiceberg's ``"default"``,
    unless the table exists only under the name eosflow gave it before (then that one, so a
    job that wrote it keeps writing it)."""
    if name is not None:
        return _catalog(name, properties)
    catalog = _catalog("default", properties)
    if properties.get("type") != "sql" or catalog.table_exists(table):
        return catalog  # other catalogs keep no name with their tables
    legacy = _catalog(_LEGACY_NAME, properties)
    if legacy.table_exists(table):
        log.warning(
            "Iceberg table %s was created under the catalog name %r (eosflow before 0.1's "
            "issue 50); writing it there. pyiceberg opens it with SqlCatalog(%r, ...); give "
            "IcebergSink(catalog_name=%r) to say so and silence this",
            table, _LEGACY_NAME, _LEGACY_NAME, _LEGACY_NAME,
        )  # fmt: skip
        return legacy
    return catalog


class IcebergSink:
    """Appends every value, as one row, to an Iceberg table, exactly once.

    Args:
        table: the table's identifier, ``"namespace.name"``.
        catalog: pyiceberg catalog properties, as ``pyiceberg.catalog.load_catalog`` takes them:
            ``{"type": "sql", "uri": "sqlite:////path/catalog.db", "warehouse": "file:///path"}``
            (SQLite or PostgreSQL, no server), ``{"type": "rest", "uri": ...}``. S3 settings
            (``s3.endpoint``, ``s3.access-key-id``...) go here too.
        catalog_name: the catalog's name for pyiceberg. A SQL catalog stores it with each
            table, and sees only its own name's tables. Default: pyiceberg's ``"default"`` (what
            ``load_catalog()`` and ``SqlCatalog("default", ...)`` open), or ``"eosflow"`` for a
            table that exists only under that name (created by eosflow before issue 50).
        schema: the rows' ``pyarrow.Schema``. ``None``: the existing table's, or (new table)
            inferred from the first batch and then kept. An existing table's schema is never
            changed: a given schema must have the table's column names and types.
        partition_by: a new table's partition spec, ``[(source column, transform)]`` with
            Iceberg's transforms: ``"identity"``, ``"year"``, ``"month"``, ``"day"``,
            ``"hour"``, ``"bucket[16]"``, ``"truncate[4]"`` (e.g. ``[("ts", "day")]``).
        to_record: value -> dict of column values (needed on keyed streams).

    No compaction option: pyiceberg 0.12 cannot rewrite data files (docs/sink-lakehouse.md,
    "Small files and compaction", says what to run).

    A value that does not fit the schema goes to the dataflow's dead letters with the cause.
    """

    #: ``--recovery local`` is refused at start-up with this reason (docs/sink-lakehouse.md).
    local_recovery_unsupported = LOCAL_RECOVERY_UNSUPPORTED

    def __init__(
        self,
        table: str,
        *,
        catalog: dict[str, str],
        catalog_name: str | None = None,
        schema: pa.Schema | None = None,
        partition_by: list[tuple[str, str]] | None = None,
        to_record: Callable[[Any], Any] | None = None,
    ) -> None:
        if "." not in table:
            raise ConfigError(f"IcebergSink table {table!r}: expected 'namespace.name'")
        if schema is not None and not isinstance(schema, pa.Schema):
            raise ConfigError(f"IcebergSink schema must be a pyarrow.Schema, got {schema!r}")
        if to_record is not None and not callable(to_record):
            raise ConfigError("IcebergSink to_record must be a function value -> dict")
        self.partition_by = [(str(c), str(t)) for c, t in (partition_by or [])]
        if self.partition_by:
            from pyiceberg.transforms import parse_transform

            for col, transform in self.partition_by:
                try:
                    parse_transform(transform)
                except Exception as exc:
                    raise ConfigError(
                        f"IcebergSink partition_by ({col!r}, {transform!r}): {exc}"
                    ) from None
                if schema is not None and col not in schema.names:
                    raise ConfigError(f"IcebergSink partition_by: {col!r} is not a column")
        self.table = table
        self.catalog = dict(catalog)
        self.catalog_name = catalog_name
        self.schema = schema
        self.to_record = to_record

    def __repr__(self) -> str:
        return f"IcebergSink({self.table!r})"

    def preflight(self, *, job: str, checkpoint_interval: float | None) -> None:
        """Creates the table (given a schema) or checks the given schema against it, before
        any worker starts.

        Raises:
            ConfigError: the catalog cannot be loaded, or the table's schema differs.
        """
        ops = _IcebergTable(self, SinkContext(job, "preflight", 0, 1, 0))
        if ops.table_schema() is None and self.schema is not None:
            ops.create(self.schema)

    def open(self, ctx: SinkContext) -> LakeWriter:
        """A writer for subtask ``ctx.subtask``."""
        return LakeWriter(
            _IcebergTable(self, ctx), ctx, schema=self.schema, to_record=self.to_record
        )

    def recorded_commits(self, job: str, step: str, subtasks: int = 1) -> list[str]:
        """What ``eosflow reset`` clears here (:func:`~sinks.lake.writer.recorded_commits`;
        one record per step, whatever the ``subtasks``)."""
        return recorded_commits(_IcebergTable(self, SinkContext(job, step, 0, 1, 0)))

    def forget_commits(self, job: str, step: str, subtasks: int = 1) -> list[str]:
        """``eosflow reset``: the table forgets the job's commits of ``step`` (rows stay)."""
        return forget_commits(_IcebergTable(self, SinkContext(job, step, 0, 1, 0)))

    def certify_redirect(self, rewrite: Any, step: str) -> IcebergSink:
        """``eosflow certify``: a copy writing the same table name in a catalog of the run's
        own (SQL on SQLite, warehouse under the run's outputs directory, removed with
        certify's work directory)."""
        out = copy.copy(self)
        home = os.path.abspath(os.path.join(rewrite.outputs, step))
        os.makedirs(home, exist_ok=True)
        out.catalog = {
            "type": "sql",
            "uri": f"sqlite:///{home}/catalog.db",
            "warehouse": f"file://{home}/warehouse",
        }
        return out

    def read_output(self) -> list[dict[str, Any]]:
        """The committed rows (``eosflow certify``, ``processor.testing.read_output``)."""
        rows = read_iceberg(self.table, catalog=self.catalog, catalog_name=self.catalog_name)
        return list(rows.to_pylist())


class _IcebergTable:
    """The Iceberg side of :class:`~sinks.lake.writer.LakeWriter` for one writer."""

    def __init__(self, sink: IcebergSink, ctx: SinkContext) -> None:
        from pyiceberg import exceptions

        self.exc = exceptions
        self.sink = sink
        self.ctx = ctx
        self.describe = f"Iceberg table {sink.table}"
        self.catalog = _table_catalog(sink.catalog_name, sink.catalog, sink.table)
        self.property = _PROPERTY.format(job=ctx.job, step=ctx.step)
        self.forget_hint = (
            f"reset the job with its pipeline ('eosflow reset {ctx.job} --pipeline FILE' "
            f"removes the table property {self.property!r}; the rows stay)"
        )
        self._table: Any = None

    def _load(self) -> Any:
        try:
            return self.catalog.load_table(self.sink.table)
        except self.exc.NoSuchTableError:
            return None

    def table_schema(self) -> pa.Schema | None:
        table = self._load()
        if table is None:
            return None
        self._table = table
        schema = _plain(table.schema().as_arrow())
        if self.sink.schema is not None:
            try:
                check_schema(schema, _plain(self.sink.schema), where=self.describe)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        return schema

    def create(self, schema: pa.Schema) -> pa.Schema:
        from pyiceberg.transforms import parse_transform

        namespace = self.sink.table.rsplit(".", 1)[0]
        self.catalog.create_namespace_if_not_exists(namespace)
        try:
            txn = self.catalog.create_table_transaction(self.sink.table, schema=schema)
            if self.sink.partition_by:
                with txn.update_spec() as spec:
                    for col, transform in self.sink.partition_by:
                        spec.add_field(col, parse_transform(transform), f"{col}_{transform}")
            txn.commit_transaction()
        except (self.exc.TableAlreadyExistsError, self.exc.CommitFailedException):
            pass  # another writer created it first
        created = self.table_schema()
        assert created is not None
        return created

    def write_files(self, data: pa.Table, prefix: str) -> list[Any]:
        from pyiceberg.io.pyarrow import _dataframe_to_data_files

        table = self._load()
        self._table = table
        files = _dataframe_to_data_files(
            table_metadata=table.metadata, df=data, io=table.io, write_uuid=uuid.uuid4()
        )
        return [f.file_path for f in files]

    def delete_files(self, files: list[Any]) -> None:
        table = self._table or self._load()
        if table is None:
            return  # no table, so nothing of it to clean
        for path in files:
            with contextlib.suppress(FileNotFoundError, OSError):
                table.io.delete(path)

    def last_committed(self) -> int:
        self._table = self._load()
        if self._table is None:
            return 0
        return int(self._table.properties.get(self.property, "0"))

    def forget(self) -> None:
        """Removes the table property that records the (job, step)'s last checkpoint."""
        table = self._load()
        if table is not None:
            with table.transaction() as txn:
                txn.remove_properties(self.property)

    def commit(self, files: list[Any], checkpoint_id: int) -> None:
        from pyiceberg.io.pyarrow import parquet_file_to_data_file

        table = _without_retries(self._table)
        ctx = self.ctx
        txn = table.transaction()
        txn.set_properties({self.property: str(checkpoint_id)})
        summary = {
            "eosflow.job": ctx.job,
            "eosflow.step": ctx.step,
            "eosflow.checkpoint": str(checkpoint_id),
        }
        with txn.update_snapshot(snapshot_properties=summary).fast_append() as append:
            for path in files:
                append.append_data_file(parquet_file_to_data_file(table.io, table.metadata, path))
        try:
            txn.commit_transaction()
        except self.exc.CommitFailedException as exc:
            raise CommitConflict(str(exc)) from exc


def _without_retries(table: Any) -> Any:
    """``table`` whose in-memory properties turn off pyiceberg's own commit retries.

    pyiceberg (0.12) retries a ``CommitFailedException`` by re-applying the transaction's
    append to the table's new metadata: it would not read ``eosflow.checkpoint.<job>.<step>``
    again, so a racing committer that already committed the epoch would see it appended twice
    (the unit test of racing committers caught exactly that). The writer retries instead, and
    checks first. Only this in-memory copy changes: the catalog applies the commit's updates to
    its own current metadata, so the property is never written to the table.
    """
    from pyiceberg.table import Table, TableProperties

    props = {**table.metadata.properties, TableProperties.COMMIT_NUM_RETRIES: "0"}
    return Table(
        table.name(),
        table.metadata.model_copy(update={"properties": props}),
        table.metadata_location,
        table.io,
        table.catalog,
    )


def _plain(schema: pa.Schema) -> pa.Schema:
    """``schema`` without field metadata (pyiceberg's field ids), large types as plain."""
    fields = []
    for f in schema:
        t = f.type
        if pa.types.is_large_string(t):
            t = pa.string()
        elif pa.types.is_large_binary(t):
            t = pa.binary()
        fields.append(pa.field(f.name, t, f.nullable))
    return pa.schema(fields)


def read_iceberg(
    table: str, *, catalog: dict[str, str], catalog_name: str | None = None
) -> pa.Table:
    """The committed rows of an Iceberg table (a pyiceberg scan); ``catalog_name`` as for
    :class:`IcebergSink`."""
    return _table_catalog(catalog_name, catalog, table).load_table(table).scan().to_arrow()
