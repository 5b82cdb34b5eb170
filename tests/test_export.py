"""Exporters: every format round-trips, refusals are refusals, the CLI writes what the API returns."""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from placement.consumers import export as ex
from placement.cli import main
from placement.formats import placement_document, read_instance, write_instance, write_placement
from placement.core.model import InfeasibleError, InvalidInputError, Placement
from solvers.default import default_placement, default_rank2gpu
from tests.conftest import INSTANCES, random_instance


def group_preserving_perm(rng: np.random.Generator, num_experts: int, num_groups: int) -> np.ndarray:
    """A random permutation that moves whole groups among group positions and shuffles inside them."""
    size = num_experts // num_groups
    return np.concatenate([g * size + rng.permutation(size) for g in rng.permutation(num_groups)])


def random_expert_map(rng, inst, preserving: bool) -> np.ndarray:
    m = inst.model
    rows = [
        group_preserving_perm(rng, m.num_experts, m.num_groups) if preserving else rng.permutation(m.num_experts)
        for _ in range(m.num_moe_layers)
    ]
    return np.stack(rows)


def write_pair(tmp_path, inst, placement: Placement, **doc_kw):
    """Write ``inst`` and ``placement`` as files; return (instance path, placement path, instance read back)."""
    ipath = tmp_path / "inst.json"
    write_instance(inst, ipath)
    inst = read_instance(ipath)
    ppath = tmp_path / "p.json"
    write_placement(ppath, placement_document(inst, placement, solver="test", **doc_kw))
    return ipath, ppath, inst


# ---------------------------------------------------------------------------------------------
# SGLang
# ---------------------------------------------------------------------------------------------
def sglang_instance():
    """pp=1, one dense layer then three MoE layers; 8 ranks = two EP groups of 4 on 4 hosts of 2 GPUs."""
    from dataclasses import replace

    inst = random_instance(np.random.default_rng(4), ep=4, dp=8, pp=1, num_domains=2, trays_per_domain=2, gpus_per_tray=2)
    model = replace(inst.model, num_layers=4, moe_layers=(1, 2, 3))
    return replace(inst, model=model, parallel=replace(inst.parallel, stage_layers=((0, 1, 2, 3),)))


def test_sglang_round_trip_and_shape():
    inst = sglang_instance()
    rng = np.random.default_rng(1)
    for _ in range(5):
        p = Placement(default_rank2gpu(inst), random_expert_map(rng, inst, preserving=False))
        text = ex.export_text("sglang", p, inst)
        doc = json.loads(text)
        # exactly one key: SGLang calls init_by_mapping(server_args, model_config, **doc)
        assert list(doc) == ["physical_to_logical_map"]
        rows = np.array(doc["physical_to_logical_map"])
        assert rows.shape == (inst.model.num_layers, inst.model.num_experts)  # all layers, dense included
        dense = [i for i in range(inst.model.num_layers) if i not in inst.model.moe_layers]
        assert dense and all((rows[i] == np.arange(inst.model.num_experts)).all() for i in dense)
        np.testing.assert_array_equal(ex.parse_sglang_expert_location(text, inst), p.phy2log)


def brute_force_sglang_runs(inst, r2g) -> bool:
    """SGLang's multi-node engine: node k runs EP ranks k*n .. k*n+n-1, one node per host."""
    cl = inst.cluster
    for ranks in inst.parallel.stage_ep_groups[0]:
        hosts = [int(cl.gpu2host[r2g[r]]) for r in ranks]
        ok = False
        for nodes in range(1, len(hosts) + 1):
            if len(hosts) % nodes:
                continue
            n = len(hosts) // nodes
            blocks = [hosts[k * n : (k + 1) * n] for k in range(nodes)]
            if all(len(set(b)) == 1 for b in blocks) and len({b[0] for b in blocks}) == nodes:
                ok = True
        if not ok:
            return False
    return True


