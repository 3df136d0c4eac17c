"""The job page (processor/runtime/observe/ui) in a real browser: Debian's chromium, driven by
selenium through Debian's chromedriver (named explicitly, so that Selenium Manager never downloads
one).

The fixture tests serve the page's files and a fixed ``/api/job`` document (the schema of
docs/observability.md) from a stdlib HTTP server, and check what the page draws from it: the
stage boxes and the edge of the graph, one bar per checkpoint with the failed ones marked, the
tables, the banner when ``/api/job`` fails. ``EOSFLOW_UPDATE_SCREENSHOT=1`` writes the first
one's screenshot to ``docs/job-page.png``. The live test loads the page from the runner's own
server (processor/runtime/observe/webui.py) while a paced job runs on the embedded broker.

Without chromium or chromedriver the tests skip, except under ``CI`` (which installs them),
where they fail.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

# One Chromium at a time (xdist loadgroup): 4 browsers driving pages at once went stale under load.
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("browser")]

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ROOT = Path(__file__).resolve().parents[2]
UI = ROOT / "processor" / "runtime" / "observe" / "ui"
ASSETS = {"app.js": "text/javascript", "panels.js": "text/javascript", "style.css": "text/css"}
WAIT_S = 10.0


def _unavailable(reason: str) -> None:
    # CI installs chromium and chromedriver: a missing browser there is a broken CI, not a skip.
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    """A headless chromium, its profile in ``tmp_path``, no network of its own."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        _unavailable(
            f"the job page's browser test needs {' and '.join(missing)} "
            "(apt-get install chromium chromium-driver)"
        )
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _unavailable("the job page's browser test needs selenium (pip install -e '.[dev]')")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1440,1000",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


