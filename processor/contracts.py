"""Contracts the engine defines and the other packages implement.

``processor`` never imports ``connectors``, ``sinks`` or ``dedup`` (except the CLI wiring); they
import these protocols from here. Further contracts (sources, two-phase-commit sinks, the ID store)
join this module as the engine that calls them lands.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["Serde"]


@runtime_checkable
class Serde(Protocol):
    """Encodes values to record bytes and decodes them back.

    Attributes:
        name: short label used in error messages and dead-letter headers (e.g. ``json``).

    Invariants:
        ``deserialize(serialize(x)) == x`` for every value ``x`` the serde accepts.
        ``serialize`` raises only ``SerializationError``; ``deserialize`` of any ``bytes``
        raises only ``DeserializationError``, with ``topic``, ``partition`` and ``offset``
        copied from its arguments. Serdes hold no per-record state and are thread-safe.
    """

    name: str

    def serialize(self, value: Any) -> bytes:
        """Encode ``value``; raise ``SerializationError`` if it cannot be encoded."""

    def deserialize(
        self,
        data: bytes,
        *,
        topic: str | None = None,
        partition: int | None = None,
        offset: int | None = None,
    ) -> Any:
        """Decode ``data``; raise ``DeserializationError`` (with the location) if malformed."""
