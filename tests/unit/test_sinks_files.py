"""Unit tests for sinks.files: two-phase commit of part files on a local directory (tmp_path).

No server is involved: the file system under ``tmp_path`` is the real one. A "crash" is a writer
abandoned where it stands (its prepared files are already fsynced and closed, as after SIGKILL);
the next writer gets a new generation and ``recover`` with the restored snapshot's committables.
"""

from __future__ import annotations

import logging
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from processor.contracts import Sink, SinkContext, SinkWriter
from processor.errors import ConfigError, DefinitionError, SerializationError, SnapshotError
from processor.snapshot import codec
from sinks.files import (
    FileSink,
    FileSinkWriter,
    read_avro,
    read_committed,
    read_committed_lines,
    read_jsonl,
)
from sinks.files.directory import _mount_fstype

CLAIM = ".eosflow-sink.json"


def context(
    subtask: int = 0,
    generation: int = 1,
    *,
    step: str = "out",
    job: str = "clicks",
    snapshot_url: str | None = None,
    fault: Any = None,
) -> SinkContext:
    extra = {"fault": fault} if fault is not None else {}
    return SinkContext(
        job=job,
        step=step,
        subtask=subtask,
        parallelism=2,
        generation=generation,
        snapshot_url=snapshot_url,
        **extra,
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
    assert os.listdir(out) == [CLAIM]


def test_no_file_is_created_when_epoch_is_empty(out: Path) -> None:
    writer = FileSink(out).open(context())
    writer.write([])
    assert writer.prepare(1) is None
    assert writer.prepare(2) is None
    assert os.listdir(out) == [CLAIM]


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


@pytest.mark.parametrize("checkpoint_id", [-1, True, "3"])
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


def test_part_names_sort_by_number_when_checkpoint_ids_pass_ten_digits(out: Path) -> None:
    """Regression: ids were capped at 10**10 (DefinitionError in prepare, a restart loop)."""
    writer = FileSink(out).open(context())
    for checkpoint_id, value in [(9_999_999_999, "first"), (10**10, "second"), (10**10 + 1, "x")]:
        writer.commit(checkpoint_id, epoch(writer, checkpoint_id, [value]))
    assert "part-00000-10000000000.jsonl" in visible(out)
    assert read_jsonl(out) == ["first", "second", "x"]


# -- commit when both the temp and the final exist -------------------------------------------------


def test_commit_drops_temp_when_final_is_an_identical_copy(out: Path) -> None:
    """A rename that copies then deletes (no atomic rename) was interrupted after the copy."""
    writer = FileSink(out).open(context())
    committable = epoch(writer, 1, ["a", "b"])
    (out / committable["final"]).write_bytes((out / committable["temp"]).read_bytes())
    writer.commit(1, committable)
    assert in_progress(out) == []
    assert read_jsonl(out) == ["a", "b"]


def test_commit_completes_rename_when_final_is_a_partial_copy(out: Path) -> None:
    writer = FileSink(out).open(context())
    committable = epoch(writer, 1, ["a", "b", "c"])
    (out / committable["final"]).write_bytes((out / committable["temp"]).read_bytes()[:5])
    writer.commit(1, committable)
    assert in_progress(out) == []
    assert read_jsonl(out) == ["a", "b", "c"]


def test_commit_refuses_to_overwrite_when_final_holds_other_data(out: Path) -> None:
    writer = FileSink(out).open(context())
    committable = epoch(writer, 1, ["mine"])
    (out / committable["final"]).write_bytes(b'"someone else"\n')
    with pytest.raises(ConfigError, match="another run or sink step wrote into"):
        writer.commit(1, committable)
    assert read_jsonl(out) == ["someone else"]
    assert in_progress(out) == [committable["temp"]]


# -- one directory, one step -----------------------------------------------------------------------


def test_writer_is_refused_when_directory_belongs_to_another_step(out: Path) -> None:
    FileSink(out).open(context(step="out"))
    with pytest.raises(ConfigError, match=r"belongs to job 'clicks' step 'out'.*not to job"):
        FileSink(out).open(context(step="audit"))
    with pytest.raises(ConfigError, match="Give every sink step its own directory"):
        FileSink(out).open(context(job="other-job"))
    FileSink(out).open(context(subtask=1, step="out"))  # the same step's other subtask


def test_preflight_refuses_directory_when_another_job_owns_it(out: Path) -> None:
    sink = FileSink(out)
    sink.preflight(job="clicks", checkpoint_interval=1.0)  # nothing there yet
    sink.open(context(job="clicks"))
    sink.preflight(job="clicks", checkpoint_interval=1.0)
    with pytest.raises(ConfigError, match="belongs to job 'clicks'"):
        sink.preflight(job="payments", checkpoint_interval=1.0)


def test_config_error_is_raised_when_claim_file_is_unreadable(out: Path) -> None:
    out.mkdir()
    (out / CLAIM).write_bytes(b"{not json")
    with pytest.raises(ConfigError, match=r"claim .* is unreadable"):
        FileSink(out).open(context())


def test_mount_type_is_the_deepest_mount_when_directories_are_nested() -> None:
    mountinfo = (
        "22 1 0:21 / / rw - ext4 /dev/vda rw\n"
        "30 22 0:40 / /mnt/bucket rw - fuse.s3fs s3fs rw\n"
        "31 22 0:41 / /mnt/bucket\\040two rw - nfs4 server:/x rw\n"
    )
    assert _mount_fstype("/mnt/bucket/out/part", mountinfo) == "fuse.s3fs"
    assert _mount_fstype("/mnt/bucketx", mountinfo) == "ext4"
    assert _mount_fstype("/mnt/bucket two/out", mountinfo) == "nfs4"
    assert _mount_fstype("/", "garbage\n") is None


# -- recover ---------------------------------------------------------------------------------------


def test_recover_calls_fault_hook_when_first_pending_is_committed_and_rest_is_not(
    out: Path,
) -> None:
    sink = FileSink(out)
    before = sink.open(context(generation=1))
    pending = [(1, epoch(before, 1, ["one"])), (2, epoch(before, 2, ["two"]))]
    before.write(["orphan"])
    seen: list[tuple[str, list[str], int]] = []

    def fault(point: str) -> None:
        if point == "mid-sink-recover":
            seen.append((point, visible(out), len(in_progress(out))))

    sink.open(context(generation=2, fault=fault)).recover(pending)
    assert seen == [("mid-sink-recover", ["part-00000-0000000001.jsonl"], 2)]
    assert read_jsonl(out) == ["one", "two"]
    assert in_progress(out) == []


def test_commit_calls_fault_hook_when_first_part_is_visible_and_rest_is_not(out: Path) -> None:
    seen: list[tuple[str, list[str]]] = []
    writer = FileSink(out, max_part_bytes=1).open(
        context(fault=lambda point: seen.append((point, visible(out))))
    )
    committable = epoch(writer, 1, ["a", "b"])
    writer.commit(1, committable)
    writer.commit(1, committable)
    first, second = "part-00000-0000000001-0000.jsonl", "part-00000-0000000001-0001.jsonl"
    assert seen == [("mid-sink-commit", [first]), ("mid-sink-commit", [first, second])]


def test_recover_skips_fault_hook_when_nothing_is_pending(out: Path) -> None:
    seen: list[str] = []
    FileSink(out).open(context(fault=seen.append)).recover([])
    assert seen == []


def _store_with_completed(tmp_path: Path, job: str, *checkpoint_ids: int) -> str:
    from processor.snapshot.store import SnapshotStore

    url = (tmp_path / "snapshots").as_uri()
    store = SnapshotStore(url)
    for checkpoint_id in checkpoint_ids:
        handle = store.write_task_snapshot(job, checkpoint_id, "t0", {"x": 1})
        store.complete(job, checkpoint_id, {"t0": handle}, {})
    return url


def test_recover_refuses_part_files_when_newer_than_newest_completed_checkpoint(
    out: Path, tmp_path: Path
) -> None:
    """A job restarted without its snapshots (ids from 1 again) would overwrite old parts."""
    old = FileSink(out).open(context())
    old.commit(7, epoch(old, 7, ["old run"]))
    url = _store_with_completed(tmp_path, "clicks", 3)
    with pytest.raises(ConfigError, match=r"up to checkpoint 7.*newest completed checkpoint .* 3"):
        FileSink(out).open(context(generation=2, snapshot_url=url)).recover([])
    fresh = (tmp_path / "fresh").as_uri()
    with pytest.raises(ConfigError, match="is none: they were written by another run"):
        FileSink(out).open(context(generation=2, snapshot_url=fresh)).recover([])
    # Another subtask has no parts here; this one does once its store knows checkpoint 7.
    FileSink(out).open(context(subtask=1, generation=2, snapshot_url=url)).recover([])
    url = _store_with_completed(tmp_path, "clicks", 7)
    FileSink(out).open(context(generation=2, snapshot_url=url)).recover([])
    assert read_jsonl(out) == ["old run"]


# -- part files rotated by size --------------------------------------------------------------------


def test_epoch_is_split_into_parts_when_files_reach_max_part_bytes(out: Path) -> None:
    writer = FileSink(out, max_part_bytes=10).open(context())
    for value in ["aaaa", "bbbb", "cccc", "dddd", "e"]:
        writer.write([value])  # 7 bytes a line: every second write fills a part
    assert visible(out) == []
    committable = writer.prepare(3)
    assert committable == {
        "parts": [
            [".part-00000-g1-0.inprogress", "part-00000-0000000003-0000.jsonl"],
            [".part-00000-g1-1.inprogress", "part-00000-0000000003-0001.jsonl"],
            [".part-00000-g1-2.inprogress", "part-00000-0000000003-0002.jsonl"],
        ]
    }
    assert visible(out) == []
    assert codec.loads(codec.dumps(committable)) == committable
    writer.commit(3, committable)
    writer.commit(3, committable)
    assert read_jsonl(out) == ["aaaa", "bbbb", "cccc", "dddd", "e"]
    single = epoch(writer, 4, ["f"])
    assert single == {
        "temp": ".part-00000-g1-3.inprogress",
        "final": "part-00000-0000000004-0000.jsonl",
    }


def test_recover_commits_every_part_when_crash_came_between_renames(out: Path) -> None:
    sink = FileSink(out, max_part_bytes=1)
    before = sink.open(context(generation=1))
    committable = epoch(before, 1, ["a", "b", "c", "d"])  # one part per write call: 2 parts
    temp, final = committable["parts"][0]
    os.replace(out / temp, out / final)  # the crash came after the first rename
    before.write(["orphan"])
    sink.open(context(generation=2)).recover([(1, committable)])
    assert visible(out) == ["part-00000-0000000001-0000.jsonl", "part-00000-0000000001-0001.jsonl"]
    assert in_progress(out) == []
    assert read_jsonl(out) == ["a", "b", "c", "d"]


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "1MB"])
def test_config_error_is_raised_when_max_part_bytes_is_invalid(out: Path, value: Any) -> None:
    with pytest.raises(ConfigError, match="max_part_bytes"):
        FileSink(out, max_part_bytes=value)


