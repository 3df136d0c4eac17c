"""Dedup IDs across a change of the job's parallelism: inherited read-only prefixes.

A stored ID cannot be re-split by key (a keyed ID is ``value_id([key, id(value)])``), so the
IDs stay where the old subtasks wrote them (docs/dedup.md, "Changing the parallelism";
docs/design-rescaling.md 3.5, option B):

- every shape epoch writes under its own prefixes (:func:`dedup_prefix`): a subtask of a new
  shape never writes to, nor deletes from, an older one;
- the runner gives each new subtask :func:`merge_dedup_states` of the old subtasks that may
  hold its keys (``processor.wire.shared_keys``): lineage, filters and the list of old prefixes
  it *inherits*, with the write markers each must still hold;
- :class:`InheritingIdStore` looks a Bloom hit up in its own prefix and in every inherited one,
  in the same single round trip, and checks the inherited write markers there too (a lookup
  never answers "absent" from a prefix that lost IDs);
- an inherited prefix is retired once the subtask's cut-off has passed the newest bucket it
  held: every ID there is older than the horizon;
- :func:`sweep_retired` deletes the prefixes of older epochs that no retained checkpoint
  references any more (:func:`referenced_prefixes`).

Invariants:
    An inherited prefix is only read. Several new subtasks may share it, each with its own
    watermark, so only :func:`sweep_retired`, given every prefix the retained checkpoints
    reference, deletes it.
    No false negatives across a change of parallelism: an ID recorded before the checkpoint
    the new shape restores is reported as seen while its timestamp is within the horizon.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dedup.buckets import merge_snapshots
from dedup.errors import DedupConfigError, RedisDataLost
from dedup.store import RedisIdStore, Scope

__all__ = [
    "InheritingIdStore",
    "dedup_prefix",
    "merge_dedup_states",
    "referenced_prefixes",
    "sweep_retired",
]

log = logging.getLogger(__name__)

MIN_TS = -(2**63)
_READS = (1, 2)  # dedup.core.STATE_VERSION and the one before it


def dedup_prefix(job: str, step: str, subtask: int, epoch: int = 0) -> str:
    """The Redis prefix of a dedup step's subtask in shape epoch ``epoch``.

    Epoch 0 keeps the name every job had before parallelism could change
    (``eosflow:<job>:dedup:<step>:<subtask>``), so existing jobs keep their IDs; later epochs
    write under ``eosflow:<job>:dedup:<step>:e<epoch>.<subtask>``.
    """
    if epoch < 0 or subtask < 0:
        raise ValueError(f"need epoch >= 0 and subtask >= 0, got {epoch}, {subtask}")
    base = f"eosflow:{job}:dedup:{step}"
    return f"{base}:{subtask}" if epoch == 0 else f"{base}:e{epoch}.{subtask}"


def _ints(mapping: Mapping[Any, Any]) -> dict[int, int]:
    return {int(k): int(v) for k, v in mapping.items()}


def merge_dedup_states(old: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The dedup state of one new subtask after a change of parallelism.

    Args:
        old: ``(prefix, snapshot state)`` of every old subtask that may hold the new subtask's
            keys (``shared_keys(...)[i]``), each state taken at the same checkpoint.

    Returns:
        A state :meth:`dedup.core.Deduplicator.restore` accepts: lineage = union (a run
        belongs to one old subtask); watermark and cut-off = the lowest; prepared = the
        highest; filters = per bucket the union (no false negatives); ``written`` empty (the
        new subtask has written nothing yet); ``inherited`` = every old prefix with the write
        markers it must still hold, and the old states' own inherited prefixes.

    Raises:
        DedupConfigError: the states disagree on ``within``/``bucket`` or have an unknown
            version.
        ValueError: ``old`` is empty.
    """
    if not old:
        raise ValueError("merge_dedup_states needs at least one old state")
    states = [state for _prefix, state in old]
    for prefix, state in old:
        if state.get("version") not in _READS:
            raise DedupConfigError(
                f"dedup state of {prefix!r} has version {state.get('version')!r}; this eosflow "
                f"merges versions {_READS}"
            )
    for name in ("bucket_ms", "within_ms"):
        values = {state[name] for state in states}
        if len(values) > 1:
            raise DedupConfigError(
                f"the old dedup states disagree on {name} ({sorted(values)}): they cannot be "
                "merged; restore the job at its old parallelism first"
            )
    lineage: dict[int, int] = {}
    for state in states:  # a run shared by two states (inherited by both) has one cut-off
        for run, cut in _ints(state["lineage"]).items():
            lineage[run] = max(cut, lineage.get(run, cut))
    inherited: dict[str, dict[str, Any]] = {}

    def inherit(prefix: str, written: dict[int, int], buckets: list[int] | None) -> None:
        entry = inherited.setdefault(prefix, {"prefix": prefix, "written": {}, "buckets": buckets})
        for run, n in written.items():
            entry["written"][run] = max(n, entry["written"].get(run, 0))
        if entry["buckets"] is None or buckets is None:
            entry["buckets"] = None  # read again at restore
        else:
            entry["buckets"] = sorted(set(entry["buckets"]) | set(buckets))

    for prefix, state in old:
        inherit(prefix, _ints(state.get("written", {})), None)
        for entry in state.get("inherited", []):
            buckets = entry.get("buckets")
            inherit(entry["prefix"], _ints(entry["written"]), buckets and [int(b) for b in buckets])
    caps = {state.get("expected_ids") for state in states}
    cap = caps.pop() if len(caps) == 1 else None  # None: an older snapshot, or they disagree
    cutoff = min(state["cutoff"] for state in states)
    bucket_ms = states[0]["bucket_ms"]
    return {
        "version": 2,
        "lineage": lineage,
        "written": {},
        "prepared": max(state["prepared"] for state in states),
        "watermark": min(state["watermark"] for state in states),
        "cutoff": cutoff,
        "bucket_ms": bucket_ms,
        "within_ms": states[0]["within_ms"],
        "expected_ids": cap,
        "filters": merge_snapshots(
            [state["filters"] for state in states],
            expected_ids=cap,
            drop_before=cutoff,
            bucket_ms=bucket_ms,
        ),
        "inherited": [inherited[p] for p in sorted(inherited)],
    }


