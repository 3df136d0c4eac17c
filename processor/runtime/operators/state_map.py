"""Which operator state a restore keeps: the plan's stateful steps against the checkpoint's.

Operator state is keyed by step name in each task's snapshot (``operators``), and a task
restores the entries whose name is one of its steps. Before this check, the state of a step
that was renamed or removed (and was not the first step of its stage: that renames the stage,
which :func:`~processor.runtime.topics.check_graph` refuses) was skipped without a word while
the sources went on from the checkpoint's offsets: silent data loss. :func:`check_state` runs
in the runner before any worker starts and refuses, naming the step, the checkpoint and the
fixes:

* state of a step the pipeline no longer has (or has without state, or in another stage):
  rename it back, ``--map-state OLD=NEW`` (restore OLD's state into NEW, a stateful step of the
  same kind in the same stage), or ``--allow-dropped-state`` (dropped, logged);
* a changed kind under the same name (a ``count`` that became a ``process``, a windowed
  aggregate that became an unwindowed one): the snapshot would not fit the new operator.

A new stateful step without state in the checkpoint starts empty (logged at INFO).

**How the runner learns which steps have state.** Every manifest the coordinator writes
carries the plan's layout under the metadata key :data:`STATE_KEY` (stage -> step -> kind, from
:func:`state_layout`). That is exact, not a guess: the tasks snapshot the stateful operators of
their stage, and a worker whose plan differs from the runner's (its fingerprint) is refused,
so every task of a run writes exactly this layout. It costs a few bytes per manifest and no
read of the snapshots, whose size grows with the keyed state (a task's snapshot can be hundreds
of megabytes). Manifests written before the layout was recorded fall back to reading one task
snapshot per stage (every subtask of a stage holds the same operators); their snapshots carry
no kinds either, so the kind check is skipped for them. Each task snapshot also records the
kind next to its operator state (``kinds``), so that a snapshot read on its own says what it
holds.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from processor.compiler import Plan
from processor.dataflow import Session, Step
from processor.errors import ConfigError
from processor.snapshot.store import Manifest, SnapshotStore

__all__ = ["STATE_KEY", "check_state", "restore_sources", "state_kind", "state_layout"]

log = logging.getLogger(__name__)

#: The manifest metadata key holding the layout of the operator state (:func:`state_layout`).
STATE_KEY = "state"

Layout = dict[str, dict[str, Any]]  # stage -> {step: kind (None: not recorded)}


def state_kind(step: Step) -> str | None:
    """The kind of state ``step`` keeps (``None``: none). Two steps of one kind have snapshots
    of one shape and meaning; the names are stable, since they are written in snapshots."""
    kind = step.kind
    if kind == "aggregate":
        window = step.params["window"]
        if window is None:
            return "aggregate"
        return "session-aggregate" if isinstance(window, Session) else "window-aggregate"
    if kind == "join":
        return f"{step.params['mode']}-join"
    if kind == "dedup":  # keyed IDs hash (key, id): other IDs than a global dedup's
        return "keyed-dedup" if step.keyed else "dedup"
    if kind == "process":
        return "process"
    return None


def state_layout(plan: Plan) -> dict[str, dict[str, str]]:
    """Stage name -> {stateful step -> its :func:`state_kind`}: what the plan's tasks snapshot."""
    steps = plan.flow.steps
    layout: dict[str, dict[str, str]] = {}
    for stage in plan.stages:
        kinds = {n: state_kind(steps[n]) for n in stage.steps}
        layout[stage.name] = {n: k for n, k in kinds.items() if k is not None}
    return layout


def restore_sources(operators: Iterable[str], map_state: Mapping[str, str]) -> dict[str, str]:
    """Target step -> the step whose snapshot state it restores: each step's own, except that
    ``OLD=NEW`` gives NEW the state of OLD (and NEW's own, if any, is dropped: the runner
    allowed that with ``--allow-dropped-state``)."""
    names = list(operators)
    sources = {n: n for n in names if n not in map_state}
    sources.update({map_state[n]: n for n in names if n in map_state})
    return sources


def _restored_layout(store: SnapshotStore, manifest: Manifest) -> Layout:
    recorded = manifest.metadata.get(STATE_KEY)
    if recorded is not None:
        return {stage: dict(steps) for stage, steps in recorded.items()}
    layout: Layout = {}  # an older manifest: one snapshot per stage says it
    for task in sorted(manifest.tasks):
        stage = task.rpartition(".")[0]
        if stage in layout:
            continue
        state = store.read_task_snapshot(manifest.tasks[task])
        kinds = state.get("kinds") or {}
        layout[stage] = {n: kinds.get(n) for n in state["operators"] if not n.startswith("~")}
    return layout


