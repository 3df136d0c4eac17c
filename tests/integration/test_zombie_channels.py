"""A frozen worker that wakes up after the next generation started cannot add to the output
(issue 35, item 6), against a real broker and a really frozen process.

The story, with the engine's own tasks and channel writer: generation 1's source task runs in
its own process (:mod:`tests.integration.zombie_job`), writes the first records and barrier 1;
its downstream task completes checkpoint 1 and commits. The source then reads more records and
writes them to the channel, where they stay in librdkafka's queue, and the process is frozen
(SIGSTOP) before they are sent: a worker the runner could not kill (an executor cut off from
the driver, a long GC pause). Generation 2 restores checkpoint 1: its source reads the same
records again and writes ``GenerationStart(2)``, them and barrier 2. Then the frozen process is
woken up (SIGCONT), and its queued records land in the channel after generation 2's marker.
Generation 2's downstream task restored checkpoint 1 and reads on through barrier 3.

Before the fix, nothing told those records from generation 2's (the marker was the only
fence): the committed output held the second batch twice.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import orjson
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from connectors import KafkaSettings
from connectors.transport import KafkaTransport
from processor.runtime.task import Task
from processor.testing import unique_name
from processor.wire import GenerationStart, bundle_records, decode_control
from tests.integration.zombie_job import CommittedList, acked, plan_of, read_until, task_env

pytestmark = pytest.mark.integration

FIRST, SECOND = 40, 25  # records before checkpoint 1, and those the zombie holds


def _produce(brokers: str, topic: str, numbers: range) -> None:
    producer = Producer({"bootstrap.servers": brokers})
    for n in numbers:
        producer.produce(topic, orjson.dumps({"user": _user(n), "n": n}), partition=0)
    assert producer.flush(30) == 0


def _user(n: int) -> str:
    return f"u{n % 7}"


def _expected(numbers: range) -> Counter[tuple[str, int]]:
    """The running count's output, computed without the engine: ``(user, i)`` for the
    ``i``-th record of each user."""
    seen: Counter[str] = Counter()
    out: Counter[tuple[str, int]] = Counter()
    for n in numbers:
        seen[_user(n)] += 1
        out[(_user(n), seen[_user(n)])] += 1
    return out


def _counted(values: list[object]) -> Counter[tuple[str, int]]:
    return Counter((str(v[0]), int(v[1])) for v in values)  # type: ignore[index]


def _stopped(pid: int, timeout: float = 60.0) -> None:
    """Waits until ``pid`` is in the stopped state (``T`` in ``/proc/PID/stat``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "T":
            return
        time.sleep(0.02)
    raise TimeoutError(f"process {pid} did not stop")


def _channel_log(brokers: str, topic: str) -> list[tuple[int, object, bytes | None, int]]:
    """``(offset, control or None, key, records)`` of every message of channel partition 0
    (``records``: how many data records it carries, a bundle several)."""
    consumer = Consumer(
        {"bootstrap.servers": brokers, "group.id": "zombie-test", "enable.auto.commit": False}
    )
    _low, high = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)
    consumer.assign([TopicPartition(topic, 0, 0)])
    out: list[tuple[int, object, bytes | None, int]] = []
    deadline = time.monotonic() + 30
    while len(out) < high and time.monotonic() < deadline:
        for m in consumer.consume(500, 0.5):
            if m.error() is None:
                ctl = decode_control(m.headers())
                value = m.value() or b""
                records = 0 if ctl is not None else len(bundle_records(value) or [value])
                out.append((m.offset() or 0, ctl, m.key(), records))
    consumer.close()
    return out


def test_records_a_frozen_worker_queued_are_ignored_when_it_wakes_up_after_the_next_generation(
    kafka_settings: KafkaSettings, tmp_path: Path
) -> None:
    brokers = kafka_settings.brokers
    job = unique_name("zombie-channels")  # kebab-case, unique: also on a long-lived broker
    source = f"{job}-clicks"
    transport = KafkaTransport(kafka_settings)
    transport.ensure_topics({source: 1})
    plan = plan_of(job, source)
    downstream = plan.stage_of("count")
    channel = downstream.inputs[0].topic
    transport.ensure_topics({channel: 1})
    _produce(brokers, source, range(FIRST))
    snapshots = tmp_path.as_uri()
    CommittedList.epochs = {}

    zombie = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.zombie_job", brokers, job, source, snapshots],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[2],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    try:
        assert zombie.stdin is not None and zombie.stdout is not None
        line = zombie.stdout.readline().split()
        assert line[:1] == ["checkpoint1"], line
        source_chk1 = line[1]

        # Generation 1's downstream task: checkpoint 1 completes, its epoch commits.
        down1 = Task(task_env(plan, transport, snapshots, generation=1), downstream, 0)
        down1.open(None, {source: 1})
        down_chk1 = acked(down1, 1)[1]
        down1.complete(1)
        down1.close()
        assert _counted(CommittedList.committed()) == _expected(range(FIRST))

        # More input; the zombie writes it to the channel, where it stays queued, and freezes.
        _produce(brokers, source, range(FIRST, FIRST + SECOND))
        zombie.stdin.write("go\n")
        zombie.stdin.flush()
        assert zombie.stdout.readline().split() == ["queued", str(SECOND)]
        _stopped(zombie.pid)
        before = _channel_log(brokers, channel)
        # generation 1's first records are in the channel, the second batch is in the queue
        assert sum(n for _o, _ctl, _k, n in before) == FIRST

        # Generation 2 restores checkpoint 1: its source re-reads the second batch.
        src2 = Task(task_env(plan, transport, snapshots, generation=2), plan.stage_of("clicks"), 0)
        store = src2.env.store
        src2.open(store.read_task_snapshot(source_chk1), {source: 1})
        read_until(src2, SECOND)
        src2.trigger(2)
        src2.env.writer.flush()

        # The zombie wakes up: librdkafka sends what it held, after generation 2's marker.
        os.kill(zombie.pid, signal.SIGCONT)
        assert zombie.stdout.readline().split() == ["done"]
        assert zombie.wait(60) == 0
        src2.trigger(3)
        src2.env.writer.flush()
        log = _channel_log(brokers, channel)
        marker = next(
            o for o, ctl, _k, _n in log if isinstance(ctl, GenerationStart) and ctl.generation == 2
        )
        after = sum(n for o, _ctl, _k, n in log if o > marker)
        assert after == 2 * SECOND  # generation 2's records and, after them, the zombie's
        # what generation 1 wrote after the marker (keyed as its own marker): the records, and
        # the watermarks of a source that goes on
        zombie_writes = [(o, n) for o, _ctl, key, n in log if o > marker and key == log[0][2]]

        # Generation 2's downstream task restores checkpoint 1 and reads through barrier 3.
        down2 = Task(task_env(plan, transport, snapshots, generation=2), downstream, 0)
        down2.open(store.read_task_snapshot(down_chk1), {source: 1})
        acked(down2, 2, 3)
        down2.complete(3)
        stats = down2.stats()
        down2.close()
        src2.close()
    finally:
        if zombie.poll() is None:
            zombie.kill()
            zombie.wait()

    committed = _counted(CommittedList.committed())
    twice = sorted(k for k, c in committed.items() if c > 1)
    assert not twice, f"{len(twice)} (user, count) emitted twice: {twice[:10]}"
    assert committed == _expected(range(FIRST + SECOND))  # more counts: the zombie's records
    assert stats["fenced"] == len(zombie_writes)  # messages: bundles, watermarks
    assert sum(n for _o, n in zombie_writes) == SECOND  # every record the zombie held
