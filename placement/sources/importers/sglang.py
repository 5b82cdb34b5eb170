"""Reader of SGLang's expert distribution dumps in ``per_token`` mode (``.pt`` files).

The format, as ``python/sglang/srt/eplb/expert_distribution.py`` of SGLang writes it (read at commit
02295fe of sgl-project/sglang; SGLang cannot be installed for CPU, so the tests use fixtures built to
this schema): a server started with ``--expert-distribution-recorder-mode per_token`` records
between ``POST /start_expert_distribution_record`` and ``/stop_expert_distribution_record``;
``/dump_expert_distribution_record`` makes every rank ``torch.save`` the file
``expert_distribution_recorder_{time}_{rank}.pt`` into ``SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR``,
holding::

    {"records": [{"forward_pass_id": int, "rank": int, "gatherer_key": str,
                  "input_ids": [...], "positions": [...], "extend_seq_lens": [...],
                  "forward_mode": int, "misc_objects": [...],
                  "topk_ids_of_layer": int32 tensor (num_layers, num_tokens, 8),
                  "global_physical_count": tensor}, ...],
     "last_physical_to_logical_map": int tensor (num_layers, num_physical_experts)}

``topk_ids_of_layer`` holds PHYSICAL expert ids (with redundant experts there are more physical
than logical experts) over every layer of the model (``num_hidden_layers``; dense layers stay -1),
8 columns (``_DetailSinglePassGatherer._TOP_K_NUM``), -1 where nothing was recorded.  This reader
keeps the model's MoE layers and its ``top_k`` columns, drops the tokens with -1 in a MoE layer of
the rank's stage (counted in the provenance), and maps ids to logical experts with
``last_physical_to_logical_map`` (the map at dump time: run the recording without EPLB
rebalancing in between).  ``forward_pass_id`` plays the role of the step.  ``stat`` mode dumps
only ``logical_count`` (per-expert counts): refused, since an instance needs per-token ids.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from placement.sources.importers.core import IdChecker, LoadedIds, RouterCall, check_phy2log_map
from placement.core.model import InvalidInputError, MoEModel

__all__ = ["read_calls", "load_dump"]

SGLANG_TOP_K_COLUMNS = 8


def load_dump(path: Path) -> Any:
    """``torch.load`` with ``weights_only=True`` (no arbitrary unpickling); errors name the file."""
    try:
        import torch
    except ImportError:
        raise InvalidInputError(f"{path}: reading SGLang .pt dumps needs torch (pip install torch)") from None
    if not path.is_file():
        raise InvalidInputError(f"{path}: dump file not found or not a regular file")
    try:
        return torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure on untrusted bytes is bad input
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InvalidInputError(f"{path}: not a readable torch dump (truncated or corrupt): {msg}") from None


def _array(value: Any, where: str, name: str) -> np.ndarray:
    try:
        import torch

        if isinstance(value, torch.Tensor):
            return value.detach().cpu().numpy()
    except ImportError:  # pragma: no cover - load_dump needs torch already
        pass
    if isinstance(value, np.ndarray):
        return value
    raise InvalidInputError(f"{where}: {name}: expected a tensor, found {type(value).__name__}")


def read_calls(
    paths: Sequence[str | os.PathLike[str]], model: MoEModel, stage_of_rank: Any = None,
    on_bytes: Callable[[int], None] | None = None,
) -> Iterator[RouterCall]:
    """One :class:`RouterCall` per (record, MoE layer) of SGLang ``per_token`` dumps.

    ``stage_of_rank``: optional callable rank -> the MoE layers (model indices) that rank's stage
    runs; tokens are dropped as padding only when -1 appears in those layers (default: all).
    ``on_bytes`` is called with each file's size once it is loaded (progress; it only observes).
    """
    checker = IdChecker(model)
    k = model.top_k
    for p in sorted({str(x) for x in paths}):
        path = Path(p)
        doc = load_dump(path)
        if on_bytes is not None:
            on_bytes(path.stat().st_size)
        if not isinstance(doc, dict):
            raise InvalidInputError(f"{path}: expected a dict with 'records', found {type(doc).__name__}")
        if "records" not in doc:
            if "logical_count" in doc:
                raise InvalidInputError(
                    f"{path}: an SGLang 'stat' dump holds per-expert counts only; an instance needs per-token "
                    f"expert ids: record with --expert-distribution-recorder-mode per_token"
                )
            raise InvalidInputError(f"{path}: records: missing (not an SGLang per_token dump)")
        records = doc["records"]
        if not isinstance(records, list):
            raise InvalidInputError(f"{path}: records: expected a list")
        if "last_physical_to_logical_map" not in doc:
            raise InvalidInputError(f"{path}: last_physical_to_logical_map: missing")
        p2l = _array(doc["last_physical_to_logical_map"], str(path), "last_physical_to_logical_map").astype(np.int64)
        check_phy2log_map(p2l, model, str(path), "last_physical_to_logical_map")
        num_physical = p2l.shape[1]
        for number, rec in enumerate(records, 1):
            where = f"{path}: record {number}"
            if not isinstance(rec, dict):
                raise InvalidInputError(f"{where}: expected a dict")
            for key in ("forward_pass_id", "rank"):
                v = rec.get(key)
                if isinstance(v, bool) or not isinstance(v, int):
                    raise InvalidInputError(f"{where}: {key}: expected an integer, found {v!r:.40}")
            if "topk_ids_of_layer" not in rec:
                raise InvalidInputError(f"{where}: topk_ids_of_layer: missing")
            phys = _array(rec["topk_ids_of_layer"], where, "topk_ids_of_layer")
            if phys.dtype.kind not in "iu" or phys.ndim != 3 or phys.shape[0] != model.num_layers:
                raise InvalidInputError(
                    f"{where}: topk_ids_of_layer: expected integer (num_layers={model.num_layers}, tokens, "
                    f"{SGLANG_TOP_K_COLUMNS}), found {phys.dtype} {phys.shape}"
                )
            if phys.shape[2] < k:
                raise InvalidInputError(f"{where}: topk_ids_of_layer: {phys.shape[2]} columns, the model's top_k is {k}")
            phys = phys.astype(np.int64)
            if phys.shape[2] > k and np.any(phys[:, :, k:] != -1):
                raise InvalidInputError(
                    f"{where}: topk_ids_of_layer: ids beyond the model's top_k={k} columns (wrong model.top_k?)"
                )
            rank = rec["rank"]
            layers = list(model.moe_layers if stage_of_rank is None else stage_of_rank(rank))
            sub = phys[layers, :, :k]  # (moe layers of the stage, tokens, k)
            if sub.size and (sub.max() >= num_physical or sub.min() < -1):
                bad = int(sub.max()) if sub.max() >= num_physical else int(sub.min())
                raise InvalidInputError(f"{where}: physical expert id {bad} is outside [0, {num_physical}) (or -1)")
            valid = ~(sub < 0).any(axis=(0, 2))
            for j, layer in enumerate(layers):
                ids = p2l[layer][sub[j][valid]] if valid.any() else np.empty((0, k), dtype=np.int64)
                ids = checker.check(ids.reshape(-1, k), f"{where} (layer {layer})")
                yield RouterCall(
                    where=f"{where} (layer {layer})",
                    step=rec["forward_pass_id"],
                    layer=layer,
                    num_tokens=int(ids.shape[0]),
                    load=LoadedIds(ids),
                    rank=rank,
                )
