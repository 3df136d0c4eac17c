"""A local directory as the few filesystem calls the snapshot store uses, without fsspec.

Every worker and the runner open the snapshot store on their start path, and nearly every job
keeps its checkpoints on a local disk (``file://``, the default). fsspec's import (with
``importlib.metadata``, ``email`` and ``configparser`` behind it) was about a fifth of a worker's
imports (``bench/RESULTS.md``, "Start-up without fsspec"). So a local
store is served here, in the calls the store, the savepoints and the Kafka sink's staging make,
with fsspec's ``LocalFileSystem`` semantics (absolute POSIX paths without a trailing ``/``;
listings of full paths); every other URL (``s3://``, ``memory://``, chained URLs, or a local
one with storage options) goes to fsspec, imported then.

Invariants:
    :func:`open_fs` returns the root fsspec's ``url_to_fs`` returns for the same URL, and
    :class:`LocalFiles` names paths as its ``LocalFileSystem`` does, so a listing compares equal
    to the paths the caller built (the staged sink keeps what a listing returns).
"""

from __future__ import annotations

import contextlib
import glob as _glob
import os
import shutil
from typing import IO, Any

__all__ = ["LocalFiles", "open_fs"]


def open_fs(url: str, **storage_options: Any) -> tuple[Any, str]:
    """``(filesystem, root path)`` for ``url``, as fsspec's ``url_to_fs`` (a
    :class:`LocalFiles` for a local path or ``file://`` URL without options)."""
    local = url.startswith("file://") or ("://" not in url and not url.startswith("file:"))
    if local and not storage_options and "::" not in url:
        return LocalFiles(), _path(url)
    from fsspec.core import url_to_fs

    return url_to_fs(url, **storage_options)  # type: ignore[no-any-return]


def _path(path: str) -> str:
    """fsspec's ``LocalFileSystem._strip_protocol`` on POSIX: absolute, no trailing ``/``."""
    if path.startswith("file://"):
        path = path.removeprefix("file://")
    if not path.startswith("/"):
        if path.startswith("~"):
            path = os.path.expanduser(path)
        else:
            path = path.removeprefix("./") if path != "." else ""
            path = f"{os.getcwd()}/{path}"
    return path.rstrip("/") or "/"


class LocalFiles:
    """The calls of fsspec's ``LocalFileSystem`` the snapshot store, the savepoints and the
    staged Kafka sink make, on this host's files."""

    protocol = ("file", "local")

    def cat_file(self, path: str) -> bytes:
        with open(_path(path), "rb") as f:
            return f.read()

    def pipe_file(self, path: str, data: bytes) -> None:
        with open(_path(path), "wb") as f:
            f.write(data)

    def open(self, path: str, mode: str = "rb") -> IO[Any]:
        return open(_path(path), mode)

    def exists(self, path: str) -> bool:
        return os.path.lexists(_path(path))

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(_path(path), exist_ok=exist_ok)

    def mv(self, path1: str, path2: str) -> None:
        shutil.move(_path(path1), _path(path2))

    def rm_file(self, path: str) -> None:
        os.remove(_path(path))

    def rm(self, path: str, recursive: bool = False) -> None:
        path = _path(path)
        if os.path.isdir(path) and not os.path.islink(path):
            if not recursive:
                raise ValueError("Cannot delete directory, set recursive=True")
            shutil.rmtree(path)
        else:
            os.remove(path)

    def glob(self, pattern: str) -> list[str]:
        return sorted(_path(p) for p in _glob.glob(_path(pattern)))

    def ls(self, path: str, detail: bool = False) -> list[Any]:
        """The entries of directory ``path`` (full paths; with ``detail``: dicts of ``name``,
        ``size`` and ``type``), or ``path`` itself if it is a file. Raises
        ``FileNotFoundError`` if it does not exist."""
        path = _path(path)
        if not os.path.isdir(path):
            return [self._info(path)] if detail else [self._info(path)["name"]]
        found: list[Any] = []
        with os.scandir(path) as entries:
            for entry in entries:
                name = os.path.join(path, entry.name)
                if not detail:
                    found.append(name)
                    continue
                with contextlib.suppress(FileNotFoundError):  # gone since: fsspec skips it
                    found.append(self._info(name))
        return found

    @staticmethod
    def _info(path: str) -> dict[str, Any]:
        st = os.lstat(path)
        if os.path.islink(path):
            st = os.stat(path)
        kind = "directory" if os.path.isdir(path) else "file"
        return {"name": path, "size": st.st_size, "type": kind}
