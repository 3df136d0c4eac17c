"""File sink: part files written under hidden temporary names, renamed atomically on commit.

Layout of the output directory (DESIGN.md, "Sinks: two-phase commit")::

    part-<subtask:05d>-<checkpoint_id:010d>.jsonl          committed; one per subtask and epoch
    .part-<subtask:05d>-g<generation>-<seq>.inprogress     being written, or prepared (hidden)

Every value is one line. Readers glob ``part-*`` (or call :func:`read_committed_lines` /
:func:`read_jsonl`) and see committed epochs only: a part file appears whole, by ``os.replace``,
when its checkpoint completes. Give every sink step its own directory: part file names hold the
subtask and the checkpoint, not the step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Callable, Sequence
from typing import IO, Any

import orjson

from processor.contracts import SinkContext
from processor.errors import ConfigError, DefinitionError, SerializationError, SnapshotError

__all__ = ["FileSink", "FileSinkWriter", "read_committed_lines", "read_jsonl"]

log = logging.getLogger(__name__)

#: Output format -> extension of its committed part files.
_EXTENSIONS = {"jsonl": ".jsonl", "raw": ".txt"}
_COMMITTED = re.compile(r"part-\d{5,}-\d{10}\.(?:jsonl|txt)\Z")
_MAX_CHECKPOINT_ID = 10**10  # part names hold 10 digits


class FileSink:
    """Writes every value as one line of part files in a directory, exactly once.

    Args:
        path: the output directory, created by the writers if missing.
        format: ``"jsonl"`` (each value as ``orjson.dumps(value)``, files ending in ``.jsonl``)
            or ``"raw"`` (each value a ``bytes`` or ``str`` line, ``str`` encoded as UTF-8,
            files ending in ``.txt``).
        encoder: encodes one value to the bytes of its line, in place of the format's encoding
            (the extension still follows ``format``). The sink adds the newline.

    A line must not contain a newline (``"\\n"``): the value would read back as two lines.

    Raises:
        ConfigError: ``format`` is unknown or ``encoder`` is not callable.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        format: str = "jsonl",
        encoder: Callable[[Any], bytes] | None = None,
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
        # Configuration only: the directory is created by the writers, in the worker processes.
        self.path = os.fspath(path)
        self.format = format
        self.encoder = encoder

    def __repr__(self) -> str:
        return f"FileSink({self.path!r}, format={self.format!r})"

    def open(self, ctx: SinkContext) -> FileSinkWriter:
        """A writer for subtask ``ctx.subtask`` (creates the output directory if missing)."""
        return FileSinkWriter(self.path, ctx, format=self.format, encoder=self.encoder)


