"""The output directory of a file sink: the names in it, the claim naming the (job, step) that
owns it, the file system it is on, and what makes its creates and renames durable.

The layout is in the package docstring (:mod:`sinks.files`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import time
from typing import Any

import orjson

from processor.errors import ConfigError

__all__: list[str] = []

#: Output format -> extension of its committed part files.
_EXTENSIONS = {"jsonl": ".jsonl", "raw": ".txt", "avro": ".avro"}
_COMMITTED = re.compile(r"part-(\d{5,})-(\d{10,})(?:-(\d{4,}))?\.(jsonl|txt|avro)\Z")
_CLAIM = ".eosflow-sink.json"
#: FUSE file systems over object stores: their rename is a copy then a delete (or missing).
_NON_ATOMIC_RENAME = frozenset(
    {"fuse.s3fs", "fuse.goofys", "fuse.geesefs", "fuse.gcsfuse", "fuse.mountpoint-s3",
     "fuse.rclone", "fuse.blobfuse", "fuse.blobfuse2"}
)  # fmt: skip


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
