"""The Python API a scheduler embeds: typed arguments checked, one exception hierarchy, no printing,
deadlines passed to solvers, deterministic output, atomic files, and the README example runs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import placement
from placement.predict.report import report
from placement.formats import read_placement
from solvers import SOLVERS, SolveOptions, SolveResult
from solvers.base import default_workers
from solvers.default import default_placement
from tests.conftest import INSTANCES, ROOT

try:  # kahypar is a peer behind the optional extra .[peers]; without it, it cannot run
    import mtkahypar  # noqa: F401

    RUNNABLE_SOLVERS = sorted(SOLVERS)
except ImportError:
    RUNNABLE_SOLVERS = sorted(n for n in SOLVERS if n != "kahypar")

TINY = INSTANCES / "tiny.json"


def test_public_names_resolve():
    for name in placement.__all__:
        assert getattr(placement, name) is not None, name
    assert placement.SolveResult is SolveResult and placement.SolveOptions is SolveOptions
    assert placement.solver_names() == sorted(SOLVERS) and "default" in placement.solver_names()


def test_solve_scores_and_saves_without_printing(tiny, tmp_path, capsys):
    result = placement.solve(tiny, time_limit_s=30, seed=1)
    assert isinstance(result, SolveResult) and result.solver == placement.DEFAULT_SOLVER
    assert result.metrics == report(tiny, result.placement)
    assert result.params["seed"] == 1 and result.params["time_limit_s"] == 30
    assert 0 < result.wall_s < 30
    placement.save_result(tiny, result, tmp_path / "p.json")
    assert placement.load_placement(tiny, tmp_path / "p.json").rank2gpu.tolist() == result.placement.rank2gpu.tolist()
    assert placement.evaluate_placement(tiny, result.placement) == result.metrics
    assert placement.check_placement(tiny, result.placement) == []
    assert os.listdir(tmp_path) == ["p.json"]
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""


@pytest.mark.parametrize("solver", RUNNABLE_SOLVERS)
def test_same_seed_same_placement(tiny, solver):
    """Determinism: the same instance, seed and options give the same placement and metrics."""
    results = [placement.solve(tiny, solver=solver, time_limit_s=60, seed=5, num_workers=1) for _ in range(2)]
    assert results[0].placement.rank2gpu.tolist() == results[1].placement.rank2gpu.tolist()
    assert results[0].placement.phy2log.tolist() == results[1].placement.phy2log.tolist()
    assert results[0].metrics == results[1].metrics


@pytest.mark.parametrize("solver", RUNNABLE_SOLVERS)
def test_same_seed_same_placement_file(tiny, solver):
    """The placement file is deterministic too, byte for byte: no wall-clock values in it."""
    docs = [
        placement.result_document(tiny, placement.solve(tiny, solver=solver, time_limit_s=60, seed=5, num_workers=1))
        for _ in range(2)
    ]
    assert json.dumps(docs[0], sort_keys=True) == json.dumps(docs[1], sort_keys=True)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"solver": "nope"}, "solver"),
        ({"time_limit_s": 0}, "time_limit_s"),
        ({"time_limit_s": float("nan")}, "time_limit_s"),
        ({"time_limit_s": float("inf")}, "time_limit_s"),
        ({"time_limit_s": "10"}, "time_limit_s"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**40}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"num_workers": 0}, "num_workers"),
        ({"num_workers": True}, "num_workers"),
        ({"consumer": "nccl"}, "consumer"),
        ({"objective": "fast"}, "objective"),
        ({"layout": "random"}, "layout"),
        ({"group_preserving": "yes"}, "group_preserving"),
        ({"finish_reserve_s": -1.0}, "finish_reserve_s"),
        ({"wall_limit_s": 0}, "wall_limit_s"),
        ({"wall_limit_s": float("inf")}, "wall_limit_s"),
    ],
)
def test_bad_arguments_name_the_parameter(tiny, kwargs, name):
    with pytest.raises(placement.InvalidInputError, match=rf"^{name}"):
        placement.solve(tiny, **kwargs)


def test_a_solver_bug_surfaces_as_solver_error(tiny, monkeypatch):
    def broken(instance, options):
        raise ZeroDivisionError("oops")

    monkeypatch.setitem(SOLVERS, "_broken", broken)
    with pytest.raises(placement.SolverError, match="_broken.*ZeroDivisionError"):
        placement.solve(tiny, solver="_broken")


def test_an_invalid_answer_is_refused(tiny, monkeypatch):
    def bad(instance, options):
        p = default_placement(instance)
        p2l = np.array(p.phy2log)
        p2l[0, 0] = p2l[0, 1]  # an expert twice, another missing
        return SolveResult(placement.Placement(p.rank2gpu, p2l), "_bad", "heuristic", 0.0)

    monkeypatch.setitem(SOLVERS, "_bad", bad)
    with pytest.raises(placement.SolverError, match="invalid placement: phy2log"):
        placement.solve(tiny, solver="_bad")


def test_solver_gets_the_deadline_the_stop_event_and_the_solver_view(tiny, monkeypatch):
    seen: dict = {}

    def spy(instance, options):
        seen["options"] = options
        seen["heldout"] = instance.routing.heldout_topk
        seen["should_stop"] = options.should_stop()
        return SolveResult(default_placement(instance), "_spy", "heuristic", 0.0)

    monkeypatch.setitem(SOLVERS, "_spy", spy)
    event = threading.Event()
    t0 = time.monotonic()
    result = placement.solve(tiny, solver="_spy", time_limit_s=20, started_at=t0, stop_event=event, finish_reserve_s=2.0)
    options = seen["options"]
    assert options.deadline == pytest.approx(t0 + 18.0)
    assert options.stop_event is event and options.num_workers == default_workers()
    assert options.work_budget_s == placement.solver_budget_s(tiny, 20) > 17.0 / placement.api.LOAD_HEADROOM
    assert options.time_limit_s == 20
    assert seen["heldout"] is None and seen["should_stop"] is False
    assert "interrupted" not in result.details

    event.set()  # a stop requested before or during the solve
    result = placement.solve(tiny, solver="_spy", stop_event=event)
    assert seen["should_stop"] is True and seen["options"].time_left_s() == 0.0
    assert result.details["interrupted"] is True


def test_a_wall_limit_moves_the_deadline_not_the_work(tiny, monkeypatch):
    """``wall_limit_s`` (the safety net ``placement plan`` gives its solves) sets the deadline; the
    work budget and the recorded parameters still come from ``time_limit_s``."""
    seen: list = []

    def spy(instance, options):
        seen.append(options)
        return SolveResult(default_placement(instance), "_spy", "heuristic", 0.0)

    monkeypatch.setitem(SOLVERS, "_spy", spy)
    t0 = time.monotonic()
    a = placement.solve(tiny, solver="_spy", time_limit_s=10, started_at=t0, finish_reserve_s=1.0)
    b = placement.solve(tiny, solver="_spy", time_limit_s=10, wall_limit_s=40, started_at=t0, finish_reserve_s=1.0)
    assert seen[0].deadline == pytest.approx(t0 + 9.0) and seen[1].deadline == pytest.approx(t0 + 39.0)
    assert seen[0].work_budget_s == seen[1].work_budget_s and seen[0].time_limit_s == seen[1].time_limit_s == 10
    assert a.params == b.params


def test_a_solve_cut_by_its_safety_net_says_so_and_a_normal_one_does_not(tiny):
    normal = placement.solve(tiny, time_limit_s=10, seed=1, num_workers=1)
    assert normal.wall_clock_cut is False
    # a net already past when the solver starts: the rank layout and the layers stop at once
    cut = placement.solve(tiny, time_limit_s=10, wall_limit_s=1e-6, seed=1, num_workers=1)
    assert cut.wall_clock_cut is True
    assert placement.check_placement(tiny, cut.placement) == []
    assert "wall_clock_cut" not in json.dumps(placement.result_document(tiny, normal)["solve"]["details"]["layout"])


def test_default_reserve_scales_with_the_routing_sample(tiny):
    # both windows, and the pipeline split's sampled-window runs (tiny has pp 2 and a performance block)
    ids = tiny.routing.topk.size + tiny.routing.heldout_topk.size + placement.api.SPLIT_SCORING_RUNS * tiny.routing.topk.size
    assert placement.estimate_finish_s(tiny) == pytest.approx(
        placement.FINISH_RESERVE_S + placement.api.SCORING_S_PER_EXPERT_ID * ids
    )


def test_solver_budget_is_the_limit_less_size_based_overheads(tiny):
    """The work budget depends on the instance's size and the limit only (determinism)."""
    from placement.api import LOAD_HEADROOM, STARTUP_RESERVE_S

    scoring = placement.estimate_finish_s(tiny) - placement.FINISH_RESERVE_S
    assert placement.solver_budget_s(tiny, 30.0) == pytest.approx(
        (30.0 - STARTUP_RESERVE_S - scoring - placement.estimate_finish_s(tiny)) / LOAD_HEADROOM
    )
    assert placement.solver_budget_s(tiny, 0.5) == 0.0