# -- Avro container files --------------------------------------------------------------------------

TOTAL = {
    "type": "record",
    "name": "Total",
    "namespace": "eosflow.test",
    "fields": [
        {"name": "user", "type": "string"},
        {"name": "count", "type": "long"},
        {"name": "amount", "type": "long"},
        {"name": "tag", "type": ["null", "string"], "default": None},
    ],
}


def total(user: str, count: int, amount: int) -> dict[str, Any]:
    return {"user": user, "count": count, "amount": amount, "tag": None}


@pytest.mark.parametrize("avro_codec", ["deflate", "null", "bzip2", "xz"])
def test_records_round_trip_when_format_is_avro(out: Path, avro_codec: str) -> None:
    import fastavro

    writer = FileSink(out, format="avro", schema=TOTAL, codec=avro_codec).open(context())
    first = [total(f"u{i}", i, i * 10) for i in range(5)]
    writer.commit(1, epoch(writer, 1, first))
    writer.commit(2, epoch(writer, 2, [total("z", 1, 2)]))
    assert visible(out) == ["part-00000-0000000001.avro", "part-00000-0000000002.avro"]
    assert read_avro(out) == [*first, total("z", 1, 2)]
    with open(out / "part-00000-0000000001.avro", "rb") as f:
        reader = fastavro.reader(f)
        assert reader.metadata["avro.codec"] == avro_codec
        assert reader.metadata["eosflow.job"] == "clicks"
        assert reader.writer_schema["name"] == "eosflow.test.Total"