class _PageServer:
    """The page's files at ``/`` and ``/ui/*``, ``job`` at ``/api/job`` (a 503 when ``None``):
    what the runner's web server serves, without a runner."""

    def __init__(self, job: dict[str, Any] | None) -> None:
        self.job = job
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/":
                    self._send(200, "text/html", (UI / "index.html").read_bytes())
                elif path.startswith("/ui/") and path[4:] in ASSETS:
                    self._send(200, ASSETS[path[4:]], (UI / path[4:]).read_bytes())
                elif path == "/api/job" and owner.job is not None:
                    self._send(200, "application/json", json.dumps(owner.job).encode())
                elif path == "/api/job":
                    self._send(503, "text/plain", b"gone")
                else:
                    self._send(404, "text/plain", b"not found")

            def _send(self, status: int, kind: str, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> _PageServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def fixture_watermarks(now_ms: int) -> dict[str, Any]:
    """The watermarks of :func:`fixture_job` (observe.watermarks.summarize's schema): a
    backfill 3 hours behind, held back by ``clicks.v1[2]``; partition 1 paused ahead by
    watermark alignment, partition 3 idle."""
    base = now_ms - 3 * 3600_000
    marks = [(base + 40_000, "reading"), (base + 95_000, "ahead"), (base, "reading")]
    marks.append((base + 20_000, "idle"))
    newest = base + 100_000
    sources = [
        {
            "topic": "clicks.v1",
            "partition": p,
            "task": f"clicks.{p % 2}",
            "watermark_ms": wm,
            "newest_ms": wm + 5_000,
            "state": state,
            "lag_s": (now_ms - wm) / 1000,
            "behind_newest_s": (newest - wm) / 1000,
            "holding": p == 2,
        }
        for p, (wm, state) in enumerate(marks)
    ]
    held = {"topic": "clicks.v1", "partition": 2, "state": "reading", "task": "clicks.0"}
    channel = {"topic": "eosflow.clicks-by-user.ch0", "partition": 1, "state": "reading"}

    def stage(name: str, wm: int, by: dict[str, Any]) -> dict[str, Any]:
        return {
            "stage": name,
            "source": name == "clicks",
            "watermark_ms": wm,
            "end": False,
            "lag_s": (now_ms - wm) / 1000,
            "behind_newest_s": (newest - wm) / 1000,
            "held_by": by,
            "tasks": 2,
        }

    return {
        "now_ms": now_ms,
        "watermark_ms": base - 2_000,
        "end": False,
        "lag_s": (now_ms - base + 2_000) / 1000,
        "behind_newest_s": (newest - base + 2_000) / 1000,
        "newest_ms": newest,
        "held_by": held,
        "paused_ahead": 1,
        "alignment_ms": base,
        "stages": [
            stage("clicks", base, held),
            stage("count", base - 2_000, {**channel, "task": "count.1"}),
        ],
        "sources": sources,
    }


def fixture_job(now_ms: int | None = None) -> dict[str, Any]:
    """A two-stage job an hour in: clicks parsed and shuffled to a keyed count, 30 checkpoints
    of which two failed, one restart, lag on both sides of the channel, two dead letters, a
    watermark held back by one source partition."""
    now_ms = now_ms if now_ms is not None else int(time.time() * 1000)
    history = []
    for i in range(30):
        cid = 112 + i
        at_ms = now_ms - (30 - i) * 2000
        if cid == 121:
            entry = {"status": "failed", "reason": "timeout", "duration_s": 1.5}
            entry.update(alignment_s=None, size_bytes=None)
        elif cid == 133:
            entry = {"status": "failed", "reason": "declined", "duration_s": None}
            entry.update(alignment_s=None, size_bytes=None)
        else:
            entry = {
                "status": "completed",
                "reason": None,
                "duration_s": round(0.08 + 0.03 * ((i * 7) % 11) + (0.35 if i == 18 else 0), 3),
                "alignment_s": round(0.01 + 0.008 * ((i * 5) % 7), 3),
                "size_bytes": 180_000 + 9_000 * i + 20_000 * (i % 4),
            }
        history.append({"id": cid, "at_ms": at_ms, **entry})
    return {
        "job": "clicks-by-user",
        "state": "running",
        "runner": "local",
        "mode": "aligned",
        "recovery": "global",
        "generation": 2,
        "restarts": 1,
        "uptime_s": 3725.4,
        "updated_ms": now_ms,
        "workers": [
            {"worker": 0, "pid": 4101, "host": "node-a", "connected": True},
            {"worker": 1, "pid": 4388, "host": "node-a", "connected": True},
        ],
        "graph": {
            "stages": [
                {
                    "name": "clicks",
                    "parallelism": 2,
                    "steps": ["clicks", "parse", "key-by-user"],
                    "sources": ["clicks.v1"],
                    "sinks": [],
                },
                {
                    "name": "count",
                    "parallelism": 2,
                    "steps": ["count", "totals-out"],
                    "sources": [],
                    "sinks": ["totals-out"],
                },
            ],
            "edges": [
                {
                    "src": "clicks",
                    "dst": "count",
                    "topic": "eosflow.clicks-by-user.ch0",
                    "shuffle": True,
                    "back": False,
                }
            ],
        },
        "steps": {
            "clicks": {"in": 7_412_330, "out": 7_412_330, "in_per_s": 2010.0, "out_per_s": 2010.0},
            "parse": {"in": 7_412_330, "out": 7_412_318, "in_per_s": 2010.0, "out_per_s": 2009.5},
            "key-by-user": {"in": 7_412_318, "out": 7_412_318, "in_per_s": 2009.5},
            "count": {"in": 7_412_100, "out": 7_412_100, "in_per_s": 1998.0, "out_per_s": 1998.0},
            "totals-out": {"in": 7_412_100, "out": 7_412_100, "in_per_s": 1998.0},
        },
        "records": {"in": 7_412_330, "out": 7_412_100, "in_per_s": 2010.0, "out_per_s": 1998.0},
        "checkpoints": {
            "completed": 140,
            "failed": {"timeout": 1, "declined": 1, "restart": 0},
            "last_completed": 141,
            "pending": 142,
            "history": history,
        },
        "restarts_list": [
            {
                "at_ms": now_ms - 41 * 60_000,
                "cause": "worker 1 killed by signal SIGKILL",
                "kind": "killed",
            }
        ],
        "lag": {
            "sources": [
                {"topic": "clicks.v1", "partition": p, "records": r}
                for p, r in enumerate([120, 85, 430, 12])
            ],
            "channels": [
                {"topic": "eosflow.clicks-by-user.ch0", "partition": p, "records": r}
                for p, r in enumerate([3, 0])
            ],
        },
        "watermarks": fixture_watermarks(now_ms),
        "dead_letters": {
            "total": 12,
            "recent": [
                {
                    "step": "parse",
                    "error_type": "JSONDecodeError",
                    "cause": "Expecting ',' delimiter: line 1 column 18 (char 17)",
                    "topic": "clicks.v1",
                    "partition": 2,
                    "offset": 1_840_221,
                },
                {
                    "step": "parse",
                    "error_type": "KeyError",
                    "cause": "'user_id'",
                    "topic": "clicks.v1",
                    "partition": 0,
                    "offset": 1_851_007,
                },
            ],
        },
    }


def _wait(driver: Any, condition: Any, what: str) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, WAIT_S, poll_frequency=0.1).until(condition, message=what)


