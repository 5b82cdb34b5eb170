"""The ``step_time`` objective (the default): the rank layout ranks every candidate by predicted
step time, the solver never returns a placement predicting a slower step than the default one,
and an instance without a ``performance`` block falls back to ``total`` and says so.

Predicted step times are recomputed here independently, from :func:`placement.predict.cost.evaluate` and
:class:`placement.predict.performance.StepTimeModel`.
"""

from __future__ import annotations

import dataclasses
import inspect
import json

import numpy as np
import pytest

from placement.predict.cost import evaluate
from placement.core.model import Instance, Placement
from placement.predict.performance import StepTimeModel
from solvers.base import OBJECTIVES, SolveOptions
from solvers.default import default_rank2gpu
from tests.conftest import INSTANCES, random_instance

TOL = 1e-12


def _identity(inst: Instance) -> np.ndarray:
    m = inst.model
    return np.tile(np.arange(m.num_experts, dtype=np.int64), (m.num_moe_layers, 1))


def _step_s(inst: Instance, placement: Placement) -> float:
    return StepTimeModel(inst).step_time_s(evaluate(inst, placement), placement.rank2gpu)


def _default_step_s(inst: Instance) -> float:
    return _step_s(inst, Placement(default_rank2gpu(inst), _identity(inst)))


def _with_performance(inst: Instance, tiny: Instance) -> Instance:
    # tiny's block says hybridep, which dispatches in BF16 (placement.core.model.Instance refuses FP8 bytes there)
    model = dataclasses.replace(inst.model, dispatch_bytes_per_token=2 * inst.model.hidden_size)
    return dataclasses.replace(inst, model=model, performance=tiny.performance)


def _plan(inst: Instance, **kw):
    import time

    from solvers.layout import plan_layout

    opts = SolveOptions(time_limit_s=20.0, num_workers=1, **kw)
    return plan_layout(inst, opts, deadline=time.monotonic() + 60.0)


def test_step_time_is_the_default_everywhere():
    from placement import api
    from placement.cli import build_parser

    assert OBJECTIVES[0] == "step_time" and set(OBJECTIVES) == {"step_time", "total", "bottleneck"}
    assert SolveOptions().objective == "step_time"
    assert inspect.signature(api.solve).parameters["objective"].default == "step_time"
    args = build_parser().parse_args(["solve", str(INSTANCES / "tiny.json")])
    assert args.objective == "step_time"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_layout_pick_is_the_fastest_predicted_candidate(tiny, seed):
    rng = np.random.default_rng(seed)
    inst = _with_performance(random_instance(rng, pp=2, moe_layers=4, num_domains=3, tokens=8), tiny)
    if seed == 2:  # two GPUs of the first domain down: the default layout is not the packed one
        avail = inst.cluster.available.copy()
        avail[:2] = False
        inst = dataclasses.replace(inst, cluster=dataclasses.replace(inst.cluster, available=avail))
    plan = _plan(inst)
    d = plan.details
    assert d["ranked_by"] == "step_time" and "step_time_fallback" not in d
    chosen_s = _step_s(inst, Placement(plan.rank2gpu, plan.phy2log))
    cands = d["candidates"]
    predicted = {name: c["predicted_step_time_s"] for name, c in cands.items() if "predicted_step_time_s" in c}
    # both byte searches ran and every candidate was scored by predicted step time
    assert any(n.startswith("total: ") for n in predicted) and any(n.startswith("bottleneck: ") for n in predicted)
    assert "default, contiguous experts" in predicted
    assert chosen_s == pytest.approx(cands[d["chosen"]]["predicted_step_time_s"], rel=1e-12)
    assert all(chosen_s <= s + TOL for s in predicted.values())
    assert chosen_s <= _default_step_s(inst) + TOL


def test_solve_never_predicts_slower_than_default(tiny):
    from placement import api

    r = api.solve(tiny, time_limit_s=30.0, num_workers=1)
    assert r.params["objective"] == "step_time"
    solved_s = _step_s(tiny, r.placement)
    check = r.details["step_time_check"]
    assert check["predicted_step_time_s"] == pytest.approx(solved_s, rel=1e-12)
    assert solved_s <= _default_step_s(tiny) + TOL
    if "layout_map_predicted_step_time_s" in check:
        assert solved_s <= check["layout_map_predicted_step_time_s"] + TOL
    # The metrics are those of the pipeline split the solve chose (placement.predict.pipeline_split), never
    # slower than the instance's split on the same placement.
    from placement.core.pipeline_layout import parse_layout, with_layout

    split = with_layout(tiny, parse_layout(r.details["pipeline_layout"]["chosen"]))
    assert r.metrics["predicted_step_time_s"] == pytest.approx(_step_s(split, r.placement), rel=1e-12)
    assert r.metrics["predicted_step_time_s"] <= solved_s + TOL