def test_records_are_built_by_to_record_when_stream_is_keyed(out: Path) -> None:
    sink = FileSink(
        out,
        format="avro",
        schema=TOTAL,
        to_record=lambda kv: {"user": kv[0], "count": kv[1][0], "amount": kv[1][1]},
    )
    writer = sink.open(context())
    writer.write([("user-1", (1, 20)), ("user-2", (1, 5))])
    writer.commit(1, writer.prepare(1))
    assert read_avro(out) == [total("user-1", 1, 20), total("user-2", 1, 5)]


def test_serialization_error_names_the_field_when_value_does_not_match_schema(
    out: Path,
) -> None:
    writer = FileSink(out, format="avro", schema=TOTAL).open(context())
    writer.write([total("a", 1, 1)])
    bad = {"user": "b", "count": "two", "amount": 2}
    with pytest.raises(
        SerializationError,
        match=r"value #1 of the batch: field .*Total.count is 'two' \(str\), expected long",
    ) as info:
        writer.write([total("b", 2, 2), bad, total("c", 3, 3)])
    assert "step='out' subtask=0" in str(info.value)
    with pytest.raises(SerializationError, match=r"field .*Total.amount is None"):
        writer.write([{"user": "d", "count": 1}])
    writer.write([total("e", 5, 5)])
    writer.commit(1, writer.prepare(1))
    assert read_avro(out) == [total("a", 1, 1), total("e", 5, 5)]


