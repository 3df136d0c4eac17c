"""Values to Arrow tables under a fixed schema: the records that do not fit are set aside.

A lakehouse table has a schema; the sinks never change it. Each ``write`` turns its values into
one :class:`pyarrow.Table` of exactly the table's schema. A value that does not fit (a field the
schema does not have, a required field missing or null, a value of the wrong type or range) is
not written: it is returned with the reason, and the sink hands it to the dataflow's dead
letters (``RecordsRejected``). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa

__all__ = ["check_schema", "infer_schema", "to_table"]

_CONVERT_ERRORS = (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError, ValueError)


def infer_schema(records: Sequence[dict[str, Any]]) -> pa.Schema:
    """The schema pyarrow infers from ``records`` (the first batch a sink sees).

    Raises:
        ValueError: pyarrow cannot infer one type per field (mixed types), or no field at all.
    """
    try:
        schema = pa.Table.from_pylist(list(records)).schema
    except _CONVERT_ERRORS as exc:
        raise ValueError(f"cannot infer a table schema from the first records: {exc}") from exc
    if not schema.names:
        raise ValueError("cannot infer a table schema: the first records have no fields")
    for f in schema:
        if pa.types.is_null(f.type):
            raise ValueError(
                f"cannot infer the type of field {f.name!r}: it is null in every record of the "
                "first batch; give the sink a schema"
            )
    return schema


def check_schema(table_schema: pa.Schema, given: pa.Schema, *, where: str) -> None:
    """``given`` (the user's schema) must be the table's: same names, order and types.

    Raises:
        ValueError: naming the first difference; the table is never altered to fit.
    """
    if table_schema.names != given.names:
        raise ValueError(
            f"{where}: the table's columns are {table_schema.names}, the sink's schema has "
            f"{given.names}. The sink never changes a table's schema: alter the table with its "
            "own tools, or give the sink the table's schema (or none, to use the table's)"
        )
    for have, want in zip(table_schema, given, strict=True):
        if not have.type.equals(want.type):
            raise ValueError(
                f"{where}: column {have.name!r} is {have.type} in the table, {want.type} in the "
                "sink's schema. The sink never changes a table's schema"
            )


def _misfit(
    record: Any, schema: pa.Schema, columns: frozenset[str], required: frozenset[str]
) -> str | None:
    if not isinstance(record, dict):
        return (
            f"expected a dict of column values, got {type(record).__name__}; give the sink "
            "to_record=<value -> dict> (a keyed stream hands (key, value) tuples)"
        )
    extra = [k for k in record if k not in columns]
    if extra:
        return (
            f"field(s) {extra} are not columns of the table ({', '.join(schema.names)}); the "
            "sink never widens a table's schema: alter the table, or drop the field(s) in "
            "to_record"
        )
    missing = [n for n in required if record.get(n) is None]
    if missing:
        return f"required column(s) {sorted(missing)} missing or null"
    return None


def to_table(records: Sequence[Any], schema: pa.Schema) -> tuple[pa.Table, list[tuple[int, str]]]:
    """``records`` as a table of ``schema``, and the ``(index, reason)`` of each one that does
    not fit (left out of the table)."""
    columns = frozenset(schema.names)
    required = frozenset(f.name for f in schema if not f.nullable)
    rejects: list[tuple[int, str]] = []
    fitting: list[Any] = []
    kept_index: list[int] = []
    for i, record in enumerate(records):
        why = _misfit(record, schema, columns, required)
        if why is None:
            fitting.append(record)
            kept_index.append(i)
        else:
            rejects.append((i, why))
    try:
        table = pa.Table.from_pylist(fitting, schema=schema)
    except _CONVERT_ERRORS:
        # Slow path, only when some value does not convert: find which, one at a time.
        good = []
        for i, record in zip(kept_index, fitting, strict=True):
            try:
                pa.Table.from_pylist([record], schema=schema)
                good.append(record)
            except _CONVERT_ERRORS as exc:
                rejects.append((i, f"{type(exc).__name__}: {exc}"))
        rejects.sort()
        table = pa.Table.from_pylist(good, schema=schema)
    return table, rejects
