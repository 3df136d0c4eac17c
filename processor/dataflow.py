"""The public API: a ``Dataflow`` of named steps, built fluently and validated as it is built.

::

    flow = Dataflow("click-counts")
    clicks = flow.source("clicks", topic="clicks", serde=JsonSerde(),
                         timestamp=lambda c: c["ts_ms"], max_out_of_orderness=timedelta(seconds=1))
    (clicks.filter("valid", lambda c: c["amount"] > 0)
           .key_by("by-user", lambda c: c["user"])
           .count("per-minute", window=Tumbling(timedelta(minutes=1)))
           .sink("out", FileSink("out/"))

Every step has a stable kebab-case name: names key the state in snapshots, so renaming a step is
a migration. Records are ``(key, value, timestamp_ms)`` inside the engine; a keyed step's output
values are what the user functions return. Aggregations emit ``(key, result)`` records:

* without a window, the running result after every input record (a changelog);
* with a window, one record per key and window when the watermark passes the window's end plus
  ``allowed_lateness`` (or, with ``emit="update"``, one per change of a window, at once); the
  value is ``{"start_ms", "end_ms", "value"}``. Records arriving after
  that are dropped, counted and logged (never silently), or with ``late="dead_letters"`` sent
  to the dead-letter destination.

Values that cross a shuffle (the input of a keyed aggregation) are encoded with orjson: they must
be JSON-like (dict, list, str, int, float, bool, None); tuples come back as lists.

Bad records are data, not crashes: with ``Dataflow(name, dead_letters=sink)`` (or
``flow.dead_letters(sink)``), a record that fails to decode, or whose user function raises, goes to
that sink with the cause and where it came from, inside the same epoch as everything else
(docs/engine.md, "Dead letters"). Without one, undecodable records are counted, logged and skipped,
and a user function that raises fails the job.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from processor.contracts import Serde, Sink
from processor.errors import DefinitionError
from processor.windows import Session, Sliding, Tumbling, duration_ms

__all__ = [
    "DEAD_LETTERS",
    "Dataflow",
    "KeyedStream",
    "Session",
    "Sliding",
    "Step",
    "Stream",
    "Table",
    "Tumbling",
]

_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,62}\Z")
#: The step name of the dead-letter destination (reserved: no step may use it).
DEAD_LETTERS = "dead-letters"


@dataclass
class Step:
    """One named step of a dataflow (the compiler's input; users build them through streams).

    Attributes:
        name: stable kebab-case identifier.
        kind: ``source``, ``map``, ``filter``, ``flat_map``, ``key_by``, ``aggregate``,
            ``process``, ``dedup``, ``union``, ``join`` (two parents), ``to_table``,
            ``iterate`` (a loop head; ``params["feedback"]`` names the step whose output is fed
            back to it) or ``sink``.
        parents: names of the steps feeding this one.
        keyed: the step's output is keyed (partitioned by key after a shuffle or ``key_by``).
        params: kind-specific settings (functions, serde, window...).
    """

    name: str
    kind: str
    parents: tuple[str, ...]
    keyed: bool
    params: dict[str, Any] = field(default_factory=dict)


class Dataflow:
    """A graph of named steps. Build it with :meth:`source` and the stream methods.

    Args:
        name: the job name (kebab-case; it names topics and checkpoint directories).
        dead_letters: where records that fail to decode or whose user function raises go (see
            :meth:`dead_letters`); ``None``: they are skipped (decode) or fail the job (function).
    """

    def __init__(self, name: str, *, dead_letters: Sink | None = None) -> None:
        if not isinstance(name, str) or not _NAME.match(name):
            raise DefinitionError(
                f"dataflow name {name!r} is not valid: use lowercase letters, digits and '-', "
                "starting with a letter or digit, at most 63 characters (it names topics and "
                "checkpoint directories)"
            )
        self.name = name
        self.steps: dict[str, Step] = {}
        self._open_loops: list[str] = []  # iterate steps whose body is being built
        self.dead_letter_sink: Sink | None = None
        if dead_letters is not None:
            self.dead_letters(dead_letters)

    def __repr__(self) -> str:
        return f"Dataflow({self.name!r}, steps={list(self.steps)})"

    def dead_letters(self, sink: Sink) -> None:
        """Route bad records to ``sink``: records whose value fails to decode, and records for
        which a user function raises (``map``, ``filter``, ``flat_map``, ``key_by``, a source's
        ``timestamp``, an aggregation's ``init``/``add``/``merge``/``reduce`` function, a
        ``process`` step's ``fn`` or ``on_timer``).

        Each goes to ``sink`` as one dict ``{"step", "task", "error_type", "cause", "topic",
        "partition", "offset", "key", "value", "ts_ms"}`` (undecodable bytes as ``value_b64``,
        plus ``value_utf8`` when they are UTF-8), written in the epoch that read the record and
        committed with it: exactly once, like any sink's output. Every task of the job opens its
        own writer (step ``dead-letters``; see docs/engine.md, "Dead letters").

        Raises:
            DefinitionError: ``sink`` is not a :class:`~processor.contracts.Sink`, or the
                dataflow already has a dead-letter destination.
        """
        if not isinstance(sink, Sink):
            raise DefinitionError(
                f"dataflow {self.name!r}: dead-letter destination {sink!r} does not implement "
                "processor.contracts.Sink (use one of eosflow's sinks, e.g. sinks.FileSink)"
            )
        if self.dead_letter_sink is not None:
            raise DefinitionError(
                f"dataflow {self.name!r} already sends dead letters to "
                f"{self.dead_letter_sink!r}: give one dead-letter destination"
            )
        self.dead_letter_sink = sink

    def _add(self, step: Step) -> Step:
        if not isinstance(step.name, str) or not _NAME.match(step.name):
            raise DefinitionError(
                f"step name {step.name!r} is not valid: use lowercase kebab-case (letters, "
                "digits, '-'), at most 63 characters; names key the state in snapshots"
            )
        if step.name == DEAD_LETTERS:
            raise DefinitionError(
                f"step name {DEAD_LETTERS!r} is reserved for the dataflow's dead-letter "
                "destination (its writers' state is kept under that name): choose another name"
            )
        if step.name in self.steps:
            raise DefinitionError(
                f"step name {step.name!r} is used twice in dataflow {self.name!r}: "
                "every step needs its own name"
            )
        self.steps[step.name] = step
        return step

    def source(
        self,
        name: str,
        topic: str,
        *,
        serde: Serde | None = None,
        timestamp: Callable[[Any], int] | None = None,
        max_out_of_orderness: timedelta = timedelta(0),
        start: str = "earliest",
        keyed: bool = False,
        key_serde: Serde | None = None,
    ) -> Stream:
        """Read ``topic`` (every partition; subtask ``i`` of ``P`` reads partitions ``p % P == i``).

        With ``keyed=True`` the stream is keyed by each record's Kafka message key, and keyed
        steps after it (``aggregate``, ``count``, ``reduce``, a keyed ``dedup``) run in the
        source's own task, without a shuffle: Kafka already put every record of a key in one
        partition, and one subtask reads that partition. This is Kafka Streams' and Quix's
        default. It rests on two conditions, both checked when the job starts (docs/engine.md,
        "Keyed sources"):

        * the producer chose partitions by key (any partitioner that sends one key to one
          partition, e.g. Kafka's default), and topics that meet in one keyed step (a
          ``union``) have the same partition count and partitioner;
        * the partition count does not change during the job's life (adding partitions moves
          keys, which would split their state): it is recorded at the first start, and a
          later start with another count is refused.

        A record without a key cannot be keyed: it is a bad record (dead letter, or counted and
        skipped). ``key_by`` after a keyed source re-keys, and its stream is shuffled as usual.

        Args:
            serde: decodes record values (default: the raw bytes).
            timestamp: event time of a value in epoch milliseconds (default: the Kafka record
                timestamp).
            max_out_of_orderness: how far behind the newest event time of a partition an event
                may arrive; the watermark trails the newest event time by this much.
            start: ``earliest`` or ``latest``, where a job without a checkpoint starts reading.
            keyed: key the stream by the message key, partitioned as the topic is.
            key_serde: decodes message keys of a keyed source (default: UTF-8 text); keys must
                decode to JSON-like values (they are kept in snapshots).
        """
        if not isinstance(topic, str) or not topic:
            raise DefinitionError(f"source {name!r}: topic must be a non-empty string")
        if serde is not None and not isinstance(serde, Serde):
            raise DefinitionError(
                f"source {name!r}: serde {serde!r} does not implement processor.contracts.Serde"
            )
        if start not in ("earliest", "latest"):
            raise DefinitionError(f"source {name!r}: start must be 'earliest' or 'latest'")
        if not isinstance(keyed, bool):
            raise DefinitionError(f"source {name!r}: keyed must be True or False, got {keyed!r}")
        if key_serde is not None and not keyed:
            raise DefinitionError(
                f"source {name!r}: key_serde decodes the message keys of a keyed source; add "
                "keyed=True (the stream is then keyed by them) or drop key_serde"
            )
        if key_serde is not None and not isinstance(key_serde, Serde):
            raise DefinitionError(
                f"source {name!r}: key_serde {key_serde!r} does not implement "
                "processor.contracts.Serde"
            )
        for other in self.steps.values():
            if other.kind == "source" and other.params["topic"] == topic:
                raise DefinitionError(
                    f"sources {other.name!r} and {name!r} both read topic {topic!r}: read it "
                    "once and use the stream twice"
                )
        params = {
            "topic": topic,
            "serde": serde,
            "timestamp": _callable(name, "timestamp", timestamp, optional=True),
            "max_out_of_orderness_ms": duration_ms("max_out_of_orderness", max_out_of_orderness),
            "start": start,
            "keyed": keyed,
            "key_serde": key_serde,
        }
        step = self._add(Step(name, "source", (), keyed, params))
        return KeyedStream(self, step) if keyed else Stream(self, step)

    def table(
        self,
        name: str,
        topic: str,
        *,
        serde: Serde | None = None,
        key_serde: Serde | None = None,
        timestamp: Callable[[Any], int] | None = None,
        max_out_of_orderness: timedelta = timedelta(0),
    ) -> Table:
        """A keyed table read from ``topic`` (typically compacted): each record is the new row
        of its message key, valid from its timestamp on; a record with a null value (a
        tombstone) deletes the row. Read from the start, like a changelog.

        Join streams with it (``stream.join(name, table)``, an event-time temporal join) or
        other tables. It is a keyed source (``keyed=True``): the same rules hold, and a join
        with another keyed source of the same partitioning runs without a shuffle.

        Watermark: a table's partition that has caught up with its end does not hold the
        watermark back (tables are often quiet for hours); an update that arrives after that
        applies to the stream records not yet joined (docs/engine.md, "Joins").

        Args:
            serde: decodes rows (a tombstone is not decoded: its row is ``None``).
            key_serde: decodes message keys (default: UTF-8 text).
            timestamp: event time of a row in epoch milliseconds (default, and for tombstones:
                the Kafka record timestamp).
            max_out_of_orderness: as for :meth:`source`.
        """
        stream = self.source(
            name,
            topic,
            serde=serde,
            timestamp=timestamp,
            max_out_of_orderness=max_out_of_orderness,
            keyed=True,
            key_serde=key_serde,
        )
        stream.step.params["table"] = True
        return Table(self, stream.step)

    def validate(self) -> None:
        """Checks the whole graph: at least one source, every stream ends in a sink.

        Raises:
            DefinitionError: what is wrong and which step.
        """
        if not any(s.kind == "source" for s in self.steps.values()):
            raise DefinitionError(f"dataflow {self.name!r} has no source")
        consumed = {p for s in self.steps.values() for p in s.parents}
        consumed |= {s.params["feedback"] for s in self.steps.values() if s.kind == "iterate"}
        dangling = [
            s.name for s in self.steps.values() if s.kind != "sink" and s.name not in consumed
        ]
        if dangling:
            raise DefinitionError(
                f"dataflow {self.name!r}: the output of step(s) {dangling} goes nowhere; end "
                "every stream with .sink(name, sink) (a ConsoleSink prints it)"
            )
        routed = [s.name for s in self.steps.values() if s.params.get("late") == "dead_letters"]
        if routed and self.dead_letter_sink is None:
            raise DefinitionError(
                f"dataflow {self.name!r}: step(s) {routed} send late records to dead letters "
                "(late='dead_letters') and the dataflow has no dead-letter destination; give "
                "Dataflow(..., dead_letters=<sink>) or use late='drop'"
            )


def _callable(step: str, what: str, fn: Any, *, optional: bool = False) -> Any:
    if fn is None and optional:
        return None
    if not callable(fn):
        raise DefinitionError(f"step {step!r}: {what} must be callable, got {fn!r}")
    return fn


class Stream:
    """The output of a step; methods add steps and return their output streams."""

    keyed = False

    def __init__(self, flow: Dataflow, step: Step) -> None:
        self.flow = flow
        self.step = step

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.flow.name!r}, step={self.step.name!r})"

    def _then(self, name: str, kind: str, keyed: bool, **params: Any) -> Step:
        return self.flow._add(Step(name, kind, (self.step.name,), keyed, params))

    def _same(self, step: Step) -> Stream:
        return KeyedStream(self.flow, step) if step.keyed else Stream(self.flow, step)

    def map(self, name: str, fn: Callable[[Any], Any]) -> Stream:
        """``fn(value)`` for every value (the key, if any, is kept)."""
        return self._same(self._then(name, "map", self.keyed, fn=_callable(name, "fn", fn)))

    def filter(self, name: str, fn: Callable[[Any], bool]) -> Stream:
        """Keep the values for which ``fn(value)`` is true."""
        return self._same(self._then(name, "filter", self.keyed, fn=_callable(name, "fn", fn)))

    def flat_map(self, name: str, fn: Callable[[Any], Iterable[Any]]) -> Stream:
        """Every element of ``fn(value)``, in order."""
        return self._same(self._then(name, "flat_map", self.keyed, fn=_callable(name, "fn", fn)))

    def key_by(self, name: str, fn: Callable[[Any], Any]) -> KeyedStream:
        """Key every value by ``fn(value)`` (a str, int or other JSON-like value)."""
        return KeyedStream(
            self.flow, self._then(name, "key_by", True, fn=_callable(name, "fn", fn))
        )

    def dedup(
        self,
        name: str,
        id: Callable[[Any], Any],
        *,
        within: timedelta,
        late: str = "drop",
        bucket: timedelta | None = None,
        expected_ids: int = 100_000,
        fp_rate: float = 0.001,
        redis_url: str | None = None,
    ) -> Stream:
        """Drop every record whose ``id(value)`` was already seen within ``within``.

        On an unkeyed stream the IDs are global (records are shuffled by ID, so copies meet);
        on a keyed stream they are per key (``(key, id(value))``) and the stream stays keyed.
        Seen IDs are kept in Bloom filters per time bucket of the records' timestamps, in front
        of a Redis ID store (``redis_url``, default ``EOSFLOW_REDIS_URL``), and forgotten when
        the watermark passes them by ``within``. Exactly once across restarts: the store agrees
        with the restored checkpoint (docs/dedup.md).

        Args:
            id: the business ID of a value (a str, bytes, int or JSON-like value).
            within: the horizon: a copy is recognised if its timestamp is at least the
                watermark minus ``within``.
            late: a record older than the horizon cannot be checked: ``"drop"`` (default) or
                ``"pass"`` it; either is counted and logged.
            bucket: length of a Bloom time bucket (default ``within / 4``, at least 1 s).
            expected_ids: IDs per bucket and subtask that one filter holds at ``fp_rate``.
            fp_rate: target false-positive rate of the filters (costs lookups, never
                correctness).
        """
        within_ms = duration_ms("within", within)
        bucket_ms = None if bucket is None else duration_ms("bucket", bucket)
        if within_ms <= 0:
            raise DefinitionError(f"dedup {name!r}: within must be positive, got {within}")
        if bucket_ms is not None and not 0 < bucket_ms <= within_ms:
            raise DefinitionError(
                f"dedup {name!r}: bucket must be positive and at most within ({within}), "
                f"got {bucket}"
            )
        if bucket_ms is not None and within_ms // bucket_ms > 1000:
            raise DefinitionError(
                f"dedup {name!r}: within / bucket is over 1,000 ({within} / {bucket}): every "
                "live bucket costs one Bloom probe per record; use a larger bucket"
            )
        if late not in ("drop", "pass"):
            raise DefinitionError(f"dedup {name!r}: late must be 'drop' or 'pass', got {late!r}")
        if isinstance(expected_ids, bool) or not isinstance(expected_ids, int) or expected_ids < 1:
            raise DefinitionError(
                f"dedup {name!r}: expected_ids must be a positive int, got {expected_ids!r}"
            )
        if not isinstance(fp_rate, float) or not 0 < fp_rate < 0.5:
            raise DefinitionError(f"dedup {name!r}: fp_rate must be in (0, 0.5), got {fp_rate!r}")
        step = self._then(
            name,
            "dedup",
            self.keyed,
            id=_callable(name, "id", id),
            within_ms=within_ms,
            bucket_ms=bucket_ms,
            late=late,
            expected_ids=expected_ids,
            fp_rate=fp_rate,
            redis_url=redis_url,
        )
        return self._same(step)

    def union(self, name: str, *others: Stream) -> Stream:
        """The records of this stream and of ``others``, interleaved."""
        streams = (self, *others)
        if not others:
            raise DefinitionError(f"union {name!r} needs at least one other stream")
        for s in streams:
            if s.flow is not self.flow:
                raise DefinitionError(f"union {name!r}: streams of different dataflows")
        keyed = all(s.keyed for s in streams)
        step = self.flow._add(Step(name, "union", tuple(s.step.name for s in streams), keyed))
        return self._same(step)

    def iterate(
        self,
        name: str,
        body: Callable[[Stream], tuple[Stream, Stream]],
        *,
        max_iterations: int | None = None,
    ) -> Stream:
        """A loop: ``body(loop)`` builds steps on ``loop`` and returns ``(feedback, output)``.

        ``loop`` carries this stream's records and every record of ``feedback``, which goes back
        to the loop's head through an internal channel topic (a back-edge); ``output`` is what
        the loop emits (this method returns it). Records circulate until the body stops feeding
        them back: a streaming iteration, e.g. label propagation over a stream of graph edges
        (``examples/connected_components.py``).

        Exactly once, loops included: checkpoints follow Algorithm 2 of Carbone et al. (2015),
        the records in flight on the back-edge are part of the snapshot, and ``--until-idle``
        ends only when a checkpoint finds no record in the loop (docs/iterations.md).

        Args:
            body: builds the loop body. ``loop`` is unkeyed; key it inside the body.
            max_iterations: a record fed back more than this many times is dropped from the
                loop (counted, logged, and sent to the dead-letter destination if the dataflow
                has one). ``None``: no limit (the body must end every loop itself).

        Raises:
            DefinitionError: ``body`` does not return two streams of this dataflow, the
                feedback stream does not come from ``loop``, or loops are nested.
        """
        flow = self.flow
        if flow._open_loops:
            raise DefinitionError(
                f"iterate {name!r} is inside the body of iterate {flow._open_loops[-1]!r}: "
                "nested loops are not supported; give the inner loop's body to the outer one"
            )
        if max_iterations is not None and (
            isinstance(max_iterations, bool)
            or not isinstance(max_iterations, int)
            or max_iterations < 1
        ):
            raise DefinitionError(
                f"iterate {name!r}: max_iterations must be a positive int or None, "
                f"got {max_iterations!r}"
            )
        if not callable(body):
            raise DefinitionError(f"iterate {name!r}: body must be callable, got {body!r}")
        before = set(flow.steps)
        head = self._then(name, "iterate", False, max_iterations=max_iterations, feedback=None)
        flow._open_loops.append(name)
        try:
            feedback, output = _loop_result(name, flow, head, body(Stream(flow, head)))
        except BaseException:
            for step in set(flow.steps) - before:  # no half-built loop stays in the flow
                del flow.steps[step]
            raise
        finally:
            flow._open_loops.pop()
        head.params["feedback"] = feedback.step.name
        return output

    def sink(self, name: str, sink: Sink) -> None:
        """Write the values to ``sink`` (committed when a checkpoint completes).

        Keyed streams write ``(key, value)`` pairs (JSON arrays in a file sink).
        """
        if not isinstance(sink, Sink):
            raise DefinitionError(
                f"sink step {name!r}: {sink!r} does not implement processor.contracts.Sink "
                "(use one of eosflow's sinks, e.g. sinks.FileSink or sinks.ConsoleSink)"
            )
        self._then(name, "sink", False, sink=sink)


def _loop_result(name: str, flow: Dataflow, head: Step, result: Any) -> tuple[Stream, Stream]:
    """Checks what an ``iterate`` body returned: ``(feedback, output)``."""
    if (
        not isinstance(result, tuple)
        or len(result) != 2
        or not all(isinstance(s, Stream) and s.flow is flow for s in result)
    ):
        raise DefinitionError(
            f"iterate {name!r}: body must return (feedback, output), two streams built "
            f"from its argument, got {result!r}"
        )
    feedback, output = result
    if feedback.step is head:
        raise DefinitionError(
            f"iterate {name!r}: the feedback stream is the loop itself (every record would "
            "circulate forever); feed back the output of a step of the body"
        )
    if not _descends(flow, feedback.step.name, head.name):
        raise DefinitionError(
            f"iterate {name!r}: the feedback stream (step {feedback.step.name!r}) does not "
            "come from the loop's stream: build it from body's argument"
        )
    return feedback, output


def _descends(flow: Dataflow, step: str, ancestor: str) -> bool:
    todo, seen = [step], set()
    while todo:
        name = todo.pop()
        if name == ancestor:
            return True
        if name not in seen:
            seen.add(name)
            todo.extend(flow.steps[name].parents)
    return False


# At the end: KeyedStream subclasses Stream (processor/keyed.py imports this module).
from processor.keyed import KeyedStream, Table  # noqa: E402
