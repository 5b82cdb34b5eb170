"""The dispatcher's node rule (placement.core.dispatch) in the evaluator, the solve and the HybridEP export.

Hand counts on hand-made instances: an EP group of 64 split 8/56 over two racks runs as HybridEP
runs it (nodes of 8, RDMA between nodes of one rack, landing on the sender's local index); a 32/32
split keeps the old per-domain crossings and changes only by the per-direction NIC.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from placement.consumers import export as ex
from placement.predict.cost import evaluate, sampled_token_weight
from placement.core.dispatch import node_labels, node_size
from placement.core.model import Cluster, Instance, MoEModel, ParallelLayout, Placement, Routing
from tests.conftest import INSTANCES


def two_racks(slice0: int, topk: np.ndarray) -> tuple[Instance, Placement]:
    """One EP group of 64 ranks (one expert each, one sampled token per rank), its first ``slice0``
    EP ranks in rack 0 and the rest in rack 1 (two NVLink domains of 64 GPUs)."""
    ep = 64
    model = MoEModel("hand", 1, (0,), ep, topk.shape[-1], 1, 1, 7168, 7392, 14336)
    par = ParallelLayout(1, 1, ep, ep, 1, "tp-cp-ep-dp-pp", ((0,),), 4096, 1, ep)
    cl = Cluster(2, 16, 4, np.ones(128, dtype=bool), 900.0, 100.0)
    inst = Instance("hand", model, par, cl, Routing(topk.reshape(1, ep, -1, topk.shape[-1]), None), "per_domain")
    rank2gpu = np.r_[np.arange(slice0), 64 + np.arange(ep - slice0)]
    return inst, Placement(rank2gpu, np.arange(ep)[None, :])


def test_node_sizes():
    assert node_size(np.array([0] * 8 + [1] * 56), "hybridep") == 8
    assert node_size(np.array([0] * 20 + [1] * 44), "hybridep") == 4
    assert node_size(np.array([0] * 32 + [1] * 32), "hybridep") == 32
    assert node_size(np.array([0] * 32 + [1] * 32), "deepep") == 8  # NUM_MAX_NVL_PEERS
    assert node_size(np.array([3] * 8), "deepep") == 8  # one NVLink node: intranode kernels
    labels, sizes = node_labels(np.array([[0] * 8 + [1] * 56, [0] * 32 + [1] * 32]), "hybridep")
    assert sizes.tolist() == [8, 32]
    assert len(set(labels[0].tolist())) == 8 and labels[1].tolist() == [0] * 32 + [1] * 32


def test_8_56_split_is_priced_as_hybridep_runs_it():
    # Every token goes to experts 8 and 9: EP ranks 8 and 9, node 1 (ranks 8..15), in rack 1.
    topk = np.tile(np.array([8, 9]), (64, 1))
    inst, pl = two_racks(8, topk)
    m = evaluate(inst, pl)
    w = sampled_token_weight(inst, 1)
    rt = inst.model.roundtrip_bytes_per_copy
    # Hand count: the 8 senders of node 1 stay inside it; the 56 others (7 nodes, 48 of them in
    # rack 1 with node 1) cross once each.  The old per-domain count saw only rack 0's 8 senders.
    assert m.cross_domain_bytes_per_step == pytest.approx(56 * w * rt)
    assert m.remote_nodes_per_token == pytest.approx(56 / 64)
    assert m.remote_domains_per_token == pytest.approx(8 / 64)
    # Each sender sends 1 copy; the copy from EP rank j lands on rank 8 + j % 8, so each of node 1's
    # 8 ranks receives one copy from each of the 7 other nodes: 7 received, the busier direction.
    assert m.max_gpu_nic_sent_bytes_per_layer == pytest.approx([1 * w * rt])
    assert m.max_gpu_nic_received_bytes_per_layer == pytest.approx([7 * w * rt])
    assert m.max_gpu_cross_domain_bytes_per_layer == pytest.approx([7 * w * rt])
    assert m.max_gpu_cross_domain_bytes_per_step == pytest.approx(7 * w * rt)
    assert m.small_node_ep_groups == 1
    # NVLink: inside node 1 every token reaches ranks 8 and 9 from its landing GPU (or its sender):
    # 64 tokens x 2 targets, minus the copies that landed on (or started at) rank 8 or 9 itself
    # (senders with j % 8 in {0, 1}: 16 tokens, one target each).
    assert m.intra_domain_bytes_per_step == pytest.approx((128 - 16) * w * rt)
    # The same token-by-token on the round-robin routing of the issue: two remote nodes per token.
    rr = np.stack([(np.arange(64) + 8) % 64, (np.arange(64) + 16) % 64], axis=1)
    inst2, pl2 = two_racks(8, rr)
    m2 = evaluate(inst2, pl2)
    assert m2.cross_domain_bytes_per_step == pytest.approx(128 * w * rt)  # the old count: 24 crossings
    assert m2.remote_domains_per_token == pytest.approx(24 / 64)
    assert m2.max_gpu_cross_domain_bytes_per_step == pytest.approx(2 * w * rt)  # 2 sent, 2 received


def test_32_32_split_changes_only_by_the_per_direction_nic():
    rng = np.random.default_rng(7)
    topk = np.sort(np.argsort(rng.random((64, 3, 64)), axis=-1)[..., :4], axis=-1)  # 3 tokens per rank
    inst, pl = two_racks(32, topk)
    m = evaluate(inst, pl)
    w = sampled_token_weight(inst, 3)
    rt, nc = inst.model.roundtrip_bytes_per_copy, inst.model.nic_bytes_per_copy
    dom = np.r_[np.zeros(32, int), np.ones(32, int)]
    cross, sent, old_nic = 0, np.zeros(64), np.zeros(64)
    into = np.zeros(2)
    for j in range(64):
        for t in range(3):
            remote = set(dom[topk[j, t]].tolist()) - {dom[j]}
            cross += len(remote)
            sent[j] += len(remote)
            for d in remote:
                into[d] += 1
    old_nic = (sent + into[dom] / 32) * nc  # the old model: sent + an even share, (send + receive) at one copy
    # Crossings and every byte count over the fabric are the old per-domain ones.
    assert m.cross_domain_bytes_per_step == pytest.approx(cross * w * rt)
    assert m.remote_nodes_per_token == pytest.approx(m.remote_domains_per_token)
    assert m.small_node_ep_groups == 0
    assert m.max_gpu_nic_sent_bytes_per_layer == pytest.approx([sent.max() * w * rt])
    # The NIC term is the busier direction, not the old average: max(sent, received) x four transfers.
    assert m.max_gpu_cross_domain_bytes_per_step >= sent.max() * w * rt
    assert m.max_gpu_cross_domain_bytes_per_step != pytest.approx(old_nic.max() * w)
    recv_total = m.cross_domain_bytes_per_step / rt / w  # every crossing lands on one GPU
    assert recv_total == pytest.approx(cross)


# ---------------------------------------------------------------------------------------------
# The solve follows the dispatcher; its answer exports to HybridEP
# ---------------------------------------------------------------------------------------------
def _nodes_ok(inst: Instance, pl: Placement) -> list[str]:
    """Independent check of HybridEP's rule on the exported node sizes: n divides ep, and every
    run of n consecutive EP ranks sits in one NVLink domain."""
    rank2n = ex.hybridep_rank2n(inst, pl)
    par, cl = inst.parallel, inst.cluster
    bad = []
    for s in range(par.pp):
        for ranks in par.stage_ep_groups[s]:
            n = int(rank2n[ranks[0]])
            doms = [int(cl.gpu2domain[int(pl.rank2gpu[r])]) for r in ranks]
            if par.ep % n or any(len(set(doms[k:k + n])) != 1 for k in range(0, par.ep, n)):
                bad.append(f"stage {s}: nodes of {n} over {doms}")
    return bad


@pytest.mark.parametrize("name,time_limit", [("tiny", 10), ("dsv3_ep256", 15), ("qwen3_256", 15),
                                             ("dsv3_256", 15), ("dsv3_1024", 15)])
def test_every_hybridep_instance_solves_and_exports(tmp_path, capsys, name, time_limit):
    from placement.cli import main
    from placement.formats import read_instance, read_placement

    path = INSTANCES / f"{name}.json"
    inst = read_instance(path)
    assert inst.performance is not None and inst.performance.dispatcher == "hybridep"
    out, env = tmp_path / "p.json", tmp_path / "env.sh"
    assert main(["solve", str(path), "--time-limit", str(time_limit), "-o", str(out)]) == 0, capsys.readouterr().err
    assert main(["export", str(out), "--format", "hybridep", "--instance", str(path), "-o", str(env)]) == 0, \
        capsys.readouterr().err
    pl, doc = read_placement(out)
    assert doc["consumer"] in ("hybridep", "none")
    assert _nodes_ok(inst, pl) == []
    text = env.read_text()
    rank2n = ex.hybridep_rank2n(inst, pl)
    for rank in (0, inst.parallel.world_size - 1):
        got = ex.parse_hybridep_env_text(text, rank)["NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN"]
        assert int(got) == int(rank2n[rank])


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(down=st.lists(st.integers(0, 9), max_size=2, unique=True), order=st.randoms(use_true_random=False))
def test_no_returned_placement_breaks_its_dispatchers_rule(tiny, down, order):
    """tiny (dispatcher hybridep) with trays down (the one it has is brought back at random, so up
    to two trays of ten are down): the default solve either meets the equal-slice
    rule, or says it could not (consumer_fallback) and HybridEP runs its nodes; a DeepEP-dispatcher
    copy is solved under DeepEP's rule or refused."""
    from placement.api import solve
    from placement.core.model import InfeasibleError
    from solvers.layout.rules import equal_slice_breaks

    cl = tiny.cluster
    avail = np.ones(cl.num_gpus, dtype=bool) if order.random() < 0.5 else cl.available.copy()
    for tray in down:
        avail[tray * cl.gpus_per_tray:(tray + 1) * cl.gpus_per_tray] = False
    if int(avail.sum()) < tiny.parallel.world_size:
        return
    inst = dataclasses.replace(tiny, cluster=dataclasses.replace(cl, available=avail))
    res = solve(inst, time_limit_s=5, seed=0)
    assert _nodes_ok(inst, res.placement) == []
    if "consumer_fallback" not in res.params:
        assert res.consumer == "hybridep" and equal_slice_breaks(inst, res.placement.rank2gpu) == []
    deepep = dataclasses.replace(inst, performance=dataclasses.replace(inst.performance, dispatcher="deepep"))
    try:
        res = solve(deepep, time_limit_s=5, seed=0)
    except InfeasibleError as exc:
        assert "consumer none" in str(exc)
    else:
        assert res.consumer == "deepep" and equal_slice_breaks(deepep, res.placement.rank2gpu) == []


