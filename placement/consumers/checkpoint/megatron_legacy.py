"""Megatron's legacy per-rank checkpoints (``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt``).

The expert-parallel ranks' files of one (tensor, pipeline) pair are merged, permuted in memory
(:func:`placement.consumers.checkpoint.apply_permutation`) and split again: one pair's files at a time, so
the peak memory is one pipeline stage's model on all its expert ranks.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np

from placement.consumers.checkpoint._entries import _doc_groups, _shape, _write_dir, apply_permutation
from placement.consumers.checkpoint._rules import infer_num_layers
from placement.core.model import InvalidInputError
from placement.core.permutation import read_expert_permutation

__all__ = ["permute_megatron_legacy"]


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
            num_layers = infer_num_layers("megatron", "state_dict", merged.keys(), offset)
            present = {
                layer: perm
                for layer, perm in layers.items()
                if layer >= offset
                and (
                    f"decoder.layers.{layer - offset}.mlp.router.weight" in merged
                    or (
                        num_layers is not None
                        and f"mtp.layers.{layer - num_layers}.transformer_layer.mlp.router.weight" in merged
                    )
                )
            }
            if not present:
                continue
            permuted = apply_permutation(
                merged, present, stack="megatron", num_groups=groups, layer_offset=offset, num_layers=num_layers
            )
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


_LAYER = r"(?P<layer>decoder\.layers\.\d+|mtp\.layers\.\d+\.transformer_layer)"
_LOCAL = [
    re.compile(_LAYER + r"(?P<pre>\.mlp\.experts\.local_experts\.)(?P<expert>\d+)(?P<post>\..+)"),
    re.compile(_LAYER + r"(?P<pre>\.mlp\.experts\.linear_fc[12]\.(?:weight|bias))(?P<expert>\d+)(?P<post>)"),
]
_LEGACY_GROUPED = re.compile(_LAYER + r"\.mlp\.experts\.weight[12]")


def _merge_ep(local: Mapping[int, Mapping[str, Any]], ep: int) -> tuple[dict[str, Any], Callable[[Mapping[str, Any]], dict[int, dict]]]:
    """Merge EP ranks' state dicts (local expert ids -> global), and the function that splits back."""
    import torch

    first = local[0]
    per_rank: dict[str, int] = {}  # expert-indexed family -> experts per rank
    for k in first:
        for rx in _LOCAL:
            m = rx.fullmatch(k)
            if m:
                fam = m.group("layer") + m.group("pre") + "{}" + m.group("post")
                per_rank[fam] = per_rank.get(fam, 0) + 1
    merged: dict[str, Any] = {}
    for r in range(ep):
        for k, v in local[r].items():
            for rx in _LOCAL:
                m = rx.fullmatch(k)
                if m:
                    fam = m.group("layer") + m.group("pre") + "{}" + m.group("post")
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
                        fam = m.group("layer") + m.group("pre") + "{}" + m.group("post")
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