def referenced_prefixes(state: dict[str, Any] | None) -> set[str]:
    """The inherited prefixes a dedup snapshot state still reads (its own prefix is not in
    the state: the runner knows it from the step, subtask and epoch)."""
    return {entry["prefix"] for entry in (state or {}).get("inherited", [])}


_GLOB = re.compile(r"([*?\[\]\\])")
_SUBTASK = re.compile(r"(?:e(\d+)\.)?(\d+)")


def sweep_retired(client: Any, job: str, step: str, keep: set[str], epoch: int) -> int:
    """Deletes every key of the dedup prefixes of ``job``'s step ``step`` of shape epochs
    before ``epoch`` that are not in ``keep``; returns how many keys it deleted.

    ``keep``: every prefix (own and inherited) that a retained checkpoint still references.
    Prefixes of ``epoch`` and later are never touched. Uses ``SCAN`` (never ``KEYS``), and
    deletes in batches of 1,000 keys.
    """
    base = f"eosflow:{job}:dedup:{step}:"
    deleted = 0
    doomed: list[str] = []

    def flush() -> None:
        nonlocal deleted
        if doomed:
            deleted += int(client.delete(*doomed))
            doomed.clear()

    for raw in client.scan_iter(match=_GLOB.sub(r"\\\1", base) + "*", count=1000):
        key = raw.decode() if isinstance(raw, bytes) else raw
        head, sep, _rest = key[len(base) :].partition(":")
        found = _SUBTASK.fullmatch(head)
        if not sep or found is None:
            continue  # not a dedup prefix of this step (another step's name starts the same)
        if int(found.group(1) or 0) >= epoch or base + head in keep:
            continue
        doomed.append(key)
        if len(doomed) >= 1000:
            flush()
    flush()
    if deleted:
        log.info(
            "dedup prefixes retired job=%s step=%s before_epoch=%d keys_deleted=%d",
            job, step, epoch, deleted,
        )  # fmt: skip
    return deleted


@dataclass
class _Inherited:
    prefix: str
    written: dict[int, int]  # run -> batches this prefix must still account for
    buckets: list[int] | None  # bucket starts it held when first inherited
    mark: int = MIN_TS  # its GC mark: buckets below it may be gone


