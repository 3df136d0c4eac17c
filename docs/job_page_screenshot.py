"""Writes docs/job-page.png: the job page of a real run, taken in headless Chromium.

    python docs/job_page_screenshot.py

The run: ``tests/e2e/pipelines/dedup_window_count.py`` (clicks with 10 % copies, dedup by ID
in Redis, windowed count per page, files) on the embedded broker and Redis, 2 workers paced to
1,500 records/s each, one worker SIGKILLed at its second ``after-snapshot-before-ack`` (a
restart and an aborted checkpoint to show). The picture is taken 20 s after the page first
drew. Needs Debian's chromium and chromium-driver (``.ci/run`` installs them).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from processor.embedded import servers  # noqa: E402
from processor.runtime.job import Fault  # noqa: E402
from tests.e2e.harness import chaos_seed, run_chaos  # noqa: E402

OUT = ROOT / "docs" / "job-page.png"


def _browser(profile: str) -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in (
        "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={profile}", "--window-size=1440,1200",
    ):  # fmt: skip
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp, servers(["kafka", "redis"]) as ends:
        browser = _browser(str(Path(tmp) / "profile"))

        def shoot(runner: Any) -> None:
            while runner.web is None:
                time.sleep(0.1)
            browser.get(runner.web.url)
            time.sleep(20)
            height = browser.execute_script("return document.documentElement.scrollHeight")
            browser.execute_cdp_cmd(
                "Emulation.setDeviceMetricsOverride",
                {"width": 1440, "height": int(height), "deviceScaleFactor": 1, "mobile": False},
            )
            browser.save_screenshot(str(OUT))
            print(f"wrote {OUT}", file=sys.stderr)

        try:
            assert ends.kafka_brokers is not None and ends.redis_url is not None
            run_chaos(
                "dedup_window_count.py",
                brokers=ends.kafka_brokers,
                tmp=Path(tmp),
                records=60_000,
                seed=chaos_seed(),
                mode="aligned",
                interval=1.0,
                duplicates=0.10,
                faults=[Fault(0, 1, "after-snapshot-before-ack", 2)],
                env={"EOSFLOW_REDIS_URL": ends.redis_url},
                run_options={"metrics": "127.0.0.1:0", "max_rate": 1_500.0},
                during=shoot,
            )
        finally:
            browser.quit()


if __name__ == "__main__":
    main()
