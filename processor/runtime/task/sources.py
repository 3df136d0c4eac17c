"""Source inputs of a task: decoding, timestamps, bad records and the source watermark.

Source tasks read input partitions ``p % P == i`` (:func:`processor.wire.source_partitions_for`);
the records that fail to decode, or whose ``timestamp`` function raises, are dead letters with
the cause, or (without a dead-letter destination) counted and logged, never dropped silently.
"""

from __future__ import annotations

import logging
from typing import Any

from dedup.ids import source_id
from processor.contracts import Message
from processor.errors import DeserializationError
from processor.runtime.dead_letters import source_origins
from processor.runtime.operators import (
    MAX_WATERMARK,
    Record,
)
from processor.runtime.task.inputs import ChannelInputs

log = logging.getLogger(__name__)

_WATERMARK_EVERY_S = 0.2
#: Without a dead-letter destination, these source failures are skipped (counted and logged).
_SKIPPABLE = (DeserializationError, KeyError, TypeError, ValueError)


class SourceInputs(ChannelInputs):
    """How a source task reads, decodes and timestamps its input partitions."""

    def _source_batch(self, msgs: list[Message]) -> None:
        params = self.source_params
        by_topic: dict[str, list[Record]] = {}
        single: list[tuple[Message, Record]] = []  # local recovery: pushed one at a time
        lineage = self.lineage
        max_ts = self.max_ts
        tables = self.table_topics
        failed: set[int] = set()  # id() of the messages that did not enter the operators
        for m in msgs:
            topic: Any = m.topic()
            decode, ts_fn, lag_ms, key_of = params[topic]
            try:
                key = None if key_of is None else key_of(m)
                value = m.value()
                if decode is not None:  # given the bytes only: the place is added on failure
                    value = decode(value)
                if ts_fn is None or (value is None and topic in tables):  # a table's tombstone
                    ts = m.timestamp()[1]
                else:
                    ts = int(ts_fn(value))
            except Exception as exc:
                if isinstance(exc, DeserializationError):
                    exc = exc.located(topic, m.partition(), m.offset())
                if self.dead is None and not isinstance(exc, _SKIPPABLE):
                    raise
                failed.add(id(m))
                self.entry[topic].n_in += 1  # read, and not emitted (metrics)
                self._bad_record(m, exc)
                continue
            tp = (topic, m.partition())
            if ts - lag_ms > max_ts[tp]:
                max_ts[tp] = ts - lag_ms
            if lineage is not None:
                single.append((m, (key, value, ts)))
                continue
            batch = by_topic.get(topic)
            if batch is None:
                batch = by_topic[topic] = []
            batch.append((key, value, ts))
        self.records_in += len(msgs)
        for topic, batch in by_topic.items():
            self._origins = source_origins(msgs, topic, failed)
            source = self.entry[topic]
            source.n_in += len(batch)
            source.n_out += len(batch)
            for child in source.children:
                self._push(child, batch, True)
        if single:
            assert lineage is not None
            self._origins = self._pushing
        for m, record in single:
            topic = m.topic()
            lineage.set(source_id(topic, m.partition(), m.offset()))  # type: ignore[union-attr]
            self._message = m
            source = self.entry[topic]
            source.n_in += 1
            source.n_out += 1
            for child in source.children:
                self._push(child, [record], True)
        self._origins = None
        self.pos = self.reader.positions()

    def _bad_record(self, m: Message, exc: Exception) -> None:
        """A source record that did not decode, or whose ``timestamp`` function raised."""
        topic: Any = m.topic()
        if self.dead is not None:
            decode = self.source_params[topic][0]
            value: Any = m.value()
            decoded = not isinstance(exc, DeserializationError)
            if decoded and decode is not None:  # the timestamp function raised: decode again
                try:
                    value = decode(value)
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
        now = self.env.clock()
        if self.env.end_offsets is not None and all(
            self.pos.get(tp, 0) >= self.env.end_offsets.get(tp, 0) for tp in self.max_ts
        ):
            self.drained = True  # at the end: the runner takes the final checkpoint
            if self.env.drain:
                self._advance_watermark(MAX_WATERMARK)
                return
            # --no-drain: the watermark the data put, now, not at the next tick: what the
            # input closed fires in this run (the final checkpoint follows).
        elif now - self._last_wm_emit < _WATERMARK_EVERY_S:
            return
        if not self.max_ts:
            return
        self._last_wm_emit = now
        if not self.quiet_tables:
            self._advance_watermark(min(self.max_ts.values()))
            return
        # A table's partition that caught up with its end does not hold the watermark back:
        # tables are often quiet for hours (docs/engine.md, "Joins"). While a table loads, the
        # watermark waits for it, so stream records join the rows their time had.
        lag = self.reader.cached_lag()
        live = [
            ts
            for tp, ts in self.max_ts.items()
            if tp[0] not in self.quiet_tables or lag.get(tp, 1) > 0
        ]
        self._advance_watermark(min(live) if live else MAX_WATERMARK - 1)
