"""Compilation of a ``Dataflow`` into stages connected by Kafka channel topics.

Rules (docs/engine.md, "From ``Dataflow`` to processes"):

* **Fusion.** Steps joined by forward edges run in one task (operator chaining): ``map``,
  ``filter``, ``flat_map``, ``key_by`` and ``sink`` stay in their parent's stage.
* **Shuffles.** A keyed aggregation (or ``process`` step) whose input is not already partitioned
  by its key starts a new stage; the edge is a channel topic of ``P x P`` partitions, key-routed
  with :func:`processor.wire.key_owner` (key groups). An aggregation over the output of another
  aggregation (same key, nothing re-keyed in between) needs no shuffle and is fused. A ``dedup``
  is placed the same way; a global one (unkeyed stream) always shuffles, keyed by the record ID.
* **Partial combining.** A windowed aggregation with a ``merge`` function (``count``, ``reduce``,
  ``aggregate(merge=...)``) that emits when its windows close gets a combiner on the upstream
  side of its shuffle: each batch sends one partial accumulator per key and window instead of
  every record.
* **Loops.** An ``iterate`` head starts a new stage fed by a forward channel; the body's feedback
  step writes to the head through another forward channel. A depth-first search over the stage
  graph from the sources classifies every edge: the edges to a stage still on the search's stack
  are the back-edges (the graph is a DAG plus back-edges). Each back-edge must be the feedback
  edge of an ``iterate``; checkpoints treat it with Algorithm 2 of Carbone et al. (2015), see
  docs/iterations.md. Channels inside a loop carry each record's iteration count.
* **Joins.** A ``join`` step's two inputs meet in one stage when they are partitioned alike there
  (keyed sources' streams merge their source stages); otherwise each input is shuffled by key
  to a new stage.
* **Union.** Streams of one stage stay in it; streams of different source stages merge those
  stages (a source stage has no inputs, so this cannot make a cycle); otherwise the union starts a
  new stage fed by *forward* channels (upstream subtask ``u`` writes to ``u``).

Every stage has the job's parallelism ``P`` (worker ``i`` runs subtask ``i`` of every stage), so a
forward edge never needs a repartition.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

from processor.dataflow import Dataflow, Sliding, Step
from processor.errors import DefinitionError
from processor.wire import channel_partition, channel_topic_name, default_key_groups, route_table

__all__ = [
    "HASHED",
    "Edge",
    "Plan",
    "Stage",
    "channel_inputs",
    "channel_partitions",
    "compile_flow",
]

#: The partitioning of a shuffle's output (by key group: :func:`processor.wire.key_owner`).
HASHED = "hashed"
#: ``None``, :data:`HASHED`, or the keyed source topics a stream is partitioned like.
Partitioning = frozenset[str] | str | None


@dataclass(frozen=True)
class Edge:
    """A channel topic between two stages.

    Attributes:
        topic: the internal topic (``P x P`` partitions).
        src_step: the step whose output is written to it.
        dst_step: the step that reads it.
        shuffle: key-routed (``True``) or forward, upstream ``u`` to downstream ``u`` (``False``).
        combine: the upstream side sends partial accumulators of a windowed aggregation.
        back: a back-edge (found by the depth-first search): the feedback of a loop.
        loop: both ends are in a loop; records carry their iteration count.
    """

    topic: str
    src_step: str
    dst_step: str
    src_stage: str
    dst_stage: str
    shuffle: bool
    combine: bool
    back: bool = False
    loop: bool = False


@dataclass(frozen=True)
class Stage:
    """Fused steps that run as one task per subtask.

    Attributes:
        name: the name of the stage's first step (task names are ``<stage>.<subtask>``).
        steps: the stage's steps in topological order.
        sources: the source steps (a source stage reads Kafka topics, not channels).
        inputs: channel edges the stage reads.
        outputs: channel edges the stage writes.
    """

    name: str
    steps: tuple[str, ...]
    sources: tuple[str, ...]
    inputs: tuple[Edge, ...]
    outputs: tuple[Edge, ...]

    def task(self, subtask: int) -> str:
        return f"{self.name}.{subtask}"


@dataclass(frozen=True)
class Plan:
    """A compiled dataflow."""

    flow: Dataflow
    parallelism: int
    stages: tuple[Stage, ...]
    #: Groups of keyed source topics that a keyed step reads without a shuffle: each topic's
    #: partition count must stay as it was at the job's first start, and the topics of one
    #: group must have equal counts (:func:`processor.runtime.topics.check_keyed_sources`).
    copartitioned: tuple[tuple[str, ...], ...] = ()
    #: The job's key-group count ``G``: a keyed record goes to the owner of key group
    #: ``crc32(key) % G`` (:func:`processor.wire.owner_of`); chosen at the job's first start
    #: and kept by a change of parallelism, which moves whole key groups (a larger count only
    #: when the new parallelism is above it: :mod:`processor.runtime.shape.rescale`).
    key_groups: int = 128
    #: The job's shape epoch: one more after each change of parallelism. The channel topics of
    #: each epoch are new topics (their partition count is ``P*P``).
    epoch: int = 0

    @property
    def job(self) -> str:
        return self.flow.name

    @property
    def edges(self) -> tuple[Edge, ...]:
        return tuple(e for s in self.stages for e in s.outputs)

    @property
    def cyclic(self) -> bool:
        """The dataflow has loops (``iterate``)."""
        return any(e.back for e in self.edges)

    def interleaving_dependent(self) -> list[tuple[str, Edge]]:
        """Steps whose output depends on how several input channels interleaved, paired with
        a channel their output reaches: a running (unwindowed) aggregation's values, a
        windowed one's with ``emit="update"``, a ``process`` step's state and outputs, and
        which copy a ``dedup`` step lets through. Under local recovery a restarted worker reads its
        channels again in another order, so such a step re-emits *other* records under IDs its
        surviving downstream tasks keep the first copy of (docs/local-recovery.md, "Limits").
        Windowed aggregations that emit when a window closes are not listed: a window fires
        on the watermark, which no channel passes before its own records, so its result does
        not depend on the order."""
        steps = self.flow.steps
        children: dict[str, list[str]] = {}
        for step in steps.values():
            for parent in step.parents:
                children.setdefault(parent, []).append(step.name)
        found = []
        for stage in self.stages:
            channels = sum(self.parallelism if e.shuffle else 1 for e in stage.inputs)
            if channels < 2 or not stage.outputs:
                continue
            for name in stage.steps:
                step = steps[name]
                running = step.kind == "aggregate" and (
                    step.params.get("window") is None or step.params.get("emit") == "update"
                )
                if not (running or step.kind in ("dedup", "process")):
                    continue
                reach, todo = {name}, [name]
                while todo:  # what the step's output flows through inside the stage
                    for child in children.get(todo.pop(), []):
                        if child in stage.steps and child not in reach:
                            reach.add(child)
                            todo.append(child)
                found += [(name, e) for e in stage.outputs if e.src_step in reach]
        return found

    def task_names(self) -> list[str]:
        return [s.task(i) for s in self.stages for i in range(self.parallelism)]

    def stage_of(self, step: str) -> Stage:
        for stage in self.stages:
            if step in stage.steps:
                return stage
        raise KeyError(step)

    def fingerprint(self) -> str:
        """A digest of the stages, channels and every step's plain parameters (topics, names,
        numbers). A worker whose compiled plan has another fingerprint than its runner's loaded
        the pipeline differently, e.g. it read other environment variables."""
        parts = [self.describe()]
        for step in self.flow.steps.values():
            plain = {
                k: v
                for k, v in step.params.items()
                if isinstance(v, str | int | float | bool) or v is None
            }
            parts.append(f"{step.name} {step.kind} {sorted(plain.items())!r}")
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]

    def describe(self) -> str:
        """A readable summary (``eosflow run --explain``)."""
        lines = [
            f"job {self.job!r}, parallelism {self.parallelism}, key groups {self.key_groups}"
            + (f", shape epoch {self.epoch}" if self.epoch else "")
        ]
        for s in self.stages:
            kind = f"sources {list(s.sources)}" if s.sources else "channel inputs"
            lines.append(f"  stage {s.name!r} ({kind}): {' -> '.join(s.steps)}")
            for e in s.outputs:
                how = "shuffle" + (" + combiner" if e.combine else "") if e.shuffle else "forward"
                if e.back:
                    how = "back-edge (loop feedback)"
                lines.append(f"    {how} {e.src_step} -> {e.dst_step} via topic {e.topic}")
        return "\n".join(lines)


def _edge_inputs(edge: Edge, subtask: int, parallelism: int) -> list[int]:
    """The partitions of ``edge``'s topic that downstream ``subtask`` reads: one from every
    upstream subtask on a shuffle, the one from its own subtask on a forward edge."""
    if edge.shuffle:
        return [channel_partition(u, subtask, parallelism) for u in range(parallelism)]
    return [channel_partition(subtask, subtask, parallelism)]


def channel_inputs(plan: Plan, stage: Stage, subtask: int) -> list[tuple[str, int]]:
    """The channel partitions subtask ``subtask`` of ``stage`` reads, by input edge, then by
    upstream subtask (:func:`processor.wire.channel_partition` lays them out)."""
    P = plan.parallelism
    return [(e.topic, p) for e in stage.inputs for p in _edge_inputs(e, subtask, P)]


def channel_partitions(plan: Plan) -> list[tuple[str, int]]:
    """Every channel partition some task of ``plan`` reads, by edge, then by partition (a
    forward edge's other partitions are never written)."""
    P = plan.parallelism
    return [
        (e.topic, p)
        for e in plan.edges
        for p in sorted(p for i in range(P) for p in _edge_inputs(e, i, P))
    ]


class _Stages:
    """Union-find over stage ids."""

    def __init__(self) -> None:
        self.parent: list[int] = []
        self.is_source: list[bool] = []

    def new(self, is_source: bool) -> int:
        self.parent.append(len(self.parent))
        self.is_source.append(is_source)
        return len(self.parent) - 1

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def merge(self, ids: list[int]) -> int:
        root = self.find(ids[0])
        for other in ids[1:]:
            self.parent[self.find(other)] = root
        return root


def compile_flow(
    flow: Dataflow,
    parallelism: int,
    *,
    combine: bool = True,
    key_groups: int | None = None,
    epoch: int = 0,
) -> Plan:
    """Turns ``flow`` into stages and channel edges.

    ``key_groups`` (default :func:`processor.wire.default_key_groups` of ``parallelism``) and
    ``epoch``: the job's topology (:mod:`processor.runtime.shape.rescale`), from its ``_TOPOLOGY``
    file; the defaults are a new job's.

    ``combine=False``: no combiner before shuffles (local recovery needs it: a combiner's
    partials depend on batch boundaries, so a restarted worker could not re-emit the same
    records with the same IDs).

    Raises:
        DefinitionError: the dataflow is invalid (see :meth:`Dataflow.validate`) or
            ``parallelism`` is not a positive int.
    """
    if isinstance(parallelism, bool) or not isinstance(parallelism, int) or parallelism < 1:
        raise DefinitionError(f"parallelism must be a positive int, got {parallelism!r}")
    flow.validate()
    steps = flow.steps
    stages = _Stages()
    stage_of: dict[str, int] = {}
    # How each step's output is partitioned among the subtasks: None (not by key), HASHED (a
    # shuffle's key routing) or the keyed source topics whose Kafka partitioning it keeps.
    partitioned: dict[str, Partitioning] = {}
    copartitioned: set[tuple[str, ...]] = set()
    # (src_step, dst_step, shuffle): channel edges, with the destination's stage known later
    channel_edges: list[tuple[str, str, bool]] = []

    def fuse_keyed(step: Step, parent: Step) -> bool:
        """A keyed stateful step stays in its parent's stage when the parent's output is
        partitioned by its key already; records what that relies on."""
        scheme = partitioned[parent.name]
        if scheme is None:
            stage_of[step.name] = stages.new(is_source=False)
            channel_edges.append((parent.name, step.name, True))
            return False
        stage_of[step.name] = stage_of[parent.name]
        if scheme != HASHED:
            copartitioned.add(tuple(sorted(scheme)))
        return True

    for step in steps.values():  # insertion order is topological: parents exist before children
        parents = [steps[p] for p in step.parents]
        if step.kind == "source":
            stage_of[step.name] = stages.new(is_source=True)
            keyed = step.params.get("keyed", False)
            partitioned[step.name] = frozenset([step.params["topic"]]) if keyed else None
        elif step.kind in ("aggregate", "process"):
            (parent,) = parents
            fused = fuse_keyed(step, parent)
            partitioned[step.name] = partitioned[parent.name] if fused else HASHED
        elif step.kind == "dedup":
            # Like an aggregation: copies of an ID (global) or of a key's ID must meet in one
            # subtask. A global dedup's input is keyed by ID before the shuffle (by the task).
            (parent,) = parents
            if step.keyed and fuse_keyed(step, parent):
                partitioned[step.name] = partitioned[parent.name]
            elif step.keyed:
                partitioned[step.name] = HASHED
            else:
                stage_of[step.name] = stages.new(is_source=False)
                channel_edges.append((parent.name, step.name, True))
                partitioned[step.name] = None
        elif step.kind == "iterate":
            # A loop head runs in its own stage: its back-edge input is a channel, and a source
            # stage reads no channels.
            (parent,) = parents
            stage_of[step.name] = stages.new(is_source=False)
            channel_edges.append((parent.name, step.name, False))
            partitioned[step.name] = None
        elif step.kind == "join":
            partitioned[step.name] = _place_join(
                step, parents, partitioned, stages, stage_of, channel_edges, copartitioned
            )
        elif step.kind == "union":
            _place_union(step, parents, stages, stage_of, channel_edges)
            partitioned[step.name] = _union_partitioning([partitioned[p.name] for p in parents])
        else:  # map, filter, flat_map, key_by, to_table, sink
            (parent,) = parents
            stage_of[step.name] = stage_of[parent.name]
            partitioned[step.name] = None if step.kind == "key_by" else partitioned[parent.name]
    for step in steps.values():  # loop feedback: a forward channel back to the head
        if step.kind == "iterate":
            channel_edges.append((step.params["feedback"], step.name, False))
    groups = default_key_groups(parallelism) if key_groups is None else key_groups
    route_table(parallelism, groups)  # refuses a parallelism above the key groups
    plan = _build(flow, parallelism, stages, stage_of, channel_edges, combine=combine, epoch=epoch)
    return replace(plan, copartitioned=tuple(sorted(copartitioned)), key_groups=groups)


def _union_partitioning(schemes: list[Partitioning]) -> Partitioning:
    """Streams partitioned alike stay so when merged: all by the shuffle's routing, or all by
    keyed source topics (which must then be co-partitioned, checked at start-up). A mix of
    the two is not partitioned: Kafka's partitioner and the shuffle's routing differ."""
    if any(s is None for s in schemes):
        return None
    if all(s == HASHED for s in schemes):
        return HASHED
    if any(s == HASHED for s in schemes):
        return None
    topics: set[str] = set()
    for scheme in schemes:
        assert isinstance(scheme, frozenset)
        topics |= scheme
    return frozenset(topics)


def _place_join(
    step: Step,
    parents: list[Step],
    partitioned: dict[str, Partitioning],
    stages: _Stages,
    stage_of: dict[str, int],
    channel_edges: list[tuple[str, str, bool]],
    copartitioned: set[tuple[str, ...]],
) -> Partitioning:
    """A join's two inputs must meet by key in one subtask. Inputs of one stage partitioned
    alike, or keyed sources' streams (whose source stages merge, the topics then checked to be
    co-partitioned at start-up), join in place; otherwise both are shuffled to a new stage."""
    schemes = [partitioned[p.name] for p in parents]
    ids = sorted({stages.find(stage_of[p.name]) for p in parents})
    if schemes[0] is not None and schemes[0] == schemes[1] and len(ids) == 1:
        stage_of[step.name] = ids[0]
        if schemes[0] != HASHED:
            copartitioned.add(tuple(sorted(schemes[0])))
        return schemes[0]
    keyed_sources = all(isinstance(s, frozenset) for s in schemes)
    if keyed_sources and all(stages.is_source[i] for i in ids):
        stage_of[step.name] = stages.merge(ids)
        topics = frozenset().union(*schemes)  # type: ignore[arg-type]
        copartitioned.add(tuple(sorted(topics)))
        return topics
    stage_of[step.name] = stages.new(is_source=False)
    for p in parents:
        channel_edges.append((p.name, step.name, True))
    return HASHED


def _place_union(
    step: Step,
    parents: list[Step],
    stages: _Stages,
    stage_of: dict[str, int],
    channel_edges: list[tuple[str, str, bool]],
) -> None:
    ids = sorted({stages.find(stage_of[p.name]) for p in parents})
    if len(ids) == 1:
        stage_of[step.name] = ids[0]
    elif all(stages.is_source[i] for i in ids):
        stage_of[step.name] = stages.merge(ids)
    else:
        stage_of[step.name] = stages.new(is_source=False)
        for p in parents:
            channel_edges.append((p.name, step.name, False))


def _build(
    flow: Dataflow,
    parallelism: int,
    stages: _Stages,
    stage_of: dict[str, int],
    channel_edges: list[tuple[str, str, bool]],
    *,
    combine: bool,
    epoch: int,
) -> Plan:
    steps = flow.steps
    members: dict[int, list[str]] = {}
    for name in steps:  # topological order within each stage
        members.setdefault(stages.find(stage_of[name]), []).append(name)
    names = {sid: ms[0] for sid, ms in members.items()}
    stage_edges = [
        (names[stages.find(stage_of[src])], names[stages.find(stage_of[dst])])
        for src, dst, _shuffle in channel_edges
    ]
    sources = [names[sid] for sid in members if stages.is_source[sid]]
    back = _back_edges(sources, stage_edges)
    loop_stages = _loop_stages(stage_edges, back)
    edges: list[Edge] = []
    for i, (src, dst, shuffle) in enumerate(channel_edges):
        feedback = steps[dst].kind == "iterate" and steps[dst].params["feedback"] == src
        if feedback != (i in back):
            what = "the feedback of a loop" if feedback else f"{src!r} -> {dst!r}"
            raise DefinitionError(
                f"dataflow {flow.name!r}: {what} is not the back-edge a depth-first search "
                "from the sources finds: a stream from outside a loop joins its body (a union "
                "inside the body) and the search reached the loop through it; union that "
                "stream with the loop's input before iterate instead"
            )
        in_loop = any(stage_edges[i][0] in ls and stage_edges[i][1] in ls for ls in loop_stages)
        agg = steps[dst]
        combines = (
            combine
            and not in_loop
            and shuffle
            and agg.kind == "aggregate"
            and isinstance(agg.params["window"], Sliding)  # sessions merge: no partials
            and agg.params["merge"] is not None
            # late records to dead letters: the window sees each record, not a batch's partial
            and agg.params.get("late", "drop") == "drop"
            # every record's update is emitted: a partial would hide the updates it folds
            and agg.params.get("emit", "close") == "close"
        )
        edges.append(
            Edge(
                topic=channel_topic_name(flow.name, src, dst, epoch),
                src_step=src,
                dst_step=dst,
                src_stage=names[stages.find(stage_of[src])],
                dst_stage=names[stages.find(stage_of[dst])],
                shuffle=shuffle,
                combine=combines,
                back=i in back,
                loop=in_loop,
            )
        )
    if len({e.topic for e in edges}) != len(edges):
        raise DefinitionError(f"dataflow {flow.name!r}: two channel edges map to one topic")
    out: list[Stage] = []
    for sid, ms in members.items():
        name = names[sid]
        out.append(
            Stage(
                name=name,
                steps=tuple(ms),
                sources=tuple(m for m in ms if steps[m].kind == "source"),
                inputs=tuple(e for e in edges if e.dst_stage == name),
                outputs=tuple(e for e in edges if e.src_stage == name),
            )
        )
    for stage in out:
        if stage.sources and stage.inputs:
            raise DefinitionError(f"internal: stage {stage.name!r} mixes sources and channels")
    return Plan(flow=flow, parallelism=parallelism, stages=tuple(out), epoch=epoch)


def _back_edges(sources: list[str], edges: list[tuple[str, str]]) -> set[int]:
    """Indexes of the back-edges of the stage graph ``edges``: a depth-first search from
    ``sources`` (in order, children in edge order), an edge to a stage on the stack is one."""
    out: dict[str, list[int]] = {}
    for i, (src, _dst) in enumerate(edges):
        out.setdefault(src, []).append(i)
    back: set[int] = set()
    on_stack: set[str] = set()
    done: set[str] = set()
    for root in sources:
        if root in done:
            continue
        # iterative DFS: (stage, index of the next outgoing edge to explore)
        stack: list[tuple[str, int]] = [(root, 0)]
        on_stack.add(root)
        while stack:
            stage, k = stack[-1]
            succ = out.get(stage, [])
            if k == len(succ):
                stack.pop()
                on_stack.discard(stage)
                done.add(stage)
                continue
            stack[-1] = (stage, k + 1)
            i = succ[k]
            dst = edges[i][1]
            if dst in on_stack:
                back.add(i)
            elif dst not in done:
                stack.append((dst, 0))
                on_stack.add(dst)
    return back


def _loop_stages(edges: list[tuple[str, str]], back: set[int]) -> list[set[str]]:
    """Per back-edge ``tail -> head``: the stages on a path from the head to the tail."""

    def reach(start: str, forward: bool) -> set[str]:
        seen, todo = {start}, [start]
        while todo:
            stage = todo.pop()
            for src, dst in edges:
                a, b = (src, dst) if forward else (dst, src)
                if a == stage and b not in seen:
                    seen.add(b)
                    todo.append(b)
        return seen

    loops = []
    for i in sorted(back):
        tail, head = edges[i]
        loops.append(reach(head, True) & reach(tail, False))
    return loops
