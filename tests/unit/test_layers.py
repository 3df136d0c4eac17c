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
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Callable, Iterator
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
    return module == "processor.runtime" or module.startswith("processor.runtime.")


def test_imports_point_one_way_between_the_packages() -> None:
    assert _violations(_graph()) == []


def test_no_import_cycle_passes_through_two_packages() -> None:
    assert _cross_package_cycles(_graph()) == []


def test_no_module_of_the_four_packages_is_in_an_import_cycle() -> None:
    graph = _graph()
    cycles = [f"{_describe_cycle(graph, c)} (the circle: {', '.join(c)})" for c in _cycles(graph)]
    assert not cycles, "import cycles (move the shared thing down a floor):\n" + "\n".join(cycles)


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
        ("sinks/extra.py", "from processor.runtime.runner import Runner\n", "sinks.extra"),
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
    savepoints = tmp_path / "processor" / "runtime" / "savepoints.py"
    savepoints.write_text(
        savepoints.read_text() + "\n\ndef _owner() -> None:\n"
        "    from processor.runtime.runner import Runner  # noqa: F401\n"
    )
    graph = _graph(tmp_path)
    cycles = _cycles(graph)
    assert len(cycles) == 1, cycles
    assert {"processor.runtime.runner", "processor.runtime.savepoints"} <= set(cycles[0])
    described = _describe_cycle(graph, cycles[0])
    assert "processor.runtime.savepoints (line " in described, described
    assert "processor.runtime.runner (line " in described, described


@pytest.mark.parametrize(
    ("files", "via"),
    [
        pytest.param(
            {
                "processor/streams.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                "    from processor.runtime.process import ProcessContext\n"
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
