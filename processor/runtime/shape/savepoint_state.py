"""What a savepoint holds beyond its checkpoint, and how a restore makes it the job's state
again after the job's topics and dedup IDs are gone (issue 35, item 3).

A savepoint belongs to the user (Flink's rule): ``eosflow reset``, retention, the channel purge,
the dedup GC and the shape GC may delete anything of the job but the savepoint, and the
savepoint must still restore. Two things a checkpoint leaves outside itself:

* **Channel positions.** A checkpoint records offsets in the job's internal channel topics.
  Reset deletes those topics (the restore recreates them empty), the purge deletes records
  below the oldest retained checkpoint. A savepoint is aligned: at its barrier every channel
  had delivered everything before it, and what follows the barrier belongs to a generation
  that a restore drops anyway. So the copy-back rewrites each task's channel positions to the
  channels' current ends (every barrier seen, nothing to replay): the same channels, or new
  empty ones, start where nothing of the savepoint is left to read. A local-recovery replay
  check (``~replay-<stage>``) keeps only the IDs of a dead upstream worker whose successor was
  still re-emitting its records (its per-channel IDs describe the old channel records). Only a
  snapshot that still had records *in flight* (channels still recovering
  from an earlier unaligned checkpoint, a loop's back-edge log) needs old channel records:
  if they are gone, the restore is refused at once, before any worker starts (no restart can
  bring them back).
* **Dedup IDs.** They live in Redis (:mod:`dedup.store`). The savepoint carries a copy of
  every ID its dedup states rely on (``<task>.ids``, :mod:`dedup.savepoint`), written back
  into Redis by the copy-back. Reset, the dedup GC and the shape sweep may then delete them
  freely.

And the sinks: a savepoint taken with ``--stop``, or of a running job once its sinks reported
the commit, records ``committed``: its tasks' pending committables are dropped at the
copy-back, because the commit markers that a recovery would read (a Kafka sink's marker topic)
may be gone with the job's topics, and a recovery that finds no marker re-publishes the epoch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from processor.errors import ConfigError
from processor.runtime.operators.replay import STATE_VERSION as REPLAY_STATE_VERSION
from processor.runtime.shape.topology import subtask_of
from processor.snapshot.store import Manifest, SnapshotStore, decode_snapshot, encode_snapshot
from processor.wire import job_topic_prefix

__all__ = ["RedisUrls", "load_saved_ids", "rebase", "redis_urls", "save_ids"]

log = logging.getLogger(__name__)

TP = tuple[str, int]
#: Dedup step -> the Redis URL of its IDs (``None``: not known).
RedisUrls = Callable[[str], str | None]
_DEDUP_KINDS = ("dedup", "keyed-dedup")
_IDS = ".ids"


def redis_urls(flow: Any = None, environ: Mapping[str, str] | None = None) -> RedisUrls:
    """A dedup step's Redis: its own ``redis_url``, else ``EOSFLOW_REDIS_URL`` (of ``environ``,
    the run's extra environment, then of this process)."""
    steps = flow.steps if flow is not None else {}

    def url(step: str) -> str | None:
        own = steps[step].params.get("redis_url") if step in steps else None
        return (
            own or (environ or {}).get("EOSFLOW_REDIS_URL") or os.environ.get("EOSFLOW_REDIS_URL")
        )

    return url


def _dedup_steps(state: Mapping[str, Any]) -> list[str]:
    kinds = state.get("kinds", {})
    return sorted(n for n in state.get("operators", {}) if kinds.get(n) in _DEDUP_KINDS)


def _epoch(manifest: Mapping[str, Any]) -> int:
    return int((manifest.get("topology") or {}).get("epoch", 0))


def _client(clients: dict[str, Any], url: str | None, step: str, what: str) -> Any:
    if not url:
        raise ConfigError(
            f"dedup step {step!r} keeps its record IDs in Redis, and no Redis URL is known to "
            f"{what}: set EOSFLOW_REDIS_URL (or the step's redis_url=)"
        )
    if url not in clients:
        from dedup.store import redis_client

        clients[url] = redis_client(url, name="eosflow-savepoint")
    return clients[url]


def save_ids(
    store: SnapshotStore,
    manifest: Manifest,
    write: Callable[[str, bytes], None],
    redis_url: RedisUrls,
) -> dict[str, dict[str, Any]]:
    """Copies the dedup IDs each task of ``manifest`` relies on out of Redis into a file
    ``<task>.ids`` (``write(name, blob)``); returns ``{task: {file, size, checksum}}``.

    Raises:
        ConfigError: no Redis URL for a dedup step.
        RedisDataLost: Redis no longer holds IDs the checkpoint relies on (never copied).
    """
    from dedup.rescale import dedup_prefix
    from dedup.savepoint import saved_ids

    epoch = _epoch(manifest.metadata)
    clients: dict[str, Any] = {}
    files: dict[str, dict[str, Any]] = {}
    try:
        for task, handle in sorted(manifest.tasks.items()):
            state = store.read_task_snapshot(handle)
            saved = {}
            for step in _dedup_steps(state):
                client = _client(clients, redis_url(step), step, "copy them into the savepoint")
                prefix = dedup_prefix(manifest.job, step, subtask_of(task), epoch)
                saved[step] = saved_ids(client, prefix, state["operators"][step])
            if saved:
                blob, checksum = encode_snapshot(saved)
                name = f"{task}{_IDS}"
                write(name, blob)
                files[task] = {"file": name, "size": len(blob), "checksum": checksum}
    finally:
        for client in clients.values():
            client.close()
    return files


