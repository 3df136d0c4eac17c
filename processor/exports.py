"""A package's public names imported on first use (PEP 562).

A pipeline file imports ``from sinks import FileSink``; the runner and every worker load it. A
package ``__init__`` that imported all its modules at once made every process pay for the ones
it never uses (redis-py for ``RedisSink``, the whole certify kit): about 30-50 ms of each
process's start-up (bench/RESULTS.md, "Start-up and shut-down"). Such a package lists where
each name lives and installs the two module hooks::

    __getattr__, __dir__ = lazy_exports(__name__, {"FileSink": "sinks.files", ...})
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, homes: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of ``package``: a name of ``homes``
    (name -> the module that defines it) is imported at its first use and kept in the
    package, so later uses cost nothing."""
    module = sys.modules[package]

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        setattr(module, name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(module)) | set(homes))

    return __getattr__, __dir__
