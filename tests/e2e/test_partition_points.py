"""The broker partitioned while a worker sits at an exact protocol point (issue 17).

``tests/e2e/test_partitions.py`` places its partitions by progress. Here a ``hold`` fault
(:class:`processor.runtime.job.Fault`, action ``hold``) stops worker 1 at a named point: in the
middle of a barrier alignment, just before its sink's ``prepare``, or between a checkpoint's
completion and its sink's commit. The test sees the worker's ``reached`` file, black-holes the
broker behind the :class:`processor.testing.FaultProxy` (every client connection of the job goes
through it), keeps it partitioned for 5 s (45 s: ``slow``, past librdkafka's 30 s request and
socket timeouts), heals it, and only then releases the worker: the held step runs over
connections that were stalled (5 s) or torn down and re-made (45 s), while the other worker
ran into the partition on its own. A second variant releases the worker 1 s into the
partition, so that the held step itself (the staged sink's ``prepare`` flush, its commit's
publish) meets the partition.

The job is the running total into the file sink or into the staged Kafka sink (read through
the dedup consumer: exact on every broker; the transactional sink's aborted records stay
visible to ``read_committed`` readers on Tansu, the broker these tests need). It must finish
``--until-idle`` with the committed output equal to the expectation computed from the click
generator alone, or fail loudly; every wait is bounded. Each test prints its report: restarts
and their causes, checkpoints, seconds from heal and from release to the next completed
checkpoint.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from connectors import KafkaSettings
from connectors.admin import TopicAdmin
from processor.runtime.job import Fault
from processor.runtime.supervision.runner import Runner
from processor.runtime.supervision.worker import hold_paths
from processor.testing import BrokerBehindProxy
from tests.e2e.harness import (
    assert_exactly_once,
    chaos_seed,
    expected,
    expected_running_totals,
    run_chaos,
)
from tests.e2e.test_partitions import _check_logs, _config_file
from tests.integration.test_sinks_kafka import read_topic

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

_WORKER = 1
#: The reach of each point to hold at: late enough that a checkpoint completed before (the
#: restore has something to go back to), early enough that the input is far from drained.
_NTH = {"mid-alignment": 3, "before-prepare": 3, "after-completion-before-commit": 2}
_POINTS = list(_NTH)
#: README command 2 holds one point per sink, and releases one held step into the partition;
#: the rest of the matrix runs in CI's crash tier (marker ``crash``).
_COMMAND_2 = {("mid-alignment", "file"), ("after-completion-before-commit", "staged-kafka")}
_COMMAND_2_MEETS = {"before-prepare"}


def _points_by_sink() -> list[Any]:
    return [
        pytest.param(
            point,
            sink,
            id=f"{point}-{sink}",
            marks=[] if (point, sink) in _COMMAND_2 else [pytest.mark.crash],
        )
        for sink in ("file", "staged-kafka")
        for point in _POINTS
    ]


def _points_meeting() -> list[Any]:
    return [
        pytest.param(
            point, id=point, marks=[] if point in _COMMAND_2_MEETS else [pytest.mark.crash]
        )
        for point in _POINTS
    ]


#: Bounds: the worker must reach the point within this long of the test's start...
_REACH_S = 120.0
#: ...and the job must complete a checkpoint within this long of the release.
_RECOVER_S = 300.0


def _hold_and_partition(
    broker: BrokerBehindProxy,
    point: str,
    seconds: float,
    report: dict[str, Any],
    *,
    release_after: float | None,
) -> Callable[[Runner], None]:
    """Waits for worker 1 to hold at ``point``, black-holes the broker for ``seconds``, heals
    it, and releases the worker (``release_after`` seconds into the partition instead, when
    given); then measures the time to the next completed checkpoint. It never leaves the
    proxy broken or the worker held, whatever happens."""

    def during(runner: Runner) -> None:
        reached, release = hold_paths(runner.dir / "faults", point, _WORKER)
        deadline = time.monotonic() + _REACH_S
        try:
            while not reached.exists():
                if time.monotonic() > deadline:
                    return
                time.sleep(0.01)
            coordinator = runner.coordinator
            report["held"] = True
            report["completed_at_hold"] = coordinator.stats.completed
            report["restarts_at_hold"] = runner.restarts
            start = time.monotonic()
            broker.proxy.black_hole()
            released: float | None = None
            if release_after is not None:
                time.sleep(release_after)
                release.touch()
                released = time.monotonic()
                time.sleep(max(0.0, seconds - release_after))
            else:
                time.sleep(seconds)
            broker.proxy.heal()
            healed = time.monotonic()
            report["partition_s"] = round(healed - start, 1)
            report["completed_during"] = coordinator.stats.completed - report["completed_at_hold"]
            if released is None:
                release.touch()
                released = time.monotonic()
            at_heal = coordinator.stats.completed
            while time.monotonic() < released + _RECOVER_S:
                if runner.coordinator.stats.completed > at_heal or runner.final_chk is not None:
                    now = time.monotonic()
                    report["recovery_from_heal_s"] = round(now - healed, 1)
                    report["recovery_from_release_s"] = round(now - released, 1)
                    return
                time.sleep(0.05)
        finally:
            broker.proxy.heal()
            release.touch()

    return during


def _run(
    broker: BrokerBehindProxy,
    tmp: Path,
    *,
    sink: str,
    point: str,
    seconds: float,
    release_after: float | None = None,
) -> dict[str, Any]:
    seed = chaos_seed()
    records = 30_000
    report: dict[str, Any] = {}
    env = {"EOSFLOW_KAFKA_CONFIG": _config_file(tmp)}
    read_output: Callable[[dict[str, str]], list[Any]] | None = None
    if sink == "file":
        pipeline = "running_total_work.py"
        env["WORK_US"] = "250"
    else:
        pipeline = "running_total_kafka.py"
        settings = KafkaSettings(broker.brokers)
        topic = f"point-out-{uuid.uuid4().hex[:8]}"
        TopicAdmin(settings).ensure_topic(topic, 3)
        env.update(OUTPUT_TOPIC=topic, SINK_MODE="staged", WORK_US="300")

        def read_output(_job_env: dict[str, str]) -> list[Any]:
            msgs = read_topic(settings, topic, committed=True, dedup=True)
            return [[m.key().decode(), orjson.loads(m.value())] for m in msgs]

    run = run_chaos(
        pipeline,
        brokers=broker.brokers,
        tmp=tmp,
        records=records,
        seed=seed,
        mode="aligned",
        interval=0.5,
        faults=[Fault(0, _WORKER, point, _NTH[point], "hold")],
        env=env,
        read_output=read_output,
        during=_hold_and_partition(broker, point, seconds, report, release_after=release_after),
    )
    result = run.result
    held_log = run.logs.get(f"worker-{_WORKER}.log", "")
    report.update(
        restarts=result.restarts,
        checkpoints=result.checkpoints,
        seconds=round(result.seconds, 1),
        released_in_log=f"RELEASED worker={_WORKER} point={point}" in held_log,
    )
    print(
        f"seed={seed} {sink} sink, hold at {point}, partition {seconds}s, release "
        f"{'after heal' if release_after is None else f'{release_after}s in'}: {report}; "
        f"causes={result.restart_causes}"
    )
    assert report.get("held"), (
        f"seed={seed}: worker {_WORKER} never held at {point} (its {_NTH[point]}th reach) "
        f"within {_REACH_S}s: the test proved nothing; {report}"
    )
    assert_exactly_once(expected(expected_running_totals, records, seed), run.output, seed=seed)
    assert "recovery_from_release_s" in report, (
        f"seed={seed}: no checkpoint completed within {_RECOVER_S}s of the release: {report}"
    )
    _check_logs(run.logs, report)
    return report


@pytest.mark.parametrize(("point", "sink"), _points_by_sink())
def test_a_5s_partition_at_a_protocol_point_keeps_output_exactly_once(
    broker: BrokerBehindProxy, tmp_path: Path, point: str, sink: str
) -> None:
    """Held at the point for the whole partition, released after healing."""
    _run(broker, tmp_path, sink=sink, point=point, seconds=5.0)


@pytest.mark.parametrize("point", _points_meeting())
def test_a_5s_partition_meets_the_held_step_itself_exactly_once(
    broker: BrokerBehindProxy, tmp_path: Path, point: str
) -> None:
    """Released 1 s into the partition: the staged sink's ``prepare`` flush or its commit's
    publish runs while the broker is unreachable."""
    _run(broker, tmp_path, sink="staged-kafka", point=point, seconds=5.0, release_after=1.0)


@pytest.mark.slow
@pytest.mark.parametrize("sink", ["file", "staged-kafka"])
@pytest.mark.parametrize("point", _POINTS)
def test_a_45s_partition_at_a_protocol_point_keeps_output_exactly_once(
    broker: BrokerBehindProxy, tmp_path: Path, point: str, sink: str
) -> None:
    _run(broker, tmp_path, sink=sink, point=point, seconds=45.0)


@pytest.mark.slow
@pytest.mark.parametrize("point", _POINTS)
def test_a_45s_partition_meets_the_held_step_itself_exactly_once(
    broker: BrokerBehindProxy, tmp_path: Path, point: str
) -> None:
    _run(broker, tmp_path, sink="staged-kafka", point=point, seconds=45.0, release_after=1.0)
