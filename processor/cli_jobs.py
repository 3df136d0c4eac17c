"""The operator commands about jobs: ``eosflow jobs``, ``status``, ``reset``, ``savepoint`` and
``txn``.

Each parses nothing (:mod:`processor.cli` does), calls :class:`processor.admin.JobAdmin`, which
does the work and returns values, and prints them; errors it raises become the messages and
exit codes below (an error not caught here is reported by :func:`processor.cli.main`, exit 2).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Mapping
from typing import Any

from processor.admin import JobAdmin, ResetPlan
from processor.admin.values import JobStatus
from processor.errors import ConfigError, JobNotFoundError, JobRunningError
from processor.runtime.observe import archive, watermarks
from processor.runtime.supervision.lifecycle import describe_cause
from processor.runtime.supervision.startup import describe as describe_start

__all__ = ["jobs", "reset", "savepoint", "status", "txn_abort", "txn_list"]


def status(args: argparse.Namespace) -> int:
    try:
        found = JobAdmin().status(args.job)
    except JobNotFoundError as exc:
        print(exc, file=sys.stderr)
        return 1
    if getattr(args, "web", False):
        return serve_page(found, args.address)
    if args.json:
        print(json.dumps(found.as_dict(), indent=2))
        return 0
    st, alive = found.data, found.alive
    age = time.time() - st["updated_ms"] / 1000
    state = st["state"] if alive or st["state"] != "running" else "not running (stale)"
    chk = st["checkpoint"]
    print(f"job        {st['job']}  ({state}, updated {age:.0f}s ago)")
    print(
        f"generation {st['generation']}  restarts {st['restarts']}  mode {st['mode']}"
        f"  runner {st.get('runner', 'local')}"
    )
    if st.get("startup"):  # where the start went, in seconds since the runner began
        print(f"start      {describe_start(st['startup'])}")
    print(
        f"checkpoint last {chk['last_completed']} ({chk['last_duration_ms']} ms), "
        f"{chk['completed']} completed, {chk['aborted']} aborted, pending {chk['pending']}"
        + (
            f" for {chk['pending_s']:.0f} s, no ack from {', '.join(chk['pending_missing'])}"
            if (chk.get("pending_s") or 0) >= 5
            else ""
        )
    )
    print(
        f"records    read {st['records_in']:,}  to sinks {st['records_out']:,}  "
        f"committed {st.get('records_committed', 0):,}  source lag {st['source_lag']:,}  "
        "(every generation: read and to sinks count re-reads and re-writes after restarts, "
        "committed each checkpoint's epoch once)"
    )
    _print_waits(st, alive)
    if st.get("dead_letters") or st.get("bad_records_skipped"):
        print(
            f"bad input  {st.get('dead_letters', 0):,} dead letters, "
            f"{st.get('bad_records_skipped', 0):,} skipped (no dead-letter sink)"
        )
    for line in watermarks.status_lines(st.get("watermarks")):
        print(line)
    if st.get("web") and alive:
        print(f"job page   {st['web']}  (Prometheus: {st['web']}metrics)")
    _print_group(st["job"])
    for w in found.workers:
        print(f"worker {w.worker}   pid {w.pid}  {w.state}")
    for cause in st["restart_causes"]:
        # each failure once, with its count (older status files: one string per restart)
        print(f"restart    {cause if isinstance(cause, str) else describe_cause(cause)}")
    return 0


def _print_waits(st: Mapping[str, Any], alive: bool) -> None:
    """What the workers wait on (a dedup store, a sink's commit, a broker), and since when."""
    for w in st.get("waiting") or ():
        since = time.strftime("%H:%M:%S", time.localtime(int(w["since_ms"]) / 1000))
        still = "" if alive else " (when the job last wrote its status)"
        print(
            f"waiting    worker {w['worker']} on {w['on']} since {since} "
            f"({float(w['for_s']):.0f} s{still})"
        )


def _print_group(job: str) -> None:
    """The job's consumer group and its committed source offsets (where the last committed
    checkpoint is, as ``kafka-consumer-groups --describe --group`` shows it), when the broker
    (``EOSFLOW_KAFKA_BROKERS``) answers."""
    from connectors import job_group

    try:
        offsets = JobAdmin().group_offsets(job)
    except Exception as exc:  # status works without a broker: say so, go on
        print(f"group      {job_group(job)}  (offsets not read: {str(exc).splitlines()[0][:120]})")
        return
    shown = ", ".join(f"{t}[{p}]={o}" for (t, p), o in sorted(offsets.items())[:8])
    more = f", +{len(offsets) - 8} more" if len(offsets) > 8 else ""
    print(f"group      {job_group(job)}  committed {shown or 'nothing yet'}{more}")


def jobs(args: argparse.Namespace) -> int:
    """Every job recorded under the state directory: state, last checkpoint, runner."""
    admin = JobAdmin()
    rows = []
    for job in admin.list_jobs():
        chk = "-"
        if job.last_checkpoint is not None and job.last_checkpoint_ms is not None:
            ago = time.time() - job.last_checkpoint_ms / 1000
            drained = ", drained" if job.drained else ""
            chk = f"{job.last_checkpoint} ({_ago(ago)} ago{drained})"
        out = f"{job.records_out:,}" if job.records_out is not None else "-"
        pid = str(job.runner_pid) if job.runner_pid is not None else "-"
        rows.append((job.job, job.state, chk, out, pid, job.snapshot_url, job.drained))
    if args.json:
        keys = ("job", "state", "last_checkpoint", "records_out", "runner_pid", "snapshot_url",
                "drained")  # fmt: skip
        print(json.dumps([dict(zip(keys, r, strict=True)) for r in rows], indent=2))
        return 0
    if not rows:
        print(f"no jobs recorded under {admin.jobs_dir}")
        return 0
    head = ("JOB", "STATE", "LAST CHECKPOINT", "RECORDS OUT", "RUNNER PID")
    widths = [max(len(h), *(len(str(r[i])) for r in rows)) for i, h in enumerate(head)]
    for row in [head, *(r[:5] for r in rows)]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return 0


def savepoint(args: argparse.Namespace) -> int:
    """A running job's savepoint (an aligned checkpoint it takes now; ``--stop`` stops it after
    it), or a stopped job's newest completed checkpoint, copied where retention keeps it."""
    admin, job = JobAdmin(), args.job
    try:
        taken = admin.copy_checkpoint(job, path=args.path, snapshot_url=args.snapshot_url)
        print(f"job {job!r} is not running: savepoint of its checkpoint {taken.checkpoint_id}")
    except (ConfigError, JobNotFoundError) as exc:
        print(f"eosflow: {exc}", file=sys.stderr)
        return 1
    except JobRunningError:
        what = "and stop " if args.stop else ""
        print(f"asking job {job!r} to take a savepoint {what}(at most {args.timeout:g}s)...")
        try:
            taken = admin.request_savepoint(
                job, stop=args.stop, path=args.path, timeout=args.timeout,
                snapshot_url=args.snapshot_url,
            )  # fmt: skip
        except ConfigError as exc:
            print(f"eosflow: {exc}", file=sys.stderr)
            return 1
    print(taken.path)
    return 0


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.0f}h"


