"""The operator commands about jobs: ``eosflow jobs``, ``eosflow status`` and ``eosflow reset``.

A job is known by its directory under the state directory (``$EOSFLOW_STATE_DIR/jobs/<job>``:
``status.json``, worker logs) and by its snapshot store (checkpoints, generation, start
positions, lease; :mod:`processor.snapshot.lease`).

Also what ``eosflow txn`` (:mod:`processor.cli`) shares with ``reset``: a pipeline's
transactional Kafka sinks (:func:`kafka_sinks`), fencing their ids, holding a job's lease.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from processor.snapshot.store import SnapshotStore

__all__ = ["jobs", "kafka_sinks", "pid_alive", "reset", "savepoint", "status"]


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs on this host (a zombie, killed but not reaped yet, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc (macOS): kill(0) is all there is
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def _read_status(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _alive(status: dict[str, Any]) -> bool:
    return status.get("state") == "running" and pid_alive(int(status["pid"]))


def _worker_state(worker: dict[str, Any], job_alive: bool) -> str:
    """``alive`` / ``dead`` for a worker on this host; ``unknown`` on another (Spark)."""
    local = worker.get("host") in (None, "", socket.gethostname(), "localhost", "127.0.0.1")
    if not job_alive:
        return "stopped"
    if not local or not worker.get("pid"):
        return "connected" if worker.get("connected") else "not connected"
    if not pid_alive(int(worker["pid"])):
        return "dead"
    return "alive, connected" if worker.get("connected") else "alive, not connected"


def status(args: argparse.Namespace) -> int:
    from processor.runtime.local import jobs_dir

    base = jobs_dir()
    if args.job:
        path = base / args.job / "status.json"
    else:
        found = sorted(base.glob("*/status.json"), key=lambda p: p.stat().st_mtime)
        if not found:
            print(f"no jobs recorded under {base}", file=sys.stderr)
            return 1
        path = found[-1]
    st = _read_status(path)
    if st is None:
        print(f"no status for job {args.job!r} (looked for {path})", file=sys.stderr)
        return 1
    alive = _alive(st)
    for w in st["workers"]:
        w["state"] = _worker_state(w, alive)
    if args.json:
        print(json.dumps({**st, "alive": alive}, indent=2))
        return 0
    age = time.time() - st["updated_ms"] / 1000
    state = st["state"] if alive or st["state"] != "running" else "not running (stale)"
    chk = st["checkpoint"]
    print(f"job        {st['job']}  ({state}, updated {age:.0f}s ago)")
    print(
        f"generation {st['generation']}  restarts {st['restarts']}  mode {st['mode']}"
        f"  runner {st.get('runner', 'local')}"
    )
    print(
        f"checkpoint last {chk['last_completed']} ({chk['last_duration_ms']} ms), "
        f"{chk['completed']} completed, {chk['aborted']} aborted, pending {chk['pending']}"
    )
    print(
        f"records    in {st['records_in']:,}  out {st['records_out']:,}  "
        f"source lag {st['source_lag']:,}"
    )
    if st.get("dead_letters") or st.get("bad_records_skipped"):
        print(
            f"bad input  {st.get('dead_letters', 0):,} dead letters, "
            f"{st.get('bad_records_skipped', 0):,} skipped (no dead-letter sink)"
        )
    if st.get("web") and alive:
        print(f"job page   {st['web']}  (Prometheus: {st['web']}metrics)")
    for w in st["workers"]:
        print(f"worker {w['worker']}   pid {w['pid']}  {w['state']}")
    for cause in st["restart_causes"]:
        print(f"restart    {cause}")
    return 0


def jobs(args: argparse.Namespace) -> int:
    """Every job recorded under the state directory: state, last checkpoint, runner."""
    from processor.runtime.local import default_snapshot_url, jobs_dir
    from processor.snapshot.store import SnapshotStore

    base = jobs_dir()
    rows = []
    for directory in sorted(p for p in base.glob("*") if p.is_dir()):
        st = _read_status(directory / "status.json") or {}
        job = directory.name
        url = st.get("snapshot_url") or default_snapshot_url(job)
        latest = SnapshotStore(url).latest_completed(job)
        if not st:
            state = "never ran"
        elif _alive(st):
            state = "running"
        else:
            state = st["state"] if st["state"] != "running" else "died"
        chk = "-"
        # a bounded run drained its watermark: the job takes no new input (runtime.drain)
        drained = latest is not None and latest.metadata.get("drained") is not None
        if latest is not None:
            ago = time.time() - latest.created_ms / 1000
            chk = f"{latest.checkpoint_id} ({_ago(ago)} ago{', drained' if drained else ''})"
        out = f"{st['records_out']:,}" if st else "-"
        rows.append((job, state, chk, out, str(st.get("pid", "-")), url, drained))
    if args.json:
        keys = ("job", "state", "last_checkpoint", "records_out", "runner_pid", "snapshot_url",
                "drained")  # fmt: skip
        print(json.dumps([dict(zip(keys, r, strict=True)) for r in rows], indent=2))
        return 0
    if not rows:
        print(f"no jobs recorded under {base}")
        return 0
    head = ("JOB", "STATE", "LAST CHECKPOINT", "RECORDS OUT", "RUNNER PID")
    widths = [max(len(h), *(len(str(r[i])) for r in rows)) for i, h in enumerate(head)]
    for row in [head, *(r[:5] for r in rows)]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return 0


def savepoint(args: argparse.Namespace) -> int:
    """A running job's savepoint (an aligned checkpoint it takes now; ``--stop`` stops it after
    it), or a stopped job's newest completed checkpoint, copied where retention keeps it."""
    from processor.errors import ConfigError, JobRunningError
    from processor.runtime.local import default_snapshot_url, job_dir
    from processor.runtime.savepoints import request_savepoint, write_savepoint

    job = args.job
    st = _read_status(job_dir(job) / "status.json") or {}
    url = args.snapshot_url or st.get("snapshot_url") or default_snapshot_url(job)
    where = args.path
    if where is not None and "://" not in where:  # the runner's directory is not this one
        where = str(Path(where).resolve())
    try:
        with holding(job, url) as store:  # stopped: nothing can change its checkpoints
            latest = store.latest_completed(job)
            if latest is None:
                print(f"eosflow: job {job!r} has no completed checkpoint in {url}", file=sys.stderr)
                return 1
            path = write_savepoint(store, latest, path=where)
            print(f"job {job!r} is not running: savepoint of its checkpoint {latest.checkpoint_id}")
    except ConfigError as exc:
        print(f"eosflow: {exc}", file=sys.stderr)
        return 1
    except JobRunningError:
        store = SnapshotStore(url)
        what = "and stop " if args.stop else ""
        print(f"asking job {job!r} to take a savepoint {what}(at most {args.timeout:g}s)...")
        try:
            path = request_savepoint(store, job, stop=args.stop, path=where, timeout=args.timeout)
        except ConfigError as exc:
            print(f"eosflow: {exc}", file=sys.stderr)
            return 1
    print(path)
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
    from processor.errors import JobRunningError

    try:
        with holding(args.job, args.snapshot_url) as store:
            done = _reset(args, store)
    except JobRunningError as exc:
        print(f"eosflow: refusing to reset: {exc}", file=sys.stderr)
        return 1
    if not done:
        return 1
    store.delete_job(args.job)  # the lease file that the release just wrote
    return 0


