"""The worker's acks: no checkpoint is acknowledged over a hole in a channel (issue 17)."""

from __future__ import annotations

from typing import Any

import pytest

from processor.errors import KafkaClientError
from processor.runtime.worker import send_acks
from processor.snapshot.store import SnapshotHandle


class _Client:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send(self, msg: dict[str, Any]) -> bool:
        self.sent.append(msg)
        return True


class _Writer:
    """Delivery failed for a record written before the barrier; reported on flush."""

    def __init__(self, failed: bool) -> None:
        self.failed, self.flushes = failed, 0

    def flush(self, timeout: float = 30.0) -> None:
        self.flushes += 1
        if self.failed:
            raise KafkaClientError("delivering to ch[3]: Message timed out", retriable=True)


class _Task:
    name = "count.0"

    def __init__(self, ready: list[int], declined: list[tuple[int, str]] | None = None) -> None:
        self.ready, self.declined, self.loop_log = ready, declined or [], {}

    def ready_acks(self) -> list[tuple[int, SnapshotHandle]]:
        return [(chk, SnapshotHandle(f"/chk-{chk}/count.0.snap", 10, "ab")) for chk in self.ready]


def test_no_ack_is_sent_when_a_record_before_the_barrier_was_not_delivered() -> None:
    """Regression (issue 17): a delivery error surfaced only at the next write, so a checkpoint
    could complete while a record before its barrier was missing from the channel."""
    client, writer = _Client(), _Writer(failed=True)
    with pytest.raises(KafkaClientError, match="Message timed out"):
        send_acks(client, writer, [_Task([4])], lambda _point: None)  # type: ignore[arg-type]
    assert [m for m in client.sent if m["t"] == "ack"] == []


def test_acks_follow_a_flush_that_delivered_everything() -> None:
    client, writer = _Client(), _Writer(failed=False)
    tasks = [_Task([4, 5], declined=[(3, "upload failed")])]
    send_acks(client, writer, tasks, lambda _point: None)  # type: ignore[arg-type]
    assert writer.flushes == 1
    assert [(m["t"], m["chk"]) for m in client.sent] == [("decline", 3), ("ack", 4), ("ack", 5)]


def test_nothing_is_flushed_when_no_checkpoint_is_ready() -> None:
    client, writer = _Client(), _Writer(failed=True)
    send_acks(client, writer, [_Task([])], lambda _point: None)  # type: ignore[arg-type]
    assert writer.flushes == 0 and client.sent == []
