"""The runner's restart rules (processor.runtime.lifecycle)."""

from __future__ import annotations

from processor.runtime.lifecycle import same_cause, same_kind

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
