"""The writer of one file sink subtask: the two-phase commit of its part files."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import fastavro

from processor.contracts import SinkContext
from processor.errors import ConfigError, DefinitionError, SerializationError, SnapshotError
from processor.snapshot.store import SnapshotStore
from sinks.files.directory import _COMMITTED, _EXTENSIONS, _claim, _compare_files, _fsync_dir
from sinks.files.parts import _ENCODERS, _avro_mismatch, _AvroPart, _LinePart

__all__ = ["FileSinkWriter"]

log = logging.getLogger(__name__)


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


def _check_checkpoint_id(checkpoint_id: int) -> None:
    if isinstance(checkpoint_id, bool) or not isinstance(checkpoint_id, int):
        raise DefinitionError(f"checkpoint id must be an int, got {checkpoint_id!r}")
    if checkpoint_id < 0:
        raise DefinitionError(f"checkpoint id {checkpoint_id} is negative")
