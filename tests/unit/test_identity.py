"""The job's identity commits in the background and wakes the runner when a completion notice
is due (issue 51: the runner's 50 ms poll was 25 ms of every commit's latency on average)."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import pytest

from processor.errors import JobFencedError
from processor.runtime.supervision.identity import JobIdentity

TP = tuple[str, int]


class _Claim:
    """A claim that records its commits; ``fence`` makes the next one fail as fenced."""

    group = "eosflow-job"
    transactional_id = "eosflow.job.runner"

    def __init__(self) -> None:
        self.commits: list[tuple[dict[TP, int], dict[str, Any]]] = []
        self.fence = False

    def committed(self) -> dict[TP, int]:
        return {}

    def open(self) -> None:
        pass

    def commit(self, offsets: Mapping[TP, int], claim: Mapping[str, Any]) -> None:
        if self.fence:
            raise JobFencedError("initialized by a newer runner")
        self.commits.append((dict(offsets), dict(claim)))

    def last(self) -> dict[str, Any] | None:
        return None

    def forget(self) -> None:
        pass

    def close(self) -> None:
        pass


def _identity(claim: _Claim) -> tuple[JobIdentity, threading.Event]:
    identity = JobIdentity("job", claim)  # type: ignore[arg-type]
    woken = threading.Event()
    identity.wake = woken.set
    return identity, woken


def test_a_committed_checkpoint_wakes_the_runner_with_its_notice_due() -> None:
    claim = _Claim()
    identity, woken = _identity(claim)
    assert identity.ready() == []
    identity.completed(4, [["clicks", 0, 812], ["clicks", 1, 790]])
    assert woken.wait(10), "the runner was not woken"
    assert identity.ready() == [4]
    offsets, record = claim.commits[-1]
    assert offsets == {("clicks", 0): 812, ("clicks", 1): 790}  # the group, before the notice
    assert record["checkpoint"] == 4
    identity.close()


def test_a_fenced_commit_wakes_the_runner_and_ready_raises() -> None:
    claim = _Claim()
    claim.fence = True
    identity, woken = _identity(claim)
    identity.completed(5, [["clicks", 0, 1]])
    assert woken.wait(10), "the runner was not woken"
    with pytest.raises(JobFencedError, match="another runner took job 'job'"):
        identity.ready()
    identity.close()
