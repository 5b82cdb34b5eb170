"""The in-memory engine: a flat mapping of entries (a state dict) with each MoE layer's experts renumbered.

Every format of :mod:`placement.consumers.checkpoint` ends here or in :mod:`placement.consumers.checkpoint.dcp`'s
streaming engine; both classify names with :mod:`placement.consumers.checkpoint._rules`.
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from placement.consumers.checkpoint._rules import UNKNOWN_MSG, classify, has_stack, infer_num_layers, resolve_layer, SHARD
from placement.core.model import InvalidInputError
from placement.core.permutation import PARAMETER_NAMES, check_permutation, read_expert_permutation

__all__ = ["Stack", "STACKS", "Form", "permute_entries", "apply_permutation", "apply_exported_permutation"]

Stack = Literal["megatron", "torchtitan", "hf"]
STACKS: tuple[Stack, ...] = ("megatron", "torchtitan", "hf")
Form = Literal["state_dict", "torch_dist", "orbax"]


def permute_entries(
    entries: Mapping[str, Any],
    layers: Mapping[int, Sequence[int] | np.ndarray],
    *,
    stack: str,
    form: Form = "state_dict",
    num_groups: int = 1,
    layer_offset: int = 0,
    require_all: bool = True,
    keep_router: bool = False,
    num_layers: int | None = None,
) -> dict[str, Any]:
    """A new mapping in which every per-expert entry of the listed layers is renumbered.

    Parameters
    ----------
    entries : mapping of entry name -> value
        Tensors (torch or numpy; 0-d entries of optimizer state pass), ``bytes``/``io.BytesIO``
        objects (Megatron ``torch_dist`` ``_extra_state`` shards, renamed with their expert) or
        anything else (passes through unless its name says it is per-expert).
    layers : mapping of model layer index -> (E,) ints
        ``phy2log`` per MoE layer: new expert ``p`` takes old expert ``layers[l][p]``.
    stack : "megatron", "torchtitan" or "hf"
    form : "state_dict", "torch_dist" or "orbax"
        How names encode layers: a layer number in the name (``state_dict``), or layers as an axis
        of the tensor (``torch_dist``: axis 0, the model's layer index; ``orbax``: the scan axis).
    num_groups : int
        Expert groups of group-limited routing; 1 when routing is not group-limited.
    layer_offset : int
        Model layer index of the names' layer 0 (``state_dict`` form, one pipeline stage's file).
    require_all : bool
        Every listed layer must have its router and expert weights among the entries.
    keep_router : bool
        Move only the experts (weights, biases, FP8 state and their optimizer state) and keep the
        router and its per-expert bias and counters in logical order: the layout that
        :mod:`placement.consumers.runtime`'s dispatch-time map expects.  Groups then need not stay whole.
    num_layers : int, optional
        Decoder layers of the model: MTP layer ``J`` (``mtp.layers.J.*``, ``mtp_layers.J.*``) is
        model layer ``num_layers + J``.  By default the largest decoder layer index in the names
        plus one (plus ``layer_offset``), which holds for a full state dict and for the last
        pipeline stage's (the one holding MTP).

    Returns
    -------
    dict
        Same keys; permuted entries are new, every other value is the same object.

    Raises
    ------
    InvalidInputError
        An entry under an expert/router name has no identifiable expert axis, a shape does not
        match the permutation, a layer's experts are incomplete, or a layer is missing.
    InfeasibleError
        ``num_groups > 1`` and a permutation moves an expert to another group.
    """
    if not has_stack(stack):
        raise InvalidInputError(f"stack: expected one of {', '.join(STACKS)}, found {stack!r}")
    groups = 1 if keep_router else num_groups
    perms = {int(layer): check_permutation(int(layer), perm, groups) for layer, perm in layers.items()}
    out = dict(entries)
    if num_layers is None:
        num_layers = infer_num_layers(stack, form, entries.keys(), layer_offset)
    routers: set[int] = set()
    weights: set[int] = set()
    named: dict[tuple[str, int | None, int | None], dict[int, str]] = {}
    for key, value in entries.items():
        base, shard = key, None
        if isinstance(value, (bytes, bytearray, io.BytesIO)):
            m = SHARD.fullmatch(key)
            if m:
                base = m.group("base")
                shard = ([int(x) for x in m.group("off").split(".")], [int(x) for x in m.group("shape").split(".")])
        hit = classify(stack, form, base)
        if hit is None:
            continue
        if keep_router and not hit.weight and hit.kind in ("axis",):
            continue  # the router, its bias and counters stay logical
        if hit.kind in ("unknown", "bucket"):
            raise InvalidInputError(f"{key}: {UNKNOWN_MSG}; refusing to permute the checkpoint without it")
        if hit.kind == "extra":
            if _is_empty(value):
                continue
            raise InvalidInputError(
                f"{key}: per-expert FP8 scaling state packed for a grouped GEMM; permute the torch_dist "
                "checkpoint instead, where Megatron-Core stores it per expert"
            )
        if shard is not None:  # a torch_dist ShardedObject: its offsets say layer (and expert)
            off, global_shape = shard
            shape_text = ".".join(map(str, global_shape))
            if hit.kind == "named" and len(off) >= 1:
                named.setdefault((hit.group + f"/shard_{{}}_{shape_text}", None, off[0]), {})[int(hit.expert or 0)] = key
            elif hit.kind == "axis" and hit.layer_axis is None and len(off) >= 1:
                layer = resolve_layer(hit, layer_offset, num_layers, key)
                template = f"{base}/shard_{{expert}}{''.join('.' + str(x) for x in off[1:])}_{shape_text}"
                named.setdefault((template, None, layer), {})[off[0]] = key
            elif hit.kind == "axis" and len(off) >= 2:
                template = f"{base}/shard_{off[0]}.{{expert}}{''.join('.' + str(x) for x in off[2:])}_{shape_text}"
                named.setdefault((template, None, off[0]), {})[off[1]] = key
            else:
                raise InvalidInputError(f"{key}: a per-expert object whose shard offsets {off} name no expert")
            continue
        if hit.kind in ("named",):
            in_name = None if hit.layer is None else resolve_layer(hit, layer_offset, num_layers, key)
            named.setdefault((hit.group, hit.layer_axis, in_name), {})[int(hit.expert or 0)] = key
            continue
        if _is_object(value):
            raise InvalidInputError(f"{key}: a per-expert entry that is not a tensor ({type(value).__name__})")
        shape = _shape(value)
        if hit.optimizer and len(shape) == 0:
            continue  # an optimizer step counter, shared by all experts
        if hit.kind == "grouped":
            layer = resolve_layer(hit, layer_offset, num_layers, key)
            if layer in perms:
                out[key] = _take_grouped(key, value, perms[layer], expert_major_rows=key.endswith("weight2"))
                weights.add(layer)
            continue
        # kind "axis"
        if hit.layer_axis is None:
            layer = resolve_layer(hit, layer_offset, num_layers, key)
            if layer not in perms:
                continue
            perm = perms[layer]
            axis = hit.axis if hit.axis >= 0 else len(shape) + hit.axis
            if len(shape) <= axis or shape[axis] != len(perm):
                raise InvalidInputError(f"{key}: expected {len(perm)} experts along dim {axis}, found shape {shape}")
            out[key] = _take(value, perm, axis)
            if not hit.optimizer:
                (routers if hit.router else weights if hit.weight else set()).add(layer)
        else:
            present = {l: p for l, p in perms.items() if len(shape) > hit.layer_axis and l < shape[hit.layer_axis]}
            for l, perm in present.items():
                if len(shape) <= hit.axis or shape[hit.axis] != len(perm):
                    raise InvalidInputError(f"{key}: expected {len(perm)} experts along dim {hit.axis}, found shape {shape}")
            if present:
                out[key] = _take_stacked(value, present, hit.layer_axis, hit.axis)
                if not hit.optimizer:
                    (routers if hit.router else weights if hit.weight else set()).update(present)
    for (template, layer_axis, in_name), keys in named.items():
        todo = perms if in_name is None else ({in_name: perms[in_name]} if in_name in perms else {})
        for l, perm in todo.items():
            if sorted(keys) != list(range(len(perm))):
                have = sorted(keys)
                raise InvalidInputError(
                    f"layer {l} ({template}): holds experts {have[:6]}{'...' if len(have) > 6 else ''} of {len(perm)}: "
                    "merge the expert-parallel shards before permuting"
                )
        if not todo:
            continue
        if layer_axis is None:
            perm = next(iter(todo.values()))
            for p, old in enumerate(perm):
                value = entries[keys[old]]
                # a copy: a model's state_dict() values are its live parameters, and
                # load_state_dict(out) copies into them one by one
                out[keys[p]] = _clone(value) if hasattr(value, "shape") else value
            weights.update(todo)
        else:
            new = {e: _clone(entries[k]) for e, k in keys.items()}
            for l, perm in todo.items():
                if _shape(entries[keys[0]])[layer_axis] <= l:
                    continue
                for p, old in enumerate(perm):
                    _select(new[p], layer_axis, l)[...] = _select(entries[keys[old]], layer_axis, l)
                weights.add(l)
            for e, k in keys.items():
                out[k] = new[e]
    if require_all:
        for layer in perms:
            if layer not in routers and not keep_router:
                expected = PARAMETER_NAMES.get(stack, {}).get("router_weight", "a router weight")
                if form == "state_dict":
                    expected = repr(expected.format(layer=layer - layer_offset))
                raise InvalidInputError(
                    f"layer {layer}: state dict has no {expected} (stack={stack}, form={form}, layer_offset={layer_offset})"
                )
            if layer not in weights:
                raise InvalidInputError(f"layer {layer}: no expert weights found under stack={stack} naming ({form})")
    return out


def apply_permutation(
    state_dict: Mapping[str, Any],
    layers: Mapping[int, Sequence[int] | np.ndarray],
    *,
    stack: Stack,
    num_groups: int = 1,
    layer_offset: int = 0,
    keep_router: bool = False,
    num_layers: int | None = None,
) -> dict[str, Any]:
    """A new in-memory state dict in which each listed MoE layer's experts are renumbered.

    Parameters
    ----------
    state_dict : mapping of parameter name -> tensor (torch or numpy)
        A full (expert-parallel merged) ``model.state_dict()`` in ``stack``'s naming.
    layers : mapping of model layer index -> (E,) ints
        ``phy2log`` per MoE layer: new expert ``p`` takes old expert ``layers[l][p]``.
    stack : "megatron", "torchtitan" or "hf"
    num_groups : int
        Expert groups of the model's group-limited routing (``moe_router_num_groups`` /
        ``num_expert_groups`` / ``n_group``); 1 when routing is not group-limited.
    layer_offset : int
        Model layer index of the state dict's layer 0 (a pipeline stage's first layer).
    keep_router : bool
        Move the experts only (see :func:`permute_entries`), for :mod:`placement.consumers.runtime`.
    num_layers : int, optional
        Decoder layers; MTP layer ``J`` is model layer ``num_layers + J`` (see :func:`permute_entries`).

    Returns
    -------
    dict
        Same keys; permuted tensors are new, every other value is the same object.

    Raises
    ------
    InvalidInputError
        A permutation is not one, a layer's router is missing, the state dict lacks experts, or
        an entry under an expert name cannot be permuted (its name is in the message).
    InfeasibleError
        ``num_groups > 1`` and a permutation moves an expert to another group.
    """
    if stack not in PARAMETER_NAMES:
        raise InvalidInputError(f"stack: expected one of {', '.join(STACKS)}, found {stack!r}")
    for layer in layers:
        if int(layer) < layer_offset:
            raise InvalidInputError(f"layer {layer}: below layer_offset={layer_offset}")
    return permute_entries(
        state_dict, layers, stack=stack, num_groups=num_groups, layer_offset=layer_offset, keep_router=keep_router,
        num_layers=num_layers,
    )


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
    ``num_groups`` when ``group_limited``); a document with ``apply: runtime`` (a keep-router
    export) moves the experts only (``keep_router=True``).  A JSON string or a path-like string is accepted.
    By default every MoE layer of the document must be in the state dict; ``only_present=True``
    (one pipeline stage's file) applies the layers whose router is present, and refuses when
    none is.
    """
    layers, meta = read_expert_permutation(doc if isinstance(doc, str) else dict(doc))
    chosen = stack or meta.get("stack")
    if chosen not in PARAMETER_NAMES:
        raise InvalidInputError(f"stack: expected one of {', '.join(STACKS)}, found {chosen!r}")
    groups = _doc_groups(meta)
    if only_present:
        router = PARAMETER_NAMES[chosen]["router_weight"]
        decoder = infer_num_layers(chosen, "state_dict", state_dict.keys(), layer_offset)
        mtp_routers = {k for k in state_dict if k.startswith(("mtp.layers.", "mtp_layers.")) and ".router." in k}

        def present(layer: int) -> bool:
            if router.format(layer=layer - layer_offset) in state_dict:
                return True
            j = None if decoder is None else layer - decoder  # an MTP layer: num_layers + j
            return j is not None and j >= 0 and any(k.startswith((f"mtp.layers.{j}.", f"mtp_layers.{j}.")) for k in mtp_routers)

        layers = {layer: perm for layer, perm in layers.items() if layer >= layer_offset and present(layer)}
        if not layers:
            raise InvalidInputError(
                f"the state dict holds none of the document's MoE layers (stack={chosen}, layer_offset={layer_offset})"
            )
    return apply_permutation(state_dict, layers, stack=chosen, num_groups=groups, layer_offset=layer_offset,
                             keep_router=meta.get("apply") == "runtime")


