"""What the tasks of one worker share, and the operator that writes to an output channel."""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from itertools import repeat
from typing import Any

import orjson

from dedup.ids import derived_id
from processor.compiler import Edge, Plan
from processor.contracts import Reader, Writer
from processor.runtime.job import DEFAULT_MAX_IDS
from processor.runtime.operators.core import Operator, Record
from processor.runtime.operators.process import wall_clock_ms
from processor.snapshot.store import SnapshotStore
from processor.wire import (
    Barrier,
    GenerationStart,
    Watermark,
    channel_key,
    channel_partition,
    encode_bundles,
    encode_control,
    route_table,
)

__all__ = ["ChannelOut", "Lineage", "Loop", "TaskEnv"]

TP = tuple[str, int]


class TaskEnv:
    """What the tasks of one worker share."""

    def __init__(
        self,
        *,
        plan: Plan,
        generation: int,
        mode: str,
        writer: Writer,
        reader_factory: Callable[[str], Reader],
        store: SnapshotStore,
        uploads: ThreadPoolExecutor,
        fault: Callable[[str], None],
        end_offsets: dict[TP, int] | None,
        start_positions: dict[TP, int] | None = None,
        clock: Callable[[], float] = time.monotonic,
        checkpoint_interval: float | None = None,
        recovery: str = "global",
        recovery_max_ids: int = DEFAULT_MAX_IDS,
        stale_through: int = 0,
        sink_generation: int | None = None,
        now_ms: Callable[[], int] | None = None,
        map_state: dict[str, str] | None = None,
        drain: bool = True,
        watermark_drift_ms: int | None = None,
    ) -> None:
        self.plan = plan
        self.generation = generation
        self.mode = mode  # aligned | unaligned | sync
        self.writer = writer
        self.reader_factory = reader_factory
        self.store = store
        self.uploads = uploads
        self.fault = fault
        self.end_offsets = end_offsets
        # Where a start without a checkpoint reads from, fixed at the job's first start:
        # "latest" sources and every channel (whose earlier records belong to older runs).
        self.start_positions = start_positions or {}
        self.clock = clock
        self.checkpoint_interval = checkpoint_interval
        self.recovery = recovery  # global | local (docs/local-recovery.md)
        # Local recovery: IDs one task's replay check may hold (processor.runtime.operators.replay)
        self.recovery_max_ids = recovery_max_ids
        # Local recovery: checkpoints up to this id were triggered before this worker restarted
        # (aborted or completed); their barriers and triggers are stale here.
        self.stale_through = stale_through
        # What sink writers see as their generation: unique per start of this worker. It is
        # also this worker's incarnation, the key of every channel record it writes
        # (processor.wire, "Fencing").
        self.sink_generation = generation if sink_generation is None else sink_generation
        # Processing time (epoch ms) for processing-time timers (``process`` steps).
        self.now_ms = now_ms or wall_clock_ms
        # ``--map-state OLD=NEW``: NEW restores the snapshot state of OLD
        # (runtime.operators.state_map).
        self.map_state = map_state or {}
        # A bounded run's sources at their end: emit the maximum watermark (``--no-drain``: no).
        self.drain = drain
        # ``--watermark-alignment``: the largest lead of a source partition's watermark over
        # the slowest one's (event time, ms); ``None``: sources read without alignment.
        self.watermark_drift_ms = watermark_drift_ms


class Lineage:
    """Local recovery: the ID of the record being pushed through a task's operators.

    The task pushes one input record at a time and sets :attr:`parent` to its ID (and bumps
    :attr:`seq`) before each push; a :class:`ChannelOut` names its ``n``-th output for that
    parent ``derived_id(parent, edge tag + n)``. So a record's ID depends only on its ancestry,
    never on how the task interleaved its input channels, and a restarted worker re-emits
    exactly the IDs it emitted before (downstream tasks drop those copies).
    """

    __slots__ = ("parent", "seq")

    def __init__(self) -> None:
        self.parent = 0
        self.seq = 0

    def set(self, parent: int) -> None:
        self.parent = parent
        self.seq += 1


class Loop:
    """A task in a loop: the iteration count of the records being pushed (how many times they
    went around the loop's back-edge). The task sets it before each push; a loop channel writes
    it with every record; the loop head adds one to what it reads from the back-edge."""

    __slots__ = ("iteration",)

    def __init__(self) -> None:
        self.iteration = 0


