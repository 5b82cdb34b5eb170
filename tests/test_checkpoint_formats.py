"""Checkpoint permutation of the silent cases and of Megatron-Core's torch_dist layout.

Each ``test_silent_*`` fails on the state-dict-only permutation this module replaced (it left the
entry unpermuted without a word); they check that the entry now follows its expert or stops the
run with its name.  The torch_dist entries are named and shaped as megatron-core 0.16.1 writes
them (``megatron/core/transformer/moe/experts.py`` ``SequentialMLP.sharded_state_dict``: expert
axis after the layer axis; ``dist_checkpointing/mapping.py`` ``ShardedObject.unique_key``:
``{key}/shard_{offsets}_{shape}``; ``dist_checkpointing/optimizer.py``:
``optimizer.state.{name}.{param key}``; ``optimizer/optimizer.py``: ``optimizer.state.fp32_param``).
"""

from __future__ import annotations

import io

import numpy as np
import pytest

from placement import checkpoint as ck
from placement.core.model import InvalidInputError
from placement.core.permutation import PERMUTATION_KIND, PERMUTATION_VERSION

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]

E = 8
PERM = [3, 1, 0, 2, 7, 5, 4, 6]


def megatron_sd(layer: int = 1) -> dict:
    rng = np.random.default_rng(0)
    pre = f"decoder.layers.{layer}.mlp."
    sd = {pre + "router.weight": rng.normal(size=(E, 4)), pre + "router.expert_bias": rng.normal(size=E)}
    for e in range(E):
        sd[pre + f"experts.local_experts.{e}.linear_fc1.weight"] = rng.normal(size=(6, 4))
        sd[pre + f"experts.local_experts.{e}.linear_fc2.weight"] = rng.normal(size=(4, 3))
    return sd


def test_silent_router_buffer_follows_its_expert():
    sd = megatron_sd()
    sd["decoder.layers.1.mlp.router.qb_beta"] = np.arange(E, dtype=float)  # a per-expert router buffer
    out = ck.apply_permutation(sd, {1: PERM}, stack="megatron")
    assert out["decoder.layers.1.mlp.router.qb_beta"].tolist() == [float(p) for p in PERM]
    sd["decoder.layers.1.mlp.router.odd"] = np.zeros((3, 2))  # a router tensor without an expert axis
    with pytest.raises(InvalidInputError, match="router.odd: expected 8 experts along dim 0"):
        ck.apply_permutation(sd, {1: PERM}, stack="megatron")


def test_silent_grouped_fp8_extra_state_is_refused_by_name():
    sd = {**megatron_sd(), "decoder.layers.1.mlp.experts.linear_fc1._extra_state": io.BytesIO(b"fp8 scales")}
    with pytest.raises(InvalidInputError, match=r"decoder\.layers\.1\.mlp\.experts\.linear_fc1\._extra_state"):
        ck.apply_permutation(sd, {1: PERM}, stack="megatron")


