"""The in-progress part files of a file sink, one class a format (lines, Avro), and the
encoding of values into them."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import IO, Any

import fastavro
import orjson
from fastavro.validation import validate as _avro_validate
from fastavro.write import Writer as _AvroWriter

from processor.errors import ConfigError

__all__: list[str] = []

#: Uncompressed bytes of Avro records gathered before they are compressed into one block.
_AVRO_BLOCK_BYTES = 64 * 1024


class _LinePart:
    """An in-progress file of lines: encoded batches go straight to the (buffered) file."""

    def __init__(self, file: IO[bytes]) -> None:
        self.file = file

    def append(self, data: bytes, count: int) -> None:
        self.file.write(data)

    def size(self) -> int:
        return self.file.tell()

    def finish(self) -> None:
        pass


class _Block:
    """What ``fastavro.write.Writer.write_block`` reads of a block (``fastavro.read.Block``)."""

    def __init__(self, data: bytes, count: int) -> None:
        self.bytes_ = io.BytesIO(data)
        self.num_records = count


class _AvroPart:
    """An in-progress Avro object container file: fastavro writes the header (schema, codec,
    sync marker) and compresses blocks of whole write calls' records."""

    def __init__(self, file: IO[bytes], schema: Any, codec: str, metadata: dict[str, str]) -> None:
        self.file = file
        self.writer = _AvroWriter(file, schema, codec=codec, metadata=metadata)
        self.block = bytearray()
        self.count = 0

    def append(self, data: bytes, count: int) -> None:
        self.block += data
        self.count += count
        if len(self.block) >= _AVRO_BLOCK_BYTES:
            self._dump()

    def _dump(self) -> None:
        if self.count:
            self.writer.write_block(_Block(bytes(self.block), self.count))
            self.block.clear()
            self.count = 0

    def size(self) -> int:
        return self.file.tell() + len(self.block)

    def finish(self) -> None:
        self._dump()
        self.writer.flush()


def _encode_raw(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    raise TypeError("format 'raw' takes bytes or str values")


_ENCODERS: dict[str, Callable[[Any], bytes]] = {"jsonl": orjson.dumps, "raw": _encode_raw}


def _parse_avro_schema(schema: Any) -> Any:
    if schema is None:
        raise ConfigError("FileSink format 'avro' needs schema=<Avro schema as a dict>")
    try:
        return fastavro.parse_schema(schema)
    except Exception as exc:
        raise ConfigError(
            f"FileSink schema is not a valid Avro schema: {type(exc).__name__}: {exc}"
        ) from None


def _check_codec(schema: Any, codec: str) -> None:
    """Writes an empty container file with ``codec``: fastavro knows it and its library loads."""
    try:
        part = _AvroPart(io.BytesIO(), schema, codec, {})
        part.writer.write_block(_Block(b"", 0))
    except Exception as exc:
        raise ConfigError(f"FileSink codec {codec!r} cannot be used: {exc}") from None


def _avro_mismatch(datum: Any, schema: Any, exc: Exception) -> str:
    """Which field of ``datum`` does not match ``schema`` (the validator names it)."""
    try:
        _avro_validate(datum, schema, raise_errors=True)
    except Exception as invalid:
        found = []
        for error in getattr(invalid, "errors", ())[:3]:
            expected = error.schema
            if isinstance(expected, dict):
                expected = expected.get("name", expected.get("type"))
            where = f"field {error.field}" if error.field else "the value"
            found.append(
                f"{where} is {error.datum!r:.80} ({type(error.datum).__name__}), "
                f"expected {expected}"
            )
        if found:
            return "; ".join(found)
    return f"{type(exc).__name__}: {exc}"