class FileSinkWriter:
    """One subtask's writer of a :class:`FileSink`.

    Per epoch: the first non-empty ``write`` creates the hidden in-progress file;
    ``prepare(checkpoint_id)`` fsyncs and closes it and returns the committable
    ``{"temp": <in-progress name>, "final": <part name>}`` (names relative to the directory);
    ``commit`` renames temp to final. The next write starts a new in-progress file.

    Invariants:
        Nothing is visible under ``part-*`` before ``commit``: output is staged under hidden
        names that readers' globs do not match, and appears whole by an atomic rename.
        A prepared file is durable (its data and its directory entry fsynced) before
        ``prepare`` returns, so a completed checkpoint's committable names data that exists.
        ``commit`` is idempotent: a temp already renamed (final present, temp gone) is done.
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
    ) -> None:
        self.ctx = ctx
        self.directory = path
        self._ext = _EXTENSIONS[format]
        self._encode_one = encoder if encoder is not None else _ENCODERS[format]
        # orjson never writes a newline without OPT_INDENT_2; other encodings are checked.
        self._check_newlines = encoder is not None or format != "jsonl"
        self._temp_pattern = re.compile(rf"\.part-{ctx.subtask:05d}-g\d+-\d+\.inprogress\Z")
        self._file: IO[bytes] | None = None
        self._temp: str | None = None
        self._seq = 0
        self._records = 0
        self._bytes = 0
        self._prepared: set[str] = set()  # temps prepared by this writer, not yet committed
        os.makedirs(path, exist_ok=True)

    def __repr__(self) -> str:
        ctx = self.ctx
        return f"FileSinkWriter({self.directory!r}, step={ctx.step!r}, subtask={ctx.subtask})"

    # -- epoch -----------------------------------------------------------------------------------

    def write(self, values: Sequence[Any]) -> None:
        """Appends ``values`` to the epoch's in-progress file, one line each.

        Raises:
            SerializationError: a value cannot be encoded (nothing of this call is written).
        """
        if not values:
            return
        data = b"".join([self._line(value) for value in values])
        if self._file is None:
            self._file = self._create_temp()
        self._file.write(data)
        self._records += len(values)
        self._bytes += len(data)

    def prepare(self, checkpoint_id: int) -> dict[str, str] | None:
        """Makes the epoch's file durable (still hidden); returns its committable, or ``None``
        when the epoch wrote nothing."""
        _check_checkpoint_id(checkpoint_id)
        if self._file is None or self._temp is None:
            return None
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        temp, self._file, self._temp = self._temp, None, None
        _fsync_dir(self.directory)  # the temp's directory entry, created this epoch
        final = f"part-{self.ctx.subtask:05d}-{checkpoint_id:010d}{self._ext}"
        self._prepared.add(temp)
        log.info(
            "prepared checkpoint_id=%d step=%r subtask=%d temp=%s records=%d bytes=%d",
            checkpoint_id,
            self.ctx.step,
            self.ctx.subtask,
            temp,
            self._records,
            self._bytes,
        )
        self._records = self._bytes = 0
        return {"temp": temp, "final": final}

    def commit(self, checkpoint_id: int, committable: Any) -> None:
        """Renames the prepared file to its part name. Idempotent; ``None`` is a no-op.

        Raises:
            SnapshotError: ``missing`` when neither the temp nor the final file exists (the
                prepared output was deleted, or the sink points at another directory);
                ``corrupt`` when ``committable`` is not one of this subtask's committables.
        """
        if committable is None:
            return
        temp, final = self._parse(checkpoint_id, committable)
        temp_path = os.path.join(self.directory, temp)
        final_path = os.path.join(self.directory, final)
        try:
            os.replace(temp_path, final_path)
        except FileNotFoundError:
            if not os.path.exists(final_path):
                raise SnapshotError(
                    f"file sink step={self.ctx.step!r} subtask={self.ctx.subtask}: the output "
                    f"of checkpoint {checkpoint_id} is missing: neither {temp} (prepared) nor "
                    f"{final} (committed) exists in {self.directory}. Committing it would lose "
                    "that epoch's records. Check that the sink writes to the directory it used "
                    "before the restart and that nothing deletes part or .inprogress files there",
                    reason="missing",
                    path=temp_path,
                ) from None
            log.info(
                "already committed checkpoint_id=%d step=%r subtask=%d final=%s",
                checkpoint_id,
                self.ctx.step,
                self.ctx.subtask,
                final,
            )
        else:
            log.info(
                "committed checkpoint_id=%d step=%r subtask=%d final=%s",
                checkpoint_id,
                self.ctx.step,
                self.ctx.subtask,
                final,
            )
        # Also after "already committed": a crash may have come between rename and fsync.
        _fsync_dir(self.directory)
        self._prepared.discard(temp)

    def recover(self, pending: Sequence[tuple[int, Any]]) -> None:
        """Commits ``pending`` in order, then deletes this subtask's other in-progress files
        (orphans of epochs after the restored checkpoint). Idempotent.

        Raises:
            SnapshotError: as :meth:`commit`.
        """
        keep = set(self._prepared)
        for checkpoint_id, committable in pending:
            self.commit(checkpoint_id, committable)
            if committable is not None:
                keep.add(committable["temp"])
        if self._temp is not None:
            keep.add(self._temp)
        deleted = 0
        for name in sorted(os.listdir(self.directory)):
            if self._temp_pattern.match(name) and name not in keep:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(self.directory, name))
                    deleted += 1
                log.debug(
                    "deleted orphan step=%r subtask=%d temp=%s",
                    self.ctx.step,
                    self.ctx.subtask,
                    name,
                )
        if deleted:
            _fsync_dir(self.directory)
        log.info(
            "recovered step=%r subtask=%d generation=%d pending=%d orphans_deleted=%d",
            self.ctx.step,
            self.ctx.subtask,
            self.ctx.generation,
            len(pending),
            deleted,
        )

    def close(self) -> None:
        """Closes the in-progress file, if any, without deleting it (``recover`` does)."""
        if self._file is not None:
            self._file.close()
            log.debug(
                "closed step=%r subtask=%d unprepared_temp=%s",
                self.ctx.step,
                self.ctx.subtask,
                self._temp,
            )
        self._file = self._temp = None

    # -- helpers ---------------------------------------------------------------------------------

    def _line(self, value: Any) -> bytes:
        try:
            data = self._encode_one(value)
        except Exception as exc:
            raise self._unencodable(value, f"{type(exc).__name__}: {exc}") from exc
        if not isinstance(data, bytes):
            raise self._unencodable(value, f"encoder returned {type(data).__name__}, not bytes")
        if self._check_newlines and b"\n" in data:
            raise self._unencodable(value, "its line contains a newline")
        return data + b"\n"

    def _unencodable(self, value: Any, why: str) -> SerializationError:
        return SerializationError(
            f"file sink step={self.ctx.step!r} subtask={self.ctx.subtask} could not encode a "
            f"value of type {type(value).__name__}: {why}. Convert it in a map step before the "
            "sink, or give FileSink an encoder= that handles it"
        )

    def _create_temp(self) -> IO[bytes]:
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
            return file

    def _parse(self, checkpoint_id: int, committable: Any) -> tuple[str, str]:
        temp = committable.get("temp") if isinstance(committable, dict) else None
        final = committable.get("final") if isinstance(committable, dict) else None
        prefix = f"part-{self.ctx.subtask:05d}-"
        if (
            not isinstance(temp, str)
            or not isinstance(final, str)
            or not self._temp_pattern.match(temp)
            or not _COMMITTED.match(final)
            or not final.startswith(prefix)
        ):
            raise SnapshotError(
                f"file sink step={self.ctx.step!r} subtask={self.ctx.subtask}: committable "
                f"{committable!r} of checkpoint {checkpoint_id} is not a file sink committable "
                f"of this subtask (expected {{'temp': '.{prefix}g<generation>-<seq>.inprogress', "
                f"'final': '{prefix}<checkpoint_id:010d>{self._ext}'}}); was the step's sink "
                "replaced since the snapshot was taken?",
                reason="corrupt",
            )
        return temp, final


def _encode_raw(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    raise TypeError("format 'raw' takes bytes or str values")


_ENCODERS: dict[str, Callable[[Any], bytes]] = {"jsonl": orjson.dumps, "raw": _encode_raw}


def _check_checkpoint_id(checkpoint_id: int) -> None:
    if isinstance(checkpoint_id, bool) or not isinstance(checkpoint_id, int):
        raise DefinitionError(f"checkpoint id must be an int, got {checkpoint_id!r}")
    if not 0 <= checkpoint_id < _MAX_CHECKPOINT_ID:
        raise DefinitionError(f"checkpoint id {checkpoint_id} is outside [0, 10**10)")


def _fsync_dir(directory: str) -> None:
    # Without it a power cut can undo a create or rename that the checkpoint already relies on.
    with contextlib.suppress(OSError):  # some platforms cannot open a directory
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def read_committed_lines(path: str | os.PathLike[str]) -> list[bytes]:
    """Every line of the committed part files under ``path``, without newlines.

    Files are read in name order (subtask, then checkpoint); in-progress files never are.

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    directory = os.fspath(path)
    lines: list[bytes] = []
    for name in sorted(n for n in os.listdir(directory) if _COMMITTED.match(n)):
        with open(os.path.join(directory, name), "rb") as f:
            data = f.read()
        if data:
            lines.extend(data.split(b"\n")[:-1])  # every line ends with "\n"
    return lines


def read_jsonl(path: str | os.PathLike[str]) -> list[Any]:
    """Every value of the committed part files under ``path`` (as :func:`read_committed_lines`),
    decoded from JSON."""
    return [orjson.loads(line) for line in read_committed_lines(path)]
