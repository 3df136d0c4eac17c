"""File sink: part files written under hidden temporary names, renamed atomically on commit.

Layout of the output directory (DESIGN.md, "Sinks: two-phase commit"; docs/sink-files.md)::

    part-<subtask:05d>-<checkpoint_id:010d>.<ext>          committed; one per subtask and epoch
    part-<subtask:05d>-<checkpoint_id:010d>-<n:04d>.<ext>  committed, when max_part_bytes is set
    .part-<subtask:05d>-g<generation>-<seq>.inprogress     being written, or prepared (hidden)
    .eosflow-sink.json                                     the (job, step) owning the directory

``<ext>`` is ``jsonl`` (one JSON value per line), ``txt`` (raw lines) or ``avro`` (one Avro object
container file per part). Readers glob ``part-*`` (or call :func:`read_committed`,
:func:`read_jsonl`, :func:`read_avro`) and see committed epochs only: a part file appears whole,
by ``os.replace``, when its checkpoint completes. A directory belongs to one sink step of one
job: part names hold the subtask and the checkpoint, not the step, so writers of another step or
job are refused instead of overwriting each other's parts.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import re
import time
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

import fastavro
import orjson
from fastavro.validation import validate as _avro_validate
from fastavro.write import Writer as _AvroWriter

from processor.contracts import SinkContext
from processor.errors import ConfigError, DefinitionError, SerializationError, SnapshotError
from processor.snapshot.store import SnapshotStore

__all__ = [
    "FileSink",
    "FileSinkWriter",
    "read_avro",
    "read_committed",
    "read_committed_lines",
    "read_jsonl",
]

log = logging.getLogger(__name__)

#: Output format -> extension of its committed part files.
_EXTENSIONS = {"jsonl": ".jsonl", "raw": ".txt", "avro": ".avro"}
_COMMITTED = re.compile(r"part-(\d{5,})-(\d{10,})(?:-(\d{4,}))?\.(jsonl|txt|avro)\Z")
_CLAIM = ".eosflow-sink.json"
#: Uncompressed bytes of Avro records gathered before they are compressed into one block.
_AVRO_BLOCK_BYTES = 64 * 1024
#: FUSE file systems over object stores: their rename is a copy then a delete (or missing).
_NON_ATOMIC_RENAME = frozenset(
    {"fuse.s3fs", "fuse.goofys", "fuse.geesefs", "fuse.gcsfuse", "fuse.mountpoint-s3",
     "fuse.rclone", "fuse.blobfuse", "fuse.blobfuse2"}
)  # fmt: skip


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


class FileSinkWriter:
    """One subtask's writer of a :class:`FileSink`.

    Per epoch: the first non-empty ``write`` creates a hidden in-progress file (another one each
    time the current one reaches ``max_part_bytes``); ``prepare(checkpoint_id)`` fsyncs and
    closes them and returns the committable ``{"temp": <in-progress>, "final": <part name>}``,
    or ``{"parts": [[temp, final], ...]}`` when the epoch filled several files (names relative
    to the directory); ``commit`` renames each temp to its final name.

    Invariants:
        Nothing is visible under ``part-*`` before ``commit``: output is staged under hidden
        names that readers' globs do not match, and appears whole by an atomic rename.
        A prepared file is durable (its data and its directory entry fsynced) before
        ``prepare`` returns, so a completed checkpoint's committable names data that exists.
        ``commit`` is idempotent: a temp already renamed (final present, temp gone) is done; a
        final identical to its temp (a rename that copied) only loses the temp. It never
        overwrites a final with other content, nor commits a part whose temp and final are gone.
        ``recover`` touches only this subtask's files and never deletes a pending temp.
        ``write`` is all or nothing per call: a value that fails to encode leaves the file as
        it was.
        In-progress names never collide: the generation separates runs, and a name already
        taken in the same generation is skipped (exclusive create), never truncated.
    """

    def __init__(
        self,
        path: str,
        ctx: SinkContext,
        *,
        format: str = "jsonl",
        encoder: Callable[[Any], bytes] | None = None,
        schema: Any = None,
        codec: str = "deflate",
        to_record: Callable[[Any], Any] | None = None,
        max_part_bytes: int | None = None,
    ) -> None:
        self.ctx = ctx
        self.directory = path
        self._ext = _EXTENSIONS[format]
        self._avro = format == "avro"
        if self._avro and schema is None:
            raise ConfigError("FileSinkWriter format 'avro' needs a parsed schema")
        self._schema = schema
        self._codec = codec
        self._to_record = to_record
        self._encode_one = encoder if encoder is not None else _ENCODERS.get(format)
        # orjson never writes a newline without OPT_INDENT_2; other encodings are checked.
        self._check_newlines = encoder is not None or format == "raw"
        self._max_part_bytes = max_part_bytes
        self._temp_pattern = re.compile(rf"\.part-{ctx.subtask:05d}-g\d+-\d+\.inprogress\Z")
        self._part: _LinePart | _AvroPart | None = None
        self._temp: str | None = None
        self._epoch: list[str] = []  # this epoch's full (closed, fsynced) in-progress files
        self._seq = 0
        self._records = 0
        self._bytes = 0
        self._prepared: set[str] = set()  # temps prepared by this writer, not yet committed
        if not os.path.isdir(path):
            os.makedirs(path, exist_ok=True)
            # The new directory's own entry: a power cut must not lose it with its parts.
            _fsync_dir(os.path.dirname(os.path.abspath(path)))
        _claim(path, ctx.job, ctx.step)

    def __repr__(self) -> str:
        ctx = self.ctx
        return f"FileSinkWriter({self.directory!r}, step={ctx.step!r}, subtask={ctx.subtask})"

    # -- epoch -----------------------------------------------------------------------------------

    def write(self, values: Sequence[Any]) -> None:
        """Appends ``values`` to the epoch's in-progress file.

        Raises:
            SerializationError: a value cannot be encoded (nothing of this call is written).
        """
        if not values:
            return
        data = self._encode_avro(values) if self._avro else self._encode_lines(values)
        if self._part is None:
            self._part = self._open_part()
        self._part.append(data, len(values))
        self._records += len(values)
        self._bytes += len(data)
        if self._max_part_bytes is not None and self._part.size() >= self._max_part_bytes:
            self._finish_part()

    def prepare(self, checkpoint_id: int) -> dict[str, Any] | None:
        """Makes the epoch's files durable (still hidden); returns its committable, or ``None``
        when the epoch wrote nothing."""
        _check_checkpoint_id(checkpoint_id)
        if self._part is not None:
            self._finish_part()
        if not self._epoch:
            return None
        _fsync_dir(self.directory)  # the temps' directory entries, created this epoch
        temps, self._epoch = self._epoch, []
        self._prepared.update(temps)
        pairs = [[temp, self._final_name(checkpoint_id, i)] for i, temp in enumerate(temps)]
        log.info(
            "prepared checkpoint_id=%d step=%r subtask=%d temp=%s parts=%d records=%d bytes=%d",
            checkpoint_id, self.ctx.step, self.ctx.subtask, temps[0], len(temps), self._records,
            self._bytes,
        )  # fmt: skip
        self._records = self._bytes = 0
        if len(pairs) == 1:
            return {"temp": pairs[0][0], "final": pairs[0][1]}
        return {"parts": pairs}

    def commit(self, checkpoint_id: int, committable: Any) -> None:
        """Renames the prepared files to their part names. Idempotent; ``None`` is a no-op.

        Raises:
            SnapshotError: ``missing`` when neither the temp nor the final file of a part exists
                (the prepared output was deleted, or the sink points at another directory);
                ``corrupt`` when ``committable`` is not one of this subtask's committables.
            ConfigError: a final name holds other content than its temp (another run or step
                wrote into this directory).
        """
        if committable is None:
            return
        pairs = self._parse(checkpoint_id, committable)
        done = 0
        for i, (temp, final) in enumerate(pairs):
            done += self._commit_part(checkpoint_id, temp, final)
            if i == 0:  # visible (the first part of several), nothing fsynced or forgotten yet
                self.ctx.fault("mid-sink-commit")
        # Also after "already committed": a crash may have come between rename and fsync.
        _fsync_dir(self.directory)
        for temp, _final in pairs:
            self._prepared.discard(temp)
        log.info(
            "%s checkpoint_id=%d step=%r subtask=%d final=%s parts=%d",
            "committed" if done else "already committed", checkpoint_id, self.ctx.step,
            self.ctx.subtask, pairs[0][1], len(pairs),
        )  # fmt: skip

    def recover(self, pending: Sequence[tuple[int, Any]]) -> None:
        """Commits ``pending`` in order, then deletes this subtask's other in-progress files
        (orphans of epochs after the restored checkpoint). Idempotent.

        Raises:
            SnapshotError: as :meth:`commit`.
            ConfigError: the directory holds this subtask's part files of a checkpoint newer
                than the job's newest completed one: they come from another run of the job
                (its snapshots were deleted), and this run would overwrite or duplicate them.
        """
        names = os.listdir(self.directory)
        self._check_history(names)
        keep = set(self._prepared) | set(self._epoch)
        for i, (checkpoint_id, committable) in enumerate(pending):
            self.commit(checkpoint_id, committable)
            if committable is not None:
                keep.update(temp for temp, _final in self._parse(checkpoint_id, committable))
            if i == 0:
                self.ctx.fault("mid-sink-recover")
        if self._temp is not None:
            keep.add(self._temp)
        deleted = 0
        for name in sorted(names):
            if self._temp_pattern.match(name) and name not in keep:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(self.directory, name))
                    deleted += 1
                log.debug(
                    "deleted orphan step=%r subtask=%d temp=%s", self.ctx.step, self.ctx.subtask,
                    name,
                )  # fmt: skip
        if deleted:
            _fsync_dir(self.directory)
        log.info(
            "recovered step=%r subtask=%d generation=%d pending=%d orphans_deleted=%d",
            self.ctx.step, self.ctx.subtask, self.ctx.generation, len(pending), deleted,
        )  # fmt: skip

    def close(self) -> None:
        """Closes the in-progress file, if any, without deleting it (``recover`` does)."""
        if self._part is not None:
            self._part.file.close()
            log.debug(
                "closed step=%r subtask=%d unprepared_temp=%s", self.ctx.step, self.ctx.subtask,
                self._temp,
            )  # fmt: skip
        self._part = None
        self._temp = None

    # -- helpers ---------------------------------------------------------------------------------

    def _encode_lines(self, values: Sequence[Any]) -> bytes:
        encode, check = self._encode_one, self._check_newlines
        assert encode is not None
        lines = []
        for value in values:
            try:
                data = encode(value)
            except Exception as exc:
                raise self._unencodable(value, f"{type(exc).__name__}: {exc}") from exc
            if not isinstance(data, bytes):
                why = f"encoder returned {type(data).__name__}, not bytes"
                raise self._unencodable(value, why)
            if check and b"\n" in data:
                raise self._unencodable(value, "its line contains a newline")
            lines.append(data)
        lines.append(b"")
        return b"\n".join(lines)

    def _encode_avro(self, values: Sequence[Any]) -> bytes:
        # Encoded into a buffer of this call alone: a bad value leaves nothing behind.
        buf = io.BytesIO()
        schema, to_record, write = self._schema, self._to_record, fastavro.schemaless_writer
        for i, value in enumerate(values):
            datum = value
            if to_record is not None:
                try:
                    datum = to_record(value)
                except Exception as exc:
                    why = f"value #{i} of the batch: to_record raised {type(exc).__name__}: {exc}"
                    raise self._unencodable(value, why) from exc
            try:
                write(buf, schema, datum)
            except Exception as exc:
                why = f"value #{i} of the batch: {_avro_mismatch(datum, schema, exc)}"
                raise self._unencodable(value, why) from exc
        return buf.getvalue()

    def _unencodable(self, value: Any, why: str) -> SerializationError:
        fix = (
            "Fix the value or the schema, or convert it with to_record="
            if self._avro
            else "Convert it in a map step before the sink, or give FileSink an encoder= that "
            "handles it"
        )
        return SerializationError(
            f"file sink step={self.ctx.step!r} subtask={self.ctx.subtask} could not encode a "
            f"value of type {type(value).__name__}: {why}. {fix}"
        )

    def _open_part(self) -> _LinePart | _AvroPart:
        ctx = self.ctx
        while True:
            name = f".part-{ctx.subtask:05d}-g{ctx.generation}-{self._seq}.inprogress"
            self._seq += 1
            try:
                # "xb": an earlier writer of this generation may have left a prepared file
                # under this name; truncating it would lose a pending epoch.
                file = open(os.path.join(self.directory, name), "xb")  # noqa: SIM115
            except FileExistsError:
                log.warning(
                    "in-progress name taken step=%r subtask=%d temp=%s", ctx.step, ctx.subtask, name
                )
                continue
            self._temp = name
            if not self._avro:
                return _LinePart(file)
            metadata = {"eosflow.job": ctx.job, "eosflow.step": ctx.step}
            return _AvroPart(file, self._schema, self._codec, metadata)

    def _finish_part(self) -> None:
        part, temp = self._part, self._temp
        assert part is not None and temp is not None
        part.finish()
        part.file.flush()
        os.fsync(part.file.fileno())
        part.file.close()
        self._epoch.append(temp)
        self._part = self._temp = None

    def _final_name(self, checkpoint_id: int, index: int) -> str:
        name = f"part-{self.ctx.subtask:05d}-{checkpoint_id:010d}"
        if self._max_part_bytes is not None:
            name += f"-{index:04d}"
        return name + self._ext

    def _commit_part(self, checkpoint_id: int, temp: str, final: str) -> bool:
        """Renames one part; ``False`` when it was already committed."""
        temp_path = os.path.join(self.directory, temp)
        final_path = os.path.join(self.directory, final)
        if os.path.exists(final_path):
            if not os.path.exists(temp_path):
                return False  # committed before a crash (or by the commit call before this one)
            self._settle_both(checkpoint_id, temp_path, final_path)
            return True
        try:
            os.replace(temp_path, final_path)
        except FileNotFoundError:
            if os.path.exists(final_path):  # a concurrent commit of the same part won
                return False
            raise SnapshotError(
                f"file sink step={self.ctx.step!r} subtask={self.ctx.subtask}: the output "
                f"of checkpoint {checkpoint_id} is missing: neither {temp} (prepared) nor "
                f"{final} (committed) exists in {self.directory}. Committing it would lose "
                "that epoch's records. Check that the sink writes to the directory it used "
                "before the restart and that nothing deletes part or .inprogress files there",
                reason="missing",
                path=temp_path,
            ) from None
        return True

    def _settle_both(self, checkpoint_id: int, temp_path: str, final_path: str) -> None:
        """Temp and final both exist. On a POSIX file system ``os.replace`` never leaves both, so
        either a rename that copies was interrupted (the final is a copy, maybe a partial one,
        of the temp) or another writer made the final (refused: overwriting loses its data)."""
        relation = _compare_files(final_path, temp_path)
        if relation == "equal":
            os.remove(temp_path)
            log.warning("dropped temp of a copied part checkpoint_id=%d final=%s", checkpoint_id,
                        os.path.basename(final_path))  # fmt: skip
            return
        if relation == "prefix":
            os.replace(temp_path, final_path)
            log.warning("completed an interrupted rename checkpoint_id=%d final=%s",
                        checkpoint_id, os.path.basename(final_path))  # fmt: skip
            return
        raise ConfigError(
            f"file sink step={self.ctx.step!r} subtask={self.ctx.subtask}: committing checkpoint "
            f"{checkpoint_id} would overwrite {final_path}, which holds other data than its "
            f"prepared file {os.path.basename(temp_path)}: another run or sink step wrote into "
            f"{self.directory}. Give every sink step and every run of a job without its "
            "snapshots its own, empty directory"
        )

    def _check_history(self, names: list[str]) -> None:
        """Part files newer than the newest completed checkpoint were not made by this run."""
        url = self.ctx.snapshot_url
        if url is None:
            return
        own = [
            int(m.group(2))
            for m in map(_COMMITTED.match, names)
            if m and int(m.group(1)) == self.ctx.subtask
        ]
        if not own:
            return
        completed = SnapshotStore(url).completed_ids(self.ctx.job)
        newest = completed[-1] if completed else 0
        if max(own) > newest:
            raise ConfigError(
                f"file sink step={self.ctx.step!r} subtask={self.ctx.subtask}: {self.directory} "
                f"holds part files up to checkpoint {max(own)}, but the newest completed "
                f"checkpoint of job {self.ctx.job!r} in {url} is "
                f"{newest or 'none'}: they were written by another run of the job whose "
                "snapshots are gone, and this run would overwrite or repeat them. Move them "
                "away or point the sink at an empty directory"
            )

    def _parse(self, checkpoint_id: int, committable: Any) -> list[tuple[str, str]]:
        raw: Any = None
        if isinstance(committable, dict) and set(committable) == {"parts"}:
            raw = committable["parts"]
        elif isinstance(committable, dict) and set(committable) == {"temp", "final"}:
            raw = [(committable["temp"], committable["final"])]
        prefix = f"part-{self.ctx.subtask:05d}-"
        if isinstance(raw, list | tuple) and raw:
            pairs = [tuple(p) for p in raw if isinstance(p, list | tuple) and len(p) == 2]
            if len(pairs) == len(raw) and all(
                isinstance(temp, str)
                and isinstance(final, str)
                and self._temp_pattern.match(temp)
                and _COMMITTED.match(final)
                and final.startswith(prefix)
                for temp, final in pairs
            ):
                return pairs
        raise SnapshotError(
            f"file sink step={self.ctx.step!r} subtask={self.ctx.subtask}: committable "
            f"{committable!r} of checkpoint {checkpoint_id} is not a file sink committable of "
            f"this subtask (expected {{'temp': '.{prefix}g<generation>-<seq>.inprogress', "
            f"'final': '{prefix}<checkpoint_id:010d>{self._ext}'}} or {{'parts': [[temp, "
            "final], ...]}}); was the step's sink replaced since the snapshot was taken?",
            reason="corrupt",
        )


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


def _check_checkpoint_id(checkpoint_id: int) -> None:
    if isinstance(checkpoint_id, bool) or not isinstance(checkpoint_id, int):
        raise DefinitionError(f"checkpoint id must be an int, got {checkpoint_id!r}")
    if checkpoint_id < 0:
        raise DefinitionError(f"checkpoint id {checkpoint_id} is negative")


def _fsync_dir(directory: str) -> None:
    # Without it a power cut can undo a create or rename that the checkpoint already relies on.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some platforms cannot open a directory
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some file systems do not sync directories; an I/O error must not pass for success.
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _compare_files(a: str, b: str) -> str:
    """``"equal"``, ``"prefix"`` (``a`` is a strict prefix of ``b``) or ``"other"``."""
    size_a, size_b = os.path.getsize(a), os.path.getsize(b)
    if size_a > size_b:
        return "other"
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while chunk := fa.read(1 << 20):
            if fb.read(len(chunk)) != chunk:
                return "other"
    return "equal" if size_a == size_b else "prefix"


def _read_claim(path: str) -> dict[str, Any] | None:
    """The claim file's content; ``None`` if there is none. Waits out a claim being written."""
    data = b""
    for _attempt in range(20):
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        if data:
            try:
                owner = orjson.loads(data)
            except orjson.JSONDecodeError:
                break
            if isinstance(owner, dict):
                return owner
            break
        time.sleep(0.05)  # created but not yet written by a writer claiming it right now
    raise ConfigError(
        f"the file sink claim {path} is unreadable ({data[:80]!r}); it names the job and step "
        "owning the directory. Delete it if this directory belongs to the step being started"
    )