def _reset(args: argparse.Namespace, store: SnapshotStore) -> bool:
    """What :func:`reset` does holding the lease; ``False`` when not confirmed."""
    from processor.runtime.local import job_dir
    from processor.wire import job_topic_prefix

    job = args.job
    directory = job_dir(job)
    prefix = job_topic_prefix(job)
    topics = _internal_topics(prefix)
    print(f"reset job {job!r} deletes:")
    print(f"  checkpoints and job files in {store.url}")
    print(f"  its state directory {directory}")
    print(f"  {len(topics)} internal topics ({prefix}*): {', '.join(topics) or 'none'}")
    print(f"  its dedup and record-ID keys in Redis (eosflow:{job}:*), if Redis is set")
    if args.pipeline:
        print(f"  and aborts the open transactions of {args.pipeline}'s Kafka sinks")
    if not args.yes:
        if not sys.stdin.isatty():
            print("not a terminal: pass --yes to confirm", file=sys.stderr)
            return False
        if input(f"type the job name ({job}) to confirm: ").strip() != job:
            print("not confirmed; nothing deleted", file=sys.stderr)
            return False
    if args.pipeline:
        from processor.runtime.topology import recorded_parallelism

        workers = max(args.workers, recorded_parallelism(store, job))
        abort_transactions(kafka_sinks(args.pipeline)[1], workers)
    deleted = store.delete_job(job)
    print(f"deleted {deleted} checkpoints")
    if topics:
        _admin().delete_topics(topics)
        print(f"deleted {len(topics)} topics")
    keys = _delete_redis_keys(job)
    if keys is not None:
        print(f"deleted {keys} Redis keys")
    shutil.rmtree(directory, ignore_errors=True)
    print(f"job {job!r} reset: its next run starts afresh")
    return True


