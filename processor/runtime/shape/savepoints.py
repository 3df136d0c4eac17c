"""Savepoints (issue 24): checkpoints a user asks for and keeps, and restoring a job from one.

A savepoint is a completed, **aligned** checkpoint copied out of the job's checkpoint
directories, where retention (``--keep-checkpoints``) never looks::

    <store>/_savepoints/<job>/sp-<id:010d>/  (or any directory/URL given with --path; outside
                                             the job's directory, so `eosflow reset` keeps it)
        <task>.g<n>.snap ...   the checkpoint's snapshots, byte for byte
        <task>.ids             the dedup IDs the task's states rely on, copied out of Redis
                               (:mod:`processor.runtime.shape.savepoint_state`)
        _MANIFEST              the checkpoint's manifest, byte for byte (written after them)
        _SAVEPOINT             what it is (job, checkpoint, workers, stop, committed, the ids
                               files, the last checkpoint id and generation), written last: a
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
newest checkpoint completed since. The copy-back makes it restorable whatever was deleted since
(``eosflow reset``, retention, the channel purge, the dedup GC): its channels start at their
current ends, its dedup IDs go back into Redis, generations continue after its own
(:mod:`processor.runtime.shape.savepoint_state`); a savepoint whose records in flight are gone is
refused there, before any worker starts. Refused, with what to do: a savepoint of another job; a job
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
from collections.abc import Callable
from typing import Any

from processor.errors import ConfigError
from processor.runtime.checkpoints.coordinator import (
    LAST_CHECKPOINT,
    CheckpointCoordinator,
    last_checkpoint,
)
from processor.runtime.shape.savepoint_state import (
    RedisUrls,
    load_saved_ids,
    rebase,
    redis_urls,
    save_ids,
)
from processor.snapshot.localfs import open_fs
from processor.snapshot.store import (
    GENERATION_FILE,
    MANIFEST,
    Manifest,
    SnapshotStore,
    decode_snapshot,
    encode_snapshot,
)

__all__ = [
    "LAST_CHECKPOINT",
    "REQUEST",
    "RESULT",
    "SavepointRequests",
    "request_savepoint",
    "restore_savepoint",
    "write_savepoint",
]

log = logging.getLogger(__name__)

REQUEST = "_SAVEPOINT_REQUEST"
RESULT = "_SAVEPOINT_RESULT"
_MARKER = "_SAVEPOINT"
#: Job file: the final checkpoint of the job's last clean stop, which every sink committed.
FINAL_COMMITTED = "_FINAL_COMMITTED"
_POLL_S = 0.5


def default_path(store: SnapshotStore, job: str, checkpoint_id: int) -> str:
    """``<state dir>/savepoints/<job>/sp-<id>`` for a job's default store (which lives in the
    job's directory, deleted by ``eosflow reset``), else ``<store>/_savepoints/<job>/...``
    (job names cannot start with ``_``: no job's directory is that one)."""
    url = store.url.rstrip("/")
    own = f"/jobs/{job}/checkpoints"
    if url.endswith(own):
        return f"{url.removesuffix(own)}/savepoints/{job}/sp-{checkpoint_id:010d}"
    return f"{url}/_savepoints/{job}/sp-{checkpoint_id:010d}"


def write_savepoint(
    store: SnapshotStore,
    manifest: Manifest,
    *,
    path: str | None = None,
    stop: bool = False,
    each_file: Callable[[], None] | None = None,
    committed: bool = False,
    redis_url: RedisUrls | None = None,
) -> str:
    """Copies the completed checkpoint ``manifest`` to ``path`` (default: :func:`default_path`),
    with the dedup IDs its states rely on (:mod:`processor.runtime.shape.savepoint_state`); returns
    the savepoint's path. ``each_file``: called after each file (the runner renews its lease: a
    big copy must not let it lapse). ``committed``: every sink of the checkpoint committed (a
    restore drops its pending committables). ``redis_url``: a dedup step's Redis (default:
    ``EOSFLOW_REDIS_URL``).

    Raises:
        ConfigError: the checkpoint is not aligned (its in-flight channel records are offsets
            in internal topics that a savepoint does not keep), or a dedup step's Redis is
            not known.
        RedisDataLost: Redis lost IDs the checkpoint relies on.
    """
    job, chk = manifest.job, manifest.checkpoint_id
    if manifest.metadata.get("aligned") is False:
        raise ConfigError(
            f"checkpoint {chk} of job {job!r} is unaligned: its records in flight are offsets "
            "of internal topics, which a savepoint cannot keep. Take the savepoint of the "
            "running job (eosflow savepoint JOB: an aligned checkpoint), or start the job and "
            "stop it with eosflow savepoint JOB --stop"
        )
    target = path or default_path(store, job, chk)
    src_fs, _ = open_fs(store.url)
    dst_fs, root = open_fs(target)
    dst_fs.makedirs(root, exist_ok=True)
    if dst_fs.exists(f"{root}/{_MARKER}"):
        dst_fs.rm(f"{root}/{_MARKER}")  # an overwrite is incomplete until the marker is back
    for handle in manifest.tasks.values():
        name = handle.path.rsplit("/", 1)[-1]
        dst_fs.pipe_file(f"{root}/{name}", src_fs.cat_file(handle.path))
        if each_file is not None:
            each_file()

    def write(name: str, blob: bytes) -> None:
        dst_fs.pipe_file(f"{root}/{name}", blob)
        if each_file is not None:
            each_file()

    ids = save_ids(store, manifest, write, redis_url or redis_urls())
    manifest_path = f"{store.checkpoint_dir(job, chk)}/{MANIFEST}"
    dst_fs.pipe_file(f"{root}/{MANIFEST}", src_fs.cat_file(manifest_path))
    marker = {
        "job": job,
        "checkpoint_id": chk,
        "created_ms": int(time.time() * 1000),
        "tasks": sorted(manifest.tasks),
        "stop": stop,
        "committed": stop or committed,  # the sinks committed it: nothing pending to recover
        "last_checkpoint": max(chk, last_checkpoint(store, job)),  # ids continue after it
        # generations never go back either: a restore after eosflow reset continues after it
        "generation": int(manifest.metadata.get("generation") or 0),
        "ids": ids,  # the dedup IDs it carries, per task (savepoint_state)
    }
    dst_fs.pipe_file(f"{root}/{_MARKER}", json.dumps(marker, indent=2).encode())
    log.info("savepoint job=%r checkpoint_id=%d path=%s", job, chk, target)
    return target


def _read_marker(path: str) -> tuple[Any, str, dict[str, Any]]:
    fs, root = open_fs(path)
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
    store: SnapshotStore,
    job: str,
    path: str,
    *,
    allow_rewind: bool = False,
    transport: Any = None,
    redis_url: RedisUrls | None = None,
) -> tuple[int, bool]:
    """Makes the savepoint at ``path`` the job's newest completed checkpoint (copying it back
    into the store if needed); returns its checkpoint id and whether it was copied back
    (:func:`undo_restore` removes the copy when a later start-up check refuses the start).

    The copy-back rebases it (:func:`processor.runtime.shape.savepoint_state.rebase`): its channels
    start at their current ends on ``transport`` (created if ``eosflow reset`` deleted them),
    and its dedup IDs are written back into Redis (``redis_url``: a dedup step's).

    Raises:
        ConfigError: not a complete savepoint, one of another job, a restore that would not
            be the job's newest state (see the module docstring), or a savepoint whose
            records in flight are gone (refused before any worker starts).
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
    copied = chk not in store.completed_ids(job)
    if copied:
        _copy_back(store, job, path, marker, fs, root, transport)
        try:
            loaded = load_saved_ids(
                lambda name: bytes(fs.cat_file(f"{root}/{name}")),
                marker.get("ids") or {},
                redis_url or redis_urls(),
            )
        except BaseException:
            undo_restore(store, job, chk)
            raise
        if loaded:
            log.info("savepoint %s: %d dedup IDs written back into Redis", path, loaded)
    else:
        _same_checkpoint(store, job, chk, fs, root, path)
    ever = int(marker.get("last_checkpoint", chk))
    if ever > last:  # the store forgot (eosflow reset): ids must still not go back
        store.write_job_file(job, LAST_CHECKPOINT, str(ever).encode())
    generation = int(marker.get("generation") or 0)
    raw = store.read_job_file(job, GENERATION_FILE)
    if generation > (int(raw) if raw else 0):  # nor generations (the zombie checks compare)
        store.write_job_file(job, GENERATION_FILE, f"{generation}\n".encode())
    log.info("restoring job=%r from savepoint=%s checkpoint_id=%d", job, path, chk)
    return chk, copied


def _same_checkpoint(
    store: SnapshotStore, job: str, chk: int, fs: Any, root: str, path: str
) -> None:
    """The job's own checkpoint ``chk`` must be the savepoint's (after a reset, a new run of
    the job may have a checkpoint of the same id)."""
    saved = json.loads(fs.cat_file(f"{root}/{MANIFEST}"))["tasks"]
    own = store.load(job, chk)
    # a copy-back rebased the snapshots (savepoint_state): it recorded the savepoint's
    checksums = own.metadata.get("savepoint_checksums") or {
        t: h.checksum for t, h in own.tasks.items()
    }
    if {t: e["checksum"] for t, e in saved.items()} != checksums:
        raise ConfigError(
            f"job {job!r} has a checkpoint {chk} that is not savepoint {path}'s checkpoint {chk} "
            "(another run of the job since, e.g. after eosflow reset): its state would be "
            "restored instead. Delete the job's state (eosflow reset JOB) to restore the "
            "savepoint"
        )


def undo_restore(store: SnapshotStore, job: str, chk: int) -> None:
    """Removes a savepoint's copy from the store (the start was refused after it)."""
    fs, _ = open_fs(store.url)
    fs.rm(store.checkpoint_dir(job, chk), recursive=True)