def check_state(
    plan: Plan,
    store: SnapshotStore,
    manifest: Manifest | None,
    map_state: Mapping[str, str],
    allow_dropped: bool,
) -> None:
    """Refuses a restore of ``manifest`` that would lose, misplace or misread operator state
    (see the module docstring); logs the state that starts empty, is mapped or is dropped.

    Raises:
        ConfigError: naming the steps, the checkpoint and the fixes.
    """
    job = plan.job
    if manifest is None:
        if map_state:
            raise ConfigError(
                f"job {job!r} has no completed checkpoint, so there is no state to map with "
                f"--map-state {_pairs(map_state)}: run it without the option"
            )
        return
    chk = manifest.checkpoint_id
    where = f"checkpoint {chk} of job {job!r} (in {store.url})"
    had, now = _by_step(_restored_layout(store, manifest)), _by_step(state_layout(plan))
    _check_mapping(plan, where, had, now, map_state)
    targets = set(map_state.values())
    dropped: dict[str, str] = {}
    changed: list[str] = []
    for step, (stage, kind) in sorted(had.items()):
        if step in map_state:
            continue
        if step in targets:
            dropped[step] = f"replaced by the state of {_old_of(map_state, step)!r}"
        elif step not in now:
            what = plan.flow.steps.get(step)
            gone = "no longer in the pipeline"
            dropped[step] = gone if what is None else f"now a {what.kind} step, keeping no state"
        elif now[step][0] != stage:
            dropped[step] = f"moved from stage {stage!r} to {now[step][0]!r}"
        elif kind is not None and kind != now[step][1]:
            changed.append(f"{step!r} (was {kind}, is {now[step][1]})")
    if changed:
        raise ConfigError(
            f"job {job!r}: {where} holds state of step(s) {', '.join(changed)} whose kind "
            "changed: the snapshot does not fit the new operator. Run the step as it was, or "
            "give the new step another name (the old state is then dropped: "
            "--allow-dropped-state)"
        )
    if dropped and not allow_dropped:
        listed = "; ".join(f"{s!r}: {why}" for s, why in dropped.items())
        raise ConfigError(
            f"job {job!r}: {where} holds state of step(s) that the pipeline would not restore "
            f"({listed}). Restoring would silently restart them from empty state while the "
            "sources go on from the checkpoint. Rename the step back, map its state onto a "
            "stateful step of the same kind in the same stage with --map-state OLD=NEW, or "
            "drop it with --allow-dropped-state"
        )
    for step, why in dropped.items():
        log.warning("dropping state step=%s checkpoint_id=%d: %s", step, chk, why)
    for old, new in sorted(map_state.items()):
        log.info("mapping state old=%s new=%s checkpoint_id=%d", old, new, chk)
    for step in sorted(set(now) - set(had) - targets):
        log.info(
            "new stateful step starts empty step=%s kind=%s checkpoint_id=%d",
            step, now[step][1], chk,
        )  # fmt: skip


def _check_mapping(
    plan: Plan,
    where: str,
    had: Mapping[str, tuple[str, Any]],
    now: Mapping[str, tuple[str, str]],
    map_state: Mapping[str, str],
) -> None:
    problems = []
    for old, new in sorted(map_state.items()):
        say = f"--map-state {old}={new}: "
        if old not in had:
            problems.append(
                f"{say}{where} holds no state of step {old!r} (it holds state of: "
                f"{', '.join(sorted(had)) or 'none'})"
            )
            continue
        if old in now:
            problems.append(
                f"{say}the pipeline still has the stateful step {old!r}; map only "
                "the state of steps it no longer has"
            )
        step = plan.flow.steps.get(new)
        if step is None or new not in now:
            why = "has no such step" if step is None else f"has it as a {step.kind} step"
            problems.append(
                f"{say}the pipeline {why}; NEW must be a stateful step (it has: "
                f"{', '.join(sorted(now)) or 'none'})"
            )
            continue
        (old_stage, old_kind), (new_stage, new_kind) = had[old], now[new]
        if old_kind is not None and old_kind != new_kind:
            problems.append(f"{say}{old!r} kept {old_kind} state, {new!r} is a {new_kind}")
        if old_stage != new_stage:
            problems.append(
                f"{say}{old!r} was in stage {old_stage!r}, {new!r} is in stage "
                f"{new_stage!r}: a task restores only its own stage's snapshot"
            )
        if "dedup" in str(new_kind):
            problems.append(
                f"{say}a dedup step keeps its IDs in Redis under its step name, "
                "which a mapping cannot move: rename the step back"
            )
    if problems:
        raise ConfigError(f"job {plan.job!r}: " + "; ".join(problems))


def _by_step(layout: Mapping[str, Mapping[str, Any]]) -> dict[str, tuple[str, Any]]:
    """Step -> (its stage, its kind)."""
    return {s: (stage, k) for stage, steps in layout.items() for s, k in steps.items()}


def _old_of(map_state: Mapping[str, str], new: str) -> str:
    return next(old for old, target in map_state.items() if target == new)


def _pairs(map_state: Mapping[str, str]) -> str:
    return " ".join(f"{old}={new}" for old, new in sorted(map_state.items()))
