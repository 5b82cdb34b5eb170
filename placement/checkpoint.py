"""Apply an expert permutation to a checkpoint: in memory, or offline on the files real stacks write.

Megatron-Core, TorchTitan and MaxText place expert ``j`` on EP rank ``j // (E / ep)`` and read no
expert map, so a placement is applied by renumbering the experts of each MoE layer in the
checkpoint: new expert ``p`` takes old expert ``perm[p]`` (the placement's ``phy2log`` row) for
**every per-expert tensor**: the expert weights and biases, the router weight rows, the router's
per-expert bias and balancing buffers, per-expert FP8 scaling state, and the optimizer's moments
and master weights of all of these.  Moving them together leaves the model's function and its next
optimizer step unchanged: a token that picked old expert ``e`` now picks slot ``log2phy[e]``,
which holds the same weights, with the same score.  With group-limited routing that holds only
when each group of ``E / G`` contiguous ids maps onto one block of ``E / G`` contiguous slots, so
other permutations are refused (:func:`placement.permutation.check_permutation`); to use them,
keep the router logical and install the dispatch-time map of :mod:`placement.runtime`.

Entry points (``docs/checkpoints.md`` has the file layouts and the stack versions they were read
from):

- :func:`apply_permutation` / :func:`apply_exported_permutation`: an in-memory state dict
  (``stack`` = ``megatron``, ``torchtitan`` or ``hf``; torch tensors or numpy arrays).
- :func:`permute_dcp`: a ``torch.distributed.checkpoint`` directory: Megatron-Core's ``torch_dist``
  format (``form="torch_dist"``: sharded keys without layer numbers, layers and experts as axes 0
  and 1, per-expert ``_extra_state`` objects, ``optimizer.state.<name>.`` moments and
  ``fp32_param`` master weights) or a TorchTitan checkpoint (``stack="torchtitan"``: model FQNs at
  the top level, optimizer state as ``optimizer.state.<fqn>.<name>``).
- :func:`permute_megatron_legacy`: Megatron's legacy per-rank ``mp_rank_TT_PPP[_EEE]`` files,
  merged over the expert-parallel ranks, permuted, split again.
- :func:`permute_orbax`: an Orbax PyTree checkpoint of a MaxText model (scanned layers).

Every offline entry point reads the whole source, refuses before writing anything when a tensor's
expert axis cannot be identified (the message names the tensor), writes the result into a
temporary directory beside the destination and renames it into place: the destination either does
not exist or holds the complete permuted checkpoint.  ``python -m placement.checkpoint`` is the
command line (exit codes 0 ok, 2 invalid input, 3 infeasible, 1 other).
"""

from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from placement.model import InfeasibleError, InvalidInputError, PlacementError
from placement.permutation import MAXTEXT_EXPERT_PATHS, PARAMETER_NAMES, check_permutation, read_expert_permutation

__all__ = [
    "Stack",
    "STACKS",
    "PARAMETER_NAMES",
    "MAXTEXT_EXPERT_PATHS",
    "apply_permutation",
    "apply_exported_permutation",
    "permute_entries",
    "permute_dcp",
    "permute_megatron_legacy",
    "permute_orbax",
    "main",
]

Stack = Literal["megatron", "torchtitan", "hf"]
STACKS: tuple[Stack, ...] = ("megatron", "torchtitan", "hf")
Form = Literal["state_dict", "torch_dist", "orbax"]

