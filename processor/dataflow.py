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
(docs/engine.md, "Dead letters"). Without one, undecodable records (and records whose ``timestamp``
function raises ``KeyError``, ``TypeError`` or ``ValueError``) are counted, logged and skipped,
and any other user function that raises fails the job.

The streams and their methods are in :mod:`processor.streams`, the :class:`Step` in
:mod:`processor.steps`; this module re-exports them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from processor.contracts import Serde, Sink
from processor.errors import DefinitionError
from processor.steps import DEAD_LETTERS, Step, user_fn
from processor.streams import KeyedStream, Stream, Table
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
            "timestamp": user_fn(name, "timestamp", timestamp, optional=True),
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
        applies to the stream records not yet joined (docs/engine.md, "Tables and joins").

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
