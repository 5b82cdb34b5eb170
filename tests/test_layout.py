"""The rank-layout optimizer (solvers/layout/) and the Slurm hostfile (placement/consumers/hostfile.py)."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from placement.core.checker import check, deepep_violations
from placement.predict.cost import evaluate
from placement.core.model import Cluster, InfeasibleError, Instance, Placement
from solvers.base import SolveOptions
from solvers.default import default_rank2gpu
from solvers.layout import (
    BlockScorer,
    FootprintModel,
    estimate_layout,
    layout_blocks,
    place_on_parts,
    plan_layout,
    shape_candidates,
    stage_footprints,
)
from solvers.layout.rules import equal_slice_breaks
from solvers.layout.tokens import Tokens, crossings
from tests.conftest import random_instance


def _with_available(inst: Instance, available: np.ndarray) -> Instance:
    cl = inst.cluster
    cluster = Cluster(cl.num_domains, cl.trays_per_domain, cl.gpus_per_tray, available, cl.nvlink_gbps, cl.scaleout_gbps)
    return Instance(inst.name, inst.model, inst.parallel, cluster, inst.routing, inst.cost_mode)


def _plan(inst: Instance, **kw) -> "object":
    kw.setdefault("objective", "total")  # these tests are about the byte objectives (test_step_time.py: step_time)
    opts = SolveOptions(num_workers=1, **kw)
    return plan_layout(inst.for_solver(), opts, deadline=time.monotonic() + 60)


# ---------------------------------------------------------------------------------------------
# shapes
# ---------------------------------------------------------------------------------------------
def _brute_partitions(n: int, unit: int, max_part: int, max_parts: int) -> set[tuple[int, ...]]:
    out = set()
    units = n // unit
    for m in range(1, max_parts + 1):
        for combo in itertools.product(range(1, units + 1), repeat=m):
            if sum(combo) == units and max(combo) * unit <= max_part:
                out.add(tuple(sorted((c * unit for c in combo), reverse=True)))
    return out


@pytest.mark.parametrize("n,unit,max_part,max_parts", [(8, 2, 8, 3), (12, 2, 8, 4), (16, 4, 12, 4), (9, 3, 9, 3)])
def test_shape_candidates_are_all_partitions(n, unit, max_part, max_parts):
    got = shape_candidates(n, unit, max_part, max_parts)
    assert len(got) == len(set(got))
    assert set(got) == _brute_partitions(n, unit, max_part, max_parts)
    assert all(list(s) == sorted(s, reverse=True) for s in got)


def test_equal_shapes_only_for_deepep():
    got = shape_candidates(16, 2, 16, 8, equal_only=True)
    assert got == [(16,), (8, 8), (4, 4, 4, 4), (2,) * 8]
    assert shape_candidates(16, 2, 6, 8, equal_only=True) == [(4, 4, 4, 4), (2,) * 8]


# ---------------------------------------------------------------------------------------------
# experts on parts: exact counts, per_pair optimum, never worse than the contiguous map
# ---------------------------------------------------------------------------------------------
def _recount(topk, src_part, e2p, mode):
    out = 0
    for t in range(topk.shape[0]):
        parts = [int(e2p[e]) for e in topk[t]]
        if mode == "per_pair":
            out += sum(p != src_part[t] for p in parts)
        else:
            out += len(set(parts) - {int(src_part[t])})
    return out


@pytest.mark.parametrize("mode", ["per_domain", "per_pair"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_place_on_parts_counts_exactly_and_beats_contiguous(mode, seed):
    rng = np.random.default_rng(seed)
    E, ep, k, n = 8, 4, 2, 40
    topk = np.stack([rng.choice(E, size=k, replace=False) for _ in range(n)])
    src = rng.integers(0, ep, size=n)
    part_of_ep = np.array([0, 0, 0, 1])
    tok = Tokens(topk, src, E)
    pl = place_on_parts(tok, part_of_ep, 2, experts_per_rank=2, mode=mode, group_size=None)
    assert np.bincount(pl.expert2part, minlength=2).tolist() == [6, 2]
    src_part = part_of_ep[src]
    assert pl.crossings == _recount(topk, src_part, pl.expert2part, mode)
    contiguous = np.repeat(part_of_ep, 2)
    assert pl.crossings <= _recount(topk, src_part, contiguous, mode)
    if mode == "per_pair":  # exact: an assignment problem; compare with every map
        best = min(
            _recount(topk, src_part, np.array([1 if e in small else 0 for e in range(E)]), mode)
            for small in itertools.combinations(range(E), 2)
        )
        assert pl.crossings == best


def test_place_on_parts_group_preserving_keeps_groups_on_blocks():
    rng = np.random.default_rng(3)
    E, gs = 16, 4
    topk = np.stack([rng.choice(E, size=3, replace=False) for _ in range(60)])
    src = rng.integers(0, 8, size=60)
    part_of_ep = np.array([0, 0, 0, 0, 0, 1, 1, 1])  # 2 slots per rank: block 2 is split 2/2
    tok = Tokens(topk, src, E)
    pl = place_on_parts(tok, part_of_ep, 2, experts_per_rank=2, mode="per_domain", group_size=gs)
    slot2part = np.repeat(part_of_ep, 2)
    assert sorted(pl.group2position.tolist()) == [0, 1, 2, 3]
    for g, blk in enumerate(pl.group2position):
        want = np.bincount(slot2part[blk * gs : (blk + 1) * gs], minlength=2)
        assert np.bincount(pl.expert2part[g * gs : (g + 1) * gs], minlength=2).tolist() == want.tolist()
    assert pl.crossings == int(crossings(tok, pl.expert2part, part_of_ep[src], "per_domain").sum())


# ---------------------------------------------------------------------------------------------
# the estimator agrees with the evaluator
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["per_domain", "per_pair"])
@pytest.mark.parametrize("tp", [1, 2])
def test_estimate_matches_evaluator(mode, tp):
    rng = np.random.default_rng(11 + tp)
    inst = random_instance(rng, num_experts=16, top_k=3, ep=4, dp=4 // tp if tp > 1 else 4, tp=tp, pp=2,
                           num_domains=4, trays_per_domain=2, gpus_per_tray=2, tokens=12, moe_layers=4, cost_mode=mode)
    if tp > 1:  # ep = tp * dp: one EP group per stage holds two TP pairs
        inst = random_instance(rng, num_experts=16, top_k=3, ep=4, dp=2, tp=2, pp=2, num_domains=4,
                               trays_per_domain=2, gpus_per_tray=2, tokens=12, moe_layers=4, cost_mode=mode)
    for trial in range(3):
        r2g = rng.permutation(inst.cluster.num_gpus)[: inst.parallel.world_size]
        # keep TP pairs inside one domain (the layout's invariant)
        if tp > 1:
            doms = np.repeat(rng.permutation(inst.cluster.num_domains), inst.cluster.gpus_per_domain)
            r2g = np.argsort(doms, kind="stable")[: inst.parallel.world_size]
        est = estimate_layout(inst, r2g, group_preserving=False)
        placement = Placement(r2g, est["phy2log"])
        assert check(inst, placement) == []
        m = evaluate(inst, placement, rule="domain")  # the estimator counts whole domains (docs/design.md)
        if mode == "per_domain" and not equal_slice_breaks(inst, r2g):  # where HybridEP's node is the domain slice
            assert evaluate(inst, placement).cross_domain_bytes_per_step == pytest.approx(m.cross_domain_bytes_per_step)
        assert est["total_bytes"] == pytest.approx(m.cross_domain_bytes_per_step, rel=1e-9)
        assert est["stage_bytes"] == pytest.approx(m.cross_domain_bytes_per_stage, rel=1e-9)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), mode=st.sampled_from(["per_domain", "per_pair"]), groups=st.sampled_from([2, 3]),
       tp=st.sampled_from([1, 2]), gp=st.booleans())
def test_estimate_holds_against_the_evaluator_with_several_ep_groups_per_stage(seed, mode, groups, tp, gp):
    """Bytes: exact (each stage's EP groups share one expert map, as the evaluator has it).
    Busiest NIC per layer: exact in ``per_domain``; in ``per_pair`` the estimate spreads a part's
    arrivals evenly over its GPUs, so it lies within [evaluator / ep, 2 * evaluator].  Times: per
    layer the busier of that NIC and the contiguous map's NVLink floor, so per stage at least the
    evaluator's NIC time (over ep in ``per_pair``) and at most the evaluator's time (twice in
    ``per_pair``) plus the contiguous map's, scored by the evaluator in ``per_domain``."""
    rng = np.random.default_rng(seed)
    ep = 4
    inst = random_instance(rng, num_experts=8, top_k=3, ep=ep, dp=groups * ep // tp, tp=tp, pp=2,
                           num_domains=4, trays_per_domain=groups, gpus_per_tray=2 * tp, tokens=8, moe_layers=4,
                           num_groups=2 if gp else 1, cost_mode=mode)
    assert inst.parallel.stage_ep_groups.shape[1] == groups
    cl = inst.cluster
    # TP pairs stay inside a tray (the layout's invariant): permute trays and the pairs' slots
    pairs = rng.permutation(cl.num_gpus // tp)
    r2g = (pairs[:, None] * tp + np.arange(tp)).reshape(-1)[: inst.parallel.world_size]
    est = estimate_layout(inst, r2g, group_preserving=gp)
    placement = Placement(r2g, est["phy2log"])
    assert check(inst, placement) == []
    m = evaluate(inst, placement, rule="domain")  # the estimator counts whole domains
    assert est["total_bytes"] == pytest.approx(m.cross_domain_bytes_per_step, rel=1e-9, abs=1e-6)
    assert est["stage_bytes"] == pytest.approx(m.cross_domain_bytes_per_stage, rel=1e-9, abs=1e-6)
    nic_bw = cl.scaleout_gbps * 1e9
    est_nic = np.array(est["layer_nic_s"]) * nic_bw
    true_nic = np.array(m.max_gpu_cross_domain_bytes_per_layer)
    identity = np.tile(np.arange(inst.model.num_experts), (inst.model.num_moe_layers, 1))
    contiguous = evaluate(inst, Placement(r2g, identity), cost_mode="per_domain", rule="domain")
    l2s = inst.moe_layer2stage
    true_nic_s = np.bincount(l2s, weights=true_nic / nic_bw, minlength=inst.parallel.pp)
    tol = 1e-9
    if mode == "per_domain":
        assert est_nic == pytest.approx(true_nic, rel=1e-9, abs=1e-6)
        low, high = true_nic_s, np.array(m.alltoall_time_s_per_stage) + contiguous.alltoall_time_s_per_stage
    else:
        assert np.all(est_nic >= true_nic / ep * (1 - tol)) and np.all(est_nic <= 2 * true_nic * (1 + tol) + 1e-6)
        low = true_nic_s / ep
        high = 2 * np.array(m.alltoall_time_s_per_stage) + contiguous.alltoall_time_s_per_stage
    got = np.array(est["stage_time_s"])
    assert np.all(got >= low * (1 - tol) - 1e-15) and np.all(got <= high * (1 + tol) + 1e-15), (got, low, high)
    assert est["slowest_stage_s"] == pytest.approx(got.max())


def test_estimate_group_preserving_map_is_group_preserving(tiny):
    from placement.core.checker import violates_group_preservation

    r2g = default_rank2gpu(tiny)
    est = estimate_layout(tiny, r2g, group_preserving=True)
    placement = Placement(r2g, est["phy2log"])
    assert check(tiny, placement) == [] and violates_group_preservation(tiny, placement) == []
    assert est["total_bytes"] == pytest.approx(evaluate(tiny, placement, rule="domain").cross_domain_bytes_per_step)


# ---------------------------------------------------------------------------------------------
# the footprint model
# ---------------------------------------------------------------------------------------------
def test_footprint_model_matches_brute_force():
    """Three blocks of 4 GPUs on domains with 5, 4, 3 free: the MILP's optimum is the brute force's."""
    free = np.array([5, 4, 3])
    shapes = [shape_candidates(4, 1, 5, 3) for _ in range(3)]
    rng = np.random.default_rng(0)
    cost = [[0.0 if len(sh) == 1 else float(rng.integers(1, 50)) for sh in s] for s in shapes]
    tim = [[1.0] * len(s) for s in shapes]
    model = FootprintModel([4, 4, 4], shapes, free, cost, tim)
    status, feet, total, _ = model.solve("total", time_limit_s=30)
    assert status == "OPTIMAL"
    best = np.inf
    # brute force over every way to split each block over the domains
    splits = [c for c in itertools.product(range(6), repeat=3) if sum(c) == 4]
    for a, b, c in itertools.product(splits, repeat=3):
        if any(a[d] + b[d] + c[d] > free[d] for d in range(3)):
            continue
        val = 0.0
        for bi, foot in enumerate((a, b, c)):
            sh = tuple(sorted((v for v in foot if v), reverse=True))
            val += cost[bi][shapes[bi].index(sh)]
        best = min(best, val)
    assert total == pytest.approx(best)
    for d in range(3):
        assert sum(f.get(d, 0) for f in feet) <= free[d]
    assert all(sum(f.values()) == 4 for f in feet)


# ---------------------------------------------------------------------------------------------
# plan_layout
# ---------------------------------------------------------------------------------------------
def _fragmented(seed: int = 0, **kw) -> Instance:
    """Every EP group (4 GPUs) fits a domain (4 GPUs), but one GPU down makes the default straddle."""
    rng = np.random.default_rng(seed)
    inst = random_instance(rng, num_experts=16, top_k=3, ep=4, dp=4, pp=2, num_domains=4, trays_per_domain=2,
                           gpus_per_tray=2, tokens=16, moe_layers=4, **kw)
    available = np.ones(inst.cluster.num_gpus, dtype=bool)
    available[1] = False
    return _with_available(inst, available)


def test_zero_cross_domain_when_every_group_fits_a_rack():
    inst = _fragmented()
    default = Placement(default_rank2gpu(inst), np.tile(np.arange(16), (4, 1)))
    assert evaluate(inst, default).cross_domain_bytes_per_step > 0  # the default straddles
    plan = _plan(inst)
    placement = Placement(plan.rank2gpu, np.tile(np.arange(16), (4, 1)))
    assert check(inst, placement) == []
    assert evaluate(inst, placement).cross_domain_bytes_per_step == 0.0
    assert plan.details["estimated_total_bytes"] == 0.0
    assert all(len(f) == 1 for f in plan.details["stage_footprints"])


def test_zero_cross_domain_on_a_built_instance_with_racks_to_spare():
    """The committed tiny spec on one more domain: every EP group (8) fits one domain (8 GPUs)."""
    import dataclasses

    from placement.sources.instances import SPECS, build

    spec = dataclasses.replace(SPECS["tiny"], num_domains=6, trays_per_domain=4, gpus_per_tray=2, trays_down=5)
    inst = build(spec)
    plan = _plan(inst)
    placement = Placement(plan.rank2gpu, np.tile(np.arange(inst.model.num_experts), (inst.model.num_moe_layers, 1)))
    assert check(inst, placement) == []
    assert evaluate(inst, placement).cross_domain_bytes_per_step == 0.0


def test_plan_is_never_worse_than_default_and_straddlers_get_fewest_layers(tiny):
    plan = _plan(tiny)
    est = plan.details["estimate"]
    assert est["total_bytes"] <= plan.details["default_estimate"]["total_bytes"]
    placement = Placement(plan.rank2gpu, plan.phy2log)
    assert check(tiny, placement) == []
    assert evaluate(tiny, placement).cross_domain_bytes_per_step == pytest.approx(est["total_bytes"])
    assert plan.details["objective"] == "total"
    assert {"estimated_total_bytes", "estimated_slowest_stage_s"} <= set(plan.details)


def test_bottleneck_objective_reports_both(tiny):
    tot = _plan(tiny)
    bot = _plan(tiny, objective="bottleneck")
    assert bot.details["estimated_slowest_stage_s"] <= tot.details["estimated_slowest_stage_s"] + 1e-12
    assert tot.details["estimated_total_bytes"] <= bot.details["estimated_total_bytes"] + 1e-6
    for p in (tot, bot):
        assert p.details["estimated_total_bytes"] >= 0 and p.details["estimated_slowest_stage_s"] > 0


def test_deterministic(tiny):
    a, b = _plan(tiny, seed=3), _plan(tiny, seed=3)
    assert a.rank2gpu.tolist() == b.rank2gpu.tolist()
    assert a.phy2log.tolist() == b.phy2log.tolist()


def test_deepep_rule_holds_when_asked():
    """EP 4 on domains of 4 GPUs with two GPUs down: some group must straddle, in equal halves."""
    rng = np.random.default_rng(5)
    inst = random_instance(rng, num_experts=16, top_k=3, ep=4, dp=4, pp=2, num_domains=3, trays_per_domain=2,
                           gpus_per_tray=2, tokens=16, moe_layers=4)
    available = np.ones(12, dtype=bool)
    available[[0, 1, 8, 9]] = False  # free GPUs per domain: 2, 4, 2
    inst = _with_available(inst, available)
    plan = _plan(inst, consumer="deepep")
    placement = Placement(plan.rank2gpu, np.tile(np.arange(16), (4, 1)))
    assert check(inst, placement) == [] and deepep_violations(inst, placement) == []
    assert sorted(len(f) for f in plan.details["stage_footprints"]) == [1, 2]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), slices=st.sampled_from([1, 2, 4]))