def test_serialization_error_says_to_record_raised_when_it_does(out: Path) -> None:
    writer = FileSink(out, format="avro", schema=TOTAL, to_record=lambda v: v["missing"]).open(
        context()
    )
    with pytest.raises(
        SerializationError, match="value #0 of the batch: to_record raised KeyError"
    ):
        writer.write([{}])
    assert in_progress(out) == []


def test_avro_file_holds_few_blocks_when_many_small_batches_are_written(out: Path) -> None:
    import fastavro

    writer = FileSink(out, format="avro", schema=TOTAL).open(context())
    records = [total(f"user-{i:05d}", i, i) for i in range(20_000)]
    for i in range(0, len(records), 10):
        writer.write(records[i : i + 10])
    assert in_progress(out) == [".part-00000-g1-0.inprogress"]  # one file for the epoch
    writer.commit(1, writer.prepare(1))
    with open(out / "part-00000-0000000001.avro", "rb") as f:
        blocks = list(fastavro.block_reader(f))
    assert 3 <= len(blocks) <= 10  # ~64 KiB of records a block, not one block a batch
    assert sum(b.num_records for b in blocks) == len(records)
    assert read_avro(out) == records


def test_every_avro_part_is_a_whole_container_file_when_epoch_is_rotated(out: Path) -> None:
    import fastavro

    writer = FileSink(out, format="avro", schema=TOTAL, max_part_bytes=2000).open(context())
    records = [total(f"user-{i:05d}", i, i) for i in range(2000)]
    for i in range(0, len(records), 100):
        writer.write(records[i : i + 100])
    committable = writer.prepare(1)
    assert len(committable["parts"]) > 5
    writer.commit(1, committable)
    for name in visible(out):
        with open(out / name, "rb") as f:
            assert fastavro.is_avro(f)
    assert read_avro(out) == records


def test_nothing_is_written_when_avro_epoch_is_empty(out: Path) -> None:
    writer = FileSink(out, format="avro", schema=TOTAL).open(context())
    writer.write([])
    assert writer.prepare(1) is None
    assert os.listdir(out) == [CLAIM]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "needs schema="),
        (
            {
                "schema": {
                    "type": "record",
                    "name": "R",
                    "fields": [{"name": "a", "type": "integer"}],
                }
            },
            "not a valid Avro schema: UnknownType: integer",
        ),
        ({"schema": {"type": "record", "fields": []}}, "not a valid Avro schema"),
        ({"schema": TOTAL, "codec": "gzip"}, "codec 'gzip' cannot be used: unrecognized codec"),
        ({"schema": TOTAL, "encoder": bytes}, "takes to_record="),
        ({"schema": TOTAL, "to_record": "user"}, "to_record must be a function"),
    ],
)
def test_config_error_is_raised_when_avro_options_are_wrong(
    out: Path, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        FileSink(out, format="avro", **kwargs)


def test_config_error_is_raised_when_avro_options_are_given_to_a_line_format(out: Path) -> None:
    with pytest.raises(ConfigError, match="belong to format 'avro', not 'jsonl'"):
        FileSink(out, schema=TOTAL)


def test_snappy_is_usable_only_when_its_library_is_installed(out: Path) -> None:
    try:
        import cramjam  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match=r"codec 'snappy' cannot be used: .*cramjam"):
            FileSink(out, format="avro", schema=TOTAL, codec="snappy")
    else:
        writer = FileSink(out, format="avro", schema=TOTAL, codec="snappy").open(context())
        writer.commit(1, epoch(writer, 1, [total("a", 1, 1)]))
        assert read_avro(out) == [total("a", 1, 1)]


