"""Snapshot and manifest files: their bytes and the values they stand for (no I/O).

:mod:`processor.snapshot.store` decides where these files go and when they are written; this
module only turns values into bytes and back, and refuses bytes that do not check out.

A snapshot file is a 32-byte header, then the body (:func:`processor.snapshot.codec.dumps`)::

    magic b"EOSF" | format version u16 | flags u16 | body length u64 | BLAKE2b-128 of the body

A manifest (``<job>/chk-<id>/_MANIFEST``) is JSON: ``format_version``, ``job``,
``checkpoint_id``, ``created_ms``, ``tasks`` (task -> ``file``, ``size``, ``checksum``) and the
coordinator's ``metadata``.

Invariants:
    A snapshot or manifest whose checksum, length, version or shape does not check out is
    refused with :class:`SnapshotError` (``corrupt`` or ``unknown_version``), never half-read.
    A manifest names only files of its own checkpoint directory.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from processor.errors import DefinitionError, SerializationError, SnapshotError
from processor.snapshot.codec import dumps, loads

__all__ = [
    "FORMAT_VERSION",
    "Manifest",
    "SnapshotHandle",
    "decode_manifest",
    "decode_snapshot",
    "encode_manifest",
    "encode_snapshot",
]

#: Version of the snapshot file and manifest formats this eosflow writes and reads.
FORMAT_VERSION = 1

_MAGIC = b"EOSF"
_KNOWN_FLAGS = 0  # no flag defined in version 1; a set bit means a newer writer (compression...)
_HEADER = struct.Struct("<4sHHQ16s")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}\Z")


@dataclass(frozen=True)
class SnapshotHandle:
    """Where one task's snapshot of one checkpoint was written.

    Attributes:
        path: the file, as a path of the store's filesystem.
        size: file size in bytes, header included.
        checksum: hex BLAKE2b-128 of the body, as in the file's header.
    """

    path: str
    size: int
    checksum: str


@dataclass(frozen=True)
class Manifest:
    """A completed checkpoint: what every task wrote, plus the coordinator's metadata.

    Attributes:
        job: the job name.
        checkpoint_id: the checkpoint.
        created_ms: when the manifest was written, epoch milliseconds.
        tasks: task name -> its snapshot.
        metadata: what the coordinator recorded (source offsets, generation...), as read back
            from JSON: tuples come back as lists.
        format_version: the format the manifest was written in.
    """

    job: str
    checkpoint_id: int
    created_ms: int
    tasks: Mapping[str, SnapshotHandle]
    metadata: Mapping[str, Any]
    format_version: int = FORMAT_VERSION


def encode_snapshot(state: Any) -> tuple[bytes, str]:
    """The bytes of a snapshot file holding ``state``, and the body's hex checksum."""
    body = dumps(state)
    digest = hashlib.blake2b(body, digest_size=16).digest()
    return _HEADER.pack(_MAGIC, FORMAT_VERSION, 0, len(body), digest) + body, digest.hex()


def decode_snapshot(blob: bytes, path: str) -> Any:
    """The state held by the snapshot file ``blob`` (read from ``path``, named in errors).

    Raises:
        SnapshotError: ``unknown_version`` for a newer format, ``corrupt`` for anything else
            that does not check out.
    """
    if len(blob) < _HEADER.size:
        raise corrupt(path, f"{len(blob)} bytes, shorter than the {_HEADER.size}-byte header")
    magic, version, flags, length, digest = _HEADER.unpack_from(blob)
    if magic != _MAGIC:
        raise corrupt(path, f"not an eosflow snapshot (starts with {magic!r}, not {_MAGIC!r})")
    if version > FORMAT_VERSION:
        raise SnapshotError(
            f"{path}: snapshot format version {version} is newer than this eosflow supports "
            f"({FORMAT_VERSION}): upgrade eosflow",
            reason="unknown_version",
            path=path,
        )
    if version == 0:
        raise corrupt(path, "format version 0 does not exist")
    if flags & ~_KNOWN_FLAGS:
        raise SnapshotError(
            f"{path}: snapshot uses flags {flags:#06x} unknown to this eosflow: upgrade eosflow",
            reason="unknown_version",
            path=path,
        )
    body = blob[_HEADER.size :]
    if len(body) != length:
        raise corrupt(path, f"header says {length} body bytes, file has {len(body)}")
    actual = hashlib.blake2b(body, digest_size=16).digest()
    if actual != digest:
        raise corrupt(path, f"checksum {actual.hex()} does not match {digest.hex()}")
    try:
        return loads(body)
    except SnapshotError as exc:
        raise corrupt(path, str(exc)) from exc


