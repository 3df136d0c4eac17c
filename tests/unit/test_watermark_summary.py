"""The watermarks as shown to the user (:mod:`processor.runtime.observe.watermarks`) and the
page a finished run leaves (:mod:`processor.runtime.observe.archive`), from hand-made task stats
(the schema of :meth:`processor.runtime.task.core.Task.stats`) at a fixed time."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from processor.compiler import compile_flow
from processor.dataflow import Dataflow
from processor.runtime.observe import archive
from processor.runtime.observe.watermarks import (
    families,
    format_span,
    format_time,
    progress_text,
    status_lines,
    summarize,
)
from processor.snapshot.store import SnapshotStore
from sinks import ConsoleSink

NOW = 1_700_000_000_000 + 3600_000  # an hour after the first event, the same UTC day
BASE = 1_700_000_000_000
NONE = -(2**63)
END = 2**63 - 1


def _plan() -> Any:
    flow = Dataflow("wm-job")
    (
        flow.source("clicks", "clicks-topic", timestamp=lambda v: v)
        .key_by("by-user", lambda v: v)
        .count("count")
        .sink("out", ConsoleSink())
    )
    return compile_flow(flow, 2)


def _stages() -> tuple[str, str]:
    plan = _plan()
    source = next(s.name for s in plan.stages if s.sources)
    other = next(s.name for s in plan.stages if not s.sources)
    return source, other


def _tasks(
    p3: int | None = BASE + 10_000, p3_state: str = "idle", channel_wm: int = BASE + 9_000
) -> dict[str, dict[str, Any]]:
    """Two source tasks (partitions 0, 2 and 1, 3), two channel tasks."""
    src, down = _stages()
    ch = "eosflow.wm-job.ch0"
    t0 = [
        ["clicks-topic", 0, BASE + 60_000, BASE + 65_000, "reading"],
        ["clicks-topic", 2, BASE + 200_000, BASE + 205_000, "ahead"],
    ]
    t1 = [
        ["clicks-topic", 1, BASE + 50_000, BASE + 55_000, "reading"],
        ["clicks-topic", 3, p3, None if p3 is None else p3 + 5_000, p3_state],
    ]
    low1 = NONE if p3 is None else min(BASE + 50_000, p3)
    return {
        f"{src}.0": {"watermark": BASE + 60_000, "wm_parts": t0, "align_wm": BASE + 60_000},
        f"{src}.1": {"watermark": low1, "wm_parts": t1, "align_wm": BASE + 50_000},
        f"{down}.0": {
            "watermark": channel_wm,
            "wm_parts": [
                [ch, 0, channel_wm, None, "reading"],
                [ch, 2, BASE + 60_000, None, "reading"],
            ],
        },
        f"{down}.1": {
            "watermark": BASE + 9_500,
            "wm_parts": [
                [ch, 1, BASE + 9_500, None, "aligning"],
                [ch, 3, BASE + 50_000, None, "reading"],
            ],
        },
    }


def test_summary_names_the_partition_that_holds_the_job_back_when_one_lags() -> None:
    src, down = _stages()
    wm = summarize(_plan(), _tasks(), NOW)
    assert wm["held_by"] == {
        "topic": "clicks-topic",
        "partition": 3,
        "state": "idle",
        "task": f"{src}.1",
    }
    stages = {s["stage"]: s for s in wm["stages"]}
    assert stages[src]["watermark_ms"] == BASE + 10_000  # the lowest task's, not the mean
    assert stages[src]["held_by"]["partition"] == 3
    assert stages[down]["watermark_ms"] == BASE + 9_000
    assert stages[down]["held_by"] == {
        "topic": "eosflow.wm-job.ch0", "partition": 0, "state": "reading", "task": f"{down}.0"
    }  # fmt: skip
    assert wm["watermark_ms"] == BASE + 9_000  # the job's: its slowest stage's
    assert wm["newest_ms"] == BASE + 205_000
    assert wm["behind_newest_s"] == 196.0
    assert wm["lag_s"] == (NOW - BASE - 9_000) / 1000
    assert wm["paused_ahead"] == 1
    assert wm["alignment_ms"] == BASE + 50_000
    parts = {p["partition"]: p for p in wm["sources"]}
    assert [p["partition"] for p in wm["sources"]] == [0, 1, 2, 3]
    assert [p for p in parts if parts[p]["holding"]] == [3]
    assert parts[2]["state"] == "ahead" and parts[2]["behind_newest_s"] == 5.0
    assert parts[0]["lag_s"] == (NOW - BASE - 60_000) / 1000


def test_summary_holds_the_job_at_none_when_a_partition_has_not_read_yet() -> None:
    src, _down = _stages()
    wm = summarize(_plan(), _tasks(p3=None, p3_state="reading"), NOW)
    assert wm["watermark_ms"] is None and wm["lag_s"] is None
    assert wm["held_by"]["partition"] == 3
    assert next(s for s in wm["stages"] if s["stage"] == src)["watermark_ms"] is None
    assert progress_text(wm) == " wm=none (held by clicks-topic[3], 1 ahead paused)"


def test_summary_says_end_when_every_task_reached_the_end_of_a_bounded_input() -> None:
    tasks = _tasks(p3_state="done")
    for st in tasks.values():
        st["watermark"] = END
        st["wm_parts"] = [[*p[:4], "done"] for p in st["wm_parts"]]
    wm = summarize(_plan(), tasks, NOW)
    assert wm["end"] and wm["held_by"] is None
    assert all(s["end"] and s["lag_s"] == 0.0 for s in wm["stages"])
    assert progress_text(wm) == " wm=end"
    assert status_lines(wm)[0] == "watermark  end of input"


def test_summary_is_empty_before_any_task_reported() -> None:
    wm = summarize(_plan(), {}, NOW)
    assert wm["stages"] == [] and wm["sources"] == [] and wm["watermark_ms"] is None
    assert progress_text(wm) == "" and status_lines(wm) == []


def test_progress_text_and_status_lines_say_watermark_lag_and_holder() -> None:
    wm = summarize(_plan(), _tasks(), NOW)
    assert progress_text(wm) == (
        " wm=22:13:29Z (3m16s behind newest, held by clicks-topic[3] idle, 1 ahead paused)"
    )
    lines = status_lines(wm, limit=2)
    assert lines[0] == (
        "watermark  22:13:29Z  (3m16s behind newest, 59m51s behind now)  "
        "held by clicks-topic[3] idle"
    )
    assert any(
        line.startswith("  stage ") and "held by eosflow.wm-job.ch0[0]" in line for line in lines
    )
    sources = [line for line in lines if line.startswith("  source ")]
    # The first two partitions, then the holding one although past the limit, then the rest.
    assert "clicks-topic[0]" in sources[0] and "clicks-topic[1]" in sources[1]
    assert "clicks-topic[3]" in sources[2] and sources[2].endswith("<- holds the job back")
    assert sources[3] == "  source   +1 more partitions (--json: all)"


def test_times_and_spans_read_like_the_page() -> None:
    assert format_time(BASE, BASE + 1000) == "22:13:20Z"
    assert format_time(BASE, BASE + 86_400_000) == "2023-11-14 22:13:20Z"
    assert format_time(None) == "none"
    assert [format_span(s) for s in (0.85, 12, 130, 11_100, 190_000, -130, None)] == [
        "850ms", "12s", "2m10s", "3h05m", "2d04h", "-2m10s", "?",
    ]  # fmt: skip


def test_metric_families_carry_stage_and_partition_watermarks() -> None:
    wm = summarize(_plan(), _tasks(), NOW)
    src, down = _stages()

    class Fixed(Collector):
        def collect(self) -> Any:
            return families(wm, "wm-job", "eosflow_job")

    registry = CollectorRegistry()
    registry.register(Fixed())
    got = {
        (s.name, frozenset(s.labels.items())): s.value
        for f in text_string_to_metric_families(generate_latest(registry).decode())
        for s in f.samples
    }

    def value(name: str, **labels: str) -> float:
        [v] = [v for (n, ls), v in got.items() if n == name and set(labels.items()) <= ls]
        return v

    assert value("eosflow_watermark_timestamp_seconds", stage=down) == (BASE + 9_000) / 1000
    assert value("eosflow_watermark_lag_seconds", stage=src) == (NOW - BASE - 10_000) / 1000
    assert value("eosflow_watermark_behind_newest_seconds", stage=src) == 195.0
    assert value("eosflow_watermark_held_by", stage=src, topic="clicks-topic") == 1
    assert (
        value("eosflow_source_partition_watermark_timestamp_seconds", partition="2")
        == (BASE + 200_000) / 1000
    )
    assert (
        value("eosflow_source_partition_newest_event_timestamp_seconds", partition="0")
        == (BASE + 65_000) / 1000
    )
    assert value("eosflow_source_partition_state", partition="2", state="ahead") == 1
    assert value("eosflow_source_partition_state", partition="2", state="reading") == 0
    assert all(v == 0 or v == 1 for (n, _l), v in got.items() if n.endswith("_state"))

    ended = summarize(_plan(), {k: {**v, "watermark": END} for k, v in _tasks().items()}, NOW)
    assert math.isinf(
        next(iter(families(ended, "wm-job", "eosflow_job"))).samples[0].value
    )  # +Inf at the end of the input


def test_saved_page_is_read_back_with_the_stores_checkpoints_after_the_run(tmp_path: Path) -> None:
    """``eosflow status --web``'s document: the run's page, its state as ``status.json`` says,
    the checkpoints the store retains added to (or marked in) the run's own history."""
    job_dir = tmp_path / "jobs" / "wm-job"
    job_dir.mkdir(parents=True)
    store_url = (tmp_path / "checkpoints").as_uri()
    store = SnapshotStore(store_url)
    for cid in (3, 4):
        handle = store.write_task_snapshot("wm-job", cid, "s0.0", {"n": cid})
        store.complete("wm-job", cid, {"s0.0": handle}, {})
    history = [{"id": 4, "status": "completed", "at_ms": 1, "duration_s": 0.1}]
    history.append({"id": 5, "status": "failed", "reason": "timeout", "at_ms": 2})
    page = {
        "job": "wm-job",
        "state": "running",
        "updated_ms": 123,
        "checkpoints": {"history": history},
    }
    archive.write_page(job_dir, page)
    status = {"job": "wm-job", "state": "running", "pid": 0, "snapshot_url": store_url}
    (job_dir / "status.json").write_text(json.dumps(status))

    got = archive.read_page(job_dir, alive=False)
    assert got["state"] == "died"  # "running" with no runner alive
    history = got["checkpoints"]["history"]
    assert [(h["id"], h["status"], h.get("retained", False)) for h in history] == [
        (3, "completed", True), (4, "completed", True), (5, "failed", False),
    ]  # fmt: skip
    assert got["checkpoints"]["history"][0]["size_bytes"] > 0
    assert got["archived"]["retained_checkpoints"] == [3, 4]
    assert got["archived"]["written_ms"] == 123

    (job_dir / archive.PAGE_FILE).unlink()  # a run that never wrote its page
    status.update(state="finished", records_in=7, watermarks={"stages": []})
    (job_dir / "status.json").write_text(json.dumps(status))
    got = archive.read_page(job_dir, alive=False)
    assert got["state"] == "finished" and got["records"]["in"] == 7
    assert [h["id"] for h in got["checkpoints"]["history"]] == [3, 4]


