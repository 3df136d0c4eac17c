"""Creating and filling a test's input topics.

A pipeline test writes its input before the run, then runs the pipeline until idle
(:mod:`processor.testing.run`)::

    topic = create_topic(brokers, "clicks-1f3a", partitions=4)
    produce(brokers, topic, clicks, key=lambda c: c["user"])
    produce_jsonl(brokers, topic, "tests/data/clicks.jsonl", key=lambda c: c["user"])

Records are written by one idempotent producer (``acks=all``): per partition they keep the
order of ``values``, and none is written twice. Values are JSON by default, or any serde of
:mod:`connectors` (``serde=AvroSerde(schema)``), the same one the pipeline's source reads with.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka import KafkaException

from processor.contracts import Serde

__all__ = ["create_topic", "produce", "produce_jsonl", "produce_records", "unique_name"]

#: Seconds :func:`produce` waits for the last deliveries.
FLUSH_TIMEOUT = 60.0


def unique_name(hint: str = "", *, prefix: str = "t", limit: int = 63) -> str:
    """A name made of ``prefix``, ``hint`` (e.g. a test's name) and 8 random hex digits, in
    lowercase letters, digits and ``-`` only, at most ``limit`` characters: valid as a Kafka
    topic and as a job name (``[a-z0-9][a-z0-9-]{0,62}``)."""
    suffix = uuid.uuid4().hex[:8]
    base = re.sub(r"[^a-z0-9]+", "-", f"{prefix}-{hint}".lower()).strip("-")
    room = limit - len(suffix) - 1
    base = base[:room].rstrip("-") or "t"
    return f"{base}-{suffix}"


def create_topic(
    brokers: str,
    name: str,
    partitions: int = 1,
    *,
    config: Mapping[str, str] | None = None,
) -> str:
    """Create topic ``name`` with ``partitions`` partitions (and topic ``config``) unless it
    exists, wait until every partition has a leader, and return ``name``.

    Raises:
        ConfigError: the topic exists with another number of partitions.
        KafkaClientError: the broker refused or did not answer.
    """
    from connectors import KafkaSettings, TopicAdmin

    TopicAdmin(KafkaSettings.from_env(brokers=brokers)).ensure_topic(name, partitions, config)
    return name


def _key_bytes(key: Any) -> bytes | None:
    if key is None or isinstance(key, bytes):
        return key
    if isinstance(key, str):
        return key.encode()
    return orjson.dumps(key, option=orjson.OPT_SORT_KEYS)


def produce(
    brokers: str,
    topic: str,
    values: Iterable[Any],
    *,
    key: Callable[[Any], Any] | None = None,
    serde: Serde | None = None,
    partition: int | Callable[[Any], int] | None = None,
    timestamp_ms: Callable[[Any], int] | None = None,
) -> int:
    """Write ``values`` to ``topic`` (which must exist) and wait until all are delivered.

    Args:
        brokers: bootstrap servers (the ``eosflow_kafka`` fixture).
        values: the records' values, encoded with ``serde``.
        key: the record key of a value: ``str`` is written as UTF-8, ``bytes`` as they are,
            anything else as JSON; ``None`` (default, or returned) writes no key.
        serde: how values are encoded (default :class:`connectors.JsonSerde`).
        partition: a partition number for every record, or a function of the value; default:
            the producer's partitioner (by key hash; spread when there is no key).
        timestamp_ms: the record's timestamp (epoch milliseconds) as a function of the value;
            default: the time of writing.

    Returns:
        The number of records written.

    Raises:
        SerializationError: a value the serde cannot encode (nothing after it is written).
        KafkaClientError: a record was not delivered (the first failure, with how many).
    """
    from connectors import JsonSerde

    encode = (serde or JsonSerde()).serialize

    def records() -> Iterable[dict[str, Any]]:
        for value in values:
            record: dict[str, Any] = {"value": encode(value)}
            if key is not None:
                record["key"] = _key_bytes(key(value))
            if partition is not None:
                record["partition"] = partition(value) if callable(partition) else partition
            if timestamp_ms is not None:
                record["timestamp"] = int(timestamp_ms(value))
            yield record

    return produce_records(brokers, topic, records())


def produce_records(brokers: str, topic: str, records: Iterable[Mapping[str, Any]]) -> int:
    """Write ``records`` (each the keyword arguments of ``Producer.produce``: ``value``, and
    optionally ``key``, ``partition``, ``timestamp``, ``headers``) to ``topic``, which must
    exist, and wait until all are delivered; returns how many were written.

    Raises:
        KafkaClientError: a record was not delivered (the first failure, with how many).
    """
    from connectors import KafkaSettings, create_producer, producer_config
    from connectors.errors import classify

    producer = create_producer(producer_config(KafkaSettings.from_env(brokers=brokers)))
    failures: list[Any] = []

    def delivered(err: Any, _msg: Any) -> None:
        if err is not None:
            failures.append(err)

    count = 0
    for record in records:
        while True:
            try:
                producer.produce(topic, on_delivery=delivered, **record)
                break
            except BufferError:  # the local queue is full: let deliveries drain
                producer.poll(0.05)
            except KafkaException as exc:  # refused at once, e.g. a partition that is not there
                raise classify(exc, context=f"writing record {count} to topic {topic!r}") from exc
        count += 1
        if count % 10_000 == 0:
            producer.poll(0)
    left = producer.flush(FLUSH_TIMEOUT)
    if failures:
        raise classify(
            failures[0],
            context=f"{len(failures)} of {count} records to topic {topic!r} not delivered, first",
        )
    if left:
        from processor.errors import KafkaClientError

        raise KafkaClientError(
            f"{left} of {count} records to topic {topic!r} still undelivered after "
            f"{FLUSH_TIMEOUT:g}s: is the broker at {brokers} reachable?",
            retriable=True,
        )
    return count


def produce_jsonl(
    brokers: str,
    topic: str,
    path: str | Path,
    **options: Any,
) -> int:
    """Write the JSON values of a JSON-lines file (one value a line; blank lines skipped) to
    ``topic``, with :func:`produce`'s ``options`` (``key``, ``serde``, ``partition``,
    ``timestamp_ms``); returns the number of records written.

    Raises:
        ValueError: a line is not JSON (names the file and line).
    """
    source = Path(path)

    def values() -> Iterable[Any]:
        with source.open("rb") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    yield orjson.loads(line)
                except orjson.JSONDecodeError as exc:
                    raise ValueError(f"{source}:{number}: not JSON ({exc})") from None

    return produce(brokers, topic, values(), **options)
