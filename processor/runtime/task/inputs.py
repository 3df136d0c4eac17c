"""Channel inputs of a task: the live fast path, the recovery modes, loops and local recovery.

Recovery (docs/engine.md, "Recovery (global)"; :mod:`processor.wire` on generation markers): a
restored channel
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

Local recovery (docs/local-recovery.md): channel records carry their IDs; the ones this task
processed already are dropped by :class:`~processor.runtime.operators.replay.ReplayCheck`, the
others pushed one at a time with their ID as lineage.

Zombie fencing (:mod:`processor.wire`, "Fencing"): a record written by an older incarnation
of its channel's writer than one already read there is dropped, in every mode
(:class:`~.fence.ChannelFence`). The live fast path compares the record's key with the
channel's floor key; anything else goes the slow path.

:class:`ChannelInputs` owns all of this state (positions, recovery phases, the barrier aligner,
paused channels and their stash, the loop's back-edge log, alignment times); it pushes records
into the task's :class:`~.chain.OperatorChain` and hands the aligner's snapshot, barrier and
abort actions to the task's checkpoint coordinator (a :class:`Barriers`).

Invariants:
    ``pos[tp]`` is the offset after the last record of ``tp`` that went through the operators
    (or was deliberately dropped). Records of a paused channel that were fetched anyway are
    stashed, never processed early, and replayed in order on resume.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any, Protocol

import orjson

from dedup.ids import derived_id, source_id
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
from processor.contracts import Message, Reader
from processor.errors import EosflowError, IterationLimitError
from processor.runtime.operators.core import (
    MIN_WATERMARK,
    Record,
)
from processor.runtime.task.chain import TP, OperatorChain
from processor.runtime.task.channels import TaskEnv
from processor.runtime.task.checkpoints import InputState
from processor.runtime.task.dead_letters import channel_origins
from processor.runtime.task.fence import NOT_LIVE, ChannelFence
from processor.wire import (
    Barrier,
    EndOfStream,
    GenerationStart,
    Watermark,
    bundle_records,
    decode_control,
)

log = logging.getLogger(__name__)

#: Recovery modes of a restored channel input.
_REPLAY, _DROP = 1, 2


class Barriers(Protocol):
    """What the channel inputs hand to the checkpoint coordinator: the aligner's actions."""

    def snapshot(self, checkpoint_id: int, inputs: InputState) -> None: ...
    def forward_barrier(self, checkpoint_id: int) -> None: ...
    def note_barrier(self, checkpoint_id: int, unaligned: bool) -> None: ...
    def alignment_done(self, checkpoint_id: int) -> None: ...
    def forget(self, checkpoint_id: int) -> None: ...
    def stale(self) -> int: ...