def test_default_workers_respects_a_cgroup_quota(monkeypatch):
    import placement.core.executor as base

    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(base, "_cgroup_cpu_limit", lambda: None)
    assert base.default_workers() == cores
    monkeypatch.setattr(base, "_cgroup_cpu_limit", lambda: 1)
    assert base.default_workers() == 1


def test_load_placement_checks_against_the_instance(tiny, tmp_path):
    result = placement.solve(tiny)
    doc = placement.result_document(tiny, result)
    doc["rank2gpu"][0] = doc["rank2gpu"][1]
    (tmp_path / "p.json").write_text(json.dumps(doc))
    with pytest.raises(placement.InvalidInputError, match="rank2gpu"):
        placement.load_placement(tiny, tmp_path / "p.json")


def test_a_failed_write_keeps_the_previous_file_and_leaves_no_temporary(tiny, tmp_path, monkeypatch):
    result = placement.solve(tiny)
    out = tmp_path / "p.json"
    out.write_text("previous")

    def interrupted_replace(src, dst):
        raise KeyboardInterrupt  # e.g. a second Ctrl-C between writing and renaming

    monkeypatch.setattr(os, "replace", interrupted_replace)
    with pytest.raises(KeyboardInterrupt):
        placement.save_result(tiny, result, out)
    assert out.read_text() == "previous" and os.listdir(tmp_path) == ["p.json"]
    monkeypatch.undo()
    placement.save_result(tiny, result, out)
    assert read_placement(out)[1]["instance"]["sha256"] == tiny.sha256
    assert os.stat(out).st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_verify_and_export_through_the_api(tiny, tmp_path):
    result = placement.solve(tiny, seed=0)
    placement.save_result(tiny, result, tmp_path / "p.json")
    rep = placement.verify_placement(TINY, tmp_path / "p.json")
    assert rep.violations == [] and rep.checks
    placement.export_placement("megatron", tmp_path / "p.json", tmp_path / "perm.json", TINY)
    layers = json.loads((tmp_path / "perm.json").read_text())["layers"]
    assert len(layers) == tiny.model.num_moe_layers
    with pytest.raises(placement.InvalidInputError):
        placement.verify_placement(TINY, tmp_path / "missing.json")