def test_the_layouts_own_equal_slice_rule_agrees_with_the_verifier(seed, slices):
    """``solvers.layout.rules`` reads the DeepEP/HybridEP rule on its own; the verifier's reading
    (placement.core.checker) must agree on layouts built to hold it and on random ones."""
    from solvers.layout.rules import equal_slice_breaks

    rng = np.random.default_rng(seed)
    inst = random_instance(rng, ep=8, dp=8, pp=2, num_domains=4, trays_per_domain=2, gpus_per_tray=2)
    cl = inst.cluster
    if rng.random() < 0.5:
        r2g = rng.permutation(cl.num_gpus)[: inst.parallel.world_size]
    else:  # every EP group in `slices` equal consecutive slices, each in its own domain
        r2g = np.empty(inst.parallel.world_size, dtype=np.int64)
        free = {d: list(rng.permutation(np.flatnonzero(cl.gpu2domain == d))) for d in range(cl.num_domains)}
        for s in range(inst.parallel.pp):
            for eg in inst.parallel.stage_ep_groups[s]:
                doms = [d for d in rng.permutation(cl.num_domains) if len(free[d]) >= len(eg) // slices][:slices]
                if len(doms) < slices:
                    return
                for i, chunk in enumerate(np.split(np.asarray(eg), slices)):
                    r2g[chunk] = [free[doms[i]].pop() for _ in chunk]
    placement = Placement(r2g, np.tile(np.arange(inst.model.num_experts), (inst.model.num_moe_layers, 1)))
    assert bool(equal_slice_breaks(inst, r2g)) == bool(deepep_violations(inst, placement))


def test_deepep_rule_that_cannot_hold_is_infeasible():
    """Domains with 3, 3 and 2 free GPUs: an EP group of 4 cannot take equal slices."""
    rng = np.random.default_rng(6)
    inst = random_instance(rng, num_experts=8, top_k=2, ep=4, dp=4, pp=2, num_domains=3, trays_per_domain=2,
                           gpus_per_tray=2, tokens=8, moe_layers=2)
    available = np.ones(12, dtype=bool)
    available[[0, 4, 8, 9]] = False
    inst = _with_available(inst, available)
    with pytest.raises(InfeasibleError, match="equal consecutive slices"):
        _plan(inst, consumer="deepep")
    _plan(inst)  # without the rule it is feasible


def test_too_few_gpus_is_infeasible():
    inst = _fragmented()
    available = np.zeros(inst.cluster.num_gpus, dtype=bool)
    available[:6] = True
    with pytest.raises(InfeasibleError, match="needs 8 GPUs"):
        _plan(_with_available(inst, available))


@pytest.mark.exclusive  # a wall-clock bound (tests/machine_share.py)
def test_deadline_is_honoured(tiny):
    t0 = time.monotonic()
    plan = plan_layout(tiny, SolveOptions(num_workers=1), deadline=t0 + 0.3)
    assert time.monotonic() - t0 < 5.0
    assert check(tiny, Placement(plan.rank2gpu, plan.phy2log)) == []


def test_tp_groups_stay_in_a_tray():
    rng = np.random.default_rng(8)
    inst = random_instance(rng, num_experts=16, top_k=3, ep=4, dp=4, tp=2, pp=1, num_domains=3, trays_per_domain=2,
                           gpus_per_tray=4, tokens=8, moe_layers=2)
    available = np.ones(24, dtype=bool)
    available[[0, 1, 2, 3]] = False
    inst = _with_available(inst, available)
    plan = _plan(inst)
    host = inst.cluster.gpu2host[plan.rank2gpu]
    assert (host[0::2] == host[1::2]).all()
    assert plan.details["tp_cp_groups_split_across_trays"] == 0


def test_blocks_partition_the_world(tiny):
    blocks = layout_blocks(tiny)
    ranks = np.sort(np.concatenate([b.ranks for b in blocks]))
    assert ranks.tolist() == list(range(tiny.parallel.world_size))
    assert [b.stage for b in blocks] == [0, 1]


def test_stage_footprints_counts(tiny):
    feet = stage_footprints(tiny, default_rank2gpu(tiny))
    assert [sum(c for _, c in f) for f in feet] == [8, 8]


# ---------------------------------------------------------------------------------------------
# Slurm hostfile
# ---------------------------------------------------------------------------------------------
def test_slurm_hostfile_one_host_per_rank(tiny):
    from placement.consumers.hostfile import cuda_visible_devices, local_rank_mismatches, slurm_hostfile

    plan = _plan(tiny)
    lines = slurm_hostfile(tiny, plan.rank2gpu).splitlines()
    cl = tiny.cluster
    assert len(lines) == tiny.parallel.world_size
    assert lines == [cl.host_name(int(cl.gpu2host[g])) for g in plan.rank2gpu]
    # every host's ranks take its GPUs in rank order
    cvd = cuda_visible_devices(tiny, plan.rank2gpu)
    for host, value in cvd.items():
        gpus = [int(x) for x in value.split(",")]
        assert gpus == sorted(gpus)
    # a host running fewer ranks than GPUs (tiny: one host runs 1 of 2) is reported when the
    # placement's GPU is not local index 0
    r2g = plan.rank2gpu.copy()
    assert isinstance(local_rank_mismatches(tiny, r2g), list)


def test_cuda_visible_devices_when_a_host_runs_fewer_ranks():
    from placement.consumers.hostfile import cuda_visible_devices, local_rank_mismatches

    rng = np.random.default_rng(0)
    inst = random_instance(rng, num_experts=8, top_k=2, ep=2, dp=2, pp=1, num_domains=1, trays_per_domain=2,
                           gpus_per_tray=2)
    r2g = np.array([3, 0])  # rank 0 on host 1 local GPU 1; rank 1 on host 0 local GPU 0
    assert cuda_visible_devices(inst, r2g) == {"rack00-tray00": "0", "rack00-tray01": "1"}
    assert len(local_rank_mismatches(inst, r2g)) == 1


# ---------------------------------------------------------------------------------------------
# the CLI: exit 3 with a reason
# ---------------------------------------------------------------------------------------------
def _write(inst: Instance, tmp_path) -> str:
    from placement.formats import write_instance

    path = tmp_path / "inst.json"
    write_instance(inst, path)
    return str(path)


def test_cli_exits_3_when_deepep_rule_cannot_hold(tmp_path, capsys):
    from placement.cli import main

    rng = np.random.default_rng(6)
    inst = random_instance(rng, num_experts=8, top_k=2, ep=4, dp=4, pp=2, num_domains=3, trays_per_domain=2,
                           gpus_per_tray=2, tokens=8, moe_layers=2)
    available = np.ones(12, dtype=bool)
    available[[0, 4, 8, 9]] = False
    path = _write(_with_available(inst, available), tmp_path)
    code = main(["solve", path, "--solver", "cpsat", "--consumer", "deepep", "--time-limit", "20", "--workers", "1"])
    err = capsys.readouterr().err
    assert code == 3, err
    assert "equal consecutive slices" in err and "deepep" in err


def test_cli_exits_3_when_too_few_gpus(tmp_path, capsys):
    from placement.cli import main

    inst = _fragmented()
    available = np.zeros(inst.cluster.num_gpus, dtype=bool)
    available[:6] = True
    path = _write(_with_available(inst, available), tmp_path)
    code = main(["solve", path, "--solver", "cpsat", "--time-limit", "20", "--workers", "1"])
    err = capsys.readouterr().err
    assert code == 3, err
    assert "needs 8 GPUs" in err


# ---------------------------------------------------------------------------------------------
# properties on random small clusters
# ---------------------------------------------------------------------------------------------
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    down=st.lists(st.integers(0, 17), max_size=5, unique=True),
    mode=st.sampled_from(["per_domain", "per_pair"]),
    objective=st.sampled_from(["total", "bottleneck"]),
)
def test_plan_is_valid_exact_and_no_worse_than_default(seed, down, mode, objective):
    """Any fragmentation of 3 domains x 3 trays x 2 GPUs: a valid layout on free GPUs whose estimate
    is the evaluator's number and is no worse than the default's on the chosen objective."""
    rng = np.random.default_rng(seed)
    inst = random_instance(rng, num_experts=8, top_k=2, ep=4, dp=4, pp=2, num_domains=3, trays_per_domain=3,
                           gpus_per_tray=2, tokens=8, moe_layers=3, cost_mode=mode)
    available = np.ones(18, dtype=bool)
    available[down] = False
    inst = _with_available(inst, available)
    plan = _plan(inst, objective=objective)
    placement = Placement(plan.rank2gpu, plan.phy2log)
    assert check(inst, placement) == []
    m = evaluate(inst, placement)
    assert plan.details["estimated_total_bytes"] == pytest.approx(m.cross_domain_bytes_per_step, rel=1e-9, abs=1e-6)
    key = "total_bytes" if objective == "total" else "slowest_stage_s"
    assert plan.details["estimate"][key] <= plan.details["default_estimate"][key] * (1 + 1e-9) + 1e-9
    if objective == "total":  # no stage slower than the default's slowest, on the estimator
        assert max(plan.details["estimate"]["stage_time_s"]) <= plan.details["stage_time_cap_s"] * (1 + 1e-9)
    # ... and on the evaluator, whatever the objective
    default = Placement(default_rank2gpu(inst), np.tile(np.arange(8), (3, 1)))
    assert m.alltoall_time_s_per_step <= evaluate(inst, default).alltoall_time_s_per_step * (1 + 1e-9)
    # a footprint uses every free GPU at most once and the stage footprints add up
    assert [sum(c for _, c in f) for f in plan.details["stage_footprints"]] == [4, 4]


