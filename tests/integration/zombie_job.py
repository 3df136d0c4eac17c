"""The job of ``test_zombie_channels.py``, and its zombie: a real source task in its own process.

``python -m tests.integration.zombie_job BROKERS JOB SOURCE_TOPIC SNAPSHOT_URL`` runs subtask 0
of the job's source stage as generation 1, with the project's channel writer, as a worker runs
it (without the control plane): it writes ``GenerationStart(1)``, the source's first records
and the barrier of checkpoint 1, flushes them, prints ``checkpoint1 PATH`` (its snapshot) and
waits for a line on stdin. Then it reads the records produced since, writes them to the channel
(queued by librdkafka: ``linger.ms`` is 30 s), prints ``queued N`` and stops itself with
SIGSTOP: a frozen worker holding queued records. Once woken up (SIGCONT) it goes on like a
worker whose process resumed: the writer delivers what it queued, and it prints ``done``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

from connectors import KafkaSettings
from connectors.serde import JsonSerde
from connectors.transport import KafkaTransport
from processor.compiler import Plan, compile_flow
from processor.contracts import SinkContext
from processor.dataflow import Dataflow
from processor.runtime.task import Task, TaskEnv
from processor.snapshot.store import SnapshotStore

#: Channel records sit in the zombie's librdkafka queue for this long unless flushed.
ZOMBIE_LINGER_MS = 30_000


class CommittedList:
    """A sink that keeps, in this process, the values of every committed epoch; a commit is
    idempotent per checkpoint (recovery commits a restored snapshot's epoch again)."""

    epochs: ClassVar[dict[int, list[Any]]] = {}

    def open(self, ctx: SinkContext) -> CommittedList:
        self.epoch: list[Any] = []
        return self

    def write(self, values: Sequence[Any]) -> None:
        self.epoch += values

    def prepare(self, checkpoint_id: int) -> Any:
        epoch, self.epoch = self.epoch, []
        return epoch or None

    def commit(self, checkpoint_id: int, committable: Any) -> None:
        CommittedList.epochs[checkpoint_id] = list(committable)

    def recover(self, pending: Sequence[tuple[int, Any]]) -> None:
        for chk, committable in pending:
            self.commit(chk, committable)

    def close(self) -> None:
        pass

    @classmethod
    def committed(cls) -> list[Any]:
        return [v for _chk, values in sorted(cls.epochs.items()) for v in values]


def plan_of(job: str, source_topic: str) -> Plan:
    """source -> key by user -> running count (after a shuffle: the channel) -> sink, one
    subtask each: the sink gets ``(user, count)`` once per record."""
    flow = Dataflow(job)
    (
        flow.source("clicks", source_topic, serde=JsonSerde())
        .key_by("by-user", lambda v: v["user"])
        .count("count")
        .sink("out", CommittedList())
    )
    return compile_flow(flow, 1, combine=False)


def task_env(
    plan: Plan, transport: KafkaTransport, snapshot_url: str, generation: int, **kw: Any
) -> TaskEnv:
    return TaskEnv(
        plan=plan,
        generation=generation,
        mode="aligned",
        writer=transport.writer(client_id=f"{plan.job}-g{generation}-{os.getpid()}"),
        reader_factory=lambda group: transport.reader(group_id=group),
        store=SnapshotStore(snapshot_url),
        uploads=ThreadPoolExecutor(1),
        fault=lambda _point: None,
        end_offsets=None,
        **kw,
    )


def read_until(task: Task, count: int, timeout: float = 60.0) -> None:
    """Steps ``task`` until it has read ``count`` records in all."""
    deadline = time.monotonic() + timeout
    while task.stats()["in"] < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{task.name} read {task.stats()['in']} of {count} records")
        task.step(0.1, 500)


def acked(task: Task, *checkpoint_ids: int, timeout: float = 60.0) -> dict[int, str]:
    """Steps ``task`` until its snapshots of ``checkpoint_ids`` are uploaded; their paths."""
    found: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found.update((chk, handle.path) for chk, handle in task.ready_acks())
        if all(chk in found for chk in checkpoint_ids):
            return found
        task.step(0.1, 500)
    raise TimeoutError(f"{task.name}: snapshots of {checkpoint_ids}, found only {sorted(found)}")


def main(argv: list[str]) -> None:
    brokers, job, source_topic, snapshot_url = argv
    settings = KafkaSettings(brokers=brokers, client_config={"linger.ms": ZOMBIE_LINGER_MS})
    transport = KafkaTransport(settings)
    plan = plan_of(job, source_topic)
    env = task_env(plan, transport, snapshot_url, generation=1)
    task = Task(env, plan.stage_of("clicks"), 0)
    counts = {source_topic: 1}
    task.open(None, counts)
    first = int(transport.end_offsets([(source_topic, 0)])[(source_topic, 0)])
    read_until(task, first)
    task.trigger(1)
    path = acked(task, 1)[1]
    env.writer.flush()  # generation 1's records up to barrier 1 are in the channel
    print(f"checkpoint1 {path}", flush=True)
    sys.stdin.readline()
    total = int(transport.end_offsets([(source_topic, 0)])[(source_topic, 0)])
    read_until(task, total)
    print(f"queued {total - first}", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)  # frozen, with the records in librdkafka's queue
    env.writer.flush()  # woken up: the process goes on, and so does its producer
    print("done", flush=True)
    task.close()


if __name__ == "__main__":
    main(sys.argv[1:])
