"""``eosflow certify``: run a user's pipeline under faults and compare every committed output
with a fault-free run's.

The steps (docs/testing.md, "eosflow certify"):

1. snapshot the input (:mod:`processor.certify.inputs`) so that every run reads the same
   records;
2. run the pipeline twice without faults: the reference output, and a second one that must
   equal it (else the pipeline is not deterministic and no fault run could be judged);
3. run it ``--runs`` times with faults (:mod:`processor.certify.plan`), each run with its own
   job name and destinations (:mod:`processor.runtime.redirect`);
4. compare each run's committed output with the reference, per sink, as multisets, and per key
   in order where the sink keeps a key's order.
"""

from __future__ import annotations

import contextlib
import random
import re
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from processor.certify.destinations import (
    appended,
    check_readable,
    cleanup,
    free_redis_db,
    prepare_outputs,
)
from processor.certify.inputs import copy_topic, load_lines
from processor.certify.plan import FAULT_KINDS, RunPlan, plan_runs
from processor.certify.report import Report, RunOutcome, SinkCheck
from processor.certify.services import Services, services
from processor.errors import ConfigError, EosflowError
from processor.runtime.job import RunOptions
from processor.runtime.pipeline import load_flow
from processor.runtime.redirect import Rewrite, redirected, sink_steps
from processor.runtime.supervision.preflight import extra_environ
from processor.testing.chaos import (
    Killer,
    Outage,
    RecoveryClock,
    hold_final,
    on_driver_thread,
)
from processor.testing.compare import Output, diff, order_diff
from processor.testing.outputs import ORDERED, read_output

__all__ = ["CertifyOptions", "certify"]

FAULT_LINE = re.compile(r"fault injection: SIGKILL worker=(\d+) point=([\w-]+)")


@dataclass
class CertifyOptions:
    """What ``eosflow certify`` does; see ``eosflow certify --help``."""

    pipeline: str
    runs: int | None = None  # default: one per applicable fault kind
    faults: tuple[str, ...] = FAULT_KINDS
    runner: str = "local"
    workers: int = 2
    checkpoint_interval: float = 0.5
    mode: str = "aligned"
    recovery: str = "global"
    kills: int = 3
    outage_s: float = 5.0
    pace_s: float = 10.0
    seed: int | None = None
    inputs: dict[str, Path] = field(default_factory=dict)
    partitions: int = 4
    input_key: str | None = None
    side_outputs: list[Path] = field(default_factory=list)
    workdir: Path | None = None
    keep: bool = False
    verbose: bool = False
    out: TextIO = sys.stderr

    def validate(self) -> None:
        unknown = [f for f in self.faults if f not in FAULT_KINDS]
        if unknown or not self.faults:
            raise ConfigError(
                f"--faults {','.join(self.faults)}: choose among {','.join(FAULT_KINDS)}"
            )
        if self.runs is not None and self.runs < 1:
            raise ConfigError(f"--runs must be at least 1, got {self.runs}")
        if self.runner not in ("local", "spark"):
            raise ConfigError(f"--runner {self.runner!r}: use local or spark")
        if self.pace_s < 0:
            raise ConfigError(f"--pace must be 0 (full speed) or positive, got {self.pace_s}")
        if self.partitions < 1:
            raise ConfigError(f"--partitions must be at least 1, got {self.partitions}")


