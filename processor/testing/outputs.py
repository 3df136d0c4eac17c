"""Reading what a sink committed, for every sink kind eosflow ships, as a test compares it.

:func:`read_output` takes the sink object of a pipeline (the one given to ``Stream.sink``) and
returns its committed output as :class:`~processor.testing.compare.Output` records, each with
its key and where it was read:

========================  ==========================================================  =======
sink                      what is read                                                order
========================  ==========================================================  =======
``FileSink``              committed part files (JSON lines decoded, raw lines as       per key
                          ``bytes``, Avro records), ``file:line``
``KafkaSink``             the topic as a ``read_committed`` reader sees it (staged     per key
                          mode: re-published copies dropped by their ``eosflow-id``)
``PostgresSink``          the table's rows (``columns`` of the sink)                   none
``RedisSink``             every element of every key of the sink's database but its    none
                          bookkeeping keys (a stream's entries without their IDs)
========================  ==========================================================  =======

"Order" says whether a key's records keep their order in that sink (:data:`ORDERED`), so that
a comparison may also check each key's sequence (:func:`~processor.testing.compare.order_diff`).
A sink of another kind can take part by defining ``read_output() -> list`` itself.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import fastavro
import orjson
from confluent_kafka import TopicPartition

from connectors import KafkaSettings, TopicAdmin, consumer_config, create_consumer
from processor.errors import ConfigError
from processor.testing.compare import Output

__all__ = ["ORDERED", "read_output", "reader_config", "scan_topic"]

#: Sink kinds whose output keeps each key's records in order.
ORDERED = ("FileSink", "KafkaSink")


def read_output(
    sink: Any, *, keyed: bool = False, settings: KafkaSettings | None = None
) -> list[Output]:
    """Everything ``sink`` committed, as :class:`Output` records.

    Args:
        sink: a pipeline's sink object (``FileSink``, ``KafkaSink``, ``PostgresSink``,
            ``RedisSink``, or any object with a ``read_output()`` method).
        keyed: the sink's stream is keyed, so a file sink's records are ``[key, value]`` pairs
            (the key is taken from them).
        settings: the Kafka cluster of a ``KafkaSink`` without settings of its own (default
            ``KafkaSettings.from_env()``).

    Raises:
        ConfigError: a sink kind this function cannot read.
    """
    kind = type(sink).__name__
    own = getattr(sink, "read_output", None)
    if callable(own):
        return [r if isinstance(r, Output) else Output(r) for r in own()]
    if kind == "FileSink":
        return _read_files(sink.path, keyed)
    if kind == "KafkaSink":
        kafka = sink.settings or settings or KafkaSettings.from_env()
        return _read_kafka(sink, kafka)
    if kind == "PostgresSink":
        return _read_postgres(sink)
    if kind == "RedisSink":
        return _read_redis(sink)
    raise ConfigError(
        f"cannot read the output of a {kind} sink: give it a read_output() method returning "
        "its committed records (see processor.testing.outputs)"
    )


def _read_files(path: str, keyed: bool) -> list[Output]:
    from sinks.files.read import _committed_parts

    out: list[Output] = []
    if not os.path.isdir(path):
        return out
    for file in _committed_parts(path, ("jsonl", "txt", "avro")):
        name = os.path.basename(file)
        with open(file, "rb") as f:
            if file.endswith(".avro"):
                values: list[Any] = list(fastavro.reader(f))
            else:
                lines = f.read().split(b"\n")[:-1]
                values = list(map(orjson.loads, lines)) if file.endswith(".jsonl") else lines
        for i, value in enumerate(values, 1):
            key = value[0] if keyed and isinstance(value, list) and len(value) == 2 else None
            out.append(Output(value, key, f"{name}:{i}"))
    return out


def reader_config(settings: KafkaSettings, *, committed: bool = True) -> dict[str, Any]:
    """The settings of a consumer that reads output as a downstream reader would: a group of
    its own, ``read_committed`` unless ``committed=False``."""
    return consumer_config(
        settings,
        group_id=f"eosflow-reader-{os.getpid()}-{time.monotonic_ns()}",
        overrides={"isolation.level": "read_committed" if committed else "read_uncommitted"},
        allow_read_uncommitted=not committed,
    )


def scan_topic(
    settings: KafkaSettings, topic: str, *, committed: bool = True, timeout: float = 60.0
) -> Iterator[Any]:
    """Every message of ``topic`` up to the end each partition had when the scan began
    (``read_committed`` unless ``committed=False``), partition by partition in offset order.

    Raises:
        TimeoutError: the partitions were not read to their ends within ``timeout`` seconds.
    """
    admin = TopicAdmin(settings)
    parts = admin.partitions(topic)
    ends = admin.end_offsets(parts, committed=committed)
    todo = {p: end for (_, p), end in ends.items() if end > 0}
    if not todo:
        return
    consumer: Any = create_consumer(reader_config(settings, committed=committed))
    try:
        consumer.assign([TopicPartition(topic, p, 0) for p in todo])
        deadline = time.monotonic() + timeout
        while todo:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"reading {topic!r}: partitions {sorted(todo)} not read to their ends "
                    f"{todo} within {timeout:g}s"
                )
            for msg in consumer.consume(1000, 0.2):
                p = msg.partition()
                if p not in todo:
                    continue
                if msg.error() is not None:  # end of partition (markers may follow the data)
                    position = msg.offset()
                else:
                    yield msg
                    position = msg.offset() + 1
                if position >= todo[p]:
                    del todo[p]
    finally:
        consumer.close()


def _key(raw: bytes | None) -> Any:
    if raw is None:
        return None
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return raw


def _read_kafka(sink: Any, settings: KafkaSettings) -> list[Output]:
    from dedup.consumer import sink_record_id

    staged = sink.mode == "staged"
    seen: set[Any] = set()
    out: list[Output] = []
    for msg in scan_topic(settings, sink.topic, committed=not staged):
        if staged:
            record_id = sink_record_id(msg)
            if record_id is not None and record_id in seen:
                continue  # a re-published copy: its readers drop it (DedupConsumer)
            seen.add(record_id)
        value = sink.serde.deserialize(
            msg.value(), topic=msg.topic(), partition=msg.partition(), offset=msg.offset()
        )
        where = f"{msg.topic()}[{msg.partition()}]@{msg.offset()}"
        out.append(Output(value, _key(msg.key()), where))
    return out


def _read_postgres(sink: Any) -> list[Output]:
    import psycopg
    from psycopg import sql

    dsn = sink.dsn or os.environ.get("EOSFLOW_POSTGRES_DSN")
    if not dsn:
        raise ConfigError("reading a PostgresSink's table needs its dsn or EOSFLOW_POSTGRES_DSN")
    table = sql.Identifier(*sink.table)  # identifier parts: ("table",) or ("schema", "table")
    name = ".".join(sink.table)
    query = sql.SQL("SELECT {} FROM {}").format(
        sql.SQL(", ").join(map(sql.Identifier, sink.columns)), table
    )
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(query).fetchall()
    index = [sink.columns.index(k) for k in sink.key]
    out = []
    for row in rows:
        value = [_jsonable(v) for v in row]
        key = [value[i] for i in index] if index else None
        out.append(Output(value, key, f"{name}({key})" if key else name))
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool, type(None), list, dict)):
        return value
    if isinstance(value, (bytes, memoryview)):
        return bytes(value).hex()
    return str(value)  # Decimal, datetime, UUID: their text form


def _read_redis(sink: Any) -> list[Output]:
    """One record per element: ``[key, value]`` for a string, ``[key, field, value]`` per hash
    field, ``[key, element]`` per list, set or sorted-set element (with its score) and per
    stream entry (its fields; entry IDs are the server's clock). Elements of one key written by
    several subtasks interleave differently from run to run, so they are compared as a
    multiset, not in order."""
    from dedup.store import redis_client

    url = sink.url or os.environ.get("EOSFLOW_REDIS_URL")
    if not url:
        raise ConfigError("reading a RedisSink's keys needs its url or EOSFLOW_REDIS_URL")
    client = redis_client(url)
    reserved = sink.namespace.encode()
    out = []
    for key in sorted(client.scan_iter(count=1000)):
        if key.startswith(reserved):
            continue
        kind = client.type(key).decode()
        name = key.decode(errors="backslashreplace")
        items: list[Any]
        if kind == "string":
            items = [client.get(key)]
        elif kind == "hash":
            items = [list(kv) for kv in sorted(client.hgetall(key).items())]
        elif kind == "list":
            items = client.lrange(key, 0, -1)
        elif kind == "set":
            items = sorted(client.smembers(key))
        elif kind == "zset":
            items = [list(m) for m in client.zrange(key, 0, -1, withscores=True)]
        elif kind == "stream":
            items = [sorted(fields.items()) for _id, fields in client.xrange(key)]
        else:
            items = [kind]
        for i, item in enumerate(items):
            value = _decoded(item)
            flat = value if kind == "hash" else [value]
            out.append(Output([name, *flat], name, f"{name}[{i}]"))
    return out


def _decoded(content: Any) -> Any:
    if isinstance(content, bytes):
        return content.decode(errors="backslashreplace")
    if isinstance(content, (list, tuple)):
        return [_decoded(c) for c in content]
    return content
