"""No import circle in the tree: every import of every module of deltad, bench, trainer and
consumers (at module level, under TYPE_CHECKING, or inside a function) is an edge, and the
graph of the project's own modules has no cycle (issue 37: three two-file circles)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("deltad", "bench", "trainer", "consumers")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            parts = p.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = p
    return out


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports anywhere in its file (``from pkg import sub`` is an
    edge to ``pkg.sub`` when that is a module, else to ``pkg``)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                if path.name != "__init__.py":
                    base = base[:-1]
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            subs = {f"{mod}.{a.name}" for a in node.names} & known.keys()
            out.update(subs)
            if len(subs) < len(node.names):
                out.add(mod)
    return {m for m in out if m in known and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_tree_has_no_import_circle() -> None:
    known = _modules()
    graph = {n: _imports(n, p, known) for n, p in known.items()}
    assert len(graph) > 100  # (the walk found the tree)
    assert _cycles(graph) == []


def test_the_walk_sees_a_circle_through_a_function_level_import(tmp_path: Path) -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    known = {"deltad.x": tmp_path / "x.py", "deltad.y": tmp_path / "y.py"}
    known["deltad.x"].write_text("def f():\n    from deltad import y\n")
    known["deltad.y"].write_text("from deltad.x import f\n")
    assert _imports("deltad.x", known["deltad.x"], known) == {"deltad.y"}
    assert _imports("deltad.y", known["deltad.y"], known) == {"deltad.x"}