class ChannelInputs:
    """How a task reads its channel inputs and acts on their control records (Flink's input
    gates and ``CheckpointBarrierHandler`` of one task)."""

    def __init__(
        self,
        env: TaskEnv,
        stage: Stage,
        name: str,
        chain: OperatorChain,
        reader: Reader,
        checkpoints: Barriers,
    ) -> None:
        self.env = env
        self.name = name
        self.generation = env.generation
        self.chain = chain
        self.reader = reader
        self._checkpoints = checkpoints
        self.loop_topics = {e.topic for e in stage.inputs if e.loop}
        steps = env.plan.flow.steps
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
        self.stale_dropped = 0
        self.fence = ChannelFence(name)
        self.pos: dict[TP, int] = {}
        self.modes: dict[TP, int] = {}  # a recovering channel's current mode (fast to test)
        # ... and the phases it still has to go through, the current one first: (_REPLAY,
        # checkpoint whose barrier ends it) or (_DROP, generation whose marker ends it).
        self.phases: dict[TP, list[tuple[int, int]]] = {}
        self.blocked: set[TP] = set()
        self.stash: dict[TP, list[Message]] = {}
        self.to_resume: set[TP] = set()
        self.channel_wm: dict[TP, int] = {}
        #: a source's event-time progress: only what a restored snapshot had, kept as it was
        self.max_ts: dict[TP, int] = {}
        self.aligner: BarrierAligner | None = None
        self.barrier_seen: dict[int, set[TP]] = {}
        # metrics: when a checkpoint's first barrier came, how long its alignment took (s)
        self.align_start: dict[int, float] = {}
        self.align_s: dict[int, float] = {}

    # -- lifecycle -------------------------------------------------------------------------------

    def open(
        self,
        tps: list[TP],
        positions: dict[TP, int | None],
        state: dict[str, Any] | None,
        seen: set[TP],
        *,
        alone: bool,
        restored_id: int,
    ) -> None:
        """Sets each restored channel's recovery phases, the aligner, and starts reading at
        ``positions`` (``alone``: restarted alone, every record after them is live)."""
        recovering = state.get("recovering", {}) if state is not None else {}
        self.back = {tp for tp in tps if tp[0] in self.back_topics}
        for tp in tps:
            if tp in self.back:  # a loop's watermark comes from its regular inputs only
                self.channel_wm.pop(tp, None)
            else:
                self.channel_wm.setdefault(tp, MIN_WATERMARK)
            if alone:
                continue
            # What the snapshot's channel still had to go through when it was taken (an
            # unaligned snapshot during an earlier recovery), then this restore's phases.
            phases = [(int(m), int(b)) for m, b in recovering.get(tp, [])]
            if state is not None and tp not in seen and positions[tp] is not None:
                phases.append((_REPLAY, restored_id))
            phases.append((_DROP, self.generation))
            self.phases[tp] = phases
            self.modes[tp] = phases[0][0]
        self.aligner = BarrierAligner(
            tps,
            unaligned=self.env.mode == "unaligned",
            restored_checkpoint=self._checkpoints.stale(),
            back_edges=self.back,
        )
        self.replaying = {tp for tp in self.back if tp in self.modes}
        self.fence.open(tp for tp in tps if tp not in self.modes)
        self.reader.open(positions, start="earliest", stop_at=None)
        self.pos = {tp: o for tp, o in self.reader.positions().items()}
        if self.replaying:  # replay the back-edge log before consuming the regular inputs
            self.held = [tp for tp in tps if tp not in self.back]
            self.blocked |= set(self.held)  # anything fetched anyway is stashed, not processed
            self.reader.pause(self.held)

    def watermark_parts(self) -> list[list[Any]]:
        """``[topic, partition, watermark, None, state]`` per channel input (the metrics and
        the job page; back-edges have no watermark): state ``aligning`` while held for a
        barrier, else ``reading``."""
        return [
            [tp[0], tp[1], None if wm == MIN_WATERMARK else wm, None,
             "aligning" if tp in self.blocked else "reading"]
            for tp, wm in self.channel_wm.items()
        ]  # fmt: skip

    def restore(self, state: dict[str, Any]) -> None:
        self.channel_wm = dict(state["channel_wm"])
        self.max_ts = dict(state["max_ts"])
        # absent from a snapshot of a release before the fencing: no floor, the markers set it
        self.fence.restore(state.get("floors", {}))

    def read(self, msgs: list[Message]) -> None:
        """Processes a polled batch, then resumes the channels its barriers let go."""
        self._channel_batch(msgs)
        self._resume_pending()

    # -- checkpoints -----------------------------------------------------------------------------

    def snapshot(self, checkpoint_id: int) -> dict[str, Any]:
        """The channels' part of the snapshot of ``checkpoint_id`` (see :class:`InputState`);
        a loop head starts logging its back-edges until the barrier comes around."""
        seen = self.barrier_seen.pop(checkpoint_id, set())
        for old in [c for c in self.barrier_seen if c < checkpoint_id]:
            del self.barrier_seen[old]
        if self.back:  # Algorithm 2: log the back-edges until the barrier comes around
            self.back_logging.clear()
            self.back_logging |= self.back - seen
            self.logging_id = checkpoint_id
            self.loop_log[checkpoint_id] = 0
        if self.modes:
            log.info(
                "snapshot with recovering channels task=%s checkpoint_id=%d channels=%d",
                self.name, checkpoint_id, len(self.modes),
            )  # fmt: skip
        return {
            "barrier_seen": sorted(seen),
            "channel_wm": dict(self.channel_wm),
            "max_ts": dict(self.max_ts),
            "recovering": {tp: [list(ph) for ph in self.phases[tp]] for tp in self.modes},
            "floors": self.fence.snapshot(),
        }

    def forget(self, checkpoint_id: int) -> None:
        """``checkpoint_id`` was aborted: its back-edge log, then the coordinator's part."""
        logged = self.loop_log.pop(checkpoint_id, None) is not None
        if logged and checkpoint_id == self.logging_id:
            self.back_logging.clear()
        self._checkpoints.forget(checkpoint_id)

    def alignment_of(self, checkpoint_id: int) -> float:
        """Seconds this task aligned its inputs for ``checkpoint_id`` (0: none), when it is
        acked; what older (aborted, stale) checkpoints left is dropped with it."""
        seconds = self.align_s.get(checkpoint_id, 0.0)
        for times in (self.align_start, self.align_s):
            for old in [c for c in times if c <= checkpoint_id]:
                del times[old]
        return seconds

    # -- the data path ---------------------------------------------------------------------------

    def _channel_batch(self, msgs: list[Message]) -> None:
        if self.chain.replay is not None:
            self._channel_batch_ids(msgs)
            return
        if self.chain.loop is not None:
            self._loop_batch(msgs)
            return
        entry, pos, modes, blocked = self.chain.entry, self.pos, self.modes, self.blocked
        if not blocked and len(entry) == 1 and msgs and self._live_batch(msgs):
            return
        live, fence = self.fence.live_keys, self.fence
        buckets: dict[str, list[Record]] = {}
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
            key = m.key()
            if headers is None and key == live.get(tp, NOT_LIVE):
                items = _items(m.value())
                bucket = buckets.get(topic)
                if bucket is None:
                    bucket = buckets[topic] = []
                bucket += [(tuple(k) if type(k) is list else k, v, t) for k, v, t in items]
                pos[tp] = offset + 1
                n += len(items)
                continue
            # slow path: a control record, a channel still recovering, another incarnation
            self._drain(buckets, msgs, after, m)
            after = m
            pos[tp] = offset + 1
            ctl = decode_control(headers)
            mode = modes.get(tp)
            if key != live.get(tp, NOT_LIVE) and not fence.admit(
                tp, key, offset, recovering=mode is not None
            ):
                continue
            if ctl is None:
                if mode == _DROP:
                    self.stale_dropped += 1
                    continue
                items = _items(m.value())
                self.chain.origins = lambda _i, m=m: m
                self.chain.push(
                    entry[topic],
                    [(tuple(k) if type(k) is list else k, v, t) for k, v, t in items],
                    True,
                )
                n += len(items)
            else:
                self._control(tp, ctl, mode)
        self._drain(buckets, msgs, after, None)
        self.chain.origins = None
        self.records_in += n

    def _live_batch(self, msgs: list[Message]) -> bool:
        """The common batch as columns: one channel topic, nothing paused, every record a data
        record (no header) keyed with its channel's live key. ``False`` (nothing done) for any
        other batch: :meth:`_channel_batch` takes it record by record."""
        heads = [m.headers() for m in msgs]
        if heads.count(None) != len(heads):  # a control record
            return False
        keys = [m.key() for m in msgs]
        if keys.count(keys[0]) != len(keys):
            return False
        (topic,) = self.chain.entry
        live, key = self.fence.live_keys, keys[0]
        # each partition's last record in the batch (a dict keeps the last value of a key)
        last = dict(zip([m.partition() for m in msgs], range(len(msgs)), strict=True))
        for partition in last:
            if live.get((topic, partition), NOT_LIVE) != key:  # recovering, or a zombie's
                return False
        items: list[Any] = []
        for m in msgs:  # messages are mostly bundles: one call per message, not per record
            items += _items(m.value())
        batch = [(tuple(k) if type(k) is list else k, v, t) for k, v, t in items]
        pos = self.pos
        for partition, i in last.items():
            offset: Any = msgs[i].offset()
            pos[(topic, partition)] = offset + 1
        self.chain.origins = channel_origins(msgs, None, None, topic, self.blocked, self.modes)
        self.chain.push(self.chain.entry[topic], batch, True)
        self.chain.origins = None
        self.records_in += len(batch)
        return True

    def _channel_batch_ids(self, msgs: list[Message]) -> None:
        """Local recovery: channel records are ``[key, value, ts, id hex]``; the ones whose ID
        this task processed already are dropped, the others pushed one at a time."""
        modes, loads, floor = self.modes, orjson.loads, self.fence.floor
        held: list[tuple[Message, Record, int]] = []
        held_tp: TP | None = None  # the channel of the held records (one at a time)
        held_inc = 0  # and their writer's incarnation
        n = 0
        for m, topic, tp, ctl in self._unstashed(msgs):
            if ctl is None:
                if modes.get(tp) == _DROP:
                    self.stale_dropped += 1
                    continue
                inc = floor.get(tp, 0)  # the fence admitted it: its writer's incarnation
                if tp != held_tp or inc != held_inc:
                    n += self._deliver(held_tp, held_inc, held)
                    held, held_tp, held_inc = [], tp, inc
                value: Any = m.value()
                bundle = bundle_records(value)
                if bundle is None:
                    item = loads(value)
                    k = tuple(item[0]) if type(item[0]) is list else item[0]
                    # a record written without IDs (before a switch to local recovery): its place
                    rid = int(item[3], 16) if len(item) > 3 else source_id(topic, tp[1], m.offset())
                    held.append((m, (k, item[1], item[2]), rid))
                    continue
                # a bundle (written without IDs): each record's place in it
                place = source_id(topic, tp[1], m.offset())
                for i, (k, v, t) in enumerate(bundle):
                    held.append(
                        (m, (tuple(k) if type(k) is list else k, v, t), derived_id(place, i))
                    )
                continue
            n += self._deliver(held_tp, held_inc, held)
            held, held_tp = [], None
            if isinstance(ctl, (Barrier, GenerationStart)) and modes.get(tp) != _DROP:
                # The replay check learns who writes the channel and what its barriers cover
                # (processor.runtime.operators.replay); the fence admitted the record, so the
                # floor is its writer's incarnation.
                replay = self.chain.replay
                assert replay is not None
                if isinstance(ctl, GenerationStart):
                    replay.incarnation(tp, max(ctl.incarnation, floor.get(tp, 0)))
                elif ctl.generation == self.generation:
                    replay.barrier(tp, floor.get(tp, 0), ctl.checkpoint_id)
            self._control(tp, ctl, modes.get(tp))
        n += self._deliver(held_tp, held_inc, held)
        self.records_in += n

    def _unstashed(self, msgs: list[Message]) -> Iterator[tuple[Message, Any, TP, Any]]:
        """``(message, topic, channel, control or None)`` for the messages of channels that are
        not blocked, their positions advanced; a blocked channel's messages are stashed. (The
        checks run as the caller consumes: a control record may block its channel.)"""
        pos, blocked, fence = self.pos, self.blocked, self.fence
        for m in msgs:
            topic: Any = m.topic()
            tp = (topic, m.partition())
            if tp in blocked:
                self.stash.setdefault(tp, []).append(m)
                continue
            pos[tp] = m.offset() + 1
            headers = m.headers()
            key = m.key()
            if key != fence.live_keys.get(tp, NOT_LIVE) and not fence.admit(
                tp, key, m.offset(), recovering=tp in self.modes
            ):
                continue
            yield m, topic, tp, decode_control(headers) if headers is not None else None

    def _loop_batch(self, msgs: list[Message]) -> None:
        """A task in a loop: loop channel records are ``[key, value, ts, iteration]``; runs of
        records with one input and one iteration are pushed together, with the iteration in
        :attr:`loop`. A loop head adds one to what its back-edges deliver, drops what exceeds
        ``max_iterations``, and counts the back-edge log of the checkpoint it is collecting."""
        modes = self.modes
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
            for item in _items(m.value()):  # loop channels' records are never bundled
                k = tuple(item[0]) if type(item[0]) is list else item[0]
                record = (k, item[1], item[2])
                it = item[3] if topic in loop_topics else 0
                if topic in back_topics:
                    it += 1
                    if mode == _REPLAY:
                        replayed += 1
                    elif tp in logging_tps:  # the log of the checkpoint whose barrier comes around
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
        loop = self.chain.loop
        assert loop is not None
        loop.iteration = key[1]
        self.chain.origins = msgs.__getitem__
        self.chain.push(self.chain.entry[key[0]], run, True)
        self.chain.origins = None

    def _iteration_limit(self, m: Message, record: Record, limit: int) -> None:
        """A record came around the loop more than ``max_iterations`` times: dropped from the
        loop, counted and logged, and a dead letter when the dataflow has a destination."""
        self.loop_exhausted += 1
        head = self.chain.entry[m.topic()].name
        if self.chain.dead is not None:
            exc = IterationLimitError(f"went around loop {head!r} more than {limit} times")
            self.chain.dead.function_failed(head, record, exc, m)
        if self.loop_exhausted <= 20 or self.loop_exhausted % 10_000 == 0:
            log.warning(
                "record dropped from loop %r after max_iterations=%d task=%s count=%d%s",
                head, limit, self.name, self.loop_exhausted,
                " (dead letter)" if self.chain.dead is not None else "",
            )  # fmt: skip

    def _deliver(
        self, tp: TP | None, incarnation: int, held: list[tuple[Message, Record, int]]
    ) -> int:
        """Pushes the records of ``held`` (read on channel ``tp``, written by ``incarnation``)
        whose IDs are new to this task, each on its own."""
        if not held or tp is None:
            return 0
        replay, lineage, entry = self.chain.replay, self.chain.lineage, self.chain.entry
        assert replay is not None and lineage is not None
        fresh = replay.check(tp, incarnation, [rid for _m, _r, rid in held])
        self.chain.origins = self.chain.pushing
        for (m, record, rid), new in zip(held, fresh, strict=True):
            if new:
                lineage.set(rid)
                self.chain.message = m
                self.chain.push(entry[m.topic()], [record], True)
        self.chain.origins = None
        return len(held)

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
                self.chain.origins = channel_origins(
                    msgs, after, until, topic, self.blocked, self.modes
                )
                self.chain.push(self.chain.entry[topic], batch, True)
        buckets.clear()

    def _control(self, tp: TP, ctl: Any, mode: int | None) -> None:
        if isinstance(ctl, GenerationStart):
            if ctl.generation > self.generation:
                raise EosflowError(
                    f"task {self.name}: channel {tp} carries generation {ctl.generation}, newer "
                    f"than this worker's {self.generation}: this worker is a zombie; stopping"
                )
            self.fence.announce(tp, ctl.incarnation)  # the key said so already, normally
            if mode is not None and ctl.generation == self.generation:
                self._live(tp)  # this generation's records follow
            elif mode == _DROP and ctl.generation >= self.phases[tp][0][1]:
                self._next_phase(tp)  # a dead generation's records end; what follows is next
            return
        if mode == _DROP:
            return
        if isinstance(ctl, Barrier):
            if mode == _REPLAY:
                if ctl.checkpoint_id >= self.phases[tp][0][1]:
                    self._next_phase(tp)  # the in-flight records of that checkpoint end here
                return
            if ctl.generation != self.generation:
                return
            if ctl.checkpoint_id == self.logging_id:  # not a late barrier of an aborted one
                self.back_logging.discard(tp)
            if ctl.checkpoint_id not in self.barrier_seen:
                self.align_start[ctl.checkpoint_id] = time.monotonic()
            self.barrier_seen.setdefault(ctl.checkpoint_id, set()).add(tp)
            self._checkpoints.note_barrier(ctl.checkpoint_id, ctl.unaligned)
            assert self.aligner is not None
            actions = self.aligner.on_barrier(tp, ctl.checkpoint_id, unaligned=ctl.unaligned)
            self._actions(actions)
            if self.aligner.pending_checkpoint is not None:
                self.env.fault("mid-alignment")
        elif isinstance(ctl, Watermark):
            if tp in self.back:
                return  # feedback of this task's own output: waiting for it would stall
            self.channel_wm[tp] = max(self.channel_wm.get(tp, MIN_WATERMARK), ctl.ts_ms)
            self.chain.advance_watermark(min(self.channel_wm.values()))
        elif isinstance(ctl, EndOfStream):
            assert self.aligner is not None
            self._actions(self.aligner.on_end_of_stream(tp))

    def _next_phase(self, tp: TP) -> None:
        """``tp``'s current recovery phase ended: the next one starts, or the channel is live."""
        phases = self.phases[tp]
        phases.pop(0)
        if phases:
            self.modes[tp] = phases[0][0]
        else:
            self._live(tp)

    def _live(self, tp: TP) -> None:
        del self.phases[tp]
        del self.modes[tp]
        self.fence.live(tp)
        self._replayed(tp)

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
                self._checkpoints.snapshot(action.checkpoint_id, self)
            elif isinstance(action, ForwardBarrier):
                self._checkpoints.forward_barrier(action.checkpoint_id)
            elif isinstance(action, AlignmentDone):
                self._checkpoints.alignment_done(action.checkpoint_id)
                began = self.align_start.pop(action.checkpoint_id, None)
                if began is not None:
                    self.align_s[action.checkpoint_id] = time.monotonic() - began
            elif isinstance(action, AbortCheckpoint):
                self.forget(action.checkpoint_id)

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

    def abort(self, checkpoint_id: int, reason: str) -> None:
        """The coordinator aborted ``checkpoint_id``: the aligner lets go of it."""
        if self.aligner is not None:
            self._actions(self.aligner.on_abort(checkpoint_id, reason))
            self._resume_pending()
        self.forget(checkpoint_id)


def _items(value: Any) -> list[Any]:
    """The records (JSON arrays) of a data record's value: itself, or a bundle's records."""
    bundle = bundle_records(value)
    return [orjson.loads(value)] if bundle is None else bundle
