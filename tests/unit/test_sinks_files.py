"""Unit tests for sinks.files: two-phase commit of part files on a local directory (tmp_path)."""

from __future__ import annotations

import logging
import os
import pickle
from pathlib import Path
from typing import Any

import pytest

from processor.contracts import Sink, SinkContext, SinkWriter
from processor.errors import ConfigError, DefinitionError, SerializationError, SnapshotError
from processor.snapshot import codec
from sinks import FileSink, read_committed_lines, read_jsonl
from sinks.files import FileSinkWriter


def context(subtask: int = 0, generation: int = 1) -> SinkContext:
    return SinkContext(
        job="clicks", step="out", subtask=subtask, parallelism=2, generation=generation
    )


def visible(directory: Path) -> list[str]:
    """What a reader globbing ``part-*`` sees."""
    return sorted(p.name for p in directory.glob("part-*"))


def in_progress(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob(".part-*.inprogress"))


def epoch(writer: FileSinkWriter, checkpoint_id: int, values: list[Any]) -> Any:
    """Writes one epoch in two batches and prepares it."""
    writer.write(values[: len(values) // 2])
    writer.write(values[len(values) // 2 :])
    return writer.prepare(checkpoint_id)


@pytest.fixture
def out(tmp_path: Path) -> Path:
    return tmp_path / "out"


def test_values_round_trip_when_epochs_are_committed(out: Path) -> None:
    writer = FileSink(out).open(context())
    first = [{"user": "a", "n": 1}, {"user": "b", "n": 2}, [1, 2.5, None], "text"]
    second = [{"user": "c", "n": 3}]
    c1 = epoch(writer, 1, first)
    writer.commit(1, c1)
    c2 = epoch(writer, 2, second)
    writer.commit(2, c2)
    writer.close()
    assert visible(out) == ["part-00000-0000000001.jsonl", "part-00000-0000000002.jsonl"]
    assert in_progress(out) == []
    assert read_jsonl(out) == first + second
    assert (out / "part-00000-0000000002.jsonl").read_bytes() == b'{"user":"c","n":3}\n'


def test_directory_is_created_when_writer_opens_not_when_sink_is_built(out: Path) -> None:
    sink = FileSink(out / "nested")
    assert not out.exists()
    assert pickle.loads(pickle.dumps(sink)).path == str(out / "nested")
    sink.open(context())
    assert (out / "nested").is_dir()


def test_sink_and_writer_satisfy_contracts_when_opened(out: Path) -> None:
    sink = FileSink(out)
    writer = sink.open(context())
    assert isinstance(sink, Sink)
    assert isinstance(writer, SinkWriter)


def test_nothing_is_visible_when_epoch_is_written_and_prepared_but_not_committed(
    out: Path,
) -> None:
    writer = FileSink(out).open(context(subtask=3, generation=7))
    writer.write([1, 2])
    assert visible(out) == []
    assert in_progress(out) == [".part-00003-g7-0.inprogress"]
    committable = writer.prepare(5)
    assert committable == {
        "temp": ".part-00003-g7-0.inprogress",
        "final": "part-00003-0000000005.jsonl",
    }
    assert visible(out) == []
    assert read_jsonl(out) == []
    writer.commit(5, committable)
    assert visible(out) == ["part-00003-0000000005.jsonl"]
    assert read_jsonl(out) == [1, 2]


def test_next_epoch_starts_new_in_progress_file_when_previous_was_prepared(out: Path) -> None:
    writer = FileSink(out).open(context())
    c1 = epoch(writer, 1, [1])
    writer.write([2])
    assert in_progress(out) == [".part-00000-g1-0.inprogress", ".part-00000-g1-1.inprogress"]
    c2 = writer.prepare(2)
    assert c2 is not None
    assert c1["temp"] != c2["temp"]
    writer.commit(1, c1)
    writer.commit(2, c2)
    assert read_jsonl(out) == [1, 2]


def test_commit_does_nothing_when_called_twice(out: Path) -> None:
    writer = FileSink(out).open(context())
    committable = epoch(writer, 1, ["a", "b"])
    writer.commit(1, committable)
    writer.commit(1, committable)
    assert visible(out) == ["part-00000-0000000001.jsonl"]
    assert read_jsonl(out) == ["a", "b"]


def test_commit_does_nothing_when_committable_is_none(out: Path) -> None:
    writer = FileSink(out).open(context())
    writer.commit(1, None)
    writer.recover([(1, None)])
    assert os.listdir(out) == []


def test_no_file_is_created_when_epoch_is_empty(out: Path) -> None:
    writer = FileSink(out).open(context())
    writer.write([])
    assert writer.prepare(1) is None
    assert writer.prepare(2) is None
    assert os.listdir(out) == []


def test_recover_commits_pending_and_deletes_own_orphans_when_restarted_after_crash(
    out: Path,
) -> None:
    sink = FileSink(out)
    before = sink.open(context(subtask=0, generation=1))
    other = sink.open(context(subtask=1, generation=1))
    c1 = epoch(before, 1, ["epoch-1"])  # checkpoint 1 completes, crash before commit
    epoch(before, 2, ["epoch-2"])  # checkpoint 2 never completes: prepared orphan
    before.write(["epoch-3"])  # unprepared orphan, left open by the "crash"
    other.write(["other-subtask"])  # another subtask's in-progress file
    assert len(in_progress(out)) == 4

    after = sink.open(context(subtask=0, generation=2))
    after.recover([(1, c1)])

    assert visible(out) == ["part-00000-0000000001.jsonl"]
    assert read_jsonl(out) == ["epoch-1"]
    assert in_progress(out) == [".part-00001-g1-0.inprogress"]
    after.write(["epoch-2-again"])
    assert ".part-00000-g2-0.inprogress" in in_progress(out)
    after.commit(2, after.prepare(2))
    assert read_jsonl(out) == ["epoch-1", "epoch-2-again"]


def test_recover_does_nothing_more_when_called_again_after_crash_during_recovery(
    out: Path,
) -> None:
    sink = FileSink(out)
    before = sink.open(context(generation=1))
    c1 = epoch(before, 1, ["x"])
    c2 = epoch(before, 2, ["y"])
    before.commit(1, c1)  # crash after committing 1 of 2 pending
    first = sink.open(context(generation=2))
    first.recover([(1, c1), (2, c2)])
    second = sink.open(context(generation=3))
    second.recover([(1, c1), (2, c2)])
    assert visible(out) == ["part-00000-0000000001.jsonl", "part-00000-0000000002.jsonl"]
    assert in_progress(out) == []
    assert read_jsonl(out) == ["x", "y"]


def test_commit_raises_clear_error_when_temp_and_final_are_missing(out: Path) -> None:
    writer = FileSink(out).open(context())
    committable = epoch(writer, 4, [1])
    (out / committable["temp"]).unlink()
    with pytest.raises(SnapshotError, match="output of checkpoint 4 is missing") as info:
        writer.commit(4, committable)
    assert info.value.reason == "missing"
    message = str(info.value)
    assert committable["temp"] in message
    assert committable["final"] in message
    assert "step='out'" in message


def test_commit_raises_when_committable_is_not_a_file_sink_committable(out: Path) -> None:
    writer = FileSink(out).open(context(subtask=0))
    other = FileSink(out).open(context(subtask=1))
    foreign = epoch(other, 1, [1])
    for committable in (
        ["line"],
        {"temp": "../escape", "final": "part-00000-0000000001.jsonl"},
        foreign,
    ):
        with pytest.raises(SnapshotError, match="not a file sink committable") as info:
            writer.commit(1, committable)
        assert info.value.reason == "corrupt"
    assert visible(out) == []


def test_in_progress_name_is_skipped_when_taken_in_same_generation(out: Path) -> None:
    """A writer reopened without a new generation must not truncate a prepared file."""
    sink = FileSink(out)
    first = sink.open(context())
    c1 = epoch(first, 1, ["kept"])
    second = sink.open(context())
    c2 = epoch(second, 2, ["new"])
    assert c2["temp"] == ".part-00000-g1-1.inprogress"
    second.commit(1, c1)
    second.commit(2, c2)
    assert read_jsonl(out) == ["kept", "new"]


def test_close_keeps_in_progress_file_when_epoch_was_not_prepared(out: Path) -> None:
    writer = FileSink(out).open(context())
    writer.write([1])
    writer.close()
    writer.close()
    assert in_progress(out) == [".part-00000-g1-0.inprogress"]
    assert visible(out) == []


def test_lines_are_written_as_given_when_format_is_raw(out: Path) -> None:
    writer = FileSink(out, format="raw").open(context())
    writer.write([b"bytes line", "text line \u00e9", ""])
    writer.commit(1, writer.prepare(1))
    assert visible(out) == ["part-00000-0000000001.txt"]
    assert read_committed_lines(out) == [b"bytes line", "text line \u00e9".encode(), b""]


def test_serialization_error_names_step_and_type_when_raw_value_is_not_text(out: Path) -> None:
    writer = FileSink(out, format="raw").open(context())
    with pytest.raises(SerializationError, match=r"step='out'.*type int"):
        writer.write([1])


def test_serialization_error_is_raised_when_raw_line_contains_newline(out: Path) -> None:
    writer = FileSink(out, format="raw").open(context())
    with pytest.raises(SerializationError, match="newline"):
        writer.write(["two\nlines"])


def test_nothing_of_the_batch_is_written_when_a_value_cannot_be_encoded(out: Path) -> None:
    writer = FileSink(out).open(context())
    writer.write([1])
    with pytest.raises(SerializationError, match=r"step='out'.*type object"):
        writer.write([2, object()])
    writer.write([3])
    writer.commit(1, writer.prepare(1))
    assert read_jsonl(out) == [1, 3]


def test_encoder_replaces_format_encoding_when_given(out: Path) -> None:
    writer = FileSink(out, encoder=lambda v: f"{v[0]},{v[1]}".encode()).open(context())
    writer.write([("a", 1), ("b", 2)])
    writer.commit(1, writer.prepare(1))
    assert visible(out) == ["part-00000-0000000001.jsonl"]
    assert read_committed_lines(out) == [b"a,1", b"b,2"]


def test_serialization_error_is_raised_when_encoder_returns_no_bytes(out: Path) -> None:
    writer = FileSink(out, encoder=lambda v: str(v)).open(context())  # type: ignore[arg-type,return-value]
    with pytest.raises(SerializationError, match="returned str, not bytes"):
        writer.write([1])


@pytest.mark.parametrize("format", ["csv", "JSONL", ""])
def test_config_error_is_raised_when_format_is_unknown(out: Path, format: str) -> None:
    with pytest.raises(ConfigError, match=r"format .* is not supported.*'jsonl', 'raw'"):
        FileSink(out, format=format)


def test_config_error_is_raised_when_encoder_is_not_callable(out: Path) -> None:
    with pytest.raises(ValueError, match="encoder must be a function"):
        FileSink(out, encoder=b"not callable")  # type: ignore[arg-type]


@pytest.mark.parametrize("checkpoint_id", [-1, 10**10, True, "3"])
def test_definition_error_is_raised_when_checkpoint_id_is_invalid(
    out: Path, checkpoint_id: Any
) -> None:
    writer = FileSink(out).open(context())
    writer.write([1])
    with pytest.raises(DefinitionError, match="checkpoint id"):
        writer.prepare(checkpoint_id)


def test_committable_round_trips_when_stored_in_a_snapshot(out: Path) -> None:
    writer = FileSink(out).open(context())
    committable = epoch(writer, 1, [1])
    restored = codec.loads(codec.dumps(committable))
    assert restored == committable
    writer.commit(1, restored)
    assert read_jsonl(out) == [1]


def test_read_committed_lines_ignores_other_files_when_directory_is_shared(out: Path) -> None:
    writer = FileSink(out).open(context())
    writer.commit(1, epoch(writer, 1, [1]))
    writer.write([2])  # in progress
    (out / "README").write_text("not a part file\n")
    (out / "part-00000-0000000009.jsonl.bak").write_text("9\n")
    assert read_jsonl(out) == [1]


def test_log_lines_carry_key_value_context_when_epoch_is_committed(
    out: Path, caplog: pytest.LogCaptureFixture
) -> None:
    writer = FileSink(out).open(context(subtask=2))
    with caplog.at_level(logging.INFO, logger="sinks.files"):
        writer.commit(7, epoch(writer, 7, [1]))
    text = caplog.text
    assert "prepared checkpoint_id=7 step='out' subtask=2" in text
    assert (
        "committed checkpoint_id=7 step='out' subtask=2 final=part-00002-0000000007.jsonl" in text
    )