def reset(args: argparse.Namespace) -> int:
    """Deletes a stopped job's checkpoints, job files, internal topics, dedup IDs and state
    directory (and, given its pipeline, aborts its Kafka sinks' open transactions)."""
    try:
        done = JobAdmin().reset(
            args.job, pipeline=args.pipeline, workers=args.workers,
            snapshot_url=args.snapshot_url, confirm=lambda plan: _confirm(plan, args.yes),
            force=args.force,
        )  # fmt: skip
    except JobRunningError as exc:
        print(f"eosflow: refusing to reset: {exc}", file=sys.stderr)
        return 1
    if done is None:
        return 1
    for sink in done.fenced:
        print(_fenced(sink.step, len(sink.transactional_ids)))
    print(f"deleted {done.checkpoints} checkpoints")
    if done.topics:
        print(f"deleted {len(done.topics)} topics")
    if done.redis_keys is not None:
        print(f"deleted {done.redis_keys} Redis keys")
    if done.group:
        print(f"deleted consumer group {done.group} (its committed source offsets)")
    for line in done.sink_records:
        print(f"cleared {line}")
    print(f"job {done.job!r} reset: its next run starts afresh")
    return 0


def _confirm(plan: ResetPlan, yes: bool) -> bool:
    """Shows what a reset deletes; ``True`` when confirmed (``--yes``, or the job's name typed)."""
    job, topics = plan.job, plan.topics
    print(f"reset job {job!r} deletes:")
    print(f"  checkpoints and job files in {plan.snapshot_url}")
    print(f"  its state directory {plan.directory}")
    print(f"  {len(topics)} internal topics ({plan.topic_prefix}*): {', '.join(topics) or 'none'}")
    print(f"  its dedup and record-ID keys in Redis (eosflow:{job}:*), if Redis is set")
    if plan.group:
        print(f"  its consumer group {plan.group} (the sources' committed offsets)")
    if plan.pipeline:
        print(f"  and aborts the open transactions of {plan.pipeline}'s Kafka sinks")
        for line in plan.sink_records:
            print(f"  and clears {line}")
    else:
        print(
            "  (not the sinks' own records of the job: a lakehouse table's last checkpoint, "
            "PostgreSQL prepared transactions; give --pipeline FILE to clear them too)"
        )
    if yes:
        return True
    if not sys.stdin.isatty():
        print("not a terminal: pass --yes to confirm", file=sys.stderr)
        return False
    if input(f"type the job name ({job}) to confirm: ").strip() != job:
        print("not confirmed; nothing deleted", file=sys.stderr)
        return False
    return True