# ---------------------------------------------------------------------------------------------
# The README's scheduler example
# ---------------------------------------------------------------------------------------------
def _between(text: str, begin: str, end: str) -> str:
    return text.split(begin, 1)[1].split(end, 1)[0]


def test_readme_example_is_the_example_file():
    readme = (ROOT / "README.md").read_text()
    section = _between(readme, "## Embedding in a scheduler", "\n## ")
    snippet = re.search(r"```python\n(.*?)```", section, re.S)
    assert snippet, "the README section has no python block"
    example = (ROOT / "examples" / "scheduler.py").read_text()
    code = _between(example, "# --- README example: begin ---\n", "# --- README example: end ---")
    assert snippet.group(1).strip() == code.strip()


def test_scheduler_example_runs(tmp_path):
    out = tmp_path / "tiny.placement.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "scheduler.py"), str(TINY), str(out), "--budget-s", "30"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["status"] and summary["interrupted"] is False and summary["wall_s"] < 30
    _, doc = read_placement(out)
    assert doc["metrics"]["heldout_cross_domain_bytes_per_step"] == summary["heldout_cross_domain_bytes_per_step"]


def test_scheduler_example_reports_bad_input_with_exit_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "scheduler.py"), str(tmp_path / "missing.json"), str(tmp_path / "o.json")],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "not found" in proc.stderr
    assert os.listdir(tmp_path) == []
