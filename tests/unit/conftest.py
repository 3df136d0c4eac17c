"""Fixtures of the unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import dedup.native


@pytest.fixture(params=["c", "python"])
def dedup_paths(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Runs a test with the dedup step's C accelerator (:mod:`dedup.native`, skipped where it
    is not built) and with the pure-Python path (as under ``EOSFLOW_NATIVE=0``): both must
    decide alike."""
    if request.param == "c" and dedup.native.native is None:
        pytest.skip("dedup/_native.c is not built (or EOSFLOW_NATIVE=0)")
    if request.param == "python":
        monkeypatch.setattr(dedup.native, "native", None)
    yield request.param
