"""One measured eosflow job: run a pipeline until idle and say how fast it went.

Throughput is ``records / (seconds - ready_s)``: ``seconds`` is the runner's wall time from its
construction to the end of the job (final checkpoint committed, workers stopped) and ``ready_s``
the start-up part of it (compiling, creating channel topics, spawning the worker processes,
importing the pipeline in them, restoring, opening every reader, until every worker of the first
generation is connected). Start-up is a fixed cost of a second or so that does not depend on the
checkpoint mode; leaving it in would make every run look slower the shorter it is. What remains
is processing plus the final checkpoint and commit, which every mode pays ("none" included: it
takes one checkpoint at the end), so it is the steady-state rate of an exactly-once job.

CPU time is recorded too: the worker processes' (the runner reaps them, so they count in this
process's ``RUSAGE_CHILDREN``), the coordinator's (this process) and the broker's (read from
``/proc``), which tells a CPU-bound run from one that waits.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from processor.runtime.supervision.local import LocalRunner, RunOptions
from processor.runtime.supervision.runner import Runner

__all__ = ["broker_cpu_s", "check_output", "drop_channel_topics", "make_runner", "run_job"]


def make_runner(kind: str, pipeline: Path, options: RunOptions) -> Runner:
    """``local``, ``spark`` (``local[workers]``) or a standalone cluster's ``spark://`` master
    on this machine (the executors run this interpreter; the driver binds loopback)."""
    if kind == "spark" or kind.startswith("spark://"):
        from processor.runtime.supervision.spark import SparkOptions, SparkRunner

        if kind == "spark":
            return SparkRunner(pipeline, options)
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        cluster = SparkOptions(
            master=kind, control_host="127.0.0.1", conf={"spark.pyspark.python": sys.executable}
        )
        return SparkRunner(pipeline, options, cluster)
    return LocalRunner(pipeline, options)


def drop_channel_topics(runner: Runner) -> None:
    """Deletes the job's channel topics: the embedded broker keeps everything in memory, and a
    broker that grows run after run would bias the later runs of the schedule."""
    from connectors import KafkaSettings, TopicAdmin

    admin = TopicAdmin(KafkaSettings.from_env(environ=runner.options.environ))
    admin.delete_topics([e.topic for e in runner.plan.edges])


def broker_cpu_s() -> float:
    """CPU seconds used so far by the brokers on this machine: the Tansu processes this
    process started, and any Apache Kafka broker running here (a JVM whose main class is
    ``kafka.Kafka``, e.g. one named by ``EOSFLOW_KAFKA_BROKERS`` on loopback). 0 if none: a
    remote broker's CPU is not seen."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        # fields[1] is the ppid; fields[11], fields[12] are utime and stime (proc(5))
        ours = int(fields[1]) == me and b"tansu" in cmdline
        if ours or b"\0kafka.Kafka\0" in cmdline:
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def _cpu() -> tuple[float, float, float]:
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    me = resource.getrusage(resource.RUSAGE_SELF)
    return (
        children.ru_utime + children.ru_stime,
        me.ru_utime + me.ru_stime,
        broker_cpu_s(),
    )


def _count_lines(directory: str, pattern: str = "part-*") -> int:
    lines = 0
    for path in Path(directory).glob(pattern):
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                lines += chunk.count(b"\n")
    return lines


def check_output(pipeline: str, directory: str, records: int) -> str:
    """``ok``, or what is wrong with the committed output of a finished job.

    keyed_count and join_enrich emit one line per click; six_ops and session_count emit window
    counts whose values add up to the number of clicks (which tier a click lands in depends on
    the interleaving of channels, the total does not). Output left in uncommitted ``.inprogress``
    files is reported: a job that says it finished must have committed everything.
    """
    import orjson

    if pipeline in ("keyed_count", "join_enrich"):
        got = _count_lines(directory)
    else:
        got = 0
        for path in Path(directory).glob("part-*"):
            for line in path.read_bytes().splitlines():
                got += orjson.loads(line)[1]["value"]
    if got == records:
        return "ok"
    pending = _count_lines(directory, ".part-*.inprogress")
    per_click = pipeline in ("keyed_count", "join_enrich")
    what = "clicks committed" if per_click else "clicks in committed windows"
    return f"INCOMPLETE: {got:,} of {records:,} {what}; {pending:,} lines left uncommitted"


def _nearest_rank(ordered: list[float], q: float) -> float:
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def run_job(
    pipeline: Path,
    *,
    environ: dict[str, str],
    state_dir: str,
    mode: str,
    interval: float | None,
    records: int,
    workers: int = 2,
    progress: Any = None,
    runner: str = "local",
) -> dict[str, Any]:
    """Runs ``pipeline`` until idle; returns the measurements of the run.

    ``interval`` is ignored (and may be ``None``) in mode ``none``. On ``runner="spark"`` the
    worker CPU is not measured (the workers are the JVM's children, reaped by it): ``None``.
    """
    options = RunOptions(
        workers=workers,
        checkpoint_interval=interval or 1.0,
        mode=mode,
        until_idle=True,
        environ=environ,
        state_dir=state_dir,
        progress=progress,
    )
    load = os.getloadavg()[0]
    job = make_runner(runner, pipeline, options)  # applies options.environ while loading
    cpu_before = _cpu()
    result = job.run()
    cpu_after = _cpu()
    with contextlib.suppress(Exception):  # cleanup only; a failure here must not lose the run
        drop_channel_topics(job)
    steady = result.seconds - result.ready_s
    durations = sorted(result.checkpoint_durations)
    used = [b - a for a, b in zip(cpu_before, cpu_after, strict=True)]
    workers_cpu: float | None = used[0] if runner == "local" else None
    coordinator_cpu, broker_cpu = used[1:]
    return {
        "job": result.job,
        "runner": runner,
        "spark_start_s": getattr(getattr(job, "spark", None), "spark_start_s", None),
        "mode": mode,
        "interval_s": interval if mode != "none" else None,
        "records": records,
        "records_in": result.records_in,
        "records_out_reported": result.records_out,
        "output_lines": _count_lines(environ["OUTPUT_DIR"]),
        "output_check": check_output(pipeline.stem, environ["OUTPUT_DIR"], records),
        "seconds": result.seconds,
        "ready_s": result.ready_s,
        "steady_s": steady,
        "records_per_s": records / steady if steady > 0 else 0.0,
        # input only: start-up and the final checkpoint + shutdown both left out
        "input_s": result.final_trigger_s - result.ready_s,
        "input_records_per_s": records / (result.final_trigger_s - result.ready_s),
        "checkpoints": result.checkpoints,
        "checkpoint_ms_median": 1000 * statistics.median(durations) if durations else None,
        "checkpoint_ms_p95": 1000 * _nearest_rank(durations, 0.95) if durations else None,
        "checkpoint_ms_max": 1000 * durations[-1] if durations else None,
        "checkpoint_ms": [round(1000 * d) for d in result.checkpoint_durations],
        "restarts": result.restarts,
        "workers_cpu_s": workers_cpu,
        "coordinator_cpu_s": coordinator_cpu,
        "broker_cpu_s": broker_cpu,
        "loadavg_1m_before": load,
        "finished_at": time.time(),
    }