def test_sglang_refuses_layouts_it_cannot_run(tmp_path, tiny, capsys):
    inst = sglang_instance()
    rng = np.random.default_rng(3)
    seen = set()
    for _ in range(60):
        r2g = rng.permutation(inst.cluster.num_gpus)[: inst.parallel.world_size]
        p = Placement(r2g, np.tile(np.arange(8), (3, 1)))
        runs = brute_force_sglang_runs(inst, r2g)
        seen.add(runs)
        assert (ex.sglang_layout_problem(inst, p) is None) == runs
    assert seen == {True, False}
    # pipeline parallel (tiny: pp=2): refused with exit 3 and one line, nothing written
    ppath = tmp_path / "p.json"
    write_placement(ppath, placement_document(tiny, default_placement(tiny), solver="default"))
    out = tmp_path / "sglang.json"
    assert main(["export", str(ppath), "--format", "sglang", "-o", str(out), "--instance", str(INSTANCES / "tiny.json")]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pp=2" in err and not out.exists()
    # SGLang reads a path as a file only when it ends in .json
    assert main(["export", str(ppath), "--format", "sglang", "-o", str(tmp_path / "map.txt"), "--instance", str(INSTANCES / "tiny.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "-o" in err and ".json" in err


def test_sglang_reader_rejects_what_sglang_would_not_take(tiny):
    p = default_placement(tiny)
    doc = ex.sglang_expert_location(tiny, p)
    with pytest.raises(InvalidInputError, match="exactly the key"):
        ex.parse_sglang_expert_location({**doc, "meta": {}}, tiny)
    with pytest.raises(InvalidInputError, match="one per transformer layer"):
        ex.parse_sglang_expert_location({"physical_to_logical_map": doc["physical_to_logical_map"][1:]}, tiny)
    bad = [row[:] for row in doc["physical_to_logical_map"]]
    bad[1][0] = tiny.model.num_experts
    with pytest.raises(InvalidInputError, match="expert ids"):
        ex.parse_sglang_expert_location({"physical_to_logical_map": bad}, tiny)


# ---------------------------------------------------------------------------------------------
# vLLM
# ---------------------------------------------------------------------------------------------
def test_vllm_maps_match_a_brute_force_inverse(tiny):
    rng = np.random.default_rng(2)
    p = Placement(default_rank2gpu(tiny), random_expert_map(rng, tiny, preserving=False))
    doc = json.loads(ex.export_text("vllm", p, tiny))
    L, E = p.phy2log.shape
    log2phy = np.array(doc["logical_to_physical_map"])
    assert log2phy.shape == (L, E, 1)  # (L, E, R + 1) with R = 0 redundant slots
    assert np.array(doc["logical_replica_count"]).tolist() == [[1] * E] * L
    for li in range(L):
        for e in range(E):
            (slot,) = [q for q in range(E) if p.phy2log[li, q] == e]
            assert log2phy[li, e, 0] == slot == p.log2phy[li, e]
    np.testing.assert_array_equal(ex.parse_vllm_eplb_maps(doc), p.phy2log)
    assert doc["meta"]["moe_layers"] == list(tiny.model.moe_layers)


def test_vllm_replicas_padded_with_minus_one():
    # Four logical experts on six physical slots: the example in vLLM's EplbState docstring.
    p = Placement(np.arange(3), np.array([[0, 1, 2, 3, 0, 1], [0, 2, 0, 1, 0, 3]]))
    inst = random_instance(np.random.default_rng(0), num_experts=4, ep=2, dp=2, pp=1, moe_layers=2)
    doc = ex.vllm_eplb_maps(p, inst)
    assert doc["logical_to_physical_map"] == [
        [[0, 4, -1], [1, 5, -1], [2, -1, -1], [3, -1, -1]],
        [[0, 2, 4], [3, -1, -1], [1, -1, -1], [5, -1, -1]],
    ]
    assert doc["logical_replica_count"] == [[2, 2, 1, 1], [3, 1, 1, 1]]
    np.testing.assert_array_equal(ex.parse_vllm_eplb_maps(json.loads(ex._json_text(doc))), p.phy2log)


def test_vllm_reader_catches_inconsistent_maps(tiny):
    doc = ex.vllm_eplb_maps(default_placement(tiny), tiny)
    doc["logical_to_physical_map"][0][3][0] = 4
    with pytest.raises(InvalidInputError, match="layer 0 expert 3"):
        ex.parse_vllm_eplb_maps(doc)


def test_vllm_needs_no_instance(tmp_path, tiny):
    ppath = tmp_path / "p.json"
    write_placement(ppath, placement_document(tiny, default_placement(tiny), solver="default"))
    out = tmp_path / "eplb.json"
    assert main(["export", str(ppath), "--format", "vllm", "-o", str(out)]) == 0
    np.testing.assert_array_equal(ex.parse_vllm_eplb_maps(out.read_text()), default_placement(tiny).phy2log)
    bad = default_placement(tiny).phy2log.copy()
    bad[1, 0] = 1
    write_placement(ppath, placement_document(tiny, Placement(default_rank2gpu(tiny), bad), solver="x"))
    assert main(["export", str(ppath), "--format", "vllm", "-o", str(out)]) == 2


# ---------------------------------------------------------------------------------------------
# Megatron-Core / TorchTitan permutations
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stack", ["megatron", "torchtitan"])
def test_permutation_round_trip(tiny, stack):
    rng = np.random.default_rng(3)
    p = Placement(default_rank2gpu(tiny), random_expert_map(rng, tiny, preserving=True))
    text = ex.export_text(stack, p, tiny)
    layers, doc = ex.parse_expert_permutation(text)
    assert sorted(layers) == list(tiny.model.moe_layers)  # keyed by transformer layer index
    np.testing.assert_array_equal(np.stack([layers[i] for i in tiny.model.moe_layers]), p.phy2log)
    assert doc["stack"] == stack and doc["group_limited"] and doc["group_preserving"]
    assert "W_new[p] = W_old[layers[l][p]]" in doc["direction"]
    assert doc["instance"] == {"name": tiny.name, "sha256": tiny.sha256}


def test_permutation_refuses_group_breaking_maps(tiny):
    rng = np.random.default_rng(4)
    while True:
        p2l = random_expert_map(rng, tiny, preserving=False)
        if ex.group_breaks(p2l, tiny.model.num_experts, tiny.model.num_groups):
            break
    with pytest.raises(InfeasibleError, match="keep groups whole"):
        ex.expert_permutation(tiny, Placement(default_rank2gpu(tiny), p2l), "megatron")


def test_permutation_allows_any_map_without_group_limited_routing():
    # two groups, but every token may use both: not group-limited, so any permutation is fine
    inst = random_instance(np.random.default_rng(5), num_experts=8, num_groups=2, groups_per_token=2)
    p2l = np.stack([np.array([7, 0, 1, 2, 3, 4, 5, 6])] * inst.model.num_moe_layers)
    doc = ex.expert_permutation(inst, Placement(np.arange(inst.parallel.world_size), p2l), "torchtitan")
    assert not doc["group_limited"] and not doc["group_preserving"]


def test_permutation_reader_rejects_non_permutations(tiny):
    doc = ex.expert_permutation(tiny, default_placement(tiny), "megatron")
    doc["layers"]["2"][0] = doc["layers"]["2"][1]
    with pytest.raises(InvalidInputError, match="layers.2: not a permutation"):
        ex.parse_expert_permutation(doc)
    with pytest.raises(InvalidInputError, match="expected kind"):
        ex.parse_expert_permutation({"kind": "something else"})


# ---------------------------------------------------------------------------------------------
# HybridEP
# ---------------------------------------------------------------------------------------------
def hybrid_instance():
    # 4 domains of 2 trays x 2 GPUs; world 8 = 2 stages x one EP group of 4.
    return random_instance(np.random.default_rng(6), ep=4, dp=4, pp=2, num_domains=4, trays_per_domain=2, gpus_per_tray=2)


def brute_force_rank2n(inst, rank2gpu) -> np.ndarray:
    """Per rank, the largest n dividing ep with every run of n consecutive EP ranks of its group in
    one domain (HybridEP's node = rank // n, deep_ep/hybrid_ep_buffer.py on DeepEP's hybrid-ep branch)."""
    par, cl = inst.parallel, inst.cluster
    out = np.zeros(par.world_size, dtype=int)
    for s in range(par.pp):
        for ranks in par.stage_ep_groups[s]:
            doms = [int(cl.gpu2domain[rank2gpu[r]]) for r in ranks]
            fits = [n for n in range(1, par.ep + 1) if par.ep % n == 0
                    and all(len(set(doms[k * n : (k + 1) * n])) == 1 for k in range(par.ep // n))]
            out[ranks] = max(fits)
    return out


def source_env(path, rank: int) -> dict[str, str]:
    """Source the file in a real POSIX shell as global rank ``rank``; the three variables."""
    names = ["NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN", "USE_MNNVL", "NVLINK_DOMAIN_SIZE"]
    script = f". '{path}' && " + " && ".join(f'echo "${n}"' for n in names)
    out = subprocess.run(["sh", "-c", script], env={"PATH": os.environ["PATH"], "SLURM_PROCID": str(rank)},
                         capture_output=True, text=True, timeout=60, check=True).stdout.split()
    return dict(zip(names, out))


def test_hybridep_env_for_whole_and_split_groups(tmp_path):
    inst = hybrid_instance()
    whole = Placement(np.arange(8), np.tile(np.arange(8), (3, 1)))  # each group inside one domain
    env = ex.hybridep_env(inst, whole)
    assert env == {"NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN": "4", "USE_MNNVL": "1", "NVLINK_DOMAIN_SIZE": "4"}
    split = Placement(np.array([0, 1, 4, 5, 8, 9, 12, 13]), whole.phy2log)  # 2 + 2 per group
    text = ex.hybridep_env_text(inst, split)
    assert ex.parse_env_text(text) == ex.hybridep_env(inst, split)
    assert ex.parse_env_text(text)["NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN"] == "2"
    path = tmp_path / "env.sh"
    path.write_text(text)
    assert source_env(path, 5) == ex.hybridep_env(inst, split)


def test_hybridep_per_rank_values_when_groups_differ(tmp_path):
    inst = hybrid_instance()
    mixed = Placement(np.array([0, 1, 2, 3, 4, 5, 8, 9]), np.tile(np.arange(8), (3, 1)))  # stage 0: n=4, stage 1: n=2
    with pytest.raises(InfeasibleError, match="different NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN values"):
        ex.hybridep_env(inst, mixed)
    text = ex.hybridep_env_text(inst, mixed)
    path = tmp_path / "env.sh"
    path.write_text(text)
    for rank in range(8):
        want = ex.hybridep_env(inst, mixed, rank=rank)
        assert want["NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN"] == ("4" if rank < 4 else "2")
        assert ex.parse_hybridep_env_text(text, rank) == want
        assert source_env(path, rank) == want  # what a real shell makes of the file


def test_hybridep_runs_interleaved_layouts_with_one_rank_nodes():
    inst = hybrid_instance()
    interleaved = Placement(np.array([0, 4, 1, 5, 8, 9, 10, 11]), np.tile(np.arange(8), (3, 1)))
    assert ex.hybridep_rank2n(inst, interleaved).tolist() == [1, 1, 1, 1, 4, 4, 4, 4]
    text = ex.hybridep_env_text(inst, interleaved)
    assert "1 EP group(s) run nodes smaller" in text
    assert ex.parse_hybridep_env_text(text, 0)["NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN"] == "1"


@settings(max_examples=60, deadline=None)
@given(st.randoms(use_true_random=False))
def test_hybridep_agrees_with_brute_force(r):
    inst = hybrid_instance()
    rng = np.random.default_rng(r.randrange(2**32))
    # Mostly structured layouts (n consecutive ranks per domain), some uniformly random ones.
    r2g = rng.permutation(16)[:8]
    if r.random() < 0.7:
        free = {d: [d * 4 + int(j) for j in rng.permutation(4)] for d in range(4)}
        chosen: list[int] = []
        for _stage in range(2):
            n = r.choice([1, 2, 4])
            doms = [d for d in rng.permutation(4).tolist() if len(free[d]) >= n][: 4 // n]
            if len(doms) < 4 // n:
                break
            for d in doms:
                chosen += [free[d].pop() for _ in range(n)]
        if len(chosen) == 8:
            r2g = np.array(chosen)
    p = Placement(r2g, np.tile(np.arange(8), (3, 1)))
    want = brute_force_rank2n(inst, r2g)
    got = ex.hybridep_rank2n(inst, p)
    assert got.tolist() == want.tolist()
    text = ex.hybridep_env_text(inst, p)
    assert [int(ex.parse_hybridep_env_text(text, k)["NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN"]) for k in range(8)] == got.tolist()


def test_env_reader():
    assert ex.parse_env_text("# c\n\nexport A=1\nB='x y'\n") == {"A": "1", "B": "x y"}
    with pytest.raises(InvalidInputError, match="line 1"):
        ex.parse_env_text("not an assignment")


# ---------------------------------------------------------------------------------------------
# Slurm (the host file itself is written by placement.consumers.hostfile)
# ---------------------------------------------------------------------------------------------
def test_slurm_launch_round_trip(tiny):
    rng = np.random.default_rng(7)
    for _ in range(10):
        r2g = rng.permutation(tiny.cluster.available_gpus)[: tiny.parallel.world_size]
        p = Placement(r2g, np.tile(np.arange(tiny.model.num_experts), (tiny.model.num_moe_layers, 1)))
        hostfile = ex.export_text("slurm", p, tiny)
        hosts = ex.parse_slurm_hostfile(hostfile)
        assert hosts == [tiny.cluster.host_name(tiny.cluster.gpu2host[g]) for g in r2g]
        # with the per-host CUDA_VISIBLE_DEVICES file, a launch puts every rank on its GPU
        np.testing.assert_array_equal(ex.parse_slurm_launch(hostfile, ex.slurm_gpus_text(tiny, p), tiny), r2g)


def test_slurm_export_writes_the_gpu_file_beside(tmp_path, capsys, tiny):
    r2g = default_placement(tiny).rank2gpu[::-1].copy()  # ranks in reverse: local ranks need a map
    p = Placement(r2g, default_placement(tiny).phy2log)
    ppath = tmp_path / "p.json"
    write_placement(ppath, placement_document(tiny, p, solver="x"))
    out = tmp_path / "job.hosts"
    assert main(["export", str(ppath), "--format", "slurm", "-o", str(out), "--instance", str(INSTANCES / "tiny.json")]) == 0
    assert "job.gpus" in capsys.readouterr().out
    gpus = tmp_path / "job.gpus"
    np.testing.assert_array_equal(ex.parse_slurm_launch(out.read_text(), gpus.read_text(), tiny), r2g)
    assert ex.slurm_gpus_path(tmp_path / "hosts") == tmp_path / "hosts.gpus"


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------
def test_cli_export_every_format_matches_the_api(tmp_path, capsys):
    inst = hybrid_instance()
    rng = np.random.default_rng(8)
    p = Placement(np.arange(8), random_expert_map(rng, inst, preserving=True))
    ipath, ppath, inst = write_pair(tmp_path, inst, p)
    for fmt in ex.FORMATS:
        if fmt in ("sglang", "vllm-ascend"):
            continue  # pp=2: refused (test_sglang_refuses_layouts_it_cannot_run)
        out = tmp_path / f"out.{fmt}"
        assert main(["export", str(ppath), "--format", fmt, "-o", str(out), "--instance", str(ipath)]) == 0, capsys.readouterr().err
        assert out.read_text() == ex.export_text(fmt, p, inst)
    assert not list(tmp_path.glob(".*.tmp"))  # atomic writes leave no temporaries


def test_cli_export_exit_codes(tmp_path, capsys):
    inst = hybrid_instance()
    p = Placement(np.array([0, 4, 1, 5, 8, 9, 10, 11]), np.tile(np.arange(8), (3, 1)))
    ipath, ppath, inst = write_pair(tmp_path, inst, p)
    out = tmp_path / "env.sh"
    # HybridEP runs the interleaved stage with nodes of one rank (per-rank values in the file)
    assert main(["export", str(ppath), "--format", "hybridep", "-o", str(out), "--instance", str(ipath)]) == 0
    assert ex.parse_hybridep_env_text(out.read_text(), 1)["NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN"] == "1"
    capsys.readouterr()

    # an instance that is not the one the placement was solved for
    assert main(["export", str(ppath), "--format", "sglang", "-o", str(tmp_path / "s.json"), "--instance", str(INSTANCES / "tiny.json")]) == 2
    assert "instance.sha256" in capsys.readouterr().err
    # formats that need the instance say so
    assert main(["export", str(ppath), "--format", "megatron", "-o", str(out)]) == 2
    assert "--instance" in capsys.readouterr().err
    assert main(["export", str(ppath), "--format", "nope", "-o", str(out)]) == 2
    capsys.readouterr()


def test_cli_export_refuses_an_invalid_placement(tmp_path, capsys):
    inst = hybrid_instance()
    p = Placement(np.array([0, 0, 1, 2, 3, 4, 5, 6]), np.tile(np.arange(8), (3, 1)))
    ipath, ppath, _ = write_pair(tmp_path, inst, p)
    assert main(["export", str(ppath), "--format", "sglang", "-o", str(tmp_path / "x.json"), "--instance", str(ipath)]) == 2
    assert "runs 2 ranks" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# vllm-ascend: expert_map_path
# ---------------------------------------------------------------------------------------------
def vllm_ascend_reader(doc: dict, rank_id: int, layer_id: int, num_experts: int):
    """What vllm-ascend's ExpertLoadBalancer computes from the file (vllm_ascend/ops/expert_load_balancer.py):
    the (layers, ranks, slots) tensor, then get_rank_placement_map: per logical expert its local slot
    on rank_id or -1, and the rank's local expert count."""
    tensor = np.array([[dev["device_expert"] for dev in layer["device_list"]] for layer in doc["layer_list"]])
    assert tensor.shape[0] == doc["moe_layer_count"] and tensor.shape[1] == doc["layer_list"][0]["device_count"]
    placement_map = np.full((tensor.shape[0], tensor.shape[1], num_experts), -1)
    for li in range(tensor.shape[0]):
        for r in range(tensor.shape[1]):
            placement_map[li, r, tensor[li, r]] = np.arange(tensor.shape[2])
    local = placement_map[layer_id, rank_id]
    return int((local != -1).sum()), local


def test_vllm_ascend_map_read_as_its_loader_reads_it(tmp_path):
    inst = sglang_instance()
    rng = np.random.default_rng(9)
    p = Placement(default_rank2gpu(inst), random_expert_map(rng, inst, preserving=False))
    text = ex.export_text("vllm-ascend", p, inst)
    doc = json.loads(text)
    k = inst.experts_per_rank
    for li in range(inst.model.num_moe_layers):
        for r in range(inst.parallel.ep):
            n, local = vllm_ascend_reader(doc, r, li, inst.model.num_experts)
            assert n == k
            for slot in range(k):  # EP rank r's local slot j holds the placement's physical slot r*k + j
                assert local[p.phy2log[li, r * k + slot]] == slot
    np.testing.assert_array_equal(ex.parse_vllm_ascend_expert_map(text), p.phy2log)
    with pytest.raises(InfeasibleError, match="vllm-ascend: pp=2"):
        ex.vllm_ascend_expert_map(*_tiny_pair())


def _tiny_pair():
    from placement.formats import read_instance as _read

    tiny = _read(INSTANCES / "tiny.json")
    return tiny, default_placement(tiny)


@pytest.mark.parametrize("stack", ["megatron", "torchtitan"])
def test_keep_router_exports_a_group_breaking_map_that_only_the_dispatch_time_route_applies(tiny, stack):
    from placement.core.permutation import check_permutation, read_expert_permutation

    rng = np.random.default_rng(9)
    while True:
        p2l = random_expert_map(rng, tiny, preserving=False)
        if ex.group_breaks(p2l, tiny.model.num_experts, tiny.model.num_groups):
            break
    doc = ex.expert_permutation(tiny, Placement(default_rank2gpu(tiny), p2l), stack, keep_router=True)
    assert doc["group_limited"] and not doc["group_preserving"]
    layers, _ = read_expert_permutation(doc)
    np.testing.assert_array_equal(np.stack([layers[i] for i in tiny.model.moe_layers]), p2l)
    # the checkpoint tool applies it only with keep_router (router left logical for placement.consumers.runtime)
    with pytest.raises(InfeasibleError, match="across groups"):
        check_permutation(0, layers[tiny.model.moe_layers[0]], tiny.model.num_groups)
    check_permutation(0, layers[tiny.model.moe_layers[0]], 1)  # what permute_entries(keep_router=True) checks
    with pytest.raises(InvalidInputError, match="--keep-router"):
        ex.export_text("sglang", Placement(default_rank2gpu(tiny), p2l), tiny, keep_router=True)
