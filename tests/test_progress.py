"""placement.core.progress: when a bar is drawn, and that it counts the work either way."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from placement.core.progress import ENV_VAR, progress, progress_enabled
from tests.conftest import INSTANCES


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_is_drawn_on_a_terminal_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert progress_enabled(stream=_Tty())
    assert not progress_enabled(stream=io.StringIO())
    assert not progress_enabled(stream=_Tty(), quiet=True)


@pytest.mark.parametrize(("value", "tty", "expected"), [("1", False, True), ("0", True, False), ("", False, False)])
def test_the_environment_variable_overrides_the_terminal_test(
    monkeypatch: pytest.MonkeyPatch, value: str, tty: bool, expected: bool
) -> None:
    monkeypatch.setenv(ENV_VAR, value)
    assert progress_enabled(stream=_Tty() if tty else io.StringIO()) is expected
    assert not progress_enabled(stream=_Tty(), quiet=True)  # --quiet wins over the variable


def test_a_drawn_bar_shows_the_work_and_is_removed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "1")
    out = io.StringIO()
    with progress(4, "solve: layers", "layer", stream=out) as bar:
        assert bar.active
        for _ in range(4):
            bar.update()
        bar.write("a note")
    text = out.getvalue()
    assert "solve: layers" in text and "4/4" in text and "a note" in text
    assert bar.n == 4


def test_a_quiet_bar_draws_nothing_and_still_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "1")
    out = io.StringIO()
    with progress(None, "import: bytes read", "B", unit_scale=True, quiet=True, stream=out) as bar:
        bar.update(1000)
        bar.set_total(2000)
        bar.update(1000)
        bar.write("not shown")
    assert out.getvalue() == ""
    assert (bar.n, bar.total, bar.active) == (2000, 2000, False)


def test_report_takes_absolute_figures_as_library_callbacks_give_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "1")
    out = io.StringIO()
    with progress(None, "plan: candidates", "candidate", stream=out) as bar:
        bar.report(2, 10)
        bar.report(7, 10)
        bar.report(7, 12)  # the total may change as the work learns more
    assert (bar.n, bar.total) == (7, 12)
    assert "7/12" in out.getvalue()


# ---------------------------------------------------------------------------------------------
# The commands: a bar on stderr (forced into the capture), the same files with and without it
# ---------------------------------------------------------------------------------------------
def _run_twice(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str],
               outputs: list[Path]) -> tuple[list[bytes], str]:
    """Run ``argv`` with the bar forced on, then with ``--quiet``; the second run's files and the
    first run's stderr (the second's must be empty)."""
    from placement.cli import main

    monkeypatch.setenv(ENV_VAR, "1")
    assert main(argv) == 0, capsys.readouterr().err
    first = [p.read_bytes() for p in outputs]
    err = capsys.readouterr().err
    for p in outputs:
        p.unlink()
    assert main([*argv, "--quiet"]) == 0, capsys.readouterr().err
    assert capsys.readouterr().err == ""
    assert [p.read_bytes() for p in outputs] == first
    return first, err


def test_solve_draws_layers_and_writes_the_same_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    argv = ["solve", str(INSTANCES / "tiny.json"), "--time-limit", "10", "--workers", "1", "--seed", "3", "-o", str(out)]
    _, err = _run_twice(monkeypatch, capsys, argv, [out])
    layers = json.loads((INSTANCES / "tiny.json").read_text())["model"]["moe_layers"]
    assert "solve: expert maps" in err and f"{len(layers)}/{len(layers)}" in err
    assert "[placement] solving tiny" in err


def test_the_library_reports_layers_through_its_callback() -> None:
    import placement

    inst = placement.load_instance(INSTANCES / "tiny.json")
    seen: list[tuple[int, int]] = []
    with_cb = placement.solve(inst, time_limit_s=10, seed=3, num_workers=1, on_progress=lambda d, t: seen.append((d, t)))
    L = inst.model.num_moe_layers
    assert seen == [(i, L) for i in range(1, L + 1)]
    without = placement.solve(inst, time_limit_s=10, seed=3, num_workers=1)
    assert np.array_equal(with_cb.placement.phy2log, without.placement.phy2log)
    assert np.array_equal(with_cb.placement.rank2gpu, without.placement.rank2gpu)


def test_plan_draws_items_and_writes_the_same_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from tests.test_plan import _cluster_doc, _job_doc, _write

    job, cl = _write(tmp_path, "job.json", _job_doc()), _write(tmp_path, "cluster.json", _cluster_doc())
    out = tmp_path / "plan.json"
    argv = ["plan", str(job), "--cluster", str(cl), "--candidates", "tp=1 pp=1 vpp=1 ep=8 dp=8 mb=1",
            "--time-limit", "30", "--workers", "1", "-o", str(out)]
    files = [out, tmp_path / "plan.instance.json", tmp_path / "plan.placement.json"]
    _, err = _run_twice(monkeypatch, capsys, argv, files)
    doc = json.loads(out.read_text())
    items = doc["counts"]["work_items"]
    assert "plan: candidates" in err and f"{items}/{items}" in err


def test_import_draws_bytes_and_writes_the_same_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from tests.test_importers import _routing, _sections, _write_megatron

    ids = _routing(np.random.default_rng(5), steps=4, micro=2, tokens=6)
    paths = _write_megatron(tmp_path / "traces", ids)
    sec = _sections(tmp_path)
    out = tmp_path / "imported.json"
    argv = ["import", "--from", "megatron", *paths, "--model", sec["model"], "--parallel", sec["parallel"],
            "--cluster", sec["cluster"], "-o", str(out)]
    _, err = _run_twice(monkeypatch, capsys, argv, [out, out.with_suffix(".npz")])
    assert "import: traces read" in err
    total = sum(Path(p).stat().st_size for p in paths)
    seen: list[tuple[int, int]] = []
    import placement

    placement.import_routing("megatron", paths, model=sec["model"], parallel=sec["parallel"], cluster=sec["cluster"],
                             on_progress=lambda d, t: seen.append((d, t)))
    assert seen[-1] == (total, total) and all(t == total for _, t in seen)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
