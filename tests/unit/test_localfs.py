"""The local files of the snapshot store (:mod:`processor.snapshot.localfs`) answer as fsspec's
``LocalFileSystem`` does, for the calls the store, the savepoints and the staged Kafka sink make;
other URLs still go to fsspec."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from fsspec.core import url_to_fs

from processor.snapshot.localfs import LocalFiles, open_fs


@pytest.mark.parametrize(
    "url",
    [
        "{tmp}/a/b",
        "{tmp}/a/b/",
        "file://{tmp}/a/b",
        "file://{tmp}/a/b/",
        "a/b",
        "./a/b",
        ".",
        "~/x",
    ],
)
def test_a_local_url_opens_at_the_root_fsspec_gives_it(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    url = url.format(tmp=tmp_path)
    fs, root = open_fs(url)
    assert isinstance(fs, LocalFiles)
    assert root == url_to_fs(url)[1]


@pytest.mark.parametrize("url", ["memory://x/y", "simplecache::file:///tmp/x", "file:/tmp/x"])
def test_other_urls_go_to_fsspec(url: str) -> None:
    fs, root = open_fs(url)
    assert not isinstance(fs, LocalFiles)
    assert root == url_to_fs(url)[1]


def test_local_options_go_to_fsspec(tmp_path: Path) -> None:
    fs, _ = open_fs(f"file://{tmp_path}", auto_mkdir=True)
    assert not isinstance(fs, LocalFiles)


def test_the_calls_answer_as_fsspecs_local_filesystem(tmp_path: Path) -> None:
    mine, root = open_fs(f"file://{tmp_path}/store")
    theirs, same = url_to_fs(f"file://{tmp_path}/store")
    assert root == same
    for fs, top in ((mine, f"{root}/m"), (theirs, f"{root}/t")):
        fs.makedirs(f"{top}/chk-1", exist_ok=True)
        fs.makedirs(f"{top}/chk-1", exist_ok=True)
        fs.pipe_file(f"{top}/chk-1/_MANIFEST", b"manifest")
        fs.pipe_file(f"{top}/chk-1/a.snap.tmp", b"12345")
        fs.mv(f"{top}/chk-1/a.snap.tmp", f"{top}/chk-1/a.snap")
        fs.makedirs(f"{top}/chk-2")
        with fs.open(f"{top}/chk-2/b.staged", "wb") as f:
            f.write(b"xy")
        with pytest.raises(FileExistsError):
            fs.makedirs(f"{top}/chk-2")
    m, t = f"{root}/m", f"{root}/t"

    def same_names(a: list[str], b: list[str]) -> None:
        assert sorted(x.replace(m, "T") for x in a) == sorted(x.replace(t, "T") for x in b)

    same_names(mine.ls(m), theirs.ls(t))
    same_names(mine.ls(f"{m}/chk-1/a.snap"), theirs.ls(f"{t}/chk-1/a.snap"))
    same_names(mine.glob(f"{m}/chk-*/_MANIFEST"), theirs.glob(f"{t}/chk-*/_MANIFEST"))
    assert mine.glob(f"{m}/chk-*/_MANIFEST") == sorted(mine.glob(f"{m}/chk-*/_MANIFEST"))

    def sizes(fs: object, top: str) -> dict[str, tuple[int, str]]:
        listing = fs.ls(f"{top}/chk-1", detail=True)  # type: ignore[attr-defined]
        return {e["name"].replace(top, "T"): (e["size"], e["type"]) for e in listing}

    assert (
        sizes(mine, m)
        == sizes(theirs, t)
        == {
            "T/chk-1/_MANIFEST": (8, "file"),
            "T/chk-1/a.snap": (5, "file"),
        }
    )
    for fs, top in ((mine, m), (theirs, t)):
        assert fs.cat_file(f"{top}/chk-1/a.snap") == b"12345"
        assert fs.exists(f"{top}/chk-1") and not fs.exists(f"{top}/chk-9")
        with pytest.raises(FileNotFoundError):
            fs.ls(f"{top}/chk-9")
        with pytest.raises(FileNotFoundError):
            fs.cat_file(f"{top}/chk-9/x")
        with pytest.raises(ValueError):
            fs.rm(f"{top}/chk-1")
        fs.rm(f"{top}/chk-2/b.staged")
        fs.rm_file(f"{top}/chk-1/_MANIFEST")
        fs.rm(f"{top}/chk-1", recursive=True)
        assert fs.ls(top) == [f"{top}/chk-2"]


def test_a_worker_and_a_runner_start_without_importing_fsspec() -> None:
    """The point of the module: fsspec and what it imports stay out of a start on a local
    store (35-50 ms of each process's imports; asyncio stays: confluent_kafka imports it)."""
    code = (
        "import sys, processor.cli, processor.runtime.supervision.local, "
        "processor.runtime.supervision.worker, sinks.kafka; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'fsspec'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
