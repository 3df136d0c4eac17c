"""Conditional writes on a snapshot store's filesystem: what a remote job lease stands on.

A lease on a store that many hosts share cannot be "read, see nobody holds it, write": two
runners can both read "free" and both write (issue 35, item 7). It needs writes that the store
itself refuses when the object changed since it was read:

* **S3** (``s3://``, through s3fs): ``PutObject`` with ``If-None-Match: *`` creates an object
  only if it does not exist, ``If-Match: <etag>`` replaces it only if it is still the version
  read; S3 answers ``412 Precondition Failed`` otherwise (AWS S3 since 2024). Before the first
  lease, :meth:`ConditionalFiles.check` makes sure the store really refuses such writes: an
  S3-compatible store that ignores the headers would turn the lease back into check-then-write,
  so it is refused with :class:`~processor.errors.ConfigError`, never used.
* **memory://** (tests): one process's dictionary; a lock makes the check and the write one
  step, which is all a process-local store needs.

Every other filesystem (``gs://``, ``hdfs://``, ``abfs://``...) is refused with a message
that says what works. A local ``file://`` store does not come here: its lease is an ``flock``
(:mod:`processor.snapshot.lease`).

Invariants:
    ``create`` and ``replace`` either write and return the new version, or write nothing and
    raise :class:`ConditionFailed`. A version is the one the store itself reports (S3: the
    ETag), compared by the store, not by eosflow.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from processor.errors import ConfigError

if TYPE_CHECKING:
    from fsspec.implementations.memory import MemoryFileSystem

__all__ = ["ConditionFailed", "ConditionalFiles", "Versioned", "conditional_files"]


class ConditionFailed(Exception):
    """The store refused a conditional write: the object exists (create), or changed or is gone
    (replace). Nothing was written."""


@dataclass(frozen=True)
class Versioned:
    """An object's bytes and the version the store gave them (S3: the ETag)."""

    data: bytes
    version: str


class ConditionalFiles(Protocol):
    """Reads and conditional writes of single small objects, by path in the store's filesystem."""

    def check(self, probe: str) -> None:
        """Makes sure the store refuses conditional writes whose condition fails (``probe``:
        a path of this caller's own, created and deleted). Raises :class:`ConfigError` if it
        does not."""

    def read(self, path: str) -> Versioned | None:
        """The object and its version (one request: both belong together), or ``None``."""

    def create(self, path: str, data: bytes) -> str:
        """Writes ``path`` only if it does not exist; its new version."""

    def replace(self, path: str, data: bytes, version: str) -> str:
        """Writes ``path`` only if its version is still ``version``; its new version."""


def conditional_files(fs: Any, url: str) -> ConditionalFiles:
    """The conditional writes of the fsspec filesystem ``fs`` (the store at ``url``).

    Raises:
        ConfigError: the filesystem has none eosflow can use.
    """
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if "memory" in protocols:  # fsspec's MemoryFileSystem (not imported for a local store)
        return _Memory(fs)
    if "s3" in protocols and hasattr(fs, "_call_s3"):
        return _S3(fs, url)
    raise ConfigError(
        f"the snapshot store {url} ({type(fs).__name__}, protocol {'/'.join(protocols)}) "
        "offers no conditional writes that eosflow can use, and the job lease on a shared "
        "store needs them: without them two runners of one job can both believe they hold it. "
        "Use an s3:// store (AWS S3, or an S3-compatible store that honours If-None-Match and "
        "If-Match on PutObject), or a file:// store on the runner's own disk "
        "(--snapshot-url file:///path)"
    )


# -- S3 ------------------------------------------------------------------------------------------

_CONFLICT = "ConditionalRequestConflict"  # 409: another conditional write to the key in flight
_REFUSED = {"PreconditionFailed", "412", "NoSuchKey", "404", _CONFLICT}