def test_hybridep_with_fp8_dispatch_bytes_is_refused_naming_the_field(tmp_path, capsys):
    """Megatron-Core's HybridEP path cannot dispatch in FP8 (megatron-core 0.16.1
    megatron/core/transformer/moe/fused_a2a.py): an instance that says hybridep with FP8-sized
    dispatch copies is refused in one line (exit 2), and no output file is written."""
    import json
    import shutil

    from placement.cli import main

    src = INSTANCES
    doc = json.loads((src / "tiny.json").read_text())
    assert doc["performance"]["dispatcher"] == "hybridep"
    doc["model"]["dispatch_bytes_per_token"] = doc["model"]["hidden_size"] + doc["model"]["hidden_size"] // 128 * 4
    shutil.copy(src / "tiny.npz", tmp_path / "tiny.npz")
    (tmp_path / "tiny.json").write_text(json.dumps(doc))
    out = tmp_path / "out.json"
    assert main(["solve", str(tmp_path / "tiny.json"), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.dispatch_bytes_per_token" in err[0] and "fused_a2a.py" in err[0]
    assert not out.exists()
    doc["performance"]["dispatcher"] = "deepep"  # DeepEP dispatches FP8: accepted
    (tmp_path / "tiny.json").write_text(json.dumps(doc))
    from placement.formats import read_instance

    assert read_instance(tmp_path / "tiny.json").model.dispatch_bytes_per_token == 264


def test_doctests():
    import doctest

    import placement.core.dispatch

    assert doctest.testmod(placement.core.dispatch).failed == 0


def test_deepep_group_inside_one_rack_is_one_nvlink_node():
    """NVIDIA's GB200 write-up measured DeepEP EP32 inside one NVL72 at NVLink bandwidth: one node;
    over several racks DeepEP's internode kernels run nodes of NUM_MAX_NVL_PEERS = 8."""
    assert node_size(np.array([5] * 32), "deepep") == 32
    assert node_size(np.array([5] * 32 + [6] * 32), "deepep") == 8
    assert node_size(np.array([5] * 4 + [6] * 4), "deepep") == 4
