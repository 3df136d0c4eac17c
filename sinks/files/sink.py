"""The file sink's configuration: :class:`FileSink`, checked before the job runs, opens one
:class:`~sinks.files.writer.FileSinkWriter` per subtask."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from processor.contracts import SinkContext
from processor.errors import ConfigError
from sinks.files.directory import (
    _CLAIM,
    _EXTENSIONS,
    _NON_ATOMIC_RENAME,
    _claimed,
    _mount_fstype,
    _read_claim,
)
from sinks.files.parts import _check_codec, _parse_avro_schema
from sinks.files.writer import FileSinkWriter

__all__ = ["FileSink"]


class FileSink:
    """Writes every value to part files in a directory, exactly once.

    Args:
        path: the output directory, created by the writers if missing. One sink step per
            directory.
        format: ``"jsonl"`` (each value as ``orjson.dumps(value)``, one per line), ``"raw"``
            (each value a ``bytes`` or ``str`` line, ``str`` encoded as UTF-8) or ``"avro"``
            (each value one datum of ``schema``, in Avro object container files).
        encoder: ``jsonl``/``raw`` only: encodes one value to the bytes of its line, in place of
            the format's encoding. The sink adds the newline.
        schema: ``avro`` only, required: the Avro schema (a dict, as ``fastavro.parse_schema``
            takes it). Record fields missing from a value take their default; keys that are not
            fields are ignored (fastavro's non-strict mode).
        codec: ``avro`` only: block compression, ``"deflate"`` (default), ``"null"``, ``"bzip2"``,
            ``"xz"``, or ``"snappy"``, ``"zstandard"``, ``"lz4"`` when their library is installed.
        to_record: ``avro`` only: turns a stream value (a ``(key, value)`` tuple on a keyed
            stream) into the datum to write.
        max_part_bytes: start a new part file within an epoch once the current one holds this
            many bytes (checked after every ``write``, so a part may exceed it by one batch).
            ``None`` (default): one part file per subtask and epoch. When set, every part name
            carries an index: ``part-<subtask>-<checkpoint>-<n>.<ext>``.

    A line (``jsonl``, ``raw``) must not contain a newline: the value would read back as two.

    Raises:
        ConfigError: an unknown format or codec, an invalid schema (with the parser's reason),
            an option that does not belong to the format, or a ``max_part_bytes`` below 1.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        format: str = "jsonl",
        encoder: Callable[[Any], bytes] | None = None,
        schema: Any = None,
        codec: str = "deflate",
        to_record: Callable[[Any], Any] | None = None,
        max_part_bytes: int | None = None,
    ) -> None:
        if format not in _EXTENSIONS:
            raise ConfigError(
                f"FileSink format {format!r} is not supported: expected one of "
                f"{', '.join(map(repr, _EXTENSIONS))}; for another encoding pass "
                "encoder=<function returning the bytes of one line>"
            )
        if encoder is not None and not callable(encoder):
            raise ConfigError(
                f"FileSink encoder must be a function value -> bytes, got {type(encoder).__name__}"
            )
        if to_record is not None and not callable(to_record):
            raise ConfigError(
                "FileSink to_record must be a function value -> Avro datum, got "
                f"{type(to_record).__name__}"
            )
        if max_part_bytes is not None and (
            isinstance(max_part_bytes, bool)
            or not isinstance(max_part_bytes, int)
            or max_part_bytes < 1
        ):
            raise ConfigError(
                f"FileSink max_part_bytes={max_part_bytes!r}: expected a number of bytes >= 1, "
                "or None for one part file per epoch"
            )
        self.parsed_schema: Any = None
        if format == "avro":
            if encoder is not None:
                raise ConfigError(
                    "FileSink format 'avro' takes to_record=<value -> datum>, not encoder="
                )
            self.parsed_schema = _parse_avro_schema(schema)
            _check_codec(self.parsed_schema, codec)
        elif schema is not None or to_record is not None or codec != "deflate":
            raise ConfigError(
                f"FileSink schema=, codec= and to_record= belong to format 'avro', not {format!r}"
            )
        # Configuration only: the directory is created by the writers, in the worker processes.
        self.path = os.fspath(path)
        self.format = format
        self.encoder = encoder
        self.schema = schema
        self.codec = codec
        self.to_record = to_record
        self.max_part_bytes = max_part_bytes

    def __repr__(self) -> str:
        return f"FileSink({self.path!r}, format={self.format!r})"

    def preflight(self, *, job: str, checkpoint_interval: float | None) -> None:
        """Refuses, before workers start, a directory another job owns or one on a file system
        whose rename is not atomic (object-store FUSE mounts).

        Raises:
            ConfigError: saying which job owns the directory, or which file system it is on.
        """
        owner = _read_claim(os.path.join(self.path, _CLAIM))
        if owner is not None and owner.get("job") != job:
            raise _claimed(self.path, owner, job=job, step=None)
        fstype = _mount_fstype(self.path)
        if fstype in _NON_ATOMIC_RENAME:
            raise ConfigError(
                f"FileSink {self.path!r} is on a {fstype} file system, whose rename is a copy "
                "then a delete: readers could see half-written part files and a crash could "
                "leave both names. Write to a local or NFS directory and upload committed part "
                "files from there"
            )

    def open(self, ctx: SinkContext) -> FileSinkWriter:
        """A writer for subtask ``ctx.subtask`` (creates and claims the directory)."""
        return FileSinkWriter(
            self.path,
            ctx,
            format=self.format,
            encoder=self.encoder,
            schema=self.parsed_schema,
            codec=self.codec,
            to_record=self.to_record,
            max_part_bytes=self.max_part_bytes,
        )
