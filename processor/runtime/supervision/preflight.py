"""Start-up checks: what a job needs is checked once, before any worker starts, so that a
bad configuration fails with a message instead of a restart loop."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

from processor.compiler import Plan
from processor.contracts import preflight_sink
from processor.errors import ConfigError
from processor.runtime.job import RunOptions

__all__ = ["check_local_recovery", "extra_environ", "preflight"]

log = logging.getLogger(__name__)


def check_local_recovery(plan: Plan) -> None:
    """What ``--recovery local`` cannot keep exactly once (docs/local-recovery.md, "Limits").

    Raises:
        ConfigError: which step, why, and what to use instead.
    """
    job, steps = plan.job, plan.flow.steps.values()
    if plan.cyclic:
        raise ConfigError(
            f"job {job!r} has a loop (iterate): --recovery local is not supported "
            "for loops yet (records in a loop carry an iteration count, not the record IDs "
            "local recovery drops copies by); use --recovery global"
        )
    routed = [s.name for s in steps if s.params.get("late") == "dead_letters"]
    if routed:
        raise ConfigError(
            f"job {job!r}: --recovery local cannot keep late records exactly "
            f"once in step(s) {routed} (late='dead_letters'): whether a record is late "
            "depends on how the restarted worker's inputs interleave, and the surviving "
            "tasks keep the windows it emitted before. Use --recovery global, or "
            "late='drop'"
        )
    processes = [s.name for s in steps if s.kind == "process"]
    if processes:
        raise ConfigError(
            f"job {job!r}: --recovery local cannot keep step(s) {processes} "
            "(process) exactly once: what a timer emits has no record ID that a restarted "
            "worker would give it again (processing-time timers fire when the clock says, "
            "event-time ones may emit several records per key and time), and its state "
            "depends on how its input channels interleave. Use --recovery global"
        )
    joins = [s.name for s in steps if s.kind == "join"]
    if joins:
        raise ConfigError(
            f"job {job!r}: --recovery local cannot keep the join step(s) {joins} exactly "
            "once: a join's output records have no identity of their own that a restarted "
            "worker would give them again (a pair is emitted by whichever of its records "
            "arrives second, and a temporal join's records by the watermark that passes them). "
            "Use --recovery global"
        )
    _check_sinks_local_recovery(plan)
    crossing = plan.interleaving_dependent()
    if crossing:
        step, edge = crossing[0]
        raise ConfigError(
            f"job {job!r}: --recovery local cannot keep step {step!r} exactly "
            f"once: it reads several input channels and its output reaches step "
            f"{edge.dst_step!r} through channel topic {edge.topic}. A restarted worker "
            f"reads its channels again in another order, so {step!r} would re-emit "
            "different results under the record IDs the surviving downstream tasks already "
            "kept (a mix of old and new values). Use --recovery global, a windowed "
            "aggregation, or a sink right after the step (in its own stage)"
        )


def _check_sinks_local_recovery(plan: Plan) -> None:
    """A sink whose commit spans its subtasks declares why a worker restarted alone would
    break it: ``local_recovery_unsupported`` (a class attribute, the reason as a sentence)."""
    flow = plan.flow
    sinks = [(s.name, s.params["sink"]) for s in flow.steps.values() if s.kind == "sink"]
    if flow.dead_letter_sink is not None:
        sinks.append(("dead letters", flow.dead_letter_sink))
    for name, sink in sinks:
        why = getattr(sink, "local_recovery_unsupported", None)
        if why:
            raise ConfigError(
                f"job {plan.job!r}: --recovery local cannot keep sink step {name!r} "
                f"({sink!r}) exactly once: {why}. Use --recovery global (the default) with "
                "this sink"
            )


def preflight(plan: Plan, options: RunOptions, interval: float | None) -> None:
    """Sinks check their configuration; ``dedup`` steps check their Redis."""
    if not options.drain and not options.until_idle:
        raise ConfigError(
            "--no-drain only applies to a bounded run: add --until-idle, or leave --no-drain "
            "out (a job that runs until stopped never drains its watermark)"
        )
    flow = plan.flow
    sinks = [s.params["sink"] for s in flow.steps.values() if s.kind == "sink"]
    if flow.dead_letter_sink is not None:
        sinks.append(flow.dead_letter_sink)
    else:
        log.warning(
            "job=%s has no dead-letter destination: records that fail to decode (or whose "
            "timestamp function raises KeyError, TypeError or ValueError) are counted, logged "
            "and skipped, and any other user function that raises fails the job; "
            "give Dataflow(..., dead_letters=<sink>) to keep them",
            plan.job,
        )
    with extra_environ(options.environ):
        for sink in sinks:
            preflight_sink(
                sink,
                job=plan.job,
                checkpoint_interval=interval,
                checkpoint_timeout=options.checkpoint_timeout if interval is not None else None,
            )
        _preflight_redis(plan)


def _preflight_redis(plan: Plan) -> None:
    """``dedup`` steps keep record IDs in Redis: it must answer within 5 s
    and must not evict them, or the job fails now, with the address, instead of timing its
    checkpoints out for minutes (issue 18). Each server is checked once."""
    users: dict[str | None, tuple[str, str]] = {}  # URL (None: the variable) -> what, source
    for step in plan.flow.steps.values():
        if step.kind == "dedup":
            url = step.params.get("redis_url")
            source = f"redis_url= of step {step.name!r}" if url else "EOSFLOW_REDIS_URL"
            users.setdefault(url or None, (f"dedup step {step.name!r}", source))
    if not users:  # redis-py is not imported for nothing (about 30 ms of start-up)
        return
    from dedup.server import allow_eviction, check_redis

    for url, (what, source) in users.items():
        check_redis(url, what=what, source=source, allow_eviction=allow_eviction())


@contextlib.contextmanager
def extra_environ(extra: dict[str, str]) -> Iterator[None]:
    """``os.environ`` plus ``extra`` while the pipeline file is loaded in this process."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
