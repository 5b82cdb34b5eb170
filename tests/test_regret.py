"""The step-time model's uncertainty: the low/mid/high band and the max-min-regret choice (placement.cost)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from placement.cost import band_report, evaluate, max_min_regret, report, setting_step_models
from placement.performance import SETTINGS, StepTimeModel, performance_settings
from solvers.default import default_placement

times = st.lists(st.fixed_dictionaries({s: st.floats(0.1, 10.0) for s in ("low", "mid", "high")}), min_size=1,
                 max_size=6)


@settings(max_examples=200, deadline=None)
@given(times)
def test_max_min_regret_is_the_brute_force_maximin(cands):
    choice = max_min_regret(cands)
    best = {s: min(c[s] for c in cands) for s in cands[0]}
    worst = [min(best[s] / c[s] for s in c) for c in cands]
    assert worst[choice.index] >= max(worst) * (1 - 1e-9)
    assert all(w < max(worst) * (1 - 1e-9) for w in worst[: choice.index])  # the first of the ties
    for s, i in choice.best_by_setting.items():
        assert cands[i][s] <= best[s] * (1 + 1e-9)
    assert choice.differs == any(i != choice.index for i in choice.best_by_setting.values())


def test_one_candidate_best_everywhere_is_chosen_and_the_choice_does_not_differ():
    choice = max_min_regret([{"low": 2.0, "high": 1.5}, {"low": 1.0, "high": 1.0}, {"low": 3.0, "high": 0.9}])
    assert choice.best_by_setting == {"low": 1, "high": 2} and choice.differs
    assert choice.index == 1  # worst ratios 0.5/0.6, 0.9, 0.333
    same = max_min_regret([{"low": 1.0, "high": 1.0}, {"low": 2.0, "high": 2.0}])
    assert same.index == 0 and not same.differs


def test_the_report_carries_the_band_of_the_setting_models(tiny):
    p = default_placement(tiny)
    rep = report(tiny, p)
    variants = performance_settings(tiny.performance)
    for s in SETTINGS:
        import dataclasses

        model = StepTimeModel(dataclasses.replace(tiny, performance=variants[s]))
        want = model.predict_metrics(evaluate(tiny, p, window="heldout"), p.rank2gpu)
        assert rep[f"heldout_predicted_tflops_per_gpu_{s}"] == pytest.approx(want.tflops_per_gpu)
        assert rep[f"predicted_step_time_s_{s}"] == pytest.approx(
            model.predict_metrics(evaluate(tiny, p), p.rank2gpu).step_time_s)
    assert rep["predicted_step_time_s_mid"] == pytest.approx(rep["predicted_step_time_s"])  # mid: the block itself
    assert set(band_report(setting_step_models(tiny), evaluate(tiny, p), p.rank2gpu)) == {
        f"predicted_{k}_{s}" for k in ("step_time_s", "tflops_per_gpu") for s in SETTINGS}


def test_solve_returns_the_max_min_regret_candidate_and_says_whether_settings_differ(tiny, capsys):
    import placement
    from placement.cli import main
    from tests.conftest import INSTANCES

    r = placement.solve(tiny, time_limit_s=10, seed=0, num_workers=1)
    check = r.details["step_time_check"]
    names = list(check["candidates"])
    cands = [check["candidates"][n]["predicted_step_time_s"] for n in names]
    assert names[max_min_regret(cands).index] == check["returned"]
    assert check["choice_differs"] == any(n != check["returned"] for n in check["choice_by_setting"].values())
    assert any(n.startswith("balanced packing") for n in names)  # free maps: the balanced starts are in
    assert main(["solve", str(INSTANCES / "tiny.json"), "--time-limit", "10", "--workers", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["step_time_choice"]["returned"] == check["returned"]
    assert all(f"heldout_predicted_tflops_per_gpu_{s}" in out["metrics"] for s in SETTINGS)
    assert main(["solve", str(INSTANCES / "tiny.json"), "--time-limit", "10", "--workers", "1"]) == 0
    text = capsys.readouterr().out
    assert "TFLOP/s/GPU, low/mid/high (h-o)" in text and "setting" in text


def test_checkpoint_apply_leaves_the_group_breaking_balanced_candidates_out(tiny):
    import placement

    r = placement.solve(tiny, time_limit_s=10, seed=0, num_workers=1, apply="checkpoint")
    assert not any(n.startswith("balanced packing") for n in r.details["step_time_check"]["candidates"])
    assert np.asarray(r.placement.phy2log).shape[0] == tiny.model.num_moe_layers
