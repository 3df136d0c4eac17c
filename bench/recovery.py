"""Recovery time: SIGKILL one worker of a running job and time the way back to committed output.

The job runs on the local runner in this process's main thread; a monitor thread waits until the
first generation is connected plus ``kill_after`` seconds, SIGKILLs one worker and then polls
(every 5 ms) for:

* ``detect_s``: the runner noticed the death and started a restart (``runner.restarts``);
* ``connected_s``: every worker of the new generation is connected to the coordinator (it has
  restored the latest completed checkpoint and opened its inputs);
* ``first_output_s``: the first part file of a checkpoint taken by the new generation (a
  checkpoint id above the restored one) appears in the output directory: the moment new results
  are visible to readers again.

All three are measured from the kill. The runner's restart backoff (``RunOptions``'s default
0.5 s before the first restart) is part of them, as it is for a user.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

from jobs import drop_channel_topics, make_runner

from processor.runtime.supervision.local import RunOptions
from processor.runtime.supervision.runner import Runner

__all__ = ["measure_recovery"]

_PART = re.compile(r"part-\d{5,}-(\d{10})\.jsonl\Z")
_POLL_S = 0.005


def _committed_ids(directory: str) -> set[int]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return set()
    return {int(m.group(1)) for m in map(_PART.match, names) if m}


class _Monitor(threading.Thread):
    def __init__(
        self, runner: Runner, *, kill_after: float, victim: int, output: str, timeout: float
    ) -> None:
        super().__init__(name="bench-recovery-monitor", daemon=True)
        self.runner, self.kill_after, self.victim = runner, kill_after, victim
        self.output, self.timeout = output, timeout
        self.found: dict[str, Any] = {}
        self.error: str | None = None
        self.stop = threading.Event()

    def _wait(self, condition: Any, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not condition():
            if self.stop.is_set() or time.monotonic() > deadline:
                return False
            time.sleep(_POLL_S)
        return True

    def run(self) -> None:
        try:
            self._run()
        except Exception as exc:  # reported with the result, never a silent thread death
            self.error = f"{type(exc).__name__}: {exc}"

    def _run(self) -> None:
        runner = self.runner
        if not self._wait(lambda: runner.ready_s is not None, 120):
            self.error = "the job never became ready"
            return
        if self.stop.wait(self.kill_after):
            return
        if runner.final_chk is not None or any(w.drained for w in runner.workers):
            self.error = "the input was drained before the kill: raise --recovery-records"
            return
        old = {w.pid for w in runner.workers}
        before = runner.coordinator.stats.last_completed
        generation = runner.generation
        pid = runner.workers[self.victim].pid
        if pid is None:
            self.error = "the victim's pid is unknown"
            return
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        found = self.found
        found.update(victim=self.victim, last_completed_before_kill=before)

        def new_generation() -> bool:
            workers = list(runner.workers)
            return (
                runner.generation > generation
                and len(workers) == runner.options.workers
                and not {w.pid for w in workers} & old
            )

        if self._wait(lambda: runner.restarts > 0, self.timeout):
            found["detect_s"] = time.monotonic() - killed
        if not self._wait(new_generation, self.timeout):
            self.error = "no new generation started"
            return
        found["spawned_s"] = time.monotonic() - killed
        latest = runner.store.latest_completed(runner.job)
        restored = latest.checkpoint_id if latest is not None else 0
        found["restored_checkpoint"] = restored
        if self._wait(lambda: all(w.conn is not None for w in list(runner.workers)), self.timeout):
            found["connected_s"] = time.monotonic() - killed
        if self._wait(lambda: max(_committed_ids(self.output), default=0) > restored, 60):
            found["first_output_s"] = time.monotonic() - killed


def measure_recovery(
    pipeline: Path,
    *,
    environ: dict[str, str],
    state_dir: str,
    kill_after: float,
    victim: int,
    workers: int = 2,
    interval: float = 1.0,
    runner: str = "local",
) -> dict[str, Any]:
    """Runs ``pipeline`` until idle with aligned checkpoints, killing worker ``victim`` once.

    ``environ`` holds ``JOB_NAME``, ``CLICKS_TOPIC``, ``OUTPUT_DIR`` and the broker; the runner
    applies it in this process too while it loads the pipeline.
    """
    options = RunOptions(
        workers=workers,
        checkpoint_interval=interval,
        mode="aligned",
        until_idle=True,
        environ=environ,
        state_dir=state_dir,
        progress=None,
    )
    job = make_runner(runner, pipeline, options)
    monitor = _Monitor(
        job, kill_after=kill_after, victim=victim, output=environ["OUTPUT_DIR"], timeout=120
    )
    monitor.start()
    try:
        result = job.run()
    finally:
        monitor.stop.set()
        monitor.join(5)
    with contextlib.suppress(Exception):  # cleanup only
        drop_channel_topics(job)
    return {
        **monitor.found,
        "error": monitor.error,
        "restarts": result.restarts,
        "restart_causes": result.restart_causes,
        "seconds": result.seconds,
        "checkpoints": result.checkpoints,
        "job": job.job,
        "runner": runner,
        "kill_after_s": kill_after,
        "restart_backoff_s": options.restart_backoff,
    }
