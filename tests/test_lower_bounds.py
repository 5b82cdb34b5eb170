"""Lower bounds on every layer (solvers/experts/lower_bounds.py and solvers/experts/bounds.py).

References: brute force over every map of small random layers (both cost modes, free and
group-preserving, with load caps), hand values of the LP relaxation on two-expert layers, and the
crossings of the maps the solver returns on the committed instances.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from placement.formats import read_instance
from placement.core.model import Routing
from solvers.base import SolveOptions
from solvers.default import default_rank2gpu
from solvers.experts import (
    LayerProblem,
    NetSet,
    SwapSearch,
    build_layer_problem,
    capped_greedy,
    linear_costs,
    net_crossings,
    num_group_assignments,
    per_pair_class_bound,
    place_experts,
)
from solvers.experts.lower_bounds import (
    bound_to_crossings,
    group_assignment_bound,
    lagrangian_bound,
    layer_lower_bound,
)
from tests.conftest import INSTANCES, random_instance
from tests.test_experts import _all_class_maps
from tests.test_experts import _group_preserving as _keeps_groups


def _skewed_instance(rng, mode, groups, top_k, domains):
    """A random instance whose routing favours a few experts (so load caps bind)."""
    inst = random_instance(rng, num_experts=8, top_k=top_k, ep=4, dp=4, pp=1, num_domains=domains,
                           trays_per_domain=2, gpus_per_tray=2, tokens=10, moe_layers=1, num_groups=groups,
                           groups_per_token=1, cost_mode=mode)
    pref = rng.random(8) ** 3  # a few popular experts
    keys = rng.random(inst.routing.topk.shape[:-1] + (8,)) * pref
    topk = np.sort(np.argsort(-keys, axis=-1)[..., :top_k], axis=-1)
    inst = dataclasses.replace(inst, routing=Routing(topk, topk))
    r2g = rng.permutation(inst.cluster.num_gpus)[: inst.parallel.world_size]
    return inst, r2g


# ---------------------------------------------------------------------------------------------
# Every bound is at most the brute-force optimum
# ---------------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 100_000), mode=st.sampled_from(["per_domain", "per_pair"]),
       gp=st.booleans(), top_k=st.sampled_from([2, 3]), domains=st.sampled_from([2, 3]),
       tol=st.sampled_from([0.0, 0.1, 0.3, 10.0]))
def test_every_bound_is_at_most_the_brute_force_optimum(seed, mode, gp, top_k, domains, tol):
    rng = np.random.default_rng(seed)
    inst, r2g = _skewed_instance(rng, mode, 2 if gp else 1, top_k, domains)
    problem = build_layer_problem(inst, r2g, 0, group_preserving=gp, validation_fraction=0)
    if problem.trivial:
        return
    nets, cap = problem.nets_all, problem.load_cap(tol)
    maps = [m for m in _all_class_maps(problem.class_capacity) if not gp or _keeps_groups(problem, m)]
    cost = {i: net_crossings(nets, m, problem.class_sig, mode) for i, m in enumerate(maps)}
    best = min(cost.values())
    within = [cost[i] for i, m in enumerate(maps) if (problem.class_loads(m) <= cap).all()]
    if mode == "per_pair":
        exact = per_pair_class_bound(problem, nets, None)
        assert exact.bound is not None and exact.bound <= best + 1e-6
        lp = per_pair_class_bound(problem, nets, cap)
        if within:
            assert lp.bound is not None and lp.bound <= min(within) + 1e-6
        return
    free_best = min(net_crossings(nets, m, problem.class_sig, mode) for m in _all_class_maps(problem.class_capacity))
    lag = lagrangian_bound(problem, nets, None)
    assert lag.crossings <= free_best + 1e-6  # over every map with the capacities
    assert bound_to_crossings(lag.crossings) <= free_best
    capped = lagrangian_bound(problem, nets, cap)
    whole = layer_lower_bound(problem, nets, cap)
    if within:
        assert capped.crossings <= min(within) + 1e-6
        assert bound_to_crossings(whole.crossings) <= min(within)
    if gp:
        gb = group_assignment_bound(problem, nets)
        assert gb is not None and bound_to_crossings(gb.crossings) <= best


@pytest.mark.parametrize("seed", [3, 4, 5])
@pytest.mark.parametrize("gp", [False, True])
def test_place_experts_bounds_every_layer_even_without_a_search_budget(seed, gp):
    """With no CP-SAT budget the search proves nothing: the lower bounds alone cover every layer,
    and they are at most the brute-force optimum over the search space (the caps' maps and the default)."""
    rng = np.random.default_rng(seed)
    inst = random_instance(rng, num_experts=8, top_k=2, ep=4, dp=4, pp=2, num_domains=3, trays_per_domain=2,
                           gpus_per_tray=2, tokens=10, moe_layers=2, num_groups=2 if gp else 1)
    r2g = rng.permutation(inst.cluster.num_gpus)[: inst.parallel.world_size]
    opts = SolveOptions(time_limit_s=30, seed=0, num_workers=1, group_preserving=gp)
    plan = place_experts(inst, r2g, opts, deadline=time.monotonic() + 60, validation_fraction=0.0,
                         deterministic_time=0.0)
    assert plan.details["layers_without_bound"] == 0 and plan.bound_bytes is not None
    for li, d in enumerate(plan.details["layers"]):
        problem = build_layer_problem(inst, r2g, li, group_preserving=gp, validation_fraction=0)
        if problem.trivial:
            continue
        cap = problem.load_cap(d["load_tolerance"])
        space = [m for m in _all_class_maps(problem.class_capacity)
                 if (not gp or _keeps_groups(problem, m)) and (problem.class_loads(m) <= cap).all()]
        space.append(problem.default_expert2class)
        best = min(net_crossings(problem.nets_all, m, problem.class_sig, "per_domain") for m in space)
        assert d["bound_crossings"] is not None and d["bound_crossings"] <= best <= d["objective_crossings"]
        assert "lower_bound" in d


# ---------------------------------------------------------------------------------------------
# Hand values
# ---------------------------------------------------------------------------------------------
def _two_expert_layer(nets: NetSet, *, group_preserving: bool = False, gs: int = 2) -> LayerProblem:
    """Two domains, one EP group, one expert per class (or ``gs`` per group in group-preserving mode)."""
    E = int(nets.experts.max()) + 1
    epr = E // 2
    load = np.bincount(np.repeat(nets.experts, 1, axis=0).reshape(-1),
                       weights=np.repeat(nets.weight, nets.experts.shape[1]), minlength=E).astype(np.int64)
    return LayerProblem(layer=0, stage=0, cost_mode="per_domain", num_experts=E, experts_per_rank=epr,
                        domains=np.array([0, 1]), rank2class=np.array([0, 1]), class_sig=np.array([[0], [1]]),
                        class_capacity=np.array([epr, epr]), load=load[None, :], bytes_per_crossing=1.0,
                        nets_fit=nets, nets_val=NetSet.aggregate(np.zeros((0, 2)), np.zeros(0), np.zeros(0)),
                        nets_all=nets, group_preserving=group_preserving,
                        expert_group_size=gs if group_preserving else E)


def test_lagrangian_bound_reaches_the_lp_value_on_a_hand_case():
    # Experts 0 and 1 share the two one-slot classes (domains 0 and 1).  Net {0, 1} from domain 0
    # (weight 1) and from domain 1 (weight 2).  Every map splits the pair: 1 + 2 = 3 crossings.
    # LP: y0 >= x[e, 1], x[0, 1] + x[1, 1] = 1, so y0 >= 1/2; likewise y1 >= 1/2: 1/2 + 2/2 = 1.5.
    nets = NetSet(np.array([[0, 1], [0, 1]]), np.array([0, 0]), np.array([0, 1]), np.array([1, 2]))
    problem = _two_expert_layer(nets)
    lag = lagrangian_bound(problem, nets, None)
    assert lag.crossings == pytest.approx(1.5)
    assert bound_to_crossings(lag.crossings) == 2
    assert min(net_crossings(nets, m, problem.class_sig, "per_domain") for m in (np.array([0, 1]), np.array([1, 0]))) == 3


def test_group_assignment_bound_is_exact_on_whole_groups_by_hand():
    # Four experts in two groups of two; each group position lies in one domain.  Net {0, 1} (group 0)
    # from domain 0 weight 5; net {2, 3} (group 1) from domain 0 weight 1; net {0, 2} from domain 1
    # weight 2.  Group 0 on domain 0: 0 + 1 + 2 = 3; group 0 on domain 1: 5 + 0 + 2 = 7.  Bound 3.
    nets = NetSet(np.array([[0, 1], [2, 3], [0, 2]]), np.array([0, 0, 0]), np.array([0, 0, 1]),
                  np.array([5, 1, 2]))
    problem = _two_expert_layer(nets, group_preserving=True)
    gb = group_assignment_bound(problem, nets)
    assert gb is not None and gb.crossings == 3.0
    costs = [net_crossings(nets, np.array(m), problem.class_sig, "per_domain") for m in ([0, 0, 1, 1], [1, 1, 0, 0])]
    assert min(costs) == 3


# ---------------------------------------------------------------------------------------------
# The committed instances: the raw bound is at most the crossings of the maps the solver finds
# ---------------------------------------------------------------------------------------------
# dsv3_ep256's first straddling layer takes about ten times as long for its group-preserving bound
# as dsv3_256's (measured 298 s against 28.5 s on a loaded 2-core machine; the same 8! assignments
# and 8,192 nets): the same code, checked on dsv3_256 and dsv3_1024.
GP_UNCHECKED = {"dsv3_ep256"}
COMMITTED = sorted(p.stem for p in INSTANCES.glob("*.json")
                   if json.loads(p.read_text()).get("kind") not in ("job", "cluster"))  # plan inputs are no instances


def _first_and_last_straddling(inst, r2g, gp):
    """The first and the last MoE layer whose stage straddles domains (their problems)."""
    out = []
    for order in (range(inst.model.num_moe_layers), reversed(range(inst.model.num_moe_layers))):
        for li in order:
            p = build_layer_problem(inst, r2g, li, group_preserving=gp)
            if not p.trivial:
                if not out or out[0].layer != li:
                    out.append(p)
                break
    return out


@pytest.mark.parametrize("name", COMMITTED)
def test_bounds_are_at_most_the_solvers_maps_on_committed_instances(name):
    inst = read_instance(INSTANCES / f"{name}.json")
    r2g = default_rank2gpu(inst)
    modes = [False, True] if inst.model.num_groups > 1 else [False]
    checked_gp = False
    for gp in modes:
        # Group-preserving bounds enumerate every class-to-group assignment (8! = 40,320 on the
        # dsv3 instances): one straddling layer checks that path, except on GP_UNCHECKED.
        layers = _first_and_last_straddling(inst, r2g, gp)
        if gp:
            layers = [] if name in GP_UNCHECKED else layers[:1]
            checked_gp = bool(layers) and num_group_assignments(layers[0]) == 40_320
        for p in layers:
            nets = p.nets_all
            cap = p.load_cap(0.10)
            greedy = capped_greedy(p, linear_costs(p, nets), cap)
            maps = [p.default_expert2class] + ([SwapSearch(p, nets).run(greedy, cap)] if greedy is not None else [])
            best = min(net_crossings(nets, m, p.class_sig, p.cost_mode) for m in maps)
            if p.cost_mode == "per_pair":
                b = per_pair_class_bound(p, nets, None).bound
                assert b is not None and b <= best + 1e-6
                continue
            lb = layer_lower_bound(p, nets, None)
            assert bound_to_crossings(lb.crossings) <= best, (name, gp, p.layer, lb.info, best)
            assert lb.crossings > 0  # a straddling layer with sampled tokens has a positive bound
    if name in ("dsv3_256", "dsv3_1024"):
        assert checked_gp  # the group-preserving path, over all 8! assignments, on committed instances


def test_tiny_solve_reports_a_bound_on_every_layer_below_its_crossings(tiny):
    for gp in (False, True):
        opts = SolveOptions(time_limit_s=30, seed=0, num_workers=1, group_preserving=gp)
        plan = place_experts(tiny, default_rank2gpu(tiny), opts, deadline=time.monotonic() + 60)
        assert plan.details["layers_without_bound"] == 0 and plan.bound_bytes is not None
        assert plan.bound_bytes <= plan.objective_bytes + 1e-6
        for d in plan.details["layers"]:
            if d["status"] == "trivial":
                continue
            raw = d["lower_bound"]["lower_bound_crossings"]
            assert bound_to_crossings(raw) <= d["objective_crossings"]