def _body(driver: Any, key: str) -> str | None:
    return driver.execute_script(f"return document.body.dataset.{key} || null")  # type: ignore[no-any-return]


def _rows(driver: Any, table: str) -> list[list[str]]:
    """A table's cells, read in one script: the page may redraw it between two WebDriver
    calls (a stale element)."""
    return driver.execute_script(  # type: ignore[no-any-return]
        "return [...document.querySelectorAll(arguments[0])]"
        ".map(tr => [...tr.cells].map(td => td.textContent.trim()))",
        f"#{table} tbody tr:not(.empty)",
    )


def _drawn(driver: Any) -> dict[str, Any]:
    """What the page drew, read in one script: it redraws on every poll, so elements found by
    one WebDriver call may be stale by the next (seen in CI under load)."""
    return driver.execute_script(  # type: ignore[no-any-return]
        """
        const q = (s) => [...document.querySelectorAll(s)];
        const text = (id) => document.getElementById(id).textContent.trim();
        return {
          name: text("job-name"),
          state: text("job-state"),
          workers: text("job-workers"),
          stages: Object.fromEntries(q("#graph svg g.stage").map(
            (g) => [g.dataset.stage, g.getBoundingClientRect().x])),
          edges: q("#graph svg g.edge").map((g) => ({src: g.dataset.src, dst: g.dataset.dst,
            class: g.getAttribute("class"), text: g.textContent})),
          rates: Object.fromEntries(q("#graph text.step-rate").map(
            (t) => [t.dataset.step, t.textContent])),
          bars: q("#checkpoints svg rect.ckpt-duration").map((r) => ({id: r.dataset.id,
            class: r.getAttribute("class"),
            title: (r.querySelector("title") || {}).textContent || ""})),
          legends: q("#checkpoints svg .legend").length,
          ticks: q("#checkpoints svg text.tick").length,
          dead_letters_total: text("dead-letters-total"),
        };"""
    )


def _screenshot(driver: Any, tmp_path: Path) -> Path:
    """The whole page, not the window: resize to its height first."""
    height = driver.execute_script("return document.documentElement.scrollHeight")
    metrics = {"width": 1440, "height": int(height), "deviceScaleFactor": 1, "mobile": False}
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)
    update = os.environ.get("EOSFLOW_UPDATE_SCREENSHOT") == "1"
    path = ROOT / "docs" / "job-page.png" if update else tmp_path / "job-page.png"
    driver.save_screenshot(str(path))
    return path


