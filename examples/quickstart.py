"""Quickstart: click events in, per-user totals out, on embedded servers (or yours).

What it does, end to end, on real servers:

1. finds Kafka and Redis (``EOSFLOW_KAFKA_BROKERS`` / ``EOSFLOW_REDIS_URL``, a running
   ``eosflow dev up``, or embedded Tansu and Redis started for this run and stopped after it);
2. probes the broker and prints what it guarantees;
3. writes ``--records`` JSON click events to an input topic with 8 partitions;
4. reads every partition to the end offsets it had at start, in batches, and sums count and amount
   per user;
5. writes the totals to an output topic in one Kafka transaction and to a Redis hash atomically;
6. reads both back and compares them with an answer computed from the generator alone.

    python examples/quickstart.py [--records 200000]

This exercises the foundation (embedded servers, probe, client configuration, topic admin, the
partition reader, serializers). The checkpointed dataflow engine replaces steps 4-5 with a
``Dataflow`` pipeline; this script stays the smoke test of the layer underneath.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import uuid

import redis
from clicks import Totals, click_events, expected_totals, produce_clicks

from connectors import (
    JsonSerde,
    KafkaSettings,
    PartitionReader,
    TopicAdmin,
    create_producer,
    probe_broker,
)
from connectors.config import producer_config
from processor.embedded import servers


def _say(message: str) -> None:
    print(message, flush=True)


def _read_all(settings: KafkaSettings, topic: str, partitions: int, what: str) -> list[object]:
    serde = JsonSerde()
    values: list[object] = []
    with PartitionReader(settings, group_id="eosflow-quickstart") as reader:
        reader.open({(topic, p): None for p in range(partitions)})
        total = sum(reader.end_offsets_at_open.values())
        last = time.monotonic()
        while not reader.reached_end():
            for msg in reader.poll(10_000, 0.2):
                values.append(
                    serde.deserialize(
                        msg.value(),
                        topic=msg.topic(),
                        partition=msg.partition(),
                        offset=msg.offset(),
                    )
                )
            if time.monotonic() - last > 1.0:
                last = time.monotonic()
                _say(f"  {what}: {len(values):,} of about {total:,} read")
    return values


def run(records: int, partitions: int, users: int) -> bool:
    with servers(["kafka", "redis"]) as endpoints:
        assert endpoints.kafka_brokers is not None and endpoints.redis_url is not None
        for service in ("kafka", "redis"):
            _say(f"{service}: {endpoints.get(service)} ({endpoints.origin[service]})")
        settings = KafkaSettings.from_env(brokers=endpoints.kafka_brokers)
        caps = probe_broker(settings)
        _say(caps.summary())

        run_id = uuid.uuid4().hex[:8]
        clicks, totals_topic = f"quickstart-clicks-{run_id}", f"quickstart-totals-{run_id}"
        _say(f"\n[1/4] writing {records:,} clicks to {clicks} ({partitions} partitions)")
        took = produce_clicks(
            endpoints.kafka_brokers, clicks, records, partitions=partitions, users=users
        )
        _say(f"  {records / took:,.0f} records/s")

        _say(f"[2/4] reading {clicks} to its end and summing per user")
        start = time.monotonic()
        totals: dict[str, list[int]] = {}
        for event in _read_all(settings, clicks, partitions, "clicks"):
            assert isinstance(event, dict)
            entry = totals.setdefault(event["user"], [0, 0])
            entry[0] += 1
            entry[1] += event["amount"]
        took = time.monotonic() - start
        rate = records / took
        _say(f"  {records:,} records in {took:.2f}s = {rate:,.0f} records/s, {len(totals):,} users")

        _say(f"[3/4] writing totals to {totals_topic} in one transaction and to Redis atomically")
        TopicAdmin(settings).ensure_topic(totals_topic, 1)
        producer = create_producer(
            producer_config(settings, transactional_id=f"quickstart-{run_id}")
        )
        producer.init_transactions(30)
        producer.begin_transaction()
        serde = JsonSerde()
        for user, (count, amount) in totals.items():
            producer.produce(
                totals_topic,
                serde.serialize({"user": user, "count": count, "amount": amount}),
                key=user.encode(),
            )
        producer.commit_transaction(60)
        del producer  # release the client before the embedded broker stops (no reconnect noise)
        client = redis.Redis.from_url(endpoints.redis_url)
        key = f"quickstart:{run_id}:totals"
        with client.pipeline(transaction=True) as pipe:  # MULTI/EXEC: all totals or none
            pipe.delete(key)
            pipe.hset(key, mapping={u: f"{c}:{a}" for u, (c, a) in totals.items()})
            pipe.execute()

        _say("[4/4] checking both outputs against the generator's own answer")
        expected = expected_totals(click_events(records, users=users))
        from_kafka = {
            row["user"]: Totals(row["count"], row["amount"])  # type: ignore[index]
            for row in _read_all(settings, totals_topic, 1, "totals")
        }
        from_redis = {
            u.decode(): Totals(*map(int, v.decode().split(":")))
            for u, v in client.hgetall(key).items()
        }
        ok = from_kafka == expected and from_redis == expected
        for name, got in (("kafka", from_kafka), ("redis", from_redis)):
            missing = expected.keys() - got.keys()
            wrong = [u for u in expected.keys() & got.keys() if got[u] != expected[u]]
            _say(f"  {name}: {len(got):,} users, {len(missing)} missing, {len(wrong)} wrong")
        client.delete(key)
        TopicAdmin(settings).delete_topics([clicks, totals_topic])
        _say(
            "OK: every click counted exactly once"
            if ok
            else "FAILED: output differs from the expectation"
        )
        return ok


def main() -> int:
    parser = argparse.ArgumentParser(description="eosflow quickstart on embedded servers")
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--users", type=int, default=1000)
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    return 0 if run(args.records, args.partitions, args.users) else 1


if __name__ == "__main__":
    sys.exit(main())
