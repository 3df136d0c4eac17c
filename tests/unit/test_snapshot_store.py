"""Unit tests for processor.snapshot.store on local files (tmp_path) and fsspec's memory://."""

from __future__ import annotations

import logging
import re
import struct
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import orjson
import pytest

from processor.errors import ConfigError, DefinitionError, SerializationError, SnapshotError
from processor.snapshot import MANIFEST, SnapshotHandle, SnapshotStore

JOB = "clicks"
STATE: dict[str, Any] = {"count": {"user-1": (3, 42), ("u", 2): {1, 2}}, "log": [b"x", None, 1.5]}


class ManualClock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store(tmp_path: Path) -> SnapshotStore:
    return SnapshotStore(f"file://{tmp_path}", clock=ManualClock())


def checkpoint(
    store: SnapshotStore, checkpoint_id: int, *, tasks: tuple[str, ...] = ("count-0", "count-1")
) -> dict[str, SnapshotHandle]:
    """Writes every task's snapshot and completes the checkpoint."""
    handles = {t: store.write_task_snapshot(JOB, checkpoint_id, t, {**STATE, "id": checkpoint_id})
               for t in tasks}  # fmt: skip
    store.complete(JOB, checkpoint_id, handles, {"offsets": {"clicks": [10, 20]}, "generation": 1})
    return handles


def chk_dir(tmp_path: Path, checkpoint_id: int) -> Path:
    return tmp_path / JOB / f"chk-{checkpoint_id:010d}"


def test_snapshot_round_trips_when_written_and_read_back(store: SnapshotStore) -> None:
    handle = store.write_task_snapshot(JOB, 1, "count-0", STATE)
    assert handle.path.endswith(f"/{JOB}/chk-0000000001/count-0.snap")
    assert handle.size == Path(handle.path).stat().st_size
    assert len(handle.checksum) == 32
    assert store.read_task_snapshot(handle) == STATE
    assert store.read_task_snapshot(handle.path) == STATE


def test_no_temporary_file_remains_when_snapshot_is_written(
    store: SnapshotStore, tmp_path: Path
) -> None:
    store.write_task_snapshot(JOB, 1, "count-0", STATE)
    assert [p.name for p in chk_dir(tmp_path, 1).iterdir()] == ["count-0.snap"]


def test_checkpoint_is_not_completed_when_only_snapshots_are_written(
    store: SnapshotStore, tmp_path: Path
) -> None:
    store.write_task_snapshot(JOB, 1, "count-0", STATE)
    assert not (chk_dir(tmp_path, 1) / MANIFEST).exists()
    assert store.completed_ids(JOB) == []
    assert store.latest_completed(JOB) is None
    with pytest.raises(SnapshotError) as info:
        store.load(JOB, 1)
    assert info.value.reason == "missing"


def test_manifest_records_handles_and_metadata_when_checkpoint_completes(
    store: SnapshotStore, tmp_path: Path
) -> None:
    handles = checkpoint(store, 7)
    manifest = store.load(JOB, 7)
    assert manifest.checkpoint_id == 7 and manifest.job == JOB
    assert manifest.created_ms == 1_700_000_000_000
    assert manifest.tasks == handles
    assert manifest.metadata == {"offsets": {"clicks": [10, 20]}, "generation": 1}
    raw = orjson.loads((chk_dir(tmp_path, 7) / MANIFEST).read_bytes())
    assert raw["format_version"] == 1
    assert raw["tasks"]["count-0"]["checksum"] == handles["count-0"].checksum
    assert store.read_task_snapshot(manifest.tasks["count-1"])["id"] == 7


def test_complete_is_idempotent_when_repeated_with_the_same_snapshots(
    store: SnapshotStore,
) -> None:
    handles = checkpoint(store, 1)
    store.complete(JOB, 1, handles, {"generation": 1})
    other = store.write_task_snapshot(JOB, 1, "count-2", STATE)
    with pytest.raises(SnapshotError) as info:
        store.complete(JOB, 1, {**handles, "count-2": other}, {})
    assert info.value.reason == "completed"