def test_job_page_draws_graph_plot_and_tables_when_served_a_job(
    browser: Any, tmp_path: Path
) -> None:
    job = fixture_job()
    with _PageServer(job) as server:
        browser.get(server.url)
        _wait(browser, lambda d: _body(d, "loaded") == "1", "the page never rendered api/job")

        page = _drawn(browser)
        assert page["name"] == "clicks-by-user"
        assert page["state"].lower() == "running"
        assert page["workers"] == "2 / 2"

        assert sorted(page["stages"]) == ["clicks", "count"]
        [edge] = page["edges"]
        assert (edge["src"], edge["dst"]) == ("clicks", "count")
        assert "edge-shuffle" in edge["class"]
        assert "eosflow.clicks-by-user.ch0" in edge["text"]
        # Left to right by depth: the shuffle's target is drawn right of its source.
        assert page["stages"]["count"] > page["stages"]["clicks"]
        assert page["rates"]["parse"] == "2.0k \u2192 2.0k /s"

        bars = page["bars"]
        assert [int(b["id"]) for b in bars] == list(range(112, 142))
        failed = {b["id"]: b["title"] for b in bars if "failed" in b["class"]}
        assert sorted(failed) == ["121", "133"]
        assert "timeout" in failed["121"] and "declined" in failed["133"]
        assert page["legends"] > 0
        assert page["ticks"] > 8

        [restart] = _rows(browser, "restarts")
        assert restart[1:] == ["killed", "worker 1 killed by signal SIGKILL"]
        lag = _rows(browser, "lag")
        assert [row[:4] for row in lag[:2]] == [
            ["source", "clicks.v1", "0", "120"],
            ["source", "clicks.v1", "1", "85"],
        ]
        assert [row[0] for row in lag].count("channel") == 2
        assert len(_rows(browser, "dead-letters")) == 2
        assert "12" in _drawn(browser)["dead_letters_total"]

        # The watermarks: per stage, with the partition that holds each back, and per source
        # partition, the one holding the job back marked (issue 37).
        summary = browser.execute_script(
            "const s = document.getElementById('watermark-summary');"
            "return {text: s.textContent, held: s.dataset.heldBy};"
        )
        assert summary["held"] == "clicks.v1[2]"
        assert "held by clicks.v1[2]" in summary["text"]
        assert "3h00m behind now" in summary["text"] and "1m42s behind newest" in summary["text"]
        assert "1 partition paused ahead" in summary["text"]
        stages = _rows(browser, "watermark-stages")
        assert [r[0] for r in stages] == ["clicks", "count"]
        assert stages[0][2:] == ["3h00m", "1m40s", "clicks.v1[2]"]
        assert stages[1][4] == "eosflow.clicks-by-user.ch0[1]"
        assert re.fullmatch(r"\d\d:\d\d:\d\dZ|\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ", stages[0][1])
        sources = _rows(browser, "watermark-sources")
        assert [(r[1], r[5]) for r in sources] == [
            ("0", "reading"), ("1", "ahead"), ("2", "reading"), ("3", "idle"),
        ]  # fmt: skip
        holding = [r for r in sources if r[6]]
        assert [(r[1], r[6]) for r in holding] == [("2", "holds the job back")]
        marked = browser.execute_script(
            "return [...document.querySelectorAll('#watermark-sources tr[data-holding]')]"
            ".map((tr) => tr.cells[1].textContent)"
        )
        assert marked == ["2"]

        # It polls: a new document is drawn within a couple of seconds.
        job["restarts_list"].append(
            {"at_ms": job["updated_ms"], "cause": "worker 0 exited with code 1", "kind": "exited"}
        )
        _wait(browser, lambda d: len(_rows(d, "restarts")) == 2, "the page stopped polling")
        assert int(_body(browser, "updates") or 0) >= 2

        errors = [
            e
            for e in browser.get_log("browser")
            if e["level"] == "SEVERE" and "favicon" not in e["message"]
        ]
        assert errors == []
        print("screenshot:", _screenshot(browser, tmp_path))


def test_job_page_keeps_its_data_and_says_so_when_the_job_is_gone(browser: Any) -> None:
    from selenium.webdriver.common.by import By

    with _PageServer(fixture_job()) as server:
        browser.get(server.url)
        _wait(browser, lambda d: _body(d, "loaded") == "1", "the page never rendered api/job")
        banner = browser.find_element(By.ID, "error-banner")
        assert not banner.is_displayed()

        server.job = None  # the runner answers 503 (or is gone): the job finished
        _wait(browser, lambda d: banner.is_displayed(), "no banner when api/job failed")
        assert "Cannot reach the job" in banner.text
        assert browser.find_element(By.ID, "job-name").text == "clicks-by-user"
        assert len(browser.find_elements(By.CSS_SELECTOR, "#graph svg g.stage")) == 2
        assert len(browser.find_elements(By.CSS_SELECTOR, "rect.ckpt-duration")) == 30

        server.job = fixture_job()  # back again (a restarted runner)
        _wait(browser, lambda d: not banner.is_displayed(), "the banner stayed after recovery")


