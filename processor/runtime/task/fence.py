"""Zombie fencing of a task's channel inputs (:mod:`processor.wire`, "Fencing").

Every channel record's key names its writer's incarnation. :class:`ChannelFence` keeps, per
channel, a *floor*: the highest incarnation read on it. A record below the floor was written by
an older incarnation after a newer one announced itself (a frozen worker, a long GC pause, a
Spark executor cut off from the driver, that woke up with records still queued in librdkafka):
it is dropped, counted and logged once per channel, whatever its kind and whatever the
channel's recovery phase. The floors are part of the task's snapshot, so a restored task fences
from its restored positions on.

The live data path pays one ``Message.key()`` call and one bytes comparison per record:
:attr:`ChannelFence.live_keys` holds the floor's key of each live channel only, so a record of
a recovering channel, or of another incarnation, falls to the slow path (:meth:`admit`).

Invariants:
    A channel's floor never goes down while a task runs; ``live_keys[tp]`` is
    ``channel_key(floor[tp])`` for every live channel and absent for a recovering one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from processor.wire import channel_key, key_incarnation

__all__ = ["NOT_LIVE", "ChannelFence"]

log = logging.getLogger(__name__)

TP = tuple[str, int]

#: ``live_keys.get`` default for a channel that is not live: equal to no key, not even ``None``
NOT_LIVE = object()


class ChannelFence:
    """The floors of one task's channel inputs, and what they let through."""

    def __init__(self, task: str) -> None:
        self.task = task
        #: per channel, the highest writer incarnation read on it
        self.floor: dict[TP, int] = {}
        #: per live channel, the key of its floor: the data fast path's one comparison
        self.live_keys: dict[TP, bytes] = {}
        #: records dropped because an older incarnation than the channel's floor wrote them
        self.fenced = 0
        self._logged: set[TP] = set()

    def restore(self, floors: Mapping[TP, int]) -> None:
        self.floor = dict(floors)

    def snapshot(self) -> dict[TP, int]:
        return dict(self.floor)

    def open(self, live: Iterable[TP]) -> None:
        """``live``: the channels that need no recovery phase (a task restarted alone)."""
        self.live_keys = {tp: channel_key(self.floor.get(tp, 0)) for tp in live}

    def live(self, tp: TP) -> None:
        """``tp``'s recovery phases are over: its records take the fast path."""
        self.live_keys[tp] = channel_key(self.floor.get(tp, 0))

    def announce(self, tp: TP, incarnation: int) -> None:
        """A ``GenerationStart`` of ``incarnation`` on ``tp``: the floor rises to it."""
        if incarnation > self.floor.get(tp, 0):
            self._raise(tp, incarnation)

    def admit(self, tp: TP, key: bytes | None, offset: object, *, recovering: bool) -> bool:
        """Whether a record whose key is not its live channel's floor key goes on to the
        channel's rules: not when an older incarnation than the channel's floor wrote it; a
        newer one raises the floor. ``recovering``: the channel is in a replay or drop phase,
        where an older release's records (no key, format version 1) go on to the phase."""
        tag = key_incarnation(key)
        floor = self.floor.get(tp, 0)
        if tag is not None and tag >= floor:
            if tag > floor:
                self._raise(tp, tag)
            return True
        if tag is None and recovering:
            return True
        self.fenced += 1
        if tp not in self._logged:
            self._logged.add(tp)
            log.warning(
                "channel record of a fenced writer dropped task=%s topic=%s partition=%d "
                "offset=%s incarnation=%s floor=%d: %s (counted as fenced; logged once per "
                "channel)",
                self.task, tp[0], tp[1], offset, tag, floor,
                "an older incarnation wrote it after a newer one announced itself: a frozen "
                "or cut-off worker woke up (a zombie)" if tag is not None else
                "it has no incarnation key: written by another eosflow release (run one "
                "release per job) or not by eosflow",
            )  # fmt: skip
        return False

    def _raise(self, tp: TP, incarnation: int) -> None:
        self.floor[tp] = incarnation
        if tp in self.live_keys:
            self.live_keys[tp] = channel_key(incarnation)
