"""Savepoints (issue 24): checkpoints a user asks for and keeps, and restoring a job from one.

A savepoint is a completed, **aligned** checkpoint copied out of the job's checkpoint
directories, where retention (``--keep-checkpoints``) never looks::

    <store>/_savepoints/<job>/sp-<id:010d>/  (or any directory/URL given with --path; outside
                                             the job's directory, so `eosflow reset` keeps it)
        <task>.g<n>.snap ...   the checkpoint's snapshots, byte for byte
        _MANIFEST              the checkpoint's manifest, byte for byte (written after them)
        _SAVEPOINT             what it is (job, checkpoint, workers, stop), written last: a
                               directory without it is an interrupted copy and is refused

Taking one (``eosflow savepoint JOB [--stop]``): the command writes the job file
``_SAVEPOINT_REQUEST``; the running job's runner reads it at most twice a second, triggers an
aligned checkpoint (or, with ``--stop``, stops after its final aligned checkpoint, whose sinks
have committed), copies it, and answers in ``_SAVEPOINT_RESULT``. A stopped job's savepoint is a
copy of its newest completed checkpoint. On Spark the driver does the same (the request is a
file in the snapshot store, which the command and the driver both reach).

Restoring (``eosflow run ... --from-savepoint PATH``): before anything starts, the savepoint is
copied back into the job's store as the completed checkpoint it was (``chk-<id>``), unless that
checkpoint is still there; then the job starts as from any checkpoint, and restarts restore the
newest checkpoint completed since. Refused, with what to do: a savepoint of another job; a job
that has completed checkpoints newer than the savepoint (they would win); and, unless
``allow_rewind``, a job that completed later checkpoints that were deleted since (restoring
would emit again what those committed). Checkpoint ids never go back: the coordinator continues
after the newest id the job ever completed (job file ``_LAST_CHECKPOINT``), so sinks that key
their output by checkpoint never see an id twice.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from fsspec.core import url_to_fs

from processor.errors import ConfigError
from processor.runtime.coordinator import LAST_CHECKPOINT
from processor.snapshot.store import MANIFEST, Manifest, SnapshotHandle, SnapshotStore

if TYPE_CHECKING:
    from processor.runtime.runner import Runner

__all__ = [
    "LAST_CHECKPOINT",
    "REQUEST",
    "RESULT",
    "SavepointRequests",
    "last_checkpoint",
    "request_savepoint",
    "restore_savepoint",
    "write_savepoint",
]

log = logging.getLogger(__name__)

REQUEST = "_SAVEPOINT_REQUEST"
RESULT = "_SAVEPOINT_RESULT"
_MARKER = "_SAVEPOINT"
_POLL_S = 0.5


def last_checkpoint(store: SnapshotStore, job: str) -> int:
    raw = store.read_job_file(job, LAST_CHECKPOINT)
    return int(raw) if raw else 0


def default_path(store: SnapshotStore, job: str, checkpoint_id: int) -> str:
    # Job names cannot start with "_": no job's directory is this one.
    return f"{store.url.rstrip('/')}/_savepoints/{job}/sp-{checkpoint_id:010d}"


def write_savepoint(
    store: SnapshotStore, manifest: Manifest, *, path: str | None = None, stop: bool = False
) -> str:
    """Copies the completed checkpoint ``manifest`` to ``path`` (default:
    ``<store>/_savepoints/<job>/``); returns the savepoint's path."""
    job, chk = manifest.job, manifest.checkpoint_id
    target = path or default_path(store, job, chk)
    src_fs, _ = url_to_fs(store.url)
    dst_fs, root = url_to_fs(target)
    dst_fs.makedirs(root, exist_ok=True)
    for handle in manifest.tasks.values():
        name = handle.path.rsplit("/", 1)[-1]
        dst_fs.pipe_file(f"{root}/{name}", src_fs.cat_file(handle.path))
    chk_dir = next(iter(manifest.tasks.values())).path.rsplit("/", 1)[0]
    dst_fs.pipe_file(f"{root}/{MANIFEST}", src_fs.cat_file(f"{chk_dir}/{MANIFEST}"))
    marker = {
        "job": job,
        "checkpoint_id": chk,
        "created_ms": int(time.time() * 1000),
        "tasks": sorted(manifest.tasks),
        "stop": stop,
    }
    dst_fs.pipe_file(f"{root}/{_MARKER}", json.dumps(marker, indent=2).encode())
    log.info("savepoint job=%r checkpoint_id=%d path=%s", job, chk, target)
    return target


def _read_marker(path: str) -> tuple[Any, str, dict[str, Any]]:
    fs, root = url_to_fs(path)
    try:
        marker = json.loads(fs.cat_file(f"{root}/{_MARKER}"))
    except FileNotFoundError:
        raise ConfigError(
            f"{path} is not a complete savepoint (no {_MARKER} file: not a savepoint "
            "directory, or its copy was interrupted); give the directory `eosflow savepoint` "
            "printed"
        ) from None
    return fs, root, marker


