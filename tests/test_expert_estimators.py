"""The expert placer's estimators against the evaluator, on random layouts with several EP groups
per stage, both cost modes.

The expert side estimates two things for speed and both are exact, not approximate: a map's
crossings times ``LayerProblem.bytes_per_crossing`` (from ``placement.predict.cost.fabric_bytes_per_crossing``)
are the evaluator's cross-domain bytes of the layer, and the class loads, balanced onto GPUs and
measured by ``rank_load_ratio``, are the evaluator's expert load max/mean of the layer.  (The expert
side estimates no all-to-all time; times come from the evaluator only.)
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from placement.predict.cost import evaluate
from placement.core.model import Placement
from solvers.experts import balance_ranks, build_layer_problem, greedy_expert_domains, net_crossings, rank_load_ratio
from tests.conftest import random_instance


def _instance(seed: int, mode: str, tp: int, dp: int):
    rng = np.random.default_rng(seed)
    inst = random_instance(rng, num_experts=8, top_k=3, ep=2, dp=dp, tp=tp, pp=2, num_domains=3,
                           trays_per_domain=2, gpus_per_tray=2 * tp, tokens=9, moe_layers=3, cost_mode=mode)
    r2g = rng.permutation(inst.cluster.num_gpus)[: inst.parallel.world_size]
    return rng, inst, r2g


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), mode=st.sampled_from(["per_domain", "per_pair"]), tp=st.sampled_from([1, 2]),
       dp=st.sampled_from([4, 6]))
def test_crossings_times_bytes_per_crossing_and_class_loads_are_the_evaluators(seed, mode, tp, dp):
    rng, inst, r2g = _instance(seed, mode, tp, dp)
    E = inst.model.num_experts
    phy2log = np.stack([rng.permutation(E) for _ in range(inst.model.num_moe_layers)])
    metrics = evaluate(inst, Placement(r2g, phy2log))
    e2r = Placement(r2g, phy2log).expert2eprank(inst.experts_per_rank)
    for li in range(inst.model.num_moe_layers):
        problem = build_layer_problem(inst, r2g, li, group_preserving=False, validation_fraction=0)
        assert problem.num_ep_groups == dp * tp // 2 >= 2  # several EP groups share the stage's map
        e2c = problem.rank2class[e2r[li]]
        got = net_crossings(problem.nets_all, e2c, problem.class_sig, mode) * problem.bytes_per_crossing
        assert got == pytest.approx(metrics.cross_domain_bytes_per_layer[li], rel=1e-12, abs=1e-6)
        expert2slot = np.argsort(phy2log[li])
        assert rank_load_ratio(problem, expert2slot) == pytest.approx(metrics.expert_load_max_over_mean_per_layer[li],
                                                                     rel=1e-12)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), mode=st.sampled_from(["per_domain", "per_pair"]), ls=st.booleans())
def test_the_quick_map_scores_what_the_evaluator_scores(seed, mode, ls):
    """``greedy_expert_domains`` (what a rank-layout search may price layouts with) reports the
    evaluator's bytes and, after balancing, the evaluator's load max/mean for its own map."""
    rng, inst, r2g = _instance(seed, mode, 1, 4)
    E, L = inst.model.num_experts, inst.model.num_moe_layers
    phy2log = np.tile(np.arange(E), (L, 1))
    quick = []
    for li in range(L):
        problem = build_layer_problem(inst, r2g, li, group_preserving=False)
        g = greedy_expert_domains(problem, load_tolerance=0.2, local_search=ls)
        slots = balance_ranks(problem, g.expert2class)
        phy2log[li, slots] = np.arange(E)
        quick.append((g.cost_bytes, rank_load_ratio(problem, slots)))
    metrics = evaluate(inst, Placement(r2g, phy2log))
    for li, (cost_bytes, ratio) in enumerate(quick):
        assert cost_bytes == pytest.approx(metrics.cross_domain_bytes_per_layer[li], rel=1e-12, abs=1e-6)
        assert ratio == pytest.approx(metrics.expert_load_max_over_mean_per_layer[li], rel=1e-12)
