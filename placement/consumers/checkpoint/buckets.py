"""The bucket layout of Megatron-Core's distributed optimizer (``dp_reshardable`` checkpoints).

Each bucket's flat optimizer state is saved without saying which parameter lies where; the layout
is recorded from the live optimizer (:func:`write_megatron_bucket_layout`) and read back by
:func:`read_bucket_layout` for :func:`placement.consumers.checkpoint.permute_dcp` (see
:mod:`placement.consumers.checkpoint.megatron_dist` for the checkpoint layouts).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from placement.core.model import InvalidInputError

__all__ = ["BUCKET_LAYOUT_KIND", "megatron_bucket_layout", "write_megatron_bucket_layout", "read_bucket_layout"]


BUCKET_LAYOUT_KIND = "placement.megatron_bucket_layout"
_FIELDS = ("chain", "dp", "gbuf", "dtype", "bucket", "start", "numel", "family", "layer", "expert", "tp", "router")
_DECODER = re.compile(r"(?:.*\.)?decoder\.layers\.(?P<i>\d+)\.(?P<rest>.+)")
_MTP = re.compile(r"(?:.*\.)?mtp\.layers\.(?P<j>\d+)\.(?:transformer_layer|mtp_model_layer)\.(?P<rest>.+)")
_SEQ = re.compile(r"mlp\.experts\.local_experts\.(?P<e>\d+)\.(?P<rest>.+)")
_TE = re.compile(r"mlp\.experts\.(?P<rest>linear_fc[12]\.(?:weight|bias))(?P<e>\d+)")


def megatron_bucket_layout(model_chunks: Any, optimizer: Any) -> list[dict[str, Any]]:
    """This rank's parameters in its distributed optimizers' buckets (one row per parameter).

    Parameters
    ----------
    model_chunks : a Megatron-Core model or a list of model chunks (DDP-wrapped or not)
    optimizer : the ``DistributedOptimizer`` or ``ChainedOptimizer`` that saves the checkpoint

    Returns
    -------
    list of dict
        ``chain`` (index among the chained optimizers), ``dp`` (``data_parallel_group_idx``),
        ``gbuf``, ``dtype`` (as in the key), ``bucket``, ``start`` (offset in the bucket
        tensor), ``numel``, ``family`` (the name with layer and local expert indices removed),
        ``layer`` (model layer index, MTP layer ``J`` as ``num_layers + J``, or None), ``expert``
        (global expert id or None), ``tp`` (tensor-parallel rank of the parameter), ``router``
        (the router weight or bias, rows by expert).
    """
    from megatron.core import parallel_state as ps

    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    names: dict[int, str] = {}
    layer_of: dict[str, int] = {}
    local_ids: dict[str, list[int]] = {}
    num_layers = None
    for chunk in chunks:
        inner = chunk
        while hasattr(inner, "module") and not hasattr(inner, "decoder"):
            inner = inner.module
        num_layers = getattr(getattr(inner, "config", None), "num_layers", num_layers)
        for name, param in inner.named_parameters():
            names[id(param)] = name
        for name, mod in inner.named_modules():
            m = _DECODER.fullmatch(name + ".x")
            if m and m.group("rest") == "x" and hasattr(mod, "layer_number"):
                layer_of[name] = int(mod.layer_number) - 1
            if hasattr(mod, "local_expert_indices") and name.endswith("mlp"):
                local_ids[name] = [int(x) for x in mod.local_expert_indices]
    tp_dense = ps.get_tensor_model_parallel_rank()
    tp_expert = ps.get_expert_tensor_parallel_rank()
    opts = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    rows: list[dict[str, Any]] = []
    for chain, opt in enumerate(opts):
        buffers = getattr(opt, "buffers", None)
        if buffers is None:
            continue
        for gbuf, buffer in enumerate(buffers):
            dtype = str((buffer.param_dtype, buffer.grad_dtype))
            for param, (start, end, bucket_id) in buffer.param_index_map.items():
                name = names.get(id(param))
                if name is None:
                    raise InvalidInputError(f"optimizer bucket {bucket_id}: a parameter that is in none of the model chunks")
                family, layer, expert, router = _identify(name, layer_of, local_ids, num_layers)
                rows.append({
                    "chain": chain, "dp": int(opt.data_parallel_group_idx), "gbuf": gbuf, "dtype": dtype,
                    "bucket": int(bucket_id), "start": int(start - buffer.buckets[bucket_id].offset),
                    "numel": int(end - start), "family": family, "layer": layer, "expert": expert,
                    "tp": tp_expert if expert is not None else tp_dense, "router": router,
                })
    return rows


def _identify(
    name: str, layer_of: Mapping[str, int], local_ids: Mapping[str, list[int]], num_layers: int | None
) -> tuple[str, int | None, int | None, bool]:
    """(family, model layer, global expert, is router) of a parameter name."""
    m = _DECODER.fullmatch(name)
    mt = _MTP.fullmatch(name)
    if m:
        prefix = name[: m.start("rest") - 1]
        layer = layer_of.get(prefix, int(m.group("i")))
        family, rest = "decoder.layers.{}." , m.group("rest")
    elif mt:
        prefix = name[: mt.start("rest") - 1]
        if num_layers is None:
            raise InvalidInputError(f"{name}: an MTP parameter and the model's num_layers is unknown")
        layer = num_layers + int(mt.group("j"))
        family, rest = "mtp.layers.{}.", mt.group("rest")
    else:
        return name, None, None, False
    mlp = prefix + ".mlp"
    for rx in (_SEQ, _TE):
        e = rx.fullmatch(rest)
        if e:
            ids = local_ids.get(mlp)
            if ids is None:
                raise InvalidInputError(f"{name}: an expert parameter outside an MoE layer with local_expert_indices")
            fam = family + (f"mlp.experts.local_experts.{{}}.{e.group('rest')}" if rx is _SEQ else f"mlp.experts.{e.group('rest')}{{}}")
            return fam, layer, ids[int(e.group("e"))], False
    if rest.startswith("mlp.experts.") and not rest.startswith("mlp.experts.shared"):
        raise InvalidInputError(f"{name}: expert parameters fused over experts (legacy GroupedMLP); not supported in buckets")
    return family + rest, layer, None, rest in ("mlp.router.weight", "mlp.router.bias")


def write_megatron_bucket_layout(path: str | os.PathLike, model_chunks: Any, optimizer: Any) -> None:
    """Gather :func:`megatron_bucket_layout` from every rank and write it (rank 0) to ``path``.

    Call it on every rank of the job that saves the ``dp_reshardable`` checkpoint (or of any job
    with the same model and parallel layout).  The file is written atomically.
    """
    import torch.distributed as dist

    rows = megatron_bucket_layout(model_chunks, optimizer)
    if dist.is_available() and dist.is_initialized():
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, rows)
        rank = dist.get_rank()
    else:
        gathered, rank = [rows], 0
    if rank == 0:
        seen: dict[tuple[Any, ...], dict[str, Any]] = {}
        for part in gathered:
            for row in part:
                seen[tuple(row[k] for k in _FIELDS[:6])] = row
        doc = {"kind": BUCKET_LAYOUT_KIND, "version": 1, "fields": list(_FIELDS),
               "params": [[row[k] for k in _FIELDS] for _, row in sorted(seen.items(), key=lambda kv: repr(kv[0]))]}
        target = Path(path)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(json.dumps(doc, separators=(",", ":")) + "\n", encoding="utf-8")
        os.replace(tmp, target)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def read_bucket_layout(layout: Mapping[str, Any] | str | os.PathLike) -> tuple[tuple[Any, ...], ...]:
    """The rows of a bucket layout document (a mapping or the path of its JSON file)."""
    where = "bucket_layout"
    if not isinstance(layout, Mapping):
        where = str(layout)
        try:
            layout = json.loads(Path(layout).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise InvalidInputError(f"{where}: cannot read the bucket layout ({exc})") from None
    if not isinstance(layout, Mapping) or layout.get("kind") != BUCKET_LAYOUT_KIND:
        raise InvalidInputError(f"{where}: kind: expected {BUCKET_LAYOUT_KIND!r}")
    if list(layout.get("fields", [])) != list(_FIELDS):
        raise InvalidInputError(f"{where}: fields: expected {list(_FIELDS)}")
    rows = []
    for i, row in enumerate(layout.get("params", [])):
        if not isinstance(row, Sequence) or len(row) != len(_FIELDS):
            raise InvalidInputError(f"{where}: params[{i}]: expected {len(_FIELDS)} fields")
        rows.append(tuple(row))
    return tuple(rows)
