"""The operator chain of a task: its fused operators, how records are pushed through them,
watermarks and processing-time timers.

:class:`OperatorChain` builds the operators of one subtask (sources, user steps, sinks, the
combiners and routers in front of output channels, the dead-letter writer, the local-recovery
replay check) and is the only place records enter them (:meth:`OperatorChain.push`). The task's
inputs (:mod:`.inputs`, :mod:`.sources`) push into it; the checkpoint coordinator
(:mod:`.checkpoints`) prepares, snapshots, restores and commits its operators and writers.

Dead letters (:mod:`processor.runtime.task.dead_letters`): with a dead-letter destination, every
task opens its own writer of it and treats it like a sink (prepare at the barrier, committable in
the snapshot, commit on completion, recover on restart). Records that fail to decode, and records
whose user function raises (operators call :meth:`OperatorChain._on_error` from their slow path),
go there with the cause. Where the failing record was read is found only when a failure happens:
the inputs set :attr:`OperatorChain.origins` to where the batch being pushed came from, and
operators that emit one output per input (``keeps_index``) keep the index of a record equal to
its index in that batch.

Invariants:
    :attr:`OperatorChain.watermark` only grows; what it fires is pushed before the watermark
    is forwarded to the output channels. :attr:`origins` is set only while the inputs push a
    batch (``None`` otherwise).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from dedup.ids import emission_id
from processor.compiler import Stage
from processor.contracts import Message, SinkContext, SinkWriter
from processor.dataflow import DEAD_LETTERS
from processor.errors import UserFunctionError
from processor.runtime.operators.core import MIN_WATERMARK, Operator, Record, SinkOp
from processor.runtime.operators.registry import build_operator, build_router
from processor.runtime.operators.replay import ReplayCheck
from processor.runtime.task.channels import ChannelOut, Lineage, Loop, TaskEnv
from processor.runtime.task.dead_letters import DeadLetters, Origins
from processor.wire import Watermark

if TYPE_CHECKING:  # imported when a step needs them (operators.registry)
    from processor.runtime.operators.dedup_step import DedupOperator
    from processor.runtime.operators.windows import Combiner

log = logging.getLogger(__name__)

TP = tuple[str, int]
#: How an operator's input indexes map onto the pushed batch: ``True`` the same, a list
#: ``input index -> batch index``, ``False`` unknown.
_Index = bool | list[int]


class OperatorChain:
    """The fused operators of one subtask, their output channels and their writers.

    Owns: the operators by step name (:attr:`ops`), the sinks, combiners, routers and output
    channels, the dead-letter writer, the writers to commit (:attr:`committers`), the entry
    operator of each input topic (:attr:`entry`), the task's watermark, and where the batch
    being pushed came from (:attr:`origins`, :attr:`message`).
    """

    def __init__(
        self,
        env: TaskEnv,
        stage: Stage,
        subtask: int,
        *,
        lineage: Lineage | None,
        loop: Loop | None,
    ) -> None:
        self.env = env
        self.plan = env.plan
        self.stage = stage
        self.subtask = subtask
        self.name = stage.task(subtask)
        self.lineage = lineage
        self.loop = loop
        self.replay: ReplayCheck | None = None
        self.watermark = MIN_WATERMARK
        # Where the batch being pushed came from, and how the input of the operator now
        # processing maps onto it (read only when a record fails; see push and _on_error).
        self.origins: Origins | None = None
        self.message: Message | None = None  # the one being pushed (local recovery)
        self._index: _Index = False
        self._dropped: list[int] | None = None
        self._build()

    # -- construction ----------------------------------------------------------------------------

    def _build(self) -> None:
        plan, env, stage = self.plan, self.env, self.stage
        steps = plan.flow.steps
        merged_into = {e.dst_step for e in stage.inputs if e.combine}
        self.ops: dict[str, Operator] = {}
        self.sinks: list[SinkOp] = []
        self.combiners: list[Combiner] = []
        self.outputs: list[ChannelOut] = []
        self.routers: list[Operator] = []  # key-by-ID heads of global dedup shuffles
        self.dedups: list[DedupOperator] = []
        for name in stage.steps:
            step = steps[name]
            if step.kind == "source":
                self.ops[name] = Operator(step)
            elif step.kind == "sink":
                ctx = self.sink_context(name, self.subtask, plan.parallelism)
                op = SinkOp(step, step.params["sink"].open(ctx), keyed=steps[step.parents[0]].keyed)
                self.ops[name] = op
                self.sinks.append(op)
            else:
                built = build_operator(step, merged_input=name in merged_into)
                self.ops[name] = built
                if step.kind == "dedup":
                    self.dedups.append(built)  # type: ignore[arg-type]
                built.open(self.sink_context(name, self.subtask, plan.parallelism))
            for parent in step.parents:
                if parent in self.ops:  # parents in other stages arrive through channels
                    self.ops[parent].children.append(self.ops[name].input(parent))
        if self.lineage is not None and not stage.sources:  # an operator like the others
            self.replay = ReplayCheck(stage.name, env.recovery_max_ids, task=self.name)
            self.ops[self.replay.name] = self.replay
        self.dead: DeadLetters | None = None
        self.committers: list[tuple[str, SinkWriter]] = [(s.name, s.writer) for s in self.sinks]
        if plan.flow.dead_letter_sink is not None:
            # One writer per task; its index is unique over the job's tasks (stage-major), so
            # writers of different stages never share output names.
            P = plan.parallelism
            index = plan.stages.index(stage) * P + self.subtask
            ctx = self.sink_context(DEAD_LETTERS, index, len(plan.stages) * P)
            self.dead = DeadLetters(plan.flow.dead_letter_sink.open(ctx), self.name)
            self.committers.append((DEAD_LETTERS, self.dead.writer))
        for tag, edge in enumerate(stage.outputs):
            out = ChannelOut(
                edge,
                self.subtask,
                plan.parallelism,
                env.writer,
                lineage=self.lineage,
                tag=tag,
                loop=self.loop,
                key_groups=plan.key_groups,
                incarnation=env.sink_generation,
            )
            self.outputs.append(out)
            head: Operator = out
            dst = steps[edge.dst_step]
            if dst.kind == "dedup" and not dst.keyed:  # global dedup: route copies by ID
                head = build_router(dst)
                head.children.append(out)
                self.routers.append(head)
            elif edge.combine:
                from processor.runtime.operators.windows import Combiner

                combiner = Combiner(steps[edge.dst_step])
                combiner.children.append(out)
                self.combiners.append(combiner)
                head = combiner
            self.ops[edge.src_step].children.append(head)
        # Without a dead-letter destination the handler raises, naming step and record.
        for operator in [*self.ops.values(), *self.combiners, *self.routers]:
            operator.on_error = self._on_error
        # Operators with processing-time timers, on the task's clock (``process`` steps).
        self.timed = [op for op in self.ops.values() if op.timed]
        for timed in self.timed:
            timed.clock = env.now_ms  # type: ignore[attr-defined]
        for name, step in steps.items():  # late='dead_letters' (validated with the flow)
            if step.params.get("late") == "dead_letters" and name in self.ops and self.dead:
                self.ops[name].on_late = self.dead.late_record
        # entry operator per input: source topic or channel topic
        self.entry: dict[str, Operator] = {}
        for name in stage.sources:
            self.entry[steps[name].params["topic"]] = self.ops[name]
        for edge in stage.inputs:
            self.entry[edge.topic] = self.ops[edge.dst_step].input(edge.src_step)

    def sink_context(self, step: str, subtask: int, parallelism: int) -> SinkContext:
        env = self.env
        return SinkContext(
            self.plan.job,
            step,
            subtask,
            parallelism,
            env.sink_generation,
            checkpoint_interval=env.checkpoint_interval,
            snapshot_url=env.store.url,
            fault=env.fault,
            epoch=self.plan.epoch,
        )

    # -- the data path ---------------------------------------------------------------------------

    def push(self, op: Operator, batch: list[Record], index: _Index = False) -> None:
        """``index``: ``True`` when ``batch[i]`` came from the ``i``-th record that
        :attr:`origins` knows (see :data:`_Index`). Costs nothing per record: the mapping is
        only built when an operator that keeps indexes dropped a failing record."""
        self._index, self._dropped = index, None
        op.n_in += len(batch)
        out = op.process(batch)
        if out:
            op.n_out += len(out)
            if not op.keeps_index:
                index = False
            elif self._dropped is not None and index is not False:
                dropped = set(self._dropped)
                kept = [i for i in range(len(batch)) if i not in dropped]
                index = kept if index is True else [index[i] for i in kept]
            for child in op.children:
                self.push(child, out, index)

    def flush(self) -> None:
        for combiner in self.combiners:
            out = combiner.flush()
            if out:
                combiner.n_out += len(out)
                self.push(combiner.children[0], out)

    def _on_error(self, op: Operator, batch: list[Record], index: int, exc: Exception) -> None:
        """An operator's user function raised on ``batch[index]``: a dead letter, or (without
        a dead-letter destination) a :class:`UserFunctionError` that names step and record."""
        where, origin = self._index, None
        if where is not False and self.origins is not None:
            origin = self.origins(index if where is True else where[index])
        if self.dead is None:
            raise _user_error(op.name, self.name, batch[index], exc, origin) from exc
        if self._dropped is None:
            self._dropped = []
        self._dropped.append(index)
        self.dead.function_failed(op.name, batch[index], exc, origin)

    def pushing(self, _index: int) -> Message | None:
        """Origins while records are pushed one at a time: the message being pushed."""
        return self.message

    def processing_time(self) -> None:
        """Fires the processing-time timers that are due (every loop of the task; one clock
        read and a heap peek per timed operator when none is)."""
        now = self.env.now_ms()
        fired_any = False
        for op in self.timed:
            self._index, self._dropped = False, None  # a failing timer has no input origin
            fired = op.on_processing_time(now)
            if fired:
                fired_any = True
                op.n_out += len(fired)
                for child in op.children:
                    self.push(child, fired)
        if fired_any:
            self.flush()
        if self.dead is not None:
            self.dead.flush()  # a timer whose on_timer raised, even if nothing fired

    def advance_watermark(self, wm: int) -> None:
        if wm <= self.watermark:
            return
        self.watermark = wm
        self.flush()
        self._index, self._dropped = False, None  # what fires has no input origin
        lineage = self.lineage
        if self.loop is not None:
            self.loop.iteration = 0  # what a watermark fires starts its own loop count
        for name, op in self.ops.items():  # the stage's steps in order (and the replay check)
            fired = op.on_watermark(wm)
            op.n_out += len(fired)
            if fired and lineage is None:
                for child in op.children:
                    self.push(child, fired)
            elif fired:  # an emission's ID: (step, key, window), its timestamp being end - 1
                assert lineage is not None
                for record in fired:
                    lineage.set(emission_id(name, record[0], record[2], 0))
                    for child in op.children:
                        self.push(child, [record])
        self.flush()
        for out in self.outputs:
            out.control(Watermark(wm))

    def close(self) -> None:
        for _name, writer in self.committers:
            writer.close()
        for op in self.ops.values():
            op.close()

    # -- reporting -------------------------------------------------------------------------------

    def counts(self) -> dict[str, Any]:
        """The chain's part of the task's stats: records out, sunk, late, dead, duplicates."""
        replayed = self.replay.duplicates if self.replay is not None else 0
        return {
            "out": sum(o.written for o in self.outputs),
            "sunk": sum(s.written for s in self.sinks),
            "dead": self.dead.count if self.dead is not None else 0,
            "late": sum(op.late_dropped for op in self.ops.values()),
            "dups": sum(op.duplicates for op in self.ops.values()) - replayed,  # dedup steps
            "replayed": replayed,
            "replay_ids": self.replay.size if self.replay is not None else 0,
            "replay_peak": self.replay.peak if self.replay is not None else 0,
            "replay_pinned": self.replay.pinned if self.replay is not None else 0,
        }

    def metrics(self) -> dict[str, Any]:
        """The chain's part of the metrics (docs/observability.md): per step, per sink, the
        dedup steps' store traffic, the transactions' headroom, the recent dead letters."""
        dedups = self.dedups
        headroom = {}
        for name, writer in self.committers:
            probe = getattr(writer, "txn_headroom_s", None)
            left = probe() if probe is not None else None
            if left is not None:
                headroom[name] = round(left, 3)
        return {
            "steps": {name: [op.n_in, op.n_out] for name, op in self.ops.items()},
            "sinks": {s.name: s.written for s in self.sinks},
            "lookups": sum(op.dedup.stats.lookups for op in dedups if op.dedup is not None),
            "round_trips": sum(op.dedup.store.round_trips for op in dedups if op.dedup is not None),
            "headroom": headroom,
            "dead_recent": list(self.dead.recent) if self.dead is not None else [],
        }


def _user_error(
    step: str, task: str, record: Record, exc: Exception, origin: Message | None
) -> UserFunctionError:
    where = None
    place = "on a record"
    if origin is not None:
        where = (origin.topic(), origin.partition(), origin.offset())
        place = f"on the record from {where[0]}[{where[1]}] at offset {where[2]}"
    key = "" if record[0] is None else f" (key {record[0]!r:.80})"
    return UserFunctionError(
        f"step {step!r} (task {task}) raised {type(exc).__name__}: {exc} {place}{key}. Fix the "
        "function, or give the Dataflow a dead-letter destination (Dataflow(..., "
        "dead_letters=...)) to set such records aside with their cause",
        step=step,
        origin=where,
    )