def test_read_committed_decodes_every_format_in_checkpoint_order(out: Path) -> None:
    """A step whose format changed between runs: each part is read with its own format."""
    jsonl = FileSink(out).open(context())
    jsonl.commit(1, epoch(jsonl, 1, [{"n": 1}]))
    avro = FileSink(out, format="avro", schema={"type": "long"}).open(context(generation=2))
    avro.commit(2, epoch(avro, 2, [2, 3]))
    raw = FileSink(out, format="raw").open(context(generation=3))
    raw.commit(3, epoch(raw, 3, ["four"]))
    assert read_committed(out) == [{"n": 1}, 2, 3, b"four"]
    assert read_jsonl(out) == [{"n": 1}]
    assert read_committed_lines(out) == [b'{"n":1}', b"four"]


# -- the protocol under crashes, as the engine drives it -------------------------------------------


class _Crash(Exception):
    """The simulated SIGKILL: the writer is abandoned where it stands."""


_POINTS = ("none", "before-prepare", "before-ack", "after-completion-before-commit",
           "mid-commit", "mid-sink-commit", "mid-sink-recover")  # fmt: skip


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), format=st.sampled_from(["jsonl", "avro"]), split=st.sampled_from([None, 8]))
def test_output_is_every_value_once_in_order_when_writers_crash_anywhere(
    data: st.DataObject, format: str, split: int | None
) -> None:
    """A model of the engine for one subtask: epochs are prepared at barriers, checkpoints
    complete or abort, committables of aborted ones are committed with the next completed one,
    and a crash restores the last completed snapshot (input position and pending committables)
    into a new generation whose writer recovers. Every value must be committed once, in order.
    """
    values = list(range(data.draw(st.integers(0, 40), label="values")))
    kwargs: dict[str, Any] = {"max_part_bytes": split}
    if format == "avro":
        kwargs.update(schema={"type": "long"}, codec="null")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        sink = FileSink(out, format=format, **kwargs)
        snapshot: tuple[int, list[tuple[int, Any]]] = (0, [])  # (position, pending)
        checkpoint_id, generation, crashes = 0, 0, 0
        while True:
            generation += 1
            crash_at = "none"
            if crashes < 4:
                crash_at = data.draw(st.sampled_from(_POINTS), label="crash")

            def fault(point: str, crash_at: str = crash_at) -> None:
                if point == crash_at:
                    raise _Crash(point)

            writer = sink.open(context(generation=generation, fault=fault))
            try:
                position, restored = snapshot
                writer.recover(restored)
                pending: list[tuple[int, Any]] = []
                finished = False
                while not finished:
                    take = data.draw(st.integers(0, 6), label="epoch size")
                    batch = values[position : position + take]
                    cut = data.draw(st.integers(0, len(batch)), label="batch split")
                    writer.write(batch[:cut])
                    writer.write(batch[cut:])
                    position += len(batch)
                    checkpoint_id += 1
                    fault("before-prepare")
                    committable = writer.prepare(checkpoint_id)
                    if committable is not None:
                        pending.append((checkpoint_id, committable))
                    if data.draw(st.booleans(), label="aborted") and position < len(values):
                        continue  # aborted: its committable waits for the next completed one
                    fault("before-ack")
                    snapshot = (position, list(pending))  # completed
                    finished = position >= len(values)
                    fault("after-completion-before-commit")
                    for i, (chk, c) in enumerate(pending):
                        writer.commit(chk, c)
                        if i == 0:
                            fault("mid-commit")
                    pending = []
            except _Crash:
                crashes += 1
                writer.close()
                continue
            writer.close()
            break
        assert read_committed(out) == values
        assert in_progress(out) == []
