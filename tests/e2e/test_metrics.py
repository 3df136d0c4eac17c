"""Prometheus metrics and ``/api/job`` scraped over HTTP while a real job runs (issue 25).

The job is ``pipelines/dedup_window_count.py``: clicks with 10 % copies, deduplicated by ID in
Redis (a shuffle by ID), counted per page and 10 s window (a second shuffle), into files. A
thread scrapes ``/metrics`` and ``/api/job`` while it runs; the test then checks that counters
never went down between scrapes, and that the final values agree with the
:class:`~processor.runtime.job.RunResult` and with what the input holds (computed from
``examples/clicks.py``, not by the engine): every click read once, every copy dropped by the
dedup step, every checkpoint counted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from connectors import KafkaSettings, TopicAdmin
from processor.runtime.job import Fault
from tests.e2e.harness import chaos_seed, click_events, with_duplicates
from tests.e2e.scrape import Scraper, assert_monotonic, run_paced, samples, value

pytestmark = [pytest.mark.integration]


def _run(tmp: Path, kafka: str, redis_url: str, records: int, **kw: Any) -> tuple[Any, Scraper]:
    scraper = Scraper()
    run = run_paced(
        "dedup_window_count.py",
        brokers=kafka,
        tmp=tmp,
        records=records,
        during=scraper,
        max_rate=3_000.0,  # so that the scraper sees the job at work several times
        interval=0.3,
        duplicates=0.10,
        # Filters that fill (fp 0.4, 2,000 IDs): Bloom hits are looked up in Redis.
        env={
            "EOSFLOW_REDIS_URL": redis_url,
            "DEDUP_FP_RATE": "0.4",
            "DEDUP_EXPECTED_IDS": "2000",
            "DEDUP_BUCKET_S": "60",
        },
        **kw,
    )
    return run, scraper


def test_metrics_scraped_during_a_run_agree_with_its_result_and_its_input(
    kafka_endpoint: tuple[str, str], redis_url: str, tmp_path: Path
) -> None:
    seed = chaos_seed()
    records = 24_000
    run, scraper = _run(tmp_path, kafka_endpoint[0], redis_url, records, seed=seed)
    result = run.result
    assert result.restarts == 0
    copies = sum(1 for _ in with_duplicates(click_events(records, seed=seed), 0.10, seed=seed))
    assert len(scraper.metrics) >= 3, f"only {len(scraper.metrics)} scrapes during the run"
    assert scraper.content_type.startswith("text/plain; version=")  # the text format
    assert_monotonic(scraper.metrics)
    assert value(scraper.metrics[-1], "eosflow_records_in_total") <= copies

    assert scraper.runner is not None
    final = samples(generate_latest(scraper.runner.metrics.registry).decode())  # type: ignore[union-attr]
    assert_monotonic([*scraper.metrics, final])
    job = {"eosflow_job": result.job}
    assert value(final, "eosflow_records_in_total", **job) == result.records_in == copies
    assert value(final, "eosflow_records_out_total", **job) == result.records_out
    assert value(final, "eosflow_sink_records_total", sink="out") == result.records_out
    # committed: each epoch once; no restart, so what was handed to the sink, the output's rows
    assert value(final, "eosflow_records_committed_total", **job) == result.records_committed
    assert result.records_committed == result.records_out == sum(run.output.values())
    # The source step counts what it read and emitted (no bad records here).
    assert value(final, "eosflow_step_records_in_total", step="clicks") == copies
    assert value(final, "eosflow_step_records_out_total", step="clicks") == copies
    # The dedup step: every copy dropped, every click through once (no restart: exact).
    assert value(final, "eosflow_step_records_in_total", step="unique") == copies
    assert value(final, "eosflow_step_records_out_total", step="unique") == records
    assert value(final, "eosflow_dedup_duplicates_total") == copies - records
    assert value(final, "eosflow_dedup_lookups_total") > 0
    assert value(final, "eosflow_dedup_redis_round_trips_total") > 0
    # Checkpoints: the counter, the histograms' counts and the last id agree with the result.
    assert value(final, "eosflow_checkpoints_completed_total") == result.checkpoints > 0
    for h in ("duration_seconds", "alignment_seconds", "size_bytes"):
        assert value(final, f"eosflow_checkpoint_{h}_count") == result.checkpoints
    assert value(final, "eosflow_checkpoint_size_bytes_sum") > 0
    assert value(final, "eosflow_last_checkpoint") == result.last_checkpoint
    assert value(final, "eosflow_sink_commit_seconds_count", sink="out") > 0
    assert value(final, "eosflow_restarts_total") == 0
    assert value(final, "eosflow_workers", state="connected") == 2
    # Lag per source partition (8) and queued records per channel partition were reported.
    lag = {ls for (n, ls), _v in final.items() if n == "eosflow_source_lag_records"}
    assert len(lag) == 8
    assert any(n == "eosflow_channel_queued_records" for n, _ls in final)
    assert any(value(s, "eosflow_source_lag_records") > 0 for s in scraper.metrics), (
        "the paced job never showed a backlog"
    )

    api = scraper.api[-1]
    assert api["job"] == result.job
    graph = api["graph"]
    assert [len(s["steps"]) > 0 for s in graph["stages"]] == [True] * 3
    assert len(graph["edges"]) == 2 and all(e["shuffle"] for e in graph["edges"])
    assert {"clicks", "work", "unique", "by-page", "per-window", "out"} <= set(api["steps"])
    assert any(
        h["status"] == "completed" and h["size_bytes"] > 0 for h in api["checkpoints"]["history"]
    )
    assert any(a["records"]["in_per_s"] > 0 for a in scraper.api)


def test_restarts_are_counted_by_cause_and_counters_survive_them(
    kafka_endpoint: tuple[str, str], redis_url: str, tmp_path: Path
) -> None:
    seed = chaos_seed()
    records = 12_000
    fault = Fault(0, 1, "after-snapshot-before-ack", 2)
    run, scraper = _run(tmp_path, kafka_endpoint[0], redis_url, records, seed=seed, faults=[fault])
    result = run.result
    assert result.restarts == 1, result.restart_causes
    assert scraper.runner is not None
    final = samples(generate_latest(scraper.runner.metrics.registry).decode())  # type: ignore[union-attr]
    assert_monotonic([*scraper.metrics, final])
    assert value(final, "eosflow_restarts_total", cause="killed") == 1
    assert value(final, "eosflow_generation") == result.generation
    # The killed generation's reads stay counted: the total is at least this generation's.
    assert value(final, "eosflow_records_in_total") >= result.records_in
    assert value(final, "eosflow_checkpoints_failed_total", reason="restart") >= 1
    assert scraper.api[-1]["checkpoints"]["failed"]["restart"] >= 1  # the job page's count
    restarts = scraper.api[-1]["restarts_list"]
    assert [r["kind"] for r in restarts] == ["killed"]
    assert "SIGKILL" in restarts[0]["cause"]


def test_transactional_sinks_show_their_transaction_timeout_headroom(
    kafka_endpoint: tuple[str, str], redis_url: str, tmp_path: Path
) -> None:
    """``pipelines/dedup_kafka_total.py`` writes through a transactional KafkaSink (default
    ``transaction.timeout.ms``: 15 min): while an epoch's transaction is open, the headroom is
    the timeout less the transaction's age, never more than the timeout."""
    scraper = Scraper()
    topic = f"metrics-out-{tmp_path.name[-20:]}"
    admin = TopicAdmin(KafkaSettings.from_env(brokers=kafka_endpoint[0]))
    admin.ensure_topic(topic, 2)
    run = run_paced(
        "dedup_kafka_total.py",
        brokers=kafka_endpoint[0],
        tmp=tmp_path,
        records=12_000,
        during=scraper,
        max_rate=3_000.0,
        env={"EOSFLOW_REDIS_URL": redis_url, "OUTPUT_TOPIC": topic, "TXN_PREFIX": topic},
        read_output=lambda _env: [],  # the output is checked by the sink's own tests
    )
    assert run.result.records_out > 0
    seen = [
        value(s, "eosflow_transaction_timeout_headroom_seconds", sink="out")
        for s in scraper.metrics
    ]
    seen = [h for h in seen if h]
    assert seen, "no scrape saw an open transaction"
    assert all(0 < h <= 900 for h in seen), seen
    assert min(seen) > 900 - 30, f"a transaction stayed open for minutes: {seen}"
    final = samples(generate_latest(scraper.runner.metrics.registry).decode())  # type: ignore[union-attr]
    assert value(final, "eosflow_sink_commit_seconds_count", sink="out") > 0
