"""Metrics bookkeeping (:mod:`processor.runtime.observe.metrics`) and the runner's HTTP server
(:mod:`processor.runtime.observe.webui`), without a job: worker stats messages are fed by hand."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from processor.compiler import compile_flow
from processor.dataflow import Dataflow
from processor.errors import ConfigError
from processor.runtime.checkpoints.coordinator import CheckpointCoordinator, CheckpointEvent
from processor.runtime.job import RunOptions, WorkerHandle, parse_address
from processor.runtime.observe.metrics import METRICS, JobMetrics, restart_kind
from processor.runtime.observe.webui import WebServer
from processor.snapshot.store import SnapshotStore
from sinks import ConsoleSink


def _plan() -> Any:
    flow = Dataflow("metrics-job")
    (
        flow.source("clicks", "clicks-topic")
        .map("parse", lambda v: v)
        .key_by("by-user", lambda v: v)
        .count("count")
        .sink("out", ConsoleSink())
    )
    return compile_flow(flow, 2)


def _metrics() -> JobMetrics:
    return JobMetrics(_plan(), runner="local", mode="aligned", recovery="global")


def _scrape(m: JobMetrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = generate_latest(m.registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def _value(got: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **kw: str) -> float:
    return sum(v for (n, ls), v in got.items() if n == name and set(kw.items()) <= ls)


def _stats(n_in: int, sunk: int, *, lag: int = 0, chan: str = "") -> dict[str, Any]:
    """A source task's and a sink task's stats, as a worker sends them."""
    return {
        "clicks.0": {
            "in": n_in, "sunk": 0, "dead": 1, "bad": 0, "late": 0, "dups": 0,
            "steps": {"clicks": [n_in, n_in], "parse": [n_in, n_in - 1]},
            "parts": [["clicks-topic", 0, lag]], "commits": [], "headroom": {},
            "dead_recent": [{"step": "parse", "error_type": "ValueError", "cause": "bad"}],
        },
        "count.0": {
            "in": n_in, "sunk": sunk, "lookups": 3, "round_trips": 2,
            "steps": {"count": [n_in, sunk], "out": [sunk, 0]}, "sinks": {"out": sunk},
            "parts": [[chan, 1, 5]] if chan else [], "commits": [["out", 0.02]],
            "headroom": {"out": 42.5},
        },
    }  # fmt: skip


def _status(generation: int, workers: list[WorkerHandle]) -> dict[str, Any]:
    return {
        "job": "metrics-job",
        "generation": generation,
        "uptime_s": 3.0,
        "checkpoint": {"last_completed": 7},
        "workers": [{"worker": w.index, "connected": w.conn is not None} for w in workers],
    }


def test_counters_keep_a_killed_workers_counts_and_gauges_show_only_the_live_ones() -> None:
    m = _metrics()
    channel = next(iter(m.channels))
    old = WorkerHandle(0, pid=100)
    m.on_stats(old, 1, _stats(50, 40, lag=9))
    new = WorkerHandle(0, pid=101)  # the same worker after a restart: another process
    new.stats = _stats(30, 20, lag=4, chan=channel)  # the runner sets it, then tells metrics
    m.on_stats(new, 2, new.stats)
    m.on_restart("worker 0 killed by signal SIGKILL")
    m.update(_status(2, [new]), [new], "running")
    got = _scrape(m)
    job = {"eosflow_job": "metrics-job"}
    # Sources' "in" only: the sink task's "in" is not read from a source.
    assert _value(got, "eosflow_records_in_total", **job) == 80
    assert _value(got, "eosflow_records_out_total") == 60
    assert _value(got, "eosflow_sink_records_total", sink="out") == 60
    assert _value(got, "eosflow_step_records_out_total", step="parse") == 78
    assert _value(got, "eosflow_dead_letters_total") == 2
    assert _value(got, "eosflow_dedup_lookups_total") == 6
    assert _value(got, "eosflow_dedup_redis_round_trips_total") == 4
    assert _value(got, "eosflow_restarts_total", cause="killed") == 1
    assert _value(got, "eosflow_sink_commit_seconds_count", sink="out") == 2
    # Gauges: the live process's only.
    assert _value(got, "eosflow_source_lag_records", topic="clicks-topic", partition="0") == 4
    assert _value(got, "eosflow_channel_queued_records", topic=channel, partition="1") == 5
    assert _value(got, "eosflow_transaction_timeout_headroom_seconds", sink="out") == 42.5
    assert _value(got, "eosflow_generation") == 2
    assert _value(got, "eosflow_last_checkpoint") == 7
    assert _value(got, "eosflow_job_info", runner="local", mode="aligned") == 1
    api = m.snapshot.api
    assert api["records"]["in"] == 80 and api["steps"]["parse"]["out"] == 78
    assert api["lag"]["sources"] == [{"topic": "clicks-topic", "partition": 0, "records": 4}]
    assert api["lag"]["channels"] == [{"topic": channel, "partition": 1, "records": 5}]
    assert api["restarts_list"][0]["kind"] == "killed"
    assert api["dead_letters"]["total"] == 2 and api["dead_letters"]["recent"][0]["step"] == "parse"
    assert [s["name"] for s in api["graph"]["stages"]] == ["clicks", "count"]
    assert api["graph"]["stages"][0]["sources"] == ["clicks-topic"]
    assert api["graph"]["edges"][0]["shuffle"] is True


def test_every_documented_metric_is_exported_from_the_start() -> None:
    m = _metrics()
    m.update(_status(1, []), [], "starting")
    m.on_checkpoint(CheckpointEvent(1, True, 0.2, 0, 4096, 0.05))
    m.on_stats(WorkerHandle(0, pid=1), 1, _stats(1, 1))
    m.update(_status(1, []), [], "running")
    names = {f.name for f in text_string_to_metric_families(generate_latest(m.registry).decode())}
    for name, (kind, _help, _labels) in METRICS.items():
        assert (name.removesuffix("_total") if kind == "counter" else name) in names, name
    doc = (Path(__file__).parents[2] / "docs" / "observability.md").read_text()
    for name in METRICS:
        assert f"`{name}`" in doc, f"{name} is not in docs/observability.md"


def test_checkpoint_events_fill_the_history_and_the_failure_counters() -> None:
    m = _metrics()
    m.on_checkpoint(CheckpointEvent(1, True, 0.2, 1000, 4096, 0.05))
    m.on_checkpoint(CheckpointEvent(2, False, 5.0, 2000, kind="timeout", reason="timed out"))
    m.update(_status(1, []), [], "running")
    got = _scrape(m)
    assert _value(got, "eosflow_checkpoints_completed_total") == 1
    assert _value(got, "eosflow_checkpoints_failed_total", reason="timeout") == 1
    assert _value(got, "eosflow_checkpoints_failed_total", reason="declined") == 0
    assert _value(got, "eosflow_checkpoint_size_bytes_sum") == 4096
    assert _value(got, "eosflow_checkpoint_alignment_seconds_sum") == pytest.approx(0.05)
    history = m.snapshot.api["checkpoints"]["history"]
    assert [(h["id"], h["status"], h["reason"]) for h in history] == [
        (1, "completed", None),
        (2, "failed", "timed out"),
    ]


def test_the_coordinator_reports_completions_with_size_and_alignment_and_failures_by_kind(
    tmp_path: Path,
) -> None:
    now = [0.0]
    events: list[CheckpointEvent] = []
    store = SnapshotStore(tmp_path.as_uri(), clock=lambda: 1.0)
    c = CheckpointCoordinator(
        store, "job", ["a.0", "b.0"], interval_s=1.0, timeout_s=5.0, clock=lambda: now[0],
        observer=events.append,
    )  # fmt: skip
    c.start_generation(1)
    chk = c.trigger_now()
    assert chk is not None
    for task, align in (("a.0", 0.25), ("b.0", 0.5)):
        handle = store.write_task_snapshot("job", chk, task, {"task": task})
        now[0] += 1.0
        c.on_ack(chk, task, handle, alignment_s=align)
    done = events[-1]
    assert done.completed and done.duration_s == 2.0 and done.alignment_s == 0.5
    assert done.size_bytes > 0
    c.trigger_now()
    now[0] += 10
    c.expired()
    declined = c.trigger_now()
    assert declined is not None
    c.decline(declined, "a.0", "snapshot upload failed")
    c.trigger_now()
    c.start_generation(2)
    assert [e.kind for e in events[1:]] == ["timeout", "declined", "restart"]
    assert c.stats.failed == {"timeout": 1, "declined": 1, "restart": 1}


@pytest.mark.parametrize(
    ("cause", "kind"),
    [
        ("worker 1 killed by signal SIGKILL", "killed"),
        ("worker 0: its Python process died (killed or crashed)", "killed"),
        ("worker 1 exit code 1 (UserFunctionError: step 'p' raised X)", "UserFunctionError"),
        ("worker 1 exit code 3", "exited"),
        ("worker 0 lost its coordinator connection", "connection_lost"),
        ("worker 2 sent nothing for 31s (heartbeat timeout 30s): stopped", "heartbeat"),
        ("4 checkpoints in a row timed out (tolerable: 3); the last ...", "checkpoint_timeouts"),
        ("the worker job ended before the job finished", "other"),
    ],
)  # fmt: skip
def test_restart_causes_fall_into_few_kinds(cause: str, kind: str) -> None:
    assert restart_kind(cause) == kind


def test_metrics_addresses_are_parsed_and_bad_ones_say_how_to_write_them() -> None:
    assert parse_address("127.0.0.1:9249-9251") == ("127.0.0.1", [9249, 9250, 9251])
    assert parse_address("0.0.0.0:0") == ("0.0.0.0", [0])
    assert parse_address("[::1]:9300") == ("::1", [9300])
    assert parse_address("off") is None
    for bad in ("9249", "localhost:x", "h:9300-9200", "h:0-5"):
        with pytest.raises(ConfigError, match="HOST:PORT"):
            parse_address(bad)
    with pytest.raises(ConfigError, match="HOST:PORT"):
        RunOptions(metrics="nonsense").validate()
    assert RunOptions(metrics="off").metrics_address() is None


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def test_the_server_takes_the_next_free_port_of_its_range_and_fails_clearly_when_none_is(
    busy_port: int,
) -> None:
    m = _metrics()
    m.update(_status(1, []), [], "running")
    try:
        web = WebServer(m, f"127.0.0.1:{busy_port}-{busy_port + 1}")
    except ConfigError:  # the next port happened to be taken as well
        pytest.skip(f"port {busy_port + 1} is in use too")
    try:
        assert web.url == f"http://127.0.0.1:{busy_port + 1}/"
        with urllib.request.urlopen(web.url + "api/job") as r:
            assert json.loads(r.read())["job"] == "metrics-job"
        with urllib.request.urlopen(web.url + "metrics") as r:
            assert b"eosflow_records_in_total" in r.read()
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(web.url + "nothing-here")
        assert err.value.code == 404
    finally:
        web.close()
    with pytest.raises(ConfigError, match="every port is in use"):
        WebServer(m, f"127.0.0.1:{busy_port}")


def test_a_waits_changing_numbers_are_not_kept_in_its_label() -> None:
    """A slow commit at every checkpoint is one series, not one per checkpoint; two waits that
    read the same then (two commits of one sink) are one sample, the longest."""
    m = _metrics()
    status = _status(1, [])
    status["waiting"] = [
        {"worker": 0, "on": "sink 'out' (its commit of checkpoint 12)", "for_s": 2.0},
        {"worker": 0, "on": "sink 'out' (its commit of checkpoint 13)", "for_s": 0.7},
        {"worker": 1, "on": "the broker: clicks[6] has 2,924 records to read and none comes",
         "for_s": 3.5},
        {"worker": 1, "on": "the dedup store of step 'u' (redis://127.0.0.1:6379/0)", "for_s": 1.0},
    ]  # fmt: skip
    m.update(status, [], "running")
    waits = {
        (dict(labels)["worker"], dict(labels)["on"]): value
        for (name, labels), value in _scrape(m).items()
        if name == "eosflow_waiting_seconds"
    }
    assert waits == {
        ("0", "sink 'out' (its commit of checkpoint N)"): 2.0,
        ("1", "the broker: clicks[6] has N records to read and none comes"): 3.5,
        ("1", "the dedup store of step 'u' (redis://127.0.0.1:6379/0)"): 1.0,
    }