@pytest.mark.exclusive  # a wall-clock bound (tests/machine_share.py)
def test_a_stop_request_returns_a_valid_layout_at_once(tiny):
    import threading

    event = threading.Event()
    event.set()
    opts = SolveOptions(num_workers=1, stop_event=event)
    t0 = time.monotonic()
    plan = plan_layout(tiny, opts, deadline=t0 + 60)
    assert time.monotonic() - t0 < 5.0
    assert check(tiny, Placement(plan.rank2gpu, plan.phy2log)) == []
    assert plan.wall_clock_cut is True


# ---------------------------------------------------------------------------------------------
# the total objective never makes the slowest stage slower than the default layout's
# ---------------------------------------------------------------------------------------------
def _sliver_prone(seed: int) -> Instance:
    """Two EP groups of 4 on three 4-GPU domains (one GPU per tray, so parts of any size), some GPUs
    down: on these seeds the bytes-optimal layout leaves a 1-GPU sliver whose NIC makes a stage
    1.3-1.5x slower than the default layout's slowest stage."""
    rng = np.random.default_rng(seed)
    inst = random_instance(rng, num_experts=8, top_k=3, ep=4, dp=4, pp=2, num_domains=3, trays_per_domain=4,
                           gpus_per_tray=1, tokens=12, moe_layers=int(rng.integers(2, 6)))
    available = np.ones(12, dtype=bool)
    available[rng.choice(12, size=int(rng.integers(1, 4)), replace=False)] = False
    return _with_available(inst, available)


