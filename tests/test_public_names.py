"""Benchmarks and the notebooks' helpers use public names only: every name they import from
``placement`` or ``solvers`` is in that module's ``__all__`` (read with ast, lazy imports count),
the notebooks' helpers import no solver module, and no benchmark calls a registered solver
directly (``SOLVERS[...]``) instead of going through ``placement.solve`` and its budget."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CALLERS = sorted((ROOT / "benchmarks").glob("*.py")) + [ROOT / "notebooks" / "_common.py"]


def _from_imports(path: Path) -> list[tuple[str, str]]:
    """``(module, name)`` of every ``from module import name`` of the project's packages in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in ("placement", "solvers"):
                out += [(node.module, a.name) for a in node.names]
    return out


@pytest.mark.parametrize("path", CALLERS, ids=lambda p: p.name)
def test_imported_names_are_public(path):
    private = []
    for module, name in _from_imports(path):
        mod = importlib.import_module(module)
        public = getattr(mod, "__all__", None)
        is_module = importlib.util.find_spec(f"{module}.{name}") is not None if hasattr(mod, "__path__") else False
        if name.startswith("_") or not (is_module or (public is not None and name in public)):
            private.append(f"{module}.{name}")
    assert private == [], f"{path.name} imports non-public names: {private}"


@pytest.mark.parametrize("path", CALLERS, ids=lambda p: p.name)
def test_no_solver_called_around_the_api(path):
    assert "SOLVERS[" not in path.read_text(), f"{path.name} calls a solver directly; use placement.solve"


def test_the_notebooks_helpers_import_no_solver_module():
    tree = ast.parse((ROOT / "notebooks" / "_common.py").read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in names if m.split(".")[0] == "solvers"]
