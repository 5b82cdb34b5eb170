"""Redundant expert slots: the data model, the two replica rules, the placement file's block, verify,
the CLI's --redundant-experts, and the SGLang / vLLM exports loaded by SGLang's own code."""

from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from placement.consumers import export as ex
from placement.cli import main
from placement.formats import placement_document, read_placement, write_placement
from placement.formats.replicas import replica_violations
from placement.app.replica_block import replicas_block
from placement.core.model import InvalidInputError, Placement
from placement.core.replicas import (
    ReplicaMap,
    check_redundant_experts,
    eplb_replicate,
    expert_loads,
    extra_slot_bytes,
    hottest_on_busiest_rank,
    load_max_over_mean,
    physical_map,
    rank_loads,
    replicate_counts,
)
from placement.app.show import replica_label
from placement.app.verify import verify_document
from solvers.default import default_placement
from tests.conftest import INSTANCES
from tests.test_export import sglang_instance, write_pair


# ---------------------------------------------------------------------------------------------
# Data model, hand-counted
# ---------------------------------------------------------------------------------------------
def test_maps_counted_by_hand():
    # E = 4, ep = 2, N = 2: rank 0 slots 0..2 hold 2, 0, (3); rank 1 slots 3..5 hold 1, 3, (2)
    rmap = ReplicaMap(np.array([[2, 0, 3, 1, 3, 2]]), num_experts=4, ep=2)
    assert rmap.slots_per_rank == 3 and rmap.num_redundant == 2
    assert rmap.logcnt.tolist() == [[1, 1, 2, 2]]
    assert rmap.log2phy.tolist() == [[[1, -1, -1], [3, -1, -1], [0, 5, -1], [2, 4, -1]]]
    assert rmap.token_share.tolist() == [[0.5, 1.0, 0.5, 1.0, 0.5, 0.5]]
    # loads 10, 20, 30, 40: rank 0 = 30/2 + 10 + 40/2 = 45, rank 1 = 20 + 40/2 + 30/2 = 55
    assert rank_loads(rmap, np.array([[10.0, 20.0, 30.0, 40.0]])).tolist() == [[45.0, 55.0]]
    assert load_max_over_mean(rmap, np.array([[10.0, 20.0, 30.0, 40.0]])) == pytest.approx(55 / 50)
    assert rmap.problems(np.array([[2, 0, 1, 3]])) == []


def test_problems_name_each_broken_rule():
    base = np.array([[2, 0, 1, 3]])
    twice = ReplicaMap(np.array([[2, 0, 2, 1, 3, 0]]), 4, 2)
    assert any("EP rank 0 holds expert 2 twice" in p for p in twice.problems(base))
    missing = ReplicaMap(np.array([[2, 0, 1, 1, 0, 2]]), 4, 2)
    assert any("expert 3 has no slot" in p for p in missing.problems())
    moved = ReplicaMap(np.array([[0, 2, 3, 1, 3, 2]]), 4, 2)
    assert any("slot 0 holds expert 0, but the placement's phy2log[0][0] is 2" in p for p in moved.problems(base))
    assert ReplicaMap(np.zeros((1, 5), dtype=int), 4, 2).problems()[0].endswith("do not divide over ep=2")


@pytest.mark.parametrize("n, ok", [(0, True), (4, True), (8, True), (3, False), (-4, False), (True, False)])
def test_redundant_experts_must_divide_over_ep(n, ok):
    if ok:
        assert check_redundant_experts(16, 4, n) == n
    else:
        with pytest.raises(InvalidInputError, match=r"^redundant_experts: "):
            check_redundant_experts(16, 4, n)


def test_extra_slot_bytes_counts_weights_gradient_and_sharded_optimizer_state():
    assert extra_slot_bytes(1000) == 1000 * (2 + 4 + 12)
    assert extra_slot_bytes(1000, 4) == 1000 * (2 + 4 + 3)
    assert extra_slot_bytes(1000, 4, sharded_optimizer=False) == 1000 * 18