def _admin() -> Any:
    from connectors import KafkaSettings, TopicAdmin

    return TopicAdmin(KafkaSettings.from_env(), timeout=10.0)


def _internal_topics(prefix: str) -> list[str]:
    return list(_admin().list_topics(prefix))


def kafka_sinks(pipeline: str) -> tuple[str, list[Any]]:
    """The job name and the transactional Kafka sink steps of a pipeline file."""
    from processor.runtime.pipeline import load_flow

    flow = load_flow(pipeline)
    steps = [
        s
        for s in flow.steps.values()
        if s.kind == "sink" and getattr(s.params["sink"], "mode", None) == "transactional"
    ]
    return flow.name, steps


def abort_transactions(steps: list[Any], workers: int) -> None:
    """Fences the transactional ids of these Kafka sink steps (open transactions abort)."""
    from connectors import KafkaSettings
    from sinks.kafka import abort_lingering

    settings = KafkaSettings.from_env()
    for step in steps:
        sink = step.params["sink"]
        done = abort_lingering(settings, sink.prefix, step.name, workers)
        print(f"sink {step.name!r}: fenced {len(done)} transactional ids (open ones aborted)")


@contextlib.contextmanager
def holding(job: str, snapshot_url: str | None = None) -> Iterator[SnapshotStore]:
    """Holds ``job``'s lease (the job cannot start meanwhile) and yields its snapshot store.

    Raises:
        JobRunningError: the job is running; the message names its runner.
    """
    from processor.runtime.local import default_snapshot_url, job_dir
    from processor.snapshot.lease import JobLease

    st = _read_status(job_dir(job) / "status.json") or {}
    store = SnapshotStore(snapshot_url or st.get("snapshot_url") or default_snapshot_url(job))
    lease = JobLease(store, job)
    lease.acquire()
    try:
        yield store
    finally:
        lease.release()


def _delete_redis_keys(job: str) -> int | None:
    url = os.environ.get("EOSFLOW_REDIS_URL")
    if not url:
        return None
    from dedup.store import redis_client

    client = redis_client(url, name="eosflow-reset")
    count = 0
    batch: list[Any] = []
    for key in client.scan_iter(match=f"eosflow:{job}:*", count=1000):
        batch.append(key)
        if len(batch) >= 1000:
            count += client.delete(*batch)
            batch = []
    if batch:
        count += client.delete(*batch)
    return int(count)
