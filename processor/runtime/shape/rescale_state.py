"""Keyed operator state after a change of parallelism (issue 24, step 4).

When a job restores at another parallelism, the runner reads the snapshots of every old subtask
of a stage and, for each new subtask and each stateful step, calls :func:`redistribute` with the
step's states from the old subtasks that may hold keys the new subtask owns
(:func:`processor.wire.shared_keys`) and a ``keep(key)`` predicate (the new subtask owns the
key). The result goes into the new subtask's snapshot and is loaded by the operator's own
``restore()``. Shapes and rules: docs/design-rescaling.md, section 2.

Rules, per piece of state:

* **Per key** (accumulators, windows, sessions, table versions, waiting records, held records,
  process state and timers): kept iff ``keep(key)``. A key lives in exactly one old subtask (the
  old routing sent each key to one owner), so merging is a union; per-key order is kept because
  a key's entries all come from one old state, in that state's order.
* **Heaps with ``seq`` tie-breakers** (a temporal join's ``waiting``, a table join's
  ``changes``): concatenated, sorted by ``(t, old subtask, seq)`` and renumbered ``1..n``; the
  sorted list is a heap, and the operator's ``seq`` becomes ``n`` so that new entries sort after
  the restored ones of the same time, as they would have in the old operator. Heaps that
  ``restore()`` rebuilds itself (session ends, interval-join expiry, process timers) are not in
  the snapshots: their entries are merged and the operator renumbers them.
* **Watermarks** (and a table's ``pruned_at``, which is the watermark of its last prune): the
  minimum. At an aligned checkpoint every subtask of a shuffled stage holds the same watermark
  (each upstream subtask writes its watermark to all of its output partitions), so the minimum
  is exact there; taking the maximum would make records that are on time for the old owner
  late (dropped) in the new one. Stages whose subtasks may differ (forward-fed, keyed sources)
  need the per-key-group floor of the design note, not built here.
* **Keyed-source stages** (keyed steps reading keyed sources without a shuffle) place keys by
  Kafka partition, not by key group: the runner refuses to change such a job's parallelism
  (:func:`processor.runtime.shape.rescale.check_rescalable`), so ``keep`` is always by key group.
* **Counters** (``late_dropped``, ``expired``, ``fired``) and the ttl sweep mark are not in the
  snapshots: they start afresh in every new operator, as after any restore (a restored ttl
  aggregate sweeps at its first watermark).

Invariants:
    Keys are compared and hashed as the codec returns them; :func:`key_bytes` gives the bytes
    the channels hashed when routing the key (``orjson.dumps`` of a tuple and of a list are
    equal, so a tuple key that a channel turned into a list and back hashes the same).
    ``redistribute`` never mutates ``states`` and returns fresh containers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from operator import itemgetter
from typing import Any

import orjson

__all__ = ["KINDS", "key_bytes", "redistribute"]

Keep = Callable[[Any], bool]


def key_bytes(key: Any) -> bytes:
    """The bytes a channel hashes to route ``key``: UTF-8 for ``str``, else ``orjson.dumps``
    (``processor.runtime.task.channels.ChannelOut.process``)."""
    return key.encode() if type(key) is str else orjson.dumps(key)


def redistribute(kind: str, states: list[Any], keep: Keep) -> Any:
    """The snapshot of one stateful step for a new subtask: the state of exactly the keys `keep`
    accepts, merged from `states` (the step's snapshots, after the snapshot codec round trip, of
    the old subtasks that may hold such keys, in old-subtask order). Accepted by the operator's
    restore().

    Args:
        kind: the step's :func:`processor.runtime.operators.state_map.state_kind`.
        states: the old subtasks' states of the step; ``None`` (no state) entries are skipped.
        keep: ``keep(key)`` is true iff the new subtask owns ``key``.

    Returns:
        The merged state; ``None`` (a fresh start) when no old state was given.

    Raises:
        ValueError: ``kind`` is a dedup kind (its IDs in Redis carry no key: redistributed
            elsewhere) or unknown.
    """
    if kind in ("dedup", "keyed-dedup"):
        raise ValueError(
            f"state kind {kind!r} is not redistributed by key here: a dedup step's IDs carry "
            "no key, so its state moves by key group with its Redis buckets (its own helper)"
        )
    merge = _MERGERS.get(kind)
    if merge is None:
        raise ValueError(
            f"no redistribution for state kind {kind!r}; expected one of {', '.join(KINDS)}"
        )
    present = [s for s in states if s is not None]
    if not present:
        return None
    return merge(present, keep)


def _aggregate(states: list[Any], keep: Keep) -> Any:
    # Without ttl a dict key -> acc; with ttl a list of [key, acc, touched] (a list tells the
    # two apart in restore()). Every old subtask ran the same step, so the shapes agree; should
    # a dict come among lists, its keys get touched None, which is what restore() gives a key
    # of a snapshot taken without ttl.
    if any(isinstance(s, list) for s in states):
        out: list[Any] = []
        for s in states:
            if isinstance(s, dict):
                out += [[k, acc, None] for k, acc in s.items() if keep(k)]
            else:
                out += [[k, acc, last] for k, acc, last in s if keep(k)]
        return out
    return {k: acc for s in states for k, acc in s.items() if keep(k)}


def _window_aggregate(states: list[Any], keep: Keep) -> Any:
    windows: dict[Any, dict[Any, Any]] = {}
    for s in states:
        for end, bucket in s["windows"].items():
            kept = {k: acc for k, acc in bucket.items() if keep(k)}
            if kept:  # a window with no key left fires nothing: dropped
                windows.setdefault(end, {}).update(kept)
    return {"watermark": _watermark(states), "windows": dict(sorted(windows.items()))}


def _session_aggregate(states: list[Any], keep: Keep) -> Any:
    # restore() rebuilds the heap of session ends from these, in this order.
    sessions = [[k, [list(x) for x in ss]] for s in states for k, ss in s["sessions"] if keep(k)]
    return {"watermark": _watermark(states), "sessions": sessions}


def _versions(saved: Iterable[Any], keep: Keep) -> list[Any]:
    """Merged ``_Versions`` snapshots ``[pruned_at, [[key, versions]]]``."""
    parts = list(saved)
    rows = [[k, list(vs)] for _pruned, kvs in parts for k, vs in kvs if keep(k)]
    return [min(p[0] for p in parts), rows]


def _temporal_join(states: list[Any], keep: Keep) -> Any:
    waiting = _heap(states, "waiting", keep)
    return {
        "watermark": _watermark(states),
        "table": _versions((s["table"] for s in states), keep),
        "waiting": waiting,
        "seq": len(waiting),
    }


def _table_join(states: list[Any], keep: Keep) -> Any:
    changes = _heap(states, "changes", keep)
    return {
        "watermark": _watermark(states),
        "sides": [_versions((s["sides"][side] for s in states), keep) for side in (0, 1)],
        "last": [k for s in states for k in s["last"] if keep(k)],
        "changes": changes,
        "seq": len(changes),
    }


def _interval_join(states: list[Any], keep: Keep) -> Any:
    # restore() rebuilds the expiry heaps from the held records.
    held = [
        [[k, list(rs)] for s in states for k, rs in s["held"][side] if keep(k)] for side in (0, 1)
    ]
    return {"watermark": _watermark(states), "held": held}


def _process(states: list[Any], keep: Keep) -> Any:
    # Each old list of timers is in firing order (time, then registration); a stable sort of
    # their concatenation by time gives (time, old subtask, old order), and restore() numbers
    # them in that order. Only timers of different keys at one time can swap; a key's timers
    # come from one state, in their old order (the sort keeps the snapshot's "firing order").
    timers: dict[str, list[list[Any]]] = {}
    for s in states:
        for kind, entries in s["timers"].items():
            timers.setdefault(kind, []).extend([t, k] for t, k in entries if keep(k))
    for entries in timers.values():
        entries.sort(key=itemgetter(0))
    return {
        "watermark": _watermark(states),
        "state": [[k, v] for s in states for k, v in s["state"] if keep(k)],
        "timers": timers,
    }


def _heap(states: list[Any], field: str, keep: Keep) -> list[tuple[Any, ...]]:
    """Entries ``(t, seq, key, ...)`` of every state's heap ``field`` whose key is kept, in
    ``(t, old subtask, seq)`` order with ``seq`` renumbered from 1: a sorted list is a heap."""
    entries = [
        (e[0], i, e[1], tuple(e)) for i, s in enumerate(states) for e in s[field] if keep(e[2])
    ]
    entries.sort(key=lambda x: (x[0], x[1], x[2]))
    return [(e[0], n, *e[2:]) for n, (_t, _i, _seq, e) in enumerate(entries, 1)]


def _watermark(states: list[Any]) -> Any:
    return min(s["watermark"] for s in states)


_MERGERS: dict[str, Callable[[list[Any], Keep], Any]] = {
    "aggregate": _aggregate,
    "window-aggregate": _window_aggregate,
    "session-aggregate": _session_aggregate,
    "temporal-join": _temporal_join,
    "table-join": _table_join,
    "interval-join": _interval_join,
    "process": _process,
}

#: The state kinds :func:`redistribute` handles (``state_kind`` values).
KINDS = tuple(_MERGERS)
