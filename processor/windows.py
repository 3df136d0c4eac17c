"""Event-time windows for keyed aggregations: :class:`Tumbling`, :class:`Sliding` and
:class:`Session`.

Windows are aligned to the epoch: a window of ``size`` starting every ``slide`` covers
``[k * slide, k * slide + size)`` in event time (epoch milliseconds). A window fires once the
watermark passes its end plus the aggregation's ``allowed_lateness``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from processor.errors import DefinitionError

__all__ = ["Session", "Sliding", "Tumbling", "duration_ms"]


_MS = timedelta(milliseconds=1)


def duration_ms(what: str, value: timedelta) -> int:
    """``value`` in whole milliseconds; ``what`` names it in the error."""
    if not isinstance(value, timedelta):
        raise DefinitionError(f"{what} must be a datetime.timedelta, got {value!r}")
    ms = value // _MS  # exact: total_seconds() * 1000 is a float (1001 ms gave 1000)
    if ms < 0:
        raise DefinitionError(f"{what} must not be negative, got {value}")
    return ms


@dataclass(frozen=True)
class Sliding:
    """Event-time windows of ``size`` starting every ``slide`` (aligned to the epoch)."""

    size: timedelta
    slide: timedelta

    def __post_init__(self) -> None:
        size, slide = duration_ms("window size", self.size), duration_ms("window slide", self.slide)
        if size <= 0 or slide <= 0:
            raise DefinitionError(f"window size and slide must be positive, got {self}")
        if size % slide:
            raise DefinitionError(
                f"window size {self.size} must be a multiple of the slide {self.slide}"
            )

    @property
    def size_ms(self) -> int:
        return duration_ms("window size", self.size)

    @property
    def slide_ms(self) -> int:
        return duration_ms("window slide", self.slide)


class Tumbling(Sliding):
    """Event-time windows of ``size`` that do not overlap."""

    def __init__(self, size: timedelta) -> None:
        super().__init__(size, size)

    def __repr__(self) -> str:
        return f"Tumbling({self.size!r})"


@dataclass(frozen=True)
class Session:
    """Gap-based windows per key: a record at ``t`` opens ``[t, t + gap)``; windows of one key
    that overlap merge (their accumulators with the aggregation's ``merge``). A session fires
    once, when the watermark reaches its end ``- 1 +`` the allowed lateness: ``gap`` after its
    last record. The same records give the same sessions in any order (the union of their
    ``[t, t + gap)`` intervals), as long as none arrives after its session fired.
    """

    gap: timedelta

    def __post_init__(self) -> None:
        if duration_ms("session gap", self.gap) <= 0:
            raise DefinitionError(f"session gap must be positive, got {self.gap}")

    @property
    def gap_ms(self) -> int:
        return duration_ms("session gap", self.gap)
