"""A reader whose position the broker no longer holds fails loudly, or skips by policy
(issue 17: offsets below a partition's log start were skipped silently with
``auto.offset.reset=earliest``; issue 18: a position beyond the end after the topic was
recreated hung the job). The partition's watermarks are faked; no broker is contacted."""

from __future__ import annotations

from typing import Any

import pytest

import connectors.reader as reader_module
from connectors import KafkaSettings, PartitionReader
from processor.errors import ConfigError, DataLossError

TP = ("eosflow.job.k.count", 3)


@pytest.fixture
def marks(monkeypatch: pytest.MonkeyPatch) -> dict[Any, tuple[int, int]]:
    found = {TP: (100, 200)}  # the partition holds offsets 100..199
    monkeypatch.setattr(reader_module, "watermarks", lambda _conf, tps, **_kw: found)
    return found


def _open(position: int | None, deleted: str = "fail") -> PartitionReader:
    reader = PartitionReader(KafkaSettings("127.0.0.1:9"), deleted=deleted)
    reader.open({TP: position})
    return reader


def test_a_position_below_the_first_offset_fails_with_the_fix_when_retention_deleted_records(
    marks: Any,
) -> None:
    with pytest.raises(DataLossError, match=r"records 50\.\.99 \(50\) were deleted") as err:
        _open(50)
    assert "retention.ms" in str(err.value) and "--on-deleted-records skip" in str(err.value)
    assert (err.value.wanted, err.value.first) == (50, 100)


def test_deleted_records_are_skipped_counted_and_logged_when_the_policy_says_skip(
    marks: Any, caplog: pytest.LogCaptureFixture
) -> None:
    reader = _open(50, deleted="skip")
    try:
        assert reader.position(TP) == 100
        assert reader.skipped == {TP: 50}
        assert "records deleted by retention skipped" in caplog.text
    finally:
        reader.close()


def test_a_position_beyond_the_end_fails_when_the_topic_was_recreated(marks: Any) -> None:
    with pytest.raises(DataLossError, match="beyond the partition's end 200"):
        _open(250)


def test_positions_inside_the_partition_open_as_they_are(marks: Any) -> None:
    for position, expected in ((150, 150), (None, 100), (200, 200)):
        reader = _open(position)
        try:
            assert reader.position(TP) == expected
        finally:
            reader.close()


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ConfigError, match="choose one of"):
        PartitionReader(KafkaSettings("127.0.0.1:9"), deleted="ignore")
