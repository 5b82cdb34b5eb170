"""The package's layers: every import points down, and no module imports itself back.

Every ``import`` and ``from ... import`` statement of ``placement/`` and ``solvers/`` counts,
wherever it stands (module level, inside a function: lazy imports, under ``TYPE_CHECKING``) and
relative ones resolved against their package.  A module importing ``pkg`` (a package) depends on
``pkg/__init__.py``; ``from pkg import sub`` on ``pkg.sub`` as well.  The circle test follows the
graph transitively (strongly connected components); the layer test checks each edge against the
order the README and docs/development.md describe.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Bottom first: a module may import its own layer or any layer below it, never one above.
LAYERS: list[tuple[str, ...]] = [
    ("placement.core",),
    ("placement.formats",),
    ("placement.predict",),
    ("placement.sources",),
    ("solvers",),
    ("placement.consumers",),
    ("placement.app",),
    ("placement.api",),
    ("placement.plan",),
    ("placement.cli",),
    ("placement",),
]


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in ("placement", "solvers"):
        for f in (ROOT / pkg).rglob("*.py"):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = f
    return mods


def import_graph(mods: dict[str, Path]) -> nx.DiGraph:
    """Edges module -> module it imports (only this project's modules)."""
    g = nx.DiGraph()
    g.add_nodes_from(mods)
    for m, f in mods.items():
        package = m if f.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(f.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            for n in names:
                while n and n not in mods:
                    n = n.rsplit(".", 1)[0] if "." in n else ""
                if n and n != m:
                    g.add_edge(m, n)
    return g


def _layer(module: str) -> int:
    best, index = -1, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, index = len(p), i
    return index


def test_the_graph_sees_lazy_relative_and_type_checking_imports(tmp_path):
    pkg = tmp_path / "placement"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("def f():\n    from . import b\n")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from placement.sub.c import X\n")
    (pkg / "sub" / "c.py").write_text("import placement.sub.a\n")
    mods = {}
    for f in pkg.rglob("*.py"):
        parts = list(f.relative_to(tmp_path).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f
    g = import_graph(mods)
    assert {("placement.sub.a", "placement.sub.b"), ("placement.sub.b", "placement.sub.c"),
            ("placement.sub.c", "placement.sub.a")} <= set(g.edges)
    assert [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1] == [
        ["placement.sub.a", "placement.sub.b", "placement.sub.c"]]


def test_no_import_circles():
    g = import_graph(_modules())
    circles = [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]
    assert circles == [], f"import circles: {circles}"


def test_imports_point_down():
    g = import_graph(_modules())
    up = [(a, b) for a, b in g.edges if _layer(b) > _layer(a)]
    assert up == [], f"imports that point up a layer: {up}"
    assert all(_layer(m) >= 0 for m in g.nodes), [m for m in g.nodes if _layer(m) < 0]


def test_the_peer_baselines_import_nothing_of_our_search():
    g = import_graph(_modules())
    for peer in ("solvers.kahypar", "solvers.eplb", "solvers.packed", "solvers.default"):
        reached = nx.descendants(g, peer)
        # Shared steps, not search: a layer's nets and loads (problem), the within-domain balancing
        # every solver's expert maps end with (balance) and the search's constants (tuning).
        shared = ("solvers.experts.problem", "solvers.experts.balance", "solvers.experts.tuning")
        ours = sorted(m for m in reached if m.startswith(("solvers.experts", "solvers.layout", "solvers.cpsat"))
                      and m not in shared)
        assert ours == [], f"{peer} reaches our search: {ours}"


@pytest.mark.parametrize("old, new", [
    ("placement.cost", "placement.predict.cost"),
    ("placement.runtime", "placement.consumers.runtime"),
    ("placement.checkpoint.dcp", "placement.consumers.checkpoint.dcp"),
    ("placement.plan.job", "placement.formats.job"),
    ("placement.controller", "placement.plan.controller"),
])
def test_old_module_paths_are_the_same_modules(old, new):
    assert importlib.import_module(old) is importlib.import_module(new)


def test_every_moved_path_resolves():
    from placement import _moved

    for old, new in _moved.MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