class InheritingIdStore(RedisIdStore):
    """A :class:`RedisIdStore` that also reads the prefixes it inherited from the subtasks of
    older shapes (read-only). See the module docstring.

    Writes, GC and its own write marker concern its own prefix only. A lookup reads the
    inherited prefixes' buckets and write markers in the same pipeline as its own: still one
    round trip per batch.
    """

    def __init__(self, client: Any, prefix: str, **kwargs: Any) -> None:
        super().__init__(client, prefix, **kwargs)
        self.inherited: list[_Inherited] = []

    def inherit(self, entries: list[dict[str, Any]], *, on_lost: str = "fail") -> None:
        """Takes the inherited prefixes of a restored state, and checks them (one round trip):
        their write markers must account for ``written`` (else :class:`RedisDataLost`, or with
        ``on_lost="accept"`` a warning and no further check); reads their GC marks and, the
        first time, the buckets they hold."""
        self.inherited = [
            _Inherited(
                e["prefix"],
                _ints(e.get("written", {})),
                None if e.get("buckets") is None else sorted(int(b) for b in e["buckets"]),
            )
            for e in entries
        ]
        if not self.inherited:
            return

        def run() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for inh in self.inherited:
                pipe.smembers(f"{inh.prefix}:buckets")
                pipe.get(f"{inh.prefix}:gc")
                if inh.written:
                    pipe.hmget(f"{inh.prefix}:written", list(inh.written))
            return list(pipe.execute())

        replies = iter(self._call("inherit", run))
        for inh in self.inherited:
            members, mark = next(replies), next(replies)
            markers = next(replies) if inh.written else []
            if inh.buckets is None:
                inh.buckets = sorted(int(m) for m in members)
            inh.mark = MIN_TS if mark is None else int(mark)
            try:
                self._check_markers(inh, markers)
            except RedisDataLost as exc:
                if on_lost != "accept":
                    raise
                log.warning(
                    "dedup store %s: going on without the lost IDs of inherited prefix %s "
                    "(on_lost=accept): copies of records whose IDs were lost may pass once. %s",
                    self.prefix, inh.prefix, exc,
                )  # fmt: skip
                inh.written = {}

    def _check_markers(self, inh: _Inherited, markers: list[Any]) -> None:
        if inh.written:
            self._check_written(inh.prefix, inh.written, markers)

    def retire(self, cutoff_ms: int, bucket_ms: int) -> list[str]:
        """Stops reading the inherited prefixes whose every bucket is wholly below
        ``cutoff_ms`` (their IDs are older than the horizon); returns them."""
        gone = [
            inh.prefix
            for inh in self.inherited
            if not inh.buckets or inh.buckets[-1] + bucket_ms <= cutoff_ms
        ]
        if gone:
            self.inherited = [inh for inh in self.inherited if inh.prefix not in gone]
            log.info("dedup store %s: inherited prefixes retired %s", self.prefix, gone)
        return gone

    def inherited_state(self) -> list[dict[str, Any]]:
        """The inherited prefixes, for the snapshot."""
        return [
            {"prefix": inh.prefix, "written": dict(inh.written), "buckets": list(inh.buckets or [])}
            for inh in self.inherited
        ]

    def deleted_below(self) -> int:
        """The highest GC mark of its own prefix and the inherited ones (a restore of an older
        checkpoint than the one an old subtask deleted buckets after)."""
        return max([super().deleted_below(), *(inh.mark for inh in self.inherited)])

    def _scopes(self, buckets: list[int], watch: Mapping[int, int]) -> list[Scope]:
        """Its own prefix, then every inherited one: the buckets of ``buckets`` it held, and
        the write markers it must still hold (checked in the lookup's round trip)."""
        wanted = set(buckets)
        return super()._scopes(buckets, watch) + [
            (inh.prefix, sorted(wanted & set(inh.buckets or ())), inh.written)
            for inh in self.inherited
        ]

    def verify(self, watch: Mapping[int, int]) -> None:
        """As :meth:`RedisIdStore.verify`, and the inherited write markers (one round trip)."""
        checks = [inh for inh in self.inherited if inh.written]
        if not checks:
            super().verify(watch)
            return
        args = self._watch_args(None, watch)

        def run() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            if args is not None:
                self._count_written(keys=[self._written], args=args, client=pipe)
            for inh in checks:
                pipe.hmget(f"{inh.prefix}:written", list(inh.written))
            return list(pipe.execute())

        replies = self._call("verify", run)
        if args is not None:
            self._raise_if_lost(replies.pop(0), watch)
        for inh, markers in zip(checks, replies, strict=True):
            self._check_markers(inh, markers)
