"""A job's first start creates its channel topics and measures them at once (issue 41).

On Apache Kafka 4.3.1 (KRaft) the new topics' leaders answered ListOffsets with
NOT_LEADER_OR_FOLLOWER for a moment after creation, and the start exited 2 ("offsets of
eosflow.<job>...: Not leader for partition", class=error) in 3 of 5 rescale starts. Here the
broker behind the fault proxy answers every channel topic's first ListOffsets requests so; the
job must wait for the leaders and finish exactly once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from processor.testing import BrokerBehindProxy
from tests.e2e.harness import (
    assert_exactly_once,
    chaos_seed,
    expected,
    expected_running_totals,
    run_chaos,
)

pytestmark = [pytest.mark.integration, pytest.mark.chaos]


def test_a_start_waits_for_new_channel_leaders_when_they_answer_not_leader(
    broker: BrokerBehindProxy, tmp_path: Path
) -> None:
    seed = chaos_seed()
    records = 5_000
    rule = broker.proxy.fail_list_offsets("eosflow.", times=6)
    run = run_chaos(
        "running_total_work.py",
        brokers=broker.brokers,
        tmp=tmp_path,
        records=records,
        seed=seed,
        mode="aligned",
        env={"WORK_US": "0"},
    )
    assert rule.applied == 6, f"only {rule.applied} answers rewritten: the test proved nothing"
    assert run.result.restarts == 0, run.result.restart_causes
    assert_exactly_once(expected(expected_running_totals, records, seed), run.output, seed=seed)
