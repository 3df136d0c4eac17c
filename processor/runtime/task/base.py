"""The task's state, its operators and how records are pushed through them.

:class:`TaskBase` builds the fused operators of one subtask (sources, user steps, sinks, the
combiners and routers in front of output channels, the dead-letter writer) and holds every field
the other layers of the task share; :mod:`.checkpoints`, :mod:`.inputs`, :mod:`.sources` and
:mod:`.core` add behaviour on top, in that order (see :mod:`processor.runtime.task`).

Dead letters (:mod:`processor.runtime.dead_letters`): with a dead-letter destination, every task
opens its own writer of it and treats it like a sink (prepare at the barrier, committable in the
snapshot, commit on completion, recover on restart). Records that fail to decode, and records
whose user function raises (operators call :meth:`TaskBase._on_error` from their slow path), go
there with the cause. Where the failing record was read is found only when a failure happens: the
task remembers which messages the batch being pushed came from, and operators that emit one
output per input (``keeps_index``) keep the index of a record equal to its index in that batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from dedup.ids import emission_id
from processor.checkpoint.aligner import (
    BarrierAligner,
)
from processor.compiler import Stage, channel_inputs
from processor.contracts import Message, SinkContext, SinkWriter
from processor.dataflow import DEAD_LETTERS
from processor.errors import DeserializationError, UserFunctionError
from processor.runtime.channels import ChannelOut, Lineage, Loop, TaskEnv
from processor.runtime.dead_letters import DeadLetters, Origins
from processor.runtime.dedup_step import DedupOperator, ReplayCheck
from processor.runtime.joins import joined_as_table_only
from processor.runtime.operators import (
    MIN_WATERMARK,
    Combiner,
    Operator,
    Record,
    SinkOp,
)
from processor.runtime.registry import build_operator, build_router
from processor.snapshot.store import SnapshotHandle
from processor.wire import (
    Watermark,
    source_partitions_for,
)

log = logging.getLogger(__name__)

TP = tuple[str, int]
#: Recovery modes of a restored channel input (see :mod:`processor.runtime.task.inputs`).
_REPLAY, _DROP = 1, 2
#: How an operator's input indexes map onto the pushed batch: ``True`` the same, a list
#: ``input index -> batch index``, ``False`` unknown.
_Index = bool | list[int]


class TaskBase:
    """State and operators of one subtask; the layers above add behaviour."""

    def __init__(self, env: TaskEnv, stage: Stage, subtask: int) -> None:
        self.env = env
        self.stage = stage
        self.subtask = subtask
        self.name = stage.task(subtask)
        self.plan = env.plan
        self.generation = env.generation
        self.is_source = bool(stage.sources)
        # Local recovery (docs/local-recovery.md): records are pushed one at a time with their
        # ID in ``lineage``; channel inputs are checked against ``replay``, the IDs this task
        # processed, so the copies a restarted upstream worker re-emits are dropped.
        self.lineage = Lineage() if env.recovery == "local" else None
        self.replay: ReplayCheck | None = None
        # Loops: the iteration count of what is pushed, for a task with a loop channel.
        loop_edges = [e for e in (*stage.inputs, *stage.outputs) if e.loop]
        self.loop = Loop() if loop_edges else None
        self.loop_topics = {e.topic for e in stage.inputs if e.loop}
        steps = self.plan.flow.steps
        self.back_topics: dict[str, int | None] = {
            e.topic: steps[e.dst_step].params["max_iterations"] for e in stage.inputs if e.back
        }
        self.back: set[TP] = set()  # back-edge input partitions
        self.back_logging: set[TP] = set()  # back-edges whose barrier has not come around yet
        self.loop_log: dict[int, int] = {}  # checkpoint -> back-edge records logged
        self.logging_id = 0
        # Back-edges not live yet (replaying the restored log, then dropping the failed
        # generation's records until this generation's marker), and the regular inputs held
        # until every back-edge is live: a snapshot taken before would record a back-edge
        # position inside a dead generation's records, which a restore would replay.
        self.replaying: set[TP] = set()
        self.held: list[TP] = []
        self.log_replayed = 0
        self.loop_exhausted = 0
        self.records_in = 0
        self.bad_records = 0
        self.stale_dropped = 0
        self._build_operators()
        #: Checkpoint -> this source task's positions, when its snapshot had the drained
        #: (maximum) watermark: recorded in the manifest (runtime.drain).
        self.drained_at: dict[int, list[list[Any]]] = {}
        self.reader = env.reader_factory(f"eosflow-{self.plan.job}")
        self.pos: dict[TP, int] = {}
        self.modes: dict[TP, int] = {}  # a recovering channel's current mode (fast to test)
        # ... and the phases it still has to go through, the current one first: (_REPLAY,
        # checkpoint whose barrier ends it) or (_DROP, generation whose marker ends it).
        self.phases: dict[TP, list[tuple[int, int]]] = {}
        self.blocked: set[TP] = set()
        self.stash: dict[TP, list[Message]] = {}
        self.to_resume: set[TP] = set()
        self.channel_wm: dict[TP, int] = {}
        self.watermark = MIN_WATERMARK
        self.max_ts: dict[TP, int] = {}
        self.drained = False
        self.restored_id = 0
        self.aligner: BarrierAligner | None = None
        self.barrier_seen: dict[int, set[TP]] = {}
        self.barrier_unaligned: dict[int, bool] = {}  # the mode each checkpoint runs in
        # snapshot bookkeeping: checkpoint id -> future / handle / alignment done
        self.uploading: dict[int, Future[SnapshotHandle]] = {}
        self.uploaded: dict[int, SnapshotHandle] = {}
        self.aligned: set[int] = set()
        # metrics: when a checkpoint's first barrier came, how long its alignment took (s), and
        # the sinks' commit durations since the last stats message
        self.align_start: dict[int, float] = {}
        self.align_s: dict[int, float] = {}
        self.commit_times: list[list[Any]] = []
        self.declined: list[tuple[int, str]] = []  # (checkpoint, reason) for the coordinator
        self._upload_failures = 0  # in a row
        self.sink_pending: dict[str, list[tuple[int, Any]]] = {n: [] for n, _w in self.committers}
        self.halted = False  # sync mode: a source stops between trigger and completion
        self._last_wm_emit = 0.0
        self.batch_size = 500
        # Where the batch being pushed came from, and how the input of the operator now
        # processing maps onto it (read only when a record fails; see _push and _on_error).
        self._origins: Origins | None = None
        self._message: Message | None = None  # the one being pushed (local recovery)
        self._index: _Index = False
        self._dropped: list[int] | None = None

    # -- construction ----------------------------------------------------------------------------

    def _build_operators(self) -> None:
        plan, env, stage = self.plan, self.env, self.stage
        steps = plan.flow.steps
        merged_into = {e.dst_step for e in stage.inputs if e.combine}
        self.ops: dict[str, Operator] = {}
        self.sinks: list[SinkOp] = []
        self.combiners: list[Combiner] = []
        self.outputs: list[ChannelOut] = []
        self.routers: list[Operator] = []  # key-by-ID heads of global dedup shuffles
        for name in stage.steps:
            step = steps[name]
            if step.kind == "source":
                self.ops[name] = Operator(step)
            elif step.kind == "sink":
                ctx = self._sink_context(name, self.subtask, plan.parallelism)
                op = SinkOp(step, step.params["sink"].open(ctx), keyed=steps[step.parents[0]].keyed)
                self.ops[name] = op
                self.sinks.append(op)
            else:
                built = build_operator(step, merged_input=name in merged_into)
                self.ops[name] = built
                built.open(self._sink_context(name, self.subtask, plan.parallelism))
            for parent in step.parents:
                if parent in self.ops:  # parents in other stages arrive through channels
                    self.ops[parent].children.append(self.ops[name].input(parent))
        if self.lineage is not None and not self.is_source:  # an operator like the others
            self.replay = ReplayCheck(stage.name, env.recovery_horizon_ms)
            self.replay.open(self._sink_context(self.replay.name, self.subtask, plan.parallelism))
            self.ops[self.replay.name] = self.replay
        self.dead: DeadLetters | None = None
        self.committers: list[tuple[str, SinkWriter]] = [(s.name, s.writer) for s in self.sinks]
        if plan.flow.dead_letter_sink is not None:
            # One writer per task; its index is unique over the job's tasks (stage-major), so
            # writers of different stages never share output names.
            P = plan.parallelism
            index = plan.stages.index(stage) * P + self.subtask
            ctx = self._sink_context(DEAD_LETTERS, index, len(plan.stages) * P)
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
            )
            self.outputs.append(out)
            head: Operator = out
            dst = steps[edge.dst_step]
            if dst.kind == "dedup" and not dst.keyed:  # global dedup: route copies by ID
                head = build_router(dst)
                head.children.append(out)
                self.routers.append(head)
            elif edge.combine:
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
        # topic -> (the value serde's ``deserialize`` or None, timestamp function, lag, message
        # key decoder or None)
        self.source_params: dict[str, tuple[Any, Any, int, Any]] = {}
        self.table_topics: set[str] = set()  # sources read as tables (Dataflow.table)
        #: the tables that only feed temporal joins' table side: caught up, they leave the
        #: watermark (runtime.joins.joined_as_table_only)
        self.quiet_tables: set[str] = set()
        for name in stage.sources:
            p = steps[name].params
            decode = p["serde"].deserialize if p["serde"] is not None else None
            if p.get("table"):  # a tombstone (null value) deletes the row: not decoded
                decode = _table_decode(decode)
                self.table_topics.add(p["topic"])
                if joined_as_table_only(steps, name):  # may leave the watermark when quiet
                    self.quiet_tables.add(p["topic"])
            self.source_params[p["topic"]] = (
                decode,
                p["timestamp"],
                p["max_out_of_orderness_ms"],
                message_key_decoder(name, p["key_serde"]) if p.get("keyed") else None,
            )

    def _sink_context(self, step: str, subtask: int, parallelism: int) -> SinkContext:
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

    def input_partitions(self, source_counts: dict[str, int]) -> list[TP]:
        P, i = self.plan.parallelism, self.subtask
        steps = self.plan.flow.steps
        tps: list[TP] = []
        for name in self.stage.sources:
            topic = steps[name].params["topic"]
            tps += [(topic, p) for p in source_partitions_for(i, P, source_counts[topic])]
        return tps + channel_inputs(self.plan, self.stage, i)

    def _stale(self) -> int:
        """Checkpoints up to this id are over for this task (restored, or triggered before it
        was restarted alone): their barriers and triggers are ignored."""
        return max(self.restored_id, self.env.stale_through)

    def _push(self, op: Operator, batch: list[Record], index: _Index = False) -> None:
        """``index``: ``True`` when ``batch[i]`` came from the ``i``-th record that
        ``self._origins`` knows (see :data:`_Index`). Costs nothing per record: the mapping is
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
                self._push(child, out, index)

    def _flush(self) -> None:
        for combiner in self.combiners:
            out = combiner.flush()
            if out:
                combiner.n_out += len(out)
                self._push(combiner.children[0], out)

    def _on_error(self, op: Operator, batch: list[Record], index: int, exc: Exception) -> None:
        """An operator's user function raised on ``batch[index]``: a dead letter, or (without
        a dead-letter destination) a :class:`UserFunctionError` that names step and record."""
        where, origin = self._index, None
        if where is not False and self._origins is not None:
            origin = self._origins(index if where is True else where[index])
        if self.dead is None:
            raise _user_error(op.name, self.name, batch[index], exc, origin) from exc
        if self._dropped is None:
            self._dropped = []
        self._dropped.append(index)
        self.dead.function_failed(op.name, batch[index], exc, origin)

    def _pushing(self, _index: int) -> Message | None:
        """Origins while records are pushed one at a time: the message being pushed."""
        return self._message

    def _processing_time(self) -> None:
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
                    self._push(child, fired)
        if fired_any:
            self._flush()
        if self.dead is not None:
            self.dead.flush()  # a timer whose on_timer raised, even if nothing fired

    def _advance_watermark(self, wm: int) -> None:
        if wm <= self.watermark:
            return
        self.watermark = wm
        self._flush()
        self._index, self._dropped = False, None  # what fires has no input origin
        lineage = self.lineage
        if self.loop is not None:
            self.loop.iteration = 0  # what a watermark fires starts its own loop count
        for name, op in self.ops.items():  # the stage's steps in order (and the replay check)
            fired = op.on_watermark(wm)
            op.n_out += len(fired)
            if fired and lineage is None:
                for child in op.children:
                    self._push(child, fired)
            elif fired:  # an emission's ID: (step, key, window), its timestamp being end - 1
                assert lineage is not None
                for record in fired:
                    lineage.set(emission_id(name, record[0], record[2], 0))
                    for child in op.children:
                        self._push(child, [record])
        self._flush()
        for out in self.outputs:
            out.control(Watermark(wm))

    # -- reporting -------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        out = sum(o.written for o in self.outputs)
        sunk = sum(s.written for s in self.sinks)
        late = sum(op.late_dropped for op in self.ops.values())
        replayed = self.replay.duplicates if self.replay is not None else 0
        dups = sum(op.duplicates for op in self.ops.values()) - replayed  # the dedup steps
        lag = 0
        if self.is_source and self.env.end_offsets is not None:
            lag = sum(max(0, self.env.end_offsets.get(tp, 0) - o) for tp, o in self.pos.items())
        return {
            "in": self.records_in,
            "out": out,
            "sunk": sunk,
            "bad": self.bad_records,
            "dead": self.dead.count if self.dead is not None else 0,
            "late": late,
            "dups": dups,
            "stale": self.stale_dropped,
            "replayed": replayed,
            "loop_limit": self.loop_exhausted,
            "lag": lag,
            "watermark": self.watermark,
            **self._metrics(),
        }

    def _metrics(self) -> dict[str, Any]:
        """What only the metrics and the job page read (docs/observability.md): per step,
        per partition, per sink, and the dedup steps' store traffic."""
        ops = self.ops.values()
        dedups = [op for op in ops if isinstance(op, DedupOperator) and op is not self.replay]
        commits, self.commit_times = self.commit_times, []
        headroom = {}
        for name, writer in self.committers:
            probe = getattr(writer, "txn_headroom_s", None)
            left = probe() if probe is not None else None
            if left is not None:
                headroom[name] = round(left, 3)
        return {
            "steps": {name: [op.n_in, op.n_out] for name, op in self.ops.items()},
            "sinks": {s.name: s.written for s in self.sinks},
            "parts": [[t, p, n] for (t, p), n in self.reader.cached_lag().items()],
            "lookups": sum(op.dedup.stats.lookups for op in dedups if op.dedup is not None),
            "round_trips": sum(op.dedup.store.round_trips for op in dedups if op.dedup is not None),
            "commits": commits,
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


def _table_decode(decode: Callable[[Any], Any] | None) -> Callable[[Any], Any]:
    """A table's row decoder: a tombstone (null value) stays ``None``."""

    def row(data: Any) -> Any:
        return None if data is None else data if decode is None else decode(data)

    return row


def message_key_decoder(step: str, serde: Any) -> Callable[[Message], Any]:
    """The key of a keyed source's record: its message key, decoded by ``serde`` (default
    UTF-8 text). A record without a key is a bad record: it cannot be given to a key's state.
    """
    decode = serde.deserialize if serde is not None else _utf8

    def key_of(m: Message) -> Any:
        raw = m.key()
        if raw is not None:
            try:
                return decode(raw)  # the bytes only: the place is added on failure
            except DeserializationError as exc:
                where: Any = (m.topic(), m.partition(), m.offset())
                raise exc.located(*where) from exc.__cause__
        raise DeserializationError(
            f"source {step!r} is keyed by the message key (keyed=True) and this record has no "
            "key; produce it with a key, or read the topic unkeyed and key_by(...) a field of "
            "the value",
            topic=m.topic(), partition=m.partition(), offset=m.offset(), serde="key",
        )  # fmt: skip

    return key_of


def _utf8(data: bytes) -> str:
    try:
        return str(data, "utf-8")
    except UnicodeDecodeError as exc:
        raise DeserializationError(
            f"message key is not UTF-8 text ({exc}); give the keyed source a key_serde",
            serde="key",
            data=data,
        ) from exc