# ---------------------------------------------------------------------------------------------
# Replica rules
# ---------------------------------------------------------------------------------------------
@st.composite
def rule_case(draw):
    ep = draw(st.sampled_from([2, 4]))
    e = ep * draw(st.integers(1, 3))
    n = ep * draw(st.integers(0, 2))
    if (e + n) // ep > e:
        n = ep * (e - e // ep)  # the most a rank can take: every expert once
    layers = draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    base = np.stack([rng.permutation(e) for _ in range(layers)])
    loads = rng.integers(0, 50, size=(layers, e)).astype(float) * rng.pareto(1.0, size=(layers, e))
    return base, loads, ep, n


@settings(max_examples=60, deadline=None)
@given(rule_case())
def test_both_rules_give_valid_maps_with_n_extra_slots(case):
    base, loads, ep, n = case
    for rmap in (hottest_on_busiest_rank(base, loads, ep, n), eplb_replicate(base, loads, ep, n)):
        assert rmap.num_redundant == n
        assert rmap.problems(base) == []
        # the static split keeps every token: rank loads sum to the expert loads
        np.testing.assert_allclose(rank_loads(rmap, loads).sum(axis=1), loads.sum(axis=1))


def brute_force_min_max_share(w: np.ndarray, n: int) -> float:
    """min over count vectors (each >= 1, summing to E + N) of max w / count."""
    best = np.inf
    for extra in itertools.product(range(n + 1), repeat=len(w)):
        if sum(extra) == n:
            best = min(best, float(np.max(w / (1 + np.array(extra)))))
    return best


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=2, max_size=4), st.integers(0, 4))
def test_eplb_replica_counts_minimise_the_heaviest_replica(w, n):
    # EPLB's replicate_experts greedy is optimal for max(w / count): check against every count vector
    wa = np.array(w, dtype=float)
    counts = replicate_counts(wa, n)
    assert counts.sum() == len(w) + n and counts.min() >= 1
    assert float(np.max(wa / counts)) == pytest.approx(brute_force_min_max_share(wa, n))


def test_eplb_rule_uses_those_counts_when_they_fit():
    # one redundant slot per rank, four hot experts: each gets one replica on a rank that lacks it
    rng = np.random.default_rng(3)
    base = np.stack([rng.permutation(16) for _ in range(3)])
    loads = rng.uniform(10, 20, size=(3, 16))
    loads[:, [1, 5, 9, 13]] = [[90, 80, 70, 60]]
    rmap = eplb_replicate(base, loads, 4, 4)
    for li in range(3):
        np.testing.assert_array_equal(rmap.logcnt[li], replicate_counts(loads[li], 4, max_count=4))
        assert sorted(np.flatnonzero(rmap.logcnt[li] == 2)) == [1, 5, 9, 13]


def test_hottest_relieves_the_busiest_rank_inside_its_domain():
    # ep 4 over two domains (ranks 0,1 | 2,3); expert 0 (on rank 0) carries most tokens
    base = np.array([[0, 1, 2, 3, 4, 5, 6, 7]])
    loads = np.array([[100.0, 10, 10, 10, 10, 10, 10, 10]])
    rmap = hottest_on_busiest_rank(base, loads, 4, 4, rank2domain=np.array([0, 0, 1, 1]))
    # first replica of expert 0 goes to rank 1 (same domain, lighter), shares then 50/50
    assert rmap.phy2log[0, 3 * 1 + 2] == 0
    assert rank_loads(rmap, loads).max() < rank_loads(physical_map(base, np.zeros((1, 4, 0)), 4), loads).max()


def test_on_dsv3_256_replicas_lower_the_sampled_rank_imbalance():
    from placement.formats import read_instance

    inst = read_instance(INSTANCES / "dsv3_256.json")
    p = default_placement(inst)
    loads = expert_loads(inst.routing.topk, inst.model.num_experts)
    none = load_max_over_mean(physical_map(p.phy2log, np.zeros((p.phy2log.shape[0], inst.parallel.ep, 0)),
                                           inst.parallel.ep), loads)
    for rule in ("hottest", "eplb"):
        block = replicas_block(inst, p, 64, rule)
        assert block["metrics"]["sampled_rank_load_max_over_mean"] == pytest.approx(none)
        assert block["metrics"]["sampled_rank_load_max_over_mean_with_replicas"] < none