def restore_savepoint(
    store: SnapshotStore, job: str, path: str, *, allow_rewind: bool = False
) -> int:
    """Makes the savepoint at ``path`` the job's newest completed checkpoint (copying it back
    into the store if needed); returns its checkpoint id.

    Raises:
        ConfigError: not a complete savepoint, one of another job, or a restore that would
            not be the job's newest state (see the module docstring).
    """
    fs, root, marker = _read_marker(path)
    chk = int(marker["checkpoint_id"])
    if marker["job"] != job:
        raise ConfigError(
            f"savepoint {path} is of job {marker['job']!r}, not {job!r}: a savepoint holds "
            "the offsets of its job's internal topics; run it under its own job name (the "
            "Dataflow's name)"
        )
    newer = [c for c in store.completed_ids(job) if c > chk]
    if newer:
        raise ConfigError(
            f"job {job!r} has completed checkpoints {newer} newer than savepoint {path} "
            f"(checkpoint {chk}): it would restore the newest. Run without --from-savepoint "
            "to continue from them, or delete them (eosflow reset JOB deletes the whole job's "
            "state) to go back to the savepoint"
        )
    last = last_checkpoint(store, job)
    if last > chk and not allow_rewind:
        raise ConfigError(
            f"job {job!r} completed checkpoint {last} after savepoint {path} (checkpoint "
            f"{chk}): restoring the savepoint re-reads the input since then and commits its "
            "output again (a rewind). Pass --allow-rewind to do it anyway"
        )
    if chk not in store.completed_ids(job):
        _copy_back(store, job, chk, fs, root)
    log.info("restoring job=%r from savepoint=%s checkpoint_id=%d", job, path, chk)
    return chk


def _copy_back(store: SnapshotStore, job: str, chk: int, fs: Any, root: str) -> None:
    """The savepoint's files into ``chk-<id>``, each snapshot checked against the manifest,
    the manifest last (only then is it a completed checkpoint)."""
    manifest = json.loads(fs.cat_file(f"{root}/{MANIFEST}"))
    dst_fs, _ = url_to_fs(store.url)
    chk_dir = store.checkpoint_dir(job, chk)
    dst_fs.makedirs(chk_dir, exist_ok=True)
    for entry in manifest["tasks"].values():
        copied = f"{chk_dir}/{entry['file']}"
        dst_fs.pipe_file(copied, fs.cat_file(f"{root}/{entry['file']}"))
        store.read_task_snapshot(SnapshotHandle(copied, int(entry["size"]), entry["checksum"]))
    dst_fs.pipe_file(f"{chk_dir}/{MANIFEST}", fs.cat_file(f"{root}/{MANIFEST}"))


def request_savepoint(
    store: SnapshotStore, job: str, *, stop: bool, path: str | None, timeout: float
) -> str:
    """Asks the running job for a savepoint and waits for the answer; returns its path.

    Raises:
        ConfigError: the runner answered with an error, or did not answer within ``timeout``.
    """
    request_id = uuid.uuid4().hex
    body = {"id": request_id, "stop": stop, "path": path, "requested_ms": int(time.time() * 1000)}
    store.write_job_file(job, REQUEST, json.dumps(body).encode())
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        raw = store.read_job_file(job, RESULT)
        answer = json.loads(raw) if raw else {}
        if answer.get("id") == request_id:
            if answer.get("error"):
                raise ConfigError(f"savepoint of job {job!r} failed: {answer['error']}")
            return str(answer["path"])
        time.sleep(0.2)
    raise ConfigError(
        f"job {job!r} did not answer the savepoint request within {timeout:g}s (is it "
        "running, and does it use this snapshot store? `eosflow status` shows it)"
    )


class SavepointRequests:
    """The runner's side: reads requests, triggers the checkpoint, copies it, answers."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.store: SnapshotStore = runner.store
        self.job: str = runner.job
        self._next_poll = 0.0
        self._seen: str | None = None
        raw = self.store.read_job_file(self.job, REQUEST)
        if raw:  # a request from before this run started is not for it
            self._seen = json.loads(raw).get("id")
        self.request: dict[str, Any] | None = None
        self.checkpoint: int | None = None

    def tick(self) -> None:
        """Each loop of the runner: a new request, a checkpoint to trigger or to copy."""
        now = time.monotonic()
        if self.request is None and now >= self._next_poll:
            self._next_poll = now + _POLL_S
            raw = self.store.read_job_file(self.job, REQUEST)
            request = json.loads(raw) if raw else None
            if request and request.get("id") != self._seen:
                self._seen = request["id"]
                self.request = request
                if request.get("stop"):
                    self.runner.stop_for("savepoint")
        if self.request is None or self.request.get("stop"):
            return  # a stop's savepoint is the final checkpoint (finished)
        runner, coordinator = self.runner, self.runner.coordinator
        if self.checkpoint is None:
            if coordinator.pending is None and runner._ready():
                self.checkpoint = coordinator.trigger_now()
                runner.server.broadcast({"t": "trigger", "chk": self.checkpoint, "aligned": True})
                runner._say(f"savepoint: aligned checkpoint {self.checkpoint} triggered")
            return
        if self.checkpoint in self.store.completed_ids(self.job):
            self._answer(self.checkpoint)
        elif coordinator.pending is None or coordinator.pending.checkpoint_id != self.checkpoint:
            self.checkpoint = None  # aborted (a restart, a timeout): trigger another

    def finished(self, final_checkpoint: int | None) -> None:
        """The runner stopped after its final checkpoint: a stop request's savepoint."""
        if self.request is not None and self.request.get("stop") and final_checkpoint:
            self._answer(final_checkpoint)

    def _answer(self, checkpoint_id: int) -> None:
        request, self.request, self.checkpoint = self.request, None, None
        assert request is not None
        answer: dict[str, Any] = {"id": request["id"]}
        try:
            manifest = self.store.load(self.job, checkpoint_id)
            answer["path"] = write_savepoint(
                self.store, manifest, path=request.get("path"), stop=bool(request.get("stop"))
            )
            self.runner._say(f"savepoint of checkpoint {checkpoint_id}: {answer['path']}")
        except Exception as exc:  # the command waits for an answer: give it the cause
            log.exception("savepoint of checkpoint %d failed", checkpoint_id)
            answer["error"] = f"{type(exc).__name__}: {exc}"
        self.store.write_job_file(self.job, RESULT, json.dumps(answer).encode())