def test_complete_refuses_when_a_snapshot_is_missing(store: SnapshotStore, tmp_path: Path) -> None:
    handle = store.write_task_snapshot(JOB, 1, "count-0", STATE)
    Path(handle.path).unlink()
    with pytest.raises(SnapshotError, match=r"has no bytes") as info:
        store.complete(JOB, 1, {"count-0": handle}, {})
    assert info.value.reason == "missing"
    assert not (chk_dir(tmp_path, 1) / MANIFEST).exists()


def test_complete_refuses_when_metadata_is_not_json(store: SnapshotStore) -> None:
    handle = store.write_task_snapshot(JOB, 1, "count-0", STATE)
    with pytest.raises(SerializationError, match="metadata is not JSON"):
        store.complete(JOB, 1, {"count-0": handle}, {"offsets": {("clicks", 0): 10}})


def test_latest_completed_skips_when_newer_checkpoints_are_incomplete_or_corrupt(
    store: SnapshotStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    checkpoint(store, 1)
    checkpoint(store, 2)
    (chk_dir(tmp_path, 2) / MANIFEST).write_bytes(b"{not json")
    checkpoint(store, 3)
    (chk_dir(tmp_path, 3) / "count-1.snap").unlink()
    store.write_task_snapshot(JOB, 4, "count-0", STATE)  # pending: no manifest
    with caplog.at_level(logging.WARNING, logger="processor.snapshot.store"):
        latest = store.latest_completed(JOB)
    assert latest is not None and latest.checkpoint_id == 1
    warnings = [r.getMessage() for r in caplog.records]
    assert any("checkpoint_id=2" in m and "_MANIFEST" in m for m in warnings)
    assert any("checkpoint_id=3" in m and "count-1.snap" in m for m in warnings)
    assert store.completed_ids(JOB) == [1, 2, 3]


def test_latest_completed_raises_when_newest_manifest_has_a_newer_version(
    store: SnapshotStore, tmp_path: Path
) -> None:
    checkpoint(store, 1)
    checkpoint(store, 2)
    path = chk_dir(tmp_path, 2) / MANIFEST
    path.write_bytes(orjson.dumps({**orjson.loads(path.read_bytes()), "format_version": 2}))
    with pytest.raises(SnapshotError, match="upgrade eosflow") as info:
        store.latest_completed(JOB)
    assert info.value.reason == "unknown_version"


def test_read_raises_corrupt_when_a_byte_is_flipped(store: SnapshotStore) -> None:
    handle = store.write_task_snapshot(JOB, 1, "count-0", STATE)
    path = Path(handle.path)
    data = bytearray(path.read_bytes())
    for offset in (0, 9, 20, len(data) - 1):  # magic, length, checksum, body
        flipped = data.copy()
        flipped[offset] ^= 0x01
        path.write_bytes(bytes(flipped))
        with pytest.raises(SnapshotError) as info:
            store.read_task_snapshot(handle.path)
        assert info.value.reason == "corrupt"
        assert info.value.path == handle.path and handle.path in str(info.value)


def test_read_raises_corrupt_when_file_is_truncated(store: SnapshotStore) -> None:
    handle = store.write_task_snapshot(JOB, 1, "count-0", STATE)
    data = Path(handle.path).read_bytes()
    for cut in (0, 10, 32, len(data) - 1):
        Path(handle.path).write_bytes(data[:cut])
        with pytest.raises(SnapshotError) as info:
            store.read_task_snapshot(handle.path)
        assert info.value.reason == "corrupt"


def test_read_raises_corrupt_when_file_is_not_the_one_the_handle_names(
    store: SnapshotStore,
) -> None:
    handle = store.write_task_snapshot(JOB, 1, "count-0", STATE)
    store.write_task_snapshot(JOB, 1, "count-0", {"other": 1})  # a valid, different snapshot
    with pytest.raises(SnapshotError, match="not the snapshot its handle names") as info:
        store.read_task_snapshot(handle)
    assert info.value.reason == "corrupt"


def test_read_refuses_with_upgrade_message_when_version_is_newer(store: SnapshotStore) -> None:
    handle = store.write_task_snapshot(JOB, 1, "count-0", STATE)
    data = bytearray(Path(handle.path).read_bytes())
    struct.pack_into("<H", data, 4, 7)
    Path(handle.path).write_bytes(bytes(data))
    expected = "snapshot format version 7 is newer than this eosflow supports (1): upgrade eosflow"
    with pytest.raises(SnapshotError, match=re.escape(expected)) as i:
        store.read_task_snapshot(handle.path)
    assert i.value.reason == "unknown_version"


def test_read_raises_missing_when_file_does_not_exist(store: SnapshotStore) -> None:
    with pytest.raises(SnapshotError) as info:
        store.read_task_snapshot(SnapshotHandle("/nowhere/x.snap", 1, "00"))
    assert info.value.reason == "missing"


def test_retain_keeps_newest_and_removes_orphans_when_asked_to_keep_two(
    store: SnapshotStore, tmp_path: Path
) -> None:
    for checkpoint_id in (1, 2):
        checkpoint(store, checkpoint_id)
    store.write_task_snapshot(JOB, 3, "count-0", STATE)  # aborted: orphan once 4 completes
    checkpoint(store, 4)
    checkpoint(store, 5)
    store.write_task_snapshot(JOB, 6, "count-0", STATE)  # pending: newer than any completed
    assert store.retain(JOB, keep=2) == [1, 2, 3]
    assert sorted(p.name for p in (tmp_path / JOB).iterdir()) == [
        "chk-0000000004",
        "chk-0000000005",
        "chk-0000000006",
    ]
    assert store.completed_ids(JOB) == [4, 5]
    assert store.retain(JOB, keep=2) == []


def test_retain_keeps_the_restorable_checkpoint_when_newest_manifest_is_corrupt(
    store: SnapshotStore, tmp_path: Path
) -> None:
    checkpoint(store, 1)
    checkpoint(store, 2)
    (chk_dir(tmp_path, 2) / MANIFEST).write_bytes(b"")
    assert store.retain(JOB, keep=1) == []
    latest = store.latest_completed(JOB)
    assert latest is not None and latest.checkpoint_id == 1


@pytest.mark.parametrize("keep", [0, -1])
def test_retain_refuses_when_keep_is_below_one(store: SnapshotStore, keep: int) -> None:
    with pytest.raises(ConfigError, match="keep at least 1"):
        store.retain(JOB, keep=keep)


def test_discard_removes_snapshots_when_checkpoint_was_aborted(
    store: SnapshotStore, tmp_path: Path
) -> None:
    store.write_task_snapshot(JOB, 1, "count-0", STATE)
    store.discard(JOB, 1)
    assert not chk_dir(tmp_path, 1).exists()
    store.discard(JOB, 1)  # idempotent


def test_discard_refuses_when_checkpoint_is_completed(store: SnapshotStore) -> None:
    checkpoint(store, 1)
    with pytest.raises(SnapshotError) as info:
        store.discard(JOB, 1)
    assert info.value.reason == "completed"


@pytest.mark.parametrize("name", ["", "../etc", "a/b", "_MANIFEST", "-x", "a b"])
def test_names_are_refused_when_they_cannot_name_a_file(store: SnapshotStore, name: str) -> None:
    with pytest.raises(DefinitionError):
        store.write_task_snapshot(JOB, 1, name, STATE)
    with pytest.raises(DefinitionError):
        store.write_task_snapshot(name, 1, "count-0", STATE)


def test_checkpoint_id_is_refused_when_not_a_ten_digit_natural(store: SnapshotStore) -> None:
    for bad in (-1, 10**10, True):
        with pytest.raises(DefinitionError):
            store.write_task_snapshot(JOB, bad, "count-0", STATE)


@pytest.fixture
def memory_url() -> Iterator[str]:
    root = f"eosflow-test-{uuid.uuid4().hex}"
    yield f"memory://{root}"
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{root}"):
        fs.rm(f"/{root}", recursive=True)


def test_whole_lifecycle_works_when_store_is_in_memory(memory_url: str) -> None:
    store = SnapshotStore(memory_url, clock=ManualClock())
    for checkpoint_id in (1, 2, 3):
        checkpoint(store, checkpoint_id)
    store.write_task_snapshot(JOB, 4, "count-0", STATE)
    store.discard(JOB, 4)
    assert store.retain(JOB, keep=1) == [1, 2]
    latest = store.latest_completed(JOB)
    assert latest is not None and latest.checkpoint_id == 3
    assert store.read_task_snapshot(latest.tasks["count-0"]) == {**STATE, "id": 3}
    assert SnapshotStore(memory_url).completed_ids(JOB) == [3]