def _every_footprint(inst: Instance) -> list[tuple[float, float, list[float]]]:
    """Brute force: (total bytes, slowest stage s, stage times) of every footprint of the blocks over
    the domains, each scored by the estimator (contiguous slices, its own expert maps)."""
    from solvers.layout.blocks import free_per_domain
    from solvers.layout.candidates import summarise

    blocks = layout_blocks(inst)
    free = free_per_domain(inst)
    D = len(free)
    scorer = BlockScorer(inst, group_preserving=False)
    per_block = []
    for blk in blocks:
        per_block.append([{d: c[d] for d in range(D) if c[d]} for c in itertools.product(range(blk.size + 1), repeat=D)
                          if sum(c) == blk.size and all(c[d] <= free[d] for d in range(D))])
    out = []
    for feet in itertools.product(*per_block):
        if any(sum(f.get(d, 0) for f in feet) > free[d] for d in range(D)):
            continue
        a2ps = [scorer.slices(blk, tuple(sorted(f.values(), reverse=True))) for blk, f in zip(blocks, feet)]
        est = summarise(inst, blocks, a2ps, scorer)
        out.append((est["total_bytes"], est["slowest_stage_s"], est["stage_time_s"]))
    return out


@pytest.mark.parametrize("seed", [17, 40, 50])
def test_total_objective_keeps_every_stage_within_the_defaults_slowest(seed):
    inst = _sliver_prone(seed)
    plan = _plan(inst)
    cap = plan.details["default_estimate"]["slowest_stage_s"]
    assert plan.details["stage_time_cap_s"] == cap
    every = _every_footprint(inst)
    # the cap binds here: the bytes-optimal footprint is slower than the default's slowest stage
    cheapest = min(every, key=lambda r: (r[0], r[1]))
    assert cheapest[1] > cap * 1.1
    # every stage of the plan is within the cap, and no footprint within it moves fewer bytes; unless
    # the evaluator, which prices HybridEP's nodes where the estimator counts whole domains
    # (docs/design.md), found the pick slower than the default and returned the default
    if plan.details["chosen"] != "default, contiguous experts":
        assert max(plan.details["estimate"]["stage_time_s"]) <= cap * (1 + 1e-9)
        best_within = min(r[0] for r in every if r[1] <= cap * (1 + 1e-9))
        assert plan.details["estimated_total_bytes"] <= best_within * (1 + 1e-9)
    else:
        assert plan.details["evaluator_check"]["checked"]  # the estimator's pick was priced and refused
    # and on the evaluator's numbers, with the plan's expert maps
    placement = Placement(plan.rank2gpu, plan.phy2log)
    default = Placement(default_rank2gpu(inst), np.tile(np.arange(8), (inst.model.num_moe_layers, 1)))
    assert check(inst, placement) == []
    assert evaluate(inst, placement).alltoall_time_s_per_step <= evaluate(inst, default).alltoall_time_s_per_step * (1 + 1e-9)


