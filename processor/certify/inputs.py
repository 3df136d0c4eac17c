"""The input of a certify: a snapshot of each source topic, read by every run alike.

A live topic may grow while certify runs, and every run must read the same records: each
source topic is copied once, before the first run, into a topic of certify's own with the same
partition count (each record to the partition it came from, with its key, value, timestamp and
headers, as a ``read_committed`` reader sees it). A JSON-lines file can stand in for a topic
(``--input TOPIC=FILE``): line ``i`` becomes a record of partition ``i % partitions``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import orjson

from connectors import KafkaSettings, TopicAdmin
from processor.errors import ConfigError
from processor.testing.outputs import scan_topic
from processor.testing.topics import produce_records

__all__ = ["copy_topic", "load_lines"]


def copy_topic(settings: KafkaSettings, source: str, target: str) -> tuple[int, int]:
    """Copies ``source`` into a new topic ``target``; returns ``(records, partitions)``.

    Raises:
        ConfigError: ``source`` does not exist or holds no record.
    """
    admin = TopicAdmin(settings)
    if not admin.exists(source):
        raise ConfigError(
            f"source topic {source!r} does not exist on {settings.brokers}: certify replays a "
            "snapshot of the pipeline's input, so write some first, or give a JSON-lines file "
            f"for it: --input {source}=FILE.jsonl"
        )
    partitions = admin.describe(source).partitions
    admin.ensure_topic(target, partitions)

    def records() -> Iterable[dict[str, Any]]:
        for msg in scan_topic(settings, source):
            _kind, ts = msg.timestamp()
            yield {
                "key": msg.key(),
                "value": msg.value(),
                "partition": msg.partition(),
                "timestamp": ts if ts > 0 else 0,
                "headers": msg.headers() or None,
            }

    count = produce_records(settings.brokers, target, records())
    if count == 0:
        raise ConfigError(
            f"source topic {source!r} holds no committed record: certify replays a snapshot of "
            f"the pipeline's input, so write some first, or --input {source}=FILE.jsonl"
        )
    return count, partitions


def load_lines(
    settings: KafkaSettings, file: Path, target: str, partitions: int, key: str | None = None
) -> int:
    """Writes every non-empty line of ``file`` (its bytes, without the newline) to a new topic
    ``target`` of ``partitions`` partitions, with timestamps one millisecond apart; returns the
    record count.

    With ``key`` (a field name), each line is a JSON object whose field ``key`` becomes the
    record key, and records go to the partition Kafka's Java producer would choose for it
    (murmur2), so that a key's records keep their order in one partition, as in a topic written
    by a keyed producer. Without it, line ``i`` goes to partition ``i % partitions`` unkeyed.

    Raises:
        ConfigError: the file is missing or empty, or a line lacks the key field.
    """
    if not file.is_file():
        raise ConfigError(f"--input file {str(file)!r} does not exist")
    TopicAdmin(settings).ensure_topic(target, partitions)
    base = int(time.time() * 1000)
    with file.open("rb") as f:
        lines = [line.rstrip(b"\r\n") for line in f]
    lines = [line for line in lines if line.strip()]
    if not lines:
        raise ConfigError(f"--input file {str(file)!r} has no line to write")
    records: list[dict[str, Any]] = [
        {"value": line, "partition": i % partitions, "timestamp": base + i}
        for i, line in enumerate(lines)
    ]
    if key is not None:
        from sinks.kafka.records import murmur2_partition

        for i, record in enumerate(records):
            k = _field(record["value"], key, file, i + 1)
            record["key"], record["partition"] = k, murmur2_partition(k, partitions)
    return produce_records(settings.brokers, target, records)


def _field(line: bytes, key: str, file: Path, number: int) -> bytes:
    try:
        value = orjson.loads(line)[key]
    except (orjson.JSONDecodeError, KeyError, TypeError, IndexError) as exc:
        raise ConfigError(
            f"--input-key {key!r}: line {number} of {str(file)!r} is not a JSON object with "
            f"field {key!r} ({type(exc).__name__}: {exc})"
        ) from exc
    if isinstance(value, bytes):
        return value
    return value.encode() if isinstance(value, str) else orjson.dumps(value)
