"""Channel inputs of a task: the live fast path, the recovery modes, loops and local recovery.

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

Local recovery (docs/local-recovery.md): channel records carry their IDs; the ones this task
processed already are dropped by :class:`~processor.runtime.dedup_step.ReplayCheck`, the others
pushed one at a time with their ID as lineage.

Invariants:
    Records of a paused channel that were fetched anyway are stashed, never processed early, and
    replayed in order on resume.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import orjson

from dedup.ids import source_id
from processor.checkpoint.aligner import (
    AbortCheckpoint,
    Action,
    AlignmentDone,
    ForwardBarrier,
    Pause,
    Resume,
    TakeSnapshot,
)
from processor.contracts import Message
from processor.errors import EosflowError, IterationLimitError
from processor.runtime.dead_letters import channel_origins
from processor.runtime.operators import (
    MIN_WATERMARK,
    Record,
)
from processor.runtime.task.base import _DROP, _REPLAY, TP
from processor.runtime.task.checkpoints import TaskCheckpoints
from processor.wire import (
    Barrier,
    EndOfStream,
    GenerationStart,
    Watermark,
    decode_control,
)

log = logging.getLogger(__name__)


class ChannelInputs(TaskCheckpoints):
    """How a task reads its channel inputs and acts on their control records."""

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
            if ctl.generation > self.generation:
                raise EosflowError(
                    f"task {self.name}: channel {tp} carries generation {ctl.generation}, newer "
                    f"than this worker's {self.generation}: this worker is a zombie; stopping"
                )
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
                self._snapshot(action.checkpoint_id)
            elif isinstance(action, ForwardBarrier):
                self._forward_barrier(action.checkpoint_id)
            elif isinstance(action, AlignmentDone):
                self.aligned.add(action.checkpoint_id)
                began = self.align_start.pop(action.checkpoint_id, None)
                if began is not None:
                    self.align_s[action.checkpoint_id] = time.monotonic() - began
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

    def abort(self, checkpoint_id: int, reason: str) -> None:
        self.halted = False
        if self.aligner is not None:
            self._actions(self.aligner.on_abort(checkpoint_id, reason))
            self._resume_pending()
        self._forget(checkpoint_id)