def test_bottleneck_objective_is_the_brute_force_optimum_on_a_small_case():
    inst = _sliver_prone(40)
    plan = _plan(inst, objective="bottleneck")
    assert plan.details["stage_time_cap_s"] is None
    fastest = min(r[1] for r in _every_footprint(inst))
    assert plan.details["estimated_slowest_stage_s"] <= fastest * (1 + 1e-9)


def test_evaluator_check_falls_back_to_the_default_layout(monkeypatch):
    """If the evaluator found every candidate slower than the default (the estimator's times are
    approximate), the default layout with contiguous experts is returned."""
    from placement import cost
    from solvers.layout import plan as planner

    inst = _sliver_prone(40)
    real = cost.evaluate
    identity = np.tile(np.arange(8), (inst.model.num_moe_layers, 1))
    default_r2g = default_rank2gpu(inst)

    def pessimistic(instance, placement, **kw):
        m = real(instance, placement, **kw)
        if np.array_equal(placement.rank2gpu, default_r2g) and np.array_equal(placement.phy2log, identity):
            return m
        import dataclasses

        return dataclasses.replace(m, alltoall_time_s_per_step=m.alltoall_time_s_per_step * 100)

    monkeypatch.setattr(planner, "evaluate", pessimistic)
    plan = _plan(inst)
    assert plan.details["chosen"] == "default, contiguous experts"
    assert plan.rank2gpu.tolist() == default_r2g.tolist() and plan.phy2log.tolist() == identity.tolist()
    assert len(plan.details["evaluator_check"]["checked"]) >= 1


