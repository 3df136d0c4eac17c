"""The dedup step's C accelerator (``dedup/_native.c``), where it was built.

``pip install`` compiles it when the machine has a C compiler (``setup.py``; the build is optional,
so an install without one still succeeds). With it, the per-key ``dedup`` step computes a batch's
IDs and probes its Bloom filters in one C call each, instead of a Python call per record and
filter: about 0.3 us per record for the ID instead of 0.7, and a few dozen ns for the probes
instead of 0.2-0.3 us per filter (``bench/dedup_step.py``).

It computes exactly what the pure-Python path computes: the same IDs
(:func:`dedup.ids.pair_id`) and the same filter bits (rbloom's layout and hashing,
:class:`NativeBloom`), so snapshots, savepoints and rescaling merges move freely between
processes with and without it (``tests/unit/test_native.py`` checks both against the Python
path).

``EOSFLOW_NATIVE=0`` in the environment turns it off (the pure-Python path, for comparison or
to rule it out).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any

__all__ = ["NativeBloom", "describe", "native"]


def _load() -> tuple[ModuleType | None, str]:
    if os.environ.get("EOSFLOW_NATIVE", "1") == "0":
        return None, "off (EOSFLOW_NATIVE=0)"
    try:  # by name: type checkers need not find the compiled module
        module = importlib.import_module("dedup._native")
    except ImportError as exc:  # not built (no compiler at install)
        return None, (
            f"not built ({exc}): the pure-Python path, about half as fast per record; "
            "reinstall eosflow on a machine with a C compiler (gcc and the Python headers)"
        )
    return module, "on (dedup/_native.c)"


#: The C module, or ``None`` (not built, or ``EOSFLOW_NATIVE=0``).
native, _STATE = _load()


def describe() -> str:
    """Whether the C accelerator runs, and if not why (for the workers' logs)."""
    if native is None and _STATE.startswith("on"):  # turned off in this process (tests, benches)
        return "off"
    return _STATE


class NativeBloom:
    """A Bloom filter held as rbloom 1.5 holds it (``k`` hashes over a bit array; rbloom's
    ``save_bytes`` is ``k`` as 8 little-endian bytes and then the bits), probed and filled in C.

    It offers what :class:`dedup.buckets.BloomBuckets` uses of an rbloom ``Bloom`` whose hash
    is ``int.__index__``, with the same bits for the same IDs: ``save_bytes`` of one loads into
    the other.
    """

    __slots__ = ("bits", "k")

    def __init__(self, k: int, bits: bytearray) -> None:
        if k < 1 or not bits:
            raise ValueError(f"a filter needs k >= 1 and bits, got k={k}, {len(bits)} bytes")
        self.k = k
        self.bits = bits

    @classmethod
    def load_bytes(cls, data: bytes) -> NativeBloom:
        """From rbloom's ``save_bytes`` (or :meth:`save_bytes`)."""
        if len(data) < 9:
            raise ValueError(f"a saved Bloom filter has at least 9 bytes, got {len(data)}")
        return cls(int.from_bytes(data[:8], "little"), bytearray(memoryview(data)[8:]))

    def save_bytes(self) -> bytes:
        return self.k.to_bytes(8, "little") + self.bits

    @property
    def size_in_bits(self) -> int:
        return len(self.bits) * 8

    def __contains__(self, record_id: int) -> bool:
        assert native is not None
        return bool(native.bloom_contains(self.bits, self.k, record_id))

    def update(self, ids: list[int]) -> None:
        assert native is not None
        native.bloom_add(self.bits, self.k, ids if type(ids) is list else list(ids))

    def copy(self) -> NativeBloom:
        return NativeBloom(self.k, bytearray(self.bits))

    def __ior__(self, other: Any) -> NativeBloom:
        if (
            not isinstance(other, NativeBloom)
            or other.k != self.k
            or len(other.bits) != len(self.bits)
        ):
            raise ValueError("size and max false positive rate must be the same for both filters")
        assert native is not None
        native.bloom_or(self.bits, other.bits)
        return self