# ---------------------------------------------------------------------------------------------
# The placement file's block, verify, show
# ---------------------------------------------------------------------------------------------
def test_block_round_trips_and_verify_checks_it(tmp_path, tiny):
    p = default_placement(tiny)
    block = replicas_block(tiny, p, 8, "hottest")
    path = tmp_path / "p.json"
    write_placement(path, placement_document(tiny, p, solver="test", replicas=block))
    back, doc = read_placement(path)
    assert doc["replicas"] == json.loads(json.dumps(block))
    assert len(path.read_text().splitlines()) < 60  # one line per layer, not per number
    report = verify_document(tiny, back, doc)
    assert report.valid and "replicas" in report.checks
    bad = json.loads(json.dumps(doc))
    bad["replicas"]["phy2log"][1][0] = (bad["replicas"]["phy2log"][1][0] + 1) % tiny.model.num_experts
    assert any(v.startswith("replicas") for v in verify_document(tiny, back, bad).violations)
    lie = json.loads(json.dumps(doc))
    lie["replicas"]["metrics"]["heldout_rank_load_max_over_mean_with_replicas"] = 1.0
    assert any("heldout_rank_load_max_over_mean_with_replicas" in v for v in verify_document(tiny, back, lie).violations)
    width = json.loads(json.dumps(doc))
    width["replicas"]["num_redundant_experts"] = 16
    assert any("replicas.phy2log[0]: expected 32 slots" in v for v in replica_violations(tiny, back, width))
    assert replica_label(doc, tiny.parallel.ep) == ", + 8 redundant expert slots per MoE layer (1 per GPU, rule hottest)"