# ---------------------------------------------------------------------------------------------
# never worse than the careful engineer's layout (solvers/packed.py) or the default, at any budget
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,work_s", [("dsv3_256", 0.0), ("qwen3_256", 0.0), ("qwen3_256", None)])
def test_never_worse_than_packed_or_default_at_any_budget(name, work_s):
    """With no work budget at all (the MILP never runs) as with a full one, the layout returned is no
    worse on the estimator than ``packed`` and ``default`` under the objective and its cap."""
    import placement
    from solvers.packed import packed_rank2gpu
    from tests.conftest import INSTANCES

    inst = placement.load_instance(INSTANCES / f"{name}.json").for_solver()
    gp = inst.model.group_limited
    plan = plan_layout(inst, SolveOptions(num_workers=1, objective="total"), deadline=time.monotonic() + 120, work_s=work_s)
    assert plan.wall_clock_cut is False
    assert plan.details["work_budget_exhausted"] is (work_s == 0.0)
    cap = plan.details["stage_time_cap_s"]
    got = plan.details["estimate"]
    assert set(plan.details["candidates"]) >= {"default", "packed"}
    for peer in (packed_rank2gpu(inst), default_rank2gpu(inst)):
        est = estimate_layout(inst, peer, group_preserving=gp)
        if est["slowest_stage_s"] <= cap * (1 + 1e-9):
            assert got["total_bytes"] <= est["total_bytes"] * (1 + 1e-9)
    assert got["slowest_stage_s"] <= cap * (1 + 1e-9)
    assert check(inst, Placement(plan.rank2gpu, plan.phy2log)) == []


