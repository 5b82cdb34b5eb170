"""Checkpoint permutations: a permuted MoE layer computes the same function, in every stack's naming.

The torch tests build a tiny DeepSeek-style MoE layer (sigmoid scores, expert bias for selection
only, group-limited top-k, weights from the unbiased scores) and check that its outputs are the
same before and after its state dict is permuted by a permutation written by ``placement export``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from placement import checkpoint as ck
from placement.consumers import export as ex
from placement.core.model import InfeasibleError, InvalidInputError, Placement
from solvers.default import default_rank2gpu
from tests.test_export import group_preserving_perm

HIDDEN, FFN, TOKENS = 8, 6, 96


# ---------------------------------------------------------------------------------------------
# A tiny MoE layer and each stack's naming of its parameters
# ---------------------------------------------------------------------------------------------
def tiny_moe_forward(torch, params: dict, x, *, top_k: int, num_groups: int, groups_per_token: int, route_scale: float = 2.5):
    """DeepSeek-V3 routing: select with ``sigmoid(logits) + bias`` over the best groups, weigh unbiased.

    params: ``gate`` (E, D), ``bias`` (E,), ``w1``/``w3`` (E, H, D), ``w2`` (E, D, H).
    """
    gate, bias, w1, w2, w3 = (params[k] for k in ("gate", "bias", "w1", "w2", "w3"))
    num_experts = gate.shape[0]
    scores = torch.sigmoid(x @ gate.T)  # (T, E)
    select = scores + bias
    grouped = select.view(x.shape[0], num_groups, num_experts // num_groups)
    group_score = grouped.topk(2, dim=-1).values.sum(-1)  # (T, G): sum of each group's top-2
    best_groups = group_score.topk(groups_per_token, dim=-1).indices
    group_mask = torch.zeros_like(group_score, dtype=torch.bool).scatter(1, best_groups, True)
    expert_mask = group_mask.repeat_interleave(num_experts // num_groups, dim=1)
    chosen = select.masked_fill(~expert_mask, float("-inf")).topk(top_k, dim=-1).indices  # (T, k)
    weights = scores.gather(1, chosen)
    weights = weights / weights.sum(-1, keepdim=True) * route_scale
    out = torch.zeros_like(x)
    for e in range(num_experts):
        tok, slot = (chosen == e).nonzero(as_tuple=True)
        if tok.numel():
            h = torch.nn.functional.silu(x[tok] @ w1[e].T) * (x[tok] @ w3[e].T)
            out.index_add_(0, tok, weights[tok, slot, None] * (h @ w2[e].T))
    return out


def to_stack(torch, params: dict, layer: int, stack: str) -> dict:
    """The layer's parameters under ``stack``'s state-dict names (megatron-* are expert layouts)."""
    gate, bias, w1, w2, w3 = (params[k] for k in ("gate", "bias", "w1", "w2", "w3"))
    E = gate.shape[0]
    fc1 = [torch.cat([w1[e], w3[e]], dim=0) for e in range(E)]  # Megatron's gated fc1: (2H, D)
    if stack == "torchtitan":
        pre = f"layers.{layer}.moe."
        return {pre + "router.gate.weight": gate, pre + "expert_bias": bias, pre + "experts.w1": w1, pre + "experts.w2": w2, pre + "experts.w3": w3}
    if stack == "hf":
        pre = f"model.layers.{layer}.mlp."
        sd = {pre + "gate.weight": gate, pre + "gate.e_score_correction_bias": bias}
        for e in range(E):
            sd[pre + f"experts.{e}.gate_proj.weight"] = w1[e]
            sd[pre + f"experts.{e}.up_proj.weight"] = w3[e]
            sd[pre + f"experts.{e}.down_proj.weight"] = w2[e]
        return sd
    pre = f"decoder.layers.{layer}.mlp."
    sd = {pre + "router.weight": gate, pre + "router.expert_bias": bias}
    if stack == "megatron-sequential":
        for e in range(E):
            sd[pre + f"experts.local_experts.{e}.linear_fc1.weight"] = fc1[e]
            sd[pre + f"experts.local_experts.{e}.linear_fc2.weight"] = w2[e]
    elif stack == "megatron-te":
        for e in range(E):
            sd[pre + f"experts.linear_fc1.weight{e}"] = fc1[e]
            sd[pre + f"experts.linear_fc2.weight{e}"] = w2[e]
    else:  # megatron-grouped: GroupedMLP reads weight1.view(E, D, -1) and weight2.view(E, -1, D)
        sd[pre + "experts.weight1"] = torch.stack([f.T for f in fc1]).reshape(HIDDEN, -1)
        sd[pre + "experts.weight2"] = torch.stack([w.T for w in w2]).reshape(-1, HIDDEN)
    return sd


def from_stack(torch, sd: dict, layer: int, stack: str, num_experts: int) -> dict:
    """Inverse of :func:`to_stack`."""
    if stack == "torchtitan":
        pre = f"layers.{layer}.moe."
        return {"gate": sd[pre + "router.gate.weight"], "bias": sd[pre + "expert_bias"],
                "w1": sd[pre + "experts.w1"], "w2": sd[pre + "experts.w2"], "w3": sd[pre + "experts.w3"]}
    if stack == "hf":
        pre = f"model.layers.{layer}.mlp."
        return {"gate": sd[pre + "gate.weight"], "bias": sd[pre + "gate.e_score_correction_bias"],
                "w1": torch.stack([sd[pre + f"experts.{e}.gate_proj.weight"] for e in range(num_experts)]),
                "w3": torch.stack([sd[pre + f"experts.{e}.up_proj.weight"] for e in range(num_experts)]),
                "w2": torch.stack([sd[pre + f"experts.{e}.down_proj.weight"] for e in range(num_experts)])}
    pre = f"decoder.layers.{layer}.mlp."
    if stack == "megatron-sequential":
        fc1 = [sd[pre + f"experts.local_experts.{e}.linear_fc1.weight"] for e in range(num_experts)]
        fc2 = [sd[pre + f"experts.local_experts.{e}.linear_fc2.weight"] for e in range(num_experts)]
    elif stack == "megatron-te":
        fc1 = [sd[pre + f"experts.linear_fc1.weight{e}"] for e in range(num_experts)]
        fc2 = [sd[pre + f"experts.linear_fc2.weight{e}"] for e in range(num_experts)]
    else:
        fc1 = [m.T for m in sd[pre + "experts.weight1"].view(num_experts, HIDDEN, -1)]
        fc2 = [m.T for m in sd[pre + "experts.weight2"].view(num_experts, -1, HIDDEN)]
    return {"gate": sd[pre + "router.weight"], "bias": sd[pre + "router.expert_bias"],
            "w1": torch.stack([f[:FFN] for f in fc1]), "w3": torch.stack([f[FFN:] for f in fc1]), "w2": torch.stack(fc2)}


STACKS = ["megatron-sequential", "megatron-te", "megatron-grouped", "torchtitan", "hf"]


def random_params(torch, gen, num_experts: int) -> dict:
    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

    return {"gate": rnd(num_experts, HIDDEN), "bias": rnd(num_experts, scale=0.3),
            "w1": rnd(num_experts, FFN, HIDDEN), "w2": rnd(num_experts, HIDDEN, FFN), "w3": rnd(num_experts, FFN, HIDDEN)}


def state_dict_for(torch, layer_params: dict[int, dict], stack: str) -> dict:
    sd = {}
    for layer, params in layer_params.items():
        sd.update(to_stack(torch, params, layer, stack))
    # entries that are not per-expert must pass through untouched
    sd["embedding.weight"] = torch.ones(3, HIDDEN, dtype=torch.float64)
    return sd


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stack", STACKS)
def test_permuted_state_dict_computes_the_same_function(tiny, stack):
    torch = pytest.importorskip("torch")
    m = tiny.model
    gen = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    layer_params = {layer: random_params(torch, gen, m.num_experts) for layer in m.moe_layers}
    x = torch.randn(TOKENS, HIDDEN, generator=gen, dtype=torch.float64)
    route = dict(top_k=m.top_k, num_groups=m.num_groups, groups_per_token=m.groups_per_token)
    before = {layer: tiny_moe_forward(torch, p, x, **route) for layer, p in layer_params.items()}

    phy2log = np.stack([group_preserving_perm(rng, m.num_experts, m.num_groups) for _ in m.moe_layers])
    assert not (phy2log == np.arange(m.num_experts)).all(axis=1).any()  # every layer really moves
    fmt = "megatron" if stack.startswith("megatron") else "torchtitan"
    # applied by the checkpoint alone (apply: checkpoint): the router rows move with the experts
    doc = json.loads(ex.export_text(fmt, Placement(default_rank2gpu(tiny), phy2log), tiny, keep_router=False))

    sd = state_dict_for(torch, layer_params, stack)
    permuted = ck.apply_exported_permutation(sd, doc, stack="hf" if stack == "hf" else None)
    assert permuted.keys() == sd.keys()
    assert permuted["embedding.weight"] is sd["embedding.weight"]
    for li, layer in enumerate(m.moe_layers):
        new = from_stack(torch, permuted, layer, stack, m.num_experts)
        # the direction: new expert p holds old expert phy2log[p]
        torch.testing.assert_close(new["w2"], layer_params[layer]["w2"][phy2log[li].tolist()])
        torch.testing.assert_close(new["bias"], layer_params[layer]["bias"][phy2log[li].tolist()])
        after = tiny_moe_forward(torch, new, x, **route)
        torch.testing.assert_close(after, before[layer], rtol=1e-12, atol=1e-12)


def test_group_breaking_permutation_changes_the_model_and_is_refused(tiny):
    torch = pytest.importorskip("torch")
    m = tiny.model
    gen = torch.Generator().manual_seed(1)
    params = random_params(torch, gen, m.num_experts)
    x = torch.randn(TOKENS, HIDDEN, generator=gen, dtype=torch.float64)
    route = dict(top_k=m.top_k, num_groups=m.num_groups, groups_per_token=m.groups_per_token)
    sd = to_stack(torch, params, 1, "torchtitan")
    swap = list(range(m.num_experts))
    swap[0], swap[-1] = swap[-1], swap[0]  # experts 0 and 15 change groups
    with pytest.raises(InfeasibleError, match="across groups"):
        ck.apply_permutation(sd, {1: swap}, stack="torchtitan", num_groups=m.num_groups)
    # Forcing it through (as if routing were not group-limited) really changes the outputs:
    forced = from_stack(torch, ck.apply_permutation(sd, {1: swap}, stack="torchtitan"), 1, "torchtitan", m.num_experts)
    diff = (tiny_moe_forward(torch, forced, x, **route) - tiny_moe_forward(torch, params, x, **route)).abs().max()
    assert diff > 1e-3


def test_exported_document_that_breaks_groups_is_refused(tiny):
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(2)
    sd = to_stack(torch, random_params(torch, gen, tiny.model.num_experts), 2, "megatron-te")
    doc = ex.expert_permutation(tiny, Placement(default_rank2gpu(tiny), np.tile(np.arange(16), (3, 1))), "megatron")
    with pytest.raises(InvalidInputError, match="has no 'decoder.layers.1.mlp.router.weight'"):
        ck.apply_exported_permutation(sd, doc)  # strict: every layer of the document
    assert ck.apply_exported_permutation(sd, doc, only_present=True).keys() == sd.keys()
    doc["layers"]["2"] = [15, *range(1, 15), 0]  # experts 0 and 15 swap groups
    with pytest.raises(InfeasibleError, match="layer 2"):
        ck.apply_exported_permutation(sd, doc, only_present=True)
    with pytest.raises(InvalidInputError, match="none of the document's MoE layers"):
        ck.apply_exported_permutation(sd, doc, only_present=True, layer_offset=3)


# ---------------------------------------------------------------------------------------------
# Without torch: numpy state dicts, and the refusals
# ---------------------------------------------------------------------------------------------
def numpy_state_dict(num_experts: int, layer: int) -> dict:
    rng = np.random.default_rng(layer)
    sd = {
        f"decoder.layers.{layer}.mlp.router.weight": rng.normal(size=(num_experts, HIDDEN)),
        f"decoder.layers.{layer}.mlp.router.expert_bias": rng.normal(size=num_experts),
        f"decoder.layers.{layer}.mlp.experts.weight1": rng.normal(size=(HIDDEN, num_experts * 2 * FFN)),
        f"decoder.layers.{layer}.mlp.experts.weight2": rng.normal(size=(num_experts * FFN, HIDDEN)),
        f"decoder.layers.{layer}.self_attention.linear_qkv.weight": rng.normal(size=(3, HIDDEN)),
    }
    for e in range(num_experts):
        sd[f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.linear_fc2.weight"] = np.full((2, 2), e)
    return sd


def test_numpy_state_dict_and_layer_offset():
    E = 8
    perm = [4, 5, 6, 7, 0, 1, 2, 3]
    sd = numpy_state_dict(E, 0)  # a pipeline stage whose layer 0 is model layer 5
    out = ck.apply_permutation(sd, {5: perm}, stack="megatron", num_groups=2, layer_offset=5)
    pre = "decoder.layers.0.mlp."
    np.testing.assert_array_equal(out[pre + "router.weight"], sd[pre + "router.weight"][perm])
    np.testing.assert_array_equal(out[pre + "router.expert_bias"], sd[pre + "router.expert_bias"][perm])
    for p, old in enumerate(perm):
        assert (out[pre + f"experts.local_experts.{p}.linear_fc2.weight"] == old).all()
        np.testing.assert_array_equal(
            out[pre + "experts.weight1"].reshape(E, HIDDEN, -1)[p], sd[pre + "experts.weight1"].reshape(E, HIDDEN, -1)[old]
        )
        np.testing.assert_array_equal(
            out[pre + "experts.weight2"].reshape(E, -1, HIDDEN)[p], sd[pre + "experts.weight2"].reshape(E, -1, HIDDEN)[old]
        )
    assert out["decoder.layers.0.self_attention.linear_qkv.weight"] is sd["decoder.layers.0.self_attention.linear_qkv.weight"]


def test_refusals_name_the_problem():
    E = 8
    sd = numpy_state_dict(E, 3)
    with pytest.raises(InvalidInputError, match="not a permutation"):
        ck.apply_permutation(sd, {3: [0] * E}, stack="megatron")
    with pytest.raises(InvalidInputError, match="has no 'decoder.layers.4.mlp.router.weight'"):
        ck.apply_permutation(sd, {4: list(range(E))}, stack="megatron")
    with pytest.raises(InvalidInputError, match=r"router.weight: expected 4 experts along dim 0, found shape \(8, 8\)"):
        ck.apply_permutation(sd, {3: [0, 1, 2, 3]}, stack="megatron")
    shard = {k: v for k, v in sd.items() if "local_experts.7." not in k}  # one EP shard is missing
    with pytest.raises(InvalidInputError, match="merge the expert-parallel shards"):
        ck.apply_permutation(shard, {3: list(range(E))}, stack="megatron")
    with pytest.raises(InvalidInputError, match="stack"):
        ck.apply_permutation(sd, {3: list(range(E))}, stack="deepspeed")  # type: ignore[arg-type]
    packed = {**sd, "decoder.layers.3.mlp.experts.linear_fc1.weight": np.zeros((E, 4, 2))}  # an unknown layout
    with pytest.raises(InvalidInputError, match="linear_fc1.weight: an expert or router entry whose expert axis this permutation cannot identify"):
        ck.apply_permutation(packed, {3: list(range(E))}, stack="megatron")
    empty = {**sd, "decoder.layers.3.mlp.experts.linear_fc1._extra_state": None}  # TE without FP8: nothing per expert
    assert ck.apply_permutation(empty, {3: list(range(E))}, stack="megatron").keys() == empty.keys()
    fp8 = {**sd, "decoder.layers.3.mlp.experts.linear_fc1._extra_state": object()}  # TE's packed per-GEMM FP8 scales
    with pytest.raises(InvalidInputError, match="linear_fc1._extra_state: per-expert FP8 scaling state"):
        ck.apply_permutation(fp8, {3: list(range(E))}, stack="megatron")
    with pytest.raises(InvalidInputError, match="no expert weights"):
        ck.apply_permutation(
            {"layers.3.moe.router.gate.weight": np.zeros((E, 2))}, {3: list(range(E))}, stack="torchtitan"
        )
