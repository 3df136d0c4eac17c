"""Checkpoint storage on any fsspec URL: task snapshots, manifests, retention, job files.

Layout under the store URL (``file://`` by default; ``s3://``, ``hdfs://``, ``memory://`` ...)::

    <job>/chk-<id:010d>/<task>.g<n>.snap  one per task (n: the writer's generation), written
                                         while the checkpoint is pending
    <job>/chk-<id:010d>/_MANIFEST       JSON, written only when every task has acknowledged
    <job>/_GENERATION, _LEASE, ...      the job's bookkeeping files (:meth:`SnapshotStore.job_file`)

The files' bytes are :mod:`processor.snapshot.fileformat`'s; this module decides where they go
and when.

Invariants:
    A checkpoint is completed iff its ``_MANIFEST`` exists, and a manifest is written only after
    every snapshot it names. Every file is written under a temporary name and renamed, so a
    reader never takes a partial write for a snapshot or a manifest. The newest usable
    completed checkpoint is never deleted. A snapshot whose checksum, length or version does not
    check out is refused with :class:`SnapshotError`, never half-read.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from processor.errors import ConfigError, DefinitionError, SnapshotError
from processor.snapshot.conditional import ConditionalFiles, conditional_files
from processor.snapshot.fileformat import (
    FORMAT_VERSION,
    Manifest,
    SnapshotHandle,
    check_name,
    corrupt,
    decode_manifest,
    decode_snapshot,
    encode_manifest,
    encode_snapshot,
    is_task_file,
)
from processor.snapshot.localfs import LocalFiles, open_fs

# FORMAT_VERSION, Manifest, SnapshotHandle and the snapshot codec are fileformat's, named here
# too: the engine imports what it stores from the store.
__all__ = [
    "FORMAT_VERSION",
    "MANIFEST",
    "Manifest",
    "SnapshotHandle",
    "SnapshotStore",
    "decode_snapshot",
    "encode_snapshot",
]

log = logging.getLogger(__name__)

#: Name of the file whose presence makes a checkpoint completed.
MANIFEST = "_MANIFEST"

GENERATION_FILE = "_GENERATION"
_CHK = re.compile(r"chk-(\d{10})\Z")


class SnapshotStore:
    """Task snapshots and checkpoint manifests under one fsspec URL.

    Args:
        url: where checkpoints live, e.g. ``file:///var/lib/eosflow/checkpoints`` or
            ``s3://bucket/eosflow``.
        clock: epoch seconds, for the manifest's ``created_ms`` (tests pass a manual clock).
        storage_options: passed to the fsspec filesystem (credentials, endpoint...).

    Invariants:
        Methods are safe to retry: ``complete`` of an already completed checkpoint with the same
        snapshots does nothing; ``discard`` of a missing checkpoint does nothing.
    """

    def __init__(
        self, url: str, *, clock: Callable[[], float] = time.time, **storage_options: Any
    ) -> None:
        self.url = url
        self._fs, root = open_fs(url, **storage_options)
        self._root = root.rstrip("/")
        self._clock = clock
        # Local disks get fsync before the rename: without it, a power cut can leave a renamed
        # but empty file, and the checkpoint would look complete.
        self._local = isinstance(self._fs, LocalFiles)
        self._conditional: ConditionalFiles | None = None

    def __repr__(self) -> str:
        return f"SnapshotStore({self.url!r})"

    # -- paths ---------------------------------------------------------------------------------

    def _job_dir(self, job: str) -> str:
        check_name("job", job)
        return f"{self._root}/{job}"

    def _chk_dir(self, job: str, checkpoint_id: int) -> str:
        if isinstance(checkpoint_id, bool) or not isinstance(checkpoint_id, int):
            raise DefinitionError(f"checkpoint id must be an int, got {checkpoint_id!r}")
        if not 0 <= checkpoint_id < 10**10:
            raise DefinitionError(f"checkpoint id {checkpoint_id} is outside [0, 10**10)")
        return f"{self._job_dir(job)}/chk-{checkpoint_id:010d}"

    def checkpoint_dir(self, job: str, checkpoint_id: int) -> str:
        """Where checkpoint ``checkpoint_id``'s files are (savepoints copy them back here)."""
        return self._chk_dir(job, checkpoint_id)

    # -- task snapshots ------------------------------------------------------------------------

    def write_task_snapshot(
        self, job: str, checkpoint_id: int, task: str, state: Any, *, incarnation: int = 0
    ) -> SnapshotHandle:
        """Writes one task's snapshot of a pending checkpoint (atomically: temp name + rename).

        ``incarnation`` (the writing worker's generation, or its start under local recovery)
        goes into the file name: a zombie of an older generation that still snapshots a
        checkpoint id the live generation reuses writes a file nobody acked, never over the
        live one's (issue 19). The manifest names the acked files.

        Raises:
            SerializationError: ``state`` holds a value the codec does not support.
        """
        check_name("task", task)
        suffix = f".g{incarnation}" if incarnation else ""
        path = f"{self._chk_dir(job, checkpoint_id)}/{task}{suffix}.snap"
        blob, checksum = encode_snapshot(state)
        self._write_atomically(path, blob)
        log.debug("wrote checkpoint_id=%d task=%r path=%s", checkpoint_id, task, path)
        return SnapshotHandle(path=path, size=len(blob), checksum=checksum)

    def read_task_snapshot(self, handle_or_path: SnapshotHandle | str) -> Any:
        """Reads a task's state back; a handle is also checked against its size and checksum.

        Raises:
            SnapshotError: ``missing``, ``unknown_version`` or ``corrupt`` (with the path).
        """
        handle = handle_or_path if isinstance(handle_or_path, SnapshotHandle) else None
        path = handle.path if handle is not None else str(handle_or_path)
        try:
            blob = self._fs.cat_file(path)
        except FileNotFoundError:
            raise SnapshotError(
                f"snapshot {path} does not exist", reason="missing", path=path
            ) from None
        state = decode_snapshot(blob, path)
        if handle is not None and (len(blob), blob[16:32].hex()) != (handle.size, handle.checksum):
            raise corrupt(
                path,
                f"not the snapshot its handle names: {len(blob)} bytes with checksum "
                f"{blob[16:32].hex()}, expected {handle.size} bytes with {handle.checksum}",
            )
        return state

    # -- manifests -----------------------------------------------------------------------------

    def complete(
        self,
        job: str,
        checkpoint_id: int,
        tasks: Mapping[str, SnapshotHandle],
        metadata: Mapping[str, Any],
    ) -> None:
        """Marks a checkpoint completed by writing its manifest (atomically).

        Invariants:
            Idempotent for the same snapshots. The manifest is written only after checking that
            every named snapshot is in the checkpoint's directory with its recorded size.

        Raises:
            SnapshotError: ``missing`` if a snapshot is not where its handle says; ``completed``
                if the checkpoint was already completed with other snapshots.
            SerializationError: ``metadata`` is not JSON (str keys; str, int, float, bool,
                None, list, dict values).
        """
        chk = self._chk_dir(job, checkpoint_id)
        path = f"{chk}/{MANIFEST}"
        if self._fs.exists(path):
            if dict(self.load(job, checkpoint_id).tasks) != dict(tasks):
                raise SnapshotError(
                    f"checkpoint {checkpoint_id} of job {job!r} is already completed with other "
                    "snapshots",
                    reason="completed",
                    path=path,
                )
            log.info("already completed checkpoint_id=%d job=%r", checkpoint_id, job)
            return
        missing = self._missing_files(chk, tasks)
        if missing:
            raise SnapshotError(
                f"checkpoint {checkpoint_id} cannot complete: {'; '.join(missing)}",
                reason="missing",
                path=chk,
            )
        blob = encode_manifest(job, checkpoint_id, int(self._clock() * 1000), tasks, metadata)
        self._write_atomically(path, blob)
        log.info("completed checkpoint_id=%d job=%r tasks=%d", checkpoint_id, job, len(tasks))

    def load(self, job: str, checkpoint_id: int) -> Manifest:
        """The manifest of a completed checkpoint (its snapshot files are not checked).

        Raises:
            SnapshotError: ``missing`` (not completed), ``unknown_version`` or ``corrupt``.
        """
        path = f"{self._chk_dir(job, checkpoint_id)}/{MANIFEST}"
        try:
            blob = self._fs.cat_file(path)
        except FileNotFoundError:
            raise SnapshotError(
                f"checkpoint {checkpoint_id} of job {job!r} is not completed (no {path})",
                reason="missing",
                path=path,
            ) from None
        return decode_manifest(blob, path, job, checkpoint_id)

    def completed_ids(self, job: str) -> list[int]:
        """Ids of the checkpoints that have a manifest, oldest first (manifests not read)."""
        found = self._fs.glob(f"{self._job_dir(job)}/chk-*/{MANIFEST}")
        ids = (_CHK.match(p.rstrip("/").split("/")[-2]) for p in found)
        return sorted(int(m.group(1)) for m in ids if m)

    def latest_completed(self, job: str) -> Manifest | None:
        """The newest completed checkpoint whose manifest reads and whose snapshots all exist.

        Checkpoints without a manifest are pending or aborted and are skipped. A corrupt
        manifest or a missing snapshot is skipped with a warning: restoring an older checkpoint
        keeps state consistent, but sinks that committed the skipped one may see outputs again
        (the dedup layer, when enabled, drops them).

        Raises:
            SnapshotError: ``unknown_version``: a newer eosflow wrote the newest checkpoint;
                falling back silently would roll back committed work.
        """
        for checkpoint_id in reversed(self.completed_ids(job)):
            try:
                manifest = self.load(job, checkpoint_id)
            except SnapshotError as exc:
                if exc.reason == "unknown_version":
                    raise
                log.warning("skipping checkpoint_id=%d error=%r", checkpoint_id, str(exc))
                continue
            missing = self._missing_files(self._chk_dir(job, checkpoint_id), manifest.tasks)
            if missing:
                log.warning("skipping checkpoint_id=%d missing=%r", checkpoint_id, missing)
                continue
            return manifest
        return None

    # -- cleanup -------------------------------------------------------------------------------

    def retain(self, job: str, keep: int) -> list[int]:
        """Deletes all but the newest ``keep`` completed checkpoints, and orphans.

        Orphans are checkpoints without a manifest older than the newest completed one: they
        were aborted. Newer ones may still be pending and are left alone.

        Invariants:
            The newest completed checkpoint, and the one :meth:`latest_completed` would restore,
            are never deleted. A manifest is deleted before its snapshots, so a crash
            mid-deletion never leaves a completed checkpoint with missing files.

        Returns:
            The ids deleted, oldest first.
        """
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ConfigError(
                f"retain keep={keep!r}: keep at least 1 completed checkpoint (recovery needs one)"
            )
        completed = self.completed_ids(job)
        if not completed:
            return []
        kept = set(completed[-keep:])
        usable = self.latest_completed(job)
        if usable is not None:
            kept.add(usable.checkpoint_id)
        done = set(completed)
        deleted = []
        for checkpoint_id in self._checkpoint_ids(job):
            if checkpoint_id in kept or (
                checkpoint_id not in done and checkpoint_id > completed[-1]
            ):
                continue
            chk = self._chk_dir(job, checkpoint_id)
            if checkpoint_id in done:
                self._fs.rm_file(f"{chk}/{MANIFEST}")
            if not self._rm_tree(chk):
                continue
            deleted.append(checkpoint_id)
            log.info(
                "deleted checkpoint checkpoint_id=%d job=%r completed=%s",
                checkpoint_id,
                job,
                checkpoint_id in done,
            )
        return deleted

    def discard(self, job: str, checkpoint_id: int) -> None:
        """Deletes an aborted checkpoint's snapshots; does nothing if there are none.

        Raises:
            SnapshotError: ``completed``: the checkpoint has a manifest (use :meth:`retain`).
        """
        chk = self._chk_dir(job, checkpoint_id)
        if self._fs.exists(f"{chk}/{MANIFEST}"):
            raise SnapshotError(
                f"checkpoint {checkpoint_id} of job {job!r} is completed: discard only deletes "
                "aborted checkpoints; use retain()",
                reason="completed",
                path=chk,
            )
        if self._rm_tree(chk):
            log.info("discarded checkpoint_id=%d job=%r", checkpoint_id, job)

    def _rm_tree(self, path: str) -> bool:
        """Deletes a checkpoint directory; ``False`` if a task was still writing into it (a
        slow upload of an aborted checkpoint, whose task then declines it): it is left for
        the next :meth:`retain`, which deletes orphans."""
        for _attempt in range(3):
            try:
                self._fs.rm(path, recursive=True)
                return True
            except FileNotFoundError:
                return True
            except OSError as exc:  # e.g. "Directory not empty": a file appeared meanwhile
                error = exc
                time.sleep(0.05)
        log.warning("could not delete %s yet (%s); retention will retry", path, error)
        return False

    # -- job bookkeeping -----------------------------------------------------------------------

    def next_generation(self, job: str) -> int:
        """Allocates the job's next generation (1, 2, ...), remembered across runs.

        Channel topics outlive a run: a new run must not reuse a generation whose
        ``GenerationStart`` markers are already in the channels (:mod:`processor.wire`).
        Only the job's one coordinator calls this.
        """
        current = self._generation(job)
        self.write_job_file(job, GENERATION_FILE, f"{current + 1}\n".encode())
        return current + 1

    def raise_generation(self, job: str, floor: int) -> None:
        """Makes the job's next generation higher than ``floor``: a generation another runner
        of the job used, with another store (the job's claim in the broker says so; issue 48:
        two stores both allocated generation 1, and their channel records were not fenced)."""
        if self._generation(job) < floor:
            self.write_job_file(job, GENERATION_FILE, f"{floor}\n".encode())

    def _generation(self, job: str) -> int:
        data = self.read_job_file(job, GENERATION_FILE)
        try:
            return int(data.decode().strip()) if data is not None else 0
        except ValueError:
            raise corrupt(self.job_file(job, GENERATION_FILE), "not an integer") from None

    def job_file(self, job: str, name: str) -> str:
        """Path of the job's bookkeeping file ``name`` (generation, start positions, lease)."""
        if not re.fullmatch(r"_[A-Z_]+", name):
            raise DefinitionError(f"job file names are _UPPER_CASE, got {name!r}")
        return f"{self._job_dir(job)}/{name}"

    def read_job_file(self, job: str, name: str) -> bytes | None:
        try:
            return bytes(self._fs.cat_file(self.job_file(job, name)))
        except FileNotFoundError:
            return None

    def write_job_file(self, job: str, name: str, data: bytes) -> None:
        """Replace the job file ``name`` atomically (readers see the old or the new bytes)."""
        self._write_atomically(self.job_file(job, name), data)

    def delete_job_file(self, job: str, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._fs.rm_file(self.job_file(job, name))

    def delete_job(self, job: str) -> int:
        """Deletes everything of ``job`` (checkpoints and job files); returns the checkpoint
        count deleted. Only ``eosflow reset`` calls this, holding the job's lease."""
        count = len(self._checkpoint_ids(job))
        with contextlib.suppress(FileNotFoundError):
            self._fs.rm(self._job_dir(job), recursive=True)
        return count

    def local_job_path(self, job: str, name: str) -> str | None:
        """The job file's path on this machine's disk, or ``None`` on a remote store."""
        if not self._local:
            return None
        self._fs.makedirs(self._job_dir(job), exist_ok=True)
        return self.job_file(job, name)

    def conditional_files(self) -> ConditionalFiles:
        """This store's conditional writes, for the job lease on a remote store.

        Raises:
            ConfigError: the store's filesystem has none (see :mod:`.conditional`).
        """
        if self._conditional is None:
            self._conditional = conditional_files(self._fs, self.url)
        return self._conditional

    def newest_checkpoint_id(self, job: str) -> int:
        """The highest checkpoint id with a directory (completed, pending or aborted), or 0."""
        ids = self._checkpoint_ids(job)
        return ids[-1] if ids else 0

    # -- helpers -------------------------------------------------------------------------------

    def _checkpoint_ids(self, job: str) -> list[int]:
        try:
            entries = self._fs.ls(self._job_dir(job), detail=False)
        except FileNotFoundError:
            return []
        ids = (_CHK.match(str(p).rstrip("/").split("/")[-1]) for p in entries)
        return sorted(int(m.group(1)) for m in ids if m)

    def _missing_files(self, chk: str, tasks: Mapping[str, SnapshotHandle]) -> list[str]:
        try:
            listing = self._fs.ls(chk, detail=True)
        except FileNotFoundError:
            listing = []
        sizes = {str(e["name"]).rstrip("/"): e["size"] for e in listing}
        problems = []
        for task, handle in tasks.items():
            check_name("task", task)
            directory, _, name = handle.path.rpartition("/")
            if directory != chk or not is_task_file(task, name):
                problems.append(f"task {task!r}: {handle.path} is not {chk}/{task}[.gN].snap")
            elif sizes.get(handle.path) != handle.size:
                found = sizes.get(handle.path, "no")
                problems.append(
                    f"task {task!r}: {handle.path} has {found} bytes, not {handle.size}"
                )
        return problems

    def _write_atomically(self, path: str, data: bytes) -> None:
        directory = path.rsplit("/", 1)[0]
        self._fs.makedirs(directory, exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        try:
            if self._local:
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
            else:
                self._fs.pipe_file(tmp, data)
            self._fs.mv(tmp, path)
        except BaseException:
            with contextlib.suppress(Exception):
                self._fs.rm_file(tmp)
            raise
        if self._local:
            with contextlib.suppress(OSError):  # the rename itself must survive a power cut
                fd = os.open(directory, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