# ---------------------------------------------------------------------------------------------
# determinism: decisions on a work budget, never on the clock; no wall-clock values in details
# ---------------------------------------------------------------------------------------------
def _eight_wide() -> Instance:
    """Four EP groups of 8 on five domains with 7, 7, 7, 6, 5 free GPUs: every group straddles."""
    rng = np.random.default_rng(7)
    inst = random_instance(rng, num_experts=16, top_k=4, ep=8, dp=8, pp=4, num_domains=5, trays_per_domain=4,
                           gpus_per_tray=2, tokens=24, moe_layers=8)
    available = np.ones(40, dtype=bool)
    available[[1, 9, 17, 25, 26, 33, 38, 39]] = False
    return _with_available(inst, available)


def _slowed(monkeypatch, seconds: float) -> None:
    """Make every expert placement of the layout take ``seconds`` longer (a busy machine)."""
    from solvers.layout import scorer

    real = scorer.place_on_parts

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return real(*args, **kwargs)

    monkeypatch.setattr(scorer, "place_on_parts", slow)


def test_a_binding_work_budget_gives_the_same_layout_and_details_on_a_slower_machine(monkeypatch):
    import json

    inst = _eight_wide()
    opts = SolveOptions(num_workers=1)
    fast = plan_layout(inst, opts, deadline=time.monotonic() + 120, work_s=0.08)
    assert fast.details["work_budget_exhausted"] is True and fast.wall_clock_cut is False
    _slowed(monkeypatch, 0.003)
    slow = plan_layout(inst, opts, deadline=time.monotonic() + 120, work_s=0.08)
    assert slow.rank2gpu.tolist() == fast.rank2gpu.tolist() and slow.phy2log.tolist() == fast.phy2log.tolist()
    # byte for byte: the details hold no wall-clock value
    assert json.dumps(slow.details, sort_keys=True) == json.dumps(fast.details, sort_keys=True)