def _status_file(where: Path, **fields: Any) -> None:
    job_dir = where / "jobs" / "wm-job"
    job_dir.mkdir(parents=True)
    status = {"job": "wm-job", "state": "running", "pid": os.getpid(), "updated_ms": 1}
    status.update(workers=[], web="http://127.0.0.1:9250/", **fields)
    (job_dir / "status.json").write_text(json.dumps(status))


def test_status_web_names_the_live_page_when_the_job_still_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A running job's page is its runner's: ``--web`` serves nothing and says where it is."""
    from processor.cli import main

    _status_file(tmp_path)  # this process is its "runner": alive
    monkeypatch.setenv("EOSFLOW_STATE_DIR", str(tmp_path))
    assert main(["status", "wm-job", "--web"]) == 0
    assert "is running: its live page is http://127.0.0.1:9250/" in capsys.readouterr().out


def test_status_web_refuses_an_address_it_cannot_serve_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from processor.cli import main

    _status_file(tmp_path, state="finished")
    monkeypatch.setenv("EOSFLOW_STATE_DIR", str(tmp_path))
    assert main(["status", "wm-job", "--web", "--address", "off"]) == 2
    assert "--address 'off': give HOST:PORT" in capsys.readouterr().err


def test_a_backfill_of_old_events_says_historical_instead_of_days_behind_now() -> None:
    """Issue 50: "1109d12h behind now" dominated the page and ``status`` for historical data:
    a constant, while how far the job trails what it read is what moves."""
    wm = summarize(_plan(), _tasks(), NOW + 1109 * 86_400_000)
    line = status_lines(wm, limit=2)[0]
    assert "3m16s behind newest; historical event time" in line and "behind now" not in line