def _claim(directory: str, job: str, step: str) -> None:
    """Makes (job, step) the owner of ``directory``, or raises if another one is."""
    path = os.path.join(directory, _CLAIM)
    owner = _read_claim(path)
    if owner is None:
        with contextlib.suppress(FileExistsError), open(path, "xb") as f:
            f.write(orjson.dumps({"job": job, "step": step}))  # one small write
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(directory)
        owner = _read_claim(path)
    if owner != {"job": job, "step": step}:
        raise _claimed(directory, owner or {}, job=job, step=step)


def _claimed(directory: str, owner: dict[str, Any], *, job: str, step: str | None) -> ConfigError:
    who = f"job {job!r}" + (f" step {step!r}" if step is not None else "")
    return ConfigError(
        f"FileSink directory {directory} belongs to job {owner.get('job')!r} step "
        f"{owner.get('step')!r} ({os.path.join(directory, _CLAIM)}), not to {who}: part names "
        "hold the subtask and checkpoint only, so two steps or jobs in one directory would "
        "overwrite each other's output. Give every sink step its own directory"
    )


def _mount_fstype(path: str, mountinfo: str | None = None) -> str | None:
    """The type of the file system holding ``path`` (Linux ``/proc/self/mountinfo``), or
    ``None`` when unknown."""
    if mountinfo is None:
        try:
            with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
                mountinfo = f.read()
        except OSError:
            return None
    target = os.path.realpath(path)
    best, fstype = -1, None
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right.split():
            continue
        mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= best:  # the last of equal mount points is on top
            best, fstype = len(mount), right.split()[0]
    return fstype


