"""Scraping a running job's ``/metrics`` and ``/api/job`` (tests of issue 25)."""

from __future__ import annotations

import itertools
import json
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from processor.runtime.observe.metrics import METRICS
from processor.runtime.supervision.runner import Runner
from tests.e2e.harness import ChaosRun, chaos_seed, run_chaos

__all__ = ["Samples", "Scraper", "assert_monotonic", "run_paced", "samples", "value"]

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


def run_paced(
    pipeline: str,
    *,
    brokers: str,
    tmp: Path,
    records: int,
    during: Callable[[Runner], None],
    max_rate: float,
    interval: float = 0.5,
    seed: int | None = None,
    **kw: Any,
) -> ChaosRun:
    """:func:`~tests.e2e.harness.run_chaos` (aligned) with the runner serving its job page and
    metrics on any free loopback port, each worker reading at most ``max_rate`` records/s so
    that ``during(runner)`` sees the job at work."""
    return run_chaos(
        pipeline,
        brokers=brokers,
        tmp=tmp,
        records=records,
        seed=chaos_seed() if seed is None else seed,
        mode="aligned",
        interval=interval,
        run_options={"metrics": "127.0.0.1:0", "max_rate": max_rate},
        during=during,
        **kw,
    )
