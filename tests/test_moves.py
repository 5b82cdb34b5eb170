"""Move-aware re-placement (placement/predict/moves.py, solvers/experts/moves.py): the accounting against an
independent count, the swap kernel's linear term against brute force, the budget never exceeded,
a zero budget returning the previous placement byte for byte, bad previous files exiting 2."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import placement
from placement.cli import main
from placement.core.model import InvalidInputError, Placement
from placement.predict.moves import (
    MoveRequest,
    count_moves,
    expert_params,
    parse_moved_bytes,
    replica_state_bytes,
    total_state_bytes,
)
from solvers.default import default_placement
from solvers.experts.moves import (
    MoveCandidate,
    MovePlan,
    MoveSwapKernel,
    allocate_moves,
    group_preserving_start,
    keep_previous_slots,
    keeps_group_types,
)
from solvers.experts.problem import build_layer_problem, is_structurally_valid
from tests.conftest import INSTANCES, random_instance, random_placement

PARAMS = 1000  # parameters per expert for instances without a performance block


def _independent_moves(inst, old: Placement, new: Placement) -> tuple[int, int]:
    """(cross-rack, NVLink) replicas moved, counted slot by slot from the definitions."""
    par, epr = inst.parallel, inst.experts_per_rank
    where: list[dict] = [{}, {}]
    for k, plc in enumerate((old, new)):
        for li in range(inst.model.num_moe_layers):
            s = int(inst.moe_layer2stage[li])
            for g, ranks in enumerate(par.stage_ep_groups[s]):
                for slot in range(inst.model.num_experts):
                    gpu = int(plc.rank2gpu[ranks[slot // epr]])
                    where[k][(li, g, int(plc.phy2log[li, slot]))] = gpu
    cross = nvl = 0
    for key, a in where[0].items():
        b = where[1][key]
        if a != b:
            if inst.cluster.gpu2domain[a] != inst.cluster.gpu2domain[b]:
                cross += 1
            else:
                nvl += 1
    return cross, nvl


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([(1, 4, 4), (1, 2, 4), (2, 2, 2)]))
def test_moves_match_an_independent_count(seed, shape):
    tp, ep, dp = shape
    rng = np.random.default_rng(seed)
    inst = random_instance(rng, tp=tp, ep=ep, dp=dp, num_experts=8)
    old, new = random_placement(rng, inst), random_placement(rng, inst)
    if seed % 2:  # same rank layout: only expert maps differ
        new = Placement(old.rank2gpu, new.phy2log)
    bpr = replica_state_bytes(inst, params=PARAMS)
    mc = count_moves(inst, old, new, bytes_per_replica=bpr)
    cross, nvl = _independent_moves(inst, old, new)
    assert (int(mc.cross_rack_per_layer.sum()), int(mc.nvlink_per_layer.sum())) == (cross, nvl)
    assert mc.moved_bytes == pytest.approx((cross + nvl) * bpr)
    assert count_moves(inst, old, old, bytes_per_replica=bpr).moved_replicas == 0


def test_replica_bytes_formula(tiny):
    # DeepSeek-V3's routed expert: 3 matrices of 7168 x 2048; BF16 weights, FP32 master and Adam moments
    p = 3 * 7168 * 2048
    assert p == 44_040_192
    inst = random_instance(np.random.default_rng(0), ep=4, dp=8, tp=1)  # 2 EP groups per stage
    assert inst.parallel.ep_groups_per_stage == 2
    assert replica_state_bytes(inst, params=p) == p * (2 + 12 / 2)
    assert replica_state_bytes(inst, params=p, sharded_optimizer=False) == p * 14
    arch = tiny.performance.architecture
    assert expert_params(tiny) == 3 * tiny.model.hidden_size * arch.moe_ffn_hidden_size
    with pytest.raises(InvalidInputError, match="performance"):
        expert_params(inst)
    assert parse_moved_bytes("10%", inst, 5.0) == pytest.approx(0.1 * total_state_bytes(inst, 5.0))
    with pytest.raises(InvalidInputError, match="--max-moved-bytes"):
        parse_moved_bytes("-3", inst, 5.0)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(["per_domain", "per_pair"]))
def test_swap_kernel_with_a_linear_cost_has_exact_deltas(seed, mode):
    rng = np.random.default_rng(seed)
    E, C, D, N, k = 8, 3, 3, 12, 3
    experts = np.sort(np.stack([rng.choice(E, k, replace=False) for _ in range(N)]), axis=1)
    ncd = rng.integers(0, D, size=(C, N))
    src = rng.integers(0, D, size=N)
    w = rng.integers(1, 5, size=N)
    lin = rng.integers(0, 7, size=(E, C)).astype(float)
    kern = MoveSwapKernel(experts, ncd, src, w, num_items=E, num_domains=D, cost_mode=mode, linear=lin)
    e2c = rng.integers(0, C, size=E)
    kern.init_state(e2c)
    for _ in range(6):
        e, f = (int(x) for x in rng.choice(E, 2, replace=False))
        before = kern.total(e2c)
        delta = kern.swap_delta(e2c, e, f)
        kern.apply(e2c, e, f)
        assert kern.total(e2c) - before == pytest.approx(delta)


def test_previous_classes_keep_the_previous_slots(tiny):
    rng = np.random.default_rng(3)
    prev = default_placement(tiny)
    for gp in (False, True):
        problem = build_layer_problem(tiny, prev.rank2gpu, 0, group_preserving=gp)
        slots = np.empty(tiny.model.num_experts, dtype=np.int64)
        row = np.arange(tiny.model.num_experts) if gp else rng.permutation(tiny.model.num_experts)
        slots[row] = np.arange(tiny.model.num_experts)
        out = keep_previous_slots(problem, problem.slot2class[slots], slots)
        assert np.array_equal(out, slots)


def test_a_free_previous_map_keeps_its_slots_in_a_group_preserving_problem(tiny):
    """The regression behind the free-map re-placement on tiny's small-node default layout: two
    experts of different groups and nodes swapped break every group's class make-up, and
    ``keep_previous_slots`` (through ``_bins``) raised 'fits no group position type'."""
    prev = default_placement(tiny)
    problem = build_layer_problem(tiny, prev.rank2gpu, 1, group_preserving=True)
    E = tiny.model.num_experts
    slots = np.arange(E)
    slots[[0, E - 1]] = slots[[E - 1, 0]]
    e2c = problem.slot2class[slots]
    assert not keeps_group_types(problem, e2c) and not is_structurally_valid(problem, e2c)
    assert np.array_equal(keep_previous_slots(problem, e2c, slots), slots)


def test_a_free_previous_map_re_placed_with_free_moves_gains_and_is_deterministic(tiny):
    """Re-placing from a free previous map on tiny's small-node default layout with free moves (the
    searches start at its nearest group-preserving map): a valid placement, no more sampled
    cross-domain bytes than the previous one, the same bytes twice."""
    from placement.predict.cost import evaluate

    prev = default_placement(tiny)
    swapped = prev.phy2log.copy()
    swapped[:, [0, -1]] = swapped[:, [-1, 0]]
    previous = Placement(prev.rank2gpu, swapped)
    runs = [placement.solve(tiny, time_limit_s=10, num_workers=1, previous=previous, move_cost=0.0) for _ in range(2)]
    assert np.array_equal(runs[0].placement.phy2log, runs[1].placement.phy2log)
    assert np.array_equal(runs[0].placement.rank2gpu, prev.rank2gpu)
    assert (evaluate(tiny.for_solver(), runs[0].placement).cross_domain_bytes_per_step
            <= evaluate(tiny.for_solver(), previous).cross_domain_bytes_per_step)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.booleans())
def test_the_group_preserving_start_is_the_cheapest_group_preserving_map_by_brute_force(tiny, seed, free):
    """``group_preserving_start`` against every one of the 2**16 class maps of tiny's two-class layer."""
    rng = np.random.default_rng(seed)
    prev = default_placement(tiny)
    problem = build_layer_problem(tiny, prev.rank2gpu, 0, group_preserving=True)  # two nodes of 8
    E, C = problem.num_experts, problem.num_classes
    assert C == 2 and E == 16  # the brute force below enumerates {0, 1}**16
    prices = rng.integers(0, 5, size=(E, C)).astype(np.float64)
    slots = rng.permutation(E) if free else np.arange(E)
    start = problem.slot2class[slots]
    got = group_preserving_start(problem, start, prices)
    assert is_structurally_valid(problem, got)
    if keeps_group_types(problem, start):
        assert np.array_equal(got, start)
        return
    every = (np.arange(2 ** E)[:, None] >> np.arange(E)[None, :]) & 1  # (2**16, E) class maps
    gs = problem.expert_group_size
    make_up = every.reshape(-1, E // gs, gs).sum(axis=2)  # class-1 experts per group
    want_types = np.sort(problem.position_class_count[:, 1])
    valid = every[(np.sort(make_up, axis=1) == want_types[None, :]).all(axis=1)]
    costs = prices[np.arange(E)[None, :], valid].sum(axis=1)
    assert prices[np.arange(E), got].sum() == pytest.approx(costs.min())


def _cand(name, crossings, replicas):
    return MoveCandidate(name, np.zeros(1, dtype=np.int64), crossings, replicas, 0)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.integers(0, 40))