def test_step_time_check_returns_the_default_when_the_solved_placement_is_slower(tiny):
    from solvers.cpsat import step_time_check

    default = Placement(default_rank2gpu(tiny), _identity(tiny))
    default_s = _step_s(tiny, default)
    rng = np.random.default_rng(0)
    # apply=checkpoint: no balanced packings among the candidates (they break expert groups); the
    # runtime default adds them (tests/test_regret.py)
    opts = SolveOptions(objective="step_time", apply="checkpoint")
    found_slower = False
    for _ in range(20):
        r2g = rng.permutation(np.flatnonzero(tiny.cluster.available))[: tiny.parallel.world_size]
        p2l = np.stack([rng.permutation(tiny.model.num_experts) for _ in range(tiny.model.num_moe_layers)])
        bad = Placement(r2g.astype(np.int64), p2l)
        bad_s = _step_s(tiny, bad)
        check = step_time_check(tiny, opts, bad, {})
        assert check["default_predicted_step_time_s"] == pytest.approx(default_s, rel=1e-12)
        assert check["fallback_to_default"] == (check["returned"] == "default placement")
        cands = check["candidates"]
        ret = cands[check["returned"]]
        # never a worse worst ratio over the settings than the default placement's (gain_kept 1: one window)
        assert ret["worst_ratio"] >= cands["default placement"]["worst_ratio"] * (1 - 1e-9)
        assert check["predicted_step_time_s"] == ret["predicted_step_time_s"]["mid"]
        if bad_s > default_s * (1 + 1e-9) + 1e-12:
            found_slower = True
            assert check["solved_predicted_step_time_s"] == pytest.approx(bad_s, rel=1e-12)
            assert check["returned"] != "solved" and check["predicted_step_time_s"] <= default_s * (1 + 1e-9)
            if check["returned"] == "default placement":
                assert np.array_equal(check["return_placement"].rank2gpu, default.rank2gpu)
                assert np.array_equal(check["return_placement"].phy2log, default.phy2log)
        elif check["returned"] == "solved":
            assert "return_placement" not in check
    assert found_slower  # random placements of tiny include slower ones: the branch is exercised
    assert step_time_check(tiny, SolveOptions(objective="total"), default, {}) == {}


def test_step_time_is_deterministic_on_the_same_file():
    from placement import api
    from placement.formats import read_instance

    runs = []
    for _ in range(2):
        inst = read_instance(INSTANCES / "tiny.json")
        r = api.solve(inst, time_limit_s=30.0, num_workers=1, seed=3)
        runs.append((r.placement.rank2gpu.tobytes(), r.placement.phy2log.tobytes(),
                     json.dumps(r.details["layout"], sort_keys=True, default=str)))
    assert runs[0] == runs[1]


def test_without_performance_block_step_time_falls_back_to_total_and_says_so(tiny):
    inst = dataclasses.replace(tiny, performance=None)
    plan = _plan(inst)
    assert plan.details["ranked_by"] == "total"
    assert "falls back to total" in plan.details["step_time_fallback"]
    total = _plan(inst, objective="total")
    assert np.array_equal(plan.rank2gpu, total.rank2gpu)
    assert np.array_equal(plan.phy2log, total.phy2log)

    from solvers.cpsat import step_time_check

    check = step_time_check(inst, SolveOptions(), Placement(plan.rank2gpu, plan.phy2log), plan.details)
    assert "skipped" in check


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_balance_within_classes_keeps_bytes_and_groups(seed):
    from solvers.kernels import keeps_expert_groups
    from solvers.layout.plan import balance_within_classes

    rng = np.random.default_rng(seed)
    inst = random_instance(rng, num_experts=8, top_k=2, ep=4, dp=4, pp=2, moe_layers=4, num_groups=4,
                           groups_per_token=2, tokens=10)
    r2g = rng.permutation(inst.cluster.num_gpus)[: inst.parallel.world_size].astype(np.int64)
    gs = inst.model.experts_per_group
    p2l = np.stack([np.concatenate([np.arange(g * gs, (g + 1) * gs)[rng.permutation(gs)]
                                    for g in rng.permutation(inst.model.num_groups)])
                    for _ in range(inst.model.num_moe_layers)])
    for group_size in (None, gs):
        out = balance_within_classes(inst, r2g, p2l, group_size=group_size)
        assert all(sorted(row.tolist()) == list(range(inst.model.num_experts)) for row in out)
        before, after = evaluate(inst, Placement(r2g, p2l)), evaluate(inst, Placement(r2g, out))
        assert after.cross_domain_bytes_per_step == pytest.approx(before.cross_domain_bytes_per_step, rel=1e-12)
        if group_size:
            assert keeps_expert_groups(out, gs)
