"""The package graph points down: no circle of imports between pdserve's parts (``pdserve.<part>``, a folder or a
module of its own), counting every import in the code — at the top of a module, inside a function, or for
type checking only."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pdserve

PACKAGE = Path(pdserve.__file__).parent


def part_of(module: str) -> str | None:
    """``pdserve.engine.scheduler`` -> ``engine``; ``pdserve.messages`` -> ``messages``; other roots -> None."""
    names = module.split(".")
    return names[1] if names[0] == "pdserve" and len(names) > 1 else None


def imports_between_parts() -> dict[tuple[str, str], list[str]]:
    """(importing part, imported part) -> where: ``file:line``, for every import that crosses between two parts."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent)
        module = ".".join(relative.with_suffix("").parts)
        here = part_of(module)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                there = part_of(target)
                is_part = there is not None and ((PACKAGE / there).is_dir() or (PACKAGE / f"{there}.py").exists())
                if here and is_part and there != here:
                    edges[(here, str(there))].append(f"{relative}:{node.lineno}")
    return edges


def circles(edges: dict[tuple[str, str], list[str]]) -> list[list[str]]:
    """The strongly connected components of more than one part (Tarjan)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_circle_between_parts():
    edges = imports_between_parts()
    assert ("router", "engine") in edges  # the scan sees imports at all
    found = circles(edges)
    detail = [
        f"{a} -> {b}: {', '.join(where[:3])}"
        for component in found
        for (a, b), where in sorted(edges.items())
        if a in component and b in component
    ]
    assert not found, "import circles between parts:\n" + "\n".join(detail)


def test_a_circle_is_found():
    edges = {("a", "b"): ["a.py:1"], ("b", "c"): ["b.py:1"], ("c", "a"): ["c.py:1"], ("c", "d"): ["c.py:2"]}
    assert circles(edges) == [["a", "b", "c"]]
    assert circles({("a", "b"): ["a.py:1"]}) == []
