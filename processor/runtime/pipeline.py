"""Loading a pipeline file and the pluggable parts named in a job's configuration."""

from __future__ import annotations

import importlib
import runpy
import sys
from pathlib import Path
from typing import Any

from processor.dataflow import Dataflow
from processor.errors import ConfigError, DefinitionError
from processor.runtime.redirect import Rewrite, apply

__all__ = ["load_flow", "load_object"]


def load_flow(path: str | Path) -> Dataflow:
    """The ``Dataflow`` defined by the Python file ``path``.

    The file is run as a module named ``eosflow_pipeline`` (so its ``if __name__ ==
    "__main__":`` block does not run) with its directory on ``sys.path``. It must define a
    module-level ``flow`` or exactly one ``Dataflow``. Every worker loads the file again: build
    the dataflow at import time, without side effects.
    """
    file = Path(path).resolve()
    if not file.is_file():
        raise ConfigError(f"pipeline file {str(path)!r} does not exist")
    folder = str(file.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        namespace = runpy.run_path(str(file), run_name="eosflow_pipeline")
    except (DefinitionError, ConfigError):
        raise
    except Exception as exc:
        raise DefinitionError(
            f"loading pipeline {str(path)!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    flow = namespace.get("flow")
    if not isinstance(flow, Dataflow):
        flows = [v for v in namespace.values() if isinstance(v, Dataflow)]
        if len(flows) != 1:
            raise DefinitionError(
                f"pipeline {str(path)!r} defines {len(flows)} Dataflow objects: name the one to "
                "run `flow` at module level"
            )
        flow = flows[0]
    rewrite = Rewrite.from_env()  # an eosflow certify run: its own job, inputs and outputs
    return flow if rewrite is None else apply(flow, rewrite)


def load_object(spec: str) -> Any:
    """``"package.module:attribute"`` -> the attribute (the runner's wiring of plug-ins)."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ConfigError(f"{spec!r} is not of the form package.module:attribute")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot load {spec!r}: {exc}") from exc
