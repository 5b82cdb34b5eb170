"""Which checkpoint entries hold experts, and along which axis: the naming rules of every stack.

One rule table per (stack, form): a regular expression over the entry's name, the kind of entry
(experts along an axis, one entry per expert, fused legacy weights, ...) and where its layer and
expert axes are.  MTP layers (Megatron-Core's ``mtp.layers.J.transformer_layer.mlp.*``, upstream's
in-memory ``mtp.layers.J.mtp_model_layer.mlp.*``, TorchTitan DeepSeek-V3's
``mtp_layers.J.moe.*``) carry ``mtp=True`` and their index ``J``: they are model layer
``num_layers + J`` (:func:`resolve_layer`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from placement.core.model import InvalidInputError
from placement.core.permutation import MAXTEXT_EXPERT_PATHS

__all__: list[str] = []  # internal to placement.consumers.checkpoint


@dataclass(frozen=True)
class _Hit:
    """How one entry holds experts.

    kind: ``axis`` (experts along ``axis``), ``named`` (one entry per expert, id in the name),
    ``grouped`` (Megatron's legacy fused GroupedMLP weights), ``extra`` (an ``_extra_state``
    shared by a grouped GEMM: passes only when empty), ``bucket`` (a distributed-optimizer bucket
    of flat state, permuted with a recorded layout), ``unknown`` (refused).
    ``layer`` is the layer in the key (None when layers are an axis, ``layer_axis``); with
    ``mtp`` it is the MTP layer's index ``J``, model layer ``num_layers + J``.
    """

    kind: str
    layer: int | None = None
    layer_axis: int | None = None
    axis: int = 0
    expert: int | None = None
    group: str = ""
    router: bool = False
    weight: bool = False
    optimizer: bool = False
    mtp: bool = False


_MEGATRON_SD = r"decoder\.layers\.(?P<layer>\d+)\.mlp\."
# MTP: megatron-core 0.16.1 names the inner layer transformer_layer; core_v0.19 / main name the
# module mtp_model_layer and map it back to transformer_layer in sharded_state_dict
_MEGATRON_MTP_SD = r"mtp\.layers\.(?P<mtp>\d+)\.(?:transformer_layer|mtp_model_layer)\.mlp\."
_MEGATRON_TD = r"decoder\.layers\.mlp\."
_MEGATRON_MTP_TD = r"mtp\.layers\.(?P<mtp>\d+)\.transformer_layer\.mlp\."
_TITAN = r"layers\.(?P<layer>\d+)\.moe\."
_TITAN_MTP = r"mtp_layers\.(?P<mtp>\d+)\.moe\."
_HF = r"model\.layers\.(?P<layer>\d+)\.mlp\."
_UNKNOWN_MSG = "an expert or router entry whose expert axis this permutation cannot identify"
BUCKET = re.compile(
    r"(?P<opt>(?:chained_\d+\.)?)optimizer\.distributed\.dp_group_idx_(?P<dp>\d+)\.gbuf_idx_(?P<gbuf>\d+)\."
    r"dtype_(?P<dtype>.+)\.bucket_idx_(?P<bucket>\d+)\.(?P<state>\w+)"
)


def _megatron_sd(prefix: str, swiglu: str = "") -> list[tuple[str, str | None, dict[str, Any]]]:
    return [
        (prefix + r"router\.(?P<rest>.+)", "axis", {"router": True}),
        (prefix + r"experts\.local_experts\.(?P<expert>\d+)\.(?P<rest>.+)", "named", {"weight": True}),
        (prefix + r"experts\.(?P<rest>linear_fc[12]\.(?:weight|bias))(?P<expert>\d+)" + swiglu, "named", {"weight": True}),
        (prefix + r"experts\.(?P<rest>weight[12])", "grouped", {"weight": True}),
        (prefix + r"experts\.linear_fc[12]\._extra_state", "extra", {}),
        (prefix + r"experts\..*", "unknown", {}),
    ]


def _megatron_td(prefix: str, stacked: bool) -> list[tuple[str, str | None, dict[str, Any]]]:
    # decoder layers are stacked along axis 0 (experts axis 1); an MTP layer is its own tensor
    axes: dict[str, Any] = {"layer_axis": 0, "axis": 1} if stacked else {"axis": 0}
    named: dict[str, Any] = {"layer_axis": 0} if stacked else {}
    return [
        (prefix + r"router\.(?P<rest>.+)", "axis", {"router": True, **axes}),
        (prefix + r"experts\.experts\.(?P<expert>\d+)\.(?P<rest>.+)", "named", {"weight": True, **named}),
        (prefix + r"experts\.experts\.(?P<rest>.+)", "axis", {"weight": True, **axes}),
        (prefix + r"experts\..*", "unknown", {}),
    ]


def _titan(prefix: str) -> list[tuple[str, str | None, dict[str, Any]]]:
    return [
        (prefix + r"router\.(?P<rest>.+)", "axis", {"router": True}),
        (prefix + r"(?P<rest>expert_bias(?:_E)?|tokens_per_expert(?:_E)?)", "axis", {}),
        (prefix + r"(?P<rest>experts\.w[123]|routed_experts\.inner_experts\.w[123]_E[A-Z]+)", "axis", {"weight": True}),
        (prefix + r"shared_experts?\..*", None, {}),
        (prefix + r".*", "unknown", {}),
    ]


# Megatron FSDP's fsdp_dtensor checkpoints (megatron/training/checkpointing.py, 0.16.1 to main):
# ``model.`` + the wrappers' ``module.`` prefixes + the parameter's name with its global expert id;
# SwiGLU's fc1 split into ``weight{e}_w`` / ``weight{e}_v`` (handle_swiglu_in_state_dict)
_FSDP_MODEL = r"(?:model\.)?(?:module\.)*"
_FSDP_SWIGLU = r"(?:_[wv])?"
_ANY_MOE: tuple[str, str | None, dict[str, Any]] = (r".*\.mlp\.(?:experts|router)\..*", "unknown", {})
# (regex, kind, options); first full match wins; kind None = passes through untouched.
_RULES: dict[tuple[str, str], list[tuple[str, str | None, dict[str, Any]]]] = {
    ("megatron", "state_dict"): [*_megatron_sd(_MEGATRON_SD), *_megatron_sd(_MEGATRON_MTP_SD), _ANY_MOE],
    ("megatron", "torch_dist"): [
        (BUCKET.pattern, "bucket", {"optimizer": True}),
        # the rest of a distributed optimizer's state (param groups, bucket sizes): no experts
        (r"(?:chained_\d+\.)?optimizer\.distributed\.dp_group_idx_\d+\.(?:optimizer|per_bucket_numel(?:_unpadded)?)",
         None, {}),
        # anything else there (dp_zero_gather_scatter's pickled param_state, an unknown layout)
        (r"(?:chained_\d+\.)?optimizer\.distributed\..*", "unknown", {}),
        *_megatron_td(_MEGATRON_TD, True),
        *_megatron_td(_MEGATRON_MTP_TD, False),
        _ANY_MOE,
    ],
    ("torchtitan", "state_dict"): [*_titan(_TITAN), *_titan(_TITAN_MTP)],
    ("hf", "state_dict"): [
        (_HF + r"gate\.(?P<rest>.+)", "axis", {"router": True}),
        (_HF + r"experts\.(?P<expert>\d+)\.(?P<rest>.+)", "named", {"weight": True}),
        (_HF + r"shared_experts\..*", None, {}),
        (_HF + r"experts\..*", "unknown", {}),
    ],
}
_RULES[("torchtitan", "torch_dist")] = _RULES[("torchtitan", "state_dict")]
_RULES[("megatron", "fsdp_dtensor")] = [
    *_megatron_sd(_FSDP_MODEL + _MEGATRON_SD, _FSDP_SWIGLU),
    *_megatron_sd(_FSDP_MODEL + _MEGATRON_MTP_SD, _FSDP_SWIGLU),
    _ANY_MOE,
]

# Optimizer state keyed by a parameter's name: (regex with group "key"), per stack and form.
_OPTIMIZER: dict[tuple[str, str], list[str]] = {
    ("megatron", "torch_dist"): [r"(?P<pre>(?:chained_\d+\.)?optimizer\.state\.\w+\.)(?P<key>.+)"],
    ("torchtitan", "state_dict"): [r"(?P<pre>(?:optimizer\.)?state\.)(?P<key>.+)\.(?P<suf>\w+)"],
    ("torchtitan", "torch_dist"): [r"(?P<pre>(?:optimizer\.)?state\.)(?P<key>.+)\.(?P<suf>\w+)"],
    # sharded_param_state_fsdp_dtensor: {"state": {param name: {exp_avg, exp_avg_sq, step}}}
    ("megatron", "fsdp_dtensor"): [r"(?P<pre>optimizer\.state\.)(?P<key>.+)\.(?P<suf>\w+)"],
}
# fsdp_dtensor's per-parameter group metadata, ``optimizer.param_to_group_meta.<param name>.<field>``
# (objects): an expert's entries follow the expert
_FSDP_GROUP_META = re.compile(r"optimizer\.param_to_group_meta\.(?P<rest>.+)")
_PASS_OPTIMIZER = re.compile(r"(?:(?:chained_\d+\.)?optimizer\.)?param_groups\..*")
_COMPILED: dict[tuple[str, str], list[tuple[re.Pattern, str | None, dict[str, Any]]]] = {
    k: [(re.compile(rx), kind, opts) for rx, kind, opts in v] for k, v in _RULES.items()
}
SHARD = re.compile(r"(?P<base>.+)/shard_(?P<off>\d+(?:\.\d+)*)_(?P<shape>\d+(?:\.\d+)*)")


def _classify_model_key(stack: str, form: str, key: str) -> _Hit | None:
    for rx, kind, opts in _COMPILED[(stack, form)]:
        m = rx.fullmatch(key)
        if not m:
            continue
        if kind is None:
            return None
        gd = m.groupdict()
        mtp = gd.get("mtp") is not None
        layer = int(gd["mtp"]) if mtp else int(gd["layer"]) if gd.get("layer") is not None else None
        expert = int(gd["expert"]) if gd.get("expert") is not None else None
        group = key if expert is None else key[: m.start("expert")] + "{expert}" + key[m.end("expert") :]
        return _Hit(kind=kind, layer=layer, expert=expert, group=group, mtp=mtp, **opts)
    return None


def classify(stack: str, form: str, key: str) -> _Hit | None:
    """The :class:`_Hit` of one entry name (model parameter, buffer or optimizer state), or None."""
    if form == "orbax":
        return _classify_orbax(key)
    if form == "fsdp_dtensor":
        g = _FSDP_GROUP_META.fullmatch(key)
        if g:
            return _classify_group_meta(stack, key, g.start("rest"))
    if _PASS_OPTIMIZER.fullmatch(key):
        return None
    for rx in _OPTIMIZER.get((stack, form), []):
        m = re.fullmatch(rx, key)
        if m:
            inner = _classify_model_key(stack, form, m.group("key"))
            if inner is None:
                return None
            group = inner.group
            if inner.expert is not None:
                group = key[: m.start("key")] + inner.group + key[m.end("key") :]
            return _Hit(**{**inner.__dict__, "optimizer": True, "group": group})
    return _classify_model_key(stack, form, key)


def _classify_group_meta(stack: str, key: str, start: int) -> _Hit | None:
    """``optimizer.param_to_group_meta.<param name>.<field>[.<index>]``: the field's name is not
    known in advance, so the parameter name is the longest prefix that names an expert; an entry
    under an expert module that names none is refused, any other passes."""
    unknown = None
    dots = [i for i, c in enumerate(key) if c == "." and i > start]
    for end in reversed(dots):
        inner = _classify_model_key(stack, "fsdp_dtensor", key[start:end])
        if inner is None:
            continue
        if inner.kind == "named":
            group = key[:start] + inner.group + key[end:]
            return _Hit(**{**inner.__dict__, "optimizer": True, "group": group})
        if inner.kind == "unknown":
            unknown = unknown or inner
        else:
            return None  # a router's group metadata: not per expert
    return _Hit(kind="unknown") if unknown is not None else None


def resolve_layer(hit: _Hit, layer_offset: int, num_layers: int | None, key: str) -> int:
    """Model layer index of an entry whose name carries its layer (decoder or MTP)."""
    if hit.mtp:
        if num_layers is None:
            raise InvalidInputError(f"{key}: an MTP layer, and the number of decoder layers is unknown: pass num_layers")
        return num_layers + int(hit.layer or 0)
    return int(hit.layer or 0) + layer_offset


def infer_num_layers(stack: str, form: str, keys: Any, layer_offset: int = 0) -> int | None:
    """Decoder layers of a full (or last-stage) state dict: the largest decoder layer index + 1."""
    rx = {
        "megatron": re.compile(r"decoder\.layers\.(\d+)\..*"),
        "torchtitan": re.compile(r"(?:.*\.)?layers\.(\d+)\..*"),
        "hf": re.compile(r"model\.layers\.(\d+)\..*"),
    }.get(stack)
    if form == "fsdp_dtensor" and stack == "megatron":
        rx = re.compile(_FSDP_MODEL + r"decoder\.layers\.(\d+)\..*")
    elif rx is None or form != "state_dict":
        return None
    top = -1
    for key in keys:
        m = rx.fullmatch(str(key))
        if m and not str(key).startswith(("mtp.", "mtp_layers.")):
            top = max(top, int(m.group(1)))
    return None if top < 0 else top + 1 + layer_offset


ORBAX_SCAN_AXIS: list[int | None] = [1]  # set per call by permute_orbax


def _classify_orbax(key: str) -> _Hit | None:
    scan = ORBAX_SCAN_AXIS[0]
    for leaf, axis in MAXTEXT_EXPERT_PATHS.items():
        if key == leaf or key.endswith("/" + leaf):
            if scan is None:
                return _Hit(kind="axis", layer=0, axis=axis, router=leaf.endswith("gate/kernel"), weight="/w" in leaf)
            return _Hit(
                kind="axis",
                layer_axis=scan,
                axis=axis if axis < scan else axis + 1,
                router=leaf.endswith("gate/kernel"),
                weight="/w" in leaf,
            )
    if "/MoeBlock_0/" in "/" + key:
        return _Hit(kind="unknown")
    return None


def has_stack(stack: str) -> bool:
    return (stack, "state_dict") in _COMPILED


UNKNOWN_MSG = _UNKNOWN_MSG
