"""Dependencies point one way, router -> cluster -> worker, and the router uses only what cluster/
exports from its package."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
    return names


@pytest.mark.parametrize("layer,forbidden", [("worker", ("cluster", "router")), ("cluster", ("router",))])
def test_lower_layers_import_nothing_above_them(layer, forbidden):
    bad = [
        (str(p.relative_to(ROOT)), m)
        for p in (ROOT / layer).rglob("*.py")
        for m in imported_modules(p)
        if m.split(".")[0] in forbidden
    ]
    assert bad == []


def test_the_router_imports_only_what_cluster_exports():
    import cluster

    files = sorted((ROOT / "router").rglob("*.py"))
    assert len(files) > len(list((ROOT / "router").glob("*.py")))  # the subpackages are searched too
    bad = [(str(p.relative_to(ROOT)), m) for p in files for m in imported_modules(p) if m.startswith("cluster.")]
    assert bad == [], "import these from `cluster` (export them in cluster/__init__.py)"
    for p in files:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "cluster":
                assert all(a.name in cluster.__all__ for a in node.names), str(p.relative_to(ROOT))


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@pytest.mark.parametrize("layer", ["router", "cluster"])
def test_no_module_imports_itself_through_others(layer):
    """Imports inside functions count: a circle held apart only by a deferred import is still one."""
    modules = {_module_name(p): p for p in (ROOT / layer).rglob("*.py")}

    def target(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {
        m: {t for n in imported_modules(p) if (t := target(n)) and t != m and not modules[t].name == "__init__.py"}
        for m, p in modules.items()
    }
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            assert state.get(n) != 1, " -> ".join(path[path.index(n) :] + [m, n]) if n in path else f"{m} -> {n}"
            if n not in state:
                visit(n, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
