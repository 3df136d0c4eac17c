"""The parts of ``eosflow certify`` and of the test kit's comparison that need no server: the
diff, the per-key order check, the fault plan, the redirection of sinks, the report, the pace."""

from __future__ import annotations

import random
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from processor.certify.plan import POINT_CHAIN, plan_runs
from processor.certify.report import Report, RunOutcome, SinkCheck
from processor.dataflow import Dataflow
from processor.errors import ConfigError
from processor.runtime.job import FAULT_POINTS
from processor.runtime.redirect import Rewrite, apply, redirected
from processor.runtime.supervision.worker import _Pace
from processor.testing import Output, assert_exactly_once, canonical, diff, order_diff
from sinks import FileSink, KafkaSink, PostgresSink, RedisSink


def test_diff_counts_missing_duplicated_and_unexpected_records_apart() -> None:
    found = diff(
        [Output(["a", 1], "a", "t[0]@0"), Output(["a", 1], "a", "t[0]@5"), ["c", 3]],
        [["a", 1], ["b", 2]],
    )
    assert found.counts() == {
        "expected": 2, "actual": 3, "missing": 1, "duplicated": 1, "unexpected": 1,
    }  # fmt: skip
    text = str(found)
    assert "expected 2 records, committed 3: 1 missing, 1 duplicated, 1 unexpected" in text
    assert '["a",1] at t[0]@0, t[0]@5' in text  # where the copies were read
    assert '["b",2]' in text and '["c",3]' in text


def test_assert_exactly_once_passes_on_equal_multisets_in_any_order() -> None:
    assert_exactly_once([{"b": 2, "a": 1}, (1, 2), b"raw"], [b"raw", [1, 2], {"a": 1, "b": 2}])
    assert_exactly_once(["x", "x"], Counter({"x": 2}))
    with pytest.raises(AssertionError, match="out: expected 2 records, committed 1: 1 missing"):
        assert_exactly_once(["x"], ["x", "x"], label="out")


@given(st.lists(st.integers(0, 5), max_size=30), st.lists(st.integers(0, 5), max_size=30))
def test_diff_accounts_for_every_record_of_both_sides(got: list[int], want: list[int]) -> None:
    c = diff(got, want).counts()
    assert c["actual"] - c["duplicated"] - c["unexpected"] == c["expected"] - c["missing"]
    assert diff(got, want).ok == (Counter(got) == Counter(want))


def test_order_diff_finds_a_key_whose_records_came_in_another_order() -> None:
    want = [Output(["u", n], "u") for n in (1, 2, 3)] + [Output(["v", 1], "v")]
    got = [Output(["u", n], "u") for n in (1, 3, 2)] + [Output(["v", 1], "v")]
    found = order_diff(got, want)
    assert found["keys"] == 2 and found["out_of_order"] == 1
    key, expected, committed = found["example"]
    assert key == '"u"' and expected[0] == '["u",2]' and committed[0] == '["u",3]'
    assert order_diff(want, want)["out_of_order"] == 0


def test_the_plan_has_two_fault_free_runs_then_takes_the_kinds_in_turn() -> None:
    kinds = ["kill", "protocol-points", "broker-partition"]
    plans = plan_runs(kinds, 5, workers=3, kills=2, outage_s=4.0, rng=random.Random(1))
    assert [(p.name, p.kind) for p in plans] == [
        ("ref", None), ("det", None), ("1", "kill"), ("2", "protocol-points"),
        ("3", "broker-partition"), ("4", "kill"), ("5", "protocol-points"),
    ]  # fmt: skip
    chain = plans[3].faults
    assert [(f.attempt, f.point) for f in chain] == list(enumerate(p for p, _n in POINT_CHAIN))
    assert {f.worker for f in chain} == {0, 1, 2}  # the workers take turns
    assert len(plans[2].kill_plan) == 2 and plans[4].outage_s == 4.0
    assert 0.1 <= plans[4].outage_at <= 0.7


def test_the_chain_visits_every_protocol_point_of_the_engine() -> None:
    assert sorted(p for p, _n in POINT_CHAIN) == sorted(FAULT_POINTS)


def test_every_sink_kind_is_redirected_to_a_destination_of_the_runs_own(tmp_path: Path) -> None:
    rewrite = Rewrite(
        job="j-c1-2", prefix="eosflow-certify-ab-2", outputs=str(tmp_path), redis_db=5
    )
    file = redirected(FileSink("out/x"), "out", rewrite)
    assert file.path == str(tmp_path / "out")
    kafka = redirected(KafkaSink("totals", transactional_id_prefix="p"), "out", rewrite)
    assert (kafka.topic, kafka.prefix) == ("eosflow-certify-ab-2-out", "eosflow-certify-ab-2-out")
    pg = redirected(PostgresSink("public.totals", ["a"]), "out", rewrite)
    assert pg.table == ("public", "totals_eosflow_certify_ab_2")
    redis = redirected(RedisSink("set", key="k", url="redis://h:1/0?x=1"), "out", rewrite)
    assert redis.url == "redis://h:1/5?x=1"

    class Odd:
        def open(self, ctx: object) -> None: ...

    with pytest.raises(ConfigError, match="certify_redirect"):
        redirected(Odd(), "odd", rewrite)


