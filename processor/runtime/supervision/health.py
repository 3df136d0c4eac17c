"""Is a connected worker stuck? Heartbeats and tolerable failed checkpoints (issue 17).

A worker that is alive but not progressing was never restarted: checkpoints timed out forever
and ``--until-idle`` never ended. Two rules catch it, as Flink's do:

* **Heartbeats.** Every worker process beats every second from a thread of its own
  (:class:`processor.runtime.supervision.worker._Heartbeat`); any message counts. A worker silent
  for longer than ``RunOptions.heartbeat_timeout`` is stopped (SIGSTOP), frozen, or cut off from the
  coordinator (a lost TCP peer, a partitioned executor).
* **Tolerable failed checkpoints.** A task blocked in a user function still beats (the thread
  runs) but never acknowledges. More than ``RunOptions.tolerable_failed_checkpoints``
  checkpoint timeouts in a row restart the job; the worker whose tasks the last timeout names
  is the one restarted under ``--recovery local``.
"""

from __future__ import annotations

import re

from processor.runtime.job import RunOptions, WorkerHandle

__all__ = ["stuck_worker"]


def stuck_worker(
    workers: list[WorkerHandle], options: RunOptions, timed_out: list[str], now: float
) -> tuple[str, int | None] | None:
    """``(cause, worker index or None)`` if a worker is stuck, else ``None``.

    Args:
        workers: the current generation's workers (``last_seen``: monotonic time).
        options: ``heartbeat_timeout`` and ``tolerable_failed_checkpoints``.
        timed_out: why each checkpoint timed out, those in a row since the last completion.
        now: the monotonic time.
    """
    timeout = options.heartbeat_timeout
    for w in workers:
        if w.conn is not None and not w.conn.closed and now - w.last_seen > timeout:
            return (
                f"worker {w.index} sent nothing for {now - w.last_seen:.0f}s (heartbeat "
                f"timeout {timeout:g}s): stopped, frozen or cut off from the coordinator",
                w.index,
            )
    if len(timed_out) > options.tolerable_failed_checkpoints:
        return (
            f"{len(timed_out)} checkpoints in a row timed out (tolerable: "
            f"{options.tolerable_failed_checkpoints}); the last {timed_out[-1]}: a task is "
            "alive but not progressing (a blocked user function, or a sink that hangs)",
            _only_worker(timed_out[-1]),
        )
    return None


def _only_worker(reason: str) -> int | None:
    """The worker whose tasks (``<stage>.<subtask>``) a timeout names, if only one's are."""
    missing = re.findall(r"'[\w-]+\.(\d+)'", reason)
    return int(missing[0]) if missing and len(set(missing)) == 1 else None
