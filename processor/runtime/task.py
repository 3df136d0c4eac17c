"""A task: subtask ``i`` of one stage, running its fused operators between Kafka partitions.

Source tasks read input partitions ``p % P == i`` and inject barriers when the coordinator
triggers a checkpoint. Channel tasks read their ``P`` partitions of every input channel topic and
align barriers with :class:`~processor.checkpoint.BarrierAligner`. Both write to their output
channels with the worker's idempotent writer and snapshot asynchronously.

Recovery (DESIGN.md, "Recovery"; :mod:`processor.wire` on generation markers): a restored channel
is in one of three modes until it is live again:

* ``_REPLAY``: unaligned snapshot, the barrier had not arrived on this channel: records up to the
  restored barrier are in-flight channel state and are processed;
* ``_DROP``: records after the restored barrier belong to an older generation and are dropped
  until ``GenerationStart`` of the current generation;
* live (no entry).

Loops (docs/iterations.md): a loop head's back-edge inputs follow Algorithm 2 of Carbone et al.
(2015): they are not aligned; the snapshot is taken once the regular inputs delivered the
barrier, and keeps the back-edges' positions at that moment; the records read from a back-edge
until the barrier comes around are the back-edge log (counted, acked with the snapshot). On
restore, the back-edges replay that log (``_REPLAY``), then drop the failed generation's records;
the regular inputs stay held until every back-edge is live. The head ignores watermarks from
back-edges, and records carry their iteration count in loop channels (``max_iterations``).

Dead letters (:mod:`processor.runtime.dead_letters`): with a dead-letter destination, every task
opens its own writer of it and treats it like a sink (prepare at the barrier, committable in the
snapshot, commit on completion, recover on restart). Records that fail to decode, and records
whose user function raises (operators call :meth:`Task._on_error` from their slow path), go there
with the cause. Where the failing record was read is found only when a failure happens: the task
remembers which messages the batch being pushed came from, and operators that emit one output per
input (``keeps_index``) keep the index of a record equal to its index in that batch.

Invariants:
    ``self.pos[tp]`` is the offset after the last record of ``tp`` that went through the
    operators (or was deliberately dropped); records of a paused channel that were fetched
    anyway are stashed, never processed early, and replayed in order on resume.
    Dead letters are written to their writer before the barrier of the epoch that read them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import orjson

from dedup.ids import emission_id, source_id
from dedup.operator import ReplayCheck
from processor.checkpoint.aligner import (
    AbortCheckpoint,
    Action,
    AlignmentDone,
    BarrierAligner,
    ForwardBarrier,
    Pause,
    Resume,
    TakeSnapshot,
)
from processor.compiler import Stage
from processor.contracts import Message, SinkContext, SinkWriter
from processor.dataflow import DEAD_LETTERS
from processor.errors import DeserializationError, EosflowError, IterationLimitError
from processor.runtime.channels import ChannelOut, Lineage, Loop, TaskEnv
from processor.runtime.dead_letters import DeadLetters, Origins, channel_origins, source_origins
from processor.runtime.operators import (
    MAX_WATERMARK,
    MIN_WATERMARK,
    Combiner,
    Operator,
    Record,
    SinkOp,
    build_operator,
    build_router,
)
from processor.snapshot.store import SnapshotHandle
from processor.wire import (
    Barrier,
    EndOfStream,
    GenerationStart,
    Watermark,
    channel_partition,
    decode_control,
    source_partitions_for,
)

__all__ = ["Task", "TaskEnv"]

log = logging.getLogger(__name__)

TP = tuple[str, int]
_REPLAY, _DROP = 1, 2
_WATERMARK_EVERY_S = 0.2
_MAX_UPLOAD_FAILURES = 3
#: Without a dead-letter destination, these source failures are skipped (counted and logged).
_SKIPPABLE = (DeserializationError, KeyError, TypeError, ValueError)
#: How an operator's input indexes map onto the pushed batch: ``True`` the same, a list
#: ``input index -> batch index``, ``False`` unknown.
_Index = bool | list[int]


class Task:
    """One subtask of one stage. See the module docstring."""

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
        self.reader = env.reader_factory(f"eosflow-{self.plan.job}")
        self.pos: dict[TP, int] = {}
        self.modes: dict[TP, int] = {}
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
                    self.ops[parent].children.append(self.ops[name])
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
        if self.dead is not None:
            for operator in [*self.ops.values(), *self.combiners, *self.routers]:
                operator.on_error = self._on_error
        # entry operator per input: source topic or channel topic
        self.entry: dict[str, Operator] = {}
        for name in stage.sources:
            self.entry[steps[name].params["topic"]] = self.ops[name]
        for edge in stage.inputs:
            self.entry[edge.topic] = self.ops[edge.dst_step]
        self.source_params: dict[str, tuple[Any, Any, int]] = {}
        for name in stage.sources:
            p = steps[name].params
            self.source_params[p["topic"]] = (
                p["serde"],
                p["timestamp"],
                p["max_out_of_orderness_ms"],
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
        )

    def input_partitions(self, source_counts: dict[str, int]) -> list[TP]:
        P, i = self.plan.parallelism, self.subtask
        steps = self.plan.flow.steps
        tps: list[TP] = []
        for name in self.stage.sources:
            topic = steps[name].params["topic"]
            tps += [(topic, p) for p in source_partitions_for(i, P, source_counts[topic])]
        for edge in self.stage.inputs:
            if edge.shuffle:
                tps += [(edge.topic, channel_partition(u, i, P)) for u in range(P)]
            else:
                tps.append((edge.topic, channel_partition(i, i, P)))
        return tps

    # -- lifecycle -------------------------------------------------------------------------------

    def open(self, state: dict[str, Any] | None, source_counts: dict[str, int]) -> None:
        """Restore ``state`` (``None``: fresh start), announce the generation, start reading."""
        tps = self.input_partitions(source_counts)
        positions: dict[TP, int | None] = dict.fromkeys(tps)
        if state is not None:
            self.restored_id = state["checkpoint"]
            for tp, offset in state["positions"].items():
                if tp in positions:
                    positions[tp] = offset
            for step, op_state in state["operators"].items():
                if step in self.ops:
                    self.ops[step].restore(op_state)
            self.channel_wm = dict(state["channel_wm"])
            self.max_ts = dict(state["max_ts"])
            self.watermark = state["watermark"]
            seen = set(state["barrier_seen"])
            for name, writer in self.committers:
                writer.recover(list(state["sinks"].get(name, [])))
        else:
            seen = set()
            for _name, writer in self.committers:
                writer.recover([])
        # Restarted alone (local recovery) in the generation the other workers still run: every
        # channel record after the restored positions is live, and copies are dropped by ID.
        alone = (
            state is not None
            and self.lineage is not None
            and state["generation"] == self.generation
        )
        if not self.is_source:
            self.back = {tp for tp in tps if tp[0] in self.back_topics}
            for tp in tps:
                if tp in self.back:  # a loop's watermark comes from its regular inputs only
                    self.channel_wm.pop(tp, None)
                else:
                    self.channel_wm.setdefault(tp, MIN_WATERMARK)
                if alone:
                    continue
                replay = state is not None and tp not in seen and positions[tp] is not None
                self.modes[tp] = _REPLAY if replay else _DROP
            self.aligner = BarrierAligner(
                tps,
                unaligned=self.env.mode == "unaligned",
                restored_checkpoint=self._stale(),
                back_edges=self.back,
            )
            self.replaying = {tp for tp in self.back if tp in self.modes}
        else:
            for tp in tps:
                self.max_ts.setdefault(tp, MIN_WATERMARK)
        start = "earliest"
        if self.is_source:
            starts = {self.plan.flow.steps[s].params["start"] for s in self.stage.sources}
            start = "latest" if starts == {"latest"} else "earliest"
        self.reader.open(positions, start=start)
        self.pos = {tp: o for tp, o in self.reader.positions().items()}
        if self.replaying:  # replay the back-edge log before consuming the regular inputs
            self.held = [tp for tp in tps if tp not in self.back]
            self.blocked |= set(self.held)  # anything fetched anyway is stashed, not processed
            self.reader.pause(self.held)
        if state is not None:
            self.env.fault("during-recovery")
        for out in self.outputs:
            out.control(GenerationStart(self.generation))
        log.info(
            "opened task=%s generation=%d restored_checkpoint=%d inputs=%d recovery=%s%s",
            self.name, self.generation, self.restored_id, len(tps), self.env.recovery,
            f" alone stale_through={self.env.stale_through}" if alone else "",
        )  # fmt: skip

    def _stale(self) -> int:
        """Checkpoints up to this id are over for this task (restored, or triggered before it
        was restarted alone): their barriers and triggers are ignored."""
        return max(self.restored_id, self.env.stale_through)

    def close(self) -> None:
        self.reader.close()
        for _name, writer in self.committers:
            writer.close()
        for op in self.ops.values():
            op.close()

    # -- the data path ---------------------------------------------------------------------------

    def step(self, timeout: float, max_records: int, budget_s: float = 0.05) -> int:
        """Poll and process for up to ``budget_s``; returns the number of records read.

        Batches are sized so that one takes about a quarter of the budget: a task with a slow
        user function must not starve the other tasks of its worker (or delay a checkpoint
        trigger) with one long batch.
        """
        if self.halted:
            return 0
        clock = time.perf_counter
        start = clock()
        total = 0
        while True:
            msgs = self.reader.poll(self.batch_size, timeout if total == 0 else 0.0)
            if msgs:
                began = clock()
                if self.is_source:
                    self._source_batch(msgs)
                else:
                    self._channel_batch(msgs)
                    self._resume_pending()
                self._flush()
                if self.dead is not None:
                    self.dead.flush()
                per_record = (clock() - began) / len(msgs)
                target = int(budget_s / 4 / per_record) if per_record > 0 else max_records
                self.batch_size = max(16, min(max_records, target))
                total += len(msgs)
            if self.is_source:
                self._source_watermark()
                if self.dead is not None:
                    self.dead.flush()
            if not msgs or self.halted or clock() - start >= budget_s:
                return total

    def _push(self, op: Operator, batch: list[Record], index: _Index = False) -> None:
        """``index``: ``True`` when ``batch[i]`` came from the ``i``-th record that
        ``self._origins`` knows (see :data:`_Index`). Costs nothing per record: the mapping is
        only built when an operator that keeps indexes dropped a failing record."""
        self._index, self._dropped = index, None
        out = op.process(batch)
        if out:
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
                self._push(combiner.children[0], out)

    def _on_error(self, op: Operator, batch: list[Record], index: int, exc: Exception) -> None:
        """An operator's user function raised on ``batch[index]``: a dead letter."""
        assert self.dead is not None
        if self._dropped is None:
            self._dropped = []
        self._dropped.append(index)
        where, origin = self._index, None
        if where is not False and self._origins is not None:
            origin = self._origins(index if where is True else where[index])
        self.dead.function_failed(op.name, batch[index], exc, origin)

    def _source_batch(self, msgs: list[Message]) -> None:
        params = self.source_params
        by_topic: dict[str, list[Record]] = {}
        single: list[tuple[Message, Record]] = []  # local recovery: pushed one at a time
        lineage = self.lineage
        max_ts = self.max_ts
        failed: set[int] = set()  # id() of the messages that did not enter the operators
        for m in msgs:
            topic: Any = m.topic()
            serde, ts_fn, lag_ms = params[topic]
            try:
                value = m.value()
                if serde is not None:
                    value = serde.deserialize(
                        value, topic=topic, partition=m.partition(), offset=m.offset()
                    )
                ts = int(ts_fn(value)) if ts_fn is not None else m.timestamp()[1]
            except Exception as exc:
                if self.dead is None and not isinstance(exc, _SKIPPABLE):
                    raise
                failed.add(id(m))
                self._bad_record(m, exc)
                continue
            tp = (topic, m.partition())
            if ts - lag_ms > max_ts[tp]:
                max_ts[tp] = ts - lag_ms
            if lineage is not None:
                single.append((m, (None, value, ts)))
                continue
            batch = by_topic.get(topic)
            if batch is None:
                batch = by_topic[topic] = []
            batch.append((None, value, ts))
        self.records_in += len(msgs)
        for topic, batch in by_topic.items():
            self._origins = source_origins(msgs, topic, failed)
            for child in self.entry[topic].children:
                self._push(child, batch, True)
        if single:
            assert lineage is not None
            self._origins = self._pushing
        for m, record in single:
            topic = m.topic()
            lineage.set(source_id(topic, m.partition(), m.offset()))  # type: ignore[union-attr]
            self._message = m
            for child in self.entry[topic].children:
                self._push(child, [record], True)
        self._origins = None
        self.pos = self.reader.positions()

    def _bad_record(self, m: Message, exc: Exception) -> None:
        """A source record that did not decode, or whose ``timestamp`` function raised."""
        topic: Any = m.topic()
        if self.dead is not None:
            serde = self.source_params[topic][0]
            value: Any = m.value()
            decoded = not isinstance(exc, DeserializationError)
            if decoded and serde is not None:  # the timestamp function raised: decode again
                try:
                    value = serde.deserialize(
                        value, topic=topic, partition=m.partition(), offset=m.offset()
                    )
                except Exception:
                    decoded = False
            self.dead.source_record(self.entry[topic].name, m, exc, value, decoded=decoded)
            return
        # No dead-letter destination: counted and logged with its location, never dropped
        # silently and never a crash loop.
        self.bad_records += 1
        if self.bad_records <= 20 or self.bad_records % 10_000 == 0:
            log.error(
                "bad record skipped (no dead-letter destination: Dataflow(..., dead_letters=)) "
                "task=%s topic=%s partition=%s offset=%s count=%d error=%r",
                self.name, topic, m.partition(), m.offset(), self.bad_records, str(exc),
            )  # fmt: skip

    def _source_watermark(self) -> None:
        if self.drained:
            return
        if self.env.end_offsets is not None and all(
            self.pos.get(tp, 0) >= self.env.end_offsets.get(tp, 0) for tp in self.max_ts
        ):
            self.drained = True
            self._advance_watermark(MAX_WATERMARK)
            return
        now = self.env.clock()
        if now - self._last_wm_emit < _WATERMARK_EVERY_S or not self.max_ts:
            return
        self._last_wm_emit = now
        self._advance_watermark(min(self.max_ts.values()))

    def _advance_watermark(self, wm: int) -> None:
        if wm <= self.watermark:
            return
        self.watermark = wm
        self._flush()
        lineage = self.lineage
        if self.loop is not None:
            self.loop.iteration = 0  # what a watermark fires starts its own loop count
        for name, op in self.ops.items():  # the stage's steps in order (and the replay check)
            fired = op.on_watermark(wm)
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

    def _channel_batch(self, msgs: list[Message]) -> None:
        if self.replay is not None:
            self._channel_batch_ids(msgs)
            return
        if self.loop is not None:
            self._loop_batch(msgs)
            return
        entry, pos, modes, blocked = self.entry, self.pos, self.modes, self.blocked
        buckets: dict[str, list[Record]] = {}
        loads = orjson.loads
        n = 0
        after: Message | None = None  # the buckets hold records after this message
        for m in msgs:
            topic: Any = m.topic()
            tp = (topic, m.partition())
            if tp in blocked:
                self.stash.setdefault(tp, []).append(m)
                continue
            offset: Any = m.offset()
            headers = m.headers()
            if headers is None and tp not in modes:
                k, v, t = loads(m.value())  # type: ignore[arg-type]
                if type(k) is list:
                    k = tuple(k)
                bucket = buckets.get(topic)
                if bucket is None:
                    bucket = buckets[topic] = []
                bucket.append((k, v, t))
                pos[tp] = offset + 1
                n += 1
                continue
            # slow path: a control record, or a channel still recovering
            self._drain(buckets, msgs, after, m)
            after = m
            pos[tp] = offset + 1
            ctl = decode_control(headers)
            mode = modes.get(tp)
            if ctl is None:
                if mode == _DROP:
                    self.stale_dropped += 1
                    continue
                k, v, t = loads(m.value())  # type: ignore[arg-type]
                self._origins = lambda _i, m=m: m
                self._push(entry[topic], [(tuple(k) if type(k) is list else k, v, t)], True)
                n += 1
            else:
                self._control(tp, ctl, mode)
        self._drain(buckets, msgs, after, None)
        self._origins = None
        self.records_in += n

    def _channel_batch_ids(self, msgs: list[Message]) -> None:
        """Local recovery: channel records are ``[key, value, ts, id hex]``; the ones whose ID
        this task processed already are dropped, the others pushed one at a time."""
        modes, loads = self.modes, orjson.loads
        held: list[tuple[Message, Record, int]] = []
        n = 0
        for m, topic, tp, ctl in self._unstashed(msgs):
            if ctl is None:
                if modes.get(tp) == _DROP:
                    self.stale_dropped += 1
                    continue
                item = loads(m.value())  # type: ignore[arg-type]
                k = tuple(item[0]) if type(item[0]) is list else item[0]
                # a record written without IDs (before a switch to local recovery): its place
                rid = int(item[3], 16) if len(item) > 3 else source_id(topic, tp[1], m.offset())
                held.append((m, (k, item[1], item[2]), rid))
                continue
            n += self._deliver(held)
            held = []
            self._control(tp, ctl, modes.get(tp))
        n += self._deliver(held)
        self.records_in += n

    def _unstashed(self, msgs: list[Message]) -> Iterator[tuple[Message, Any, TP, Any]]:
        """``(message, topic, channel, control or None)`` for the messages of channels that are
        not blocked, their positions advanced; a blocked channel's messages are stashed. (The
        checks run as the caller consumes: a control record may block its channel.)"""
        pos, blocked = self.pos, self.blocked
        for m in msgs:
            topic: Any = m.topic()
            tp = (topic, m.partition())
            if tp in blocked:
                self.stash.setdefault(tp, []).append(m)
                continue
            pos[tp] = m.offset() + 1
            headers = m.headers()
            yield m, topic, tp, decode_control(headers) if headers is not None else None

    def _loop_batch(self, msgs: list[Message]) -> None:
        """A task in a loop: loop channel records are ``[key, value, ts, iteration]``; runs of
        records with one input and one iteration are pushed together, with the iteration in
        :attr:`loop`. A loop head adds one to what its back-edges deliver, drops what exceeds
        ``max_iterations``, and counts the back-edge log of the checkpoint it is collecting."""
        modes, loads = self.modes, orjson.loads
        loop_topics, back_topics = self.loop_topics, self.back_topics
        logging_tps = self.back_logging
        run: list[Record] = []
        run_msgs: list[Message] = []
        run_key: tuple[str, int] | None = None
        n = replayed = 0
        for m, topic, tp, ctl in self._unstashed(msgs):
            if ctl is not None:
                self._push_run(run_key, run, run_msgs)
                run, run_msgs, run_key = [], [], None
                self._control(tp, ctl, modes.get(tp))
                continue
            mode = modes.get(tp)
            if mode == _DROP:
                self.stale_dropped += 1
                continue
            item = loads(m.value())  # type: ignore[arg-type]
            k = tuple(item[0]) if type(item[0]) is list else item[0]
            record = (k, item[1], item[2])
            it = item[3] if topic in loop_topics else 0
            if topic in back_topics:
                it += 1
                if mode == _REPLAY:
                    replayed += 1
                elif tp in logging_tps:  # the log of the checkpoint whose barrier is coming around
                    self.loop_log[self.logging_id] += 1
                limit = back_topics[topic]
                if limit is not None and it > limit:
                    self._iteration_limit(m, record, limit)
                    continue
            if run_key != (topic, it):
                self._push_run(run_key, run, run_msgs)
                run, run_msgs, run_key = [], [], (topic, it)
            run.append(record)
            run_msgs.append(m)
            n += 1
        self._push_run(run_key, run, run_msgs)
        self.records_in += n
        self.log_replayed += replayed

    def _push_run(
        self, key: tuple[str, int] | None, run: list[Record], msgs: list[Message]
    ) -> None:
        if key is None or not run:
            return
        assert self.loop is not None
        self.loop.iteration = key[1]
        self._origins = msgs.__getitem__
        self._push(self.entry[key[0]], run, True)
        self._origins = None

    def _iteration_limit(self, m: Message, record: Record, limit: int) -> None:
        """A record came around the loop more than ``max_iterations`` times: dropped from the
        loop, counted and logged, and a dead letter when the dataflow has a destination."""
        self.loop_exhausted += 1
        head = self.entry[m.topic()].name
        if self.dead is not None:
            exc = IterationLimitError(f"went around loop {head!r} more than {limit} times")
            self.dead.function_failed(head, record, exc, m)
        if self.loop_exhausted <= 20 or self.loop_exhausted % 10_000 == 0:
            log.warning(
                "record dropped from loop %r after max_iterations=%d task=%s count=%d%s",
                head, limit, self.name, self.loop_exhausted,
                " (dead letter)" if self.dead is not None else "",
            )  # fmt: skip

    def _deliver(self, held: list[tuple[Message, Record, int]]) -> int:
        """Pushes the records of ``held`` whose IDs are new to this task, each on its own."""
        if not held:
            return 0
        replay, lineage, entry = self.replay, self.lineage, self.entry
        assert replay is not None and lineage is not None
        fresh = replay.check([rid for _m, _r, rid in held], [r[2] for _m, r, _rid in held])
        self._origins = self._pushing
        for (m, record, rid), new in zip(held, fresh, strict=True):
            if new:
                lineage.set(rid)
                self._message = m
                self._push(entry[m.topic()], [record], True)
        self._origins = None
        return len(held)

    def _pushing(self, _index: int) -> Message | None:
        """Origins while records are pushed one at a time: the message being pushed."""
        return self._message

    def _drain(
        self,
        buckets: dict[str, list[Record]],
        msgs: list[Message],
        after: Message | None,
        until: Message | None,
    ) -> None:
        """Pushes the buckets, filled from the messages between ``after`` and ``until``."""
        for topic, batch in buckets.items():
            if batch:
                self._origins = channel_origins(msgs, after, until, topic, self.blocked, self.modes)
                self._push(self.entry[topic], batch, True)
        buckets.clear()

    def _control(self, tp: TP, ctl: Any, mode: int | None) -> None:
        if isinstance(ctl, GenerationStart):
            if ctl.generation == self.generation:
                if mode is not None:
                    del self.modes[tp]
                    self._replayed(tp)
            elif ctl.generation > self.generation:
                raise EosflowError(
                    f"task {self.name}: channel {tp} carries generation {ctl.generation}, newer "
                    f"than this worker's {self.generation}: this worker is a zombie; stopping"
                )
            return
        if mode == _DROP:
            return
        if isinstance(ctl, Barrier):
            if mode == _REPLAY:
                if ctl.checkpoint_id >= self.restored_id:
                    self.modes[tp] = _DROP
                return
            if ctl.generation != self.generation:
                return
            if ctl.checkpoint_id == self.logging_id:  # not a late barrier of an aborted one
                self.back_logging.discard(tp)
            self.barrier_seen.setdefault(ctl.checkpoint_id, set()).add(tp)
            self.barrier_unaligned.setdefault(ctl.checkpoint_id, ctl.unaligned)
            assert self.aligner is not None
            actions = self.aligner.on_barrier(tp, ctl.checkpoint_id, unaligned=ctl.unaligned)
            self._actions(actions)
            if self.aligner.pending_checkpoint is not None:
                self.env.fault("mid-alignment")
        elif isinstance(ctl, Watermark):
            if tp in self.back:
                return  # feedback of this task's own output: waiting for it would stall
            self.channel_wm[tp] = max(self.channel_wm.get(tp, MIN_WATERMARK), ctl.ts_ms)
            self._advance_watermark(min(self.channel_wm.values()))
        elif isinstance(ctl, EndOfStream):
            assert self.aligner is not None
            self._actions(self.aligner.on_end_of_stream(tp))

    def _replayed(self, tp: TP) -> None:
        """``tp`` is live; once every back-edge is (its log replayed, the failed generation's
        records after it dropped), the regular inputs held since the restore are read again."""
        if tp not in self.replaying:
            return
        self.replaying.discard(tp)
        if not self.replaying and self.held:
            log.info(
                "back-edge log replayed task=%s records=%d; reading inputs",
                self.name, self.log_replayed,
            )  # fmt: skip
            self.to_resume |= set(self.held)  # _resume_pending: stash first, then the reader
            self.held = []

    def _actions(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Pause):
                tp: Any = action.channel
                self.blocked.add(tp)
                self.reader.pause([tp])
            elif isinstance(action, Resume):
                self.to_resume |= set(action.channels)  # type: ignore[arg-type]
            elif isinstance(action, TakeSnapshot):
                self._snapshot(action.checkpoint_id)
            elif isinstance(action, ForwardBarrier):
                self._forward_barrier(action.checkpoint_id)
            elif isinstance(action, AlignmentDone):
                self.aligned.add(action.checkpoint_id)
            elif isinstance(action, AbortCheckpoint):
                self._forget(action.checkpoint_id)

    def _resume_pending(self) -> None:
        """Unblock channels once the batch that paused them is done; replay their stash first."""
        while self.to_resume:
            channels, self.to_resume = self.to_resume, set()
            channels &= self.blocked
            self.blocked -= channels
            replay = [m for tp in channels for m in self.stash.pop(tp, [])]
            if replay:
                self._channel_batch(replay)
            live = [tp for tp in channels if tp not in self.blocked]
            if live:
                self.reader.resume(live)

    # -- checkpoints -----------------------------------------------------------------------------

    def trigger(self, checkpoint_id: int, *, aligned: bool = False) -> None:
        """Source tasks: the coordinator started ``checkpoint_id`` (``aligned``: even in
        unaligned mode, as the final checkpoint of a run must be)."""
        if checkpoint_id <= self._stale():
            return
        self.barrier_unaligned[checkpoint_id] = self.env.mode == "unaligned" and not aligned
        self._snapshot(checkpoint_id)
        self._forward_barrier(checkpoint_id)
        self.aligned.add(checkpoint_id)
        if self.env.mode == "sync":
            self.halted = True

    def _forward_barrier(self, checkpoint_id: int) -> None:
        unaligned = self.barrier_unaligned.pop(checkpoint_id, self.env.mode == "unaligned")
        for old in [c for c in self.barrier_unaligned if c < checkpoint_id]:
            del self.barrier_unaligned[old]
        barrier = Barrier(checkpoint_id, self.generation, unaligned)
        for out in self.outputs:
            out.control(barrier)

    def _snapshot(self, checkpoint_id: int) -> None:
        self._flush()  # partial aggregates belong to the epoch that ends here
        if self.dead is not None:
            self.dead.flush()  # so do dead letters (the combiner flush may add some)
        if self.committers:
            self.env.fault("before-prepare")
        for name, writer in self.committers:
            committable = writer.prepare(checkpoint_id)
            if committable is not None:
                self.sink_pending[name].append((checkpoint_id, committable))
        for op in self.ops.values():
            op.prepare(checkpoint_id)  # dedup: IDs into the store before the snapshot
        seen = self.barrier_seen.pop(checkpoint_id, set())
        for old in [c for c in self.barrier_seen if c < checkpoint_id]:
            del self.barrier_seen[old]
        if self.back:  # Algorithm 2: log the back-edges until the barrier comes around
            self.back_logging.clear()
            self.back_logging |= self.back - seen
            self.logging_id = checkpoint_id
            self.loop_log[checkpoint_id] = 0
        state = {
            "task": self.name,
            "checkpoint": checkpoint_id,
            "generation": self.generation,
            "positions": dict(self.pos),
            "barrier_seen": sorted(seen),
            "channel_wm": dict(self.channel_wm),
            "max_ts": dict(self.max_ts),
            "watermark": self.watermark,
            "operators": {n: op.snapshot() for n, op in self.ops.items() if op.stateful},
            "sinks": {n: list(p) for n, p in self.sink_pending.items()},
        }
        env = self.env
        if env.mode == "sync":  # stop-the-world: serialize and upload in the task loop
            future: Future[SnapshotHandle] = Future()
            future.set_result(
                env.store.write_task_snapshot(self.plan.job, checkpoint_id, self.name, state)
            )
        else:
            future = env.uploads.submit(
                env.store.write_task_snapshot, self.plan.job, checkpoint_id, self.name, state
            )
        self.uploading[checkpoint_id] = future

    def _forget(self, checkpoint_id: int) -> None:
        logged = self.loop_log.pop(checkpoint_id, None) is not None
        if logged and checkpoint_id == self.logging_id:
            self.back_logging.clear()
        self.uploading.pop(checkpoint_id, None)
        self.uploaded.pop(checkpoint_id, None)
        self.aligned.discard(checkpoint_id)

    def ready_acks(self) -> list[tuple[int, SnapshotHandle]]:
        """Checkpoints whose snapshot is uploaded and whose alignment is done (ack them now).

        A failed upload is declined (:attr:`declined`), not fatal: the coordinator may have
        aborted that checkpoint and deleted its directory while the upload ran (a timeout, or
        another worker restarting alone); if it had not, declining aborts it, and the next
        checkpoint tries again."""
        for chk, future in list(self.uploading.items()):
            if future.done():
                del self.uploading[chk]
                try:
                    self.uploaded[chk] = future.result()
                    self._upload_failures = 0
                except Exception as exc:
                    self._upload_failures += 1
                    if self._upload_failures >= _MAX_UPLOAD_FAILURES:
                        raise  # not a race with an abort: the store is failing
                    log.warning(
                        "snapshot upload failed task=%s checkpoint_id=%d: %s: %s (declined)",
                        self.name, chk, type(exc).__name__, exc,
                    )  # fmt: skip
                    self.declined.append((chk, f"snapshot upload failed: {exc}"))
                    self.aligned.discard(chk)
        ready = []
        for chk in sorted(self.uploaded):
            if chk in self.aligned:
                ready.append((chk, self.uploaded.pop(chk)))
                self.aligned.discard(chk)
        return ready

    def complete(self, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id`` completed: commit the sinks' epochs up to it."""
        self.halted = False
        for name, writer in self.committers:
            pending = self.sink_pending[name]
            due = [(c, x) for c, x in pending if c <= checkpoint_id]
            if due:
                self.env.fault("after-completion-before-commit")
            for chk, committable in due:
                writer.commit(chk, committable)
            self.sink_pending[name] = [(c, x) for c, x in pending if c > checkpoint_id]
        for op in self.ops.values():
            op.commit(checkpoint_id)
        for chk in [c for c in self.uploaded if c <= checkpoint_id]:
            del self.uploaded[chk]

    def abort(self, checkpoint_id: int, reason: str) -> None:
        self.halted = False
        if self.aligner is not None:
            self._actions(self.aligner.on_abort(checkpoint_id, reason))
            self._resume_pending()
        self._forget(checkpoint_id)

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
        }