# ---------------------------------------------------------------------------------------------
# Which entries are per-expert, and along which axis
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Hit:
    """How one entry holds experts.

    kind: ``axis`` (experts along ``axis``), ``named`` (one entry per expert, id in the name),
    ``grouped`` (Megatron's legacy fused GroupedMLP weights), ``extra`` (an ``_extra_state``
    shared by a grouped GEMM: passes only when empty), ``unknown`` (refused).
    ``layer`` is the layer in the key (None when layers are an axis, ``layer_axis``).
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


_MEGATRON_SD = r"decoder\.layers\.(?P<layer>\d+)\.mlp\."
_MEGATRON_TD = r"decoder\.layers\.mlp\."
_TITAN = r"layers\.(?P<layer>\d+)\.moe\."
_HF = r"model\.layers\.(?P<layer>\d+)\.mlp\."
_UNKNOWN_MSG = "an expert or router entry whose expert axis this permutation cannot identify"

# (regex, kind, options); first full match wins; kind None = passes through untouched.
_RULES: dict[tuple[str, str], list[tuple[str, str | None, dict[str, Any]]]] = {
    ("megatron", "state_dict"): [
        (_MEGATRON_SD + r"router\.(?P<rest>.+)", "axis", {"router": True}),
        (_MEGATRON_SD + r"experts\.local_experts\.(?P<expert>\d+)\.(?P<rest>.+)", "named", {"weight": True}),
        (_MEGATRON_SD + r"experts\.(?P<rest>linear_fc[12]\.(?:weight|bias))(?P<expert>\d+)", "named", {"weight": True}),
        (_MEGATRON_SD + r"experts\.(?P<rest>weight[12])", "grouped", {"weight": True}),
        (_MEGATRON_SD + r"experts\.linear_fc[12]\._extra_state", "extra", {}),
        (_MEGATRON_SD + r"experts\..*", "unknown", {}),
        (r".*\.mlp\.(?:experts|router)\..*", "unknown", {}),
    ],
    ("megatron", "torch_dist"): [
        (r"(?:chained_\d+\.)?optimizer\.distributed\..*", "unknown", {}),
        (_MEGATRON_TD + r"router\.(?P<rest>.+)", "axis", {"router": True, "layer_axis": 0, "axis": 1}),
        (_MEGATRON_TD + r"experts\.experts\.(?P<expert>\d+)\.(?P<rest>.+)", "named", {"weight": True, "layer_axis": 0}),
        (_MEGATRON_TD + r"experts\.experts\.(?P<rest>.+)", "axis", {"weight": True, "layer_axis": 0, "axis": 1}),
        (_MEGATRON_TD + r"experts\..*", "unknown", {}),
        (r".*\.mlp\.(?:experts|router)\..*", "unknown", {}),
    ],
    ("torchtitan", "state_dict"): [
        (_TITAN + r"router\.(?P<rest>.+)", "axis", {"router": True}),
        (_TITAN + r"(?P<rest>expert_bias(?:_E)?|tokens_per_expert(?:_E)?)", "axis", {}),
        (_TITAN + r"(?P<rest>experts\.w[123]|routed_experts\.inner_experts\.w[123]_E[A-Z]+)", "axis", {"weight": True}),
        (_TITAN + r"shared_experts?\..*", None, {}),
        (_TITAN + r".*", "unknown", {}),
    ],
    ("hf", "state_dict"): [
        (_HF + r"gate\.(?P<rest>.+)", "axis", {"router": True}),
        (_HF + r"experts\.(?P<expert>\d+)\.(?P<rest>.+)", "named", {"weight": True}),
        (_HF + r"shared_experts\..*", None, {}),
        (_HF + r"experts\..*", "unknown", {}),
    ],
}
_RULES[("torchtitan", "torch_dist")] = _RULES[("torchtitan", "state_dict")]

# Optimizer state keyed by a parameter's name: (regex with group "key"), per stack and form.
_OPTIMIZER: dict[tuple[str, str], list[str]] = {
    ("megatron", "torch_dist"): [r"(?P<pre>(?:chained_\d+\.)?optimizer\.state\.\w+\.)(?P<key>.+)"],
    ("torchtitan", "state_dict"): [r"(?P<pre>(?:optimizer\.)?state\.)(?P<key>.+)\.(?P<suf>\w+)"],
    ("torchtitan", "torch_dist"): [r"(?P<pre>(?:optimizer\.)?state\.)(?P<key>.+)\.(?P<suf>\w+)"],
}
_PASS_OPTIMIZER = re.compile(r"(?:(?:chained_\d+\.)?optimizer\.)?param_groups\..*")
_COMPILED: dict[tuple[str, str], list[tuple[re.Pattern, str | None, dict[str, Any]]]] = {
    k: [(re.compile(rx), kind, opts) for rx, kind, opts in v] for k, v in _RULES.items()
}
_SHARD = re.compile(r"(?P<base>.+)/shard_(?P<off>\d+(?:\.\d+)*)_(?P<shape>\d+(?:\.\d+)*)")


def _classify_model_key(stack: str, form: str, key: str) -> _Hit | None:
    for rx, kind, opts in _COMPILED[(stack, form)]:
        m = rx.fullmatch(key)
        if not m:
            continue
        if kind is None:
            return None
        gd = m.groupdict()
        layer = int(gd["layer"]) if gd.get("layer") is not None else None
        expert = int(gd["expert"]) if gd.get("expert") is not None else None
        group = key if expert is None else key[: m.start("expert")] + "{expert}" + key[m.end("expert") :]
        return _Hit(kind=kind, layer=layer, expert=expert, group=group, **opts)
    return None


def _classify(stack: str, form: str, key: str) -> _Hit | None:
    """The :class:`_Hit` of one entry name (model parameter, buffer or optimizer state), or None."""
    if form == "orbax":
        return _classify_orbax(key)
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


_ORBAX_SCAN_AXIS: list[int | None] = [1]  # set per call by permute_orbax


def _classify_orbax(key: str) -> _Hit | None:
    scan = _ORBAX_SCAN_AXIS[0]
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


# ---------------------------------------------------------------------------------------------
# The engine: one flat mapping of entries, permuted
# ---------------------------------------------------------------------------------------------
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
        :mod:`placement.runtime`'s dispatch-time map expects.  Groups then need not stay whole.

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
    if (stack, "state_dict") not in _COMPILED:
        raise InvalidInputError(f"stack: expected one of {', '.join(STACKS)}, found {stack!r}")
    groups = 1 if keep_router else num_groups
    perms = {int(layer): check_permutation(int(layer), perm, groups) for layer, perm in layers.items()}
    out = dict(entries)
    routers: set[int] = set()
    weights: set[int] = set()
    named: dict[tuple[str, int | None, int | None], dict[int, str]] = {}
    for key, value in entries.items():
        base, shard = key, None
        if isinstance(value, (bytes, bytearray, io.BytesIO)):
            m = _SHARD.fullmatch(key)
            if m:
                base = m.group("base")
                shard = ([int(x) for x in m.group("off").split(".")], [int(x) for x in m.group("shape").split(".")])
        hit = _classify(stack, form, base)
        if hit is None:
            continue
        if keep_router and not hit.weight and hit.kind in ("axis",):
            continue  # the router, its bias and counters stay logical
        if hit.kind == "unknown":
            raise InvalidInputError(f"{key}: {_UNKNOWN_MSG}; refusing to permute the checkpoint without it")
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
            elif hit.kind == "axis" and len(off) >= 2:
                template = f"{base}/shard_{off[0]}.{{expert}}{''.join('.' + str(x) for x in off[2:])}_{shape_text}"
                named.setdefault((template, None, off[0]), {})[off[1]] = key
            else:
                raise InvalidInputError(f"{key}: a per-expert object whose shard offsets {off} name no expert")
            continue
        if hit.kind in ("named",):
            in_name = None if hit.layer is None else hit.layer + layer_offset
            named.setdefault((hit.group, hit.layer_axis, in_name), {})[int(hit.expert or 0)] = key
            continue
        if _is_object(value):
            raise InvalidInputError(f"{key}: a per-expert entry that is not a tensor ({type(value).__name__})")
        shape = _shape(value)
        if hit.optimizer and len(shape) == 0:
            continue  # an optimizer step counter, shared by all experts
        if hit.kind == "grouped":
            layer = int(hit.layer or 0) + layer_offset
            if layer in perms:
                out[key] = _take_grouped(key, value, perms[layer], expert_major_rows=key.endswith("weight2"))
                weights.add(layer)
            continue
        # kind "axis"
        if hit.layer_axis is None:
            layer = int(hit.layer or 0) + layer_offset
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
        Move the experts only (see :func:`permute_entries`), for :mod:`placement.runtime`.

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
        state_dict, layers, stack=stack, num_groups=num_groups, layer_offset=layer_offset, keep_router=keep_router
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
        layers = {
            layer: perm
            for layer, perm in layers.items()
            if layer >= layer_offset and router.format(layer=layer - layer_offset) in state_dict
        }
        if not layers:
            raise InvalidInputError(
                f"the state dict holds none of the document's MoE layers (stack={chosen}, layer_offset={layer_offset})"
            )
    return apply_permutation(state_dict, layers, stack=chosen, num_groups=groups, layer_offset=layer_offset,
                             keep_router=meta.get("apply") == "runtime")


def _doc_groups(meta: Mapping[str, Any]) -> int:
    return int(meta.get("num_groups", 1)) if meta.get("group_limited") else 1


# ---------------------------------------------------------------------------------------------
# torch.distributed.checkpoint directories (Megatron-Core torch_dist, TorchTitan)
# ---------------------------------------------------------------------------------------------
def permute_dcp(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    doc: Mapping[str, Any] | str,
    *,
    stack: Literal["megatron", "torchtitan"] | None = None,
    num_groups: int | None = None,
    keep_router: bool = False,
) -> list[str]:
    """Permute a ``torch.distributed.checkpoint`` directory ``src`` into a new directory ``dst``.

    Megatron-Core ``torch_dist`` (``stack="megatron"``; ``metadata.json`` and ``common.pt`` are
    copied unchanged) or TorchTitan (``stack="torchtitan"``).  Every tensor is read whole on this
    process (no process group; peak memory about the checkpoint's size), per-expert tensors and
    ``_extra_state`` objects are permuted or renamed, everything else is copied byte for byte
    (objects are not unpickled), and the result is saved with one writer.  The stacks' loaders
    reshard on load, so the file count may differ from the source's.

    Parameters
    ----------
    src, dst : path
        Source checkpoint directory; destination, which must not exist.
    doc : permutation document, its JSON text, or the path of its file
    stack : "megatron" or "torchtitan"; the document's by default
    num_groups : int, optional
        Overrides the document's group rule (1: no group constraint).
    keep_router : bool
        Move the experts only, for :mod:`placement.runtime` (see :func:`permute_entries`); also
        when the document says ``apply: runtime``.

    Returns
    -------
    list of str
        The entry names that were permuted or renamed, sorted.

    Raises
    ------
    InvalidInputError
        ``src`` is not a DCP directory, ``dst`` exists, or an entry cannot be permuted.
    InfeasibleError
        A permutation breaks expert groups of a group-limited model.
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    layers, meta = read_expert_permutation(doc if isinstance(doc, str) else dict(doc))
    chosen = stack or meta.get("stack")
    if chosen not in ("megatron", "torchtitan"):
        raise InvalidInputError(f"stack: expected megatron or torchtitan, found {chosen!r}")
    groups = _doc_groups(meta) if num_groups is None else num_groups
    keep_router = keep_router or meta.get("apply") == "runtime"  # a document for placement.runtime's map
    src, dst = Path(src), Path(dst)
    _check_dirs(src, dst, marker=".metadata")
    reader = dcp.FileSystemReader(str(src))
    md = reader.read_metadata()
    entries: dict[str, Any] = {}
    for key, item in md.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            entries[key] = torch.zeros(tuple(item.size), dtype=item.properties.dtype)
        elif isinstance(item, BytesStorageMetadata):
            entries[key] = io.BytesIO()

    class _RawBytes(DefaultLoadPlanner):
        """Keep objects as the bytes on disk (they are copied, never unpickled)."""

        def load_bytes(self, read_item, value):
            target = self.state_dict[read_item.dest_index.fqn]  # the placeholder in ``entries``
            target.write(value.read())
            target.seek(0)

    class _AsBytes(DefaultSavePlanner):
        """Write objects' bytes as they are (the source already serialised them)."""

        def transform_object(self, write_item, object):  # noqa: A002
            return object

    with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process, on purpose
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(entries, storage_reader=reader, planner=_RawBytes(flatten_state_dict=False), no_dist=True)
    form: Form = "torch_dist"
    out = permute_entries(entries, layers, stack=chosen, form=form, num_groups=groups, keep_router=keep_router)
    changed = sorted(k for k in out if out[k] is not entries[k])

    def write(tmp: Path) -> None:
        for child in src.iterdir():  # metadata.json, common.pt, ...: not part of the DCP data
            if child.name != ".metadata" and not child.name.endswith(".distcp"):
                (shutil.copytree if child.is_dir() else shutil.copy2)(child, tmp / child.name)
        writer = dcp.FileSystemWriter(str(tmp), single_file_per_rank=True)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.save(out, storage_writer=writer, planner=_AsBytes(flatten_state_dict=False), no_dist=True)

    _write_dir(dst, write)
    return changed


# ---------------------------------------------------------------------------------------------
# Megatron legacy per-rank files
# ---------------------------------------------------------------------------------------------
_RANK_DIR = re.compile(r"mp_rank_(?P<tp>\d{2})(?:_(?P<a>\d{3}))?(?:_(?P<b>\d{3}))?")


def permute_megatron_legacy(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    doc: Mapping[str, Any] | str,
    *,
    layer_offsets: Mapping[int, int] | None = None,
    num_groups: int | None = None,
    file_name: str = "model_optim_rng.pt",
    second_index: Literal["pp", "ep"] | None = None,
) -> list[str]:
    """Permute a legacy Megatron checkpoint directory (``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt``).

    The files of one (tensor, pipeline) rank pair hold ``E / ep`` local experts each (local index
    ``j`` of EP rank ``r`` is expert ``r * E / ep + j``); they are merged, permuted with
    :func:`apply_permutation` and split again.  Model entries ``model`` / ``model0``, ``model1``...
    (virtual stages) are permuted; optimizer state in these files is keyed by parameter index, so a
    file holding per-parameter optimizer state is refused (save with ``--no-save-optim``, or use
    ``torch_dist``).

    Parameters
    ----------
    src, dst : path
        The ``iter_NNNNNNN`` directory (or ``release``); the destination, which must not exist.
    doc : permutation document, its JSON text, or the path of its file
    layer_offsets : mapping of pipeline rank -> model layer index of its layer 0
        Required when there is more than one pipeline rank.
    num_groups : int, optional
        Overrides the document's group rule.
    file_name : str
    second_index : "pp" or "ep", optional
        What the second number of ``mp_rank_TT_NNN`` is: Megatron appends the pipeline rank when
        pipeline-parallel and the expert rank when expert-parallel, so a two-number name is
        ambiguous and must be told (three numbers are ``TT_PPP_EEE``).

    Returns
    -------
    list of str
        ``"mp_rank_.../file:entry"`` of every entry that changed, sorted.
    """
    import torch

    layers, meta = read_expert_permutation(doc if isinstance(doc, str) else dict(doc))
    groups = _doc_groups(meta) if num_groups is None else num_groups
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise InvalidInputError(f"{src}: not a directory")
    if dst.exists():
        raise InvalidInputError(f"{dst}: exists; refusing to overwrite")
    ranks: dict[tuple[int, int], dict[int, Path]] = {}
    for child in sorted(src.iterdir()):
        m = _RANK_DIR.fullmatch(child.name)
        if m and (child / file_name).is_file():
            if m.group("b") is not None:
                pp, ep = int(m.group("a")), int(m.group("b"))
            elif m.group("a") is not None:
                if second_index is None:
                    raise InvalidInputError(
                        f"{child}: mp_rank_TT_NNN names a pipeline or an expert rank: pass second_index='pp' or 'ep'"
                    )
                pp, ep = (int(m.group("a")), 0) if second_index == "pp" else (0, int(m.group("a")))
            else:
                pp, ep = 0, 0
            if (child / "distrib_optim.pt").exists():
                raise InvalidInputError(
                    f"{child / 'distrib_optim.pt'}: distributed-optimizer state in flat buffers, whose expert axis "
                    "cannot be identified; save in the torch_dist format"
                )
            ranks.setdefault((int(m.group("tp")), pp), {})[ep] = child / file_name
    if not ranks:
        raise InvalidInputError(f"{src}: no mp_rank_*/{file_name} files")
    pp_ranks = {pp for _, pp in ranks}
    if len(pp_ranks) > 1 and not layer_offsets:
        raise InvalidInputError(f"{src}: {len(pp_ranks)} pipeline ranks: pass layer_offsets (pipeline rank -> first layer)")
    results: dict[Path, dict] = {}
    changed: list[str] = []
    for (tp, pp), by_ep in sorted(ranks.items()):
        if sorted(by_ep) != list(range(len(by_ep))):
            raise InvalidInputError(f"{src}: tp {tp} pp {pp}: expert-parallel ranks {sorted(by_ep)} are not 0..{len(by_ep) - 1}")
        files = {ep: torch.load(path, map_location="cpu", weights_only=False) for ep, path in by_ep.items()}
        offset = int((layer_offsets or {}).get(pp, 0))
        for ep, obj in files.items():
            _refuse_indexed_optimizer(by_ep[ep], obj)
        model_keys = sorted(k for k in files[0] if re.fullmatch(r"model\d*", k))
        for mk in model_keys:
            local = {ep: obj[mk] for ep, obj in files.items()}
            merged, split = _merge_ep(local, len(by_ep))
            present = {
                layer: perm
                for layer, perm in layers.items()
                if layer >= offset and f"decoder.layers.{layer - offset}.mlp.router.weight" in merged
            }
            if not present:
                continue
            permuted = apply_permutation(merged, present, stack="megatron", num_groups=groups, layer_offset=offset)
            for ep, sd in split(permuted).items():
                for k in sd:
                    if sd[k] is not local[ep].get(k):
                        changed.append(f"{by_ep[ep].parent.name}/{file_name}:{mk}.{k}")
                files[ep][mk] = type(local[ep])(sd) if isinstance(local[ep], dict) else sd
        for ep, obj in files.items():
            results[by_ep[ep].relative_to(src)] = obj

    def write(tmp: Path) -> None:
        for child in src.iterdir():
            if not _RANK_DIR.fullmatch(child.name):
                (shutil.copytree if child.is_dir() else shutil.copy2)(child, tmp / child.name)
        for rel, obj in results.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            for other in (src / rel).parent.iterdir():
                if other.name != rel.name:
                    (shutil.copytree if other.is_dir() else shutil.copy2)(other, tmp / rel.parent / other.name)
            torch.save(obj, tmp / rel)

    _write_dir(dst, write)
    return sorted(changed)


def _refuse_indexed_optimizer(path: Path, obj: Mapping[str, Any]) -> None:
    opt = obj.get("optimizer")
    if not isinstance(opt, Mapping):
        return
    inner = opt.get("optimizer", opt)
    if isinstance(inner, Mapping) and inner.get("state"):
        raise InvalidInputError(
            f"{path}: optimizer: per-parameter state keyed by index, whose expert axis cannot be identified; "
            "save with --no-save-optim or in the torch_dist format"
        )
    if opt.get("fp32_from_fp16_params"):
        raise InvalidInputError(f"{path}: optimizer.fp32_from_fp16_params: master weights keyed by index; cannot be permuted")


_LOCAL = [
    re.compile(r"(?P<pre>decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(?P<expert>\d+)(?P<post>\..+)"),
    re.compile(r"(?P<pre>decoder\.layers\.\d+\.mlp\.experts\.linear_fc[12]\.(?:weight|bias))(?P<expert>\d+)(?P<post>)"),
]
_LEGACY_GROUPED = re.compile(r"decoder\.layers\.\d+\.mlp\.experts\.weight[12]")


def _merge_ep(local: Mapping[int, Mapping[str, Any]], ep: int) -> tuple[dict[str, Any], Callable[[Mapping[str, Any]], dict[int, dict]]]:
    """Merge EP ranks' state dicts (local expert ids -> global), and the function that splits back."""
    import torch

    first = local[0]
    per_rank: dict[str, int] = {}  # expert-indexed family -> experts per rank
    for k in first:
        for rx in _LOCAL:
            m = rx.fullmatch(k)
            if m:
                fam = m.group("pre") + "{}" + m.group("post")
                per_rank[fam] = per_rank.get(fam, 0) + 1
    merged: dict[str, Any] = {}
    for r in range(ep):
        for k, v in local[r].items():
            for rx in _LOCAL:
                m = rx.fullmatch(k)
                if m:
                    fam = m.group("pre") + "{}" + m.group("post")
                    merged[fam.format(r * per_rank[fam] + int(m.group("expert")))] = v
                    break
            else:
                if _LEGACY_GROUPED.fullmatch(k):
                    merged.setdefault(k, [])
                    merged[k].append(v)
                elif r == 0:
                    merged[k] = v
    local_shapes: dict[str, tuple[int, ...]] = {}
    for k in list(merged):
        if isinstance(merged[k], list):
            # GroupedMLP weight1 (hidden, El*f) / weight2 (El*f, hidden): read as view(El, ...) of the
            # flat buffer, so the global buffer is the ranks' flat buffers end to end
            parts = merged[k]
            rows, cols = _shape(parts[0])
            local_shapes[k] = (rows, cols)
            flat = torch.cat([t.reshape(-1) for t in parts])
            merged[k] = flat.reshape(rows * ep, cols) if k.endswith("weight2") else flat.reshape(rows, cols * ep)

    def split(sd: Mapping[str, Any]) -> dict[int, dict]:
        out: dict[int, dict] = {r: {} for r in range(ep)}
        for r in range(ep):
            for k in local[r]:
                for rx in _LOCAL:
                    m = rx.fullmatch(k)
                    if m:
                        fam = m.group("pre") + "{}" + m.group("post")
                        out[r][k] = sd[fam.format(r * per_rank[fam] + int(m.group("expert")))]
                        break
                else:
                    if _LEGACY_GROUPED.fullmatch(k):
                        size = int(np.prod(local_shapes[k]))
                        out[r][k] = sd[k].reshape(-1)[r * size : (r + 1) * size].reshape(local_shapes[k]).clone()
                    else:
                        # router and shared entries are replicas on every EP rank: the permuted
                        # value (computed from rank 0's) goes to all, an unchanged one stays
                        out[r][k] = local[r][k] if sd[k] is merged[k] else sd[k]
        return out

    return merged, split


# ---------------------------------------------------------------------------------------------
# Orbax (MaxText)
# ---------------------------------------------------------------------------------------------
def permute_orbax(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    doc: Mapping[str, Any] | str,
    *,
    scan_layers: Sequence[int] | None = None,
    scan_axis: int | None = 1,
    num_groups: int | None = None,
) -> list[str]:
    """Permute an Orbax PyTree checkpoint of a MaxText MoE model, parameters and optimizer state.

    Every leaf whose path ends in one of :data:`MAXTEXT_EXPERT_PATHS` (``.../MoeBlock_0/wi_0``,
    ``wi_1``, ``wo``, their biases, ``gate/kernel``, ``gate/bias``), wherever it sits (``params``,
    the optimizer's ``mu`` / ``nu``), is permuted along its expert axis; any other leaf under a
    ``MoeBlock_0`` is refused.  With scanned layers (MaxText's ``scan_layers=True``) the layer axis
    is ``scan_axis`` (MaxText's ``param_scan_axis``, 1): ``wi_0`` (E, L, emb, mlp), ``gate/kernel``
    (emb, L, E), ``gate/bias`` (E, L).

    Parameters
    ----------
    src, dst : path
        The PyTree checkpoint directory (a MaxText step's ``items``); destination, must not exist.
    doc : permutation document, its JSON text, or the path of its file
        Either ``placement export --format megatron|torchtitan``'s permutation (keyed by model
        layer) or ``placement export --format maxtext``'s document (``experts.layers`` keyed by
        scan position; its ``experts.tensors`` must name the tensors this function permutes).
    scan_layers : sequence of int, optional
        Model layer index of each position along the scan axis; by default the document's MoE
        layers in order (MaxText's DeepSeek decoder scans its MoE layers as one stack).
    scan_axis : int or None
        None when layers are not scanned (then the document must hold exactly one layer).
    num_groups : int, optional
        Overrides the document's group rule.

    Returns
    -------
    list of str
        Paths (``a/b/c``) of the permuted leaves, sorted.
    """
    import orbax.checkpoint as ocp

    maxtext = _maxtext_experts(doc)
    if maxtext is not None:  # ``placement export --format maxtext``: rows are already scan positions
        by_position, groups = maxtext
        groups = groups if num_groups is None else num_groups
        layers, scan_layers = by_position, list(range(max(by_position, default=-1) + 1))
    else:
        layers, meta = read_expert_permutation(doc if isinstance(doc, str) else dict(doc))
        groups = _doc_groups(meta) if num_groups is None else num_groups
    src, dst = Path(src).resolve(), Path(dst).resolve()
    if not src.is_dir():
        raise InvalidInputError(f"{src}: not an Orbax checkpoint directory")
    if dst.exists():
        raise InvalidInputError(f"{dst}: exists; refusing to overwrite")
    order = list(scan_layers) if scan_layers is not None else sorted(layers)
    if scan_axis is None and len(layers) != 1:
        raise InvalidInputError(f"scan_axis=None (unscanned layers) needs a one-layer document, found {len(layers)} layers")
    missing = sorted(set(layers) - set(order))
    if missing:
        raise InvalidInputError(f"scan_layers: MoE layers {missing[:6]} of the document have no scan position")
    by_position = {i: layers[layer] for i, layer in enumerate(order) if layer in layers}
    if scan_axis is None:
        by_position = {0: next(iter(layers.values()))}
    import jax

    with ocp.PyTreeCheckpointer() as ckptr:
        # host numpy arrays whatever devices the checkpoint was saved from (its sharding is ignored)
        meta_tree = ckptr.metadata(str(src)).item_metadata.tree
        restore_args = jax.tree_util.tree_map(
            lambda m: ocp.RestoreArgs(restore_type=np.ndarray) if type(m).__name__ == "ArrayMetadata" else ocp.RestoreArgs(),
            meta_tree,
        )
        tree = ckptr.restore(str(src), restore_args=restore_args)
    flat = _flatten_tree(tree)
    entries = {k: np.asarray(v) if hasattr(v, "shape") else v for k, v in flat.items()}
    _ORBAX_SCAN_AXIS[0] = scan_axis
    try:
        out = permute_entries(entries, by_position, stack="megatron", form="orbax", num_groups=groups)
    finally:
        _ORBAX_SCAN_AXIS[0] = 1
    changed = sorted(k for k in out if out[k] is not entries[k])
    new_tree = _unflatten_tree(tree, {k: out[k] if k in changed else flat[k] for k in flat})

    def write(tmp: Path) -> None:
        target = tmp / "tree"
        with ocp.PyTreeCheckpointer() as writer:
            writer.save(str(target), new_tree)
        for child in target.iterdir():
            child.rename(tmp / child.name)
        target.rmdir()

    _write_dir(dst, write)
    return changed


MAXTEXT_DOC_KIND = "placement.maxtext"


def _maxtext_experts(doc: Mapping[str, Any] | str) -> tuple[dict[int, np.ndarray], int] | None:
    """``({scan position: phy2log}, num_groups)`` of a ``placement.maxtext`` document, else None.

    Its ``experts.tensors`` (path, expert axis, layer axis) must agree with
    :data:`MAXTEXT_EXPERT_PATHS` at scan axis 1, so both ends name the same tensors.
    """
    import json

    if isinstance(doc, str):
        text = doc
        if not doc.lstrip().startswith("{"):
            try:
                text = Path(doc).read_text(encoding="utf-8")
            except OSError:
                return None
        try:
            doc = json.loads(text)
        except json.JSONDecodeError:
            return None
    if not isinstance(doc, Mapping) or doc.get("kind") != MAXTEXT_DOC_KIND:
        return None
    experts = doc.get("experts")
    if not isinstance(experts, Mapping) or not isinstance(experts.get("layers"), Mapping):
        raise InvalidInputError("maxtext: experts.layers: expected an object of scan position -> permutation")
    for t in experts.get("tensors", []):
        path = str(t.get("path", ""))
        leaf = next((k for k in MAXTEXT_EXPERT_PATHS if path == k or path.endswith("/" + k)), None)
        axis = None if leaf is None else MAXTEXT_EXPERT_PATHS[leaf]
        want = None if axis is None else (axis if axis < 1 else axis + 1, 1)
        if want != (t.get("expert_axis"), t.get("layer_axis")):
            raise InvalidInputError(
                f"maxtext: experts.tensors: {t.get('path')!r} with expert axis {t.get('expert_axis')} and layer axis "
                f"{t.get('layer_axis')} is not a tensor this permutation knows as such"
            )
    layers = {}
    for key, row in experts["layers"].items():
        if not str(key).isdigit():
            raise InvalidInputError(f"maxtext: experts.layers: key {key!r} is not a scan position")
        layers[int(key)] = np.asarray(row, dtype=np.int64)
    groups = int(experts.get("num_groups", 1)) if experts.get("group_limited") else 1
    return dict(sorted(layers.items())), groups


def _flatten_tree(tree: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            out.update(_flatten_tree(v, f"{prefix}{k}/"))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(_flatten_tree(v, f"{prefix}{i}/"))
    else:
        out[prefix.rstrip("/")] = tree
    return out


def _unflatten_tree(tree: Any, flat: Mapping[str, Any], prefix: str = "") -> Any:
    if isinstance(tree, Mapping):
        return {k: _unflatten_tree(v, flat, f"{prefix}{k}/") for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_unflatten_tree(v, flat, f"{prefix}{i}/") for i, v in enumerate(tree))
    return flat[prefix.rstrip("/")]


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m placement.checkpoint FORMAT PERMUTATION SRC DST``: permute a checkpoint offline."""
    parser = argparse.ArgumentParser(
        prog="python -m placement.checkpoint",
        description="Renumber the experts of a checkpoint with a permutation written by placement export.",
    )
    parser.add_argument("format", choices=["megatron-torch-dist", "megatron-legacy", "torchtitan-dcp", "orbax"])
    parser.add_argument("permutation", help="the JSON written by placement export --format megatron|torchtitan")
    parser.add_argument("src", help="source checkpoint directory")
    parser.add_argument("dst", help="destination directory (must not exist)")
    parser.add_argument("--layer-offsets", default="", help="megatron-legacy: PP:FIRST_LAYER,... per pipeline rank")
    parser.add_argument(
        "--second-index", choices=["pp", "ep"], default=None, help="megatron-legacy: what NNN of mp_rank_TT_NNN is"
    )
    parser.add_argument(
        "--keep-router", action="store_true", help="DCP formats: move the experts only (for placement.runtime's map)"
    )
    args = parser.parse_args(argv)
    try:
        if args.format == "megatron-torch-dist":
            changed = permute_dcp(args.src, args.dst, args.permutation, stack="megatron", keep_router=args.keep_router)
        elif args.format == "torchtitan-dcp":
            changed = permute_dcp(args.src, args.dst, args.permutation, stack="torchtitan", keep_router=args.keep_router)
        elif args.format == "megatron-legacy":
            offsets = {}
            for part in filter(None, args.layer_offsets.split(",")):
                pp, _, first = part.partition(":")
                if not (pp.isdigit() and first.isdigit()):
                    raise InvalidInputError(f"--layer-offsets: expected PP:FIRST_LAYER, found {part!r}")
                offsets[int(pp)] = int(first)
            changed = permute_megatron_legacy(
                args.src, args.dst, args.permutation, layer_offsets=offsets or None, second_index=args.second_index
            )
        else:
            changed = permute_orbax(args.src, args.dst, args.permutation)
    except InfeasibleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    except (InvalidInputError, PlacementError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - one line, exit 1
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"permuted {len(changed)} entries; wrote {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
