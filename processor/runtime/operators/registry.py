"""Which operator runs each kind of step: the one table from a :class:`~processor.dataflow.Step`
to its runtime :class:`~processor.runtime.operators.core.Operator` (the task builds its fused chain
with it; sources and sinks are built by the task itself).

The modules of the operators beyond the stateless ones (dedup, joins, windows, sessions;
``process`` too, though the channels import it for their clock) are imported when a step
needs them: a worker's imports are on the way of every
start and restart, and a job without dedup need not load the Redis client and the Bloom
filters (``bench/RESULTS.md``, "Start-up without fsspec")."""

from __future__ import annotations

from processor.dataflow import Session, Step
from processor.runtime.operators.core import (
    Aggregate,
    Filter,
    FlatMap,
    KeyBy,
    Map,
    Operator,
    Passthrough,
)

__all__ = ["build_operator", "build_router"]


def build_router(step: Step) -> Operator:
    """The head before a global ``dedup`` step's shuffle: keys records by their ID."""
    from processor.runtime.operators.dedup_step import IdRouter

    return IdRouter(step)


def build_operator(step: Step, *, merged_input: bool = False) -> Operator:
    """The operator of a non-source, non-sink step."""
    kind = step.kind
    if kind == "map":
        return Map(step)
    if kind == "filter":
        return Filter(step)
    if kind == "flat_map":
        return FlatMap(step)
    if kind == "key_by":
        return KeyBy(step)
    if kind == "join":
        from processor.runtime.operators.joins import build_join

        return build_join(step)
    if kind in ("union", "iterate", "to_table"):  # pass records on (the task counts loops)
        return Passthrough(step)
    if kind == "dedup":
        from processor.runtime.operators.dedup_step import DedupOperator

        return DedupOperator(step)
    if kind == "process":
        from processor.runtime.operators.process import ProcessOperator

        return ProcessOperator(step)
    if kind == "aggregate":
        window = step.params["window"]
        if window is None:
            return Aggregate(step)
        if isinstance(window, Session):
            from processor.runtime.operators.sessions import SessionAggregate

            return SessionAggregate(step)
        from processor.runtime.operators.windows import WindowedAggregate

        return WindowedAggregate(step, merged_input=merged_input)
    raise ValueError(f"no operator for step kind {kind!r}")