def corrupt(path: str, what: str) -> SnapshotError:
    return SnapshotError(f"snapshot {path} is corrupt: {what}", reason="corrupt", path=path)


def check_name(kind: str, name: str) -> None:
    if not isinstance(name, str) or not _NAME.match(name):
        raise DefinitionError(
            f"{kind} name {name!r} cannot name a snapshot file: use letters, digits, '.', '_' "
            "and '-', starting with a letter or digit (at most 200 characters)"
        )


def is_task_file(task: str, name: str) -> bool:
    """``<task>.snap``, or ``<task>.g<incarnation>.snap``: nothing that points elsewhere."""
    return (
        name == f"{task}.snap" or re.fullmatch(re.escape(task) + r"\.g\d+\.snap", name) is not None
    )


def encode_manifest(
    job: str,
    checkpoint_id: int,
    created_ms: int,
    tasks: Mapping[str, SnapshotHandle],
    metadata: Mapping[str, Any],
) -> bytes:
    """The manifest file of a completed checkpoint.

    Raises:
        SerializationError: ``metadata`` is not JSON (str keys; str, int, float, bool, None,
            list, dict values).
    """
    document = {
        "format_version": FORMAT_VERSION,
        "job": job,
        "checkpoint_id": checkpoint_id,
        "created_ms": created_ms,
        "tasks": {
            task: {"file": h.path.rsplit("/", 1)[-1], "size": h.size, "checksum": h.checksum}
            for task, h in tasks.items()
        },
        "metadata": metadata,
    }
    try:
        return orjson.dumps(document, option=orjson.OPT_INDENT_2)
    except orjson.JSONEncodeError as exc:
        raise SerializationError(
            f"checkpoint {checkpoint_id} metadata is not JSON: {exc}; use str keys and "
            "JSON values (offsets as lists or str-keyed dicts)"
        ) from None


def decode_manifest(blob: bytes, path: str, job: str, checkpoint_id: int) -> Manifest:
    """The manifest file ``blob``, read from ``path`` (in checkpoint ``checkpoint_id``'s
    directory, where its snapshots are).

    Raises:
        SnapshotError: ``unknown_version`` or ``corrupt``.
    """
    chk = path.rsplit("/", 1)[0]
    try:
        raw = orjson.loads(blob)
    except orjson.JSONDecodeError as exc:
        raise corrupt(path, f"manifest is not JSON ({exc})") from None
    try:
        version = raw["format_version"]
        if version > FORMAT_VERSION:
            raise SnapshotError(
                f"{path}: manifest format version {version} is newer than this eosflow "
                f"supports ({FORMAT_VERSION}): upgrade eosflow",
                reason="unknown_version",
                path=path,
            )
        if version < 1 or raw["checkpoint_id"] != checkpoint_id:
            raise corrupt(path, f"version {version}, checkpoint {raw['checkpoint_id']}")
        handles = {}
        for task, entry in raw["tasks"].items():
            check_name("task", task)  # a forged manifest must not point outside chk
            if not is_task_file(task, entry["file"]):
                raise corrupt(path, f"task {task!r} names file {entry['file']!r}")
            handles[task] = SnapshotHandle(
                f"{chk}/{entry['file']}", int(entry["size"]), str(entry["checksum"])
            )
        return Manifest(
            job=job,
            checkpoint_id=checkpoint_id,
            created_ms=int(raw["created_ms"]),
            tasks=handles,
            metadata=dict(raw["metadata"]),
            format_version=version,
        )
    except (KeyError, TypeError, ValueError, AttributeError, DefinitionError) as exc:
        raise corrupt(path, f"manifest is malformed ({type(exc).__name__}: {exc})") from None
