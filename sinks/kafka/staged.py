"""The Kafka sink's staged mode (no broker transactions needed): an epoch is published after
its checkpoint completes.

An epoch's records are staged in the job's snapshot store at ``prepare`` and published with
the idempotent producer only after the checkpoint completes. A crash while publishing makes
recovery publish the epoch again, so a partition can hold an epoch's records twice, with the
same :data:`HEADER_ID` and in the same order: :class:`dedup.staged.StagedDeduplicator` drops
the repeats for readers (``read_committed`` not required). Partitions are computed at write
time (Kafka's murmur2 for keyed records, round-robin otherwise) so a re-published record
lands where the first copy did.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from typing import Any

from confluent_kafka import KafkaError, Producer

from connectors.admin import TopicAdmin
from connectors.config import create_producer, producer_config
from connectors.transport import produce_waiting
from processor.contracts import SinkContext
from processor.errors import KafkaClientError
from processor.snapshot.localfs import LocalFiles, open_fs
from sinks.files.directory import _fsync_dir
from sinks.kafka.records import (
    HEADER_ID,
    HEADER_SINK,
    Headers,
    KafkaSinkConfig,
    _Encoder,
    murmur2_partition,
)

__all__ = ["StagedKafkaSinkWriter"]


class StagedKafkaSinkWriter:
    """Staged mode: records staged at ``prepare``, published with the idempotent producer on
    ``commit``; readers drop re-published repeats by :data:`HEADER_ID`.

    Invariants:
        The staged file of an epoch holds (partition, key, value, id) in write order and is
        durable before ``prepare`` returns; publishing it again yields the same records in the
        same partitions in the same order.
        ``commit`` deletes the staged file only after every record was acknowledged, so a crash
        before that publishes the epoch again (duplicates carry the same ID).
    """

    def __init__(self, sink: KafkaSinkConfig, ctx: SinkContext) -> None:
        self.sink = sink
        self.ctx = ctx
        self.settings = sink.resolved_settings()
        self.encode = _Encoder(sink)
        self.partitions = len(TopicAdmin(self.settings).partitions(sink.topic))
        base = ctx.snapshot_url or f"file://{os.path.abspath('.eosflow-staging')}"
        self.dir = f"{base.rstrip('/')}/{ctx.job}/staging/{ctx.step}/{ctx.subtask:05d}"
        self.fs, self.path = open_fs(self.dir)
        self.fs.makedirs(self.path, exist_ok=True)
        self.buffer: list[tuple[int, bytes | None, bytes]] = []
        self.n = 0
        self.rr = ctx.subtask
        self.producer: Producer | None = None
        self.errors: list[KafkaError] = []
        self.published = 0

    def write(self, values: Sequence[Any]) -> None:
        n, buf = self.partitions, self.buffer
        for key, value in self.encode.all(values):
            if key is None:
                self.rr += 1
                partition = self.rr % n
            else:
                partition = murmur2_partition(key, n)
            buf.append((partition, key, value))

    def prepare(self, checkpoint_id: int) -> Any:
        if not self.buffer:
            return None
        tag = f"{self.ctx.generation}.{self.n}"
        self.n += 1
        name = f"{self.path}/{tag}.staged"
        frames = bytearray()
        pack = struct.pack
        for partition, key, value in self.buffer:
            klen = 0xFFFFFFFF if key is None else len(key)
            frames += pack("<III", partition, klen, len(value))
            if key is not None:
                frames += key
            frames += value
        with self.fs.open(name + ".tmp", "wb") as f:
            f.write(bytes(frames))
            _fsync(f)
        self.fs.mv(name + ".tmp", name)
        if isinstance(self.fs, LocalFiles):
            # The rename must survive a power cut: commit reads a missing file as published.
            _fsync_dir(self.path)
        count = len(self.buffer)
        self.buffer = []
        return {"file": name, "epoch": tag, "count": count}

    def _load(self, name: str) -> list[tuple[int, bytes | None, bytes]]:
        data = self.fs.cat_file(name)
        out = []
        pos, unpack = 0, struct.unpack_from
        while pos < len(data):
            partition, klen, vlen = unpack("<III", data, pos)
            pos += 12
            key = None
            if klen != 0xFFFFFFFF:
                key = bytes(data[pos : pos + klen])
                pos += klen
            out.append((partition, key, bytes(data[pos : pos + vlen])))
            pos += vlen
        return out

    def _delivered(self, err: KafkaError | None, _msg: Any) -> None:
        if err is not None:
            self.errors.append(err)

    def commit(self, checkpoint_id: int, committable: Any) -> None:
        name, tag = committable["file"], str(committable["epoch"])
        if not self.fs.exists(name):
            return  # published and cleaned up before
        if self.producer is None:
            self.producer = create_producer(
                producer_config(self.settings, overrides=self.sink.producer_config)
            )
        producer, topic = self.producer, self.sink.topic
        sink_header = (HEADER_SINK, f"{self.ctx.job}/{self.ctx.step}".encode())
        id_prefix = f"{self.ctx.subtask}.{tag}."
        self.errors = []
        for seq, (partition, key, value) in enumerate(self._load(name)):
            headers: Headers = [sink_header, (HEADER_ID, f"{id_prefix}{seq}".encode())]
            produce_waiting(
                producer, topic, value, key, partition=partition, headers=headers,
                on_delivery=self._delivered,
            )  # fmt: skip
        left = producer.flush(60)
        if left or self.errors:
            detail = self.errors[0].str() if self.errors else f"{left} undelivered"
            raise KafkaClientError(
                f"staged sink {self.ctx.step}[{self.ctx.subtask}]: publishing epoch {tag} "
                f"failed: {detail}",
                retriable=True,
            )
        self.published += int(committable["count"])
        self.ctx.fault("mid-sink-commit")  # published, not yet cleaned up: recovery repeats it
        self.fs.rm(name)

    def recover(self, pending: Sequence[tuple[int, Any]]) -> None:
        keep = set()
        for i, (chk, committable) in enumerate(pending):
            self.commit(chk, committable)
            keep.add(committable["file"])
            if i == 0:
                self.ctx.fault("mid-sink-recover")
        for name in self.fs.ls(self.path, detail=False):
            if name not in keep and name.endswith((".staged", ".tmp")):
                self.fs.rm(name)  # staged by an epoch that never completed

    def close(self) -> None:
        if self.producer is not None:
            self.producer.flush(10)


def _fsync(f: Any) -> None:
    try:
        f.flush()
        os.fsync(f.fileno())
    except (AttributeError, OSError, ValueError):
        pass  # not a local file: the file system's own durability applies
