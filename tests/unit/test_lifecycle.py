"""The runner's restart rules (processor.runtime.supervision.lifecycle)."""

from __future__ import annotations

from processor.runtime.supervision.lifecycle import same_cause, same_kind

LOST = (
    "worker {w} exit code 1 (worker={w} failed: DataLossError: clicks[{p}]: the checkpoint's "
    "position {o} is beyond the partition's end 50: the topic or the broker was recreated)"
)


def test_a_deterministic_failure_is_the_same_whichever_worker_or_partition_shows_it_first() -> None:
    """Seen in CI: the workers race, so one generation fails on clicks[3] in worker 1 and the
    next on clicks[6] in worker 0; a comparison by worker number only kept restarting (49 s)."""
    first, second = LOST.format(w=1, p=3, o=512), LOST.format(w=0, p=6, o=498)
    assert not same_cause(first, second)
    assert same_kind(first, second)
    other = first.replace("DataLossError", "KafkaClientError")
    assert not same_kind(first, other)


def test_a_final_commit_that_never_comes_fails_the_run_after_the_stop_timeout() -> None:
    """Broke (issue 35, item 5): a run waited for every task's ``committed`` with no deadline
    once its final checkpoint completed (a PostgreSQL ``COMMIT PREPARED`` stuck for ever held
    ``--until-idle`` while heartbeats kept flowing)."""
    from types import SimpleNamespace

    import pytest

    from processor.runtime.job import JobFailed
    from processor.runtime.supervision.runner import Runner

    run = SimpleNamespace(
        job="j",
        final_chk=7,
        coordinator=SimpleNamespace(stats=SimpleNamespace(last_completed=7), tasks={"a", "b"}),
        options=SimpleNamespace(stop_timeout=0.0),
        _final_completed_at=None,
    )
    Runner._check_final_commit(run, {"a"})  # type: ignore[arg-type]  # the deadline starts
    with pytest.raises(JobFailed, match=r"final checkpoint 7 completed, but tasks \['b'\]"):
        Runner._check_final_commit(run, {"a"})  # type: ignore[arg-type]
    run.coordinator.stats.last_completed = 6  # not completed yet: no deadline runs
    run._final_completed_at = None
    Runner._check_final_commit(run, set())  # type: ignore[arg-type]
    Runner._check_final_commit(run, set())  # type: ignore[arg-type]
