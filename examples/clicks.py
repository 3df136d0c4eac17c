"""A deterministic JSON click stream and the answer a per-user aggregation must give.

Used by the examples, the tests and the benchmarks; the expectation is computed here, from the
generated events, never by the engine.

    python examples/clicks.py --brokers 127.0.0.1:9092 --topic clicks --records 100000
    python examples/clicks.py --jsonl clicks.jsonl --records 20000   # for eosflow certify --input
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from processor.runtime.job import parse_duration

PAGES = ("/", "/search", "/item", "/cart", "/checkout", "/help")


@dataclass(frozen=True)
class Totals:
    count: int
    amount: int


def click_events(
    records: int, *, users: int = 1000, seed: int = 7, spacing_ms: int = 10
) -> Iterator[dict[str, object]]:
    """``records`` click events, ``spacing_ms`` of event time apart (each a little out of
    order within its slot); the same arguments always give the same events."""
    rng = random.Random(seed)
    base_ms = 1_700_000_000_000
    for i in range(records):
        yield {
            "event_id": f"c-{seed}-{i}",
            "user": f"user-{rng.randrange(users):05d}",
            "page": PAGES[rng.randrange(len(PAGES))],
            "amount": rng.randrange(1, 100),
            "ts_ms": base_ms + i * spacing_ms + rng.randrange(spacing_ms),
        }


def expected_totals(events: Iterator[dict[str, object]]) -> dict[str, Totals]:
    """Per-user click count and amount sum: the reference answer."""
    acc: dict[str, list[int]] = {}
    for event in events:
        entry = acc.setdefault(str(event["user"]), [0, 0])
        entry[0] += 1
        entry[1] += int(str(event["amount"]))
    return {user: Totals(c, a) for user, (c, a) in acc.items()}


def canonical(item: object) -> bytes:
    """One output record as comparable bytes (JSON, sorted keys)."""
    import orjson

    return orjson.dumps(item, option=orjson.OPT_SORT_KEYS)


def expected_running_totals(events: Iterator[dict[str, object]]) -> Counter[bytes]:
    """Every output line of the running-total example: ``[user, [count, amount]]`` per click."""
    acc: dict[str, tuple[int, int]] = {}
    out: Counter[bytes] = Counter()
    for event in events:
        user = str(event["user"])
        count, amount = acc.get(user, (0, 0))
        acc[user] = (count + 1, amount + int(str(event["amount"])))
        out[canonical([user, list(acc[user])])] += 1
    return out


def expected_window_counts(
    events: Iterator[dict[str, object]], window_ms: int = 10_000
) -> Counter[bytes]:
    """Every output line of the windowed-count example: clicks per page and tumbling window."""
    counts: Counter[tuple[str, int]] = Counter()
    for event in events:
        ts = int(str(event["ts_ms"]))
        counts[(str(event["page"]), ts - ts % window_ms)] += 1
    return Counter(
        canonical([page, {"start_ms": s, "end_ms": s + window_ms, "value": n}])
        for (page, s), n in counts.items()
    )


def expected_two_level_counts(
    events: Iterator[dict[str, object]], window_ms: int = 10_000
) -> Counter[bytes]:
    """Every output line of ``two_level_count.py`` (local-recovery tests and bench), tagged
    with its sink: ``["pages", <windowed-count line>]`` and ``["totals", [start, {start_ms,
    end_ms, value}]]``, the clicks per window summed over pages."""
    per_page: Counter[tuple[str, int]] = Counter()
    for event in events:
        ts = int(str(event["ts_ms"]))
        per_page[(str(event["page"]), ts - ts % window_ms)] += 1
    totals: Counter[int] = Counter()
    out: Counter[bytes] = Counter()
    for (page, start), n in per_page.items():
        totals[start] += n
        value = {"start_ms": start, "end_ms": start + window_ms, "value": n}
        out[canonical(["pages", [page, value]])] += 1
    for start, n in totals.items():
        value = {"start_ms": start, "end_ms": start + window_ms, "value": n}
        out[canonical(["totals", [start, value]])] += 1
    return out


def read_two_level_output(output_dir: str) -> list[object]:
    """The committed lines of ``two_level_count.py``'s two sinks, tagged like
    :func:`expected_two_level_counts`."""
    from sinks import read_jsonl

    return [["pages", x] for x in read_jsonl(os.path.join(output_dir, "pages"))] + [
        ["totals", x] for x in read_jsonl(os.path.join(output_dir, "totals"))
    ]


def compare_outputs(want: Counter[bytes], got: Counter[bytes]) -> tuple[int, int]:
    """(missing, duplicated or unexpected) record counts of ``got`` against ``want``."""
    return sum((want - got).values()), sum((got - want).values())


def example_parser(label: str) -> argparse.ArgumentParser:
    """The options every engine example takes (workers, checkpoints, runner, recovery)."""
    parser = argparse.ArgumentParser(description=f"eosflow example: {label}")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--checkpoint-interval", type=parse_duration, default=1.0, metavar="DURATION",
        help="as eosflow run: 500ms, 1s, 2m (default 1s)",
    )  # fmt: skip
    parser.add_argument("--mode", default="aligned", choices=["aligned", "unaligned", "sync"])
    parser.add_argument(
        "--runner", default="local", choices=["local", "spark"],
        help="spark: the workers run as a Spark barrier job (needs Java 17)",
    )  # fmt: skip
    parser.add_argument("--master", help="Spark master (default local[WORKERS])")
    parser.add_argument(
        "--recovery", default="global", choices=["global", "local"],
        help="local: a failed worker restarts alone (docs/local-recovery.md; starts Redis too)",
    )  # fmt: skip
    parser.add_argument(
        "--keep", action="store_true",
        help="keep the scratch directory (output, checkpoints, worker logs) after a passing check",
    )  # fmt: skip
    return parser


def finish(args: argparse.Namespace, problems: list[str], ok: str) -> None:
    """Says how the check went; removes the example's scratch directory after a pass (unless
    ``--keep``), keeps it after a failure, and exits 1 on failure."""
    import shutil

    if problems:
        print("FAILED:\n  " + "\n  ".join(problems[:20]))
        print(f"output, checkpoints and worker logs kept in {args.work}")
        sys.exit(1)
    print(ok)
    if args.keep:
        print(f"output, checkpoints and worker logs kept in {args.work}")
    else:
        shutil.rmtree(args.work, ignore_errors=True)


#: The variables the examples' pipeline files read (set by :func:`run_until_idle` and ``produce``).
_PIPELINE_VARIABLES = ("JOB_NAME", "OUTPUT_DIR", "CLICKS_TOPIC", "EDGES_TOPIC", "USERS_TOPIC")


def run_until_idle(
    pipeline: str,
    args: argparse.Namespace,
    label: str,
    produce: Callable[[str, str], str],
) -> Any:
    """Starts the embedded servers, sets ``JOB_NAME`` and ``OUTPUT_DIR``, calls
    ``produce(brokers, run_id)`` to write the input (it says what it wrote), and runs
    ``pipeline`` until idle as ``args`` say; returns the :class:`RunResult`. The scratch
    directory (input state, checkpoints, output) is ``args.work``; :func:`finish` removes it."""
    import tempfile
    import uuid

    from processor.embedded import servers
    from processor.runtime.supervision.local import LocalRunner, RunOptions

    with servers(["kafka"]) as endpoints:
        assert endpoints.kafka_brokers is not None
        run_id = uuid.uuid4().hex[:8]
        work = args.work = tempfile.mkdtemp(prefix=f"eosflow-example-{run_id}-")
        os.environ["JOB_NAME"] = f"{label.replace(' ', '-')}-{run_id}"
        os.environ["OUTPUT_DIR"] = f"{work}/output"
        print(f"kafka: {endpoints.kafka_brokers} ({endpoints.origin['kafka']})")
        print(produce(endpoints.kafka_brokers, run_id))
        options = RunOptions(
            workers=args.workers,
            checkpoint_interval=args.checkpoint_interval,
            mode=args.mode,
            until_idle=True,
            # What the pipeline files read: on a cluster, executors have only what is forwarded.
            environ={
                **endpoints.as_env(),
                **{k: os.environ[k] for k in _PIPELINE_VARIABLES if k in os.environ},
            },
            state_dir=f"{work}/state",
            progress=sys.stdout,
            recovery=args.recovery,
        )
        if args.runner == "spark":
            from processor.runtime.supervision.spark import SparkOptions, SparkRunner

            return SparkRunner(pipeline, options, SparkOptions(master=args.master)).run()
        return LocalRunner(pipeline, options).run()


def run_example(
    pipeline: str, expected: Callable[[Iterator[dict[str, object]]], Counter[bytes]], label: str
) -> None:
    """Command line of the engine examples: write clicks, run the job until idle, check."""
    from sinks import read_jsonl

    parser = example_parser(label)
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--users", type=int, default=1000)
    args = parser.parse_args()

    def produce(brokers: str, run_id: str) -> str:
        topic = os.environ["CLICKS_TOPIC"] = f"clicks-{run_id}"
        took = produce_clicks(brokers, topic, args.records, users=args.users)
        return f"wrote {args.records:,} clicks to {topic} in {took:.1f}s"

    result = run_until_idle(pipeline, args, label, produce)
    got = Counter(canonical(item) for item in read_jsonl(os.environ["OUTPUT_DIR"]))
    want = expected(click_events(args.records, users=args.users))
    missing, extra = compare_outputs(want, got)
    rate = result.records_in / result.seconds if result.seconds else 0.0
    print(
        f"{label}: {result.records_in:,} clicks in {result.seconds:.1f}s ({rate:,.0f}/s), "
        f"{sum(got.values()):,} output records in {os.environ['OUTPUT_DIR']}, "
        f"{result.checkpoints} checkpoints"
    )
    problems = []
    if missing or extra:
        problems.append(f"{missing} expected records missing, {extra} duplicated or unexpected")
    finish(
        args, problems, f"OK: every output record exactly once ({sum(want.values()):,} expected)"
    )


def with_duplicates(
    events: Iterator[dict[str, object]], rate: float, *, seed: int = 7, max_delay: int = 2000
) -> Iterator[dict[str, object]]:
    """The events, plus a copy of each with probability ``rate``, sent again 1 to
    ``max_delay`` events later (as an at-least-once producer upstream would): same
    ``event_id``, a later offset."""
    rng = random.Random(seed + 1)
    later: dict[int, list[dict[str, object]]] = {}
    for i, event in enumerate(events):
        yield event
        yield from later.pop(i, [])
        if rate and rng.random() < rate:
            later.setdefault(i + rng.randrange(1, max_delay + 1), []).append(event)
    for i in sorted(later):
        yield from later[i]


def produce_clicks(
    brokers: str,
    topic: str,
    records: int,
    *,
    partitions: int = 8,
    users: int = 1000,
    seed: int = 7,
    duplicates: float = 0.0,
    spacing_ms: int = 10,
) -> float:
    """Create ``topic`` and write the events to it, keyed by user; returns seconds taken.

    ``duplicates``: the share of events written twice (see :func:`with_duplicates`); the
    answer of a deduplicating job is still computed from :func:`click_events` alone."""
    clicks = click_events(records, users=users, seed=seed, spacing_ms=spacing_ms)
    events = with_duplicates(clicks, duplicates, seed=seed)
    return produce_json(
        brokers, topic, events, key=lambda e: str(e["user"]), partitions=partitions, total=records
    )


def produce_json(
    brokers: str,
    topic: str,
    events: Iterable[object],
    *,
    key: Callable[[Any], str],
    partitions: int = 8,
    total: int = 0,
) -> float:
    """Create ``topic`` and write ``events`` to it as JSON, keyed by ``key(event)``; returns
    seconds taken (progress on stderr every 50,000 of ``total``)."""
    import orjson

    from connectors import KafkaSettings, TopicAdmin, create_producer, producer_config

    settings = KafkaSettings.from_env(brokers=brokers)
    TopicAdmin(settings).ensure_topic(topic, partitions)
    producer = create_producer(producer_config(settings))
    failures: list[object] = []

    def delivered(err: object, _msg: object) -> None:
        if err is not None:
            failures.append(err)

    start = time.monotonic()
    for i, event in enumerate(events):
        k = key(event).encode()
        while True:
            try:
                producer.produce(topic, orjson.dumps(event), key=k, on_delivery=delivered)
                break
            except BufferError:  # local queue full: let deliveries drain
                producer.poll(0.05)
        if i % 50_000 == 0:
            producer.poll(0)
            if i:
                print(f"  produced {i:,}/{total:,}", file=sys.stderr)
    left = producer.flush(60)
    if left or failures:
        raise RuntimeError(f"{left} records undelivered, first failures: {failures[:3]}")
    return time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--brokers", help="write the clicks to a topic of this Kafka cluster")
    where.add_argument(
        "--jsonl", metavar="FILE", help="write them to a JSON-lines file (eosflow certify --input)"
    )
    parser.add_argument("--topic", default="clicks")
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--users", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    if args.jsonl:
        import orjson

        with open(args.jsonl, "wb") as f:
            for click in click_events(args.records, users=args.users, seed=args.seed):
                f.write(orjson.dumps(click) + b"\n")
        print(f"wrote {args.records:,} clicks to {args.jsonl}")
        return
    took = produce_clicks(
        args.brokers,
        args.topic,
        args.records,
        partitions=args.partitions,
        users=args.users,
        seed=args.seed,
    )
    print(f"wrote {args.records:,} clicks to {args.topic} in {took:.1f}s")


if __name__ == "__main__":
    main()
