"""Per-layer work that scales (issue 16): exact aggregation by expert groups touched, the seeded
unbiased net sample, budget sizing as a pure function of sizes, and the anytime path (a stop
mid-layer returns the layer's incumbent, never the fallback map).

References: brute force (every assignment's map scored by ``net_crossings``, the evaluator through
``place_experts``' own check), exact expectations of the sample.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import solvers.experts.pool as pool_module
from placement.predict.cost import evaluate
from placement.core.model import Placement
from solvers.base import SolveOptions
from solvers.default import default_rank2gpu
from solvers.experts import LayerBudget, build_layer_problem, net_crossings, place_experts
from solvers.experts.budget import layer_work_s, search_net_limit
from solvers.experts.groups import _forced_costs, _single_class_types, multiset_permutations, touch_nets
from solvers.experts.layer import solve_layer
from solvers.experts.problem import NetSet, sample_nets
from solvers.kernels import bytes_per_crossing
from tests.conftest import random_instance
from tests.test_experts import _all_class_maps, _group_preserving


def _whole_positions_problem(seed: int):
    """A group-preserving layer whose every group position is one EP rank (so lies in one class),
    on a random rank layout over three domains."""
    rng = np.random.default_rng(seed)
    inst = random_instance(rng, num_experts=12, top_k=4, ep=6, dp=6, pp=1, num_domains=3, trays_per_domain=2,
                           gpus_per_tray=2, tokens=40, moe_layers=1, num_groups=6, groups_per_token=2)
    r2g = rng.permutation(inst.cluster.num_gpus)[: inst.parallel.world_size]
    return inst, r2g, build_layer_problem(inst, r2g, 0, group_preserving=True, validation_fraction=0)


@pytest.mark.parametrize("seed", range(6))
def test_forced_costs_on_group_touch_nets_are_every_assignments_exact_crossings(seed):
    """With every position in one class an assignment has one map; the crossings computed on the
    nets aggregated by expert groups touched equal that map's crossings on the exact nets."""
    _, _, problem = _whole_positions_problem(seed)
    if problem.trivial:
        pytest.skip("the layout put the stage in one domain")
    whole, whole_class = _single_class_types(problem)
    assert whole.all()
    assign = multiset_permutations(problem.position_types[2])
    forced = _forced_costs(problem, problem.nets_all, assign)
    for a in range(assign.shape[0]):
        m = whole_class[assign[a]][problem.expert2group]
        assert forced[a] == net_crossings(problem.nets_all, m, problem.class_sig, "per_domain")
    touch, group, src, weight = touch_nets(problem, problem.nets_all)
    assert weight.sum() == problem.nets_all.num_tokens and touch.shape[0] <= problem.nets_all.num_nets


