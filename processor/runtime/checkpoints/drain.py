"""Drained checkpoints: a bounded run that ended with the maximum watermark.

``--until-idle`` reads every source partition up to the end offset it had at start-up, never
past it, and (unless ``--no-drain``) then advances the watermark to the end of time, as Flink's
``stop --drain`` does: every window, session and event-time timer fires, ``ttl`` state expires
and a ``dedup`` step forgets all its IDs, so the run's output is complete. That state can take
no new input: every later record would be late, and a copy of an old record would pass the
deduplication. So a checkpoint records the positions of the source tasks whose snapshot had
the drained watermark (the manifest's ``drained``, and ``drained_all``: every source task had
it), and a start whose plan has event-time steps refuses to restore it when the run is
unbounded, or when new input waits past those positions (or, after a full drain, in partitions
added since). The plan is the one starting: a step added to a drained running total counts.

A bounded run restarted after a crash on the same input (or run again on no new input) goes on,
as it would have. A job without event-time steps (a running total) goes on whatever the input:
its state means the same whatever the watermark. Before a refusal, the checkpoint's pending
sink commits are settled: no later start would restore it to commit them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from processor.compiler import Plan
from processor.errors import ConfigError
from processor.snapshot.store import Manifest

__all__ = ["check_drained", "drained_metadata", "event_time_steps"]


def drained_metadata(positions: list[list[Any]] | None, *, every: bool) -> dict[str, Any]:
    """The manifest's ``drained`` entries: the positions of the source tasks whose snapshot
    had the drained watermark (``None``: none had), and whether every source task had it."""
    if positions is None:
        return {}
    return {"drained": sorted(positions), "drained_all": every}


def event_time_steps(plan: Plan) -> list[str]:
    """The steps of ``plan`` whose operator depends on the watermark (``Operator.event_time``:
    windows, sessions, joins, ``process``, ``dedup``, ``ttl``)."""
    steps = plan.flow.steps.values()
    return [s.name for s in steps if s.kind not in ("source", "sink") and _event_time(s)]


def _event_time(step: Any) -> bool:
    from processor.runtime.operators.registry import build_operator  # no I/O: ``open`` connects

    return build_operator(step).event_time


def check_drained(
    plan: Plan,
    latest: Manifest | None,
    transport: Any,
    *,
    until_idle: bool,
    local_recovery: bool = False,
    settle: Callable[[], object] = lambda: None,
) -> None:
    """Refuses to continue a drained checkpoint where new input would be late (module
    docstring). ``local_recovery``: ``--recovery local``, whose copy check forgets IDs behind
    the watermark as a ``dedup`` step does. ``settle`` commits what the checkpoint left
    pending before the refusal: a job killed after its final checkpoint completed and before
    its sinks committed must not lose that output because no later start restores it.

    Raises:
        ConfigError: what was drained, what would be lost, and the ways on.
    """
    drained = latest.metadata.get("drained") if latest is not None else None
    if drained is None:
        return
    assert latest is not None
    timed = event_time_steps(plan)
    if local_recovery:  # its copy check keeps IDs behind the watermark, as a dedup step does
        timed.append("the local recovery copy check")
    if not timed:  # a running total means the same whatever the watermark
        return
    positions = {(str(t), int(p)): int(o) for t, p, o in drained}
    if until_idle:
        grown = _grown(plan, transport, positions, every=bool(latest.metadata.get("drained_all")))
        if not grown:
            return
        shown = ", ".join(f"{t}[{p}] +{n:,}" for (t, p), n in sorted(grown.items())[:5])
        more = f" and {len(grown) - 5} more" if len(grown) > 5 else ""
        why = (
            f"New input arrived since ({shown}{more} offsets past the drained positions), and "
            "all of it would be late"
        )
    else:
        why = "A run without --until-idle takes new input, and all of it would be late"
    settle()
    raise ConfigError(
        f"job {plan.job!r}: checkpoint {latest.checkpoint_id} ends a bounded run "
        "(--until-idle) that drained the watermark to the end of time: every window and timer "
        f"of {timed} fired and deduplication forgot its IDs. {why}. The job is finished and "
        "its output is committed. To process the new input, start a job afresh "
        f"(eosflow reset {plan.job}, or another job name), which reads its sources from their "
        "start again; and end bounded runs that a later run continues with --until-idle "
        '--no-drain (docs/engine.md, "Bounded runs")'
    )


def _grown(
    plan: Plan, transport: Any, positions: dict[tuple[str, int], int], *, every: bool
) -> dict[tuple[str, int], int]:
    """Offsets past the drained positions, per partition; with ``every`` source task drained,
    also partitions added since (with records)."""
    tps = list(positions)
    if every:
        topics = {s.params["topic"] for s in plan.flow.steps.values() if s.kind == "source"}
        for topic in sorted(topics):
            tps += [(topic, p) for p in range(transport.partition_count(topic))]
        tps = sorted(set(tps))
    ends = transport.end_offsets(tps)
    return {tp: ends[tp] - positions.get(tp, 0) for tp in tps if ends[tp] > positions.get(tp, 0)}
