"""What the tasks of one worker share, and the operator that writes to an output channel."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import orjson

from processor.compiler import Edge, Plan
from processor.contracts import Reader, Writer
from processor.runtime.operators import Operator, Record
from processor.snapshot.store import SnapshotStore
from processor.wire import (
    Barrier,
    GenerationStart,
    Watermark,
    channel_partition,
    encode_control,
    key_to_downstream,
)

__all__ = ["ChannelOut", "TaskEnv"]

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
        clock: Callable[[], float] = time.monotonic,
        checkpoint_interval: float | None = None,
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
        self.clock = clock
        self.checkpoint_interval = checkpoint_interval


class ChannelOut(Operator):
    """Writes records to an output channel: key-routed (shuffle) or to ``u -> u`` (forward)."""

    def __init__(self, edge: Edge, subtask: int, parallelism: int, writer: Writer) -> None:
        self.name = f"->{edge.topic}"
        self.children = []
        self.late_dropped = 0
        self.topic = edge.topic
        self.writer = writer
        self.parallelism = parallelism
        base = subtask * parallelism
        self.partitions = (
            [base + d for d in range(parallelism)]
            if edge.shuffle
            else [channel_partition(subtask, subtask, parallelism)]
        )
        self.shuffle = edge.shuffle
        self.written = 0

    def process(self, batch: list[Record]) -> list[Record]:
        write, topic, dumps = self.writer.write, self.topic, orjson.dumps
        if self.shuffle:
            base, n = self.partitions[0], self.parallelism
            for k, v, t in batch:
                kb = k.encode() if type(k) is str else dumps(k)
                write(topic, base + key_to_downstream(kb, n), dumps((k, v, t)))
        else:
            (partition,) = self.partitions
            for r in batch:
                write(topic, partition, dumps(r))
        self.written += len(batch)
        return []

    def control(self, ctl: Barrier | Watermark | GenerationStart) -> None:
        value, headers = encode_control(ctl)
        for p in self.partitions:
            self.writer.write(self.topic, p, value, headers=headers)
