"""The Spark runner with its executors on separate hosts, and one host cut off (issue 39).

The hosts are network namespaces on a bridge (:class:`processor.testing.hosts.Hosts`), each with
an address and a host name of its own and a Spark worker JVM in it; the driver, the master,
Kafka (Tansu) and the snapshot store (moto's S3 server: the hosts share no snapshot
directory) listen on the bridge's address of this machine. The job's output is the file sink's,
on the disk the namespaces do share (it is read here, not by the hosts).

The fault: while the job runs, the link of a host whose worker task reads a source and writes
into a channel goes down. Nothing is closed: the driver's control connection, the executor's
heartbeats and Kafka's connections just go silent, and the worker there keeps processing what it
had fetched, queueing channel records it cannot deliver. The driver notices the silence
(heartbeat timeout), cancels the generation, cannot reach or kill that worker (another host),
waits for it, and starts the next generation on the host left. Then the link comes back: the
zombie's queued channel records reach Kafka after the new generation's marker, and the readers
must drop them (docs/failures.md, the incarnation fence). Exactly once, checked against the
answer computed from the input; the fence is seen doing it in the readers' logs.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from processor.embedded.servers import start_tansu
from processor.embedded.spark_cluster import SparkCluster, start_spark_cluster
from processor.runtime.supervision.runner import Runner
from processor.runtime.supervision.spark import SparkOptions
from processor.testing.chaos import hold_final, input_read
from processor.testing.hosts import Hosts, hosts_unavailable
from tests.e2e.harness import (
    assert_exactly_once,
    chaos_seed,
    expected,
    expected_running_totals,
    run_chaos,
)
from tests.integration.s3_server import S3Server, running_s3_server

pytestmark = [
    pytest.mark.integration,
    pytest.mark.chaos,
    pytest.mark.spark,
    pytest.mark.slow,
    pytest.mark.xdist_group("spark"),
]

FENCED = re.compile(r"channel record of a fenced writer dropped")


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    reason = hosts_unavailable()
    if reason is not None:
        pytest.skip(f"no separate hosts on this machine: {reason}")
    with Hosts(2) as made:
        yield made


class Partition(threading.Thread):
    """Cuts off the host of worker 0 once the job completed 2 checkpoints and read a quarter of
    its input; mends it once the next generation completed a checkpoint; holds the final
    checkpoint until the zombie's records had ``settle_s`` to arrive."""

    def __init__(self, runner: Runner, hosts: Hosts, records: int, settle_s: float = 8.0):
        super().__init__(name="partition", daemon=True)
        self.runner, self.hosts, self.records, self.settle_s = runner, hosts, records, settle_s
        self.done = threading.Event()
        self.cut_at: float | None = None
        self.mended_at: float | None = None
        self.cut_host = ""
        self.completed_at_cut = 0
        hold_final(runner, lambda: not self.done.is_set(), hold_s=400.0)

    def run(self) -> None:
        runner = self.runner
        try:
            while not self._due():
                time.sleep(0.05)
            worker = runner.workers[0]
            host = self.hosts.by_name(worker.host)
            generation = runner.generation
            self.cut_host, self.cut_at = host.name, time.monotonic()
            self.completed_at_cut = runner.coordinator.stats.completed
            self.hosts.cut(host)
            print(f"cut {host.name} ({host.address}) in generation {generation}")
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and not (
                runner.generation > generation and self._completed_since()
            ):
                time.sleep(0.1)
            self.hosts.mend(host)
            self.mended_at = time.monotonic()
            print(f"mended {host.name} in generation {runner.generation}")
            time.sleep(self.settle_s)
        finally:
            self.done.set()

    def _due(self) -> bool:
        runner = self.runner
        coordinator = getattr(runner, "coordinator", None)  # once the job started
        if coordinator is None or coordinator.stats.completed < 2 or not runner.workers:
            return False
        read = input_read(runner, self.records)
        return read is not None and read >= 0.25

    def _completed_since(self) -> bool:
        """The next generation completed a checkpoint of its own since the cut."""
        return self.runner.coordinator.stats.completed > self.completed_at_cut


def test_a_host_cut_off_with_queued_channel_records_is_fenced_and_exactly_once(
    hosts: Hosts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    router = hosts.router
    monkeypatch.setenv("SPARK_LOCAL_IP", router)
    broker = start_tansu(tmp_path, owned=True, host=router)
    s3: S3Server
    with (
        running_s3_server(router) as s3,
        start_spark_cluster(
            cores=2,
            host=router,
            worker_hosts=[(h.address, h.name) for h in hosts.hosts],
            conf={"spark.worker.timeout": "10"},
        ) as cluster,
    ):
        for name, value in s3.environ().items():  # the driver's snapshot store; the workers
            monkeypatch.setenv(name, value)  # get them from the job's environment
        _run(cluster, hosts, broker.url, s3, tmp_path)


def _run(cluster: SparkCluster, hosts: Hosts, brokers: str, s3: S3Server, tmp: Path) -> None:
    seed = chaos_seed()
    records = 80_000
    bucket = s3.bucket()
    spark = SparkOptions(
        master=cluster.master_url,
        control_host=hosts.router,
        conf={
            "spark.pyspark.python": sys.executable,
            "spark.driver.host": hosts.router,
            "spark.driver.bindAddress": hosts.router,
            # An executor silent for 20 s is lost (default 120 s); the job is restarted by
            # the driver's own heartbeat timeout before that.
            "spark.network.timeout": "20s",
            "spark.executor.heartbeatInterval": "2s",
            "spark.network.timeoutInterval": "5s",
        },
    )
    partitions: list[Partition] = []

    def partition(runner: Runner) -> None:
        cut = Partition(runner, hosts, records)
        partitions.append(cut)
        cut.run()

    run = run_chaos(
        "running_total_work.py",
        brokers=brokers,
        tmp=tmp,
        records=records,
        seed=seed,
        mode="aligned",
        env={"WORK_US": "250", **s3.environ()},
        runner="spark",
        spark=spark,
        run_options={"snapshot_url": f"s3://{bucket}/eosflow", "heartbeat_timeout": 6.0},
        during=partition,
    )
    (cut,) = partitions
    fenced = sum(len(FENCED.findall(text)) for text in run.logs.values())
    print(
        f"seed={seed} cut {cut.cut_host}; restarts={run.result.restarts} "
        f"causes={run.result.restart_causes}; fenced warnings={fenced}"
    )
    assert cut.cut_at is not None and cut.mended_at is not None, "the host was never cut"
    assert run.result.restarts >= 1, run.result.restart_causes
    assert_exactly_once(expected(expected_running_totals, records, seed), run.output, seed=seed)
    assert fenced >= 1, "the zombie's channel records never reached a reader: nothing was fenced"
