"""Apply an expert permutation to a checkpoint's state dict (Megatron-Core, TorchTitan, HF DeepSeek).

Megatron-Core and TorchTitan place expert ``j`` on EP rank ``j // (E / ep)`` and read no expert
map, so a placement is applied by renumbering the experts of each MoE layer in the checkpoint,
offline: new expert ``p`` takes old expert ``perm[p]`` (the placement's ``phy2log`` row) for

- the expert weights (every tensor of expert ``perm[p]`` moves to expert ``p``),
- the router weight rows (``router[p] = router_old[perm[p]]``), and
- the per-expert bias and counters (``expert_bias`` / ``e_score_correction_bias``).

Moving all three together leaves the model's function unchanged: a token that picked old expert
``e`` now picks slot ``log2phy[e]``, which holds the same weights, with the same score.  With
group-limited routing that only holds when each group of ``E / G`` contiguous ids maps onto one
block of ``E / G`` contiguous slots (the group score is computed over the block), so such
permutations are refused.

Parameter names (``docs/formats.md`` lists the source files they were checked against):

- ``megatron``: ``decoder.layers.{i}.mlp.router.weight`` (E, hidden),
  ``decoder.layers.{i}.mlp.router.expert_bias`` (E,); experts as ``SequentialMLP``
  (``decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc1.weight`` ...), ``TEGroupedMLP``
  (``decoder.layers.{i}.mlp.experts.linear_fc1.weight{j}`` ...) or the legacy ``GroupedMLP``
  (``decoder.layers.{i}.mlp.experts.weight1`` (hidden, E * f1) and ``weight2`` (E * f2, hidden),
  read expert-major as ``view(E, hidden, -1)`` and ``view(E, -1, hidden)``).
- ``torchtitan``: ``layers.{i}.moe.router.gate.weight`` (E, dim), ``layers.{i}.moe.expert_bias``
  (E,), ``layers.{i}.moe.experts.w1|w2|w3`` stacked (E, ...).
- ``hf`` (DeepSeek-V3 Hugging Face checkpoints): ``model.layers.{i}.mlp.gate.weight``,
  ``model.layers.{i}.mlp.gate.e_score_correction_bias``, ``model.layers.{i}.mlp.experts.{j}.*``.

``{i}`` is the layer index as it appears in the state dict: the model's layer index for a whole
model, the index inside the pipeline stage for one stage's file (pass ``layer_offset``, the
stage's first layer).  The state dict must hold every expert of the layers it permutes (merge the
expert-parallel shards first).

Tensors can be ``torch.Tensor`` (imported lazily: torch is the optional extra ``.[torch]``) or
numpy arrays.  Entries that are not per-expert pass through untouched (same objects).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

from placement.checker import group_breaks
from placement.model import InfeasibleError, InvalidInputError

__all__ = ["Stack", "STACKS", "PARAMETER_NAMES", "apply_permutation", "apply_exported_permutation"]

Stack = Literal["megatron", "torchtitan", "hf"]
STACKS: tuple[Stack, ...] = ("megatron", "torchtitan", "hf")

# Per stack: what moves with the experts of layer {layer}.  "rows": tensors whose dim 0 is the
# expert; "indexed": regexes (with the layer filled in) whose group "expert" is an expert id;
# "stacked": regexes of tensors whose dim 0 is the expert; "grouped": legacy fused tensors.
PARAMETER_NAMES: dict[str, dict[str, Any]] = {
    "megatron": {
        "router_weight": "decoder.layers.{layer}.mlp.router.weight",
        "experts": [
            "decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_fc1.weight (SequentialMLP)",
            "decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_fc2.weight (SequentialMLP)",
            "decoder.layers.{layer}.mlp.experts.linear_fc1.weight{expert} (TEGroupedMLP)",
            "decoder.layers.{layer}.mlp.experts.linear_fc2.weight{expert} (TEGroupedMLP)",
            "decoder.layers.{layer}.mlp.experts.weight1 (GroupedMLP, view(E, hidden, -1))",
            "decoder.layers.{layer}.mlp.experts.weight2 (GroupedMLP, view(E, -1, hidden))",
        ],
        "rows": [
            "decoder.layers.{layer}.mlp.router.weight",
            "decoder.layers.{layer}.mlp.router.bias",
            "decoder.layers.{layer}.mlp.router.expert_bias",
            "decoder.layers.{layer}.mlp.router.local_tokens_per_expert",
        ],
        "indexed": [
            r"decoder\.layers\.{layer}\.mlp\.experts\.local_experts\.(?P<expert>\d+)\.(?P<rest>.+)",
            r"decoder\.layers\.{layer}\.mlp\.experts\.(?P<rest>linear_fc[12]\.(?:weight|bias))(?P<expert>\d+)",
        ],
        "stacked": [],
        "grouped": {
            "decoder.layers.{layer}.mlp.experts.weight1": "view(E, hidden, -1): expert-major columns",
            "decoder.layers.{layer}.mlp.experts.weight2": "view(E, -1, hidden): expert-major rows",
        },
        # every key under this prefix must be one of the above, or shared by all experts (TE's
        # per-GEMM-group FP8 metadata): anything else is refused rather than left unpermuted
        "expert_prefix": "decoder.layers.{layer}.mlp.experts.",
        "shared": [r"decoder\.layers\.{layer}\.mlp\.experts\.linear_fc[12]\._extra_state"],
    },
    "torchtitan": {
        "router_weight": "layers.{layer}.moe.router.gate.weight",
        "experts": ["layers.{layer}.moe.experts.w1", "layers.{layer}.moe.experts.w2", "layers.{layer}.moe.experts.w3"],
        "rows": [
            "layers.{layer}.moe.router.gate.weight",
            "layers.{layer}.moe.router.gate.bias",
            "layers.{layer}.moe.expert_bias",
            "layers.{layer}.moe.tokens_per_expert",
        ],
        "indexed": [],
        "stacked": [r"layers\.{layer}\.moe\.experts\.(?P<rest>w[123])"],
        "grouped": {},
        "expert_prefix": "layers.{layer}.moe.experts.",
        "shared": [],
    },
    "hf": {
        "router_weight": "model.layers.{layer}.mlp.gate.weight",
        "experts": ["model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight (and up_proj, down_proj, scales)"],
        "rows": [
            "model.layers.{layer}.mlp.gate.weight",
            "model.layers.{layer}.mlp.gate.e_score_correction_bias",
        ],
        "indexed": [r"model\.layers\.{layer}\.mlp\.experts\.(?P<expert>\d+)\.(?P<rest>.+)"],
        "stacked": [],
        "grouped": {},
        "expert_prefix": "model.layers.{layer}.mlp.experts.",
        "shared": [],
    },
}


def apply_permutation(
    state_dict: Mapping[str, Any],
    layers: Mapping[int, Sequence[int] | np.ndarray],
    *,
    stack: Stack,
    num_groups: int = 1,
    layer_offset: int = 0,
) -> dict[str, Any]:
    """A new state dict in which each listed MoE layer's experts are renumbered.

    Parameters
    ----------
    state_dict : mapping of parameter name -> tensor (torch or numpy)
        A full (expert-parallel merged) state dict in ``stack``'s naming.
    layers : mapping of model layer index -> (E,) ints
        ``phy2log`` per MoE layer: new expert ``p`` takes old expert ``layers[l][p]``.
    stack : "megatron", "torchtitan" or "hf"
    num_groups : int
        Expert groups of the model's group-limited routing (``moe_router_num_groups`` /
        ``num_expert_groups`` / ``n_group``); 1 when routing is not group-limited.
    layer_offset : int
        Model layer index of the state dict's layer 0 (a pipeline stage's first layer).

    Returns
    -------
    dict
        Same keys; permuted tensors are new, every other value is the same object.

    Raises
    ------
    InvalidInputError
        A permutation is not one, a layer's router is missing, or the state dict lacks experts.
    InfeasibleError
        ``num_groups > 1`` and a permutation moves an expert to another group.
    """
    if stack not in PARAMETER_NAMES:
        raise InvalidInputError(f"stack: expected one of {', '.join(STACKS)}, found {stack!r}")
    names = PARAMETER_NAMES[stack]
    out = dict(state_dict)
    for layer in sorted(layers):
        perm = [int(x) for x in layers[layer]]
        local = int(layer) - layer_offset
        if local < 0:
            raise InvalidInputError(f"layer {layer}: below layer_offset={layer_offset}")
        num_experts = len(perm)
        if sorted(perm) != list(range(num_experts)):
            raise InvalidInputError(f"layer {layer}: not a permutation of 0..{num_experts - 1}")
        if num_groups > 1:
            if num_experts % num_groups:
                raise InvalidInputError(f"num_groups: {num_groups} groups do not divide {num_experts} experts")
            breaks = group_breaks([perm], num_experts, num_groups)
            if breaks:
                raise InfeasibleError(
                    f"layer {layer}: the permutation moves experts across groups with group-limited routing "
                    f"({num_groups} groups): {breaks[0].split(': ', 1)[1]}; refusing to change the model"
                )
        router_key = names["router_weight"].format(layer=local)
        if router_key not in state_dict:
            raise InvalidInputError(
                f"layer {layer}: state dict has no {router_key!r} (stack={stack}, layer_offset={layer_offset})"
            )
        rows_of_router = _shape(state_dict[router_key])[0]
        if rows_of_router != num_experts:
            raise InvalidInputError(f"{router_key}: {rows_of_router} expert rows, but the permutation has {num_experts}")
        moved = _permute_layer(state_dict, out, names, local, perm)
        if not moved:
            raise InvalidInputError(f"layer {layer}: no expert weights found under stack={stack} naming")
    return out


def apply_exported_permutation(
    state_dict: Mapping[str, Any],
    doc: Mapping[str, Any] | str,
    *,
    stack: Stack | None = None,
    layer_offset: int = 0,
    only_present: bool = False,
) -> dict[str, Any]:
    """:func:`apply_permutation` with a document written by ``placement export --format megatron``.

    ``stack`` defaults to the document's; the group rule comes from the document (its
    ``num_groups`` when ``group_limited``).  A JSON string or a path-like string is accepted.
    By default every MoE layer of the document must be in the state dict; ``only_present=True``
    (one pipeline stage's file) applies the layers whose router is present, and refuses when
    none is.
    """
    from placement.export import parse_expert_permutation

    if isinstance(doc, str) and not doc.lstrip().startswith("{"):
        with open(doc, encoding="utf-8") as fh:
            doc = fh.read()
    layers, meta = parse_expert_permutation(doc if isinstance(doc, str) else dict(doc))
    chosen = stack or meta.get("stack")
    if chosen not in PARAMETER_NAMES:
        raise InvalidInputError(f"stack: expected one of {', '.join(STACKS)}, found {chosen!r}")
    groups = int(meta.get("num_groups", 1)) if meta.get("group_limited") else 1
    if only_present:
        router = PARAMETER_NAMES[chosen]["router_weight"]
        layers = {
            layer: perm
            for layer, perm in layers.items()
            if layer >= layer_offset and router.format(layer=layer - layer_offset) in state_dict
        }
        if not layers:
            raise InvalidInputError(
                f"the state dict holds none of the document's MoE layers (stack={chosen}, layer_offset={layer_offset})"
            )
    return apply_permutation(state_dict, layers, stack=chosen, num_groups=groups, layer_offset=layer_offset)


# ---------------------------------------------------------------------------------------------
def _permute_layer(src: Mapping[str, Any], out: dict[str, Any], names: dict, local: int, perm: list[int]) -> int:
    """Permute every per-expert entry of one layer from ``src`` into ``out``; how many expert weights moved."""
    num_experts = len(perm)
    moved = 0
    handled: set[str] = set()
    for template in names["rows"]:
        key = template.format(layer=local)
        if key in src:
            _expect_rows(key, src[key], num_experts)
            out[key] = _take(src[key], perm)
    for pattern in names["stacked"]:
        rx = re.compile(pattern.format(layer=local))
        for key in src:
            if rx.fullmatch(key):
                _expect_rows(key, src[key], num_experts)
                out[key] = _take(src[key], perm)
                moved += 1
                handled.add(key)
    for pattern in names["indexed"]:
        rx = re.compile(pattern.format(layer=local))
        by_rest: dict[str, dict[int, str]] = {}
        for key in src:
            m = rx.fullmatch(key)
            if m:
                by_rest.setdefault(m.group("rest"), {})[int(m.group("expert"))] = key
        for rest, keys in by_rest.items():
            if sorted(keys) != list(range(num_experts)):
                have = sorted(keys)
                raise InvalidInputError(
                    f"layer {local} ({rest}): the state dict holds experts {have[:6]}{'...' if len(have) > 6 else ''} "
                    f"of {num_experts}: merge the expert-parallel shards before permuting"
                )
            for p, old in enumerate(perm):
                out[keys[p]] = src[keys[old]]
            moved += len(keys)
            handled.update(keys.values())
    for template in names["grouped"]:
        key = template.format(layer=local)
        if key in src:
            out[key] = _take_grouped(key, src[key], perm, expert_major_rows=key.endswith("weight2"))
            moved += 1
            handled.add(key)
    prefix = names["expert_prefix"].format(layer=local)
    shared = [re.compile(x.format(layer=local)) for x in names["shared"]]
    for key in src:
        if key.startswith(prefix) and key not in handled and not any(rx.fullmatch(key) for rx in shared):
            raise InvalidInputError(
                f"{key}: an expert parameter this stack's naming does not know how to permute; "
                "refusing to permute the layer's router without it"
            )
    return moved


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(int(x) for x in t.shape)


def _expect_rows(key: str, t: Any, num_experts: int) -> None:
    shape = _shape(t)
    if not shape or shape[0] != num_experts:
        raise InvalidInputError(f"{key}: expected {num_experts} experts along dim 0, found shape {shape}")


def _take(t: Any, perm: list[int]) -> Any:
    """Rows ``perm`` of ``t`` along dim 0 (a new tensor / array)."""
    if isinstance(t, np.ndarray):
        return t[np.asarray(perm, dtype=np.int64)]
    import torch  # optional extra: only needed for torch state dicts

    return t.index_select(0, torch.as_tensor(perm, dtype=torch.long, device=t.device))


def _take_grouped(key: str, t: Any, perm: list[int], *, expert_major_rows: bool) -> Any:
    """Legacy ``GroupedMLP`` fused weights, stored expert-major whatever their 2-D shape."""
    shape = _shape(t)
    num_experts = len(perm)
    split = shape[0] if expert_major_rows else shape[1]
    if len(shape) != 2 or split % num_experts:
        raise InvalidInputError(f"{key}: expected a 2-D tensor with a dimension divisible by {num_experts} experts, found {shape}")
    # view(E, hidden, -1) / view(E, -1, hidden) as Megatron's GroupedMLP.forward reads it
    per_expert = t.reshape(num_experts, -1)
    return _take(per_expert, perm).reshape(shape)
