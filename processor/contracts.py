"""Contracts the engine defines and the other packages implement.

``processor`` never imports ``connectors``, ``sinks`` or ``dedup`` (except the CLI wiring); they
import these protocols from here. The engine calls them; it does not know which Kafka client,
file system or database is behind them.

The context of a keyed process function (:class:`ProcessContext`, with :class:`KeyState` and
:class:`Timers`) is here too: the public API (``KeyedStream.process``) names it, and the runtime
(:mod:`processor.runtime.operators.process`) implements it; the API imports nothing of the runtime.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "JobClaim",
    "KeyState",
    "Message",
    "ProcessContext",
    "Reader",
    "Serde",
    "Sink",
    "SinkContext",
    "SinkWriter",
    "Timers",
    "Transport",
    "Writer",
    "preflight_sink",
]

TP = tuple[str, int]


@runtime_checkable
class Serde(Protocol):
    """Encodes values to record bytes and decodes them back.

    Attributes:
        name: short label used in error messages and dead-letter headers (e.g. ``json``).

    Invariants:
        ``deserialize(serialize(x)) == x`` for every value ``x`` the serde accepts.
        ``serialize`` raises only ``SerializationError``; ``deserialize`` of any ``bytes``
        raises only ``DeserializationError``, with ``topic``, ``partition`` and ``offset``
        copied from its arguments. Serdes hold no per-record state and are thread-safe.

    Optional batch methods (the engine's fast path uses them when a serde has them):
    ``deserialize_many(datas) -> list`` and ``serialize_many(values) -> list[bytes]``, equal to
    the per-record methods applied to each item, all or nothing: on any bad item they may raise
    any exception, and the engine then takes the per-record methods for that batch (which name
    the bad record). One call per batch instead of one Python call per record.
    """

    name: str

    def serialize(self, value: Any) -> bytes:
        """Encode ``value``; raise ``SerializationError`` if it cannot be encoded."""

    def deserialize(
        self,
        data: bytes,
        *,
        topic: str | None = None,
        partition: int | None = None,
        offset: int | None = None,
    ) -> Any:
        """Decode ``data``; raise ``DeserializationError`` (with the location) if malformed."""


@dataclass(frozen=True)
class SinkContext:
    """Where a sink writer runs.

    Attributes:
        job: the job name (unique per deployment; output names derive from it).
        step: the sink step's name.
        subtask: this writer's subtask index, ``0 <= subtask < parallelism``.
        parallelism: how many writers the sink step has.
        generation: this writer's incarnation: the job's generation (one more after every
            global recovery), or a newer number when its worker restarted alone (local
            recovery). No two starts of one subtask's writer share it.
        checkpoint_interval: seconds between checkpoints (``None``: checkpointing off), which
            bounds how long an epoch's output stays uncommitted.
        snapshot_url: the job's snapshot store (fsspec URL), a durable place every worker of
            the job can reach; sinks may stage output under it.
        fault: crash-test hook; a sink calls ``fault("mid-sink-recover")`` half-way through
            ``recover`` and ``fault("mid-sink-commit")`` inside ``commit`` once the output is
            visible but before its own bookkeeping is done, so tests can kill it there (a
            no-op outside tests).
        epoch: the job's shape epoch: 0 until its parallelism first changes, one more at each
            change (:mod:`processor.runtime.shape.rescale`). State a writer keys by ``subtask``
            outside the snapshot (a dedup step's IDs in Redis) must also be keyed by the epoch,
            since subtask ``i`` of a new shape is not subtask ``i`` of the old one.
    """

    job: str
    step: str
    subtask: int
    parallelism: int
    generation: int
    checkpoint_interval: float | None = None
    snapshot_url: str | None = None
    fault: Callable[[str], None] = field(default=lambda point: None, repr=False, compare=False)
    epoch: int = 0


@runtime_checkable
class SinkWriter(Protocol):
    """One subtask's writer of a two-phase-commit sink (docs/sinks.md, "The two-phase contract").

    The engine calls, for every epoch (the records between two barriers): ``write`` any number of
    times, then ``prepare(checkpoint_id)`` when the barrier passes. The returned committable goes
    into the task's snapshot. When checkpoint ``n`` completes, the engine calls ``commit`` for
    every pending committable of a checkpoint ``<= n``, in checkpoint order. After a restart it
    calls ``recover`` with the committables held by the restored snapshot.

    Invariants:
        Nothing written is visible to readers of the output before ``commit``.
        ``commit`` and ``recover`` are idempotent: calling them again with the same arguments
        (after a crash at any point) neither loses nor duplicates output.
        ``recover`` also discards everything written after the restored checkpoint (orphans of
        epochs that never completed): that output will be written again.
        A committable is a small value the snapshot codec accepts (``None``, ``bool``, ``int``,
        ``float``, ``str``, ``bytes``, lists, tuples, dicts, sets).
    """

    def write(self, values: Sequence[Any]) -> None:
        """Buffer or stage ``values`` for the current epoch.

        A writer may also have ``write_keyed(keys, values)``, equal to
        ``write(list(zip(keys, values)))`` (a keyed stream hands ``(key, value)`` pairs): the
        engine calls it for keyed streams when it exists, without building the pairs."""

    def prepare(self, checkpoint_id: int) -> Any:
        """Make the epoch's output durable but invisible; return its committable (or ``None``
        when the epoch wrote nothing)."""

    def commit(self, checkpoint_id: int, committable: Any) -> None:
        """Make the output of the prepared epoch visible. Idempotent."""

    def recover(self, pending: Sequence[tuple[int, Any]]) -> None:
        """After a restart: commit ``pending`` (checkpoint id, committable) and discard orphans."""

    def close(self) -> None:
        """Release files and connections (uncommitted output stays for ``recover``)."""


@runtime_checkable
class Sink(Protocol):
    """A sink definition, given to ``Stream.sink``; every worker opens its own writers from it.

    Sink objects are built in the pipeline file, which every worker process imports, so they
    hold configuration only (no open files or connections) until ``open``.
    """

    def open(self, ctx: SinkContext) -> SinkWriter:
        """A writer for subtask ``ctx.subtask``."""


def preflight_sink(
    sink: Any,
    *,
    job: str,
    checkpoint_interval: float | None,
    checkpoint_timeout: float | None = None,
) -> None:
    """Run a sink's optional start-up check, ``sink.preflight(job=, checkpoint_interval=,
    checkpoint_timeout=)`` (a sink whose ``preflight`` takes no ``checkpoint_timeout`` is
    called without it).

    Runners call it once before they start workers, so a misconfigured sink (a transaction
    timeout shorter than a checkpoint may take, a database without prepared transactions)
    fails the job at start-up with the sink's ``ConfigError`` instead of in a restart loop.
    """
    check = getattr(sink, "preflight", None)
    if check is None:
        return
    params = inspect.signature(check).parameters
    takes_timeout = "checkpoint_timeout" in params or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
    )
    if takes_timeout:
        check(
            job=job,
            checkpoint_interval=checkpoint_interval,
            checkpoint_timeout=checkpoint_timeout,
        )
    else:
        check(job=job, checkpoint_interval=checkpoint_interval)


class Message(Protocol):
    """A record read from Kafka (confluent-kafka's ``Message`` has this shape).

    ``topic``, ``partition`` and ``offset`` are typed ``Any`` because the client types them
    optional (they are never ``None`` on a record a reader delivers).
    """

    def topic(self) -> Any: ...
    def partition(self) -> Any: ...
    def offset(self) -> Any: ...
    def key(self) -> bytes | None: ...
    def value(self) -> bytes | None: ...
    def headers(self) -> list[tuple[str, bytes | None]] | None: ...
    def timestamp(self) -> tuple[int, int]: ...


class Reader(Protocol):
    """Reads explicitly assigned partitions in batches (``connectors.PartitionReader``).

    Invariants:
        Records of one partition are delivered in offset order, none skipped or repeated,
        starting at the position given to ``open`` or ``seek``.
    """

    def open(
        self,
        positions: Mapping[TP, int | None],
        *,
        start: str = "earliest",
        stop_at: Mapping[TP, int] | None = None,
    ) -> None:
        """``stop_at``: a bounded run's end offsets, never read past (see the reader)."""

    def poll(self, max_records: int = 10_000, timeout: float = 0.1) -> list[Any]:
        """Up to ``max_records`` records (:class:`Message`), data and control alike."""

    def pause(self, tps: Iterable[TP]) -> None: ...
    def resume(self, tps: Iterable[TP]) -> None: ...
    @property
    def paused(self) -> frozenset[TP]:
        """The partitions paused (barrier alignment, a bounded run's stop, watermark
        alignment)."""
        ...

    def positions(self) -> dict[TP, int]: ...
    def cached_lag(self) -> dict[TP, int]:
        """Records left per partition as the last fetches saw them (metrics; no request)."""

    def close(self) -> None: ...


class Writer(Protocol):
    """Writes records to explicit partitions with an idempotent producer.

    Invariants:
        Records written to one partition by one writer land in that order, each exactly once
        (idempotence), or ``flush`` raises.
        No gap: once a record failed, no later record of its partition reaches the log (a
        control record written after it is refused, and ``poll`` raises the failure).

    A writer may also define ``write_many(topic, [(partition, value), ...], key)``: the data
    records of a batch, all with one key, in one call, same guarantees (channels use it when
    it is there).
    """

    def write(
        self,
        topic: str,
        partition: int,
        value: bytes,
        *,
        key: bytes | None = None,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> None: ...

    def poll(self) -> None:
        """Serve delivery reports without blocking; raise a delivery failure."""

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until everything written is acknowledged; raise on a delivery failure."""

    def close(self) -> None: ...


@runtime_checkable
class Transport(Protocol):
    """What the runtime needs from Kafka (``connectors.transport.KafkaTransport``)."""

    def check_reachable(self, timeout: float = 5.0) -> None:
        """Raise ``ConfigError`` naming the address when the cluster does not answer."""

    def ensure_topics(self, partitions: Mapping[str, int]) -> None:
        """Create missing channel topics with these partition counts and a retention that
        never deletes records (an existing topic's retention is changed to it, or refused
        with a ``ConfigError`` naming the setting); refuse a mismatching count."""

    def partition_count(self, topic: str) -> int:
        """Partitions of an existing topic; raise ``ConfigError`` if it does not exist."""

    def end_offsets(self, tps: Iterable[TP]) -> dict[TP, int]:
        """Current end offsets: the high watermarks (:mod:`connectors.offsets`)."""

    def reader(self, *, group_id: str, deleted: str = "fail") -> Reader:
        """A reader; ``deleted``: what it does when retention deleted records it must read
        (``fail``: :class:`~processor.errors.DataLossError`; ``skip``: counted and logged)."""

    def writer(self, *, client_id: str) -> Writer: ...

    def purge_supported(self) -> bool:
        """Whether the broker deletes records on request (probed, never guessed by a timeout)."""

    def purge(self, before: Mapping[TP, int]) -> Mapping[TP, Future[object]]:
        """Delete each channel partition's records below its offset; returns without waiting,
        one future per partition."""


class JobClaim(Protocol):
    """A job's identity in the broker (``connectors.claim.KafkaJobClaim``; a transport offers
    one as ``transport.job_claim(job)``): who runs the job, and where its sources are.

    Attributes:
        group: the job's consumer group, which holds the sources' checkpointed offsets.
        transactional_id: the runner's transactional id; initializing it fences every earlier
            runner of the job, wherever it runs.

    Invariants:
        After :meth:`open` returned, every :meth:`commit` of an earlier opener of the same job
        fails with :class:`~processor.errors.JobFencedError`, and so does this one's once a
        later opener opened. A commit that returned proves the committer held the job after
        its offsets were in the group: a later opener that reads :meth:`committed` after its
        :meth:`open` sees them (``connectors.claim``, "The order of a commit").
    """

    group: str
    transactional_id: str

    def committed(self) -> dict[TP, int]:
        """The offsets the job's group holds, every topic (empty: none, or no group)."""

    def open(self) -> None:
        """Take the job: initialize the transactional id (fencing earlier runners)."""

    def commit(self, offsets: Mapping[TP, int], claim: Mapping[str, Any]) -> None:
        """``offsets`` into the group, then the claim record (who, which checkpoint) in a
        transaction of the runner's transactional id. Raises ``JobFencedError`` when another
        runner took the job, else ``KafkaClientError`` (committing again may succeed)."""

    def last(self) -> dict[str, Any] | None:
        """The newest committed claim record (who held the job, at which checkpoint, the
        highest generation any runner of the job used), or None. After :meth:`open`, every
        earlier opener's commit is in it or failed."""

    def forget(self) -> None:
        """Delete the job's group and its offsets (a start over, a reset)."""

    def close(self) -> None: ...


# -- the context of a keyed process function (KeyedStream.process) -------------------------------


class KeyState(Protocol):
    """``ctx.state``: the current key's state value (JSON-like; ``None`` when it has none).

    Reads see the call's own writes. Values go into snapshots: keep them JSON-like. ``get``
    returns the stored value itself (no copy): change a dict or list in place only if the call
    then returns normally (a raise after an in-place change cannot undo it), or ``set`` a new one.
    """

    def get(self, default: Any = None) -> Any:
        """The key's state value, or ``default`` if it has none."""

    def set(self, value: Any) -> None:
        """Replace the key's state value (``None`` is a value; :meth:`delete` removes it)."""

    def delete(self) -> None:
        """Remove the key's state (it leaves the snapshots)."""


class Timers(Protocol):
    """``ctx.timers``: the current key's timers. Times are epoch milliseconds (``int``).

    An event-time timer fires when the watermark reaches its time (one registered at or behind
    the watermark fires at the next watermark); a processing-time timer when the task's clock
    does (checked every loop of the task, so within a few tens of milliseconds when the worker is
    not busy). Registering a timer that exists keeps one; deleting one that does not exist does
    nothing.
    """

    def register_event_time(self, ts_ms: int) -> None: ...

    def delete_event_time(self, ts_ms: int) -> None: ...

    def register_processing_time(self, ts_ms: int) -> None: ...

    def delete_processing_time(self, ts_ms: int) -> None: ...


class ProcessContext(Protocol):
    """What ``fn(ctx, value)`` and ``on_timer(ctx, timer_ms, kind)`` see; valid during the call.

    Attributes:
        key: the record's (or the timer's) key.
        timestamp_ms: the record's event time, or the timer's time.
        watermark_ms: the operator's current event-time watermark (``-2**63`` before the first).
        processing_time_ms: the task's clock, epoch milliseconds (for processing-time timers).
        state: the key's state (:class:`KeyState`).
        timers: the key's timers (:class:`Timers`).
    """

    @property
    def key(self) -> Any: ...

    @property
    def timestamp_ms(self) -> int: ...

    @property
    def watermark_ms(self) -> int: ...

    @property
    def processing_time_ms(self) -> int: ...

    @property
    def state(self) -> KeyState: ...

    @property
    def timers(self) -> Timers: ...

    def emit(self, value: Any) -> None:
        """Send ``value`` downstream under the current key, at :attr:`timestamp_ms`."""