def test_job_page_draws_placeholders_when_the_job_has_no_data_yet(browser: Any) -> None:
    from selenium.webdriver.common.by import By

    empty: dict[str, Any] = {
        "job": "fresh",
        "state": "starting",
        "graph": {"stages": [], "edges": []},
        "steps": {},
        "checkpoints": {"completed": 0, "failed": {}, "history": [], "pending": None},
        "restarts_list": [],
        "lag": {"sources": [], "channels": []},
        "dead_letters": {"total": 0, "recent": []},
        "workers": None,
        "uptime_s": None,
    }
    with _PageServer(empty) as server:
        browser.get(server.url)
        _wait(browser, lambda d: _body(d, "loaded") == "1", "the page never rendered api/job")
        assert browser.find_element(By.ID, "job-name").text == "fresh"
        assert "No stages" in browser.find_element(By.ID, "graph").text
        assert "No checkpoints" in browser.find_element(By.ID, "checkpoints").text
        for table in ("restarts", "lag", "dead-letters", "watermark-stages", "watermark-sources"):
            assert _rows(browser, table) == []
        assert "no watermark" in browser.find_element(By.ID, "watermark-summary").text
        assert not browser.find_element(By.ID, "error-banner").is_displayed()


def test_job_page_says_it_shows_a_finished_run_when_served_from_its_saved_state(
    browser: Any,
) -> None:
    """``eosflow status --web``'s server (the runner's, given the saved document): the page
    draws the run as saved, watermarks included, under a note that the runner has exited."""
    from selenium.webdriver.common.by import By

    from processor.runtime.observe.webui import WebServer

    job = fixture_job()
    job["state"] = "finished"
    job["archived"] = {
        "status_file": "/state/jobs/clicks-by-user/status.json",
        "page_file": "/state/jobs/clicks-by-user/job-page.json",
        "written_ms": job["updated_ms"],
        "snapshot_url": "file:///state/checkpoints",
        "retained_checkpoints": [139, 140, 141],
        "store_error": None,
    }
    server = WebServer(None, "127.0.0.1:0", page=job)
    try:
        browser.get(server.url)
        _wait(browser, lambda d: _body(d, "loaded") == "1", "the page never rendered api/job")
        note = browser.find_element(By.ID, "archived-note")
        assert note.is_displayed()
        assert "runner has exited" in note.text and "3 checkpoints" in note.text
        assert not browser.find_element(By.ID, "error-banner").is_displayed()
        assert browser.find_element(By.ID, "job-state").text.lower() == "finished"
        assert len(_rows(browser, "watermark-sources")) == 4
        assert len(browser.find_elements(By.CSS_SELECTOR, "rect.ckpt-duration")) == 30
    finally:
        server.close()


class _LiveChecks:
    """Runs in a thread beside a real job (``run_chaos``'s ``during``): opens the runner's page
    as soon as it serves one and waits until it draws the graph and a checkpoint."""

    def __init__(self, browser: Any, tmp_path: Path) -> None:
        self.browser = browser
        self.tmp_path = tmp_path
        self.url: str | None = None
        self.seen: dict[str, Any] = {}
        self.wm: dict[str, Any] = {}
        self.error: BaseException | None = None
        self.done = threading.Event()

    def __call__(self, runner: Any) -> None:
        try:
            self._check(runner)
        except BaseException as exc:  # re-raised by the test, in its own thread
            self.error = exc
        finally:
            self.done.set()

    def _check(self, runner: Any) -> None:
        deadline = time.monotonic() + 20
        while runner.web is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert runner.web is not None, "the runner never served its job page"
        self.url = runner.web.url
        self.browser.get(self.url)
        _wait(self.browser, lambda d: _body(d, "loaded") == "1", "the page never rendered")
        script = """
            const q = (s) => [...document.querySelectorAll(s)];
            return {
              stages: q("#graph svg g.stage").map((g) => g.dataset.stage),
              edges: q("#graph svg g.edge").map((g) => [g.dataset.src, g.dataset.dst,
                g.classList.contains("edge-shuffle")]),
              checkpoints: q("#checkpoints svg rect.ckpt-duration").map((r) => r.dataset.id),
              rates: q("#graph text.step-rate").map((t) => t.textContent),
              name: document.getElementById("job-name").textContent,
              state: document.getElementById("job-state").textContent,
              workers: document.getElementById("job-workers").textContent,
              lag: q("#lag tbody tr:not(.empty)").length,
              held: document.getElementById("watermark-summary").dataset.heldBy || "",
              wm_summary: document.getElementById("watermark-summary").textContent,
              wm_stages: q("#watermark-stages tbody tr:not(.empty)").map(
                (tr) => [...tr.cells].map((td) => td.textContent.trim())),
              wm_sources: q("#watermark-sources tbody tr:not(.empty)").map(
                (tr) => [...tr.cells].map((td) => td.textContent.trim())),
            };"""

        def drawn(driver: Any) -> bool:
            self.seen = driver.execute_script(script)
            return len(self.seen["checkpoints"]) >= 1 and len(self.seen["stages"]) >= 2

        def rated(driver: Any) -> bool:
            drawn(driver)
            return any(t and not t.startswith(("0 ", "\u2013")) for t in self.seen["rates"])

        def watermarked(driver: Any) -> bool:
            drawn(driver)
            seen = self.seen
            times = [r[2] for r in seen["wm_sources"]]
            return bool(seen["held"]) and len(times) == 8 and "none yet" not in times

        _wait(self.browser, drawn, "no graph or no checkpoint drawn while the job ran")
        # The watermarks: every source partition's, and the one holding the job back named.
        _wait(self.browser, watermarked, "no watermark panel with a held-by partition drawn")
        self.wm = dict(self.seen)
        # The paced job reads all along: some step shows a rate above zero.
        _wait(self.browser, rated, "no step rate shown while the job ran")
        self.seen["api"] = self.browser.execute_script(
            "return fetch('api/job').then((r) => r.json())"
        )
        self.browser.save_screenshot(str(self.tmp_path / "job-page-live.png"))
        print("live screenshot:", self.tmp_path / "job-page-live.png")


