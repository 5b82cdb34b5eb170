"""The evaluator against a slow, obviously correct reference, and against known expectations."""

from __future__ import annotations

from functools import reduce
from itertools import groupby
from math import comb, gcd

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from placement.predict.cost import evaluate
from placement.predict.report import report
from placement.core.model import Cluster, Instance, MoEModel, ParallelLayout, Placement, Routing
from tests.conftest import random_instance, random_placement


def hybridep_nodes(domains: list[int]) -> int:
    """HybridEP's ranks per node of one EP group: the gcd of its runs of consecutive EP ranks in one
    domain (deepseek-ai/DeepEP hybrid-ep, deep_ep/hybrid_ep_buffer.py: node = rank // n)."""
    runs = [len(list(r)) for _, r in groupby(domains)]
    return reduce(gcd, runs)


def reference(inst: Instance, pl: Placement, window: str, mode: str) -> dict:
    """Token by token, with sets and dicts: what the cost model's docstring says, nothing clever.

    ``per_domain`` is HybridEP: nodes of ``n`` consecutive EP ranks (``n`` the gcd of the group's
    runs per domain), one crossing per remote node, landing on the same local index, NVLink from
    the GPU a copy reached first; each NIC at max(copies sent, copies received) per layer.
    """
    m, par, cl = inst.model, inst.parallel, inst.cluster
    topk = inst.routing.topk if window == "sampled" else inst.routing.heldout_topk
    L, dp, T, k = topk.shape
    w = par.global_batch * par.seq_len / par.dp / T
    e_per_rank = m.num_experts // par.ep
    sent: dict = {}
    recv: dict = {}
    nvl: dict = {}
    load: dict = {}
    cross = [0.0] * L
    cross_group = np.zeros((par.pp, par.ranks_per_stage // par.ep))
    remote_doms = 0
    remote_nodes = 0
    remote_pairs = 0
    coords = par.rank_coords
    for li in range(L):
        layer = m.moe_layers[li]
        s = par.layer2stage[layer]
        stage_ranks = [r for r in range(par.world_size) if coords["pp"][r] == s]
        groups = [stage_ranks[i : i + par.ep] for i in range(0, len(stage_ranks), par.ep)]
        slot_of = {int(e): p for p, e in enumerate(pl.phy2log[li])}
        for j in range(dp):
            senders = [r for r in stage_ranks if coords["dp"][r] == j]
            for t in range(T):
                src = senders[t % len(senders)]
                gi = next(i for i, g in enumerate(groups) if src in g)
                group = groups[gi]
                n = hybridep_nodes([int(cl.gpu2domain[pl.rank2gpu[r]]) for r in group])
                si = group.index(src)
                sg = int(pl.rank2gpu[src])
                sd = int(cl.gpu2domain[sg])
                eranks = [slot_of[int(e)] // e_per_rank for e in topk[li, j, t]]
                gpus = [int(pl.rank2gpu[group[r]]) for r in eranks]
                doms = [int(cl.gpu2domain[g]) for g in gpus]
                for g in gpus:
                    load[(li, g)] = load.get((li, g), 0) + w
                remote = set(doms) - {sd}
                remote_doms += len(remote)
                remote_pairs += sum(d != sd for d in doms)
                if mode == "per_domain":
                    nodes = {r // n for r in eranks} - {si // n}
                    remote_nodes += len(nodes)
                    cross[li] += len(nodes) * w * m.roundtrip_bytes_per_copy
                    cross_group[s, gi] += len(nodes) * w * m.roundtrip_bytes_per_copy
                    sent[(li, sg)] = sent.get((li, sg), 0) + len(nodes) * w
                    landing = {si // n: sg}
                    for q in nodes:
                        lg = int(pl.rank2gpu[group[q * n + si % n]])
                        landing[q] = lg
                        recv[(li, lg)] = recv.get((li, lg), 0) + w
                    for r in set(eranks):
                        g = int(pl.rank2gpu[group[r]])
                        if g != landing[r // n]:
                            nvl[(li, g)] = nvl.get((li, g), 0) + w * m.nic_bytes_per_copy
                else:
                    remote_nodes += len(remote)
                    for g, d in zip(gpus, doms):
                        if d != sd:
                            cross[li] += w * m.roundtrip_bytes_per_copy
                            cross_group[s, gi] += w * m.roundtrip_bytes_per_copy
                            sent[(li, sg)] = sent.get((li, sg), 0) + w
                            recv[(li, g)] = recv.get((li, g), 0) + w
                        elif g != sg:
                            nvl[(li, g)] = nvl.get((li, g), 0) + w * m.nic_bytes_per_copy
    per_gpu_total: dict = {}
    for key in set(sent) | set(recv):
        busier = max(sent.get(key, 0.0), recv.get(key, 0.0)) * m.roundtrip_bytes_per_copy
        per_gpu_total[key[1]] = per_gpu_total.get(key[1], 0) + busier
    lmm = []
    for li in range(L):
        s = par.layer2stage[m.moe_layers[li]]
        worst = 0.0
        for group in par.stage_ep_groups[s]:
            vals = [load.get((li, int(pl.rank2gpu[r])), 0.0) for r in group]
            mean = sum(vals) / len(vals)
            worst = max(worst, max(vals) / mean if mean else 1.0)
        lmm.append(worst)
    return {
        "cross": sum(cross),
        "cross_per_layer": cross,
        "cross_per_group": cross_group,
        "max_nic": max(per_gpu_total.values(), default=0.0),
        "max_sent": [max([v for (lj, _), v in sent.items() if lj == li], default=0.0) * m.roundtrip_bytes_per_copy
                     for li in range(L)],
        "max_recv": [max([v for (lj, _), v in recv.items() if lj == li], default=0.0) * m.roundtrip_bytes_per_copy
                     for li in range(L)],
        "intra": sum(nvl.values()) * m.roundtrip_bytes_per_copy / m.nic_bytes_per_copy,  # as fabric copies
        "lmm": max(lmm),
        "remote_domains_per_token": remote_doms / (L * dp * T),
        "remote_nodes_per_token": remote_nodes / (L * dp * T),
        "remote_experts_per_token": remote_pairs / (L * dp * T),
    }


shapes = st.fixed_dictionaries(
    {
        "seed": st.integers(0, 2**31),
        "mode": st.sampled_from(["per_domain", "per_pair"]),
        "window": st.sampled_from(["sampled", "heldout"]),
        "layout": st.sampled_from(
            [
                dict(ep=4, dp=4, pp=2),
                dict(ep=2, dp=4, pp=1),  # two EP groups per stage
                dict(ep=4, dp=2, tp=2, pp=1),  # TP splits a replica's tokens
                dict(ep=8, dp=8, pp=1, num_experts=16, top_k=4),
                dict(ep=4, dp=4, pp=1, num_experts=32, top_k=20),  # top-k > 16: the sorting path
            ]
        ),
    }
)


@settings(max_examples=60, deadline=None)
@given(shapes)
def test_matches_reference(case):
    rng = np.random.default_rng(case["seed"])
    inst = random_instance(rng, cost_mode=case["mode"], num_domains=4, **case["layout"])
    pl = random_placement(rng, inst)
    got = evaluate(inst, pl, window=case["window"])
    ref = reference(inst, pl, case["window"], case["mode"])
    assert got.cross_domain_bytes_per_step == pytest.approx(ref["cross"], rel=1e-9, abs=1e-6)
    assert got.cross_domain_bytes_per_layer == pytest.approx(ref["cross_per_layer"], rel=1e-9, abs=1e-6)
    assert got.max_gpu_cross_domain_bytes_per_step == pytest.approx(ref["max_nic"], rel=1e-9, abs=1e-6)
    assert got.intra_domain_bytes_per_step == pytest.approx(ref["intra"], rel=1e-9, abs=1e-6)
    assert got.expert_load_max_over_mean == pytest.approx(ref["lmm"], rel=1e-9)
    assert got.remote_domains_per_token == pytest.approx(ref["remote_domains_per_token"])
    assert got.remote_experts_per_token == pytest.approx(ref["remote_experts_per_token"])
    assert got.remote_nodes_per_token == pytest.approx(ref["remote_nodes_per_token"])
    assert got.max_gpu_nic_sent_bytes_per_layer == pytest.approx(ref["max_sent"], rel=1e-9, abs=1e-6)
    assert got.max_gpu_nic_received_bytes_per_layer == pytest.approx(ref["max_recv"], rel=1e-9, abs=1e-6)
    assert sum(got.cross_domain_bytes_per_stage) == pytest.approx(got.cross_domain_bytes_per_step)
    per_group = np.array(got.cross_domain_bytes_per_ep_group)
    assert per_group.shape == ref["cross_per_group"].shape
    assert per_group == pytest.approx(ref["cross_per_group"], rel=1e-9, abs=1e-6)
    assert per_group.sum(axis=1) == pytest.approx(got.cross_domain_bytes_per_stage, rel=1e-9, abs=1e-6)


@pytest.mark.parametrize("num_domains,expected", [(2, 1.00), (4, 2.71), (8, 4.65), (16, 6.12)])
def test_uniform_random_placement_remote_domains(num_domains, expected):
    """docs/design.md section 3's sanity check: 256 experts spread uniformly over D equal domains."""
    rng = np.random.default_rng(num_domains)
    E, k, ep = 256, 8, 64
    gpd = ep // num_domains
    model = MoEModel("u", 1, (0,), E, k, 1, 1, 7168, 7392, 14336)
    par = ParallelLayout(1, 1, ep, ep, 1, "tp-cp-ep-dp-pp", ((0,),), 4096, 1, ep)
    cl = Cluster(num_domains, 1, gpd, np.ones(ep, dtype=bool), 900.0, 100.0)
    tokens = 2000
    topk = np.sort(np.argsort(rng.random((1, ep, tokens, E)), axis=-1)[..., :k], axis=-1)
    inst = Instance("u", model, par, cl, Routing(topk, None), "per_domain")
    pl = Placement(np.arange(ep), rng.permutation(E)[None, :])
    got = evaluate(inst, pl).remote_domains_per_token
    exact = (num_domains - 1) * (1 - comb(E - E // num_domains, k) / comb(E, k))
    assert got == pytest.approx(expected, rel=0.02)
    assert exact == pytest.approx(expected, rel=0.01)


def test_single_domain_costs_nothing():
    rng = np.random.default_rng(0)
    inst = random_instance(rng, num_domains=1, trays_per_domain=4, ep=4, dp=4, pp=2)
    pl = random_placement(rng, inst)
    m = evaluate(inst, pl)
    assert m.cross_domain_bytes_per_step == 0 and m.max_gpu_cross_domain_bytes_per_step == 0


def test_report_has_heldout_twins(tiny):
    from solvers.default import default_placement

    r = report(tiny, default_placement(tiny))
    for key in ("cross_domain_bytes_per_step", "intra_domain_bytes_per_step",
                "max_gpu_cross_domain_bytes_per_step", "expert_load_max_over_mean"):
        assert key in r and f"heldout_{key}" in r
    assert len(r["cross_domain_bytes_per_layer"]) == tiny.model.num_moe_layers
    assert len(r["heldout_cross_domain_bytes_per_stage"]) == tiny.parallel.pp


def test_per_pair_at_least_per_domain(tiny):
    from solvers.default import default_placement

    pl = default_placement(tiny)
    a = evaluate(tiny, pl, cost_mode="per_domain").cross_domain_bytes_per_step
    b = evaluate(tiny, pl, cost_mode="per_pair").cross_domain_bytes_per_step
    assert b >= a > 0