class ChannelOut(Operator):
    """Writes records to an output channel: key-routed (shuffle) or to ``u -> u`` (forward).

    Every record, data and control, is keyed with ``incarnation``'s :func:`channel_key`, so
    that readers can drop what a zombie of an older incarnation writes after a newer one
    announced itself (:mod:`processor.wire`, "Fencing")."""

    def __init__(
        self,
        edge: Edge,
        subtask: int,
        parallelism: int,
        writer: Writer,
        *,
        lineage: Lineage | None = None,
        tag: int = 0,
        loop: Loop | None = None,
        key_groups: int = 128,
        incarnation: int = 0,
    ) -> None:
        self.name = f"->{edge.topic}"
        self.key = channel_key(incarnation)
        self.children = []
        self.late_dropped = 0
        self.topic = edge.topic
        self.writer = writer
        self.parallelism = parallelism
        #: key group -> downstream subtask (processor.wire.route_table)
        self.route = route_table(parallelism, key_groups)
        self.key_groups = key_groups
        self.partitions = (
            [channel_partition(subtask, d, parallelism) for d in range(parallelism)]
            if edge.shuffle
            else [channel_partition(subtask, subtask, parallelism)]
        )
        self.shuffle = edge.shuffle
        self.written = 0
        # Local recovery: records carry their ID as a 4th element (hex: JSON has no 127-bit
        # ints); ``tag`` (the edge's index in the task, shifted) keeps two edges' IDs apart.
        self.lineage = lineage
        self.tag = tag << 32
        self._seq = -1
        self._n = 0
        # A channel inside a loop (edge.loop): records carry their iteration as a 4th element.
        self.loop = loop if edge.loop else None
        many = getattr(writer, "write_many", None)  # optional in the Writer protocol
        self.write_many: Callable[[str, list[tuple[int, bytes]], bytes], None] = (
            many if many is not None else self._write_each
        )

    def _write_each(self, topic: str, records: list[tuple[int, bytes]], key: bytes) -> None:
        write = self.writer.write
        for partition, value in records:
            write(topic, partition, value, key=key)

    def process(self, batch: list[Record]) -> list[Record]:
        if self.lineage is not None:
            return self._write_tagged(batch, self._ids(len(batch)))
        if self.loop is not None:
            return self._write_tagged(batch, repeat(self.loop.iteration))
        topic, dumps = self.topic, orjson.dumps
        if self.shuffle:  # each destination's records in order, bundled (processor.wire)
            base, route, G, crc = self.partitions[0], self.route, self.key_groups, zlib.crc32
            parts = [
                base + route[crc(r[0].encode() if type(r[0]) is str else dumps(r[0])) % G]
                for r in batch
            ]
            groups: dict[int, list[Record]] = {p: [] for p in set(parts)}
            for p, r in zip(parts, batch, strict=True):
                groups[p].append(r)
            records = [(p, v) for p, rs in groups.items() for v in encode_bundles(rs)]
        else:
            (partition,) = self.partitions
            records = [(partition, v) for v in encode_bundles(batch)]
        self.write_many(topic, records, self.key)
        self.written += len(batch)
        return []

    def _ids(self, count: int) -> list[str]:
        """Local recovery: the IDs of the next ``count`` outputs for the record being pushed."""
        lineage = self.lineage
        assert lineage is not None
        if lineage.seq != self._seq:
            self._seq, self._n = lineage.seq, 0
        parent, first = lineage.parent, self.tag + self._n
        self._n += count
        return [f"{derived_id(parent, first + i):x}" for i in range(count)]

    def _write_tagged(self, batch: list[Record], tags: Iterable[Any]) -> list[Record]:
        """Writes ``[key, value, ts, tag]`` records: a record ID (local recovery) or an
        iteration count (a channel inside a loop)."""
        dumps = orjson.dumps
        base = self.partitions[0]
        if self.shuffle:
            route, G, crc = self.route, self.key_groups, zlib.crc32
            records = [
                (
                    base + route[crc(k.encode() if type(k) is str else dumps(k)) % G],
                    dumps((k, v, t, tag)),
                )
                for (k, v, t), tag in zip(batch, tags, strict=False)
            ]
        else:
            records = [
                (base, dumps((k, v, t, tag))) for (k, v, t), tag in zip(batch, tags, strict=False)
            ]
        self.write_many(self.topic, records, self.key)
        self.written += len(batch)
        return []

    def control(self, ctl: Barrier | Watermark | GenerationStart) -> None:
        value, headers = encode_control(ctl)
        for p in self.partitions:
            self.writer.write(self.topic, p, value, key=self.key, headers=headers)