def certify(options: CertifyOptions) -> Report:
    """Runs the whole certification and returns its report (``report.verdict``)."""
    options.validate()
    seed = options.seed if options.seed is not None else random.SystemRandom().randrange(10**6)
    flow = load_flow(options.pipeline)
    sinks = sink_steps(flow)
    steps = flow.steps
    keyed = {name: steps[steps[name].parents[0]].keyed for name in sinks if name in steps}
    uses_redis = (
        options.recovery == "local"
        or any(s.kind == "dedup" for s in steps.values())
        or any(type(s).__name__ == "RedisSink" for s in sinks.values())
    )
    uses_postgres = any(type(s).__name__ == "PostgresSink" for s in sinks.values())
    compared = {n: s for n, s in sinks.items() if type(s).__name__ != "ConsoleSink"}
    if not compared and not options.side_outputs:
        raise ConfigError(
            f"pipeline {options.pipeline!r} writes only to the console: certify compares what "
            "sinks commit; give it a FileSink, KafkaSink, PostgresSink or RedisSink (or "
            "--side-output FILE for a file it appends to)"
        )
    probe = Rewrite(job=flow.name, prefix="eosflow-certify-probe", outputs=".")
    for name, sink in compared.items():
        redirected(sink, name, probe)  # a sink certify cannot redirect fails here, not later
    tag = secrets.token_hex(3)
    report = Report(options.pipeline, flow.name, seed, options.runner, options.workers)
    with (
        _workdir(options, report) as workdir,
        services(workdir, redis=uses_redis, postgres=uses_postgres) as svc,
    ):
        report.servers = dict(svc.origin)
        check_readable(compared, svc)
        kinds = []
        for kind in options.faults:
            why = svc.why_not(kind)
            if why:
                report.skipped[kind] = why
            else:
                kinds.append(kind)
        if not kinds:
            raise ConfigError(
                f"none of the faults {list(options.faults)} is possible here: {report.skipped}"
            )
        rng = random.Random(seed)
        plans = plan_runs(
            kinds,
            options.runs or len(kinds),
            workers=options.workers,
            kills=options.kills,
            outage_s=options.outage_s,
            rng=rng,
        )
        with extra_environ(svc.environ()):
            topics = _snapshot_inputs(flow, options, svc, tag, report)
            reference: dict[str, list[Output]] | None = None
            for plan in plans:
                outcome = _run(plan, options, svc, workdir, tag, topics, report, compared, keyed)
                report.runs.append(outcome)
                if outcome.error is None and reference is not None:
                    outcome.checks = _compare(outcome.outputs, reference, compared, keyed)
                _say(options, outcome.line())
                if outcome.error is not None:
                    if plan.kind is None:
                        report.verdict = "ERROR"
                        break
                    continue
                if reference is None:
                    reference = outcome.outputs
                    if not any(reference.values()):
                        outcome.error = (
                            "the run without faults committed no output at all, so every run "
                            "would agree: check that the pipeline's sinks receive records "
                            f"from the input ({report.inputs})"
                        )
                        report.verdict = "ERROR"
                        break
                    continue
                if plan.name == "det" and not outcome.ok:
                    report.verdict = "NONDETERMINISTIC"
                    break
        if not report.verdict:
            report.verdict = "PASS" if all(r.ok for r in report.runs) else "FAIL"
        if not options.keep:
            cleanup(svc, tag, report)
        keep = options.keep or options.workdir is not None or report.verdict != "PASS"
        report.workdir = str(workdir) if keep else ""
    return report


@contextlib.contextmanager
def _workdir(options: CertifyOptions, report: Report) -> Iterator[Path]:
    """``--workdir``, else a temporary directory deleted afterwards unless ``--keep`` or the
    verdict is not ``PASS`` (then its worker logs and outputs explain what happened)."""
    if options.workdir is not None:
        options.workdir.mkdir(parents=True, exist_ok=True)
        yield options.workdir.resolve()  # servers chdir into it
        return
    path = Path(tempfile.mkdtemp(prefix="eosflow-certify-"))
    try:
        yield path
    finally:
        if not options.keep and report.verdict == "PASS":
            shutil.rmtree(path, ignore_errors=True)


def _say(options: CertifyOptions, text: str) -> None:
    print(text, file=options.out, flush=True)


