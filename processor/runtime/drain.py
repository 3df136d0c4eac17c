"""Drained checkpoints: a bounded run that ended with the maximum watermark.

``--until-idle`` reads every source partition up to the end offset it had at start-up, never
past it, and (unless ``--no-drain``) then advances the watermark to the end of time, as Flink's
``stop --drain`` does: every window, session and event-time timer fires, ``ttl`` state expires
and a ``dedup`` step forgets all its IDs, so the run's output is complete. That state can take
no new input: every later record would be late, and a copy of an old record would pass the
deduplication. So a checkpoint records which source partitions it drained (the manifest's
``drained``: their positions), when some task of the job keeps event-time state, and a later
start refuses it when new input waits past those positions, or when the run is unbounded.

A start restoring a drained checkpoint is refused unless it is a bounded run and no drained
partition has grown: a bounded run restarted after a crash with the same input (or run again
on no new input) continues as it would have. A job with no event-time state (a running total)
is never drained in this sense: its state means the same whatever the watermark.
"""

from __future__ import annotations

from typing import Any

from processor.compiler import Plan
from processor.errors import ConfigError
from processor.snapshot.store import Manifest

__all__ = ["check_drained", "drained_metadata"]


def drained_metadata(positions: list[list[Any]], event_time: bool) -> dict[str, Any]:
    """The manifest's ``drained`` entry: the drained source partitions' positions, if the
    checkpoint drained any and some task keeps event-time state; else nothing."""
    if not positions or not event_time:
        return {}
    return {"drained": sorted(positions)}


def check_drained(plan: Plan, latest: Manifest | None, transport: Any, *, until_idle: bool) -> None:
    """Refuses to continue a drained checkpoint where new input would be late (module
    docstring).

    Raises:
        ConfigError: what was drained, what would be lost, and the three ways on.
    """
    drained = latest.metadata.get("drained") if latest is not None else None
    if not drained:
        return
    assert latest is not None
    positions = {(str(t), int(p)): int(o) for t, p, o in drained}
    if until_idle:
        ends = transport.end_offsets(list(positions))
        grown = {tp: ends[tp] - o for tp, o in positions.items() if ends.get(tp, o) > o}
        if not grown:
            return
        shown = ", ".join(f"{t}[{p}] +{n:,}" for (t, p), n in sorted(grown.items())[:5])
        more = f" and {len(grown) - 5} more" if len(grown) > 5 else ""
        why = (
            f"new input arrived since ({shown}{more} offsets past the drained positions), and "
            "all of it would be late"
        )
    else:
        why = "a run without --until-idle takes new input, and all of it would be late"
    raise ConfigError(
        f"job {plan.job!r}: checkpoint {latest.checkpoint_id} ends a bounded run "
        "(--until-idle) that drained the watermark to the end of time: every window and timer "
        f"fired and deduplication forgot its IDs. {why[0].upper()}{why[1:]}. To go on: "
        "restore a savepoint taken before the drain (--from-savepoint); or start the job "
        f"afresh (eosflow reset {plan.job}, or another job name); and end bounded runs that a "
        'later run continues with --until-idle --no-drain (docs/engine.md, "Bounded runs")'
    )
