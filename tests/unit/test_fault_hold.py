"""Fault injection's ``hold`` action: a worker pauses at a protocol point until the test
releases it (issue 17: a partition placed at an exact protocol point)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from processor.errors import ConfigError
from processor.runtime.job import Fault
from processor.runtime.supervision import worker
from processor.runtime.supervision.worker import _fault_hook, hold_paths

_BOUND_S = 20.0


def _wait_for(path: Path, timeout: float = _BOUND_S) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear in {timeout}s"
        time.sleep(0.01)


@pytest.mark.parametrize(
    ("text", "fault"),
    [
        ("0:1:mid-alignment", Fault(0, 1, "mid-alignment", 1, "kill")),
        ("0:1:mid-alignment:3", Fault(0, 1, "mid-alignment", 3, "kill")),
        ("2:0:before-prepare:hold", Fault(2, 0, "before-prepare", 1, "hold")),
        ("0:1:mid-sink-commit:2:hold", Fault(0, 1, "mid-sink-commit", 2, "hold")),
        ("0:1:mid-sink-commit:2:kill", Fault(0, 1, "mid-sink-commit", 2, "kill")),
    ],
)
def test_fault_parses_when_the_action_is_given_or_left_out(text: str, fault: Fault) -> None:
    assert Fault.parse(text) == fault


@pytest.mark.parametrize(
    "text",
    ["0:1:mid-alignment:2:pause", "0:1:mid-alignment:2:hold:3", "0:1:hold", "0:1:nowhere:hold"],
)
def test_fault_parse_refuses_when_the_action_or_shape_is_unknown(text: str) -> None:
    with pytest.raises(ConfigError, match="fault"):
        Fault.parse(text)


def test_fault_refuses_an_unknown_action_when_built_directly() -> None:
    with pytest.raises(ConfigError, match="'pause'"):
        Fault(0, 1, "mid-alignment", 1, "pause")


def test_hold_blocks_at_the_nth_reach_until_released(tmp_path: Path) -> None:
    fault = _fault_hook(1, [["mid-alignment", 2, "hold"]], tmp_path)
    reached, release = hold_paths(tmp_path, "mid-alignment", 1)
    fault("mid-alignment")  # the first reach: not the one
    fault("before-prepare")  # another point
    assert not reached.exists()
    done = threading.Event()
    thread = threading.Thread(target=lambda: (fault("mid-alignment"), done.set()), daemon=True)
    thread.start()
    _wait_for(reached)
    assert json.loads(reached.read_text())["pid"] == os.getpid()
    assert not done.wait(0.3), "the hook returned before the release"
    release.touch()
    assert done.wait(_BOUND_S), "the hook did not return after the release"
    fault("mid-alignment")  # the third reach passes without holding
    thread.join(1)


def test_hold_ignores_a_release_left_over_from_an_earlier_hold(tmp_path: Path) -> None:
    fault = _fault_hook(0, [["before-prepare", 1, "hold"]], tmp_path)
    reached, release = hold_paths(tmp_path, "before-prepare", 0)
    release.touch()  # stale
    done = threading.Event()
    threading.Thread(target=lambda: (fault("before-prepare"), done.set()), daemon=True).start()
    _wait_for(reached)
    assert not done.wait(0.3), "a stale release file let the hold pass"
    release.touch()
    assert done.wait(_BOUND_S)


def test_hold_goes_on_by_itself_when_never_released(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(worker, "HOLD_MAX_S", 0.2)
    fault = _fault_hook(0, [["during-recovery", 1, "hold"]], tmp_path)
    start = time.monotonic()
    fault("during-recovery")
    assert 0.2 <= time.monotonic() - start < _BOUND_S
    assert hold_paths(tmp_path, "during-recovery", 0)[0].exists()


_CHILD = """
import sys
from pathlib import Path
from processor.runtime.supervision.worker import _fault_hook
_fault_hook(int(sys.argv[2]), [[sys.argv[3], 1, sys.argv[4]]], Path(sys.argv[1]))(sys.argv[3])
print("went on", flush=True)
"""


def test_hold_crosses_processes_when_the_test_owns_the_release(tmp_path: Path) -> None:
    """The runner's workers are processes: the test sees ``reached`` and writes ``release``."""
    reached, release = hold_paths(tmp_path, "mid-alignment", 1)
    args = [str(tmp_path), "1", "mid-alignment", "hold"]
    with subprocess.Popen([sys.executable, "-c", _CHILD, *args], stdout=subprocess.PIPE) as child:
        try:
            _wait_for(reached)
            time.sleep(0.2)
            assert child.poll() is None, "the worker went on without a release"
            release.touch()
            out, _ = child.communicate(timeout=_BOUND_S)
        finally:
            child.kill()
    assert child.returncode == 0
    assert out.decode().strip() == "went on"


def test_kill_action_sigkills_the_process_at_the_point(tmp_path: Path) -> None:
    args = [str(tmp_path), "0", "before-prepare", "kill"]
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, *args], capture_output=True, timeout=_BOUND_S
    )
    assert done.returncode == -9, done
    assert b"went on" not in done.stdout
