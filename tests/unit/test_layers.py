"""Imports point one way between the four packages (docs/architecture.md, "Layers").

The rules, checked on every ``import`` statement of every module, the ones inside functions
included (a lazy import is still a dependency):

* ``dedup`` is a library of its own: it imports nothing from ``processor``, ``sinks`` or
  ``connectors``.
* ``connectors`` implements the engine's contracts: from ``processor`` it imports only
  ``processor.contracts`` and ``processor.errors``; nothing from ``sinks`` or ``dedup``.
* ``sinks`` implement the engine's contracts: they never import the engine's runtime or CLI.
* ``processor`` imports ``sinks`` and ``connectors`` only in its wiring (the CLI, the
  job-administration API it calls, ``processor.admin.jobs``, and the test kit
  ``processor.testing``, which sits on top like the CLI); it may use the ``dedup`` library
  anywhere.
* No import cycle passes through two packages (a module imports its parent packages too).
* No import cycle at all, file by file, inside the four packages (issue 36): a module that two
  others need goes down a floor (a value type, a protocol in a ``contracts.py``, a small module
  both import), never into a lazy import. A module that imports its own package (``from pkg
  import name``, ``from . import name``) depends on the package's ``__init__``; the parent
  packages that ``import pkg.sub.mod`` runs first are dependencies too, except the importer's
  own ancestors (they are being imported already).
* The public API (what ``processor/__init__.py`` imports, and what that imports in turn)
  imports nothing of ``processor.runtime``: pipeline files and the compiler see the API, the
  runtime implements it (``KeyedStream.process`` names ``processor.contracts.ProcessContext``).
* The runtime is rooms (its subpackages, :data:`ROOMS`) on a floor (its own modules): the floor
  imports no room, every room imports the floor, and a room imports only the rooms
  :data:`ROOMS` gives it, which form no cycle. Each room's ``__init__`` says in its docstring
  what it owns and what it may import, and ``processor/runtime/__init__.py`` draws the same
  directions as :data:`ROOMS` (docs/architecture.md, "The runtime's rooms").
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from itertools import pairwise
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("processor", "dedup", "sinks", "connectors")
#: The modules of ``processor`` allowed to import ``sinks`` and ``connectors``.
#: ``processor.admin.jobs`` (the job-administration API the CLI calls) deletes a job's internal
#: topics and fences its Kafka sinks' transactional ids.
WIRING = {"processor.cli", "processor.cli_jobs", "processor.admin.jobs"}
#: The test kit writes input and reads output the way a user's test does, and ``eosflow
#: certify`` runs on it: wiring too.
TEST_KIT = ("processor.testing", "processor.certify")
RUNTIME = "processor.runtime"
#: The runtime's rooms and the rooms each may import; all of them may import the floor.
ROOMS: dict[str, tuple[str, ...]] = {
    "operators": (),
    "task": ("operators",),
    "checkpoints": ("operators",),
    "shape": ("checkpoints", "operators"),
    "observe": ("checkpoints",),
    "supervision": ("observe", "shape", "checkpoints", "task", "operators"),
}
FLOOR = "the floor"


def _modules(root: Path = ROOT) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imports(path: Path, module: str, known: dict[str, Path]) -> Iterator[tuple[str, int, bool]]:
    """``(imported module, line, named)`` for every import of one of the four packages in
    ``path``; ``named``: the statement names the module, else it is a parent package that the
    import runs first."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = module.split(".")
                if not is_package:
                    anchor = anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names = [base]
            # ``from a import b`` where ``b`` is a submodule imports ``a.b``
            names += [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
        for name in names:
            if name.split(".")[0] not in PACKAGES:
                continue
            while name not in known and "." in name:
                name = name.rsplit(".", 1)[0]
            parts = name.split(".")
            for i in range(1, len(parts) + 1):  # importing a.b.c runs a and a.b first
                yield ".".join(parts[:i]), node.lineno, i == len(parts)


def _graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    known = _modules(root)
    graph: dict[str, dict[str, int]] = {}
    for module, path in known.items():
        edges = graph.setdefault(module, {})
        for target, line, named in _imports(path, module, known):
            # An ancestor that a statement does not name is already being imported (it runs
            # before its submodule): no dependency. ``from pkg import x`` in pkg.mod names pkg.
            if target != module and (named or not module.startswith(f"{target}.")):
                edges.setdefault(target, line)
    return graph


def _violations(graph: dict[str, dict[str, int]]) -> list[str]:
    bad = []
    for module, edges in graph.items():
        src = module.split(".")[0]
        for target, line in edges.items():
            dst = target.split(".")[0]
            if src == dst:
                continue
            why = None
            if src == "dedup":
                why = "dedup is a library of its own: it imports nothing from the other packages"
            elif src == "connectors" and dst != "processor":
                why = "connectors imports neither sinks nor dedup"
            elif src == "connectors" and target not in (
                "processor",
                "processor.contracts",
                "processor.errors",
            ):
                why = "connectors uses only processor.contracts and processor.errors"
            elif src == "sinks" and target.startswith(("processor.runtime", "processor.cli")):
                why = "sinks implement contracts; they never import the engine's runtime or CLI"
            elif (
                src == "processor"
                and dst in ("sinks", "connectors")
                and module not in WIRING
                and not module.startswith(tuple(f"{kit}." for kit in TEST_KIT))
            ):
                why = f"processor imports {dst} only in its wiring ({sorted(WIRING)}, {TEST_KIT})"
            if why:
                bad.append(f"{module} (line {line}) imports {target}: {why}")
    return bad


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components (Tarjan) of more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _cross_package_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The import cycles that hold modules of two or more packages."""
    return [c for c in _cycles(graph) if len({m.split(".")[0] for m in c}) > 1]


def _path(
    graph: dict[str, dict[str, int]], start: str, goal: Callable[[str], bool], within: set[str]
) -> list[str]:
    """The shortest import chain from ``start`` to a module ``goal`` accepts (``start`` itself
    not counted), through modules of ``within`` only: ``["a (line 3)", "b (line 9)", "c"]``
    reads "a imports b on line 3, b imports c on line 9"; ``[]`` if there is none."""
    parent: dict[str, str] = {}
    todo = deque([start])
    while todo:
        v = todo.popleft()
        for w in sorted(graph.get(v, {})):
            if w in parent or w not in within:
                continue
            parent[w] = v
            if goal(w):
                chain = [w]
                while chain[-1] != start or len(chain) == 1:
                    chain.append(parent[chain[-1]])
                chain.reverse()
                return [f"{m} (line {graph[m][n]})" for m, n in pairwise(chain)] + [chain[-1]]
            todo.append(w)
    return []


def _describe_cycle(graph: dict[str, dict[str, int]], component: list[str]) -> str:
    """One cycle of ``component``, e.g. ``a (line 3) -> b (line 9) -> a``."""
    first = component[0]
    return " -> ".join(_path(graph, first, lambda m: m == first, set(component)))


def _api_runtime_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    """The public API is ``processor`` (its ``__init__``) and every module it imports, however
    indirectly, short of the runtime. Each import of ``processor.runtime`` by one of them, as
    the chain of imports from ``processor`` that leads to it."""
    api = {"processor"}
    todo = ["processor"]
    while todo:
        for target in graph.get(todo.pop(), {}):
            if target not in api and not _in_runtime(target):
                api.add(target)
                todo.append(target)
    chains = []
    for module in sorted(api):
        edges = graph.get(module, {})
        for target, line in sorted(edges.items()):
            named = not any(t.startswith(f"{target}.") and n == line for t, n in edges.items())
            if _in_runtime(target) and named:  # one chain per statement: its deepest module
                head = (
                    [] if module == "processor" else _path(graph, "processor", module.__eq__, api)
                )
                chains.append(" -> ".join([*head[:-1], f"{module} (line {line})", target]))
    return chains


def _in_runtime(module: str) -> bool:
    return module == RUNTIME or module.startswith(f"{RUNTIME}.")


def _room(module: str, known: Iterable[str]) -> str | None:
    """The room of a module of the runtime (its subpackage under ``processor.runtime``), or
    :data:`FLOOR` for ``processor.runtime`` and its own modules; ``None`` outside the runtime."""
    if not _in_runtime(module):
        return None
    parts = module.split(".")
    if len(parts) == 2:
        return FLOOR
    sub = f"{RUNTIME}.{parts[2]}"
    return parts[2] if any(m.startswith(f"{sub}.") for m in known) else FLOOR


def _room_violations(
    graph: dict[str, dict[str, int]], rooms: dict[str, tuple[str, ...]]
) -> list[str]:
    """Each import between the runtime's rooms that ``rooms`` does not allow, and each room that
    ``rooms`` does not know."""
    bad = []
    unknown = {_room(m, graph) for m in graph} - {None, FLOOR, *rooms}
    for room in sorted(r for r in unknown if r is not None):
        bad.append(
            f"{RUNTIME}.{room} is a room that test_layers.ROOMS does not know: add it with the "
            "rooms it may import, and say both in its __init__ docstring"
        )
    for module, edges in sorted(graph.items()):
        src = _room(module, graph)
        if src is None or src in unknown:
            continue
        allowed = (src, FLOOR) if src == FLOOR else (src, FLOOR, *rooms[src])
        wrong: dict[tuple[int, str], str] = {}  # one per statement and room: its deepest module
        for target, line in edges.items():
            dst = _room(target, graph)
            if dst is not None and dst not in allowed and dst not in unknown:
                wrong[line, dst] = max(wrong.get((line, dst), ""), target, key=len)
        if src == FLOOR:
            rule = "the runtime's floor imports no room"
        elif rooms[src]:
            rule = f"the {src} room imports only {', '.join(rooms[src])} and the floor"
        else:
            rule = f"the {src} room imports no other room, only the floor"
        for (line, dst), target in sorted(wrong.items()):
            bad.append(
                f"{module} (line {line}) imports {target}: {rule}, not {dst}. Move what both "
                "need down to a room both may import, or change test_layers.ROOMS and the "
                "rooms' docstrings (docs/architecture.md, \"The runtime's rooms\")"
            )
    return bad


def _room_docstring_problems(root: Path = ROOT) -> list[str]:
    """Rooms without an ``__init__`` docstring saying what they may import, and a difference
    between the directions that ``processor/runtime/__init__.py`` draws and :data:`ROOMS`."""
    runtime = root / "processor" / "runtime"
    problems = []
    found = {d.name for d in runtime.iterdir() if d.is_dir() and any(d.rglob("*.py"))}
    for room in sorted(found | set(ROOMS)):
        init = runtime / room / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text())) if init.exists() else None
        if not doc or "may import" not in doc.lower():
            problems.append(
                f"{init.relative_to(root)}: no docstring saying what the room owns and may import"
            )
    doc = ast.get_docstring(ast.parse((runtime / "__init__.py").read_text())) or ""
    drawn = {}
    for line in doc.splitlines():
        room, arrow, rest = (part.strip() for part in line.partition(" -> "))
        if arrow and room in found | set(ROOMS):
            drawn[room] = tuple(r.strip() for r in rest.split(",") if not r.strip().startswith("("))
    if drawn != ROOMS:
        problems.append(
            f"processor/runtime/__init__.py draws {drawn}, test_layers.ROOMS says {ROOMS}"
        )
    return problems


def test_imports_point_one_way_between_the_packages() -> None:
    assert _violations(_graph()) == []


def test_no_import_cycle_passes_through_two_packages() -> None:
    assert _cross_package_cycles(_graph()) == []


def test_no_module_of_the_four_packages_is_in_an_import_cycle() -> None:
    graph = _graph()
    cycles = [f"{_describe_cycle(graph, c)} (the circle: {', '.join(c)})" for c in _cycles(graph)]
    assert not cycles, "import cycles (move the shared thing down a floor):\n" + "\n".join(cycles)


def test_the_runtime_rooms_import_only_the_rooms_they_may() -> None:
    bad = _room_violations(_graph(), ROOMS)
    assert not bad, "imports between the runtime's rooms:\n" + "\n".join(bad)


def test_the_runtime_rooms_form_no_cycle() -> None:
    cycles = _cycles({room: dict.fromkeys(below, 0) for room, below in ROOMS.items()})
    assert not cycles, f"ROOMS lets these rooms import each other in a circle: {cycles}"


def test_every_room_says_what_it_owns_and_may_import() -> None:
    problems = _room_docstring_problems()
    assert not problems, "\n".join(problems)


def test_the_public_api_imports_nothing_of_the_runtime() -> None:
    chains = _api_runtime_imports(_graph())
    assert not chains, "the public API imports the runtime:\n" + "\n".join(chains)


@pytest.mark.parametrize(
    ("path", "line", "expected"),
    [
        ("dedup/extra.py", "from processor.errors import ConfigError\n", "dedup.extra"),
        ("dedup/extra.py", "def f():\n    import processor.runtime.task\n", "dedup.extra"),
        ("connectors/extra.py", "from sinks import FileSink\n", "connectors.extra"),
        ("processor/runtime/x.py", "from connectors import JsonSerde\n", "processor.runtime.x"),
        (
            "sinks/extra.py",
            "from processor.runtime.supervision.runner import Runner\n",
            "sinks.extra",
        ),
    ],
)
def test_the_rule_fails_when_an_import_goes_the_wrong_way(
    tmp_path: Path, path: str, line: str, expected: str
) -> None:
    """The check itself can fail: a copy of the tree with one wrong import is refused."""
    _copy_tree(tmp_path)
    (tmp_path / path).write_text(line)
    bad = _violations(_graph(tmp_path))
    assert any(b.startswith(expected) for b in bad), bad


def test_a_cycle_through_two_packages_is_found(tmp_path: Path) -> None:
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "sinks" / "a.py").write_text("import connectors.b\n")
    (tmp_path / "connectors" / "b.py").write_text("from sinks import a\n")
    assert _cross_package_cycles(_graph(tmp_path)) == [["connectors.b", "sinks.a"]]


def _copy_tree(root: Path) -> None:
    """The four packages, copied under ``root``."""
    for package in PACKAGES:
        for src in (ROOT / package).rglob("*.py"):
            dst = root / src.relative_to(ROOT)
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text(src.read_text())


def _small_tree(root: Path, files: dict[str, str]) -> None:
    """The four packages with empty ``__init__`` files, plus ``files`` (path -> text)."""
    for package in PACKAGES:
        (root / package).mkdir()
        (root / package / "__init__.py").write_text("")
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        pytest.param(
            {"processor/a.py": "import processor.b\n", "processor/b.py": "import processor.a\n"},
            ["processor.a", "processor.b"],
            id="two-files",
        ),
        pytest.param(
            {
                "processor/a.py": "import processor.b\n",
                "processor/b.py": "def f() -> None:\n    from processor.a import A\n",
            },
            ["processor.a", "processor.b"],
            id="hidden-in-a-lazy-import",
        ),
        pytest.param(
            {
                "sinks/a.py": "from sinks.b import B\n",
                "sinks/b.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                "    from sinks.a import A\n",
            },
            ["sinks.a", "sinks.b"],
            id="for-type-checking-only",
        ),
        pytest.param(
            {
                "sinks/k/__init__.py": "",
                "sinks/k/records.py": "from sinks.k.sink import KafkaSink\n",
                "sinks/k/sink.py": "from sinks.k.writer import Writer\n",
                "sinks/k/writer.py": "from sinks.k.records import encode\n",
            },
            ["sinks.k.records", "sinks.k.sink", "sinks.k.writer"],
            id="three-files",
        ),
        pytest.param(
            {
                "processor/sub/__init__.py": "from processor.sub.a import A\n",
                "processor/sub/a.py": "from processor.sub import b\n",
                "processor/sub/b.py": "",
            },
            ["processor.sub", "processor.sub.a"],
            id="from-its-own-package",
        ),
        pytest.param(
            {
                "dedup/sub/__init__.py": "from .a import A\n",
                "dedup/sub/a.py": "from . import b\n",
                "dedup/sub/b.py": "",
            },
            ["dedup.sub", "dedup.sub.a"],
            id="relative-from-its-own-package",
        ),
    ],
)
def test_a_file_level_cycle_is_found_when_modules_import_each_other(
    tmp_path: Path, files: dict[str, str], expected: list[str]
) -> None:
    _small_tree(tmp_path, files)
    graph = _graph(tmp_path)
    assert _cycles(graph) == [expected]
    described = _describe_cycle(graph, expected)
    assert described.startswith(f"{expected[0]} (line ") and described.endswith(expected[0])
    assert all(m in described for m in expected), described


def test_no_cycle_is_found_when_a_package_imports_modules_that_import_siblings(
    tmp_path: Path,
) -> None:
    """``import processor.sub.b`` in ``processor.sub.a`` runs ``processor.sub`` first, which is
    already being imported: not a dependency of ``a`` on its package."""
    _small_tree(
        tmp_path,
        {
            "processor/__init__.py": "from processor.sub import A\n",
            "processor/errors.py": "",
            "processor/sub/__init__.py": "from processor.sub.a import A\n",
            "processor/sub/a.py": "import processor.errors\nfrom processor.sub.b import B\n",
            "processor/sub/b.py": "from processor.errors import Error\n",
        },
    )
    assert _cycles(_graph(tmp_path)) == []


def test_a_cycle_added_to_the_tree_is_found_and_shown(tmp_path: Path) -> None:
    """A circle this issue removed (the runner and its savepoint requests), brought back."""
    _copy_tree(tmp_path)
    savepoints = tmp_path / "processor" / "runtime" / "shape" / "savepoints.py"
    savepoints.write_text(
        savepoints.read_text() + "\n\ndef _owner() -> None:\n"
        "    from processor.runtime.supervision.runner import Runner  # noqa: F401\n"
    )
    graph = _graph(tmp_path)
    cycles = _cycles(graph)
    assert len(cycles) == 1, cycles
    assert {
        "processor.runtime.supervision.runner",
        "processor.runtime.shape.savepoints",
    } <= set(cycles[0])
    described = _describe_cycle(graph, cycles[0])
    assert "processor.runtime.shape.savepoints (line " in described, described
    assert "processor.runtime.supervision.runner (line " in described, described


@pytest.mark.parametrize(
    ("files", "via"),
    [
        pytest.param(
            {
                "processor/streams.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                "    from processor.runtime.operators.process import ProcessContext\n"
            },
            "processor.streams (line ",
            id="for-type-checking-only",
        ),
        pytest.param(
            {"processor/windows.py": "def f() -> None:\n    import processor.runtime.operators\n"},
            "processor.windows (line ",
            id="lazy",
        ),
        pytest.param(
            {
                "processor/steps.py": "import processor.extra\n",
                "processor/extra.py": "from processor.runtime.job import RunOptions\n",
            },
            "processor.extra (line ",
            id="through-a-module-the-api-imports",
        ),
    ],
)
def test_an_import_of_the_runtime_by_the_public_api_is_found(
    tmp_path: Path, files: dict[str, str], via: str
) -> None:
    _copy_tree(tmp_path)
    assert _api_runtime_imports(_graph(tmp_path)) == []
    for path, text in files.items():
        target = tmp_path / path
        target.write_text((target.read_text() + "\n\n" if target.exists() else "") + text)
    chains = _api_runtime_imports(_graph(tmp_path))
    assert len(chains) == 1, chains
    assert chains[0].startswith("processor (line ") and via in chains[0], chains
    assert chains[0].rsplit(" -> ", 1)[1].startswith("processor.runtime."), chains


@pytest.mark.parametrize(
    ("path", "line", "expected"),
    [
        pytest.param(
            "processor/runtime/task/chain.py",
            "from processor.runtime.checkpoints.coordinator import CheckpointCoordinator\n",
            "processor.runtime.task.chain (line ",
            id="the-task-knows-the-coordinator",
        ),
        pytest.param(
            "processor/runtime/job.py",
            "def f() -> None:\n    from processor.runtime.supervision.runner import Runner\n",
            "processor.runtime.job (line ",
            id="lazy-from-the-floor",
        ),
        pytest.param(
            "processor/runtime/topics.py",
            "from processor.runtime import observe\n",
            "processor.runtime.topics (line ",
            id="a-room-named-by-from-import",
        ),
        pytest.param(
            "processor/runtime/operators/core.py",
            "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
            "    from processor.runtime.task.channels import TaskEnv\n",
            "processor.runtime.operators.core (line ",
            id="for-type-checking-only",
        ),
        pytest.param(
            "processor/runtime/observe/metrics.py",
            "from ..supervision.health import stuck_worker\n",
            "processor.runtime.observe.metrics (line ",
            id="relative-upwards",
        ),
        pytest.param(
            "processor/runtime/checkpoints/drain.py",
            "import processor.runtime.shape.topology\n",
            "processor.runtime.checkpoints.drain (line ",
            id="sideways",
        ),
        pytest.param(
            "processor/runtime/extra/mod.py",
            "",
            "processor.runtime.extra is a room that test_layers.ROOMS does not know",
            id="an-unknown-room",
        ),
    ],
)
def test_the_room_rule_fails_when_a_room_imports_one_it_may_not(
    tmp_path: Path, path: str, line: str, expected: str
) -> None:
    """The check itself can fail: a copy of the tree with one import between rooms that
    :data:`ROOMS` does not allow (or a room it does not know) is refused."""
    _copy_tree(tmp_path)  # passes as the tree does (test_the_runtime_rooms_import_only_...)
    target = tmp_path / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text((target.read_text() + "\n\n" if target.exists() else "") + line)
    bad = _room_violations(_graph(tmp_path), ROOMS)
    assert len(bad) == 1 and bad[0].startswith(expected), bad


def test_a_cycle_between_rooms_is_found() -> None:
    rooms = {**ROOMS, "operators": ("task",)}
    graph = {room: dict.fromkeys(below, 0) for room, below in rooms.items()}
    assert _cycles(graph) == [["operators", "task"]]


@pytest.mark.parametrize(
    ("path", "text", "expected"),
    [
        pytest.param("processor/runtime/observe/__init__.py", "", "observe", id="no-docstring"),
        pytest.param(
            "processor/runtime/shape/__init__.py",
            '"""The shape room."""\n',
            "shape",
            id="silent-on-imports",
        ),
        pytest.param("processor/runtime/extra/mod.py", "", "extra/__init__.py", id="no-init"),
        pytest.param(
            "processor/runtime/__init__.py",
            '"""The runtime::\n\n    task  -> operators, checkpoints\n"""\n',
            "processor/runtime/__init__.py draws",
            id="drawn-otherwise",
        ),
    ],
)
def test_a_room_that_does_not_say_what_it_may_import_is_found(
    tmp_path: Path, path: str, text: str, expected: str
) -> None:
    _copy_tree(tmp_path)
    (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / path).write_text(text)
    problems = _room_docstring_problems(tmp_path)
    assert len(problems) == 1 and expected in problems[0], problems