def test_allocation_never_exceeds_the_budget_and_zero_keeps_the_previous(seed, budget):
    rng = np.random.default_rng(seed)
    frontiers = {}
    for li in range(4):
        base = int(rng.integers(50, 100))
        cands = [_cand("previous", base, 0)]
        for j in range(int(rng.integers(1, 6))):
            cands.append(_cand(f"c{j}", base - int(rng.integers(0, 50)), int(rng.integers(1, 20))))
        frontiers[li] = cands
    plan = MovePlan({}, budget, None, 1.0)
    chosen = allocate_moves(frontiers, plan, 1.0)
    assert sum(c.replicas for c in chosen.values()) <= budget
    if budget == 0:
        assert all(c.name == "previous" for c in chosen.values())
    # a brute force over every combination is never worse by more than the greedy's slack, and the
    # greedy never chooses a candidate worse than the previous map
    assert all(c.crossings <= frontiers[li][0].crossings for li, c in chosen.items())
    big = allocate_moves(frontiers, MovePlan({}, 10**6, None, 1.0), 1.0)
    assert all(c.crossings == min(x.crossings for x in frontiers[li]) for li, c in big.items())


@pytest.mark.parametrize("rule", [{"max_moved_bytes": 0.0}, {"max_moved_bytes": 0.0, "group_preserving": False}])
def test_zero_budget_returns_the_previous_placement(tiny, rule):
    rng = np.random.default_rng(1)
    prev = default_placement(tiny)
    if rule.get("group_preserving") is False:  # any permutation may be the previous map
        prev = Placement(prev.rank2gpu, np.stack([rng.permutation(tiny.model.num_experts)
                                                  for _ in range(tiny.model.num_moe_layers)]))
    r = placement.solve(tiny, time_limit_s=10, num_workers=1, previous=prev, **rule)
    assert np.array_equal(r.placement.phy2log, prev.phy2log)
    assert np.array_equal(r.placement.rank2gpu, prev.rank2gpu)
    assert r.details["moves"]["moved_replicas"] == 0


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10_000), st.floats(0.0, 0.6))
def test_the_budget_is_never_exceeded(seed, share):
    rng = np.random.default_rng(seed)
    inst = random_instance(rng, num_experts=8, ep=4, dp=4, pp=1, num_domains=3, tokens=12, moe_layers=2)
    prev = random_placement(rng, inst)
    bpr = replica_state_bytes(inst, params=PARAMS)
    budget = share * total_state_bytes(inst, bpr)
    r = placement.solve(inst, time_limit_s=10, num_workers=1, previous=prev, max_moved_bytes=budget,
                        expert_params=PARAMS)
    mc = count_moves(inst, prev, r.placement, bytes_per_replica=bpr)
    assert mc.moved_bytes <= budget + 1e-6
    assert r.details["moves"]["moved_bytes"] == pytest.approx(mc.moved_bytes)
    assert np.array_equal(r.placement.rank2gpu, prev.rank2gpu)
    free = placement.solve(inst, time_limit_s=10, num_workers=1, previous=prev, expert_params=PARAMS)
    # a budget never beats free moves on the sampled objective the allocation minimises
    assert free.metrics["cross_domain_bytes_per_step"] <= r.metrics["cross_domain_bytes_per_step"] + 1e-6


