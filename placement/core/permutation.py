"""The expert-permutation document and the checks every consumer of it shares.

``placement export --format megatron|torchtitan`` writes, per MoE layer, ``phy2log``: new expert
slot ``p`` takes old expert ``layers[l][p]``.  The exporter (:mod:`placement.consumers.export`), the offline
checkpoint permutation (:mod:`placement.consumers.checkpoint`) and the dispatch-time map
(:mod:`placement.consumers.runtime`) all read it through this module, so none of them imports another.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from placement.core.checker import group_breaks
from placement.core.model import InfeasibleError, InvalidInputError

__all__ = [
    "PERMUTATION_KIND",
    "PERMUTATION_VERSION",
    "PERMUTATION_DIRECTION",
    "parse_expert_permutation",
    "read_expert_permutation",
    "check_permutation",
    "inverse_permutation",
    "PARAMETER_NAMES",
    "MAXTEXT_EXPERT_PATHS",
]

PERMUTATION_DIRECTION = (
    "new expert slot p takes old expert layers[l][p]: W_new[p] = W_old[layers[l][p]] for the expert "
    "weights, the router weight rows and the per-expert bias"
)
PERMUTATION_KIND = "placement.expert_permutation"
PERMUTATION_VERSION = 1

# Per stack, the entry names that follow their expert (written into the exported document; the
# rules that apply them are in placement.consumers.checkpoint).
PARAMETER_NAMES: dict[str, dict[str, Any]] = {
    "megatron": {
        "router_weight": "decoder.layers.{layer}.mlp.router.weight",
        "experts": [
            "decoder.layers.{layer}.mlp.experts.local_experts.{expert}.* (SequentialMLP)",
            "decoder.layers.{layer}.mlp.experts.linear_fc1.weight{expert}, linear_fc2.weight{expert} (TEGroupedMLP)",
            "decoder.layers.{layer}.mlp.experts.weight1 / weight2 (GroupedMLP, view(E, hidden, -1) / view(E, -1, hidden))",
            "torch_dist: decoder.layers.mlp.experts.experts.* [layers, experts, ...] and "
            "decoder.layers.mlp.experts.experts.{expert}.* (singleton_local_shards); "
            "_extra_state objects .../shard_{layer}.{expert}_{L}.{E}",
        ],
        "rows": [
            "decoder.layers.{layer}.mlp.router.* (weight, bias, expert_bias and any other router tensor: experts on dim 0)",
            "torch_dist: decoder.layers.mlp.router.* [layers, experts, ...]",
            "optimizer: optimizer.state.{exp_avg,exp_avg_sq,fp32_param,...}.<any of the above>",
        ],
    },
    "torchtitan": {
        "router_weight": "layers.{layer}.moe.router.gate.weight",
        "experts": [
            "layers.{layer}.moe.routed_experts.inner_experts.w1_EFD, w2_EDF, w3_EFD (experts on dim 0)",
            "layers.{layer}.moe.experts.w1, w2, w3 (older names)",
        ],
        "rows": [
            "layers.{layer}.moe.router.* (gate.weight, gate.bias)",
            "layers.{layer}.moe.expert_bias_E, tokens_per_expert_E (older: expert_bias, tokens_per_expert)",
            "optimizer: optimizer.state.<any of the above>.<exp_avg, exp_avg_sq, ...>",
        ],
    },
    "hf": {
        "router_weight": "model.layers.{layer}.mlp.gate.weight",
        "experts": ["model.layers.{layer}.mlp.experts.{expert}.* (gate_proj, up_proj, down_proj, their scales)"],
        "rows": ["model.layers.{layer}.mlp.gate.weight", "model.layers.{layer}.mlp.gate.e_score_correction_bias"],
    },
}

# MaxText (src/MaxText/layers/moe.py, RoutedMoE): leaf name -> expert axis in the unscanned tensor.
MAXTEXT_EXPERT_PATHS: dict[str, int] = {
    "MoeBlock_0/wi_0": 0,  # (E, emb, mlp)
    "MoeBlock_0/wi_1": 0,  # (E, emb, mlp)
    "MoeBlock_0/wo": 0,  # (E, mlp, emb)
    "MoeBlock_0/wi_0_bias": 0,  # (E, mlp)
    "MoeBlock_0/wi_1_bias": 0,  # (E, mlp)
    "MoeBlock_0/wo_bias": 0,  # (E, emb)
    "MoeBlock_0/gate/kernel": 1,  # (emb, E)
    "MoeBlock_0/gate/bias": 0,  # (E,)
}


def require_whole_groups(phy2log: Any, model: Any, rule: str) -> list[str]:
    """Refuse a group-breaking permutation when the model's routing is group-limited.

    ``phy2log``: (num_moe_layers, E) physical slot -> logical expert; ``model``: the
    :class:`placement.core.model.MoEModel`; ``rule``: the sentence start that says which reader needs
    whole groups (the message goes on ``", but N MoE layer(s) break them (first: ...); ..."``).

    Returns
    -------
    list of str
        The group breaks (:func:`placement.core.checker.group_breaks`); empty when every layer keeps
        its groups whole (always so under group-limited routing, else it raised).

    Raises
    ------
    InfeasibleError
        When ``model.group_limited`` and some layer moves an expert to another group.
    """
    breaks = group_breaks(np.asarray(phy2log, dtype=np.int64), model.num_experts, model.num_groups)
    if model.group_limited and breaks:
        raise InfeasibleError(
            f"{rule}, but {len(breaks)} MoE layer(s) break them (first: {breaks[0]}); solve with --apply checkpoint "
            "(expert maps that keep groups whole)"
        )
    return breaks


def group_fields(instance: Any, breaks: Sequence[str]) -> dict[str, Any]:
    """The expert-group and EP fields every permutation document carries, in their order.

    ``instance``: the :class:`placement.core.model.Instance`; ``breaks``: what
    :func:`require_whole_groups` returned.
    """
    m = instance.model
    return {
        "num_experts": m.num_experts,
        "num_groups": m.num_groups,
        "groups_per_token": m.groups_per_token,
        "group_limited": m.group_limited,
        "group_preserving": not breaks,
        "ep": instance.parallel.ep,
    }


def parse_expert_permutation(doc: Mapping[str, Any] | str) -> tuple[dict[int, np.ndarray], dict]:
    """``({layer index: (E,) phy2log}, document)`` from a permutation document (dict or JSON text).

    Raises
    ------
    InvalidInputError
        When the document is not a permutation file or a layer's row is not a permutation.
    """
    if isinstance(doc, str):
        try:
            doc = json.loads(doc)
        except json.JSONDecodeError as exc:
            raise InvalidInputError(
                f"expert permutation: malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
            ) from None
    if not isinstance(doc, Mapping):
        raise InvalidInputError(f"expert permutation: expected a JSON object, found {type(doc).__name__}")
    doc = dict(doc)
    if doc.get("kind") != PERMUTATION_KIND or doc.get("version") != PERMUTATION_VERSION:
        raise InvalidInputError(
            f"permutation: expected kind {PERMUTATION_KIND!r} version {PERMUTATION_VERSION}, "
            f"found {doc.get('kind')!r} version {doc.get('version')!r}"
        )
    raw = doc.get("layers")
    if not isinstance(raw, dict) or not raw:
        raise InvalidInputError("permutation: layers: expected an object of layer index -> permutation")
    num_experts = doc.get("num_experts")
    layers: dict[int, np.ndarray] = {}
    for key, row in raw.items():
        if not re.fullmatch(r"\d+", key):
            raise InvalidInputError(f"permutation: layers: key {key!r} is not a layer index")
        perm = np.asarray(row, dtype=np.int64)
        if perm.ndim != 1 or (num_experts is not None and perm.size != num_experts):
            raise InvalidInputError(f"permutation: layers.{key}: expected {num_experts} expert ids, found shape {perm.shape}")
        if sorted(perm.tolist()) != list(range(perm.size)):
            raise InvalidInputError(f"permutation: layers.{key}: not a permutation of 0..{perm.size - 1}")
        layers[int(key)] = perm
    return dict(sorted(layers.items())), doc


def read_expert_permutation(path_or_doc: Mapping[str, Any] | str) -> tuple[dict[int, np.ndarray], dict]:
    """:func:`parse_expert_permutation` of a document, JSON text, or the path of a JSON file."""
    if isinstance(path_or_doc, str) and not path_or_doc.lstrip().startswith("{"):
        try:
            with open(path_or_doc, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as exc:
            raise InvalidInputError(f"{path_or_doc}: cannot read the permutation: {exc.strerror}") from None
        try:
            return parse_expert_permutation(text)
        except InvalidInputError as exc:
            raise InvalidInputError(f"{path_or_doc}: {exc}") from None
    return parse_expert_permutation(path_or_doc)


def check_permutation(layer: int, perm: Sequence[int] | np.ndarray, num_groups: int = 1) -> list[int]:
    """``perm`` as a list of ints after checking it is a permutation that keeps groups whole.

    Raises
    ------
    InvalidInputError
        Not a permutation of ``0..E-1``, or ``num_groups`` does not divide ``E``.
    InfeasibleError
        ``num_groups > 1`` and the permutation moves an expert to another group's block of slots
        (group-limited routing scores a group over its block, so that would change the model).
    """
    out = [int(x) for x in perm]
    num_experts = len(out)
    if sorted(out) != list(range(num_experts)):
        raise InvalidInputError(f"layer {layer}: not a permutation of 0..{num_experts - 1}")
    if num_groups > 1:
        if num_experts % num_groups:
            raise InvalidInputError(f"num_groups: {num_groups} groups do not divide {num_experts} experts")
        breaks = group_breaks([out], num_experts, num_groups)
        if breaks:
            raise InfeasibleError(
                f"layer {layer}: the permutation moves experts across groups with group-limited routing "
                f"({num_groups} groups): {breaks[0].split(': ', 1)[1]}; refusing to change the model"
            )
    return out


def inverse_permutation(perm: Sequence[int] | np.ndarray) -> np.ndarray:
    """(E,) ``log2phy`` of a (E,) ``phy2log``: ``inv[perm[p]] = p``."""
    p = np.asarray(perm, dtype=np.int64)
    inv = np.empty_like(p)
    inv[p] = np.arange(p.size, dtype=np.int64)
    return inv
