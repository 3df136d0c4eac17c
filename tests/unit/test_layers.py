"""Imports point one way between the four packages (docs/architecture.md, "Layers").

The rules, checked on every ``import`` statement of every module, the ones inside functions
included (a lazy import is still a dependency):

* ``dedup`` is a library of its own: it imports nothing from ``processor``, ``sinks`` or
  ``connectors``.
* ``connectors`` implements the engine's contracts: from ``processor`` it imports only
  ``processor.contracts`` and ``processor.errors``; nothing from ``sinks`` or ``dedup``.
* ``sinks`` implement the engine's contracts: they never import the engine's runtime or CLI.
* ``processor`` imports ``sinks`` and ``connectors`` only in its wiring (the CLI, and the test kit
  ``processor.testing``, which sits on top like the CLI); it may use the ``dedup`` library
  anywhere.
* No import cycle passes through two packages (a module imports its parent packages too).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("processor", "dedup", "sinks", "connectors")
#: The modules of ``processor`` allowed to import ``sinks`` and ``connectors``.
WIRING = {"processor.cli", "processor.cli_jobs"}
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


def _imports(path: Path, module: str, known: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """``(imported module, line)`` for every import of one of the four packages in ``path``."""
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
                yield ".".join(parts[:i]), node.lineno


def _graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    known = _modules(root)
    graph: dict[str, dict[str, int]] = {}
    for module, path in known.items():
        edges = graph.setdefault(module, {})
        for target, line in _imports(path, module, known):
            if target != module and not module.startswith(f"{target}."):
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


def _cross_package_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components (Tarjan) that hold modules of two or more packages."""
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
            if len({m.split(".")[0] for m in component}) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_imports_point_one_way_between_the_packages() -> None:
    assert _violations(_graph()) == []


def test_no_import_cycle_passes_through_two_packages() -> None:
    assert _cross_package_cycles(_graph()) == []


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
    for package in PACKAGES:
        for src in (ROOT / package).rglob("*.py"):
            dst = tmp_path / src.relative_to(ROOT)
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text(src.read_text())
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
