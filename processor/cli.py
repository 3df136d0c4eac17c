"""The ``eosflow`` command.

::

    eosflow dev up [--services kafka,redis,postgres]   start embedded servers, print settings
    eosflow dev status                                 are they alive and answering?
    eosflow dev env                                    export lines: eval "$(eosflow dev env)"
    eosflow dev down                                   stop them by PID, remove their directories
    eosflow probe [--json]                             what the broker in use can do
    eosflow run PIPELINE.py [--workers N] [--checkpoint-interval 1s] [--mode aligned|unaligned]
                [--until-idle] [--runner local|spark] [--recovery global|local]
                                                       run a job (local processes or Spark)
    eosflow status [JOB] [--json] [--web]              a running (or the last) job's progress
    eosflow version

The CLI is the wiring: one of the few places in ``processor`` allowed to import ``sinks`` and
``connectors`` (docs/architecture.md, "Layers").
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence

from dedup.errors import DedupError
from processor import __version__, cli_jobs
from processor.embedded import (
    ENV_VARS,
    SERVICES,
    DevCluster,
    endpoint_answers,
    servers,
    state_file,
)
from processor.embedded._process import is_running
from processor.errors import EosflowError
from processor.runtime.job import DEFAULT_MAX_IDS, parse_alignment, parse_duration, parse_map_state

__all__ = ["main"]

log = logging.getLogger("eosflow")


class _Removed(argparse.Action):
    """``--recovery-horizon``: gone with issue 49; says what replaced it."""

    def __call__(self, parser: argparse.ArgumentParser, *_args: object, **_kw: object) -> None:
        parser.error(
            "--recovery-horizon was removed: local recovery no longer forgets record IDs by "
            "event time (a re-emitted copy is never passed unchecked). Drop the option; the "
            "bound is now --recovery-max-ids N (docs/local-recovery.md)"
        )


def _configure_logging(verbose: int) -> None:
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(
        level=max(level, logging.DEBUG),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )


def _exports(cluster: DevCluster) -> list[str]:
    return [f"export {k}={v}" for k, v in cluster.endpoints("dev").as_env().items()]


def _dev_up(args: argparse.Namespace) -> int:
    wanted = [s.strip() for s in args.services.split(",") if s.strip()]
    path = state_file()
    existing = DevCluster.load(path)
    if existing is not None and existing.servers:
        alive = existing.alive()
        if all(alive.values()) and set(wanted) <= set(existing.servers):
            print(f"eosflow dev servers already running (state: {path})")
            print("\n".join(_exports(existing)))
            return 0
        # Some died or more are wanted: stop what is left so ports and PIDs stay consistent.
        existing.stop()
    configured = []
    for service in [s for s in wanted if os.environ.get(ENV_VARS[s])]:
        name, value = ENV_VARS[service], os.environ[ENV_VARS[service]]
        if endpoint_answers(service, value):
            configured.append(service)
            print(f"{service}: using {name}={value} (not started)")
        else:  # issue 50: a shell that evaluated `eosflow dev env` before `dev down`
            print(
                f"{service}: {name}={value} does not answer (left from an earlier "
                f'`eval "$(eosflow dev env)"`?): starting a new {service}; run '
                '`eval "$(eosflow dev env)"` again, or unset the variable',
                file=sys.stderr,
            )
    to_start = [s for s in wanted if s not in configured]
    if not to_start:
        print("nothing to start: every service is given by its variable, and answers")
        return 0
    start = time.monotonic()
    cluster = DevCluster.start(to_start, owned=False)
    took = time.monotonic() - start
    cluster.save(path)
    for kind, server in cluster.servers.items():
        print(f"{kind:<9} {server.url:<50} pid={server.process.pid}")
    print(f"up in {took:.2f}s; state written to {path}")
    print("To point other shells at these servers:")
    print("\n".join(_exports(cluster)))
    return 0


def _dev_down(_args: argparse.Namespace) -> int:
    path = state_file()
    cluster = DevCluster.load(path)
    if cluster is None or not cluster.servers:
        print(f"no eosflow dev servers recorded in {path}")
        path.unlink(missing_ok=True)
        return 0
    for kind, server in cluster.servers.items():
        print(f"stopping {kind} pid={server.process.pid}")
    cluster.stop()
    path.unlink(missing_ok=True)
    print("all stopped")
    return 0


def _dev_status(_args: argparse.Namespace) -> int:
    path = state_file()
    cluster = DevCluster.load(path)
    if cluster is None or not cluster.servers:
        print(f"no eosflow dev servers recorded in {path}; start them with 'eosflow dev up'")
        return 1
    ok = True
    for kind, server in cluster.servers.items():
        alive = is_running(server.process)
        ok &= alive
        state = "running" if alive else "DEAD"
        print(f"{kind:<9} {state:<8} pid={server.process.pid:<8} {server.url}")
    for service in SERVICES:
        if os.environ.get(ENV_VARS[service]):
            print(f"note: {ENV_VARS[service]} is set and takes precedence for {service}")
    return 0 if ok else 1


def _dev_env(_args: argparse.Namespace) -> int:
    cluster = DevCluster.load(state_file())
    if cluster is None or not cluster.servers:
        print("# no eosflow dev servers running; start them with 'eosflow dev up'", file=sys.stderr)
        return 1
    print("\n".join(_exports(cluster)))
    return 0


def _probe(args: argparse.Namespace) -> int:
    from connectors import KafkaSettings, probe_broker  # CLI wiring: the allowed exception

    with servers(["kafka"]) as endpoints:
        assert endpoints.kafka_brokers is not None
        settings = KafkaSettings.from_env(brokers=endpoints.kafka_brokers)
        caps = probe_broker(settings)
        if args.json:
            print(json.dumps({**caps.as_dict(), "origin": endpoints.origin["kafka"]}, indent=2))
        else:
            if endpoints.origin["kafka"] == "embedded":
                print(
                    "(no broker configured: probed an embedded Tansu broker started for this call)"
                )
            print(caps.summary())
    return 0


def _run(args: argparse.Namespace) -> int:
    from processor.runtime.supervision.local import Fault, JobFailed, LocalRunner, RunOptions
    from processor.runtime.supervision.runner import Runner

    if args.runner == "local" and (args.master or args.conf or args.control_host):
        print(
            "eosflow: error: --master, --conf and --control-host are Spark settings; add "
            "--runner spark",
            file=sys.stderr,
        )
        return 2
    map_state = parse_map_state(args.map_state)  # before any server starts
    environ = RunOptions.parse_env(args.env)
    with servers(["kafka"]) as endpoints:
        options = RunOptions(
            workers=args.workers,
            checkpoint_interval=args.checkpoint_interval,
            mode=args.mode,
            until_idle=args.until_idle,
            drain=not args.no_drain,
            snapshot_url=args.snapshot_url,
            checkpoint_timeout=args.checkpoint_timeout,
            heartbeat_timeout=args.heartbeat_timeout,
            stop_timeout=args.stop_timeout,
            max_rate=args.max_rate,
            watermark_alignment=args.watermark_alignment,
            tolerable_failed_checkpoints=args.tolerable_failed_checkpoints,
            on_deleted_records=args.on_deleted_records,
            keep_checkpoints=args.keep_checkpoints,
            max_restarts=args.max_restarts,
            restart_window=args.restart_window,
            recovery=args.recovery,
            recovery_max_ids=args.recovery_max_ids,
            metrics=args.metrics,
            from_savepoint=args.from_savepoint,
            allow_rewind=args.allow_rewind,
            faults=[Fault.parse(f) for f in args.fault],
            map_state=map_state,
            allow_dropped_state=args.allow_dropped_state,
            start_over=args.start_over,
            force=args.force,
            takeover=args.takeover,
            takeover_timeout=args.takeover_timeout,
            environ={**endpoints.as_env(), **environ},
            progress=sys.stderr,
            log_level="DEBUG" if args.verbose > 1 else "INFO",
        )
        runner: Runner
        if args.runner == "spark":
            from processor.runtime.supervision.spark import SparkOptions, SparkRunner

            spark = SparkOptions(
                master=args.master,
                conf=SparkOptions.parse_conf(args.conf),
                control_host=args.control_host,
            )
            runner = SparkRunner(args.pipeline, options, spark)
        else:
            runner = LocalRunner(args.pipeline, options)
        if args.explain:
            print(runner.plan.describe())
            return 0
        if endpoints.origin.get("kafka") == "embedded":
            print(
                "note: no broker configured; using an embedded Tansu broker that lives as long "
                "as this command (set EOSFLOW_KAFKA_BROKERS or run 'eosflow dev up')",
                file=sys.stderr,
            )
        print(runner.plan.describe(), file=sys.stderr)
        try:
            result = runner.run()
        except JobFailed as exc:
            print(f"eosflow: job failed: {exc}", file=sys.stderr)
            return 1
        finally:
            # The run ended and gave the signals back; what is left (stopping the embedded
            # servers, the summary) is clean-up, which a stop signal must not turn into an
            # exit by SIGTERM (-15/143): Kubernetes signals a runner that --takeover stopped,
            # often just as it exits (seen in the rolling-deploy test).
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)
    print(
        f"job {result.job} finished: {result.records_in:,} records read, "
        f"{result.records_out:,} to sinks, {result.records_committed:,} committed, "
        f"{result.checkpoints} checkpoints (last {result.last_checkpoint}), "
        f"{result.restarts} restarts, {result.seconds:.1f}s"
    )
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eosflow", description=__doc__.split("::")[0].strip())
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv)")
    sub = parser.add_subparsers(dest="command", required=True)

    dev = sub.add_parser("dev", help="embedded servers for development")
    dev_sub = dev.add_subparsers(dest="dev_command", required=True)
    up = dev_sub.add_parser("up", help="start embedded servers on 127.0.0.1")
    up.add_argument(
        "--services",
        default=",".join(SERVICES),
        help=f"comma-separated subset of {','.join(SERVICES)} (default: all)",
    )
    up.set_defaults(func=_dev_up)
    dev_sub.add_parser("down", help="stop the embedded servers").set_defaults(func=_dev_down)
    dev_sub.add_parser("status", help="show the embedded servers").set_defaults(func=_dev_status)
    dev_sub.add_parser("env", help="print export lines for them").set_defaults(func=_dev_env)

    probe = sub.add_parser("probe", help="probe the broker's exactly-once capabilities")
    probe.add_argument("--json", action="store_true", help="machine-readable output")
    probe.set_defaults(func=_probe)

    run = sub.add_parser("run", help="run a pipeline file")
    run.add_argument("pipeline", help="a Python file that defines `flow = Dataflow(...)`")
    run.add_argument(
        "--runner", default="local", choices=["local", "spark"],
        help="local: one process per worker (default); spark: one Spark barrier job",
    )  # fmt: skip
    run.add_argument("--workers", type=int, default=2, help="workers (the job's parallelism)")
    run.add_argument(
        "--master", help="Spark master: local[N], spark://HOST:7077, k8s://... (default: the "
        "one spark-submit gave, else local[WORKERS])",
    )  # fmt: skip
    run.add_argument(
        "--conf", action="append", default=[], metavar="KEY=VALUE",
        help="a Spark setting, e.g. spark.archives=env.tar.gz#environment (repeatable)",
    )  # fmt: skip
    run.add_argument(
        "--env", action="append", default=[], metavar="NAME[=VALUE]",
        help="a variable every worker sees (repeatable): NAME forwards this process's value. "
        "Spark executors otherwise get only the driver's EOSFLOW_* variables",
    )  # fmt: skip
    run.add_argument(
        "--control-host", help="Spark: the driver address executors connect to for checkpoint "
        "control (default: loopback on local[N], else spark.driver.host)",
    )  # fmt: skip
    run.add_argument(
        "--checkpoint-interval", type=parse_duration, default=1.0, metavar="DURATION",
        help="time between checkpoints, e.g. 500ms, 1s (default 1s)",
    )  # fmt: skip
    run.add_argument(
        "--mode", default="aligned", choices=["aligned", "unaligned", "sync", "none"],
        help="checkpoint mode (sync: stop-the-world, for comparison; none: no checkpoints "
        "except the final one)",
    )  # fmt: skip
    run.add_argument(
        "--recovery", default="global", choices=["global", "local"],
        help="after a worker failure restart every worker from the latest checkpoint (global), "
        "or only the failed one while the others keep running (local)",
    )  # fmt: skip
    run.add_argument(
        "--recovery-max-ids", type=int, default=DEFAULT_MAX_IDS, metavar="N",
        help="local recovery: the record IDs one task may keep (in memory, about 90 bytes "
        "each) until completed checkpoints release them; more recovers the job globally "
        f"(default {DEFAULT_MAX_IDS:,})",
    )  # fmt: skip
    run.add_argument("--recovery-horizon", action=_Removed, help=argparse.SUPPRESS)
    run.add_argument(
        "--until-idle", action="store_true",
        help="stop once every source partition reached the end offset it had at start-up and "
        "a final checkpoint committed; records appended meanwhile are left for the next run. "
        "Every window and timer fires at the end (the watermark drains), so the job takes no "
        "new input afterwards: see --no-drain",
    )  # fmt: skip
    run.add_argument(
        "--no-drain", action="store_true",
        help="with --until-idle: stop at the end offsets without draining the watermark, so "
        "a later run (bounded or not) continues the job: open windows stay open, deduplication "
        "keeps its IDs (a nightly batch)",
    )  # fmt: skip
    run.add_argument("--snapshot-url", help="fsspec URL for checkpoints (default: file:// under "
                     "$EOSFLOW_STATE_DIR/jobs/JOB)")  # fmt: skip
    run.add_argument("--checkpoint-timeout", type=parse_duration, default=60.0, metavar="DURATION")
    run.add_argument(
        "--heartbeat-timeout", type=parse_duration, default=30.0, metavar="DURATION",
        help="restart a worker that sent nothing (not even its heartbeat) this long (30s)",
    )  # fmt: skip
    run.add_argument(
        "--max-rate", type=float, default=0.0, metavar="RECORDS_PER_S",
        help="records per second each worker's sources read at most, e.g. to replay or "
        "backfill at a bounded pace; a cap in every second (a token bucket of 0.1 s: no "
        "second above 1.1x it, also after a stall), not an average (default: no limit)",
    )  # fmt: skip
    run.add_argument(
        "--watermark-alignment", type=parse_alignment, default="auto",
        metavar="DURATION|auto|off",
        help="pause a source partition whose watermark runs this far (event time) ahead of "
        "the slowest partition that still has records to read, in any worker, so that a "
        "backfill fires its windows as it goes with bounded state; off: read partitions as "
        "they come; auto (default): 30s with --max-rate, off without",
    )  # fmt: skip
    run.add_argument(
        "--stop-timeout", type=parse_duration, default=120.0, metavar="DURATION",
        help="on SIGINT/SIGTERM, wait this long for the final checkpoint, then stop without "
        "it; the next run resumes from the last completed one (120s)",
    )  # fmt: skip
    run.add_argument(
        "--tolerable-failed-checkpoints", type=int, default=3, metavar="N",
        help="checkpoint timeouts in a row before a restart (a task alive but stuck; 3)",
    )  # fmt: skip
    run.add_argument(
        "--on-deleted-records", choices=["fail", "skip"], default="fail",
        help="records the job must read were deleted by retention: fail (default) or skip "
        "them, counted and logged",
    )  # fmt: skip
    run.add_argument("--keep-checkpoints", type=int, default=3)
    run.add_argument(
        "--max-restarts", type=int, default=10, metavar="N",
        help="restarts allowed within any --restart-window before the job fails (10)",
    )  # fmt: skip
    run.add_argument(
        "--restart-window", type=parse_duration, default=300.0, metavar="DURATION",
        help="the window of --max-restarts (5m): a failure rate, not a lifetime count",
    )  # fmt: skip
    run.add_argument(
        "--fault", action="append", default=[], metavar="ATTEMPT:WORKER:POINT[:N][:hold]",
        help="crash testing: SIGKILL a worker at a protocol point, or with :hold pause it "
        "there until FAULT_DIR/POINT.wWORKER.release exists (repeatable). ATTEMPT counts the "
        "job's starts from 0 (0: the first start, 1: after the first restart), WORKER from 0, "
        "N (default 1) the time the point is reached",
    )  # fmt: skip
    run.add_argument(
        "--metrics", metavar="HOST:PORT[-LAST]|off",
        help="where the job page, /api/job and Prometheus /metrics are served (default: "
        "$EOSFLOW_METRICS, else 127.0.0.1:9249-9258, the first free port; HOST:0 for any)",
    )  # fmt: skip
    run.add_argument(
        "--from-savepoint", metavar="PATH",
        help="start from this savepoint (the directory `eosflow savepoint` printed); later "
        "restarts restore the newest checkpoint taken since",
    )  # fmt: skip
    run.add_argument(
        "--allow-rewind", action="store_true",
        help="with --from-savepoint: even if the job completed (since deleted) checkpoints "
        "after the savepoint; their output is committed again",
    )  # fmt: skip
    run.add_argument(
        "--map-state", action="append", default=[], metavar="OLD=NEW",
        help="restore the checkpoint's state of step OLD, which the pipeline no longer has "
        "(renamed), into NEW, a stateful step of the same kind (repeatable)",
    )  # fmt: skip
    run.add_argument(
        "--allow-dropped-state", action="store_true",
        help="restore a checkpoint holding state of steps the pipeline no longer has, "
        "dropping that state (logged); without it such a restore is refused",
    )  # fmt: skip
    run.add_argument(
        "--start-over", action="store_true",
        help="start although the job's consumer group in Kafka holds offsets its state does "
        "not account for (the state directory or snapshot store was lost, or is an old copy): "
        "from the state it has (none: the sources' start), replacing the group's offsets; the "
        "output since is committed again. Without it such a start is refused; while another "
        "runner holds the job (it checkpointed lately), refused too unless --force",
    )  # fmt: skip
    run.add_argument(
        "--force", action="store_true",
        help="with --start-over: even while another runner holds the job (it is fenced: it "
        "stops at its next checkpoint, committing nothing more)",
    )  # fmt: skip
    run.add_argument(
        "--takeover", action="store_true",
        help="a rolling deploy: ask the runner that holds the job now (wherever it runs) to stop "
        "at a savepoint, wait for it, and start from it; nothing is processed twice. Its "
        "snapshot store must be reachable from here (the same --snapshot-url, or a shared one)",
    )  # fmt: skip
    run.add_argument(
        "--takeover-timeout", type=parse_duration, default=120.0, metavar="DURATION",
        help="with --takeover: how long to wait for the holder to stop (default 120s); past it "
        "the holder is left running and this start fails",
    )  # fmt: skip
    run.add_argument("--explain", action="store_true", help="print the compiled stages and exit")
    run.set_defaults(func=_run)

    status = sub.add_parser("status", help="progress of a running or finished job")
    status.add_argument("job", nargs="?", help="job name (default: the most recent)")
    status.add_argument("--json", action="store_true")
    status.add_argument(
        "--web", action="store_true",
        help="serve the job page and /api/job of the job's last run from its saved state "
        "(status.json, the page it left, its retained checkpoints) until Ctrl-C",
    )  # fmt: skip
    status.add_argument(
        "--address", default="127.0.0.1:9249-9258", metavar="HOST:PORT[-LAST]",
        help="with --web: where to serve (the first free port; HOST:0: any; default "
        "127.0.0.1:9249-9258, loopback only)",
    )  # fmt: skip
    status.set_defaults(func=cli_jobs.status)

    jobs = sub.add_parser("jobs", help="the jobs known here: state, last checkpoint, runner")
    jobs.add_argument("--json", action="store_true")
    jobs.set_defaults(func=cli_jobs.jobs)

    reset = sub.add_parser(
        "reset",
        help="delete a stopped job's checkpoints, internal topics, dedup IDs and state, after "
        "confirmation (its next run starts afresh)",
    )
    reset.add_argument("job")
    reset.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    reset.add_argument(
        "--pipeline", metavar="PIPELINE.py",
        help="also abort the open transactions of this pipeline's Kafka sinks, and clear its "
        "sinks' own records of the job (Iceberg and Delta tables' last checkpoint, PostgreSQL "
        "prepared transactions and markers; the rows stay)",
    )  # fmt: skip
    reset.add_argument(
        "--workers", type=int, default=8, help="sink subtasks to fence and clear (8)"
    )
    reset.add_argument("--snapshot-url", help="the job's --snapshot-url, if it ran with one")
    reset.add_argument(
        "--force", action="store_true",
        help="even while a runner elsewhere holds the job (its claim in Kafka is recent)",
    )  # fmt: skip
    reset.set_defaults(func=cli_jobs.reset)

    savepoint = sub.add_parser(
        "savepoint",
        help="copy a consistent state of a job where retention keeps it (a running job takes "
        "an aligned checkpoint for it; --stop then stops the job)",
    )
    savepoint.add_argument("job")
    savepoint.add_argument(
        "--stop", action="store_true",
        help="stop the job after the savepoint (its final checkpoint, sinks committed)",
    )  # fmt: skip
    savepoint.add_argument(
        "--path", metavar="URL", help="where (default: <snapshot store>/_savepoints/<job>/)"
    )
    savepoint.add_argument(
        "--timeout", type=parse_duration, default=300.0, metavar="DURATION",
        help="how long to wait for the running job's answer (5m)",
    )  # fmt: skip
    savepoint.add_argument("--snapshot-url", help="the job's --snapshot-url, if it ran with one")
    savepoint.set_defaults(func=cli_jobs.savepoint)

    txn = sub.add_parser("txn", help="transactions of a pipeline's Kafka sinks")
    txn_sub = txn.add_subparsers(dest="txn_command", required=True)
    for name, func, text in (
        ("list", cli_jobs.txn_list, "transactional ids, commit markers and pending epochs"),
        ("abort", cli_jobs.txn_abort, "abort open transactions of the id pool (job stopped)"),
    ):
        cmd = txn_sub.add_parser(name, help=text)
        cmd.add_argument("pipeline", help="the pipeline file of the job")
        cmd.add_argument(
            "--workers",
            type=int,
            default=2,
            help="the job's parallelism (at least: the highest one recorded is used if larger)",
        )
        if name == "list":
            cmd.add_argument("--last", type=int, default=20, help="markers to show")
        else:
            cmd.add_argument("--force", action="store_true", help="even if the job runs")
        cmd.set_defaults(func=func)

    from processor.certify.cli import add_parser as add_certify

    add_certify(sub)

    sub.add_parser("version", help="print the version").set_defaults(
        func=lambda _a: print(f"eosflow {__version__}") or 0
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _configure_logging(args.verbose)
    # A crash in native code (librdkafka, pyarrow, a user's extension) prints every thread's
    # Python stack to stderr: where it crashed, not only "exit -11". Not when called in a
    # process that has it already (pytest) or whose stderr has no descriptor.
    if not faulthandler.is_enabled():
        with contextlib.suppress(OSError, ValueError):
            faulthandler.enable()
    # SIGTERM becomes SystemExit so that `with` blocks and atexit stop owned servers.
    signal.signal(signal.SIGTERM, lambda _sig, _frame: sys.exit(143))
    try:
        return int(args.func(args))
    except (EosflowError, DedupError) as exc:
        print(f"eosflow: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
