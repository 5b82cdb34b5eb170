"""The solvers are independent of the verifier and of the file readers: nothing a module under
solvers/ imports, directly or through any chain of our own modules, is placement.core.checker,
placement.app.verify, placement.formats (the file readers), placement.api or placement.cli.

Imports are read from the source with ast, so lazy imports inside functions count too, and they
are followed transitively through every module of ``placement`` and ``solvers``.  One node is not
followed: the package facade ``placement/__init__.py``, which re-exports the public API (importing
any ``placement.x`` runs it, so following it would make every module depend on everything);
``from placement import x`` still counts as importing the submodule ``placement.x``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = ("placement.core.checker", "placement.app.verify", "placement.formats", "placement.api", "placement.cli")
OURS = ("placement", "solvers")
FACADE = "placement"


def _module_file(name: str, root: Path = ROOT) -> Path | None:
    """The source file of module ``name`` under ``root``, or None (a name that is a class or function)."""
    base = root.joinpath(*name.split("."))
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    return None


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, root: Path = ROOT) -> list[str]:
    """Every module ``path`` imports, absolute names (``from placement import checker`` counts as
    ``placement.core.checker``; relative imports are resolved against the module's package)."""
    module = _module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            out.append(name)
            out += [f"{name}.{a.name}" for a in node.names]
    return out


def _closure(start: str, root: Path = ROOT) -> dict[str, str | None]:
    """``{module: the module that imported it}`` for every module of ours ``start`` reaches."""
    parent: dict[str, str | None] = {}
    todo: list[tuple[str, str | None]] = [(start, None)]
    while todo:
        name, by = todo.pop()
        if name in parent or (name == FACADE and by is not None):
            continue
        path = _module_file(name, root)
        if path is None:
            continue
        parent[name] = by
        todo += [(n, name) for n in _imports(path, root) if n.split(".")[0] in OURS]
    return parent


def _chain(parent: dict[str, str | None], name: str) -> str:
    chain = [name]
    while (up := parent[chain[-1]]) is not None:
        chain.append(up)
    return " <- ".join(chain)


def _offends(name: str) -> bool:
    return any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN)


SOLVER_MODULES = sorted(_module_name(p) for p in (ROOT / "solvers").rglob("*.py"))


def test_the_reader_sees_every_form_of_import(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("import placement.core.checker\nfrom placement import verify\n"
                 "def f():\n    from placement.core.checker import check\n")
    assert sum(_offends(n) for n in _imports(p, tmp_path)) >= 3


def test_the_closure_follows_lazy_and_relative_imports_through_several_modules(tmp_path):
    """a -> (relative) b -> (lazy, inside a function) c -> placement.formats: a reaches formats."""
    pkg = tmp_path / "solvers"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from placement.c import x\n")
    (tmp_path / "placement").mkdir()
    (tmp_path / "placement" / "__init__.py").write_text("import placement.core.checker\n")
    (tmp_path / "placement" / "c.py").write_text("import os\nfrom placement.formats import read\nx = 1\n")
    (tmp_path / "placement" / "formats.py").write_text("")
    (tmp_path / "placement" / "checker.py").write_text("")
    reached = _closure("solvers.a", tmp_path)
    assert _chain(reached, "placement.formats") == "placement.formats <- placement.c <- solvers.b <- solvers.a"
    assert "placement.checker" not in reached  # only through the facade, which is not followed


@pytest.mark.parametrize("module", SOLVER_MODULES)
def test_no_solver_module_reaches_the_verifier_or_the_readers(module):
    reached = _closure(module)
    bad = sorted(n for n in reached if _offends(n))
    assert not bad, f"{module} reaches {[_chain(reached, n) for n in bad]}"
