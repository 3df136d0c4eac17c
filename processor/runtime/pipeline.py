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
            f"loading pipeline {str(path)!r} failed: {_where(exc, file)}"
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


def _where(exc: BaseException, file: Path) -> str:
    """``exc`` as Python prints its last line (with its "Did you mean ...?"), after the line of
    the pipeline file that raised it, ``FILE:LINE: code`` (issue 50: a ``NameError`` lost both)."""
    import traceback

    what = "".join(traceback.format_exception_only(exc)).strip() + _suggestion(exc)
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename) == file]
    if not frames:
        return what
    last = frames[-1]
    code = f": {last.line.strip()}" if last.line else ""
    return f"{last.filename}:{last.lineno}{code}: {what}"


def _suggestion(exc: BaseException) -> str:
    """Python's "Did you mean" for a ``NameError`` or ``AttributeError``: in Python 3.11 only
    the interpreter's own printing adds it, not the ``traceback`` module."""
    import builtins
    import difflib

    name = getattr(exc, "name", None)
    if not isinstance(name, str):
        return ""
    if isinstance(exc, NameError):
        tb = exc.__traceback__
        if tb is None:
            return ""
        while tb.tb_next is not None:
            tb = tb.tb_next
        frame = tb.tb_frame
        candidates = [*frame.f_locals, *frame.f_globals, *dir(builtins)]
    elif isinstance(exc, AttributeError) and getattr(exc, "obj", None) is not None:
        candidates = dir(exc.obj)
    else:
        return ""
    close = difflib.get_close_matches(name, [c for c in candidates if c != name], n=1)
    return f". Did you mean: {close[0]!r}?" if close else ""


def load_object(spec: str) -> Any:
    """``"package.module:attribute"`` -> the attribute (the runner's wiring of plug-ins)."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ConfigError(f"{spec!r} is not of the form package.module:attribute")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot load {spec!r}: {exc}") from exc
