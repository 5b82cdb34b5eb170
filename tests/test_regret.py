"""The step-time model's uncertainty: the low/mid/high band and the max-min-regret choice (placement.predict.cost)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from placement.predict.cost import evaluate
from placement.predict.report import band_report, max_min_regret, report, setting_step_models
from placement.predict.performance import SETTINGS, StepTimeModel, performance_settings
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
    drift = [check["candidates"][n]["drift_step_time_s"] for n in names]
    # the drift scenario decides; candidates level there go by their regret on the sampled window
    d_choice, s_choice = max_min_regret(drift), max_min_regret(cands)
    level = [i for i, w in enumerate(d_choice.worst_ratio) if w >= max(d_choice.worst_ratio) * (1 - 1e-9)]
    assert names.index(check["returned"]) in level
    assert s_choice.worst_ratio[names.index(check["returned"])] >= max(
        s_choice.worst_ratio[i] for i in level) * (1 - 1e-9)
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


# ------------------------------------------------------------------------- the drift scenario
@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 4))
def test_gain_kept_is_the_clipped_least_squares_slope_of_the_latest_loads(seed, windows):
    from solvers.experts.windows import gain_kept

    rng = np.random.default_rng(seed)
    E, L, T = 6, 2, 5 * windows
    topk = rng.integers(0, E, size=(L, 2, T, 1))
    bounds = [(5 * w, 5 * w + 5) for w in range(windows)]
    last = bounds[-1][0]

    def rel(a):  # the reference, written out per layer
        rows = []
        for li in range(L):
            c = np.array([np.sum(a[li] == e) for e in range(E)], dtype=float)
            rows.append(c / c.mean() - 1)
        return np.concatenate(rows)

    x, y = rel(topk[:, :, :last]), rel(topk[:, :, last:])
    want = 1.0 if not np.any(x) else float(np.clip(np.linalg.lstsq(x[:, None], y, rcond=None)[0][0], 0, 1))
    assert gain_kept(topk, bounds, E) == pytest.approx(want, abs=1e-12)
    same = np.concatenate([topk[:, :, :last], topk[:, :, :last]], axis=2)
    assert gain_kept(same, [(0, last), (last, 2 * last)], E) == pytest.approx(1.0)


def test_when_the_windows_disagree_the_rank_layout_is_chosen_on_contiguous_experts(tiny):
    """kept 0 (the latest window's loads unrelated to the earlier one's): the returned rank layout is
    the max-min-regret one among the candidates' layouts with contiguous experts (what holds whatever
    the routing does); the map on it by the sampled window."""
    import dataclasses

    from placement.core.model import Placement, Routing
    from solvers.base import SolveOptions
    from solvers.cpsat import step_time_check
    from solvers.experts.windows import SINGLE_WINDOW_GAIN_KEPT, gain_kept

    assert SINGLE_WINDOW_GAIN_KEPT == 1.0
    topk = np.asarray(tiny.routing.topk)
    T, E = topk.shape[2], tiny.model.num_experts
    # the second window: the first with every layer's experts relabelled by a shift of whole expert
    # groups (the same co-activation shape, other hot experts), one whose load slope is <= 0
    later = None
    gs = tiny.model.experts_per_group
    for shift in range(gs, E, gs):
        both = np.concatenate([topk, (topk + shift) % E], axis=2)
        if gain_kept(both, [(0, T), (T, 2 * T)], E) == 0.0:
            later = both
            break
    if later is None:
        pytest.skip("no relabelling of tiny's routing gives unrelated loads")
    inst = dataclasses.replace(tiny, routing=Routing(later, None, window_tokens=(T, T)))
    rng = np.random.default_rng(1)
    r2g = rng.permutation(np.flatnonzero(tiny.cluster.available))[: tiny.parallel.world_size].astype(np.int64)
    p2l = np.stack([rng.permutation(E) for _ in range(tiny.model.num_moe_layers)])
    check = step_time_check(inst, SolveOptions(), Placement(r2g, p2l), {})
    assert check["gain_kept"] == 0.0
    cands = check["candidates"]
    names = list(cands)
    assert {"solved layout, contiguous experts", "packed layout, contiguous experts", "default placement"} <= set(names)
    contiguous = [n for n in names if "contiguous" in n or n == "default placement"]
    best = max(cands[n]["drift_worst_ratio"] for n in contiguous)
    ret = cands[check["returned"]]
    assert ret["drift_worst_ratio"] >= best * (1 - 1e-9)
    for n in names:  # in the drift scenario a candidate is its layout's contiguous placement
        assert cands[n]["drift_worst_ratio"] <= best * (1 + 1e-9)
    level = [n for n in names if cands[n]["drift_worst_ratio"] >= best * (1 - 1e-9)]
    assert ret["worst_ratio"] >= max(cands[n]["worst_ratio"] for n in level) * (1 - 1e-9)


def test_when_the_windows_agree_the_choice_is_the_sampled_max_min_regret_one(tiny):
    import dataclasses

    from placement.core.model import Placement, Routing
    from solvers.base import SolveOptions
    from solvers.cpsat import step_time_check

    topk = np.asarray(tiny.routing.topk)
    twice = np.concatenate([topk, topk], axis=2)
    T = topk.shape[2]
    inst = dataclasses.replace(tiny, routing=Routing(twice, None, window_tokens=(T, T)))
    p = default_placement(inst)
    check = step_time_check(inst, SolveOptions(), Placement(p.rank2gpu, p.phy2log), {})
    assert check["gain_kept"] == pytest.approx(1.0)
    names = list(check["candidates"])
    choice = max_min_regret([check["candidates"][n]["predicted_step_time_s"] for n in names])
    assert check["returned"] == names[choice.index]
