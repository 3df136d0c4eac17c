"""docs/observability.md against a real job (issue 37): the metric names it documents are the
ones a running job exports, and the page of a finished run stays readable.

One paced two-stage job (``pipelines/running_total_work.py``: clicks with event times, a
shuffle by user, a running total into files) runs on the embedded broker while a thread
scrapes its ``/metrics`` and ``/api/job``. Then:

* every metric of the docs' metrics tables (their backticked ``eosflow_`` names) is exported,
  with the documented type, and every ``eosflow_`` metric exported is in the tables (issue 37:
  the docs named a metric that was not exported; prometheus_client's ``*_created`` series were
  exported and documented nowhere);
* the watermarks are exported per stage and per source partition while the job runs;
* ``eosflow status --web JOB`` (a subprocess, as a user runs it) serves the page and
  ``/api/job`` of the finished run from its state directory, with its watermarks and its
  checkpoint history, until Ctrl-C.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from processor.runtime.job import job_dir
from tests.e2e.scrape import Scraper, run_paced

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "observability.md"
TYPE_LINE = re.compile(r"^# TYPE (eosflow_\w+) (\w+)$", re.M)


def documented_metrics(doc: str) -> dict[str, str]:
    """``name -> type`` of every row of the doc's metrics tables (``| `eosflow_x` | type |``)."""
    rows = re.findall(r"^\|\s*`(eosflow_\w+)`\s*\|\s*([a-z]+)", doc, re.M)
    return dict(rows)


def exported_metrics(expositions: list[str]) -> dict[str, str]:
    """``name -> type`` of every family of the expositions, by their ``# TYPE`` lines (which
    name counters with ``_total`` and histograms by their base name, as the docs do)."""
    found: dict[str, str] = {}
    for text in expositions:
        found.update(TYPE_LINE.findall(text))
    return found


@pytest.fixture(scope="module")
def finished_job(
    kafka_endpoint: tuple[str, str], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, Scraper, list[str], Path]:
    tmp = tmp_path_factory.mktemp("observability-docs")
    texts: list[str] = []

    class RawScraper(Scraper):
        def __call__(self, runner: Any) -> None:
            deadline = time.monotonic() + 60
            while runner.web is None and time.monotonic() < deadline:
                time.sleep(0.05)
            url = runner.web.url
            while time.monotonic() < deadline:
                try:
                    with urllib.request.urlopen(url + "metrics", timeout=5) as r:
                        texts.append(r.read().decode())
                except OSError:
                    break
                time.sleep(0.3)

    scraper = RawScraper()
    run = run_paced(
        "running_total_work.py",
        brokers=kafka_endpoint[0],
        tmp=tmp,
        records=8_000,
        during=scraper,
        max_rate=1_000.0,  # two workers: about 4 s of input, several scrapes
        interval=0.3,
    )
    return run, scraper, texts, tmp / "state"


def test_every_documented_metric_is_exported_by_a_running_job_and_no_other(
    finished_job: tuple[Any, Scraper, list[str], Path],
) -> None:
    run, _scraper, texts, _state = finished_job
    assert len(texts) >= 3, f"only {len(texts)} scrapes during the run"
    documented = documented_metrics(DOC.read_text())
    assert len(documented) > 20, "the metrics tables of docs/observability.md were not found"
    exported = exported_metrics(texts)
    missing = sorted(set(documented) - set(exported))
    assert not missing, f"documented in docs/observability.md, not exported: {missing}"
    undocumented = sorted(set(exported) - set(documented))
    assert not undocumented, f"exported, not in docs/observability.md: {undocumented}"
    for name, kind in exported.items():
        assert documented[name] == kind, (
            f"{name}: exported as a {kind}, documented as a {documented[name]}"
        )
        if kind == "counter":
            assert name.endswith("_total"), name

    # Sample names: counters as <name>_total, histograms as _bucket, _sum and _count only.
    last = texts[-1]
    for name, kind in exported.items():
        samples = set(re.findall(rf"^({name}\w*)[{{ ]", last, re.M))
        if kind == "histogram" and samples:
            assert {s.removeprefix(name) for s in samples} <= {"_bucket", "_sum", "_count"}
        elif samples:
            assert samples == {name}, (name, samples)
    # The label is eosflow_job (a label, not a metric: issue 37).
    assert f'eosflow_records_in_total{{eosflow_job="{run.result.job}"}}' in last


