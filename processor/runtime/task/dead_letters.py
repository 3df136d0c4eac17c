"""Dead letters: records that failed to decode or made a user function raise, with the cause.

Each task that has a dead-letter destination owns one :class:`DeadLetters`: it turns a failure
into an entry (a JSON-like dict), buffers it, and hands the buffer to the task's dead-letter
:class:`~processor.contracts.SinkWriter`, which the task prepares, commits and recovers exactly like
a sink's writer. An entry therefore belongs to the epoch that read its record: it is committed when
that epoch's checkpoint completes and discarded with the epoch if the job restarts before, so every
bad record lands in the destination exactly once (docs/engine.md, "Dead letters").

Entry fields::

    step         the step that failed (the source step for a decode or timestamp failure)
    task         <stage>.<subtask>
    error_type   the exception's class name, e.g. DeserializationError, KeyError
    cause        str(exception)
    topic, partition, offset
                 where the record was read: the source topic for a source stage, the channel
                 topic for a channel stage; null when it cannot be told exactly (see
                 docs/engine.md)
    key, value   the input of the failing step (JSON-like: other values become their repr)
    ts_ms        the record's event time (Kafka timestamp for a record that failed at the source)
    key_b64, key_utf8, value_b64, value_utf8
                 raw Kafka bytes of a source record: base64, and the text when it is UTF-8
                 (the value's only for a record that did not decode; ``value`` is then null)

Entries hold nothing that changes between attempts (no generation, no wall clock), so a record
replayed after a restart produces the same entry.
"""

from __future__ import annotations

import base64
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Container
from typing import Any

import orjson

from processor.contracts import Message, SinkWriter
from processor.wire import bundle_records

__all__ = ["DeadLetters", "Origins", "channel_origins", "jsonable", "source_origins"]

log = logging.getLogger(__name__)

_RECENT = 5  # per task; the runner keeps the last 20 of the job
_LOG_FIRST = 20
_LOG_EVERY = 10_000

#: Index in the batch being pushed -> the message it was read from (``None``: unknown).
Origins = Callable[[int], Message | None]


def jsonable(value: Any) -> Any:
    """``value`` as JSON-like data: tuples become lists, non-string dict keys strings, anything
    else orjson cannot encode its ``repr``."""
    try:
        return orjson.loads(orjson.dumps(value, default=repr, option=orjson.OPT_NON_STR_KEYS))
    except (orjson.JSONEncodeError, TypeError, RecursionError):
        return repr(value)


def _raw(prefix: str, data: bytes | None, entry: dict[str, Any]) -> None:
    if data is None:
        return
    entry[f"{prefix}_b64"] = base64.b64encode(data).decode("ascii")
    with contextlib.suppress(UnicodeDecodeError):
        entry[f"{prefix}_utf8"] = data.decode("utf-8")


class LateRecord(Exception):
    """The cause of a late record's dead letter (its ``error_type``)."""


def _cause(exc: BaseException) -> str:
    return str(exc) or repr(exc)