def _doc_groups(meta: Mapping[str, Any]) -> int:
    return int(meta.get("num_groups", 1)) if meta.get("group_limited") else 1


def _check_dirs(src: Path, dst: Path, *, marker: str) -> None:
    if not (src / marker).is_file():
        raise InvalidInputError(f"{src}: not a torch.distributed.checkpoint directory (no {marker})")
    if dst.exists():
        raise InvalidInputError(f"{dst}: exists; refusing to overwrite")


def _write_dir(dst: Path, fill: Callable[[Path], None]) -> None:
    """Fill a temporary directory beside ``dst``, then rename it to ``dst`` (never a partial ``dst``)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent))
    try:
        fill(tmp)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _is_empty(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, io.BytesIO):
        return len(value.getbuffer()) == 0
    if isinstance(value, (bytes, bytearray)):
        return len(value) == 0
    return hasattr(value, "shape") and int(np.prod(_shape(value))) == 0


def _is_object(value: Any) -> bool:
    return not hasattr(value, "shape")


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(int(x) for x in t.shape)


def _clone(t: Any) -> Any:
    return t.copy() if isinstance(t, np.ndarray) else t.clone()


def _select(t: Any, axis: int, index: int) -> Any:
    """A view of ``t`` at ``index`` along ``axis``."""
    if isinstance(t, np.ndarray):
        return t[(slice(None),) * axis + (index,)]
    return t.select(axis, index)


def _take(t: Any, perm: Sequence[int], axis: int = 0) -> Any:
    """Entries ``perm`` of ``t`` along ``axis`` (a new tensor / array)."""
    if isinstance(t, np.ndarray):
        return np.take(t, np.asarray(perm, dtype=np.int64), axis=axis)
    import torch  # optional extra: only needed for torch state dicts

    return t.index_select(axis, torch.as_tensor(list(perm), dtype=torch.long, device=t.device))


def _take_stacked(t: Any, perms: Mapping[int, Sequence[int]], layer_axis: int, axis: int) -> Any:
    """``t`` with, at each layer ``l`` along ``layer_axis``, entries ``perms[l]`` along ``axis``."""
    new = _clone(t)
    inner = axis - 1 if axis > layer_axis else axis
    for layer, perm in perms.items():
        view = _select(new, layer_axis, layer)
        view[...] = _take(_select(t, layer_axis, layer), perm, inner)
    return new


def _take_grouped(key: str, t: Any, perm: Sequence[int], *, expert_major_rows: bool) -> Any:
    """Legacy ``GroupedMLP`` fused weights: ``weight1`` (hidden, E * f) is expert-major along its
    columns (``view(E, hidden, -1)`` in Megatron's GroupedMLP.forward reads the flat buffer), and
    ``weight2`` (E * f, hidden) along its rows."""
    shape = _shape(t)
    num_experts = len(perm)
    split = shape[0] if expert_major_rows else shape[1]
    if len(shape) != 2 or split % num_experts:
        raise InvalidInputError(f"{key}: expected a 2-D tensor with a dimension divisible by {num_experts} experts, found {shape}")
    per_expert = t.reshape(num_experts, -1)
    return _take(per_expert, perm).reshape(shape)

