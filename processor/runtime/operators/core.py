"""Operators: the steps of a stage, turned into objects that process batches of records. Here:
the contract (:class:`Operator`, :data:`Record`, the watermark bounds) and the operators without
windows (map, filter, flat_map, key_by, the running aggregation, the sink); windows and the
combiner: :mod:`.windows`; which operator runs each step kind: :mod:`.registry`.

A record is ``(key, value, ts_ms)`` (``key`` is ``None`` on unkeyed streams). Every operator
takes a batch and returns the batch it emits; the task pushes that into the operator's children
(fusion is just this call chain). Stateful operators implement ``snapshot``/``restore``.

Failing user functions: every operator runs its batch as one comprehension or loop, as fast as
Python allows. Only when a user function raises and the task gave the operator an ``on_error``
handler (the dataflow has a dead-letter destination) does it fall back to a per-record loop that
hands each failing record to the handler and keeps the others. Without a handler the exception
propagates unchanged (the task fails). Stateless operators re-run the whole batch in the slow path
(user functions are deterministic); stateful ones resume after the failing record, never applying
a record twice, and apply each record atomically (all of its windows or none).

Invariants:
    ``snapshot()`` returns a value the task may serialize later, on another thread, while the
    operator keeps running: it copies the operator's containers, and accumulators are treated as
    immutable values (``add``/``merge`` return new values; the built-in ones do).
    Processing is deterministic for a given input sequence per channel and watermark sequence.
    With an ``on_error`` handler, ``process`` returns what it would return for the batch without
    the failing records, and the state is what those records alone would have made it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from operator import itemgetter
from typing import Any, TypeAlias

from processor.contracts import SinkContext
from processor.dataflow import Step
from processor.errors import DefinitionError, RecordsRejected

__all__ = [
    "Aggregate",
    "ErrorHandler",
    "Filter",
    "FlatMap",
    "KeyBy",
    "Map",
    "Operator",
    "Passthrough",
    "Record",
    "SinkOp",
]


Record = tuple[Any, Any, int]
#: No watermark yet (the smallest event time).
MIN_WATERMARK = -(2**63)
#: The watermark of a drained stream: every window fires.
MAX_WATERMARK = 2**63 - 1


#: ``handler(operator, batch, index, exc)``: ``batch[index]`` made a user function raise ``exc``.
ErrorHandler: TypeAlias = "Callable[[Operator, list[Record], int, Exception], None]"


class Operator:
    """Base: a stateless pass-through (``union``, a loop's ``iterate`` head).

    Attributes:
        keeps_index: output record ``i`` comes from input record ``i`` whenever no record of the
            batch failed (the task uses it to find where a failing record came from).
        on_error: the dead-letter handler, or ``None``: a failing user function raises.
    """

    stateful = False
    keeps_index = True
    on_error: ErrorHandler | None = None
    #: ``on_late(step, record, watermark, allowed_lateness_ms)``: a windowed aggregation's
    #: record all of whose windows closed (``late="dead_letters"``); ``None``: dropped
    on_late: Callable[[str, Record, int, int], None] | None = None
    duplicates = 0  # records dropped as duplicates (``dedup``)
    n_in = n_out = 0  # records in and out (the task counts them per batch; metrics)

    def __init__(self, step: Step) -> None:
        self.name = step.name
        self.children: list[Operator] = []
        self.late_dropped = 0

    def process(self, batch: list[Record]) -> list[Record]:
        return batch

    def input(self, parent: str) -> Operator:
        """Where the records of ``parent`` (a parent step) go: the operator itself, or one of
        a join's inputs (:mod:`processor.runtime.operators.joins`)."""
        return self

    def _guarded(
        self,
        batch: list[Record],
        fast: Callable[[list[Record]], list[Record]],
        one: Callable[[Record], list[Record]],
    ) -> list[Record]:
        """A stateless operator's batch: ``fast`` (one comprehension); if a user function raises
        and there is a handler, the batch again record by record with ``one``."""
        try:
            return fast(batch)
        except Exception:
            if self.on_error is None:
                raise
        return self._per_record(batch, one)

    def _each(self, batch: list[Record], apply: Callable[[Record], list[Record]]) -> list[Record]:
        """A stateful operator's batch, ``apply`` per record (which changes state only when it
        returns); a record that raises goes to the handler, and the batch resumes after it."""
        out: list[Record] = []
        i = 0
        try:
            for i, record in enumerate(batch):  # noqa: B007
                out += apply(record)
            return out
        except Exception as exc:
            # A DefinitionError found while running (``process`` registering timers without
            # ``on_timer``) is the pipeline's fault, not the record's: it fails the task.
            if self.on_error is None or isinstance(exc, DefinitionError):
                raise
            self.on_error(self, batch, i, exc)  # batch[:i] are applied: resume after i
        return out + self._per_record(batch, apply, i + 1)

    def _per_record(
        self, batch: list[Record], apply: Callable[[Record], list[Record]], start: int = 0
    ) -> list[Record]:
        """The slow path: ``apply`` each record from ``start`` on; a record whose ``apply``
        raises goes to the handler. ``apply`` must change state only when it returns."""
        handler = self.on_error
        assert handler is not None
        out: list[Record] = []
        for i in range(start, len(batch)):
            try:
                out += apply(batch[i])
            except DefinitionError:
                raise
            except Exception as exc:
                handler(self, batch, i, exc)
        return out

    def on_watermark(self, watermark: int) -> list[Record]:
        """Event time reached ``watermark``: what fires."""
        return []

    @property
    def event_time(self) -> bool:
        """What the operator does depends on the watermark (windows, timers, expiry, the IDs
        a ``dedup`` keeps): a drained watermark ends what it can take (docs/engine.md,
        "Bounded runs")."""
        return type(self).on_watermark is not Operator.on_watermark

    #: The operator has processing-time timers: the task calls :meth:`on_processing_time`.
    timed = False

    def on_processing_time(self, now_ms: int) -> list[Record]:
        """The task's clock reads ``now_ms`` (epoch ms): what fires. Called every task loop, so
        it must be cheap when nothing is due."""
        return []

    # Lifecycle, for operators with side effects outside the snapshot (``dedup``): the task
    # calls ``open`` once built, ``prepare`` at every barrier before ``snapshot``, ``commit``
    # when a checkpoint completed and ``close`` at the end, on every operator it built.

    def open(self, ctx: SinkContext) -> None:
        """Once, before ``restore`` and any record."""

    def prepare(self, checkpoint_id: int) -> Future[None] | None:
        """At the barrier of ``checkpoint_id``, before :meth:`snapshot`. A returned future is
        work that the snapshot relies on and that goes on behind (``dedup``'s write of its
        IDs): the task's snapshot upload waits for it, so the checkpoint is not acknowledged
        before it completes, and fails if it fails."""
        return None

    def commit(self, checkpoint_id: int) -> None:
        """``checkpoint_id`` completed."""

    def close(self) -> None:
        """The task stops."""

    def flush(self) -> list[Record]:
        """End of a poll batch, or a barrier or watermark is about to pass: emit buffered output."""
        return []

    def snapshot(self) -> Any:
        return None

    def restore(self, state: Any) -> None:
        """Loads what :meth:`snapshot` returned (``None``: a fresh start)."""


Passthrough = Operator


class Map(Operator):
    keeps_index = True

    def __init__(self, step: Step) -> None:
        super().__init__(step)
        self.fn: Callable[[Any], Any] = step.params["fn"]

    def process(self, batch: list[Record]) -> list[Record]:
        fn = self.fn
        return self._guarded(
            batch,
            lambda b: [(k, fn(v), t) for k, v, t in b],
            lambda r: [(r[0], fn(r[1]), r[2])],
        )


class Filter(Operator):
    keeps_index = False

    def __init__(self, step: Step) -> None:
        super().__init__(step)
        self.fn: Callable[[Any], bool] = step.params["fn"]

    def process(self, batch: list[Record]) -> list[Record]:
        fn = self.fn
        return self._guarded(
            batch, lambda b: [r for r in b if fn(r[1])], lambda r: [r] if fn(r[1]) else []
        )


class FlatMap(Operator):
    keeps_index = False

    def __init__(self, step: Step) -> None:
        super().__init__(step)
        self.fn: Callable[[Any], Any] = step.params["fn"]

    def process(self, batch: list[Record]) -> list[Record]:
        fn = self.fn
        # A generator may raise half-way: a record's outputs are collected before any is kept.
        return self._guarded(
            batch,
            lambda b: [(k, out, t) for k, v, t in b for out in fn(v)],
            lambda r: [(r[0], out, r[2]) for out in fn(r[1])],
        )


class KeyBy(Operator):
    keeps_index = True

    def __init__(self, step: Step) -> None:
        super().__init__(step)
        self.fn: Callable[[Any], Any] = step.params["fn"]

    def process(self, batch: list[Record]) -> list[Record]:
        fn = self.fn
        return self._guarded(
            batch,
            lambda b: [(fn(v), v, t) for _k, v, t in b],
            lambda r: [(fn(r[1]), r[1], r[2])],
        )


class Aggregate(Operator):
    """Unwindowed keyed aggregation: emits the running result after every record.

    With a ``ttl`` (event time), a key's state expires: a record at least ``ttl`` after the
    key's last record starts from ``init()``; the watermark deletes state that old (a scan of
    the keys, at most once per half ``ttl`` of watermark progress).
    """

    stateful = True
    keeps_index = True

    def __init__(self, step: Step) -> None:
        super().__init__(step)
        self.init: Callable[[], Any] = step.params["init"]
        self.add: Callable[[Any, Any], Any] = step.params["add"]
        self.state: dict[Any, Any] = {}
        self.ttl: int | None = step.params.get("ttl_ms")
        self.touched: dict[Any, int] = {}  # ttl: key -> its newest record's event time
        self.expired = 0  # ttl: states expired (restarted by a record, or deleted)
        self._swept = MIN_WATERMARK

    def process(self, batch: list[Record]) -> list[Record]:
        if self.ttl is not None:  # not the fast path: per record, with the expiry check
            return self._each(batch, self._apply)
        state, add, init = self.state, self.add, self.init
        get = state.get
        out: list[Record] = []
        append = out.append
        try:
            for k, v, t in batch:
                acc = get(k, _NONE)  # one lookup, not `in` and `[]`
                acc = add(init() if acc is _NONE else acc, v)
                state[k] = acc
                append((k, acc, t))
            return out
        except Exception as exc:
            if self.on_error is None:
                raise
            # One output per input so far: the failing record is batch[len(out)]; the ones
            # before it are applied and must not be applied again.
            failed = len(out)
            self.on_error(self, batch, failed, exc)
        return out + self._per_record(batch, self._apply, failed + 1)

    def _apply(self, record: Record) -> list[Record]:
        k, v, t = record
        state, ttl = self.state, self.ttl
        if ttl is None:
            acc = self.add(state[k] if k in state else self.init(), v)
            state[k] = acc
            return [(k, acc, t)]
        last = self.touched.get(k)  # None: new, or restored from a snapshot without ttl
        expired = k in state and last is not None and t - last >= ttl
        acc = self.add(state[k] if k in state and not expired else self.init(), v)
        state[k] = acc
        self.expired += expired
        self.touched[k] = t if expired or last is None or t > last else last
        return [(k, acc, t)]

    @property
    def event_time(self) -> bool:
        return self.ttl is not None

    def on_watermark(self, watermark: int) -> list[Record]:
        ttl = self.ttl
        if ttl is None or watermark - self._swept < ttl // 2 + 1:
            return []
        self._swept = watermark
        old = [k for k, last in self.touched.items() if last + ttl <= watermark]
        for k in old:
            del self.touched[k]
            self.state.pop(k, None)
        self.expired += len(old)
        return []

    def snapshot(self) -> Any:
        if self.ttl is None:
            return dict(self.state)
        # A list (not a dict) tells it from a snapshot taken without ttl.
        return [[k, acc, self.touched.get(k)] for k, acc in self.state.items()]

    def restore(self, state: Any) -> None:
        self.state, self.touched = {}, {}
        if isinstance(state, list):  # taken with ttl
            for k, acc, last in state:
                self.state[k] = acc
                if last is not None:
                    self.touched[k] = last
        elif state:
            self.state = dict(state)


_key, _value = itemgetter(0), itemgetter(1)
_NONE = object()  # Aggregate: a key without state (any value, None too, can be a state)


class SinkOp(Operator):
    """Hands values to a :class:`~processor.contracts.SinkWriter` (keyed: ``(key, value)``)."""

    keeps_index = False

    def __init__(self, step: Step, writer: Any, *, keyed: bool) -> None:
        super().__init__(step)
        self.writer = writer
        self.keyed = keyed
        self.written = 0

    def process(self, batch: list[Record]) -> list[Record]:
        if batch:
            try:
                if self.keyed:
                    write_keyed = getattr(self.writer, "write_keyed", None)
                    if write_keyed is not None:  # without building (key, value) pairs
                        write_keyed(list(map(_key, batch)), list(map(_value, batch)))
                    else:
                        self.writer.write([(k, v) for k, v, _t in batch])
                else:
                    self.writer.write([v for _k, v, _t in batch])
            except RecordsRejected as rejected:
                # The writer wrote the rest of the batch; the misfits are dead letters.
                if self.on_error is None:
                    raise
                for index, cause in rejected.failures:
                    self.on_error(self, batch, index, cause)
                self.written -= len(rejected.failures)
            self.written += len(batch)
        return []