def test_cli_solve_refuses_a_count_ep_does_not_divide_in_one_line(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["solve", str(INSTANCES / "tiny.json"), "--redundant-experts", "3", "-o", str(out), "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "redundant_experts" in err and "ep=8" in err
    assert not out.exists()


def test_cli_solve_writes_replicas_that_verify_accepts(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["solve", str(INSTANCES / "tiny.json"), "--redundant-experts", "8", "--replica-rule", "eplb",
                 "--time-limit", "20", "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["replicas"]["rule"] == "eplb" and "replicas" not in doc["solve"]["details"]
    printed = capsys.readouterr().out
    held = doc["replicas"]["metrics"]["heldout_rank_load_max_over_mean_with_replicas"]
    assert "replicas: 8 redundant slots per MoE layer (rule eplb)" in printed and f"-> {held:.3f}" in printed
    assert main(["verify", str(INSTANCES / "tiny.json"), str(out)]) == 0
    assert "replicas" in capsys.readouterr().out


def test_api_refuses_a_bad_count_before_solving(tiny):
    from placement.api import solve

    with pytest.raises(InvalidInputError, match="^redundant_experts: "):
        solve(tiny, time_limit_s=5, redundant_experts=4)
    with pytest.raises(InvalidInputError, match="^replica_rule: "):
        solve(tiny, time_limit_s=5, redundant_experts=8, replica_rule="random")


# ---------------------------------------------------------------------------------------------
# Exports
# ---------------------------------------------------------------------------------------------
def replica_pair(tmp_path, n=4, rule="hottest"):
    inst = sglang_instance()
    p = Placement(default_placement(inst).rank2gpu, np.stack([np.random.default_rng(i).permutation(inst.model.num_experts)
                                                               for i in range(inst.model.num_moe_layers)]))
    ipath, ppath, inst = write_pair(tmp_path, inst, p)
    doc = placement_document(inst, p, solver="test", replicas=replicas_block(inst, p, n, rule))
    write_placement(ppath, doc)
    return inst, ipath, ppath, ReplicaMap(np.array(doc["replicas"]["phy2log"]), inst.model.num_experts, inst.parallel.ep)


def test_vllm_export_carries_the_replica_maps(tmp_path):
    inst, ipath, ppath, rmap = replica_pair(tmp_path)
    out = tmp_path / "vllm.json"
    ex.export_file("vllm", ppath, out, ipath)
    doc = json.loads(out.read_text())
    np.testing.assert_array_equal(ex.parse_vllm_eplb_maps(doc), rmap.phy2log)
    np.testing.assert_array_equal(np.array(doc["logical_to_physical_map"]), rmap.log2phy)
    np.testing.assert_array_equal(np.array(doc["logical_replica_count"]), rmap.logcnt)
    assert doc["meta"]["num_redundant_experts"] == 4
    with pytest.raises(InvalidInputError, match="needs the instance"):
        ex.export_file("vllm", ppath, out)


def test_formats_without_replicas_write_the_permutation(tmp_path):
    inst, ipath, ppath, rmap = replica_pair(tmp_path)
    out = tmp_path / "perm.json"
    ex.export_file("megatron", ppath, out, ipath)
    placement, _ = read_placement(ppath)
    text = ex.export_text("megatron", placement, inst)
    assert out.read_text() == text


def _sglang_seams(monkeypatch, el, path, n, ep, num_layers, num_experts, num_groups):
    """SGLang reads its server arguments through runtime_context accessors and the model's class
    method ``get_model_config_for_expert_location`` (DeepseekV2ForCausalLM returns exactly these
    fields); stand in for the server and the model, nothing else."""
    moe = SimpleNamespace(init_expert_location=str(path), ep_num_redundant_experts=n, ep_join_mode="none",
                          ep_dispatch_algorithm="static", moe_a2a_backend="none")
    monkeypatch.setattr(el, "get_exec", lambda: SimpleNamespace(moe=moe))
    monkeypatch.setattr(el, "get_parallel", lambda: SimpleNamespace(ep_size=ep, elastic_ep_initial_size=None,
                                                                     nnodes=1, tp_size=ep))
    monkeypatch.setattr(el, "get_device", lambda: SimpleNamespace(device="cpu"))
    monkeypatch.setattr(el, "_prefer_same_node_experts", lambda: False)
    monkeypatch.setattr(el.ModelConfigForExpertLocation, "from_model_config", staticmethod(
        lambda _cfg: el.ModelConfigForExpertLocation(num_layers, num_experts, num_groups)))


def test_sglang_builds_its_metadata_from_our_file(tmp_path, monkeypatch):
    el = pytest.importorskip("sglang.srt.eplb.expert_location")
    inst, ipath, ppath, rmap = replica_pair(tmp_path)
    out = tmp_path / "sglang.json"
    ex.export_file("sglang", ppath, out, ipath)
    m, ep = inst.model, inst.parallel.ep
    _sglang_seams(monkeypatch, el, out, rmap.num_redundant, ep, m.num_layers, m.num_experts, m.num_groups)
    moe_rows = [layer for layer in m.moe_layers if layer < m.num_layers]
    for rank in range(ep):
        meta = el.compute_initial_expert_location_metadata(None, rank)
        assert meta.num_physical_experts == m.num_experts + 4 and meta.num_local_physical_experts == rmap.slots_per_rank
        p2l = meta.physical_to_logical_map.numpy()
        np.testing.assert_array_equal(p2l[moe_rows], rmap.phy2log)
        l2p = meta.logical_to_all_physical_map.numpy()[moe_rows]
        cnt = meta.logical_to_all_physical_map_num_valid.numpy()[moe_rows]
        np.testing.assert_array_equal(cnt, rmap.logcnt)
        dispatch = meta.logical_to_rank_dispatch_physical_map.numpy()[moe_rows]
        for li in range(rmap.num_layers):
            for e in range(m.num_experts):
                slots = sorted(int(s) for s in rmap.log2phy[li, e] if s >= 0)
                assert sorted(int(s) for s in l2p[li, e] if s >= 0) == slots  # every physical slot of e
                pick = int(dispatch[li, e])
                assert pick in slots
                local = [s for s in slots if s // rmap.slots_per_rank == rank]
                assert not local or pick == local[0]  # SGLang's static dispatch prefers the rank's own copy


def test_sglang_refuses_the_counts_we_refuse(tmp_path, monkeypatch):
    el = pytest.importorskip("sglang.srt.eplb.expert_location")
    inst, ipath, ppath, rmap = replica_pair(tmp_path)
    out = tmp_path / "sglang.json"
    ex.export_file("sglang", ppath, out, ipath)
    m, ep = inst.model, inst.parallel.ep
    for n in (3, 4 + 1):  # E + N not divisible by ep: SGLang's _init_common asserts, check_redundant_experts refuses
        _sglang_seams(monkeypatch, el, out, n, ep, m.num_layers, m.num_experts, m.num_groups)
        with pytest.raises(AssertionError):
            el.compute_initial_expert_location_metadata(None, 0)
        with pytest.raises(InvalidInputError, match="^redundant_experts: "):
            check_redundant_experts(m.num_experts, ep, n)


def test_vllm_maps_reproduce_vllms_documented_example():
    # vLLM's own example (vLLM 0.34.0, vllm/distributed/eplb/eplb_state.py, EplbModelState field docs):
    # 2 MoE layers, 6 physical and 4 logical experts on 3 EP ranks
    p2l = [[0, 1, 2, 3, 0, 1], [0, 2, 0, 1, 0, 3]]
    want_l2p = [[[0, 4, -1], [1, 5, -1], [2, -1, -1], [3, -1, -1]],
                [[0, 2, 4], [3, -1, -1], [1, -1, -1], [5, -1, -1]]]
    want_count = [[2, 2, 1, 1], [3, 1, 1, 1]]
    rmap = ReplicaMap(np.array(p2l), num_experts=4, ep=3)
    assert rmap.log2phy.tolist() == want_l2p and rmap.logcnt.tolist() == want_count
    doc = ex.vllm_eplb_maps(Placement(np.arange(3), np.array(p2l)), SimpleNamespace(
        model=SimpleNamespace(num_experts=4, moe_layers=(0, 1)), parallel=SimpleNamespace(ep=3),
        name="example", sha256=""))
    assert doc["logical_to_physical_map"] == want_l2p and doc["logical_replica_count"] == want_count


def test_replica_map_update_checks_every_map_before_writing_and_replan_needs_a_model():
    torch = pytest.importorskip("torch")
    from placement import replica_runtime as rr

    installed = rr.InstalledReplicas("TorchTitan", 4)
    for layer in (0, 1):
        p2l = np.array([0, 1, 3, 2, 3, 0])
        installed._layers[layer] = (p2l, 0, [[], [], []])
        installed._route[layer] = rr._slot_table(torch, p2l, 4, torch.device("cpu"))
    with pytest.raises(InvalidInputError, match="experts \\[3\\] have no slot"):  # layer 1 bad: layer 0 unwritten
        installed.update({0: [1, 0, 3, 2, 3, 0], 1: [0, 1, 2, 2, 1, 0]})
    with pytest.raises(InvalidInputError, match="8 slots, the model 6"):
        installed.update({0: [0, 1, 2, 3, 0, 1, 2, 3]})
    assert installed.phy2log(0).tolist() == [0, 1, 3, 2, 3, 0]
    # the permutation slots may move too (placement.consumers.migrate moves their state)
    assert installed.update({0: [1, 0, 3, 2, 1, 0], 1: [0, 1, 3, 2, 3, 0]}) == [0]
    cnt, table_t = installed._route[0]
    # (N + 1, E) slots of each expert, padded with its first: 0 in slots 1, 5; 1 in 0, 4; 2 in 3; 3 in 2
    assert cnt.tolist() == [2, 2, 1, 1] and table_t.tolist() == [[1, 0, 3, 2], [5, 4, 3, 2], [1, 0, 3, 2]]
    with pytest.raises(InvalidInputError, match="^replan: this InstalledReplicas has no model"):
        installed.replan({0: [0, 1, 3, 2, 3, 0]}, None)
    installed._model = object()
    with pytest.raises(InvalidInputError, match="^group: a TorchTitan re-plan needs the EP process group"):
        installed.replan({0: [0, 1, 3, 2, 3, 0]}, None)


def test_maps_from_recent_loads_keep_the_permutation_and_follow_the_new_hot_expert():
    pytest.importorskip("torch")
    from placement import replica_runtime as rr

    installed = rr.InstalledReplicas("Megatron", 8)
    # ep 4, 3 slots per rank: rank r holds 2r, 2r + 1 and one replica
    installed._layers[0] = (np.array([0, 1, 5, 2, 3, 0, 4, 5, 1, 6, 7, 4]), 0, [[], [], []])
    loads = np.full(8, 10.0)
    loads[6] = 100.0  # expert 6 (rank 3) became the hot one
    new = installed.maps_from_loads({0: loads})[0]
    rmap = ReplicaMap(new[None, :], 8, 4)
    assert rmap.problems(np.arange(8)[None, :]) == []
    assert rmap.logcnt[0, 6] >= 2  # the hot expert got a replica
    assert rank_loads(rmap, loads[None, :]).max() < rank_loads(ReplicaMap(np.array([installed.phy2log(0)]), 8, 4),
                                                                loads[None, :]).max()