def test_move_request_rules():
    prev = Placement(np.arange(4), np.zeros((1, 4), dtype=np.int64))
    with pytest.raises(InvalidInputError, match="at most one"):
        MoveRequest(prev, max_moved_bytes=1.0, move_cost=1.0)
    with pytest.raises(InvalidInputError, match="move_cost"):
        MoveRequest(prev, move_cost=-1.0)


def test_cli_zero_budget_writes_the_previous_maps(tmp_path, capsys):
    inst = str(INSTANCES / "tiny.json")
    prev, out = tmp_path / "prev.json", tmp_path / "new.json"
    assert main(["solve", inst, "-o", str(prev), "--time-limit", "10", "--workers", "1", "--seed", "3"]) == 0
    assert main(["solve", inst, "-o", str(out), "--time-limit", "10", "--workers", "1", "--previous", str(prev),
                 "--max-moved-bytes", "0"]) == 0
    a, b = json.loads(prev.read_text()), json.loads(out.read_text())
    assert a["phy2log"] == b["phy2log"] and a["rank2gpu"] == b["rank2gpu"]
    assert "0 of 48 expert replicas moved" in capsys.readouterr().out
    assert main(["solve", inst, "--time-limit", "10", "--workers", "1", "--previous", str(prev),
                 "--max-moved-bytes", "25%", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["moves"]["moved_share"] <= 0.25 + 1e-9


def test_cli_bad_previous_exits_2(tmp_path, capsys):
    inst = str(INSTANCES / "tiny.json")
    good = tmp_path / "prev.json"
    assert main(["solve", inst, "-o", str(good), "--time-limit", "10", "--workers", "1"]) == 0
    doc = json.loads(good.read_text())
    cases = {}
    short = dict(doc, phy2log=doc["phy2log"][:-1])
    cases["short.json"] = (json.dumps(short), "phy2log")
    notperm = dict(doc, phy2log=[[0] * len(doc["phy2log"][0])] + doc["phy2log"][1:])
    cases["notperm.json"] = (json.dumps(notperm), "phy2log[0]")
    ranks = dict(doc, rank2gpu=doc["rank2gpu"][:-1])
    cases["ranks.json"] = (json.dumps(ranks), "rank2gpu")
    cases["broken.json"] = ("{not json", "broken.json")
    for name, (text, field) in cases.items():
        path = tmp_path / name
        path.write_text(text)
        capsys.readouterr()
        assert main(["solve", inst, "--previous", str(path), "--time-limit", "10"]) == 2, name
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and field in err and name in err, (name, err)
    for argv in (["--previous", str(good), "--layout", "optimize"], ["--max-moved-bytes", "5"],
                 ["--previous", str(good), "--max-moved-bytes", "lots"],
                 ["--previous", str(good), "--solver", "default"]):
        assert main(["solve", inst, "--time-limit", "10", *argv]) == 2, argv


def test_a_prohibitive_move_cost_keeps_the_previous_and_runs_are_deterministic(tiny):
    rng = np.random.default_rng(5)
    prev = default_placement(tiny)
    prev = Placement(prev.rank2gpu, np.stack([rng.permutation(tiny.model.num_experts)
                                              for _ in range(tiny.model.num_moe_layers)]))
    r = placement.solve(tiny, time_limit_s=10, num_workers=1, previous=prev, move_cost=1e9, group_preserving=False)
    assert np.array_equal(r.placement.phy2log, prev.phy2log)
    runs = [placement.solve(tiny, time_limit_s=10, num_workers=1, previous=prev, group_preserving=False,
                            max_moved_bytes=0.3 * total_state_bytes(tiny, replica_state_bytes(tiny)))
            for _ in range(2)]
    docs = [json.dumps(placement.result_document(tiny, x), sort_keys=True) for x in runs]
    assert docs[0] == docs[1]
    assert runs[0].details["moves"]["moved_share"] <= 0.3 + 1e-9


def test_cli_previous_default_with_a_zero_budget_writes_the_default_placement(tmp_path, tiny):
    out = tmp_path / "new.json"
    assert main(["solve", str(INSTANCES / "tiny.json"), "-o", str(out), "--time-limit", "10", "--workers", "1",
                 "--previous", "default", "--max-moved-bytes", "0"]) == 0
    doc = json.loads(out.read_text())
    want = default_placement(tiny)
    assert doc["phy2log"] == want.phy2log.tolist() and doc["rank2gpu"] == want.rank2gpu.tolist()


def test_a_checkpoint_re_placement_keeps_groups_whole_and_accepts_only_a_group_preserving_previous(tiny):
    """With ``apply="checkpoint"`` a re-placement of a group-limited model keeps expert groups whole
    although its rank layout is fixed; the check of the previous placement applies the same rule, and
    the default ``apply="runtime"`` takes a free previous map."""
    from placement.core.checker import violates_group_preservation

    assert tiny.model.group_limited
    prev = default_placement(tiny)
    r = placement.solve(tiny, time_limit_s=10, num_workers=1, previous=prev, move_cost=0.0, apply="checkpoint")
    assert violates_group_preservation(tiny, r.placement) == []
    # it re-placed, or proved the previous map optimal: on tiny's default layout HybridEP runs small
    # nodes (placement.core.dispatch), and under that pricing no group-preserving move gains
    assert r.details["moves"]["moved_replicas"] > 0 or (
        r.details["moves"]["gain"]["cross_domain_bytes_per_step"] == 0.0
        and all(layer["status"] == "optimal" for layer in r.details["layers"]))
    # a free map (runtime maps may be free): experts of the first and the last group swapped
    swapped = prev.phy2log.copy()
    swapped[:, [0, -1]] = swapped[:, [-1, 0]]
    free = placement.solve(tiny, time_limit_s=10, num_workers=1, previous=Placement(prev.rank2gpu, swapped),
                           move_cost=1e9)  # apply runtime: the free previous map is taken, and kept
    assert violates_group_preservation(tiny, free.placement) != []
    with pytest.raises(InvalidInputError, match="previous: phy2log: .*re-place with apply runtime"):
        placement.solve(tiny, time_limit_s=10, num_workers=1, previous=free.placement, move_cost=0.0,
                        apply="checkpoint")
    again = placement.solve(tiny, time_limit_s=10, num_workers=1, previous=free.placement)
    assert np.array_equal(again.placement.rank2gpu, free.placement.rank2gpu)
