"""Scraping a running job's ``/metrics`` and ``/api/job`` (tests of issue 25)."""

from __future__ import annotations

import itertools
import json
import time
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from processor.runtime.metrics import METRICS
from processor.runtime.runner import Runner

__all__ = ["Samples", "Scraper", "assert_monotonic", "samples", "value"]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(text: str) -> Samples:
    """``(sample name, sorted labels) -> value`` of an exposition."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(got: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in got.items() if n == name and want <= set(ls))


class Scraper:
    """Scrapes the runner's ``/metrics`` and ``/api/job`` until the job ends."""

    def __init__(self) -> None:
        self.metrics: list[Samples] = []
        self.api: list[dict[str, Any]] = []
        self.content_type = ""
        self.runner: Runner | None = None

    def __call__(self, runner: Runner) -> None:
        self.runner = runner
        deadline = time.monotonic() + 120
        while runner.web is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert runner.web is not None, "the runner never served its metrics"
        url = runner.web.url
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url + "metrics", timeout=5) as r:
                    self.content_type = r.headers["Content-Type"]
                    self.metrics.append(samples(r.read().decode()))
                with urllib.request.urlopen(url + "api/job", timeout=5) as r:
                    self.api.append(json.loads(r.read()))
            except OSError:
                return  # the job finished: its server is gone
            time.sleep(0.3)


def assert_monotonic(scrapes: list[Samples]) -> None:
    counters = {
        n.removesuffix("_total") for n, (kind, _h, _l) in METRICS.items() if kind == "counter"
    }
    for before, after in itertools.pairwise(scrapes):
        for key, v in before.items():
            name = key[0]
            if name.removesuffix("_total") in counters or name.endswith(("_count", "_bucket")):
                assert after.get(key, 0.0) >= v, f"counter {key} went down: {v} -> {after.get(key)}"
