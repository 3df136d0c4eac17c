"""Where a run's start went (processor.runtime.supervision.startup, issue 51)."""

from __future__ import annotations

import logging
import time

import pytest

from processor.runtime.supervision.startup import PHASES, StartTimes, process_age


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_each_phase_is_marked_once_and_the_last_logs_the_whole_start(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    start = StartTimes(clock)
    start.job = "j"
    for i, phase in enumerate(PHASES):
        clock.now += 0.1 * (i + 1)
        start.mark(phase)
        clock.now += 5.0
        start.mark(phase)  # a recovery passes it again: the start's mark stays
    with caplog.at_level(logging.INFO):
        start.mark(PHASES[-1])
    assert not caplog.records  # logged once, when it was first reached
    got = start.as_dict()
    assert [got[f"{p}_s"] for p in PHASES] == sorted(got[f"{p}_s"] for p in PHASES)
    assert got["compiled_s"] == 0.1 and got["connected_s"] == pytest.approx(27.1)
    with pytest.raises(AssertionError):
        start.mark("lunch")


def test_the_log_line_names_every_phase_with_its_time(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    start = StartTimes(clock)
    start.job = "j"
    with caplog.at_level(logging.INFO, logger="processor.runtime.supervision.startup"):
        for phase in PHASES:
            clock.now += 0.25
            start.mark(phase)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("job=j start: ")
    assert "compiled 0.25 s" in line and "first_committed 2.25 s" in line


def test_process_age_is_the_time_since_this_process_started() -> None:
    age = process_age()
    assert age is not None  # Linux
    time.sleep(0.05)
    later = process_age()
    assert later is not None and later >= age
    assert 0.0 < age < 24 * 3600.0
