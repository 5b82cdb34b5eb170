"""The notebooks run headless, from a clean copy, as part of the suite; one that raises fails it.

Each notebook is executed with nbclient (kernel ``python3``, ``MPLBACKEND=Agg``) in a temporary
directory holding a copy of ``notebooks/``, so the committed files (kept with their outputs for
readers on GitHub) are never overwritten; figures go to a temporary ``PLACEMENT_FIGURES_DIR``.  ``PLACEMENT_NOTEBOOK_QUICK=1``
runs the notebooks on shorter time budgets (``notebooks/_common.py``, ``budget_s``: 1.5-3 s per
solve instead of 3-10 s, plan.ipynb's job plan 28 s instead of 44 s, fewer points on the time-limit
curve, no 4,096-GPU job in throughput.ipynb): the test checks that every cell runs
and draws, not the committed figures (those come from full runs).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
EXPECTED = {"ep_size", "racks_and_trays", "time_limit_and_cost_mode", "drift", "throughput", "plan"}
CELL_TIMEOUT_S = 300


def _outputs(nb) -> list:
    return [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]


def _has_image(nb) -> bool:
    return any("image/png" in o.get("data", {}) for o in _outputs(nb))


def _has_conclusion(nb) -> bool:
    return any(cell.cell_type == "markdown" and re.search(r"^#+ Conclusion", cell.source, re.M) for cell in nb.cells)


def test_every_notebook_is_here():
    assert EXPECTED <= {p.stem for p in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_notebook_shows_its_plots(path):
    """What a reader sees on GitHub: outputs kept, with plots, and a written conclusion."""
    nb = nbformat.read(path, as_version=4)
    assert _has_image(nb), f"{path.name}: committed without plot outputs"
    assert _has_conclusion(nb), f"{path.name}: no '# Conclusion' markdown cell"
    errors = [o for o in _outputs(nb) if o.get("output_type") == "error"]
    assert not errors, f"{path.name}: committed with an error output"


def _execute(nb, workdir: Path, monkeypatch) -> None:
    """Run ``nb`` headless in ``workdir``; raises ``CellExecutionError`` when a cell raises."""
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("PLACEMENT_FIGURES_DIR", str(workdir.parent / "figures"))
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")
    monkeypatch.setenv("PLACEMENT_NOTEBOOK_QUICK", "1")  # shorter budgets (notebooks/_common.py); every cell runs
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    client = nbclient.NotebookClient(
        nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(workdir)}}
    )
    client.execute()


def test_a_raising_notebook_fails(tmp_path, monkeypatch):
    """The harness itself: a cell that raises must fail the run, later cells must not hide it."""
    nb = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell("raise ValueError('boom')"),
               nbformat.v4.new_code_cell("y = 2")]
    )
    with pytest.raises(nbclient.exceptions.CellExecutionError, match="boom"):
        _execute(nb, tmp_path, monkeypatch)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path, monkeypatch):
    work = tmp_path / "notebooks"
    shutil.copytree(NOTEBOOK_DIR, work, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    nb = nbformat.read(work / path.name, as_version=4)
    _execute(nb, work, monkeypatch)
    assert _has_image(nb), f"{path.name}: produced no plot"
    stderr = "".join(o.get("text", "") for o in _outputs(nb) if o.get("name") == "stderr")
    assert "Warning" not in stderr, f"{path.name}: warnings on stderr:\n{stderr}"