def test_job_page_draws_a_running_job_from_its_runner(
    browser: Any, kafka_endpoint: tuple[str, str], tmp_path: Path
) -> None:
    """The page as the runner serves it (processor/runtime/observe/webui.py), while a paced
    two-stage job runs: its stages, the shuffle between them, its checkpoints; then, the job over
    and its server gone, the banner over the last data."""
    from selenium.webdriver.common.by import By

    from tests.e2e.scrape import run_paced

    checks = _LiveChecks(browser, tmp_path)
    run = run_paced(
        "running_total_work.py",
        brokers=kafka_endpoint[0],
        tmp=tmp_path,
        records=12_000,
        during=checks,
        max_rate=750.0,  # two workers at 750 records/s each: about 8 s of input
    )
    # run_chaos waits 5 s for this thread; the browser is not to be shared with it.
    assert checks.done.wait(WAIT_S), "the page checks outlived the job"
    if checks.error is not None:
        raise checks.error
    assert checks.url is not None
    seen = checks.seen
    assert seen["name"] == run.result.job
    stages = {s["name"] for s in seen["api"]["graph"]["stages"]}
    assert sorted(seen["stages"]) == sorted(stages) and len(stages) == 2
    assert len(seen["edges"]) == 1 and seen["edges"][0][2] is True  # the shuffle by user
    assert len(seen["checkpoints"]) >= 1
    assert seen["workers"] == "2 / 2"
    wm = checks.wm
    topic = seen["api"]["graph"]["stages"][0]["sources"][0]
    assert re.fullmatch(rf"{re.escape(topic)}\[\d\]", wm["held"]), wm["held"]
    assert f"held by {wm['held']}" in wm["wm_summary"]
    assert [r[0] for r in wm["wm_stages"]] == [s["name"] for s in seen["api"]["graph"]["stages"]]
    assert sorted(int(r[1]) for r in wm["wm_sources"]) == list(range(8))
    assert sum(1 for r in wm["wm_sources"] if r[6] == "holds the job back") == 1

    # The job is over and its server closed: the page says so and keeps what it drew.
    banner = browser.find_element(By.ID, "error-banner")
    _wait(browser, lambda d: banner.is_displayed(), "no banner once the runner was gone")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#graph svg g.stage")) == 2
    assert browser.find_elements(By.CSS_SELECTOR, "#checkpoints svg rect.ckpt-duration")


def test_job_page_assets_exist_and_use_no_network() -> None:
    """The page is served offline: no CDN, no absolute URL in its files."""
    html = (UI / "index.html").read_text()
    assert 'href="ui/style.css"' in html and 'src="ui/app.js"' in html
    for name in ("index.html", *ASSETS):
        text = (UI / name).read_text()
        assert "http://" not in text.replace("http://www.w3.org/2000/svg", "")
        assert "https://" not in text
        assert len(text.splitlines()) < 600
