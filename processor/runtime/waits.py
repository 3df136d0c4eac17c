"""What a worker process is waiting on, and since when (issue 37: "a Redis stall is silent").

A worker blocked in a Redis retry, a sink's commit or a producer's flush does not run its loop,
so its counters stop and nothing said why: ``kill -STOP`` of the dedup store's Redis showed
``in=9,031 (0/s)`` for 22 s, and ``dedup store unreachable, retrying`` came only in the worker's
log, 12 s late (after redis-py's socket timeout). Each blocking site says what it waits on::

    with waiting("the dedup store of step 'dedup' (redis://127.0.0.1:6379/0)"):
        reply = pipe.execute()

and the worker's heartbeat thread, which runs while the loop is blocked, sends
:meth:`Waits.report` every second: the runner shows the waits that lasted longer than
``at_least_s`` in the progress line, ``status.json``, ``eosflow status`` and ``/metrics``
(``eosflow_waiting_seconds``), within about a second of the wait's start, not after a timeout.

Cheap enough for every batch: entering and leaving a wait is a lock and a dict operation
(about a microsecond); nothing is sent unless a wait lasts. The registry is per process
(:data:`WAITS`), shared by the worker's threads (the task loop, the snapshot uploads).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

__all__ = ["WAITS", "Wait", "Waits", "waiting"]


@dataclass(frozen=True)
class Wait:
    """One wait in progress: ``on`` what (a sentence fragment: "the dedup store of step 'dedup'
    (redis://127.0.0.1:6379/0)"), since ``since`` (the registry's clock) and ``since_ms`` (epoch
    milliseconds)."""

    on: str
    since: float
    since_ms: int


class _Waiting:
    """The context manager :meth:`Waits.waiting` returns (a class: cheaper than a generator)."""

    __slots__ = ("_on", "_waits")

    def __init__(self, waits: Waits, on: str) -> None:
        self._waits, self._on = waits, on

    def __enter__(self) -> None:
        self._waits._enter(self, self._on)

    def __exit__(
        self,
        _type: type[BaseException] | None,
        _exc: BaseException | None,
        _tb: TracebackType | None,
    ) -> None:
        self._waits._exit(self)


class Waits:
    """The waits in progress in one process. Thread-safe.

    Args:
        clock: monotonic seconds (tests pass a manual clock).
        wall: epoch seconds, for ``since_ms``.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._clock, self._wall = clock, wall
        self._lock = threading.Lock()
        self._now: dict[int, Wait] = {}

    def waiting(self, on: str) -> _Waiting:
        """A context manager: the code it wraps waits on ``on`` (nested waits each count)."""
        return _Waiting(self, on)

    def begin(self, on: str) -> object:
        """A wait that is not a block of code (a source reader that gets nothing while the
        broker said it has records): its token, for :meth:`end`."""
        token = object()
        self._enter(token, on)
        return token

    def end(self, token: object) -> None:
        self._exit(token)

    def _enter(self, token: object, on: str) -> None:
        wait = Wait(on, self._clock(), int(self._wall() * 1000))
        with self._lock:
            self._now[id(token)] = wait

    def _exit(self, token: object) -> None:
        with self._lock:
            self._now.pop(id(token), None)

    def current(self) -> list[Wait]:
        """The waits in progress, the oldest first."""
        with self._lock:
            waits = list(self._now.values())
        return sorted(waits, key=lambda w: w.since)

    def report(self, at_least_s: float = 0.5) -> list[dict[str, Any]]:
        """The waits that lasted ``at_least_s`` or longer, as the heartbeat sends them:
        ``{"on", "since_ms", "for_s"}``, the oldest first (short waits are normal work)."""
        now = self._clock()
        return [
            {"on": w.on, "since_ms": w.since_ms, "for_s": round(now - w.since, 1)}
            for w in self.current()
            if now - w.since >= at_least_s
        ]


#: The worker process's registry.
WAITS = Waits()


def waiting(on: str) -> _Waiting:
    """``WAITS.waiting(on)``: the code it wraps waits on ``on`` (see the module docstring)."""
    return WAITS.waiting(on)