class DeadLetters:
    """One task's dead-letter output: builds entries, counts and logs them, writes them.

    Attributes:
        writer: the task's dead-letter writer.
        count: entries routed by this task in this generation (including those of epochs that
            a restart later discards).
    """

    def __init__(self, writer: SinkWriter, task: str) -> None:
        self.writer = writer
        self.task = task
        self.count = 0
        self._buffer: list[dict[str, Any]] = []
        #: the last few entries' place and cause, for the job page (no keys or values)
        self.recent: deque[dict[str, Any]] = deque(maxlen=_RECENT)

    def source_record(
        self, step: str, message: Message, exc: BaseException, value: Any, *, decoded: bool
    ) -> None:
        """A record of a source topic failed before entering the operators: it did not decode
        (``decoded=False``), or the source's ``timestamp`` function raised on ``value``."""
        ts = message.timestamp()
        entry = self._entry(
            step,
            exc,
            message.topic(),
            message.partition(),
            message.offset(),
            None,
            jsonable(value) if decoded else None,
            ts[1] if ts[0] else None,
        )
        _raw("key", message.key(), entry)
        if not decoded:
            _raw("value", message.value(), entry)
        self._add(entry)

    def function_failed(
        self, step: str, record: tuple[Any, Any, int], exc: BaseException, origin: Message | None
    ) -> None:
        """A user function of ``step`` raised on ``record``; ``origin`` is the Kafka record the
        input came from, when the task can tell exactly."""
        k, v, t = record
        topic = partition = offset = None
        if origin is not None:
            topic, partition, offset = origin.topic(), origin.partition(), origin.offset()
        self._add(self._entry(step, exc, topic, partition, offset, jsonable(k), jsonable(v), t))

    def late_record(
        self, step: str, record: tuple[Any, Any, int], watermark: int, lateness_ms: int
    ) -> None:
        """A windowed aggregation's record all of whose windows had closed (``late=
        "dead_letters"``): its key, value and event time, and by how much it was late."""
        k, v, t = record
        exc = LateRecord(
            f"event time {t} is {watermark - t} ms behind the watermark {watermark}: every "
            f"window of the record had closed (end + allowed lateness {lateness_ms} ms <= "
            "watermark)"
        )
        self._add(self._entry(step, exc, None, None, None, jsonable(k), jsonable(v), t))

    def _entry(
        self,
        step: str,
        exc: BaseException,
        topic: Any,
        partition: Any,
        offset: Any,
        key: Any,
        value: Any,
        ts_ms: Any,
    ) -> dict[str, Any]:
        return {
            "step": step,
            "task": self.task,
            "error_type": type(exc).__name__,
            "cause": _cause(exc),
            "topic": topic,
            "partition": partition,
            "offset": offset,
            "key": key,
            "value": value,
            "ts_ms": ts_ms,
        }

    def _add(self, entry: dict[str, Any]) -> None:
        self._buffer.append(entry)
        self.count += 1
        self.recent.append(
            {k: entry[k] for k in ("step", "error_type", "topic", "partition", "offset")}
            | {"cause": str(entry["cause"])[:300]}
        )
        n = self.count
        if n <= _LOG_FIRST or n % _LOG_EVERY == 0:
            log.warning(
                "dead letter task=%s step=%s topic=%s partition=%s offset=%s count=%d "
                "error=%s: %s%s",
                self.task, entry["step"], entry["topic"], entry["partition"], entry["offset"],
                n, entry["error_type"], entry["cause"],
                " (logging the first 20, then every 10,000th)" if n == _LOG_FIRST else "",
            )  # fmt: skip

    def flush(self) -> None:
        """Writes the buffered entries (before every barrier, and after every batch)."""
        if self._buffer:
            entries, self._buffer = self._buffer, []
            self.writer.write(entries)


# -- where a failing record was read -------------------------------------------------------------
# Nothing is tracked per record: the task keeps the poll batch, and these find the messages a
# pushed batch was made of again, once, when the first of its records fails.


def source_origins(msgs: list[Message], topic: str, failed: set[int]) -> Origins:
    """A source batch of ``topic``: its messages in ``msgs`` except those whose ``id()`` is in
    ``failed`` (they did not decode)."""
    return _lazy(lambda: [m for m in msgs if m.topic() == topic and id(m) not in failed])


def channel_origins(
    msgs: list[Message],
    after: Message | None,
    until: Message | None,
    topic: str,
    blocked: Container[tuple[str, int]],
    recovering: Container[tuple[str, int]],
) -> Origins:
    """A bucket of channel ``topic`` filled from the messages strictly between ``after`` and
    ``until`` (``None``: the start, the end of ``msgs``): data records of channels that were
    neither paused (``blocked``) nor ``recovering``. The task changes those two only on its slow
    path, which pushes the buckets first, so they are what they were while the bucket filled."""

    def select() -> list[Message]:
        chosen: list[Message] = []
        started = after is None
        for m in msgs:
            if m is until:
                break
            if not started:
                started = m is after
                continue
            tp = (m.topic(), m.partition())
            if (
                tp[0] == topic
                and tp not in blocked
                and m.headers() is None
                and tp not in recovering
            ):
                bundle = bundle_records(m.value())  # type: ignore[arg-type]
                chosen += [m] * (1 if bundle is None else len(bundle))  # a bundle: each record
        return chosen

    return _lazy(select)


def _lazy(select: Callable[[], list[Message]]) -> Origins:
    """``index -> select()[index]``, calling ``select`` on the first lookup only: a flood of bad
    records in one batch costs one scan, not one per record."""
    chosen: list[Message] | None = None

    def find(index: int) -> Message | None:
        nonlocal chosen
        if chosen is None:
            chosen = select()
        return chosen[index] if 0 <= index < len(chosen) else None

    return find