def test_watermarks_are_exported_per_stage_and_per_source_partition_while_a_job_runs(
    finished_job: tuple[Any, Scraper, list[str], Path],
) -> None:
    run, _scraper, texts, _state = finished_job
    base_s = 1_700_000_000  # examples/clicks.py: event times from here, 10 ms apart
    stage_wms = [
        float(v)
        for t in texts
        for v in re.findall(r"^eosflow_watermark_timestamp_seconds\{[^}]*\} (\S+)$", t, re.M)
    ]
    finite = [v for v in stage_wms if v != float("inf")]
    assert finite and all(base_s <= v < base_s + 8_000 * 0.01 + 60 for v in finite), stage_wms
    parts = {
        m
        for t in texts
        for m in re.findall(
            r'^eosflow_source_partition_watermark_timestamp_seconds\{[^}]*partition="(\d+)"',
            t,
            re.M,
        )
    }
    assert len(parts) == 8, parts  # the clicks topic's 8 partitions
    assert any("eosflow_watermark_held_by{" in t for t in texts)
    states = {
        state
        for t in texts
        for state in re.findall(
            r'^eosflow_source_partition_state\{[^}]*state="(\w+)"[^}]*\} 1', t, re.M
        )
    }
    assert "reading" in states, states
    assert run.result.records_in == 8_000


def _serve(state: Path, job: str) -> tuple[subprocess.Popen[str], str]:
    # faulthandler: a SIGABRT dumps every thread's stack (see _stop)
    env = {
        **os.environ, "EOSFLOW_STATE_DIR": str(state), "PYTHONPATH": str(ROOT),
        "PYTHONFAULTHANDLER": "1",
    }  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "processor.cli", "status", job, "--web", "--address", "127.0.0.1:0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # Started with SIGINT ignored, as a shell's background job is (and as this test's
        # process was once a test had run a worker's main in it): Ctrl-C must still stop it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 30
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        found = re.search(r"(http://127\.0\.0\.1:\d+/)", line)
        if found:
            return proc, found.group(1)
    proc.kill()
    raise AssertionError(f"no URL printed: {lines} {proc.stderr.read() if proc.stderr else ''}")


def _stop(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """Ctrl-C, and the output; if it hangs, its threads' stacks (faulthandler, SIGABRT) are in
    the failure (they showed the main thread in its sleep loop: SIGINT was ignored, inherited
    from the suite's process)."""
    proc.send_signal(signal.SIGINT)
    try:
        return proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        _out, err = proc.communicate(timeout=30)
        raise AssertionError(f"status --web ignored Ctrl-C for 60 s; its stacks:\n{err}") from None


def test_status_web_serves_the_page_of_a_finished_run_from_its_saved_state(
    finished_job: tuple[Any, Scraper, list[str], Path],
) -> None:
    run, _scraper, _texts, state = finished_job
    job = run.result.job
    assert (job_dir(job, str(state)) / "status.json").exists()
    proc, url = _serve(state, job)
    try:
        with urllib.request.urlopen(url + "api/job", timeout=5) as r:
            api = json.loads(r.read())
        with urllib.request.urlopen(url, timeout=5) as r:
            html = r.read().decode()
        with urllib.request.urlopen(url + "ui/panels.js", timeout=5) as r:
            assert r.status == 200
        with pytest.raises(urllib.error.HTTPError) as gone:
            urllib.request.urlopen(url + "metrics", timeout=5)
        assert gone.value.code == 404
    finally:
        out, err = _stop(proc)
    assert proc.returncode == 0, (out, err)
    assert 'src="ui/app.js"' in html
    assert api["job"] == job and api["state"] == "finished"
    assert api["archived"]["page_file"]
    assert api["records"]["in"] == run.result.records_in
    assert len(api["graph"]["stages"]) == 2
    # The checkpoint history: the run's own, the ones the store retains marked.
    history = api["checkpoints"]["history"]
    completed = [h["id"] for h in history if h["status"] == "completed"]
    assert run.result.last_checkpoint in completed
    assert len(completed) >= run.result.checkpoints
    retained = api["archived"]["retained_checkpoints"]
    assert retained and run.result.last_checkpoint in retained
    assert all(h.get("retained") for h in history if h["id"] in retained)
    # The watermarks as the run ended: every stage at the end of the bounded input.
    wms = api["watermarks"]
    assert [s["stage"] for s in wms["stages"]] == [s["name"] for s in api["graph"]["stages"]]
    assert len(wms["sources"]) == 8
    assert all(p["newest_ms"] and p["watermark_ms"] for p in wms["sources"])


def test_status_shows_the_watermarks_of_the_last_run(
    finished_job: tuple[Any, Scraper, list[str], Path],
) -> None:
    run, _scraper, _texts, state = finished_job
    job = run.result.job
    saved = json.loads((job_dir(job, str(state)) / "status.json").read_text())
    assert [s["stage"] for s in saved["watermarks"]["stages"]] and saved["watermarks"]["sources"]
    # faulthandler: a SIGABRT dumps every thread's stack (see _stop)
    env = {
        **os.environ, "EOSFLOW_STATE_DIR": str(state), "PYTHONPATH": str(ROOT),
        "PYTHONFAULTHANDLER": "1",
    }  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "processor.cli", "status", job],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    lines = out.splitlines()
    assert any(line.startswith("watermark  ") for line in lines), out
    assert sum(1 for line in lines if line.startswith("  stage    ")) == 2, out
    assert sum(1 for line in lines if line.startswith("  source   ")) == 8, out