def test_more_work_budget_never_gives_a_worse_layout():
    inst = _eight_wide()
    opts = SolveOptions(num_workers=1)
    totals = [plan_layout(inst, opts, deadline=time.monotonic() + 120, work_s=w).details["estimated_total_bytes"]
              for w in (0.0, 0.08, 30.0)]
    assert totals[2] <= totals[1] * (1 + 1e-9) and totals[1] <= totals[0] * (1 + 1e-9)


# ---------------------------------------------------------------------------------------------
# the deadline: polled inside long steps, the best complete candidate returned at once
# ---------------------------------------------------------------------------------------------
@pytest.mark.exclusive  # a wall-clock bound (tests/machine_share.py)
def test_the_deadline_cuts_a_long_scoring_promptly(monkeypatch):
    """Each expert placement takes 0.2 s: scoring the default layout alone would take seconds; the
    layout polls the clock between layers and returns a valid layout soon after the deadline."""
    inst = _eight_wide()
    _slowed(monkeypatch, 0.2)
    t0 = time.monotonic()
    plan = plan_layout(inst, SolveOptions(num_workers=1), deadline=t0 + 0.3, work_s=100.0)
    elapsed = time.monotonic() - t0
    assert elapsed < 1.5, elapsed
    assert plan.wall_clock_cut is True
    assert check(inst, Placement(plan.rank2gpu, plan.phy2log)) == []


def _straddling_groups(seed: int = 0) -> Instance:
    """Wide EP (EP16, 4 expert groups of 4 on 4 GPUs each) on domains of 8 GPUs in trays of 2, with
    6 free in each: the tightest packings (6 + 6 + 4) put group positions across domains."""
    rng = np.random.default_rng(seed)
    inst = random_instance(rng, num_experts=16, top_k=4, ep=16, dp=16, pp=1, num_domains=4, trays_per_domain=4,
                           gpus_per_tray=2, tokens=8, moe_layers=2, num_groups=4, groups_per_token=2)
    available = np.ones(inst.cluster.num_gpus, dtype=bool)
    available[[0, 1, 8, 9, 16, 17, 24, 25]] = False  # one tray down in every domain: free 6, 6, 6, 6
    return _with_available(inst, available)


def test_group_aligned_candidate_keeps_group_positions_in_one_domain():
    inst = _straddling_groups()
    plan = _plan(inst, group_preserving=True)
    cands = plan.details["candidates"]
    assert "first_fit, whole expert groups" in cands
    plan_free = _plan(inst, group_preserving=False)
    assert "first_fit, whole expert groups" not in plan_free.details["candidates"]
    # the candidate's layout: every domain holds a whole number of group positions (4 GPUs)
    from solvers.layout.plan import LayoutPlanner

    planner = LayoutPlanner(inst.for_solver(), SolveOptions(num_workers=1, objective="total", group_preserving=True),
                            deadline=time.monotonic() + 60, work_s=None)
    planner.score_peers()
    cand = next(c for c in planner.cands if c.name == "first_fit, whole expert groups")
    counts = np.bincount(inst.cluster.gpu2domain[cand.rank2gpu], minlength=inst.cluster.num_domains)
    assert all(c % 4 == 0 for c in counts) and counts.sum() == 16
    placement = Placement(cand.rank2gpu, cand.estimate["phy2log"])
    assert check(inst, placement) == []
    # its estimate is the evaluator's bytes
    assert evaluate(inst, placement).cross_domain_bytes_per_step == pytest.approx(cand.estimate["total_bytes"])
    # and the chosen layout is never worse on the objective than this candidate (on the estimator's
    # whole-domain count), unless the evaluator's HybridEP pricing sent the plan back to the default
    if plan.details["chosen"] != "default, contiguous experts":
        assert plan.details["estimated_total_bytes"] <= cand.estimate["total_bytes"] + 1e-6
