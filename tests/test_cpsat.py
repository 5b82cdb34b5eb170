"""The registered solver ``cpsat`` end to end: valid, scored by the evaluator, bounded, reproducible."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import placement
from placement.core.checker import check
from placement.cli import main
from placement.predict.cost import evaluate
from placement.formats import write_instance
from solvers.default import default_rank2gpu
from tests.conftest import INSTANCES, random_instance


def _keeps_groups(phy2log: np.ndarray, num_experts: int, num_groups: int) -> bool:
    """Computed here: every group position (E/G contiguous slots) holds experts of one expert group."""
    size = num_experts // num_groups
    return all(len({int(e) // size for e in row[p * size:(p + 1) * size]}) == 1
               for row in np.asarray(phy2log) for p in range(num_groups))


@pytest.mark.parametrize("mode", ["per_domain", "per_pair"])
def test_cpsat_on_tiny_is_valid_scored_by_the_evaluator_and_bounded(tiny, mode):
    inst = tiny.with_cost_mode(mode)
    # group_preserving on: with layout="fixed" the default is free (serving consumers map experts themselves)
    # pipeline_split=False: the solver's bytes are counted on the instance's layer split, which a
    # chosen split would change (placement.predict.pipeline_split moves MoE layers between stages)
    result = placement.solve(inst, solver="cpsat", time_limit_s=20, seed=0, num_workers=1, layout="fixed",
                             group_preserving=True, pipeline_split=False)
    pl = result.placement
    assert check(inst, pl) == []
    assert np.array_equal(pl.rank2gpu, default_rank2gpu(inst))  # --layout fixed keeps the default layout
    assert result.objective_bytes == pytest.approx(evaluate(inst, pl).cross_domain_bytes_per_step, rel=1e-12)
    assert result.objective_bytes == pytest.approx(result.metrics["cross_domain_bytes_per_step"], rel=1e-12)
    layers = result.details["layers"]
    if result.bound_bytes is not None:
        assert result.bound_bytes <= result.objective_bytes * (1 + 1e-12)
    proved = all(d["status"] in ("optimal", "trivial") for d in layers)
    assert (result.status == "optimal") == proved
    if proved:
        assert result.bound_bytes == pytest.approx(result.objective_bytes)
    # group preservation asked for: it holds
    assert result.group_preserving and _keeps_groups(pl.phy2log, inst.model.num_experts, inst.model.num_groups)
    for d in layers:  # never worse than the default on the validation part
        if d["status"] != "trivial":
            assert d["validation_crossings"] <= d["default_validation_crossings"]
    for key in ("class_load_tolerance", "gpu_load_tolerance", "validation_fraction", "det_per_wall_s", "seed",
                "num_workers", "group_preserving", "layout", "consumer"):
        assert key in result.params


@pytest.mark.parametrize("apply", ["checkpoint", "runtime"])
def test_cpsat_with_the_rank_layout_search_is_valid_and_scored(tiny, apply):
    """Applied by a checkpoint permutation, maps keep groups whole (group-limited routing); applied
    at run time (the default) they may break them (the step-time check weighs free candidates), and
    the result says which it is."""
    result = placement.solve(tiny, solver="cpsat", time_limit_s=20, seed=0, num_workers=1, apply=apply)
    assert check(tiny, result.placement) == []
    assert result.objective_bytes == pytest.approx(result.metrics["cross_domain_bytes_per_step"], rel=1e-12)
    keeps = _keeps_groups(result.placement.phy2log, tiny.model.num_experts, tiny.model.num_groups)
    assert result.group_preserving == keeps
    assert result.params["group_preserving"] == (apply == "checkpoint")
    assert result.params["fit_groups_whole"] is True  # one sampled window: groups fitted whole either way
    candidates = result.details["step_time_check"]["candidates"]
    if apply == "checkpoint":
        assert keeps
        assert not any("rebalanced" in name or "balanced packing" in name for name in candidates)


def test_group_preservation_off_is_reported_truthfully(tiny):
    result = placement.solve(tiny, solver="cpsat", time_limit_s=20, seed=0, num_workers=1, layout="fixed",
                             group_preserving=False)
    assert check(tiny, result.placement) == []
    m = tiny.model
    assert result.group_preserving == _keeps_groups(result.placement.phy2log, m.num_experts, m.num_groups)


@pytest.mark.parametrize("seed,tokens", [(4, 8), (5, 8), (2, 12), (13, 12)])
def test_never_worse_than_the_default_on_the_validation_part_of_a_random_instance(seed, tokens):
    """The documented guarantee, measured by the evaluator: on each source's last quarter of sampled
    tokens (the validation part, which a layer's choice must not make worse), every layer's bytes are
    at most the default placement's (same rank layout: ``layout="fixed"``, whose EP groups straddle
    domains here).  Choosing on the fit part instead breaks it on these seeds."""
    from solvers.experts import VALIDATION_FRACTION

    rng = np.random.default_rng(seed)
    inst = random_instance(rng, num_experts=8, top_k=2, ep=4, dp=4, pp=2, num_domains=3, trays_per_domain=3,
                           gpus_per_tray=1, tokens=tokens, moe_layers=2)
    result = placement.solve(inst, solver="cpsat", time_limit_s=20, seed=0, num_workers=1, layout="fixed")
    assert any(d["status"] != "trivial" for d in result.details["layers"])
    base = placement.solve(inst, solver="default", time_limit_s=20, seed=0)
    assert check(inst, result.placement) == []
    T = inst.routing.tokens_per_source
    n_val = int(np.floor(T * VALIDATION_FRACTION))
    assert inst.parallel.tp * inst.parallel.cp == 1  # a token's source does not depend on its index here
    val = dataclasses.replace(inst, routing=dataclasses.replace(inst.routing, topk=inst.routing.topk[:, :, T - n_val:]))
    ours = evaluate(val, result.placement).cross_domain_bytes_per_layer
    default = evaluate(val, base.placement).cross_domain_bytes_per_layer
    assert all(a <= b * (1 + 1e-12) for a, b in zip(ours, default)), (ours, default)


def test_two_runs_with_the_same_seed_write_identical_files(tmp_path):
    """Byte for byte, through the CLI (layout fixed: the layout search's own details carry wall times,
    see tests/test_api.py).  The pool path is compared with the in-process one in test_experts.py."""
    paths = [tmp_path / f"run{i}.json" for i in range(2)]
    for p in paths:
        code = main(["solve", str(INSTANCES / "tiny.json"), "-o", str(p), "--solver", "cpsat", "--seed", "7",
                     "--time-limit", "15", "--workers", "2", "--layout", "fixed"])
        assert code == 0
    assert paths[0].read_bytes() == paths[1].read_bytes()


def test_an_instance_written_and_read_back_solves_the_same(tmp_path, tiny):
    path = tmp_path / "tiny_copy.json"
    write_instance(tiny, path)
    a = placement.solve(placement.load_instance(path), solver="cpsat", time_limit_s=15, seed=2, num_workers=1,
                        layout="fixed")
    b = placement.solve(tiny, solver="cpsat", time_limit_s=15, seed=2, num_workers=1, layout="fixed")
    assert np.array_equal(a.placement.phy2log, b.placement.phy2log)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), ep=st.sampled_from([2, 4]))
def test_the_solvers_slice_rule_agrees_with_the_verifiers(seed, ep):
    """cpsat checks DeepEP's equal consecutive slices with its own code; the verifier has its own:
    on random layouts (and on layouts made of equal slices) the two agree on every EP group."""
    from placement.core.checker import deepep_violations
    from placement.core.model import Placement
    from solvers.cpsat import equal_slices_breaks

    rng = np.random.default_rng(seed)
    inst = random_instance(rng, num_experts=8, top_k=2, ep=ep, dp=4, pp=2, num_domains=3, trays_per_domain=2,
                           gpus_per_tray=2)
    world = inst.parallel.world_size
    if rng.random() < 0.5:
        r2g = rng.permutation(inst.cluster.num_gpus)[:world]
    else:
        r2g = np.sort(rng.permutation(inst.cluster.num_gpus)[:world])  # sorted: often equal slices
    ours = equal_slices_breaks(inst, r2g)
    theirs = deepep_violations(inst, Placement(r2g, np.tile(np.arange(8), (inst.model.num_moe_layers, 1))))
    assert [m.split(":")[0] for m in ours] == [m.split(":")[0] for m in theirs]
