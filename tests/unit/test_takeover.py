"""``--takeover``'s decisions that need no broker (processor/runtime/supervision/takeover.py);
the handovers themselves run in tests/e2e/test_takeover.py."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import pytest

from processor.errors import ConfigError
from processor.runtime.supervision.takeover import Takeover
from processor.snapshot.store import SnapshotStore


class _Claim:
    def __init__(self, record: dict[str, Any] | None) -> None:
        self.record = record
        self.closed = False

    def last(self) -> dict[str, Any] | None:
        return self.record

    def close(self) -> None:
        self.closed = True


class _Transport:
    def __init__(self, claim: _Claim) -> None:
        self.claim = claim

    def job_claim(self, job: str) -> _Claim:
        return self.claim


def _record(store: str, host: str) -> dict[str, Any]:
    return {"host": host, "pid": 4242, "at_ms": int(time.time() * 1000), "checkpoint": 7,
            "store": store, "interval_ms": 1000, "stopped": False}  # fmt: skip


def _takeover(tmp_path: Path, said: list[str]) -> Takeover:
    store = SnapshotStore(f"file://{tmp_path / 'mine'}")
    return Takeover("job-a", store, timeout=5.0, say=said.append)


def test_a_holder_on_a_file_store_of_another_machine_is_refused_at_once(tmp_path: Path) -> None:
    """Its path names another machine's disk: no request could reach it, so the start says so
    and names the manual way, instead of waiting out the timeout."""
    said: list[str] = []
    takeover = _takeover(tmp_path, said)
    claim = _Claim(_record(f"file://{tmp_path / 'mine'}", "another-host"))
    started = time.monotonic()
    with pytest.raises(ConfigError, match="not reachable from here") as err:
        takeover.from_claim(_Transport(claim))
    assert time.monotonic() - started < 1.0
    assert "eosflow savepoint job-a --stop --path URL" in str(err.value)
    assert claim.closed


def test_no_running_holder_means_a_usual_start(tmp_path: Path) -> None:
    said: list[str] = []
    stopped = {**_record(f"file://{tmp_path / 'theirs'}", "h"), "stopped": True}
    assert _takeover(tmp_path, said).from_claim(_Transport(_Claim(stopped))) is None
    assert said == [
        f"--takeover: the runner of job 'job-a' on host h, pid 4242, stopped before this "
        f"takeover (snapshot store file://{tmp_path / 'theirs'}), which is not reachable from "
        "here; starting as usual"
    ]
    said.clear()
    assert _takeover(tmp_path, said).from_claim(_Transport(_Claim(None))) is None
    assert said == ["--takeover: the claim of job 'job-a' names no running runner"]


def test_a_holder_that_stopped_just_before_on_a_reachable_store_is_gone_on_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its runner stopped before the takeover looked (a bounded run that finished, a SIGTERM
    just before): its newest checkpoint is copied as a savepoint, as when it stops without
    answering, instead of a usual start that the job's history refuses."""
    from processor.admin import jobs
    from processor.admin.values import Savepoint
    from processor.runtime.supervision import takeover as module

    theirs = f"file://{tmp_path / 'theirs'}"
    copied: list[str | None] = []

    def copy(_self: Any, job: str, *, snapshot_url: Any = None, **_kw: Any) -> Savepoint:
        copied.append(snapshot_url)
        return Savepoint(job, f"{theirs}/savepoints/sp-9", 9)

    monkeypatch.setattr(jobs.JobAdmin, "copy_checkpoint", copy)
    monkeypatch.setattr(module, "_has_job", lambda _store, _job: True)
    said: list[str] = []
    stopped = {**_record(theirs, socket.gethostname()), "stopped": True}
    path = _takeover(tmp_path, said).from_claim(_Transport(_Claim(stopped)))
    assert path == f"{theirs}/savepoints/sp-9" and copied == [theirs]
    assert "pid 4242, stopped before this takeover" in said[-1], said
    assert "its checkpoint 9 copied as a savepoint" in said[-1], said
