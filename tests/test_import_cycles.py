"""The `portside` package's import graph has no cycle (docs/architecture.md, "Imports").

The graph is built with `ast` from every import statement of core/ and backends/, function-level
ones included (a function-level import that closes a cycle only hides it); imports under
`if TYPE_CHECKING:` are skipped (they never run). Optional heavy dependencies may still be
imported in functions: they are outside the package and so outside this graph.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ((ROOT / "core", "portside"), (ROOT / "backends", "portside.backends"))


def _modules() -> dict[str, Path]:
    found = {}
    for folder, package in SOURCES:
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _statements(body: list[ast.stmt]):
    """Every import statement that can run: nested bodies walked, `if TYPE_CHECKING:` left out."""
    for node in body:
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from _statements(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
            continue
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                yield from _statements([child])
            elif isinstance(child, ast.excepthandler):
                yield from _statements(child.body)


def _owner(name: str) -> str | None:
    """The package module `name` lives in (an attribute `a.b.C` belongs to module `a.b`)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imported(module: str, path: Path) -> dict[str, int]:
    """The package modules `module` imports, with the first line that does."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: dict[str, int] = {}
    for node in _statements(ast.parse(path.read_text(), filename=str(path)).body):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" for a in node.names]
        for name in names:
            target = _owner(name)
            if target and target != module:
                out.setdefault(target, node.lineno)
    return out


def import_graph() -> dict[str, dict[str, int]]:
    return {m: _imported(m, p) for m, p in MODULES.items()}


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph[nxt])))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        comp.append(top)
                        if top == node:
                            break
                    if len(comp) > 1:
                        components.append(comp)
    return [_one_cycle(graph, set(c)) for c in components]


def _one_cycle(graph: dict[str, dict[str, int]], members: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first inside it)."""
    start = min(members)
    parent: dict[str, str] = {}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in graph[node]:
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [start, *reversed(path[:-1]), start] if node != start else [start, start]
            if nxt in members and nxt not in parent:
                parent[nxt] = node
                queue.append(nxt)
    return sorted(members)


def _describe(graph: dict[str, dict[str, int]], cycle: list[str]) -> str:
    steps = [f"{a} (line {graph[a][b]}) -> {b}" for a, b in zip(cycle, cycle[1:])]
    return "  " + "\n  ".join(steps)


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    cycles = find_cycles(graph)
    assert not cycles, "import cycles in portside (each shown as one loop; break it at a seam):\n" + "\n\n".join(
        _describe(graph, c) for c in cycles)


@pytest.mark.parametrize("edges, expected", [
    ({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}}, 1),
    ({"a": {"b": 1}, "b": {}, "c": {"a": 1}}, 0),
    ({"a": {"b": 1}, "b": {"a": 1}, "c": {"d": 1}, "d": {"c": 1}}, 2),
])
def test_the_cycle_finder_finds_cycles(edges, expected):
    cycles = find_cycles(edges)
    assert len(cycles) == expected
    for cycle in cycles:
        assert cycle[0] == cycle[-1] and all(b in edges[a] for a, b in zip(cycle, cycle[1:]))


def test_function_level_and_relative_imports_are_edges(tmp_path):
    """What the graph reads: an import inside a function counts; one under TYPE_CHECKING does not."""
    path = tmp_path / "m.py"
    path.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from portside.config import X\n"
                    "def f():\n    from portside.engine import llm_engine\n    from . import outputs\n")
    assert set(_imported("portside.request", path)) == {"portside.engine.llm_engine", "portside.outputs"}
