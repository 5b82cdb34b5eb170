"""The verifier is independent of the solvers: no module under solvers/ imports placement.checker or
placement.verify (read from the source with ast, so lazy imports inside functions count too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = ("placement.checker", "placement.verify")


def _imports(path: Path) -> list[str]:
    """Every module ``path`` imports, absolute names (``from placement import checker`` counts as
    ``placement.checker``)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
            out += [f"{node.module}.{a.name}" for a in node.names]
    return out


def _offends(name: str) -> bool:
    return any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN)


SOLVER_FILES = sorted((ROOT / "solvers").rglob("*.py"))


def test_the_reader_sees_every_form_of_import(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("import placement.checker\nfrom placement import verify\n"
                 "def f():\n    from placement.checker import check\n")
    assert sum(_offends(n) for n in _imports(p)) >= 3


@pytest.mark.parametrize("path", SOLVER_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_solver_module_imports_the_verifier(path):
    bad = sorted({n for n in _imports(path) if _offends(n)})
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}"
