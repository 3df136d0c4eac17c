"""The Kafka sink's transactional mode (docs/sinks.md, "Kafka, transactional
(``sinks.KafkaSink``)"): an epoch is committed on checkpoint completion.

Each sink subtask owns a small pool of stable ``transactional.id``\\ s,
``<prefix>-<step>-<subtask>-<slot>``. An epoch's records go into one transaction on a free
slot, each with two headers: :data:`HEADER_SINK` and :data:`HEADER_ID`, which names the sink
subtask, the epoch and the record's place in it (two headers, not four: headers are the
largest per-record cost of producing from Python, see bench/RESULTS.md); with
``record_ids=False`` (the default) no header, and the epoch's offsets instead, learnt from the
delivery reports of each partition's first and last record of a write
(:meth:`KafkaSinkWriter._group_done`). ``prepare`` writes
a *marker* record for the epoch into the same transaction (topic
``eosflow.<job>.<step>.txn-markers``, partition = subtask modulo its partition count),
flushes, and returns the committable: the transactional id, the subtask, the epoch tag, the
record count, the offset
range the transaction wrote in every partition and the marker's offset. ``commit`` commits
the transaction. While it is prepared, the next epoch writes on another slot.

Recovery closes the window librdkafka leaves open (it cannot resume a transaction after a
restart; ``init_transactions`` aborts it): for each pending committable, the marker tells
whether the epoch committed; if it did not, the recorded ranges are re-read and the epoch is
re-published in a new transaction with a new marker (:mod:`sinks.kafka.rescue` decides and
reads; :meth:`KafkaSinkWriter._rescue` re-publishes). A transaction the broker aborted on
timeout (commit fails) goes the same way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import orjson
from confluent_kafka import KafkaError, KafkaException, Producer

from connectors.admin import INTERNAL_TOPIC_CONFIG, TopicAdmin
from connectors.config import KafkaSettings, connect_producer, create_producer, producer_config
from connectors.errors import classify, retrying
from connectors.transport import produce_waiting
from processor.contracts import SinkContext
from processor.errors import EosflowError, KafkaClientError
from sinks.kafka.records import (
    _MAX_SLOTS,
    HEADER_EPOCH,
    HEADER_ID,
    HEADER_SINK,
    HEADER_SUBTASK,
    Headers,
    KafkaSinkConfig,
    KeyPartitioner,
    _Encoder,
    marker_topic,
    record_digest,
    transactional_id,
)
from sinks.kafka.rescue import epoch_committed, read_epoch

__all__ = ["KafkaSinkWriter", "committable_subtask"]

log = logging.getLogger(__name__)

#: How often a writer reads its output topic's partition count again (seconds).
_PARTITIONS_S = 60.0
#: A write's keys, values and partitions.
_Call = tuple[Sequence[Any], Sequence[bytes], Sequence[int]]
_DONE: _Call = ((), (), ())


class _Group:
    """The records of one write to one partition (``count`` of them), until the delivery
    reports of the first and the last (the only ones it asks for) give their offsets;
    ``call``: the write's keys, values and partitions (kept for :meth:`KafkaSinkWriter.
    _group_done`'s digests until then)."""

    __slots__ = ("call", "count", "edges", "first", "last", "tp", "writer")

    def __init__(
        self, writer: KafkaSinkWriter, tp: tuple[str, int], count: int, call: _Call
    ) -> None:
        self.writer, self.tp, self.count, self.call = writer, tp, count, call
        self.first = self.last = -1
        self.edges = 0  # delivered edges: 2 when done

    def head(self, err: KafkaError | None, msg: Any) -> None:
        self._report(err, msg, head=True, tail=False)

    def tail(self, err: KafkaError | None, msg: Any) -> None:
        self._report(err, msg, head=False, tail=True)

    def both(self, err: KafkaError | None, msg: Any) -> None:
        self._report(err, msg, head=True, tail=True)

    def _report(self, err: KafkaError | None, msg: Any, *, head: bool, tail: bool) -> None:
        if err is not None:
            self.writer.errors.append(err)
            return
        offset = msg.offset()
        if head:
            self.first, self.edges = offset, self.edges + 1
        if tail:
            self.last, self.edges = offset, self.edges + 1
        if self.edges == 2:
            self.writer._group_done(self)


class KafkaSinkWriter:
    """One subtask's transactional writer; see the module docstring for the protocol.

    Invariants:
        Every record of an epoch is in exactly one transaction, on one transactional id, with
        headers naming (sink, subtask, epoch); the epoch's marker is in the same transaction.
        A slot holds at most one open or prepared transaction; a slot is free again only after
        its transaction committed.
        An epoch is published (committed) once: ``commit``/``recover`` re-publish only when the
        marker says the original did not commit, and a re-publication writes a new marker
        inside its own transaction.
    """

    def __init__(self, sink: KafkaSinkConfig, ctx: SinkContext) -> None:
        assert sink.prefix is not None
        self.sink = sink
        self.ctx = ctx
        self.settings = sink.resolved_settings()
        self.encode = _Encoder(sink)
        self.sink_id = f"{ctx.job}/{ctx.step}".encode()
        self.subtask_b = str(ctx.subtask).encode()
        self.markers = marker_topic(ctx.job, ctx.step)
        # The marker topic is created (a job's first start) or checked in the background,
        # while recover() initializes the pool's producers: on a first start it took 0.1 s of
        # the critical path from launch to the first output (bench/RESULTS.md, "Start-up: the
        # marker topic beside the producers"). recover() waits for it, so a failure still
        # fails the task's open.
        self._marker_setup: Future[int] = Future()
        threading.Thread(  # a daemon: a worker that fails before waiting for it exits at once
            target=_set_up_markers,
            args=(self._marker_setup, self.settings, self.markers, ctx),
            name=f"txn-markers-{ctx.step}-{ctx.subtask}",
            daemon=True,
        ).start()
        self.marker_partition = -1  # none until _marker_ready(): no delivery matches it
        self.producers: dict[int, Producer] = {}
        self.busy: dict[int, str] = {}  # slot -> epoch tag of its open or prepared transaction
        self.began: dict[int, float] = {}  # slot -> when its transaction began (monotonic)
        self.slot: int | None = None  # slot of the open (not yet prepared) transaction
        self.tag = ""
        self.n = 0
        self.seq = 0
        self.ranges: dict[tuple[str, int], list[int]] = {}
        # record_ids=False: the exact offsets each partition got, as runs [first, last] (or,
        # where other producers' records lie between, [first, last, digests]: _Group)
        self.runs: dict[tuple[str, int], list[list[Any]]] = {}
        self.unreported = 0  # groups of the open epoch whose edges are not both delivered yet
        self.partitioner: KeyPartitioner | None = None
        self.partitions_at = 0.0  # when the partition count was last read (monotonic)
        self.errors: list[KafkaError] = []
        self.marker_offset: list[int] = []
        self.published = 0
        self.republished = 0

    # -- producers -------------------------------------------------------------------------------

    def _tid(self, slot: int) -> str:
        assert self.sink.prefix is not None
        return transactional_id(self.sink.prefix, self.ctx.step, self.ctx.subtask, slot)

    def _producer(self, slot: int, *, fresh: bool = False) -> Producer:
        """The producer of ``slot``; ``fresh``: a new instance (fences and aborts the old one)."""
        producer = self.producers.get(slot)
        if producer is None or fresh:
            producer = self.producers[slot] = self._new_producer(slot)
        return producer

    def _new_producer(self, slot: int) -> Producer:
        """A producer for ``slot``, initialized: its id's open transaction is aborted."""
        conf = producer_config(
            self.settings,
            transactional_id=self._tid(slot),
            overrides={
                **self.sink.producer_config,
                "transaction.timeout.ms": self.sink.transaction_timeout_ms,
            },
        )
        conf["partitioner"] = "murmur2_random"  # as the Java client: same key, same partition
        producer = create_producer(conf)
        connect_producer(producer)
        retrying(producer.init_transactions, f"init_transactions {self._tid(slot)}")
        return producer

    def _marker_ready(self) -> None:
        """Waits for the marker topic's setup (started in ``__init__``): its partition."""
        if self.marker_partition < 0:
            self.marker_partition = self._marker_setup.result()

    def _free_slot(self) -> int:
        for slot in range(_MAX_SLOTS):
            if slot not in self.busy:
                return slot
        raise EosflowError(
            f"sink {self.ctx.step}[{self.ctx.subtask}]: {_MAX_SLOTS} epochs are prepared and not "
            "committed (checkpoints keep failing?); refusing to open more transactions"
        )

    def _delivered(self, err: KafkaError | None, msg: Any) -> None:
        if err is not None:
            self.errors.append(err)
            return
        tp = (msg.topic(), msg.partition())
        offset = msg.offset()
        if tp == (self.markers, self.marker_partition):
            self.marker_offset.append(offset)
            return
        r = self.ranges.get(tp)
        if r is None:
            self.ranges[tp] = [offset, offset]
        elif offset > r[1]:
            r[1] = offset
        elif offset < r[0]:
            r[0] = offset

    def _delivered_marker(self, err: KafkaError | None, msg: Any) -> None:
        if err is not None:
            self.errors.append(err)
        else:
            self.marker_offset.append(msg.offset())

    def _group_done(self, group: _Group) -> None:
        """Both edges of ``group`` are delivered: its records lie in ``[first, last]`` of its
        partition, in order. Exactly there when the span holds as many offsets as the group
        has records; when it holds more, other producers' batches lie between (librdkafka
        split the group into several requests), and the run keeps a digest of each record so
        that a rescue can tell them apart. A span shorter than the group means records were
        lost: the epoch fails."""
        span = group.last - group.first + 1
        run: list[Any] = [group.first, group.last]
        if span > group.count:
            keys, values, parts = group.call
            part = group.tp[1]
            run.append(
                b"".join(
                    record_digest(k, v)
                    for k, v, p in zip(keys, values, parts, strict=True)
                    if p == part
                ).hex()
            )
        elif span < group.count:
            self.errors.append(
                KafkaError(
                    KafkaError._INCONSISTENT,
                    f"{group.count} records produced to {group.tp[0]}[{group.tp[1]}] were "
                    f"delivered at offsets {group.first}..{group.last} ({span} offsets)",
                    retriable=True,
                )
            )
        group.call = _DONE
        self.unreported -= 1
        self.runs.setdefault(group.tp, []).append(run)

    # -- the epoch -------------------------------------------------------------------------------

    def _begin(self) -> Producer:
        slot = self._free_slot()
        producer = self._producer(slot)
        producer.begin_transaction()
        self.slot = slot
        self.tag = f"{self.ctx.generation}.{self.n}"
        self.n += 1
        self.busy[slot] = self.tag
        self.began[slot] = time.monotonic()
        self.seq = 0
        self.ranges = {}
        self.runs = {}
        self.unreported = 0
        self.errors = []
        self.marker_offset = []
        return producer

    def write(self, values: Sequence[Any]) -> None:
        if not values:
            return
        encoded = self.encode.all(values)
        self._produce([k for k, _v in encoded], [v for _k, v in encoded])

    def write_keyed(self, keys: list[Any], values: list[Any]) -> None:
        """``write(list(zip(keys, values)))`` of a keyed stream, without the pairs."""
        if not values:
            return
        if self.encode.key_fn is not None:  # the key function decides the key
            self.write(list(zip(keys, values, strict=True)))
            return
        self._produce(*self.encode.columns(keys, values))

    def _produce(self, keys: list[Any], values: list[bytes]) -> None:
        producer = self._producer(self.slot) if self.slot is not None else self._begin()
        produce, topic = producer.produce, self.sink.topic
        sink_header = (HEADER_SINK, self.sink_id)
        id_prefix = f"{self.ctx.subtask}.{self.tag}."
        ids = self.sink.record_ids
        seq, i, n = self.seq, 0, len(values)
        if not ids:  # no header: a rescue finds the records by their offsets
            self._produce_runs(producer, keys, values)
            i = n
        while i < n:  # the hot loop: one produce per record, nothing else
            rest = zip(keys[i:], values[i:], strict=True) if i else zip(keys, values, strict=True)
            try:
                delivered = self._delivered
                for key, value in rest:
                    produce(
                        topic, value, key, on_delivery=delivered,
                        headers=[sink_header, (HEADER_ID, f"{id_prefix}{seq}".encode())],
                    )  # fmt: skip
                    seq += 1
                    i += 1
            except BufferError:  # librdkafka's local queue is full: serve delivery reports
                producer.poll(0.05)
        self.seq = seq + (0 if ids else n)
        producer.poll(0)
        if self.errors:
            self._raise_delivery(f"writing epoch {self.tag}")

    def _produce_runs(self, producer: Producer, keys: list[Any], values: list[bytes]) -> None:
        """Records without headers, in order, each to the partition chosen here as the
        producer's partitioner would (:class:`~sinks.kafka.records.KeyPartitioner`). Only the
        first and the last record of each partition's group have a delivery report (a report
        per record was a fifth of a worker's CPU, bench/RESULTS.md): their offsets bound the
        group (:meth:`_group_done`). One ``produce`` per record, as the hand-written loop:
        0.1 us of CPU less per record than ``produce_batch`` and its dicts (measured)."""
        partitioner = self._partitioner(producer)
        parts = partitioner.of(keys)
        n, topic, call = len(parts), self.sink.topic, (keys, values, parts)
        edges: dict[int, Callable[[KafkaError | None, Any], None]] = {}
        backwards = parts[::-1]
        # one counting pass (a list.count per partition was 8 passes: 45 ns a record)
        for part, count in Counter(parts).items():
            first, last = parts.index(part), n - 1 - backwards.index(part)
            group = _Group(self, (topic, part), count, call)
            self.unreported += 1
            if first == last:
                edges[first] = group.both
            else:
                edges[first], edges[last] = group.head, group.tail
        produce, start = producer.produce, 0
        for edge in [*sorted(edges), n]:
            for key, value, part in zip(
                keys[start:edge], values[start:edge], parts[start:edge], strict=True
            ):
                try:  # the hot loop: one produce per record, nothing else
                    produce(topic, value, key, part)
                except BufferError:  # librdkafka's local queue is full: serve reports, again
                    produce_waiting(producer, topic, value, key, partition=part)
            if edge < n:
                produce_waiting(
                    producer, topic, values[edge], keys[edge], partition=parts[edge],
                    on_delivery=edges[edge],
                )  # fmt: skip
                start = edge + 1

    def _partitioner(self, producer: Producer) -> KeyPartitioner:
        """The output topic's partitioner, its partition count read again once a minute (as
        often as librdkafka's own metadata refresh notices a grown topic, or more)."""
        now = time.monotonic()
        if self.partitioner is None or now - self.partitions_at > _PARTITIONS_S:
            topic = self.sink.topic
            meta = retrying(
                lambda t: producer.list_topics(topic, timeout=t),
                f"metadata of {topic}",
                idempotent=True,
            ).topics.get(topic)
            if meta is None or meta.error is not None or not meta.partitions:
                raise KafkaClientError(
                    f"sink {self.ctx.step}[{self.ctx.subtask}]: output topic {topic!r} has no "
                    f"partitions in the cluster's metadata ({meta.error if meta else 'absent'})",
                    retriable=True,
                )
            count = len(meta.partitions)
            if self.partitioner is None or self.partitioner.count != count:
                self.partitioner = KeyPartitioner(count)
            self.partitions_at = now
        return self.partitioner

    def txn_headroom_s(self) -> float | None:
        """Seconds until the broker would abort the oldest open transaction of this subtask
        (its ``transaction.timeout.ms`` minus the transaction's age); ``None``: none open."""
        began = [t for slot, t in self.began.items() if slot in self.busy]
        if not began:
            return None
        return self.sink.transaction_timeout_ms / 1000 - (time.monotonic() - min(began))

    def _raise_delivery(self, context: str) -> None:
        err = self.errors[0]
        raise classify(err, context=f"sink {self.ctx.step}[{self.ctx.subtask}] {context}")

    def prepare(self, checkpoint_id: int) -> Any:
        if self.slot is None:
            return None
        slot, producer = self.slot, self._producer(self.slot)
        marker = orjson.dumps(
            {"job": self.ctx.job, "step": self.ctx.step, "subtask": self.ctx.subtask,
             "epoch": self.tag, "checkpoint": checkpoint_id, "count": self.seq}
        )  # fmt: skip
        if self.sink.record_ids:
            self._produce_marker(producer, marker, self.tag, self._delivered)
        else:
            # The records first, then the marker: with a report for only the edges of each
            # group, a record in the middle that failed shows only as the transaction's
            # abortable error, which refuses the next produce (librdkafka's
            # rd_kafka_check_produce): the marker's.
            self._flush(producer, checkpoint_id)
            if self.unreported:
                raise KafkaClientError(
                    f"sink {self.ctx.step}[{self.ctx.subtask}]: a delivery report is missing "
                    f"after flushing epoch {self.tag} at checkpoint {checkpoint_id}",
                    retriable=True,
                )
            try:
                self._produce_marker(producer, marker, self.tag, self._delivered_marker)
            except KafkaException as exc:
                raise classify(
                    exc, context=f"sink {self.ctx.step}[{self.ctx.subtask}] epoch {self.tag}"
                ) from exc
        self._flush(producer, checkpoint_id)
        committable = {
            "tid": self._tid(slot),
            "subtask": self.ctx.subtask,  # whose epoch: a rescue matches headers against it
            "slot": slot,
            "epoch": self.tag,
            "count": self.seq,
            "ids": self.sink.record_ids,  # how its records are told apart on a rescue
            "ranges": [[t, p, lo, hi] for (t, p), (lo, hi) in sorted(self.ranges.items())],
            # record_ids=False: the offsets themselves (format 2: no header on the records)
            **({} if self.sink.record_ids else {"runs": self._sorted_runs()}),
            "marker": [self.markers, self.marker_partition, self.marker_offset[0]],
        }
        self.published += self.seq
        self.slot = None
        return committable

    def _flush(self, producer: Producer, checkpoint_id: int) -> None:
        left = producer.flush(60)
        if left:
            raise KafkaClientError(
                f"sink {self.ctx.step}[{self.ctx.subtask}]: {left} records undelivered after 60 s "
                f"at checkpoint {checkpoint_id}",
                retriable=True,
            )
        if self.errors:
            self._raise_delivery(f"preparing checkpoint {checkpoint_id}")

    def _sorted_runs(self) -> list[list[Any]]:
        """``[[topic, partition, [[first, last], ...]], ...]``: the committable's ``runs``."""
        return [[t, p, sorted(runs)] for (t, p), runs in sorted(self.runs.items())]

    def _produce_marker(
        self,
        producer: Producer,
        marker: bytes,
        tag: str,
        on_delivery: Callable[..., None],
        *,
        subtask: bytes | None = None,
        partition: int | None = None,
    ) -> None:
        """The epoch's commit marker, inside the open transaction; its headers name (sink,
        subtask, epoch), which is what :func:`~sinks.kafka.rescue.epoch_committed` looks for.
        A re-published epoch's marker names the epoch's own subtask and goes to the partition
        of its first marker (a later rescue reads from there)."""
        subtask_b = self.subtask_b if subtask is None else subtask
        self._marker_ready()
        headers: Headers = [
            (HEADER_SINK, self.sink_id),
            (HEADER_SUBTASK, subtask_b),
            (HEADER_EPOCH, tag.encode()),
        ]
        produce_waiting(
            producer, self.markers, marker, subtask_b,
            partition=self.marker_partition if partition is None else partition,
            headers=headers, on_delivery=on_delivery,
        )  # fmt: skip

    def commit(self, checkpoint_id: int, committable: Any) -> None:
        slot, tag = int(committable["slot"]), str(committable["epoch"])
        if self.busy.get(slot) == tag and slot != self.slot:
            producer = self._producer(slot)
            try:
                retrying(
                    producer.commit_transaction,
                    f"commit {self._tid(slot)}",
                    self.sink.commit_timeout_s,
                )
            except KafkaClientError as exc:
                # The broker aborted the transaction (timeout) or fenced this producer: rescue,
                # unless a later epoch already wrote records in its own transaction.
                self._refuse_rescue_out_of_order(slot, tag, exc)
                log.warning(
                    "sink=%s subtask=%d epoch=%s checkpoint=%d commit failed (%s); re-publishing",
                    self.ctx.step, self.ctx.subtask, tag, checkpoint_id, exc,
                )  # fmt: skip
                self._rescue(committable, fresh=True)
            del self.busy[slot]
            self.began.pop(slot, None)
            self.ctx.fault("mid-sink-commit")  # committed; the engine has not recorded it yet
            return
        self._rescue(committable, fresh=False)

    def _refuse_rescue_out_of_order(self, slot: int, tag: str, exc: Exception) -> None:
        """Re-publishing epoch ``tag`` now would put its records after those a later epoch
        already wrote in another open (or prepared) transaction: ``read_committed`` readers
        would see part of the later epoch, then ``tag``, then the rest, and per-key order (which
        compacted topics and latest-value readers depend on) would break. Fail the task
        instead: recovery aborts every open transaction of the pool, re-publishes ``tag`` first,
        and the later epochs are replayed after it (found in review, issue 19)."""
        later = sorted(t for s, t in self.busy.items() if s != slot)
        if later:
            raise KafkaClientError(
                f"sink {self.ctx.step}[{self.ctx.subtask}]: the transaction of epoch {tag} did "
                f"not commit ({exc}) while later epoch(s) {', '.join(later)} already hold "
                f"records in open transactions; re-publishing {tag} now would order it after "
                "them. Restarting the task: recovery re-publishes it first and replays the "
                "later epochs after it"
            ) from exc

    def recover(self, pending: Sequence[tuple[int, Any]]) -> None:
        """Abort whatever the pool's ids left open, then publish every pending epoch once.

        Every id of the pool (all :data:`_MAX_SLOTS`) is initialized, in parallel: a crash
        during a streak of failed checkpoints can leave a transaction open on a high slot, and
        an open transaction holds back every ``read_committed`` reader of its partitions.
        """
        keep = {*range(self.sink.pool_size), *(int(c["slot"]) for _chk, c in pending)}
        self.producers.clear()
        with ThreadPoolExecutor(_MAX_SLOTS + len(pending), thread_name_prefix="txn-init") as pool:
            inits = [pool.submit(self._new_producer, slot) for slot in range(_MAX_SLOTS)]
            # Each pending epoch is decided once its own id is fenced (its transaction can no
            # longer change), while the pool's other ids are still being initialized: an id
            # whose transaction was open waits librdkafka's fixed 0.5 s PID timer.
            decisions = [
                pool.submit(self._committed_once_fenced, inits[int(c["slot"])], c)
                for _chk, c in pending
            ]
            fresh = {slot: init.result() for slot, init in enumerate(inits)}
            committed = [decision.result() for decision in decisions]
        self._marker_ready()
        for slot, producer in fresh.items():
            if slot in keep:
                self.producers[slot] = producer
        for i, ((chk, committable), done) in enumerate(zip(pending, committed, strict=True)):
            self._rescue(committable, fresh=False, committed=done)
            log.info(
                "sink=%s subtask=%d recovered checkpoint=%d epoch=%s",
                self.ctx.step, self.ctx.subtask, chk, committable["epoch"],
            )  # fmt: skip
            if i == 0:
                self.ctx.fault("mid-sink-recover")
        self.busy.clear()

    def _committed_once_fenced(self, init: Future[Producer], committable: Any) -> bool:
        """Whether ``committable``'s epoch committed, asked once ``init`` (the producer of its
        id, whose initialization fenced the id) is done."""
        init.result()
        return self._epoch_committed(committable)

    def _epoch_committed(self, committable: Any) -> bool:
        # The epoch's own subtask (the same as this writer's when the engine restores a task,
        # or settles an old shape with its old context: processor.runtime.shape.settle).
        subtask = committable_subtask(committable)
        where = f"sink={self.ctx.step} subtask={subtask}"
        return epoch_committed(
            self.settings, committable, self.sink_id, str(subtask).encode(), where
        )

    def _rescue(self, committable: Any, *, fresh: bool, committed: bool | None = None) -> None:
        """Publish the epoch of ``committable`` unless its marker says it committed
        (``committed``: already asked, after its id was fenced)."""
        slot, tag = int(committable["slot"]), str(committable["epoch"])
        subtask = committable_subtask(committable)
        subtask_b = str(subtask).encode()
        producer = self._producer(slot, fresh=fresh)
        if committed is None:
            committed = self._epoch_committed(committable)
        if committed:
            return
        records = read_epoch(self.settings, committable, subtask, self.sink_id)
        expected = int(committable["count"])
        if len(records) != expected:
            raise EosflowError(
                f"sink {self.ctx.step}[{subtask}]: epoch {tag} held {expected} records "
                f"but only {len(records)} are still in "
                f"{committable.get('runs') or committable['ranges']} (deleted by "
                "retention?); its output cannot be re-published"
            )
        self.errors = []
        retrying(lambda _t: producer.begin_transaction(), f"begin {self._tid(slot)}")
        for topic, partition, key, value, headers, ts in records:
            produce_waiting(
                producer, topic, value, key, partition=partition, headers=headers, timestamp=ts,
                on_delivery=self._delivered_rescue,
            )  # fmt: skip
        marker = orjson.dumps(
            {"subtask": subtask, "epoch": tag, "republished": True, "count": expected}
        )
        self._produce_marker(
            producer, marker, tag, self._delivered_rescue, subtask=subtask_b,
            partition=int(committable["marker"][1]),
        )  # fmt: skip
        producer.flush(60)
        if self.errors:
            self._raise_delivery(f"re-publishing epoch {tag}")
        retrying(
            producer.commit_transaction, f"commit {self._tid(slot)}", self.sink.commit_timeout_s
        )
        self.republished += expected
        log.warning(
            "sink=%s subtask=%d re-published epoch=%s records=%d (its transaction had aborted)",
            self.ctx.step, subtask, tag, expected,
        )  # fmt: skip

    def _delivered_rescue(self, err: KafkaError | None, _msg: Any) -> None:
        if err is not None:
            self.errors.append(err)

    def close(self) -> None:
        for slot, producer in self.producers.items():
            if slot == self.slot:
                try:
                    producer.abort_transaction(10)  # never prepared: nobody will commit it
                except KafkaException as exc:
                    log.warning("abort on close failed: %s", exc)
            try:
                producer.flush(10)
            except KafkaException as exc:  # a fatal error (e.g. no KIP-360 bump before Kafka 2.5)
                log.warning("flush on close failed: %s", exc)
        self.producers.clear()


#: How long :func:`_connect` waits for the cluster's metadata.
def committable_subtask(committable: Any) -> int:
    """The sink subtask whose epoch ``committable`` is: its ``subtask`` entry, or (committables
    written before it existed) the subtask in its transactional id
    ``<prefix>-<step>-<subtask>-<slot>``."""
    if "subtask" in committable:
        return int(committable["subtask"])
    return int(str(committable["tid"]).rsplit("-", 2)[-2])


def _set_up_markers(
    done: Future[int], settings: KafkaSettings, topic: str, ctx: SinkContext
) -> None:
    """:func:`_marker_partition` into ``done`` (in the writer's setup thread)."""
    try:
        done.set_result(_marker_partition(settings, topic, ctx))
    except BaseException as exc:  # raised again in the task, by _marker_ready()
        done.set_exception(exc)


def _marker_partition(settings: KafkaSettings, topic: str, ctx: SinkContext) -> int:
    """The marker partition of ``ctx``'s subtask: ``subtask % partitions``.

    The marker topic is created with the job's parallelism when missing, accepted with any
    partition count when it exists (a job restarted at another parallelism keeps it, issue 24)
    and grown to the parallelism when it has fewer partitions. Growing matters for liveness,
    not correctness: subtasks that share a partition are told apart by the markers' headers
    (sink, subtask, epoch), but a rescue reads the marker partition ``read_committed``, so
    another subtask's open transaction there holds it back (up to its commit, or 120 s on a
    broker that hides aborted records: rescue.py). Where the broker refuses to grow it, they
    share. Markers stay as long as the topic does: a rescue of a retained checkpoint's pending
    epoch reads its marker (rescue.py); the broker's retention could delete it.
    """
    admin = TopicAdmin(settings)
    admin.ensure_topic(topic, ctx.parallelism, INTERNAL_TOPIC_CONFIG, any_count=True)
    return ctx.subtask % admin.grow_partitions(topic, ctx.parallelism)
