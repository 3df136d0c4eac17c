"""The ``dedup`` step: drops records whose ID was seen within a horizon (``Stream.dedup``).

* **Global** (``Stream.dedup`` on an unkeyed stream): the upstream side keys every record by
  the hex of its ID (:class:`IdRouter`, the head the task puts before the shuffle), so all
  copies of an ID meet in one subtask whatever the business ID's type or dict key order; this
  operator reads the ID back from the key and emits unkeyed records.
* **Per key** (``KeyedStream.dedup``): the ID is ``(key, id(value))``; records stay keyed.

Each subtask owns a :class:`~dedup.core.Deduplicator` whose store prefix is
``eosflow:<job>:dedup:<step>:<subtask>`` in shape epoch 0 and
``eosflow:<job>:dedup:<step>:e<epoch>.<subtask>`` after the parallelism changed
(:func:`dedup.rescale.dedup_prefix`, ``SinkContext.epoch``). The IDs cannot be re-split by key,
so after a change the restored state (:func:`dedup.rescale.merge_dedup_states`) names the old
prefixes this subtask reads, read-only, until its horizon passes them.

Failing ``id`` functions are data: with a dead-letter destination the record goes there with
the cause (the others of the batch are checked as usual), without one the task fails.

If Redis lost IDs that the restored checkpoint or this run wrote (restarted empty, failed over
to a replica that missed writes), the task fails with :class:`dedup.errors.RedisDataLost`
instead of passing copies (:mod:`dedup.core`); ``EOSFLOW_DEDUP_ON_LOST_IDS=accept`` lets a
restart go on without them.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future
from itertools import compress
from operator import itemgetter
from typing import Any

from dedup.core import Deduplicator
from dedup.ids import record_pair_ids, value_id
from dedup.native import describe
from dedup.rescale import InheritingIdStore, dedup_prefix
from dedup.store import redis_client, redis_where
from processor.contracts import SinkContext
from processor.dataflow import Step
from processor.runtime.operators.core import Operator, Record
from processor.runtime.waits import waiting

__all__ = ["DedupOperator", "IdRouter"]

log = logging.getLogger(__name__)

_timestamp = itemgetter(2)


class DedupOperator(Operator):
    """See the module docstring."""

    stateful = True
    keeps_index = False

    def __init__(self, step: Step) -> None:
        super().__init__(step)
        self.params = step.params
        self.keyed = step.keyed
        self.id_fn = step.params["id"]
        self.dedup: Deduplicator | None = None
        self._client: Any = None

    @property
    def duplicates(self) -> int:  # type: ignore[override]  # read-only here: the stats own it
        return self.dedup.stats.duplicates if self.dedup is not None else 0

    def open(self, ctx: SinkContext) -> None:
        p = self.params
        self._client = redis_client(p["redis_url"])
        # While Redis does not answer, the job's status says so (processor.runtime.waits).
        where = redis_where(self._client) if hasattr(self._client, "connection_pool") else "Redis"
        on = f"the dedup store of step {ctx.step!r} ({where})"
        store = InheritingIdStore(
            self._client,
            dedup_prefix(ctx.job, ctx.step, ctx.subtask, ctx.epoch),
            wait=lambda: waiting(on),
        )
        self.dedup = Deduplicator(
            store,
            within_ms=p["within_ms"],
            bucket_ms=p["bucket_ms"],
            expected_ids=p["expected_ids"],
            fp_rate=p["fp_rate"],
            late=p["late"],
            name=f"{ctx.step}.{ctx.subtask}",
            # The way past IDs that Redis lost, chosen by an operator for one restart
            # (docs/dedup.md, "Redis durability"); by default the task refuses.
            on_lost=os.environ.get("EOSFLOW_DEDUP_ON_LOST_IDS") or "fail",
            # Redis writes its IDs while the task goes on; the snapshot upload waits for them.
            write_behind=True,
        )
        log.info("dedup %s.%d: C accelerator %s", ctx.step, ctx.subtask, describe())

    def _ids(self, batch: list[Record]) -> list[int]:
        if not self.keyed:  # the key is the ID's hex (IdRouter, before the shuffle)
            return [int(k, 16) for k, _v, _t in batch]
        return record_pair_ids(batch, self.id_fn)

    def process(self, batch: list[Record]) -> list[Record]:
        dedup = self.dedup
        assert dedup is not None, "DedupOperator.open() was not called"
        try:
            ids = self._ids(batch)
        except Exception:
            if self.on_error is None:
                raise
            batch, ids = self._ids_per_record(batch)
        new = dedup.check(ids, list(map(_timestamp, batch)))
        if self.keyed:
            return list(compress(batch, new))
        return [(None, v, t) for (_k, v, t), n in zip(batch, new, strict=True) if n]

    def _ids_per_record(self, batch: list[Record]) -> tuple[list[Record], list[int]]:
        """The slow path: records whose ``id`` function raises go to the handler."""
        handler = self.on_error
        assert handler is not None
        kept: list[Record] = []
        ids: list[int] = []
        for i, record in enumerate(batch):
            try:
                (record_id,) = self._ids([record])
            except Exception as exc:
                handler(self, batch, i, exc)
                continue
            kept.append(record)
            ids.append(record_id)
        return kept, ids

    def on_watermark(self, watermark: int) -> list[Record]:
        assert self.dedup is not None
        self.dedup.advance(watermark)
        return []

    def prepare(self, checkpoint_id: int) -> Future[None] | None:
        assert self.dedup is not None
        return self.dedup.prepare_async(checkpoint_id)

    def commit(self, checkpoint_id: int) -> None:
        assert self.dedup is not None
        self.dedup.commit(checkpoint_id)

    def snapshot(self) -> Any:
        assert self.dedup is not None
        return self.dedup.snapshot()

    def restore(self, state: Any) -> None:
        assert self.dedup is not None
        self.dedup.restore(state)

    def close(self) -> None:
        if self.dedup is not None:
            self.dedup.close()  # its write behind, if any, ends first
            stats = self.dedup.stats.as_dict()
            log.info(
                "dedup closed step=%s %s round_trips=%d",
                self.name, " ".join(f"{k}={v}" for k, v in stats.items()),
                self.dedup.store.round_trips,
            )  # fmt: skip
        if self._client is not None:
            self._client.close()


class IdRouter(Operator):
    """Upstream of a global dedup's shuffle: keys each record by the hex of its ID.

    A canonical ``str`` key routes equal IDs to one subtask (``orjson.dumps`` of a dict would
    not: key order), carries ``bytes`` IDs, and spares the downstream a second hash. An ``id``
    function that raises sends the record to the dead-letter handler.
    """

    keeps_index = True

    def __init__(self, step: Step) -> None:
        super().__init__(step)
        self.id_fn = step.params["id"]

    def process(self, batch: list[Record]) -> list[Record]:
        fn = self.id_fn
        return self._guarded(
            batch,
            lambda b: [(format(value_id(fn(v)), "x"), v, t) for _k, v, t in b],
            lambda r: [(format(value_id(fn(r[1])), "x"), r[1], r[2])],
        )
