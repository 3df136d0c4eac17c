"""Reading what file sinks committed: part files in (subtask, checkpoint, index) order,
never in-progress files."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import fastavro
import orjson

from sinks.files.directory import _COMMITTED

__all__ = ["read_avro", "read_committed", "read_committed_lines", "read_jsonl"]


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