def _s3_code(exc: BaseException) -> str | None:
    """The S3 error code behind an s3fs exception (s3fs keeps botocore's error as the cause)."""
    for err in (exc, exc.__cause__):
        response = getattr(err, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return str(code or status)
    return None


class _S3:
    def __init__(self, fs: Any, url: str) -> None:
        self._fs, self._url = fs, url

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        from fsspec.asyn import sync

        bucket, key, _ = self._fs.split_path(path)

        async def call() -> Any:
            out = await self._fs._call_s3(method, Bucket=bucket, Key=key, **kwargs)
            if method == "get_object":  # the body of the same response as the ETag
                body = out["Body"]
                try:
                    out["Body"] = await body.read()
                finally:
                    body.close()
            return out

        try:
            return sync(self._fs.loop, call)
        except Exception as exc:
            if method == "put_object" and _s3_code(exc) in _REFUSED:
                raise ConditionFailed(f"{path}: {_s3_code(exc)}") from exc
            if type(exc).__name__ == "ParamValidationError":  # botocore predates the headers
                raise ConfigError(
                    f"the snapshot store {self._url}: this botocore cannot send S3's conditional "
                    f"writes, which the job lease needs ({exc}): pip install -U 'eosflow[s3]' "
                    "(botocore 1.35.69 or newer)"
                ) from None
            raise
        finally:
            self._fs.invalidate_cache(path)

    def read(self, path: str) -> Versioned | None:
        try:
            out = self._call("get_object", path)
        except FileNotFoundError:
            return None
        return Versioned(bytes(out["Body"]), str(out["ETag"]))

    def create(self, path: str, data: bytes) -> str:
        return str(self._call("put_object", path, Body=data, IfNoneMatch="*")["ETag"])

    def replace(self, path: str, data: bytes, version: str) -> str:
        return str(self._call("put_object", path, Body=data, IfMatch=version)["ETag"])

    def check(self, probe: str) -> None:
        self._call("put_object", probe, Body=b"probe")
        ignored = []
        try:
            self.create(probe, b"created over an existing object")
            ignored.append("If-None-Match: *")
        except ConditionFailed:
            pass
        try:
            self.replace(probe, b"replaced another version", f'"{"0" * 32}"')  # not b"probe"'s md5
            ignored.append("If-Match")
        except ConditionFailed:
            pass
        with contextlib.suppress(OSError):
            self._fs.rm_file(probe)
        if ignored:
            raise ConfigError(
                f"the snapshot store {self._url} ignored a conditional write "
                f"({' and '.join(ignored)}): it wrote where S3 answers 412 Precondition Failed. "
                "The job lease needs conditional writes (without them two runners of one job "
                "can both believe they hold it). Use AWS S3 or an S3-compatible store that "
                "supports conditional PutObject (If-None-Match and If-Match), or a file:// store "
                "on the runner's own disk"
            )


# -- memory:// -----------------------------------------------------------------------------------

_MEMORY_LOCK = threading.Lock()


class _Memory:
    """fsspec's memory filesystem is one process's dictionary: a lock makes each conditional
    write atomic for every user there is. The version is the content's hash, as an S3 ETag is."""

    def __init__(self, fs: MemoryFileSystem) -> None:
        self._fs = fs

    def check(self, probe: str) -> None:
        return None

    def _current(self, path: str) -> Versioned | None:
        try:
            data = bytes(self._fs.cat_file(path))
        except FileNotFoundError:
            return None
        return Versioned(data, hashlib.blake2b(data, digest_size=16).hexdigest())

    def read(self, path: str) -> Versioned | None:
        with _MEMORY_LOCK:
            return self._current(path)

    def _write(self, path: str, data: bytes) -> str:
        self._fs.pipe_file(path, data)
        return hashlib.blake2b(data, digest_size=16).hexdigest()

    def create(self, path: str, data: bytes) -> str:
        with _MEMORY_LOCK:
            if self._current(path) is not None:
                raise ConditionFailed(f"{path} exists")
            return self._write(path, data)

    def replace(self, path: str, data: bytes, version: str) -> str:
        with _MEMORY_LOCK:
            current = self._current(path)
            if current is None or current.version != version:
                raise ConditionFailed(f"{path} is not version {version}")
            return self._write(path, data)
