"""What a dataflow is made of: named steps, and what the builders of steps share.

:class:`Step` is the compiler's input and what the runtime's operators read; the builders of the
public API make them: :class:`~processor.dataflow.Dataflow` (sources, the graph, validation)
and the streams of :mod:`processor.streams` (every other step). Streams know their dataflow by
the :class:`StepGraph` protocol: this floor is what the two modules share, and neither imports
the other back.

Also here: the check every builder applies to a user function (:func:`user_fn`), and
the parameters of keyed steps (the choices of ``how``, ``late`` and ``emit``; the functions
``count`` and ``reduce`` give their aggregation).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from processor.errors import DefinitionError
from processor.windows import Session, Sliding

__all__ = [
    "DEAD_LETTERS",
    "EMIT",
    "JOINS",
    "LATE",
    "Reducer",
    "Step",
    "StepGraph",
    "descends",
    "emit_mode",
    "plus_one",
    "sum_counts",
    "unset",
    "user_fn",
    "zero",
]

#: The step name of the dead-letter destination (reserved: no step may use it).
DEAD_LETTERS = "dead-letters"


@dataclass
class Step:
    """One named step of a dataflow (the compiler's input; users build them through streams).

    Attributes:
        name: stable kebab-case identifier.
        kind: ``source``, ``map``, ``filter``, ``flat_map``, ``key_by``, ``aggregate``,
            ``process``, ``dedup``, ``union``, ``join`` (two parents), ``to_table``,
            ``iterate`` (a loop head; ``params["feedback"]`` names the step whose output is fed
            back to it) or ``sink``.
        parents: names of the steps feeding this one.
        keyed: the step's output is keyed (partitioned by key after a shuffle or ``key_by``).
        params: kind-specific settings (functions, serde, window...).
    """

    name: str
    kind: str
    parents: tuple[str, ...]
    keyed: bool
    params: dict[str, Any] = field(default_factory=dict)


class StepGraph(Protocol):
    """The dataflow as its streams see it (:class:`~processor.dataflow.Dataflow` implements
    it): a name, its steps by name, the loops whose body is being built, and the one way in
    for a new step (``_add`` checks its name)."""

    name: str
    steps: dict[str, Step]
    _open_loops: list[str]

    def _add(self, step: Step) -> Step: ...


def user_fn(step: str, what: str, fn: Any, *, optional: bool = False) -> Any:
    """The user function ``fn`` given as ``what`` of step ``step``, checked: callable (or
    ``None`` when ``optional``), else a ``DefinitionError`` naming the step."""
    if fn is None and optional:
        return None
    if not callable(fn):
        raise DefinitionError(f"step {step!r}: {what} must be callable, got {fn!r}")
    return fn


def descends(flow: StepGraph, step: str, ancestor: str) -> bool:
    """Whether step ``step`` of ``flow`` is ``ancestor`` or fed by it, however indirectly."""
    todo, seen = [step], set()
    while todo:
        name = todo.pop()
        if name == ancestor:
            return True
        if name not in seen:
            seen.add(name)
            todo.extend(flow.steps[name].parents)
    return False


# -- the parameters of keyed steps ------------------------------------------------------------

#: What a join keeps of a record without a partner: ``inner`` drops it, ``left`` keeps it.
JOINS = ("inner", "left")

#: What a windowed aggregation does with a record all of whose windows have closed.
LATE = ("drop", "dead_letters")
#: When a windowed aggregation emits: once per window when it closes, or on every update.
EMIT = ("close", "update")


def emit_mode(name: str, emit: str | None, window: Sliding | Session | None) -> str:
    """``emit`` checked; what the step emits: ``close`` or ``update``."""
    if emit is None:
        return "close" if window is not None else "update"
    if emit not in EMIT:
        raise DefinitionError(f"step {name!r}: emit must be one of {EMIT}, got {emit!r}")
    if window is None:
        raise DefinitionError(
            f"step {name!r}: emit={emit!r} chooses when a windowed aggregation emits; an "
            "aggregation without a window emits its running result after every record: drop "
            "emit or give a window"
        )
    if emit == "update" and isinstance(window, Session):
        raise DefinitionError(
            f"step {name!r}: emit='update' is not supported with session windows: merging two "
            "sessions would need to retract the updates emitted for each; use emit='close' "
            "(one result per session) or a Tumbling/Sliding window"
        )
    return emit


_UNSET = "__eosflow_unset__"


def zero() -> int:
    """``count``'s ``init``."""
    return 0


def plus_one(acc: int, _value: Any) -> int:
    """``count``'s ``add``."""
    return acc + 1


def sum_counts(a: int, b: int) -> int:
    """``count``'s ``merge``."""
    return a + b


def unset() -> str:
    """``reduce``'s ``init``: an accumulator that the first value replaces (:class:`Reducer`)."""
    return _UNSET


class Reducer:
    """``reduce`` as an aggregation: the first value replaces the unset accumulator."""

    def __init__(self, fn: Callable[[Any, Any], Any]) -> None:
        self.fn = fn

    def __call__(self, acc: Any, value: Any) -> Any:
        if isinstance(acc, str) and acc == _UNSET:
            return value
        if isinstance(value, str) and value == _UNSET:
            return acc
        return self.fn(acc, value)