def _fenced(step: str, count: int) -> str:
    return f"sink {step!r}: fenced {count} transactional ids (open ones aborted)"


def txn_list(args: argparse.Namespace) -> int:
    admin = JobAdmin()
    sinks = admin.transactional_sinks(args.pipeline)
    if not sinks.steps:
        print(f"{args.pipeline}: no transactional Kafka sink", file=sys.stderr)
        return 1
    for sink in admin.transactions(sinks, workers=args.workers):
        print(f"sink {sink.step!r} of job {sink.job!r} -> topic {sink.topic!r}")
        for subtask, ids in enumerate(sink.subtask_ids):
            print(f"  subtask {subtask}: transactional ids {', '.join(ids)} (+ spare slots)")
        markers = sink.markers
        print(f"  {len(markers)} commit markers (last {min(len(markers), args.last)}):")
        for m in markers[-args.last :]:
            again = " re-published" if m.get("republished") else ""
            print(
                f"    subtask {m.get('subtask', '?')} epoch {m['epoch']} "
                f"checkpoint {m.get('checkpoint', '?')} records {m.get('count')}{again}"
            )
        if sink.checkpoint_id is None:
            print("  no completed checkpoint: nothing pending")
            continue
        for p in sink.pending:
            print(
                f"  pending in checkpoint {sink.checkpoint_id}: task {p.task} epoch "
                f"{p.epoch} (checkpoint {p.checkpoint}) on {p.transactional_id}, {p.records} "
                "records; committed or re-published when the job next starts"
            )
    return 0


def txn_abort(args: argparse.Namespace) -> int:
    admin = JobAdmin()
    sinks = admin.transactional_sinks(args.pipeline)
    try:
        fenced = admin.abort_transactions(sinks, workers=args.workers, force=args.force)
    except JobRunningError as exc:
        print(
            f"eosflow: refusing to abort the transactions of job {sinks.job!r}: {exc}. Aborting "
            "them would fence its producers and force a recovery; pass --force to anyway",
            file=sys.stderr,
        )
        return 1
    for sink in fenced:
        print(_fenced(sink.step, len(sink.transactional_ids)))
    print(
        "Pending epochs of the last checkpoint are re-published from the log when the job "
        "next starts (their records stay in the partitions until retention deletes them)."
    )
    return 0


def serve_page(found: JobStatus, address: str) -> int:
    """``eosflow status --web``: the job page of the job's last run, rebuilt from its saved
    state (:mod:`processor.runtime.observe.archive`), served read-only until Ctrl-C."""
    from processor.runtime.job import parse_address
    from processor.runtime.observe.webui import WebServer

    st = found.data
    if found.alive and st.get("web"):
        print(f"job {st['job']!r} is running: its live page is {st['web']}")
        return 0
    page = archive.read_page(found.path.parent, alive=found.alive)
    try:
        if parse_address(address) is None:
            raise ConfigError(f"--address {address!r}: give HOST:PORT[-LAST] to serve the page on")
        server = WebServer(None, address, page=page)
    except ConfigError as exc:
        print(f"eosflow: {exc}", file=sys.stderr)
        return 2
    written = page.get("archived", {}).get("written_ms")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(written / 1000)) if written else "?"
    print(
        f"job {st['job']!r} ({page.get('state')}): its last run's page, as saved at {when}: "
        f"{server.url}  (read-only; Ctrl-C stops)",
        flush=True,
    )
    # "Ctrl-C stops" even when started with SIGINT ignored (a shell's background job, or a
    # parent that ignores it: the suite's status --web test hung until this).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0