def _random_nets(rng, n_tokens=400, E=10, k=3):
    experts = np.stack([rng.choice(E, size=k, replace=False, p=None) for _ in range(n_tokens)])
    experts[: n_tokens // 2] = experts[0]  # one heavy net
    return NetSet.aggregate(experts, rng.integers(0, 2, n_tokens), rng.integers(0, 3, n_tokens))


def test_the_net_sample_is_seeded_integer_and_keeps_heavy_nets_whole():
    rng = np.random.default_rng(0)
    nets = _random_nets(rng)
    assert sample_nets(nets, nets.num_nets, seed=1) is nets  # small enough: the nets themselves
    a, b = sample_nets(nets, 40, seed=3), sample_nets(nets, 40, seed=3)
    assert all(np.array_equal(x, y) for x, y in zip((a.experts, a.group, a.src, a.weight),
                                                    (b.experts, b.group, b.src, b.weight)))
    assert a.weight.dtype == np.int64 and a.num_nets < nets.num_nets
    orig = {(int(g), int(s), tuple(e)): int(w) for e, g, s, w in zip(nets.experts, nets.group, nets.src, nets.weight)}
    kept = [orig[(int(g), int(s), tuple(e))] for e, g, s in zip(a.experts, a.group, a.src)]  # a subset of the nets
    tau = int(a.weight.min())
    assert tau > 1
    for w_orig, w in zip(kept, a.weight):  # at or above the threshold: as it is; below: weighs the threshold
        assert w == (w_orig if w_orig >= tau else tau)
    assert all(w >= tau for w in kept if w >= tau) and min(kept) < tau  # light nets were sampled
    assert {k for k, w in orig.items() if w >= tau} <= set(zip(a.group.tolist(), a.src.tolist(),
                                                               map(tuple, a.experts.tolist())))


def test_the_net_sample_estimates_every_maps_crossings_without_bias():
    """Over many seeds the sample's mean crossings of fixed maps match the exact crossings (the
    standard error of the mean over 400 draws is a few tenths of a percent here)."""
    rng = np.random.default_rng(1)
    nets = _random_nets(rng, n_tokens=600)
    sig = np.array([[0, 1], [1, 2], [2, 0]])  # 3 classes seen from 2 EP groups
    maps = [rng.integers(0, 3, 10) for _ in range(3)]
    exact = np.array([net_crossings(nets, m, sig, "per_domain") for m in maps], dtype=float)
    draws = np.array([[net_crossings(s, m, sig, "per_domain") for m in maps]
                      for s in (sample_nets(nets, 60, seed=i) for i in range(400))], dtype=float)
    sem = draws.std(axis=0) / np.sqrt(draws.shape[0])
    assert (np.abs(draws.mean(axis=0) - exact) <= 4 * sem + 1e-9).all(), (draws.mean(axis=0), exact, sem)
    assert (draws.std(axis=0) > 0).all()  # it is a sample, not the nets


def test_search_sizes_are_a_pure_function_of_sizes():
    assert layer_work_s(30.0, 2, [1.0, 1.0, 1.0, 1.0]) == layer_work_s(30.0, 2, [1.0, 1.0, 1.0, 1.0])
    works = layer_work_s(30.0, 2, [4.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    assert works[-1] == 0.0  # trivial layer
    # dealt heaviest first to the least loaded worker: [4] and [1, 1, 1, 1]; each worker's layers fill it
    assert works[0] == pytest.approx(24.0) and sum(works[1:5]) == pytest.approx(24.0)
    limits = [search_net_limit(w, 1e6, 8, 4) for w in (1.0, 10.0, 20.0, 1e4)]
    assert limits[0] == limits[0] and limits[-1] is None  # a big budget: all nets
    assert limits[0] <= limits[1] <= limits[2]
    assert search_net_limit(0.0, 1e6, 8, 4) == search_net_limit(0.0, 1e6, 8, 4) > 0  # never below the minimum
    assert search_net_limit(10.0, 1e6, 8, 8) <= search_net_limit(10.0, 1e6, 8, 2)  # more classes, fewer nets


def test_a_sampled_search_reports_exact_crossings_checked_by_the_evaluator(monkeypatch):
    """With the search limited to a handful of nets every layer still reports its crossings on all
    sampled tokens (place_experts checks them against the evaluator) and says what it searched."""
    rng = np.random.default_rng(5)
    inst = random_instance(rng, num_experts=8, top_k=2, ep=4, dp=4, pp=1, num_domains=3, tokens=60, moe_layers=2)
    r2g = rng.permutation(inst.cluster.num_gpus)[: inst.parallel.world_size]
    monkeypatch.setattr(pool_module, "search_net_limit", lambda *a: 10)
    opts = SolveOptions(time_limit_s=30, seed=0, num_workers=1)
    plan = place_experts(inst, r2g, opts, deadline=time.monotonic() + 60, deterministic_time=0.5, use_pool=False)
    metrics = evaluate(inst, Placement(r2g, plan.phy2log), window="sampled")
    bpc = bytes_per_crossing(inst, inst.routing.tokens_per_source)
    sampled = 0
    for li, d in enumerate(plan.details["layers"]):
        if d["status"] == "trivial":
            continue
        assert d["objective_crossings"] * bpc == pytest.approx(metrics.cross_domain_bytes_per_layer[li], rel=1e-12)
        assert d["search_nets"]["limit"] == 10 and d["search_nets"]["fit"] < d["search_nets"]["fit_exact"]
        assert d["validation_crossings"] <= d["default_validation_crossings"]
        sampled += 1
    assert sampled > 0


class _StopAfter(threading.Event):
    """A stop request that arrives after ``n`` polls (mid-layer, deterministically)."""

    def __init__(self, n: int):
        super().__init__()
        self.n, self.calls = n, 0

    def is_set(self) -> bool:
        self.calls += 1
        return self.calls > self.n or super().is_set()


@pytest.mark.parametrize("gp", [False, True])
def test_a_stop_mid_layer_returns_the_incumbent_not_the_fallback(gp):
    """A stop request after two polls (a few swaps into the local search): the layer still answers
    with its best map so far, checked by the validation guard, and says it stopped early; in free
    mode that map beats the default on the sampled tokens here (uniform random routing leaves the
    group-preserving default hard to beat), and the full run is at least as good."""
    rng = np.random.default_rng(12)
    inst = random_instance(rng, num_experts=16, top_k=4, ep=8, dp=8, pp=1, num_domains=2, trays_per_domain=2,
                           gpus_per_tray=2, tokens=64, moe_layers=1, num_groups=4, groups_per_token=2)
    r2g = default_rank2gpu(inst)
    problem = build_layer_problem(inst, r2g, 0, group_preserving=gp)
    assert not problem.trivial
    budget = LayerBudget(1.0, 0, time.monotonic() + 60)
    full = solve_layer(problem, budget, model_groups=4)
    opts = SolveOptions(time_limit_s=60, seed=0, num_workers=1, stop_event=_StopAfter(2))
    cut = solve_layer(problem, budget, model_groups=4, options=opts)
    assert cut.details["stopped_early"] and not full.details["stopped_early"]
    assert "fallback_reason" not in cut.details and cut.details["status"] in ("feasible", "optimal")
    default_all = net_crossings(problem.nets_all, problem.default_expert2class, problem.class_sig, "per_domain")
    e2c = problem.slot2class[cut.expert2slot]
    assert cut.crossings == net_crossings(problem.nets_all, e2c, problem.class_sig, "per_domain")
    assert cut.details["validation_crossings"] <= cut.details["default_validation_crossings"]
    assert cut.crossings <= default_all
    if not gp:
        assert full.crossings <= cut.crossings < default_all


@pytest.mark.parametrize("seed", [21, 22, 23])
def test_a_free_layer_is_never_worse_on_its_fit_tokens_than_every_group_preserving_map(seed):
    """Free mode on a model with expert groups, group positions aligned with the classes: the group
    search runs as one more start, so the local search's map is no worse on the fit part than the
    best group-preserving map within the same caps (brute force)."""
    rng = np.random.default_rng(seed)
    inst = random_instance(rng, num_experts=16, top_k=4, ep=8, dp=8, pp=1, num_domains=2, trays_per_domain=2,
                           gpus_per_tray=2, tokens=64, moe_layers=1, num_groups=4, groups_per_token=2)
    r2g = default_rank2gpu(inst)
    free = build_layer_problem(inst, r2g, 0, group_preserving=False)
    gp = build_layer_problem(inst, r2g, 0, group_preserving=True)
    assert not free.trivial
    out = solve_layer(free, LayerBudget(1.0, 0, time.monotonic() + 60), model_groups=4)
    assert out.details["group_start"]["status"] in ("OPTIMAL", "FEASIBLE")
    cap = free.load_cap(out.details["load_tolerance"])
    space = [m for m in _all_class_maps(free.class_capacity)
             if (free.class_loads(m) <= cap).all() and _group_preserving(gp, m)]
    best_gp = min(net_crossings(free.nets_fit, m, free.class_sig, "per_domain") for m in space)
    assert out.details["candidates"]["local_search"]["fit"] <= best_gp


def test_the_local_search_keeps_a_start_that_its_sampled_polish_made_worse_on_all_nets(monkeypatch):
    """The swap search sees a sample of the nets; its result is compared with the start itself on
    the exact fit nets, so a polish that fits the sample but loses on all nets is not kept."""
    import solvers.experts.layer as layer_module

    rng = np.random.default_rng(5)
    inst = random_instance(rng, num_experts=16, top_k=4, ep=8, dp=8, pp=1, num_domains=2, trays_per_domain=2,
                           gpus_per_tray=2, tokens=64, moe_layers=1, num_groups=1)
    problem = build_layer_problem(inst, default_rank2gpu(inst), 0, group_preserving=False)
    worst = {}

    class WorseningSwap:  # a "polish" that always returns the map worst on the exact fit nets
        def __init__(self, problem, nets):
            self.problem = problem

        def run(self, m, cap, should_stop=None):
            p = self.problem
            if "map" not in worst:
                perms = [np.random.default_rng(i).permutation(p.default_expert2class) for i in range(20)]
                worst["map"] = max(perms, key=lambda c: net_crossings(p.nets_fit, c, p.class_sig, "per_domain"))
            return worst["map"]

    monkeypatch.setattr(layer_module, "SwapSearch", WorseningSwap)
    search = layer_module._LayerSearch(problem, LayerBudget(0.0, 0, time.monotonic() + 60), problem.load_cap(10.0),
                                       layer_module.StopCheck(time.monotonic() + 60), None)
    start = problem.default_expert2class
    name, m = layer_module._best_polished(search, [("default", start)])
    fit = problem.nets_fit
    assert net_crossings(fit, worst["map"], problem.class_sig, "per_domain") > \
        net_crossings(fit, start, problem.class_sig, "per_domain")  # the polish really is worse here
    assert name == "default" and np.array_equal(m, start)
