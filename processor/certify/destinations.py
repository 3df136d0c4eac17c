"""Where certify's runs write, and reading and removing it afterwards.

Each run's sinks are redirected (:mod:`processor.runtime.redirect`); this module creates the
destinations that must exist before a run (a Kafka topic with the original's partitions, a
PostgreSQL table like the original, an empty Redis database), refuses what could not be read
back exactly, reads a side output's appended lines, and deletes what certify made.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from processor.certify.report import Report
from processor.certify.services import Services
from processor.errors import ConfigError
from processor.runtime.redirect import Rewrite, redirected
from processor.testing.compare import Output

__all__ = ["appended", "check_readable", "cleanup", "free_redis_db", "prepare_outputs"]


def check_readable(sinks: dict[str, Any], svc: Services) -> None:
    """A transactional Kafka sink is read back with ``read_committed``: on a broker that does
    not hide aborted records there (Tansu), a crash's aborted transactions would look like
    duplicates, so certify refuses instead of blaming the engine."""
    from connectors import KafkaSettings, probe_broker

    txn = [n for n, s in sinks.items() if type(s).__name__ == "KafkaSink" and s.mode != "staged"]
    if not txn:
        return
    settings = KafkaSettings.from_env(brokers=svc.kafka)
    if probe_broker(settings).read_committed_hides_aborted:
        return
    raise ConfigError(
        f"sink step {txn[0]!r} is a transactional KafkaSink, and the broker {svc.kafka} "
        "shows records of aborted transactions to read_committed readers (Tansu does; see "
        "docs/brokers.md): certify could not tell a crash's aborted output from a duplicate. "
        "Certify against Apache Kafka (EOSFLOW_KAFKA_BROKERS=...), or give the sink "
        "mode='staged' for this check"
    )


def prepare_outputs(sinks: dict[str, Any], rewrite: Rewrite, svc: Services) -> dict[str, Any]:
    """The run's redirected sinks, their destinations created."""
    out = {}
    for name, sink in sinks.items():
        copy = redirected(sink, name, rewrite)
        kind = type(sink).__name__
        if kind == "KafkaSink":
            from connectors import KafkaSettings, TopicAdmin

            admin = TopicAdmin(sink.settings or KafkaSettings.from_env(brokers=svc.kafka))
            parts = admin.describe(sink.topic).partitions if admin.exists(sink.topic) else 4
            admin.ensure_topic(copy.topic, parts)
        elif kind == "PostgresSink":
            _like_table(sink, copy, svc)
        out[name] = copy
    return out


def _like_table(sink: Any, copy: Any, svc: Services) -> None:
    """Creates the run's table like the original (columns, keys, defaults) when the original
    exists; a sink with column types creates a missing one itself."""
    import psycopg
    from psycopg import sql

    dsn = sink.dsn or svc.postgres or ""
    with psycopg.connect(dsn, autocommit=True) as conn:
        exists = conn.execute("SELECT to_regclass(%s)", [".".join(sink.table)]).fetchone()
        if exists and exists[0] is not None:
            conn.execute(
                sql.SQL("CREATE TABLE IF NOT EXISTS {} (LIKE {} INCLUDING ALL)").format(
                    sql.Identifier(*copy.table), sql.Identifier(*sink.table)
                )
            )


def free_redis_db(url: str, avoid: set[int]) -> int:
    from dedup.store import redis_client

    for db in range(1, 16):
        if db in avoid:
            continue
        client = redis_client(re.sub(r"/\d*$", f"/{db}", url.split("?")[0]))
        if client.dbsize() == 0:
            return db
    raise ConfigError(f"no empty Redis database (1-15) on {url} for certify's Redis sinks")


def appended(path: Path, since: int) -> list[Output]:
    """The lines appended to ``path`` after its first ``since`` bytes (a side output)."""
    import orjson

    if not path.exists():
        return []
    with path.open("rb") as f:
        f.seek(since)
        lines = f.read().split(b"\n")
    out = []
    for i, line in enumerate(lines[:-1] if lines and not lines[-1] else lines, 1):
        try:
            value: Any = orjson.loads(line)
        except orjson.JSONDecodeError:
            value = line
        out.append(Output(value, None, f"{path.name}+{i}"))
    return out


def cleanup(svc: Services, tag: str, report: Report) -> None:
    """Deletes certify's topics, tables and Redis databases (best effort; said if it fails)."""
    from connectors import KafkaSettings, TopicAdmin

    try:
        admin = TopicAdmin(KafkaSettings.from_env(brokers=svc.kafka))
        mine = admin.list_topics(f"eosflow-certify-{tag}-")
        for run in report.runs:
            mine += admin.list_topics(f"eosflow.{report.job[:40]}-c{tag}-{run.name}.")
        if mine:
            admin.delete_topics(mine)
    except Exception as exc:  # cleanup must not hide the verdict
        report.notes.append(f"could not delete certify's topics: {exc}")
    if svc.redis:
        from dedup.store import redis_client

        client = redis_client(svc.redis)
        for run in report.runs:
            stale = list(client.scan_iter(match=f"eosflow:{run.job}:*", count=1000))
            if stale:
                client.delete(*stale)
            if run.redis_db is not None:
                redis_client(re.sub(r"/\d*$", f"/{run.redis_db}", svc.redis)).flushdb()
    tables = [t for run in report.runs for t in run.tables]
    if tables and svc.postgres:
        import psycopg
        from psycopg import sql

        with psycopg.connect(svc.postgres, autocommit=True) as conn:
            for table in tables:
                conn.execute(
                    sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(*table.split(".")))
                )
