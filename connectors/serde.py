"""Serializers for Kafka record keys and values.

Every serde follows :class:`Serde`: ``RawSerde`` (bytes), ``StringSerde`` (UTF-8),
``JsonSerde`` (orjson), ``AvroSerde`` (schemaless Avro via fastavro) and ``ConfluentAvroSerde``
(Confluent wire format). Decoding failures raise ``DeserializationError`` carrying the topic,
partition and offset of the bad record, so the engine dead-letters it instead of crashing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from io import BytesIO
from typing import Any, TypeAlias

import orjson
from fastavro import parse_schema, schemaless_reader, schemaless_writer
from fastavro.validation import ValidationError
from fastavro.validation import validate as _avro_validate

from processor.contracts import Serde
from processor.errors import ConfigError, DeserializationError, SerializationError

__all__ = [
    "AvroSchema",
    "AvroSerde",
    "ConfluentAvroSerde",
    "JsonSerde",
    "RawSerde",
    "Serde",
    "StringSerde",
    "serde_for",
]

AvroSchema: TypeAlias = "str | list[Any] | dict[str, Any]"
"""An Avro schema as JSON-like Python data (a type name, a union list or a dict)."""

# Bound once: the JSON path runs for every record; a global is cheaper than orjson.<attr>.
_dumps = orjson.dumps
_loads = orjson.loads


def _bad(
    serde: str,
    cause: str,
    data: Any,
    topic: str | None,
    partition: int | None,
    offset: int | None,
) -> DeserializationError:
    shown = bytes(data) if isinstance(data, (bytearray, memoryview)) else data
    return DeserializationError(
        cause, topic=topic, partition=partition, offset=offset, serde=serde, data=shown
    )


class RawSerde:
    """Bytes pass-through: ``serialize`` accepts bytes-like values, ``deserialize`` never fails."""

    name = "raw"

    def serialize(self, value: Any) -> bytes:
        if isinstance(value, bytes):
            return value
        if isinstance(value, (bytearray, memoryview)):
            return bytes(value)
        raise SerializationError(
            f"raw: expected bytes, bytearray or memoryview, got {type(value).__name__}; "
            "encode the value first or use the 'string' or 'json' serde"
        )

    def deserialize(
        self,
        data: bytes,
        *,
        topic: str | None = None,
        partition: int | None = None,
        offset: int | None = None,
    ) -> bytes:
        return data

    def deserialize_many(self, datas: list[bytes]) -> list[bytes]:
        """The batch form of :meth:`deserialize` (see the ``Serde`` contract)."""
        return datas


class StringSerde:
    """UTF-8 text.

    Invariants:
        ``deserialize(serialize(s)) == s`` for every ``str`` without lone surrogates.
    """

    name = "string"

    def serialize(self, value: Any) -> bytes:
        if not isinstance(value, str):
            raise SerializationError(
                f"string: expected str, got {type(value).__name__}; convert it with str() "
                "or use the 'json' serde"
            )
        try:
            return value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise SerializationError(f"string: expected text encodable as UTF-8: {exc}") from exc

    def deserialize(
        self,
        data: bytes,
        *,
        topic: str | None = None,
        partition: int | None = None,
        offset: int | None = None,
    ) -> str:
        try:
            return str(data, "utf-8")
        except UnicodeDecodeError as exc:
            raise _bad(
                self.name, f"malformed UTF-8: {exc}", data, topic, partition, offset
            ) from exc

    def deserialize_many(self, datas: list[bytes]) -> list[str]:
        """The batch form of :meth:`deserialize` (raises on a bad item: see ``Serde``)."""
        return [str(data, "utf-8") for data in datas]


class JsonSerde:
    """JSON via orjson.

    Args:
        sort_keys: write object keys in sorted order (stable bytes for equal dicts, at a cost).

    Invariants:
        ``deserialize(serialize(x)) == x`` for JSON values: dicts with ``str`` keys, lists,
        ``str``, ``bool``, ``None``, finite ``float`` and ``int`` in ``[-2**63, 2**64)``.
        Other values orjson accepts encode one way only (tuples come back as lists, dataclasses
        and datetimes as dicts and strings, NaN and infinities as ``null``).
    """

    name = "json"

    def __init__(self, *, sort_keys: bool = False) -> None:
        self._option = orjson.OPT_SORT_KEYS if sort_keys else None

    def serialize(self, value: Any) -> bytes:
        try:
            return _dumps(value, option=self._option)
        except orjson.JSONEncodeError as exc:
            raise SerializationError(
                f"json: expected a JSON-compatible value (dict with str keys, list, str, "
                f"int within 64 bits, float, bool, None), got {type(value).__name__}: {exc}"
            ) from exc

    def deserialize(
        self,
        data: bytes,
        *,
        topic: str | None = None,
        partition: int | None = None,
        offset: int | None = None,
    ) -> Any:
        try:
            return _loads(data)
        except orjson.JSONDecodeError as exc:
            raise _bad(self.name, f"invalid JSON: {exc}", data, topic, partition, offset) from exc

    def deserialize_many(self, datas: list[bytes]) -> list[Any]:
        """The batch form of :meth:`deserialize` (raises on a bad item: see ``Serde``)."""
        return list(map(_loads, datas))

    def serialize_many(self, values: list[Any]) -> list[bytes]:
        """The batch form of :meth:`serialize` (raises on a bad item: see ``Serde``)."""
        if self._option is None:
            return list(map(_dumps, values))
        option = self._option
        return [_dumps(value, option=option) for value in values]


class _Malformed(ValueError):
    """A problem found by this module rather than by the decoder (e.g. trailing bytes)."""


def _parse(schema: Any, what: str) -> Any:
    try:
        return parse_schema(schema)
    except Exception as exc:  # fastavro raises several unrelated types for a bad schema
        raise ConfigError(f"{what} is not a valid Avro schema: {exc}; got {schema!r}") from exc


def _schema_name(schema: Any) -> str:
    if isinstance(schema, dict):
        return str(schema.get("name") or schema.get("type"))
    return "union" if isinstance(schema, list) else str(schema)


def _avro_write(buf: BytesIO, schema: Any, schema_name: str, value: Any, validate: bool) -> bytes:
    try:
        if validate:
            _avro_validate(value, schema, raise_errors=True)
        # strict_allow_default: extra fields would be dropped silently, missing ones written
        # as null; both are a record that does not match the schema.
        schemaless_writer(buf, schema, value, strict_allow_default=True)
    except Exception as exc:  # fastavro's Cython writer raises a different type per field type
        detail = "; ".join(map(str, exc.errors)) if isinstance(exc, ValidationError) else str(exc)
        raise SerializationError(
            f"avro: expected a value matching schema {schema_name}, "
            f"got {type(value).__name__} that does not: {detail}"
        ) from exc
    return buf.getvalue()


def _avro_read(data: bytes, start: int, writer: Any, reader: Any) -> Any:
    buf = BytesIO(data)  # shares the bytes object's buffer: no copy
    if start:
        buf.seek(start)
    datum = schemaless_reader(buf, writer, reader)
    left = len(data) - buf.tell()
    if left:
        # Without this check a record with garbage appended decodes "successfully".
        raise _Malformed(f"{left} trailing bytes after a complete datum")
    return datum


def _describe(exc: Exception, schema_name: str) -> str:
    if isinstance(exc, _Malformed):
        detail = str(exc)
    elif isinstance(exc, EOFError):
        detail = f"truncated datum ({exc})" if str(exc) else "truncated datum"
    else:
        detail = f"{type(exc).__name__}: {exc}"
    return f"not a valid Avro datum of schema {schema_name}: {detail}"


class AvroSerde:
    """Schemaless Avro: the record body only, no header, the schema agreed out of band.

    Args:
        schema: the writer schema, parsed once here.
        reader_schema: schema to resolve decoded data into (Avro schema evolution); defaults to
            ``schema``.
        validate: check types before writing. Without it fastavro coerces some mismatches
            (``1.7`` into a ``long`` as ``1``, ``"no"`` into a ``boolean`` as ``true``) instead
            of failing; the check costs several times the write itself.

    Raises:
        ConfigError: a schema is not valid Avro.

    Invariants:
        ``deserialize(serialize(r)) == r`` for every ``r`` matching ``schema`` (without a
        ``reader_schema``). Bytes left over after a complete datum are malformed input.
    """

    name = "avro"

    def __init__(
        self,
        schema: AvroSchema,
        *,
        reader_schema: AvroSchema | None = None,
        validate: bool = True,
    ) -> None:
        self._schema = _parse(schema, "schema")
        reader = None if reader_schema is None else _parse(reader_schema, "reader_schema")
        # None skips fastavro's resolution step when there is nothing to resolve.
        self._reader = None if reader == self._schema else reader
        self._validate = validate
        self.schema_name = _schema_name(self._schema)

    def serialize(self, value: Any) -> bytes:
        return _avro_write(BytesIO(), self._schema, self.schema_name, value, self._validate)

    def deserialize(
        self,
        data: bytes,
        *,
        topic: str | None = None,
        partition: int | None = None,
        offset: int | None = None,
    ) -> Any:
        try:
            return _avro_read(data, 0, self._schema, self._reader)
        except Exception as exc:  # untrusted bytes: any decoder failure is a bad record
            cause = _describe(exc, self.schema_name)
            raise _bad(self.name, cause, data, topic, partition, offset) from exc


def _magic_hint(first: int) -> str:
    if first in b"{[":
        return "; is this JSON?"
    return "; is this plain text?" if 0x20 <= first < 0x7F else "; is it Confluent wire format?"


class ConfluentAvroSerde:
    """Avro in the Confluent wire format: ``0x00``, 4-byte big-endian schema id, Avro body.

    There is no schema registry client (eosflow runs without network access to one). Plug a
    registry in through ``schemas`` (ids known up front) or ``resolve`` (called once per
    unknown id, the answer cached).

    Args:
        schema: the schema this serde writes with, and reads every record into.
        schema_id: the registry id of ``schema``, written in each record's header.
        schemas: other known ids and their writer schemas (older versions of ``schema``).
        resolve: ``resolve(schema_id) -> schema | None`` for ids not in ``schemas``; return
            ``None`` or raise ``LookupError`` for an unknown id.
        validate: as in :class:`AvroSerde`.

    Raises:
        ConfigError: a schema is not valid Avro, ``schema_id`` is out of range, or ``schemas``
            maps ``schema_id`` to a different schema.

    Invariants:
        ``deserialize(serialize(r)) == r`` for every ``r`` matching ``schema``. A record written
        with an older id is resolved into ``schema``. An unknown id is a bad record, but other
        exceptions from ``resolve`` (registry unreachable) propagate unchanged and an invalid
        schema from it raises ``ConfigError``: a good record must not be dead-lettered for an
        infrastructure failure.
    """

    name = "confluent-avro"

    def __init__(
        self,
        schema: AvroSchema,
        schema_id: int,
        *,
        schemas: Mapping[int, AvroSchema] | None = None,
        resolve: Callable[[int], AvroSchema | None] | None = None,
        validate: bool = True,
    ) -> None:
        if type(schema_id) is not int or not 0 <= schema_id < 2**31:
            raise ConfigError(f"schema_id: expected an int in [0, 2**31), got {schema_id!r}")
        self.schema_id = schema_id
        self._schema = _parse(schema, "schema")
        self.schema_name = _schema_name(self._schema)
        self._writers = {sid: _parse(s, f"schemas[{sid}]") for sid, s in (schemas or {}).items()}
        if self._writers.setdefault(schema_id, self._schema) != self._schema:
            raise ConfigError(
                f"schemas[{schema_id}] differs from schema, but both claim id {schema_id}; "
                "remove it from schemas or fix schema_id"
            )
        self._writers[schema_id] = self._schema  # identity check in deserialize relies on it
        self._header = b"\x00" + schema_id.to_bytes(4, "big")
        self._resolve = resolve
        self._validate = validate

    def serialize(self, value: Any) -> bytes:
        buf = BytesIO()
        buf.write(self._header)
        return _avro_write(buf, self._schema, self.schema_name, value, self._validate)

    def deserialize(
        self,
        data: bytes,
        *,
        topic: str | None = None,
        partition: int | None = None,
        offset: int | None = None,
    ) -> Any:
        if len(data) < 5:
            cause = (
                f"too short: {len(data)} bytes, expected at least 5 "
                "(magic byte 0x00 and a 4-byte schema id)"
            )
        elif data[0] != 0:
            cause = f"expected magic byte 0x00, got 0x{data[0]:02x}{_magic_hint(data[0])}"
        else:
            schema_id = int.from_bytes(data[1:5], "big")
            writer = self._writers.get(schema_id)
            if writer is None:
                writer = self._lookup(schema_id)
            if writer is not None:
                reader = None if writer is self._schema else self._schema
                try:
                    return _avro_read(data, 5, writer, reader)
                except Exception as exc:  # untrusted bytes: any decoder failure is a bad record
                    cause = f"schema id {schema_id}: {_describe(exc, self.schema_name)}"
                    raise _bad(self.name, cause, data, topic, partition, offset) from exc
            cause = (
                f"unknown schema id {schema_id} (known: {sorted(self._writers)}); "
                "pass its writer schema in schemas= or a resolve= callable"
            )
        raise _bad(self.name, cause, data, topic, partition, offset)

    def _lookup(self, schema_id: int) -> Any:
        try:
            found = None if self._resolve is None else self._resolve(schema_id)
        except LookupError:
            found = None
        if found is None:
            return None
        parsed = _parse(found, f"resolve({schema_id})")
        self._writers[schema_id] = parsed
        return parsed


_BY_NAME: dict[str, Callable[[], Serde]] = {
    "json": JsonSerde,
    "raw": RawSerde,
    "string": StringSerde,
}


def serde_for(spec: str | Serde) -> Serde:
    """Return the serde named by ``spec``, or ``spec`` itself if it already is one.

    Raises:
        ConfigError: ``spec`` is neither a known name nor a serde instance.
    """
    if isinstance(spec, str):
        factory = _BY_NAME.get(spec)
        if factory is not None:
            return factory()
    # A serde class (not instance) also has name/serialize/deserialize attributes.
    elif not isinstance(spec, type) and isinstance(spec, Serde):
        return spec
    names = ", ".join(repr(n) for n in _BY_NAME)
    raise ConfigError(
        f"unknown serde {spec!r}: expected one of {names} or a Serde instance; "
        "Avro needs a schema, pass AvroSerde(schema) or ConfluentAvroSerde(schema, schema_id)"
    )