def test_silent_per_expert_extra_state_moves_with_its_expert():
    sd = megatron_sd()
    for e in range(E):
        sd[f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc1._extra_state"] = io.BytesIO(bytes([e]))
    out = ck.apply_permutation(sd, {1: PERM}, stack="megatron")
    got = [out[f"decoder.layers.1.mlp.experts.local_experts.{p}.linear_fc1._extra_state"].getvalue()[0] for p in range(E)]
    assert got == PERM


def test_silent_optimizer_moments_follow_their_experts_older_torchtitan_names():
    rng = np.random.default_rng(1)
    sd = {"layers.2.moe.router.gate.weight": rng.normal(size=(E, 4)), "layers.2.moe.expert_bias": rng.normal(size=E)}
    for w in ("w1", "w2", "w3"):
        sd[f"layers.2.moe.experts.{w}"] = rng.normal(size=(E, 4, 3))
        sd[f"optimizer.state.layers.2.moe.experts.{w}.exp_avg"] = rng.normal(size=(E, 4, 3))
        sd[f"optimizer.state.layers.2.moe.experts.{w}.step"] = np.asarray(3.0)
    sd["optimizer.param_groups.layers.2.moe.experts.w1.lr"] = 0.1
    out = ck.apply_permutation(sd, {2: PERM}, stack="torchtitan")
    for w in ("w1", "w2", "w3"):
        key = f"optimizer.state.layers.2.moe.experts.{w}.exp_avg"
        assert np.array_equal(out[key], sd[key][PERM])
        assert out[f"optimizer.state.layers.2.moe.experts.{w}.step"] is sd[f"optimizer.state.layers.2.moe.experts.{w}.step"]
    sd["optimizer.state.layers.2.moe.experts.w1.exp_avg"] = rng.normal(size=(E * 12,))  # a flattened shard
    with pytest.raises(InvalidInputError, match=r"experts\.w1\.exp_avg: expected 8 experts along dim 0"):
        ck.apply_permutation(sd, {2: PERM}, stack="torchtitan")


def test_keep_router_moves_experts_only_and_ignores_groups():
    sd = megatron_sd()
    breaking = [4, 1, 0, 2, 7, 5, 3, 6]  # moves experts across 2 groups of 4
    out = ck.apply_permutation(sd, {1: breaking}, stack="megatron", num_groups=2, keep_router=True)
    assert out["decoder.layers.1.mlp.router.weight"] is sd["decoder.layers.1.mlp.router.weight"]
    assert np.array_equal(
        out["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"],
        sd["decoder.layers.1.mlp.experts.local_experts.4.linear_fc1.weight"],
    )


def test_permuted_state_dict_loads_into_the_live_model():
    """``model.load_state_dict(apply_permutation(model.state_dict(), ...))``: the values are copies."""
    torch = pytest.importorskip("torch")

    class Expert(torch.nn.Module):
        def __init__(self, e):
            super().__init__()
            self.linear_fc1 = torch.nn.Linear(2, 2, bias=False)
            torch.nn.init.constant_(self.linear_fc1.weight, float(e))

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.router = torch.nn.Linear(2, E, bias=False)
            self.experts = torch.nn.Module()
            self.experts.local_experts = torch.nn.ModuleList(Expert(e) for e in range(E))

    model = torch.nn.Module()
    model.decoder = torch.nn.Module()
    model.decoder.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.decoder.layers[0].mlp = Layer()
    model.load_state_dict(ck.apply_permutation(model.state_dict(), {0: PERM}, stack="megatron"))
    got = [int(m.linear_fc1.weight[0, 0]) for m in model.decoder.layers[0].mlp.experts.local_experts]
    assert got == PERM


# ---------------------------------------------------------------------------------------------
# torch_dist directory, written as Megatron-Core writes it
# ---------------------------------------------------------------------------------------------
def torch_dist_entries(torch, num_layers=4):
    gen = torch.Generator().manual_seed(3)
    fc1 = torch.randn(num_layers, E, 6, 4, generator=gen)
    out = {
        "decoder.layers.mlp.router.weight": torch.randn(num_layers, E, 4, generator=gen),
        "decoder.layers.mlp.router.expert_bias": torch.randn(num_layers, E, generator=gen),
        "decoder.layers.mlp.experts.experts.linear_fc1.weight": fc1,
        "decoder.layers.mlp.experts.experts.linear_fc2.weight": torch.randn(num_layers, E, 4, 3, generator=gen),
        "optimizer.state.exp_avg.decoder.layers.mlp.experts.experts.linear_fc1.weight": fc1 * 2,
        "optimizer.state.fp32_param.decoder.layers.mlp.router.expert_bias": torch.randn(num_layers, E, generator=gen),
        "decoder.layers.self_attention.linear_qkv.weight": torch.randn(num_layers, 12, 4, generator=gen),
    }
    for layer in range(num_layers):
        for e in range(E):
            buf = io.BytesIO()
            torch.save([f"fp8 scales of layer {layer} expert {e}"], buf)  # as Megatron's torch_dist strategy
            out[f"decoder.layers.mlp.experts.experts.linear_fc1._extra_state/shard_{layer}.{e}_{num_layers}.{E}"] = buf
    return out


def save_like_megatron(torch, entries, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class Raw(DefaultSavePlanner):  # MCoreSavePlanner.transform_object: bytes are already serialised
        def transform_object(self, write_item, object):  # noqa: A002
            return object

    dcp.save(entries, storage_writer=dcp.FileSystemWriter(str(path)), planner=Raw(), no_dist=True)
    (path / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')


def test_torch_dist_directory_every_per_expert_entry_follows(tmp_path):
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    entries = torch_dist_entries(torch)
    save_like_megatron(torch, entries, tmp_path / "src")
    doc = {"kind": PERMUTATION_KIND, "version": PERMUTATION_VERSION, "stack": "megatron", "num_experts": E,
           "layers": {"1": PERM, "3": PERM[::-1]}}
    ck.permute_dcp(tmp_path / "src", tmp_path / "dst", doc)
    assert (tmp_path / "dst" / "metadata.json").read_text() == '{"sharded_backend": "torch_dist"}'
    back = {k: torch.zeros_like(v) if hasattr(v, "shape") else io.BytesIO() for k, v in entries.items()}
    back = {k: v for k, v in back.items() if hasattr(v, "shape")}
    dcp.load(back, checkpoint_id=str(tmp_path / "dst"), no_dist=True)
    objs = {k: None for k in entries if "/shard_" in k}
    dcp.load(objs, checkpoint_id=str(tmp_path / "dst"), no_dist=True)  # the default planner unpickles
    for key, t in back.items():
        if key.startswith("decoder.layers.self_attention"):
            assert torch.equal(t, entries[key])
            continue
        axis_perm = {1: PERM, 3: PERM[::-1]}
        for layer in range(4):
            want = entries[key][layer][axis_perm[layer]] if layer in axis_perm else entries[key][layer]
            assert torch.equal(t[layer], want), (key, layer)
    assert objs["decoder.layers.mlp.experts.experts.linear_fc1._extra_state/shard_1.0_4.8"] == [f"fp8 scales of layer 1 expert {PERM[0]}"]
    assert objs["decoder.layers.mlp.experts.experts.linear_fc1._extra_state/shard_0.0_4.8"] == ["fp8 scales of layer 0 expert 0"]


def test_torch_dist_unknown_expert_entry_stops_and_writes_nothing(tmp_path):
    torch = pytest.importorskip("torch")
    entries = torch_dist_entries(torch)
    entries["optimizer.distributed.dp_group_idx_0.gbuf_idx_0.param"] = torch.zeros(10)  # bucket layout
    save_like_megatron(torch, entries, tmp_path / "src")
    doc = {"kind": PERMUTATION_KIND, "version": PERMUTATION_VERSION, "stack": "megatron", "num_experts": E, "layers": {"1": PERM}}
    with pytest.raises(InvalidInputError, match=r"optimizer\.distributed\.dp_group_idx_0\.gbuf_idx_0\.param"):
        ck.permute_dcp(tmp_path / "src", tmp_path / "dst", doc)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    assert ck.main(["megatron-torch-dist", "/nonexistent.json", str(tmp_path / "src"), str(tmp_path / "dst")]) == 2


# ---------------------------------------------------------------------------------------------
# Megatron legacy per-rank files (megatron/training/checkpointing.py get_checkpoint_name:
# iter_NNNNNNN/mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt, the file's "model" entry)
# ---------------------------------------------------------------------------------------------
def legacy_rank_files(torch, tmp_path, ep=2, grouped=False):
    full = {k: torch.as_tensor(v) for k, v in megatron_sd(layer=0).items()}
    full["decoder.layers.0.self_attention.linear_qkv.weight"] = torch.ones(3, 4)
    root = tmp_path / "iter_0000005"
    per = E // ep
    for r in range(ep):
        sd = {k: v for k, v in full.items() if "local_experts" not in k}
        for j in range(per):
            for fc in ("linear_fc1", "linear_fc2"):
                sd[f"decoder.layers.0.mlp.experts.local_experts.{j}.{fc}.weight"] = full[
                    f"decoder.layers.0.mlp.experts.local_experts.{r * per + j}.{fc}.weight"
                ]
        (root / f"mp_rank_00_{r:03d}").mkdir(parents=True)
        torch.save({"model": sd, "iteration": 5, "checkpoint_version": 3.0}, root / f"mp_rank_00_{r:03d}" / "model_optim_rng.pt")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5")
    return full, root


def test_legacy_per_rank_files_merged_permuted_split(tmp_path):
    torch = pytest.importorskip("torch")
    full, root = legacy_rank_files(torch, tmp_path)
    doc = {"kind": PERMUTATION_KIND, "version": PERMUTATION_VERSION, "stack": "megatron", "num_experts": E, "layers": {"0": PERM}}
    with pytest.raises(InvalidInputError, match="second_index"):
        ck.permute_megatron_legacy(root, tmp_path / "out", doc)
    ck.permute_megatron_legacy(root, tmp_path / "out", doc, second_index="ep")
    want = ck.apply_permutation(full, {0: PERM}, stack="megatron")
    for r in range(2):
        got = torch.load(tmp_path / "out" / f"mp_rank_00_{r:03d}" / "model_optim_rng.pt", weights_only=False)
        assert got["iteration"] == 5
        sd = got["model"]
        assert torch.equal(sd["decoder.layers.0.mlp.router.weight"], want["decoder.layers.0.mlp.router.weight"])
        assert torch.equal(sd["decoder.layers.0.self_attention.linear_qkv.weight"], torch.ones(3, 4))
        for j in range(E // 2):
            key = f"decoder.layers.0.mlp.experts.local_experts.{j}.linear_fc1.weight"
            assert torch.equal(sd[key], want[f"decoder.layers.0.mlp.experts.local_experts.{r * 4 + j}.linear_fc1.weight"])


def test_legacy_grouped_gemm_weights_across_ep_ranks(tmp_path):
    """GroupedMLP: weight1 (hidden, El*f) read as view(El, hidden, -1) of the rank's flat buffer."""
    torch = pytest.importorskip("torch")
    hidden, f, ep = 4, 3, 2
    per = E // ep
    w1 = torch.randn(E, hidden, f)  # expert e's fc1 as GroupedMLP.forward sees it
    w2 = torch.randn(E, f, hidden)
    root = tmp_path / "iter_0000001"
    for r in range(ep):
        sd = {
            "decoder.layers.0.mlp.router.weight": torch.arange(E * 2, dtype=torch.float32).reshape(E, 2),
            "decoder.layers.0.mlp.experts.weight1": w1[r * per : (r + 1) * per].reshape(hidden, -1),
            "decoder.layers.0.mlp.experts.weight2": w2[r * per : (r + 1) * per].reshape(-1, hidden),
        }
        (root / f"mp_rank_00_{r:03d}").mkdir(parents=True)
        torch.save({"model": sd}, root / f"mp_rank_00_{r:03d}" / "model_optim_rng.pt")
    doc = {"kind": PERMUTATION_KIND, "version": PERMUTATION_VERSION, "num_experts": E, "layers": {"0": PERM}}
    ck.permute_megatron_legacy(root, tmp_path / "out", doc, second_index="ep")
    for r in range(ep):
        sd = torch.load(tmp_path / "out" / f"mp_rank_00_{r:03d}" / "model_optim_rng.pt", weights_only=False)["model"]
        got1 = sd["decoder.layers.0.mlp.experts.weight1"].view(per, hidden, -1)
        got2 = sd["decoder.layers.0.mlp.experts.weight2"].view(per, -1, hidden)
        for j in range(per):
            assert torch.equal(got1[j], w1[PERM[r * per + j]]) and torch.equal(got2[j], w2[PERM[r * per + j]])


def test_legacy_optimizer_state_keyed_by_index_is_refused(tmp_path):
    torch = pytest.importorskip("torch")
    _, root = legacy_rank_files(torch, tmp_path)
    path = root / "mp_rank_00_001" / "model_optim_rng.pt"
    obj = torch.load(path, weights_only=False)
    obj["optimizer"] = {"optimizer": {"state": {0: {"exp_avg": torch.zeros(2)}}, "param_groups": []}}
    torch.save(obj, path)
    doc = {"kind": PERMUTATION_KIND, "version": PERMUTATION_VERSION, "num_experts": E, "layers": {"0": PERM}}
    with pytest.raises(InvalidInputError, match=r"mp_rank_00_001/model_optim_rng.pt: optimizer"):
        ck.permute_megatron_legacy(root, tmp_path / "out", doc, second_index="ep")
    assert not (tmp_path / "out").exists()
