"""vLLM's EPLB state (for inspection or a plugin) and the vllm-ascend plugin's ``expert_map_path`` file,
with a reader for each."""

from __future__ import annotations

import numpy as np

from placement.consumers.export._text import _as_doc, _int_matrix
from placement.consumers.export.sglang import sglang_layout_problem
from placement.core.model import InfeasibleError, Instance, InvalidInputError, Placement


def vllm_eplb_maps(placement: Placement, instance: Instance | None = None) -> dict:
    """vLLM's EPLB state for the placement (``vllm/distributed/eplb/eplb_state.py``).

    Returns
    -------
    dict
        ``physical_to_logical_map`` (L, P); ``logical_to_physical_map`` (L, E, R + 1), the physical
        slots of each logical expert in ascending order, padded with -1; ``logical_replica_count``
        (L, E); and ``meta``.  ``L`` counts MoE layers only (vLLM's ``num_moe_layers``), in model
        order, MTP MoE layers (``meta.moe_layers`` entries ``>= num_layers``) last; ``R = P - E``
        redundant slots.
    """
    p2l = np.asarray(placement.phy2log, dtype=np.int64)
    num_layers, num_physical = p2l.shape
    num_logical = instance.model.num_experts if instance is not None else num_physical
    width = num_physical - num_logical + 1
    log2phy = np.full((num_layers, num_logical, width), -1, dtype=np.int64)
    count = np.zeros((num_layers, num_logical), dtype=np.int64)
    for li in range(num_layers):
        for p in range(num_physical):  # ascending physical ids, as vLLM builds it
            e = int(p2l[li, p])
            log2phy[li, e, count[li, e]] = p
            count[li, e] += 1
    meta: dict = {"num_redundant_experts": num_physical - num_logical, "num_physical_experts": num_physical}
    if instance is not None:
        meta.update(
            instance={"name": instance.name, "sha256": instance.sha256},
            moe_layers=list(instance.model.moe_layers),
            ep=instance.parallel.ep,
            num_local_physical_experts=num_physical // instance.parallel.ep,
        )
    return {
        "physical_to_logical_map": p2l.tolist(),
        "logical_to_physical_map": log2phy.tolist(),
        "logical_replica_count": count.tolist(),
        "meta": meta,
    }


def parse_vllm_eplb_maps(doc: dict | str) -> np.ndarray:
    """(L, P) ``phy2log`` back from :func:`vllm_eplb_maps`, after checking the three maps agree."""
    doc = _as_doc(doc, "vllm EPLB maps")
    for key in ("physical_to_logical_map", "logical_to_physical_map", "logical_replica_count"):
        if key not in doc:
            raise InvalidInputError(f"vllm: missing {key}")
    p2l = _int_matrix(doc["physical_to_logical_map"], "vllm: physical_to_logical_map")
    log2phy = np.asarray(doc["logical_to_physical_map"], dtype=np.int64)
    count = _int_matrix(doc["logical_replica_count"], "vllm: logical_replica_count")
    num_layers, num_physical = p2l.shape
    if log2phy.ndim != 3 or log2phy.shape[0] != num_layers or count.shape != log2phy.shape[:2]:
        raise InvalidInputError(
            f"vllm: shapes disagree: physical_to_logical_map {p2l.shape}, logical_to_physical_map "
            f"{log2phy.shape}, logical_replica_count {count.shape}"
        )
    num_logical = log2phy.shape[1]
    if log2phy.shape[2] != num_physical - num_logical + 1:
        raise InvalidInputError(
            f"vllm: logical_to_physical_map: expected {num_physical - num_logical + 1} columns "
            f"(num_redundant_experts + 1), found {log2phy.shape[2]}"
        )
    for li in range(num_layers):
        for e in range(num_logical):
            slots = [int(p) for p in log2phy[li, e] if p != -1]
            want = [p for p in range(num_physical) if p2l[li, p] == e]
            if slots != want or count[li, e] != len(want):
                raise InvalidInputError(
                    f"vllm: layer {li} expert {e}: logical_to_physical_map {slots} / count {int(count[li, e])} "
                    f"disagree with physical_to_logical_map (slots {want})"
                )
    return p2l



# ---------------------------------------------------------------------------------------------
# vllm-ascend (the Ascend NPU plugin of vLLM): expert_map_path
# ---------------------------------------------------------------------------------------------
def vllm_ascend_expert_map(instance: Instance, placement: Placement) -> dict:
    """The file vllm-ascend's ``expert_map_path`` reads (``vllm_ascend/ops/expert_load_balancer.py``).

    For the vllm-ascend plugin only: vLLM itself has no way to load an expert map (it computes its
    own EPLB maps at run time).  ``ExpertLoadBalancer._expert_file_to_tensor`` reads
    ``moe_layer_count``, ``layer_list[0]["device_count"]`` and, per layer and device, the
    ``device_expert`` list (the experts of that EP rank, local slot order); the layer is looked up
    by position (``moe_instance_id``: the process's MoE layers in model order) and the device by
    the EP rank.  ``layer_id`` and ``device_id`` are written as vllm-ascend's own generator writes
    them.  The same SGLang-like deployment rule applies (one EP group serves every layer), so the
    layouts :func:`sglang_layout_problem` refuses are refused here too.

    Returns
    -------
    dict
        ``{"moe_layer_count": L, "layer_list": [{"layer_id": l, "device_count": ep, "device_list":
        [{"device_id": r, "device_expert": [E / ep expert ids]}]}]}``.
    """
    problem = sglang_layout_problem(instance, placement)
    if problem:
        raise InfeasibleError("vllm-ascend" + problem[len("sglang"):])
    ep, k = instance.parallel.ep, instance.experts_per_rank
    p2l = np.asarray(placement.phy2log, dtype=np.int64)
    return {
        "moe_layer_count": int(p2l.shape[0]),
        "layer_list": [
            {
                "layer_id": li,
                "device_count": ep,
                "device_list": [
                    {"device_id": r, "device_expert": [int(x) for x in row[r * k : (r + 1) * k]]} for r in range(ep)
                ],
            }
            for li, row in enumerate(p2l)
        ],
    }


def parse_vllm_ascend_expert_map(doc: dict | str) -> np.ndarray:
    """(L, P) ``phy2log`` back from a vllm-ascend expert map, read the way its loader reads it."""
    doc = _as_doc(doc, "vllm-ascend expert map")
    try:
        layers = doc["layer_list"]
        count = doc["moe_layer_count"]
        rows = [[e for dev in layer["device_list"] for e in dev["device_expert"]] for layer in layers]
        devices = {len(layer["device_list"]) for layer in layers} | {layers[0]["device_count"]}
    except (KeyError, TypeError, IndexError) as exc:
        raise InvalidInputError(f"vllm-ascend: missing or malformed field {exc}") from None
    if count != len(layers) or len(devices) != 1:
        raise InvalidInputError(
            f"vllm-ascend: moe_layer_count {count} / device_count {sorted(devices)} disagree with layer_list"
        )
    return _int_matrix(rows, "vllm-ascend: device_expert")
