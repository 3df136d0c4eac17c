"""The errors of the dedup library.

``dedup`` is a library of its own (the consumer-side helpers use it without the engine), so it
imports nothing from :mod:`processor`, not even its error hierarchy. Its errors form a small tree
of their own, drawn here and in :mod:`processor.errors`; the CLI reports both alike::

    DedupError
    ├── DedupConfigError (ValueError)   bad settings (no Redis URL, a snapshot taken with other
    │                                   ``within``/``bucket``); says how to fix it
    ├── RedisUnavailable                the ID store did not answer for longer than its
    │                                   ``give_up_s``: the records stay unchecked, never passed
    └── RedisDataLost                   the ID store lost IDs that the restored checkpoint or
                                        this run wrote (Redis restarted empty, failed over to a
                                        replica that missed writes, evicted keys): the task
                                        refuses to decide records against it

Invariants:
    Nothing here imports a third-party package or another eosflow package.
"""

from __future__ import annotations

__all__ = ["DedupConfigError", "DedupError", "RedisDataLost", "RedisUnavailable"]


class DedupError(Exception):
    """Base of every error the dedup library raises on purpose."""


class DedupConfigError(DedupError, ValueError):
    """Bad dedup configuration, detected before records are checked."""


class RedisUnavailable(DedupError):
    """Redis could not be reached for longer than the store's ``give_up_s``."""


class RedisDataLost(DedupError):
    """The ID store no longer holds IDs that were written to it (its write marker is behind).

    Attributes:
        lost: ``{run: (batches written, batches the store still accounts for)}``.
    """

    def __init__(self, message: str, lost: dict[int, tuple[int, int]]) -> None:
        super().__init__(message)
        self.lost = lost