def _copy_back(
    store: SnapshotStore,
    job: str,
    path: str,
    marker: dict[str, Any],
    fs: Any,
    root: str,
    transport: Any,
) -> None:
    """The savepoint's snapshots into ``chk-<id>``, each checked against the manifest and
    rebased for a restore now (:func:`processor.runtime.shape.savepoint_state.rebase`), the manifest
    last (only then is it a completed checkpoint)."""
    manifest = json.loads(fs.cat_file(f"{root}/{MANIFEST}"))
    chk = int(manifest["checkpoint_id"])
    states: dict[str, dict[str, Any]] = {}
    for task, entry in manifest["tasks"].items():
        blob = fs.cat_file(f"{root}/{entry['file']}")
        if (len(blob), blob[16:32].hex()) != (int(entry["size"]), entry["checksum"]):
            raise ConfigError(
                f"savepoint {path}: {entry['file']} is not the snapshot its manifest names "
                "(size or checksum): the savepoint was changed or its copy is incomplete"
            )
        states[task] = decode_snapshot(blob, f"{root}/{entry['file']}")
    rebase(job, path, manifest, states, transport, committed=bool(marker.get("committed")))
    dst_fs, _ = open_fs(store.url)
    chk_dir = store.checkpoint_dir(job, chk)
    dst_fs.makedirs(chk_dir, exist_ok=True)
    original = {t: e["checksum"] for t, e in manifest["tasks"].items()}
    for task, entry in manifest["tasks"].items():
        blob, checksum = encode_snapshot(states[task])
        dst_fs.pipe_file(f"{chk_dir}/{entry['file']}", blob)
        entry.update(size=len(blob), checksum=checksum)
    manifest.setdefault("metadata", {})["savepoint_checksums"] = original
    dst_fs.pipe_file(f"{chk_dir}/{MANIFEST}", json.dumps(manifest, indent=2).encode())