def test_a_rewrite_renames_the_job_and_points_sources_and_dead_letters_elsewhere(
    tmp_path: Path,
) -> None:
    flow = Dataflow("shop", dead_letters=FileSink("dead"))
    flow.source("orders", "orders", start="latest").sink("out", FileSink("out"))
    rewrite = Rewrite("shop-c1-ref", "eosflow-certify-1-ref", {"orders": "snap"}, str(tmp_path))
    apply(flow, rewrite)
    assert flow.name == "shop-c1-ref"
    assert flow.steps["orders"].params["topic"] == "snap"
    assert flow.steps["orders"].params["start"] == "earliest"  # a snapshot is read whole
    assert flow.steps["out"].params["sink"].path == str(tmp_path / "out")
    assert flow.dead_letter_sink.path == str(tmp_path / "dead-letters")  # type: ignore[union-attr]
    assert Rewrite.from_env(rewrite.to_env()) == rewrite


def _report(*runs: RunOutcome, verdict: str) -> Report:
    report = Report("p.py", "job", 1, "local", 2, runs=list(runs), verdict=verdict)
    return report


def test_the_report_gives_one_junit_case_per_run_with_the_failures(tmp_path: Path) -> None:
    ok = SinkCheck(
        "out", {"expected": 3, "actual": 3, "missing": 0, "duplicated": 0, "unexpected": 0}
    )
    bad = SinkCheck(
        "out",
        {"expected": 3, "actual": 4, "missing": 0, "duplicated": 1, "unexpected": 0},
        diff="expected 3 records, committed 4: 0 missing, 1 duplicated, 0 unexpected",
    )
    report = _report(
        RunOutcome("ref", "none", outputs={"out": [Output(1)] * 3}),
        RunOutcome("det", "none", checks=[ok]),
        RunOutcome("1", "3 random SIGKILLs", injected=3, restarts=3, checks=[bad]),
        verdict="FAIL",
    )
    assert report.exit_code == 1
    assert "out: 1 duplicated (of 3)" in report.text()
    assert report.conclusion().startswith("FAIL: 1 of 1 fault runs")
    path = tmp_path / "r.xml"
    report.write_junit(path)
    suite = ET.parse(path).getroot()
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("3", "1", "0")
    failure = suite.findall("testcase")[2].find("failure")
    assert failure is not None and "1 duplicated" in (failure.text or "")
    assert "outputs" not in report.to_dict()["runs"][0]


def test_a_nondeterministic_report_exits_3_and_says_why() -> None:
    det = SinkCheck(
        "out",
        {"expected": 9, "actual": 9, "missing": 4, "duplicated": 0, "unexpected": 4},
        diff="...",
    )
    report = _report(RunOutcome("ref", "none"), RunOutcome("det", "none", checks=[det]),
                     verdict="NONDETERMINISTIC")  # fmt: skip
    assert report.exit_code == 3
    assert "out: 4 missing, 4 unexpected (of 9)" in report.conclusion()
    assert canonical((1, "a")) == canonical([1, "a"])


def test_a_paced_worker_reads_at_most_its_rate() -> None:
    now = [0.0]
    pace = _Pace(1000.0, clock=lambda: now[0])
    assert pace.allowed(5000) == 0  # nothing is owed at the start
    now[0] += 0.05
    assert pace.allowed(5000) == 50
    pace.took(40)
    assert pace.allowed(5000) == 10  # what it did not take stays owed
    now[0] += 10
    assert pace.allowed(5000) == 100  # a stall builds at most 0.1 s of credit
    pace.took(100)
    assert pace.allowed(5000) == 0
    now[0] += 0.05
    assert pace.allowed(5000) == 50
    assert _Pace(0.0).rate == 0.0  # no limit: the worker does not consult it


def test_a_paced_worker_reads_no_second_above_1_1_times_its_rate_after_a_stall() -> None:
    """Issue 50: after a 25 s stall, no second of reading above 2,200 records at a cap of
    2,000/s (the average since the start allowed 13x the cap)."""
    now = [0.0]
    pace = _Pace(2000.0, clock=lambda: now[0])
    read_at: list[tuple[float, int]] = []
    while now[0] < 60:
        if 10 <= now[0] < 35:  # a stall: the worker reads nothing
            now[0] += 0.01
            continue
        n = pace.allowed(500)
        pace.took(n)
        read_at.append((now[0], n))
        now[0] += 0.01
    # every 1-second window, aligned or not
    windows = [sum(n for t, n in read_at if s / 10 <= t < s / 10 + 1) for s in range(590)]
    assert max(windows) <= 2200, max(windows)
    assert sum(n for _t, n in read_at) >= 2000 * 34  # and it reads at the rate when it can
