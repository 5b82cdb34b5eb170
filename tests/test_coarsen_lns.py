"""The co-activation starts (solvers/experts/coarsen.py) and the large-neighbourhood search
(solvers/experts/lns.py).

The starts must be valid class maps (exact class capacities, the layer's load caps, whole expert
groups in group-preserving mode) on hypothesis-generated small problems; the search never returns
worse than its incumbent, equals brute force on small layers, and is deterministic.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from placement.core.model import InvalidInputError
from solvers.experts import build_layer_problem, linear_costs, net_crossings
from solvers.experts.budget import StopCheck
from solvers.experts.coarsen import (
    coactivation_graph,
    coarse_nets,
    coarsen_start,
    kahypar_available,
    kahypar_start,
    matching_levels,
    to_valid_map,
)
from solvers.experts.lns import lns_search, neighbourhood
from solvers.experts.problem import NetSet, is_structurally_valid
from tests.conftest import random_instance
from tests.test_experts import _all_class_maps, _group_preserving


def _problem(seed: int, *, group_preserving: bool = False, num_experts: int = 16, ep: int = 8, mode: str = "per_domain",
             layer: int = 0):
    rng = np.random.default_rng(seed)
    groups = 4 if group_preserving else 1
    inst = random_instance(rng, num_experts=num_experts, top_k=3, ep=ep, dp=ep, pp=1, num_domains=3,
                           trays_per_domain=2, gpus_per_tray=max(2, ep // 4), tokens=12, moe_layers=1,
                           num_groups=groups, groups_per_token=2 if groups > 1 else 1, cost_mode=mode)
    r2g = rng.permutation(inst.cluster.num_gpus)[: inst.parallel.world_size]
    return build_layer_problem(inst, r2g, layer, group_preserving=group_preserving)


def _cap(problem, tol: float = 0.5):
    return problem.load_cap(max(tol, problem.load_excess(problem.default_expert2class)))


def _valid(problem, e2c, cap) -> bool:
    return is_structurally_valid(problem, e2c) and problem.within_caps(e2c, cap)


# ---------------------------------------------------------------------------------------------
# The graph, the matching and the coarse nets
# ---------------------------------------------------------------------------------------------
def test_coactivation_graph_is_the_clique_expansion():
    experts = np.array([[0, 1, 2], [0, 1, 3], [1, 2, 3]])
    nets = NetSet.aggregate(experts, np.zeros(3, dtype=np.int64), np.zeros(3, dtype=np.int64))
    W = coactivation_graph(nets, 4)
    want = np.zeros((4, 4))
    for row in experts:  # by hand: every pair of a 3-pin net weighs 1 / 2
        for i in row:
            for j in row:
                if i != j:
                    want[i, j] += 0.5
    np.testing.assert_allclose(W, want)
    assert W.sum() == pytest.approx(len(experts) * 3)  # each net keeps its total weight (3 pins x 1)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), levels=st.integers(1, 3))
def test_matching_levels_give_equal_nested_nodes(seed, levels):
    rng = np.random.default_rng(seed)
    E = 16
    W = rng.random((E, E)) * (rng.random((E, E)) < 0.5)
    W = W + W.T
    np.fill_diagonal(W, 0)
    out = matching_levels(W, levels)
    for li, e2v in enumerate(out, start=1):
        assert np.array_equal(np.bincount(e2v), np.full(E // 2 ** li, 2 ** li))  # every node 2^l experts
        if li > 1:  # nested: a node is the union of two nodes of the level below
            below = out[li - 2]
            assert all(len(set(e2v[below == v])) == 1 for v in range(E // 2 ** (li - 1)))


@pytest.mark.parametrize("mode", ["per_domain", "per_pair"])
def test_coarse_nets_cost_what_their_experts_cost(mode):
    p = _problem(3, mode=mode)
    W = coactivation_graph(p.nets_fit, p.num_experts)
    rng = np.random.default_rng(0)
    for e2v in matching_levels(W, 2):
        V = int(e2v.max()) + 1
        cn = coarse_nets(p.nets_fit, e2v, V, mode)
        for _ in range(5):
            v2c = rng.integers(p.num_classes, size=V)
            e2c = v2c[e2v]
            ext = np.concatenate([v2c, [0]])  # the pad: its class never matters, it sits at the source
            sig = np.vstack([p.class_sig, np.zeros((1, p.num_ep_groups), dtype=np.int64)])
            dom = np.where(cn.experts == V, cn.src[:, None], sig[ext[cn.experts], cn.group[:, None]])
            from solvers.kernels import net_crossings_of

            got = net_crossings_of(dom, cn.src, cn.weight, mode)
            assert got == net_crossings(p.nets_fit, e2c, p.class_sig, mode)


# ---------------------------------------------------------------------------------------------
# The starts are valid class maps
# ---------------------------------------------------------------------------------------------
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), gp=st.booleans(), tol=st.sampled_from([0.05, 0.2, 1.0]),
       mode=st.sampled_from(["per_domain", "per_pair"]))
def test_coarsened_start_is_a_valid_class_map(seed, gp, tol, mode):
    p = _problem(seed, group_preserving=gp, mode=mode)
    if p.trivial:
        return
    cap = _cap(p, tol)
    cost = linear_costs(p, p.nets_fit)
    m = coarsen_start(p, p.nets_fit, cap, cost)
    if m is not None:
        assert _valid(p, m, cap)
        if gp:
            assert _group_preserving(p, m)
    assert coarsen_start(p, p.nets_fit, cap, cost) is None if m is None else \
        np.array_equal(coarsen_start(p, p.nets_fit, cap, cost), m)  # deterministic


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), gp=st.booleans())
def test_to_valid_map_keeps_a_valid_map_and_repairs_any_other(seed, gp):
    p = _problem(seed, group_preserving=gp)
    if p.trivial:
        return
    cap = _cap(p, 0.2)
    cost = linear_costs(p, p.nets_fit)
    rng = np.random.default_rng(seed)
    target = rng.integers(p.num_classes, size=p.num_experts)
    m = to_valid_map(p, target, cap, cost)
    assert m is None or _valid(p, m, cap)
    d = p.default_expert2class
    if _valid(p, d, cap):
        assert np.array_equal(to_valid_map(p, d, cap, cost), d)


@pytest.mark.skipif(not kahypar_available(), reason="Mt-KaHyPar (the peers extra) is not installed")
@pytest.mark.parametrize("gp", [False, True])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_kahypar_start_is_a_valid_deterministic_class_map(seed, gp):
    p = _problem(seed, group_preserving=gp)
    if p.trivial:
        pytest.skip("one class")
    cap = _cap(p, 0.2)
    cost = linear_costs(p, p.nets_fit)
    a = kahypar_start(p, p.nets_fit, cap, cost, seed=0)
    b = kahypar_start(p, p.nets_fit, cap, cost, seed=0)
    assert a is not None and _valid(p, a, cap)
    if gp:
        assert _group_preserving(p, a)
    assert np.array_equal(a, b)


# ---------------------------------------------------------------------------------------------
# Large-neighbourhood search
# ---------------------------------------------------------------------------------------------
def _never_stop() -> StopCheck:
    return StopCheck(time.monotonic() + 600)


@pytest.mark.parametrize("mode", ["per_domain", "per_pair"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_lns_on_a_small_layer_is_the_brute_force_optimum(seed, mode):
    p = _problem(seed, num_experts=8, ep=4, mode=mode)
    if p.trivial:
        pytest.skip("one class")
    cap = _cap(p, 0.3)
    start = p.default_expert2class
    r = lns_search(p, p.nets_all, cap, start, deterministic_time=5.0, seed=0, stop=_never_stop())
    space = [m for m in _all_class_maps(p.class_capacity) if (p.class_loads(m) <= cap).all()]
    best = min(net_crossings(p.nets_all, m, p.class_sig, mode) for m in space)
    assert r.crossings == best == net_crossings(p.nets_all, r.expert2class, p.class_sig, mode)
    assert _valid(p, r.expert2class, cap)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000), gp=st.booleans())
def test_lns_never_worse_than_its_incumbent_valid_and_deterministic(seed, gp):
    p = _problem(seed, group_preserving=gp, num_experts=32, ep=8)
    if p.trivial:
        return
    cap = _cap(p, 0.2)
    start = p.default_expert2class
    v0 = net_crossings(p.nets_fit, start, p.class_sig, p.cost_mode)
    a = lns_search(p, p.nets_fit, cap, start, deterministic_time=0.3, seed=seed, stop=_never_stop())
    b = lns_search(p, p.nets_fit, cap, start, deterministic_time=0.3, seed=seed, stop=_never_stop())
    assert a.crossings <= v0
    assert a.crossings == net_crossings(p.nets_fit, a.expert2class, p.class_sig, p.cost_mode)
    assert _valid(p, a.expert2class, cap)
    if gp:
        assert _group_preserving(p, a.expert2class)
    if not (a.facts["wall_clock_cut"] or b.facts["wall_clock_cut"]):  # the safety net fired: a loaded machine
        assert np.array_equal(a.expert2class, b.expert2class) and a.facts == b.facts


def test_neighbourhoods_free_whole_groups_in_group_preserving_mode():
    p = _problem(5, group_preserving=True, num_experts=32, ep=8)
    W = coactivation_graph(p.nets_fit, p.num_experts)
    rng = np.random.default_rng(0)
    for kind in ("coactivation", "classes", "triple"):
        free = neighbourhood(p, W, p.default_expert2class, kind, rng, 6)
        groups = np.unique(p.expert2group[free])
        assert groups.shape[0] >= 2
        assert all(free[p.expert2group == g].all() for g in groups)  # whole groups only


def test_lns_stops_at_once_past_its_deadline():
    p = _problem(2, num_experts=32, ep=8)
    cap = _cap(p, 0.2)
    r = lns_search(p, p.nets_fit, cap, p.default_expert2class, deterministic_time=5.0, seed=0,
                   stop=StopCheck(time.monotonic() - 1))
    assert r.facts["rounds_run"] == 0 and np.array_equal(r.expert2class, p.default_expert2class)


# ---------------------------------------------------------------------------------------------
# The mode when nothing is said, and the overrides
# ---------------------------------------------------------------------------------------------
def test_group_preserving_default_follows_the_apply_mode(tiny):
    import dataclasses

    from placement.cli import build_parser
    from solvers.base import SolveOptions, group_preserving_default, resolve_apply

    assert tiny.model.group_limited and tiny.apply is None
    assert resolve_apply(tiny) == "runtime"  # not stated: the dispatch-time map
    assert group_preserving_default(tiny, "checkpoint") and not group_preserving_default(tiny, "runtime")
    assert not group_preserving_default(tiny)
    assert group_preserving_default(dataclasses.replace(tiny, apply="checkpoint"))  # the instance says it
    assert not group_preserving_default(dataclasses.replace(tiny, apply="checkpoint"), "runtime")  # the caller wins
    assert SolveOptions(apply="checkpoint").group_preserving_for(tiny)
    assert not SolveOptions().group_preserving_for(tiny)
    assert SolveOptions(apply="runtime", group_preserving=True).group_preserving_for(tiny)  # explicit wins
    assert not SolveOptions(apply="checkpoint", group_preserving=False).group_preserving_for(tiny)
    free = random_instance(np.random.default_rng(0), num_groups=2, groups_per_token=2)  # not group-limited
    assert not group_preserving_default(free, "checkpoint")
    parse = build_parser().parse_args
    assert parse(["solve", "x.json", "--free"]).group_preserving == "off"
    assert parse(["solve", "x.json"]).group_preserving == "auto" and parse(["solve", "x.json"]).apply is None
    assert parse(["solve", "x.json", "--group-preserving", "on"]).group_preserving == "on"
    assert parse(["solve", "x.json", "--apply", "checkpoint"]).apply == "checkpoint"


def test_checkpoint_apply_solves_group_preserving_maps_and_refuses_free_ones(tiny):
    import placement
    from placement.core.checker import violates_group_preservation

    r = placement.solve(tiny, time_limit_s=10, seed=0, num_workers=1, apply="checkpoint")
    assert violates_group_preservation(tiny, r.placement) == [] and r.params["apply"] == "checkpoint"
    with pytest.raises(InvalidInputError, match="group_preserving: free maps cannot be applied by a checkpoint"):
        placement.solve(tiny, time_limit_s=10, num_workers=1, apply="checkpoint", group_preserving=False)
    with pytest.raises(InvalidInputError, match="apply: expected one of runtime, checkpoint"):
        placement.solve(tiny, time_limit_s=10, num_workers=1, apply="offline")  # type: ignore[arg-type]


def test_fixed_layout_fits_groups_whole_by_default_and_free_when_asked(tiny):
    """Any map is valid (apply runtime), but with one sampled window under group-limited routing the
    search fits group-preserving maps; ``group_preserving=False`` fits free ones."""
    import placement

    result = placement.solve(tiny, solver="cpsat", time_limit_s=20, seed=0, num_workers=1, layout="fixed")
    assert result.details["group_preserving"] is True
    assert result.params["group_preserving"] is False and result.params["fit_groups_whole"] is True
    free = placement.solve(tiny, solver="cpsat", time_limit_s=20, seed=0, num_workers=1, layout="fixed",
                           group_preserving=False)
    assert free.details["group_preserving"] is False and free.params["fit_groups_whole"] is False