def _snapshot_inputs(
    flow: Any, options: CertifyOptions, svc: Services, tag: str, report: Report
) -> dict[str, str]:
    from connectors import KafkaSettings

    settings = KafkaSettings.from_env(brokers=svc.kafka)
    topics: dict[str, str] = {}
    for step in flow.steps.values():
        if step.kind != "source":
            continue
        source = step.params["topic"]
        target = f"eosflow-certify-{tag}-in-{source}"
        started = time.monotonic()
        if source in options.inputs:
            file = options.inputs[source]
            count, parts = (
                load_lines(settings, file, target, options.partitions, options.input_key),
                options.partitions,
            )
            origin = str(file)
        else:
            count, parts = copy_topic(settings, source, target)
            origin = f"topic {source}"
        topics[source] = target
        report.inputs[source] = {"records": count, "partitions": parts, "from": origin}
        _say(
            options,
            f"input {source}: {count:,} records in {parts} partitions from {origin} "
            f"({time.monotonic() - started:.1f}s)",
        )
    unused = set(options.inputs) - set(topics)
    if unused:
        raise ConfigError(f"--input names {sorted(unused)}, which no source of the pipeline reads")
    return topics


def _run(
    plan: RunPlan,
    options: CertifyOptions,
    svc: Services,
    workdir: Path,
    tag: str,
    topics: dict[str, str],
    report: Report,
    sinks: dict[str, Any],
    keyed: dict[str, bool],
) -> RunOutcome:
    from processor.runtime.supervision.local import LocalRunner

    job = f"{report.job[:40]}-c{tag}-{plan.name}"
    has_redis_sink = any(type(s).__name__ == "RedisSink" for s in sinks.values())
    used = {r.redis_db for r in report.runs if r.redis_db is not None}
    rewrite = Rewrite(
        job=job,
        prefix=f"eosflow-certify-{tag}-{plan.name}",
        topics=topics,
        outputs=str(workdir / f"run-{plan.name}" / "out"),
        redis_db=free_redis_db(svc.redis, used) if has_redis_sink and svc.redis else None,
    )
    outcome = RunOutcome(plan.name, plan.describe(), job=job, redis_db=rewrite.redis_db)
    try:
        copies = prepare_outputs(sinks, rewrite, svc)
        outcome.tables = [
            ".".join(c.table) for c in copies.values() if type(c).__name__ == "PostgresSink"
        ]
    except EosflowError as exc:
        outcome.error = f"preparing the outputs failed: {exc}"
        return outcome
    side_sizes = {p: (p.stat().st_size if p.exists() else 0) for p in options.side_outputs}
    run_options = RunOptions(
        workers=options.workers,
        checkpoint_interval=options.checkpoint_interval,
        mode=options.mode,
        until_idle=True,
        environ={**svc.environ(), **rewrite.to_env()},
        state_dir=str(workdir / "state"),
        faults=list(plan.faults),
        max_restarts=len(plan.faults) + plan.kills + 10,
        recovery=options.recovery,
        restart_backoff=0.1,
        max_backoff=0.5,
        progress=options.out if options.verbose else None,
    )
    records = sum(int(i["records"]) for i in report.inputs.values())
    # Fault runs read at a pace so that faults land while the input flows; so does the second
    # fault-free run, so that an output that depends on timing differs there already (the
    # reference runs at full speed: two speeds, two interleavings of the partitions).
    if plan.name != "ref" and options.pace_s > 0:
        run_options.max_rate = max(1.0, records / options.workers / options.pace_s)
    started = time.monotonic()
    try:
        if options.runner == "spark":
            from processor.runtime.supervision.spark import SparkRunner

            runner: Any = SparkRunner(options.pipeline, run_options)
        else:
            runner = LocalRunner(options.pipeline, run_options)
    except EosflowError as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
        return outcome
    threads: list[Any] = [RecoveryClock(runner)]
    if plan.kind == "protocol-points":
        hold_final(runner, _chain_pending(runner, len(plan.faults), options.checkpoint_interval))
    elif plan.kind == "kill":
        killer = Killer(
            runner,
            kills=plan.kills,
            start_after=0,
            rng=random.Random(report.seed + len(report.runs)),
            records=records,
            plan=plan.kill_plan,
        )
        killer.hold_final()
        threads.append(killer)
    elif plan.kind in ("broker-partition", "redis-restart"):
        begin: Callable[[], None]
        end: Callable[[], None]
        if plan.kind == "broker-partition":
            assert svc.proxy is not None
            begin, end = svc.proxy.black_hole, svc.proxy.heal
        else:  # the new Redis is started by the job's thread: the fault thread ends soon
            begin, end = svc.stop_redis, lambda: on_driver_thread(runner, svc.start_redis)
        outage = Outage(
            runner,
            records=records,
            at=plan.outage_at,
            seconds=options.outage_s,
            begin=begin,
            end=end,
            name=plan.kind,
        )
        hold_final(runner, outage.pending)
        threads.append(outage)
    for t in threads:
        t.start()
    try:
        result = runner.run()
        outcome.restarts, outcome.causes = result.restarts, list(result.restart_causes)
        outcome.checkpoints = result.checkpoints
    except (EosflowError, RuntimeError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
        outcome.restarts = runner.restarts
        outcome.causes = list(runner.restart_causes)
    finally:
        for t in threads:
            t.stop.set()
        for t in threads:
            t.join(30)
        if svc.proxy is not None:
            svc.proxy.heal()
    outcome.seconds = round(time.monotonic() - started, 2)
    clock = threads[0]
    outcome.recovery_s = list(clock.times)
    logs = {p.name: p.read_text(errors="replace") for p in runner.dir.glob("worker-*.log")}
    outcome.fired = sorted(
        {m.group(2) for text in logs.values() for m in FAULT_LINE.finditer(text)},
        key=[f.point for f in plan.faults].index if plan.faults else None,
    )
    if plan.kind == "protocol-points":
        outcome.not_reached = [f.point for f in plan.faults if f.point not in outcome.fired]
    for t in threads[1:]:
        if isinstance(t, Killer):
            outcome.injected = len(t.done)
        elif isinstance(t, Outage):
            outcome.injected = int(t.ended is not None)
            if t.error is not None:
                outcome.error = outcome.error or f"injecting the {t.name} failed: {t.error!r}"
    if outcome.error is None:
        try:
            # The Redis sinks of a run share its database: read it once, under all their names.
            redis = [n for n, c in copies.items() if type(c).__name__ == "RedisSink"]
            outcome.outputs = {
                name: read_output(copy, keyed=keyed.get(name, False))
                for name, copy in copies.items()
                if name not in redis[1:]
            }
            if len(redis) > 1:
                outcome.outputs["+".join(sorted(redis))] = outcome.outputs.pop(redis[0])
            for path, size in side_sizes.items():
                outcome.outputs[f"side:{path}"] = appended(path, size)
        except (EosflowError, OSError, TimeoutError) as exc:
            outcome.error = f"reading the committed output failed: {exc}"
    return outcome


def _chain_pending(runner: Any, faults: int, interval: float) -> Any:
    """Whether a protocol-point chain may still fire: fewer restarts than faults, and the
    current start is young enough to reach its point (one the pipeline never reaches must not
    keep the job waiting: ten checkpoint intervals and 10 s)."""
    patience = 10 * interval + 10.0
    seen = {"restarts": -1, "since": 0.0}

    def pending() -> bool:
        if runner.restarts != seen["restarts"]:
            seen["restarts"], seen["since"] = runner.restarts, time.monotonic()
        return bool(runner.restarts < faults and time.monotonic() - seen["since"] < patience)

    return pending


def _compare(
    outputs: dict[str, list[Output]],
    reference: dict[str, list[Output]],
    sinks: dict[str, Any],
    keyed: dict[str, bool],
) -> list[SinkCheck]:
    checks = []
    for name, want in reference.items():
        got = outputs.get(name, [])
        found = diff(got, want)
        check = SinkCheck(name, found.counts(), str(found) if not found.ok else "")
        kind = type(sinks[name]).__name__ if name in sinks else "other"
        if kind in ORDERED and any(r.key is not None for r in want):
            order = order_diff(got, want)
            check.order_keys, check.out_of_order = order["keys"], order["out_of_order"]
            check.order_example = order["example"]
        checks.append(check)
    return checks
