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
    bad = [(p.name, m) for p in (ROOT / layer).rglob("*.py") for m in imported_modules(p)
           if m.split(".")[0] in forbidden]
    assert bad == []


def test_the_router_imports_only_what_cluster_exports():
    import cluster
    bad = [(p.name, m) for p in (ROOT / "router").glob("*.py") for m in imported_modules(p)
           if m.startswith("cluster.")]
    assert bad == [], "import these from `cluster` (export them in cluster/__init__.py)"
    for p in (ROOT / "router").glob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "cluster":
                assert all(a.name in cluster.__all__ for a in node.names), p.name