def load_saved_ids(
    read: Callable[[str], bytes], files: Mapping[str, Mapping[str, Any]], redis_url: RedisUrls
) -> int:
    """Writes the IDs a savepoint carries (``files`` of its marker, ``read(name)``) back into
    Redis; returns how many."""
    from dedup.savepoint import load_ids

    clients: dict[str, Any] = {}
    loaded = 0
    try:
        for task, entry in sorted(files.items()):
            blob = read(entry["file"])
            saved = decode_snapshot(blob, entry["file"])
            if (len(blob), blob[16:32].hex()) != (entry["size"], entry["checksum"]):
                raise ConfigError(
                    f"savepoint file {entry['file']} of task {task} is not the one its "
                    "_SAVEPOINT names (size or checksum): the savepoint was changed or its copy "
                    "is incomplete; take it again"
                )
            for step, ids in saved.items():
                client = _client(clients, redis_url(step), step, "write them back")
                loaded += load_ids(client, ids)
    finally:
        for client in clients.values():
            client.close()
    return loaded


def _needs_replay(state: Mapping[str, Any], channels: set[TP], loop: bool) -> set[TP]:
    """The channels whose records after the snapshot's position the restore replays."""
    if loop:  # a back-edge log (its barrier had not come around): conservatively, all
        return set(channels)
    seen = {tuple(tp) for tp in state.get("barrier_seen", ())}
    recovering = {tuple(tp) for tp in state.get("recovering", {})}
    return {tp for tp in channels if tp not in seen or tp in recovering}


def rebase(
    job: str,
    path: str,
    manifest: Mapping[str, Any],
    states: dict[str, dict[str, Any]],
    transport: Any,
    *,
    committed: bool,
) -> None:
    """Rewrites the savepoint's task ``states`` (in place) for a restore now (see the module
    docstring): channel positions at the channels' current ends (created if missing), every
    barrier seen, no replay check; the pending committables dropped when ``committed``.

    Raises:
        ConfigError: a snapshot needs channel records in flight that are gone (at once: no
            restart can bring them back).
    """
    prefix = job_topic_prefix(job)
    chk = int(manifest["checkpoint_id"])
    channels = {
        task: {tuple(tp) for tp in state.get("positions", {}) if str(tp[0]).startswith(prefix)}
        for task, state in states.items()
    }
    tps: list[TP] = sorted({tp for found in channels.values() for tp in found})
    loop = int(manifest.get("metadata", {}).get("loop_log", 0)) > 0
    replay = {t: _needs_replay(states[t], channels[t], loop) for t in states}
    if tps and transport is not None:
        topology = manifest.get("metadata", {}).get("topology") or {}
        width = int(topology.get("parallelism") or 1 + max(subtask_of(t) for t in states))
        transport.ensure_topics({t: width * width for t, _p in tps})
        ends = transport.end_offsets(tps)
        begins = getattr(transport, "beginning_offsets", None)
        lows = begins(tps) if begins is not None else {}
        _check_in_flight(job, path, chk, states, replay, ends, lows)
    else:
        ends = {}
    for task, state in states.items():
        if channels[task] and not replay[task]:
            for tp in channels[task]:
                if tp in ends:
                    state["positions"][tp] = ends[tp]
            state["barrier_seen"] = sorted(channels[task])
            state["recovering"] = {}
            ops = state.get("operators", {})
            for name in [n for n in ops if n.startswith("~replay-")]:
                # Its per-channel IDs name the old channel records (none is read again); the
                # IDs of a dead upstream incarnation whose successor was still re-emitting at
                # the savepoint stay: the restored successor goes on re-emitting them
                # (processor.runtime.operators.replay). An older release's check: dropped.
                check = ops[name]
                if isinstance(check, dict) and check.get("version") == REPLAY_STATE_VERSION:
                    ops[name] = {**check, "channels": []}
                else:
                    del ops[name]
        if committed and "sinks" in state:
            state["sinks"] = {
                n: [(c, x) for c, x in p if c > chk] for n, p in state["sinks"].items()
            }
    log.info(
        "savepoint %s (checkpoint %d) rebased: channel positions at their ends %s%s",
        path, chk, {f"{t}[{p}]": ends[(t, p)] for t, p in tps if (t, p) in ends},
        "; committed epochs dropped" if committed else "",
    )  # fmt: skip


def _check_in_flight(
    job: str,
    path: str,
    chk: int,
    states: Mapping[str, Mapping[str, Any]],
    replay: Mapping[str, Iterable[TP]],
    ends: Mapping[TP, int],
    lows: Mapping[TP, int],
) -> None:
    for task in sorted(replay):
        for tp in sorted(replay[task]):
            at = int(states[task]["positions"][tp])
            end, low = ends.get(tp, 0), lows.get(tp, 0)
            if low <= at <= end:
                continue
            raise ConfigError(
                f"savepoint {path} (checkpoint {chk} of job {job!r}) cannot be restored: task "
                f"{task} had records in flight in channel {tp[0]}[{tp[1]}] from offset {at} "
                f"(records still to replay: an unaligned checkpoint's channel state, a channel "
                "still recovering, or a loop's back-edge log), and they are gone: the partition "
                f"now holds offsets {low}..{end} (eosflow reset deleted the topic, or it was "
                "recreated or purged). No restart can bring them back. Restore a savepoint "
                "without records in flight: take one with `eosflow savepoint "
                f"{job} --stop` from a job running with aligned checkpoints (its final "
                "checkpoint waits until every channel delivered everything), and keep the "
                "job's topics until it is restored"
            )