def _committed_parts(directory: str, extensions: tuple[str, ...]) -> Iterator[str]:
    """Committed part files with one of ``extensions``, by (subtask, checkpoint, index)."""
    found = []
    for name in os.listdir(directory):
        m = _COMMITTED.match(name)
        if m and m.group(4) in extensions:
            found.append((int(m.group(1)), int(m.group(2)), int(m.group(3) or 0), name))
    for *_key, name in sorted(found):
        yield os.path.join(directory, name)


def read_committed_lines(path: str | os.PathLike[str]) -> list[bytes]:
    """Every line of the committed line part files (``jsonl``, ``txt``) under ``path``, without
    newlines.

    Files are read in (subtask, checkpoint, index) order; in-progress files never are.

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    lines: list[bytes] = []
    for file in _committed_parts(os.fspath(path), ("jsonl", "txt")):
        with open(file, "rb") as f:
            data = f.read()
        if data:
            lines.extend(data.split(b"\n")[:-1])  # every line ends with "\n"
    return lines


def read_jsonl(path: str | os.PathLike[str]) -> list[Any]:
    """Every value of the committed ``jsonl`` part files under ``path``, decoded, in (subtask,
    checkpoint, index) order."""
    values: list[Any] = []
    for file in _committed_parts(os.fspath(path), ("jsonl",)):
        with open(file, "rb") as f:
            values.extend(map(orjson.loads, f.read().split(b"\n")[:-1]))
    return values


def read_avro(path: str | os.PathLike[str]) -> list[Any]:
    """Every record of the committed Avro part files under ``path``, in (subtask, checkpoint,
    index) order, decoded with each file's own writer schema.

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    records: list[Any] = []
    for file in _committed_parts(os.fspath(path), ("avro",)):
        with open(file, "rb") as f:
            records.extend(fastavro.reader(f))
    return records


def read_committed(path: str | os.PathLike[str]) -> list[Any]:
    """Every committed value under ``path`` whatever its format, in (subtask, checkpoint,
    index) order: JSON lines decoded, raw lines as ``bytes``, Avro records decoded."""
    values: list[Any] = []
    for file in _committed_parts(os.fspath(path), ("jsonl", "txt", "avro")):
        with open(file, "rb") as f:
            if file.endswith(".avro"):
                values.extend(fastavro.reader(f))
                continue
            lines = f.read().split(b"\n")[:-1]
        values.extend(map(orjson.loads, lines) if file.endswith(".jsonl") else lines)
    return values