def request_savepoint(
    store: SnapshotStore, job: str, *, stop: bool, path: str | None, timeout: float
) -> str:
    """Asks the running job for a savepoint and waits for the answer; returns its path.

    Raises:
        ConfigError: the runner answered with an error, or did not answer within ``timeout``.
    """
    request_id = post_savepoint_request(store, job, stop=stop, path=path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        answer = savepoint_answer(store, job, request_id)
        if answer is not None:
            return answer
        time.sleep(0.2)
    raise ConfigError(
        f"job {job!r} did not answer the savepoint request within {timeout:g}s (is it "
        "running, and does it use this snapshot store? `eosflow status` shows it)"
    )


def post_savepoint_request(store: SnapshotStore, job: str, *, stop: bool, path: str | None) -> str:
    """Writes a savepoint request where the job's runner polls for it; returns its id."""
    request_id = uuid.uuid4().hex
    body = {"id": request_id, "stop": stop, "path": path, "requested_ms": int(time.time() * 1000)}
    store.write_job_file(job, REQUEST, json.dumps(body).encode())
    return request_id


def savepoint_answer(store: SnapshotStore, job: str, request_id: str) -> str | None:
    """The savepoint's path once the runner answered request ``request_id``, else ``None``.

    Raises:
        ConfigError: the runner answered with an error.
    """
    raw = store.read_job_file(job, RESULT)
    answer = json.loads(raw) if raw else {}
    if answer.get("id") != request_id:
        return None
    if answer.get("error"):
        raise ConfigError(f"savepoint of job {job!r} failed: {answer['error']}")
    return str(answer["path"])


class SavepointRequests:
    """The runner's side: reads requests, triggers the checkpoint, copies it, answers.

    Owned by the runner, which wires it in: its store, job and coordinator, and what it does
    for the requests: ``ready()`` (every worker connected), ``broadcast(msg)`` to the workers,
    ``stop(reason)`` after a final checkpoint, ``say(text)`` on the progress output,
    ``renew()`` the job's lease while a copy runs, ``committed(checkpoint)``: every task
    reported its sinks' commit of it (a running job's savepoint is copied once they did, so
    that it records ``committed``), ``redis_url`` of its dedup steps, and ``since_ms``: when
    the run started (a request written since, while it started up, is for it: ``--takeover``).
    """

    def __init__(
        self,
        store: SnapshotStore,
        job: str,
        coordinator: CheckpointCoordinator,
        *,
        ready: Callable[[], bool],
        broadcast: Callable[[dict[str, Any]], None],
        stop: Callable[[str], None],
        say: Callable[[str], None],
        renew: Callable[[], None],
        committed: Callable[[int], bool] | None = None,
        redis_url: RedisUrls | None = None,
        since_ms: int | None = None,
    ) -> None:
        self.store = store
        if since_ms is None:
            since_ms = int(time.time() * 1000)
        self._committed = committed
        self._redis_url = redis_url
        self.job = job
        self.coordinator = coordinator
        self._ready, self._broadcast, self._stop = ready, broadcast, stop
        self._say, self._renew = say, renew
        self._next_poll = 0.0
        self._seen: str | None = None
        raw = self.store.read_job_file(self.job, REQUEST)
        if raw:  # a request from before this run started is not for it
            earlier = json.loads(raw)
            answer = json.loads(self.store.read_job_file(self.job, RESULT) or b"{}")
            if answer.get("id") == earlier.get("id") or (
                int(earlier.get("requested_ms") or 0) < since_ms
            ):  # answered (the runner this one took over from), or older than this run
                self._seen = earlier.get("id")
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
                    self._stop("savepoint")
        if self.request is None or self.request.get("stop"):
            return  # a stop's savepoint is the final checkpoint (finished)
        coordinator = self.coordinator
        if self.checkpoint is None:
            if coordinator.pending is None and self._ready():
                self.checkpoint = coordinator.trigger_now()
                self._broadcast({"t": "trigger", "chk": self.checkpoint, "aligned": True})
                self._say(f"savepoint: aligned checkpoint {self.checkpoint} triggered")
            return
        if coordinator.pending is not None and coordinator.pending.checkpoint_id == self.checkpoint:
            return  # still pending
        if coordinator.stats.last_completed == self.checkpoint:
            if self._committed is not None and not self._committed(self.checkpoint):
                return  # its sinks commit it now: the savepoint then says so
            self._answer(self.checkpoint, committed=self._committed is not None)
        else:
            self.checkpoint = None  # aborted (a restart, a timeout): trigger another

    def finished(self, final_checkpoint: int | None) -> None:
        """The runner stopped after its final checkpoint: a stop request's savepoint (and a
        request that came too late for the final checkpoint, the same one)."""
        if self.request is not None and final_checkpoint:
            self._answer(final_checkpoint, committed=True)  # the run waited for its commits

    def abandon(self, why: str) -> None:
        """The run ends without a savepoint for the open request: answer it with why."""
        if self.request is not None:
            body = {"id": self.request["id"], "error": why}
            self.request = None
            self.store.write_job_file(self.job, RESULT, json.dumps(body).encode())

    def _answer(self, checkpoint_id: int, *, committed: bool) -> None:
        request, self.request, self.checkpoint = self.request, None, None
        assert request is not None
        answer: dict[str, Any] = {"id": request["id"]}
        try:
            manifest = self.store.load(self.job, checkpoint_id)
            answer["path"] = write_savepoint(
                self.store,
                manifest,
                path=request.get("path"),
                stop=bool(request.get("stop")),
                each_file=self._renew,
                committed=committed,
                redis_url=self._redis_url,
            )
            self._say(f"savepoint of checkpoint {checkpoint_id}: {answer['path']}")
        except Exception as exc:  # the command waits for an answer: give it the cause
            log.exception("savepoint of checkpoint %d failed", checkpoint_id)
            answer["error"] = f"{type(exc).__name__}: {exc}"
        self.store.write_job_file(self.job, RESULT, json.dumps(answer).encode())


def final_committed(store: SnapshotStore, job: str) -> int:
    """The checkpoint whose commit by every sink the job's last clean stop recorded (0: none);
    a savepoint copied from a stopped job whose newest checkpoint it is says ``committed``."""
    raw = store.read_job_file(job, FINAL_COMMITTED)
    try:
        return int(json.loads(raw)["checkpoint"]) if raw else 0
    except (ValueError, KeyError, TypeError):
        return 0
