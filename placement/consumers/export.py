"""Exporters: a placement in the files real stacks read, and a reader for each to parse it back.

Every exporter takes the :class:`~placement.core.model.Instance` the placement was solved for and the
:class:`~placement.core.model.Placement` (already passed through :func:`placement.core.checker.check`), and
returns text; :func:`export_file` does the checks and writes the text atomically.  What each stack
reads, and the source files that say so, is in ``docs/formats.md``.

========== ================================================ =====================================
format     what is written                                  consumed by
========== ================================================ =====================================
sglang     ``{"physical_to_logical_map": [L][P]}``, one row  ``--init-expert-location FILE.json``
           per transformer layer (dense rows trivial)
vllm       ``physical_to_logical_map (L, P)``,               vLLM EPLB state (vLLM has no loader:
                                                            for inspection or a plugin)
           ``logical_to_physical_map (L, E, R+1)`` padded
           with -1, ``logical_replica_count (L, E)``; L =
           MoE layers
vllm-      ``moe_layer_count``, ``layer_list`` of            the vllm-ascend plugin's
ascend     ``device_list[r].device_expert``                 ``expert_map_path`` (Ascend NPUs only)
megatron   per MoE layer the permutation ``phy2log``:       :mod:`placement.consumers.checkpoint` applied to
torchtitan new expert slot ``p`` takes old expert              a Megatron-Core / TorchTitan state
           ``phy2log[p]``                                   dict, offline
slurm      one host name per line, line ``i`` = rank ``i``  ``SLURM_HOSTFILE`` with
           (and ``OUT.gpus``: per host CUDA_VISIBLE_DEVICES, ``srun --distribution=arbitrary``
           ``OUT.launch.sh``: :mod:`placement.consumers.launch`)       (or torchrun, where the layout allows)
hybridep   ``sh`` file of ``export NAME=VALUE`` lines        DeepEP HybridEP / Megatron ``flex``
           (value chosen per rank when EP groups differ)
maxtext    mesh axes and shape, the device order as         a ``jax.sharding.Mesh`` built from it;
           (process, local device) pairs, and per MoE       the permutation applied to MaxText's
           layer ``phy2log`` with the tensor paths and      scanned checkpoint
           their expert / layer axes (:mod:`placement.consumers.maxtext`)
========== ================================================ =====================================
"""

from __future__ import annotations

import json
import os
import re
import shlex
import warnings
from pathlib import Path
from typing import Literal

import numpy as np

from placement.core.checker import check, deepep_violations, group_breaks  # noqa: F401 (group_breaks: part of this module's namespace)
from placement.formats import atomic_write_text, read_instance, read_placement
from placement.core.model import InfeasibleError, Instance, InvalidInputError, Placement, PlacementError
from placement.core.permutation import (
    PARAMETER_NAMES,
    PERMUTATION_DIRECTION,
    PERMUTATION_KIND,
    PERMUTATION_VERSION,
    group_fields,
    parse_expert_permutation,
    require_whole_groups,
)

__all__ = [
    "require_placement_of",
    "ExportFormat",
    "LaunchWarning",
    "FORMATS",
    "PERMUTATION_DIRECTION",
    "sglang_expert_location",
    "sglang_layout_problem",
    "parse_sglang_expert_location",
    "vllm_eplb_maps",
    "parse_vllm_eplb_maps",
    "vllm_ascend_expert_map",
    "parse_vllm_ascend_expert_map",
    "expert_permutation",
    "parse_expert_permutation",
    "slurm_hostfile_text",
    "slurm_gpus_text",
    "slurm_gpus_path",
    "parse_slurm_hostfile",
    "parse_slurm_launch",
    "hybridep_rank2n",
    "hybridep_small_node_groups",
    "hybridep_env",
    "hybridep_env_text",
    "parse_hybridep_env_text",
    "parse_env_text",
    "export_text",
    "load_for_export",
    "export_file",
    "export_apply",
]

ExportFormat = Literal["sglang", "vllm", "vllm-ascend", "megatron", "torchtitan", "slurm", "hybridep", "maxtext"]
FORMATS: tuple[ExportFormat, ...] = (
    "sglang", "vllm", "vllm-ascend", "megatron", "torchtitan", "slurm", "hybridep", "maxtext",
)  # fmt: skip
# Formats that can be written from the placement file alone (no layer indices, hosts or domains).
_WITHOUT_INSTANCE: frozenset[str] = frozenset({"vllm"})

class LaunchWarning(UserWarning):
    """The export is complete, but a way of launching it will not work (e.g. torchrun for a layout
    whose hosts hold non-contiguous ranks); the CLI prints it as one ``warning:`` line."""


# ---------------------------------------------------------------------------------------------
# SGLang
# ---------------------------------------------------------------------------------------------
def sglang_expert_location(instance: Instance, placement: Placement) -> dict:
    """The document SGLang's ``--init-expert-location FILE.json`` reads.

    SGLang passes the JSON object as keyword arguments to ``ExpertLocationMetadata.init_by_mapping``,
    so it holds exactly one key.  Its map has one row per transformer layer (SGLang indexes it by
    the decoder layer id, ``num_layers = config.num_hidden_layers``); rows of dense layers are never
    read and hold the trivial map ``p % E``, as SGLang's own ``init_trivial`` does.  MTP MoE layers
    (index ``num_layers + j``) have no row: SGLang runs multi-token prediction as a separate draft
    model, outside this map.

    Returns
    -------
    dict
        ``{"physical_to_logical_map": [[int]]}`` of shape (num_layers, P), ``P = num_experts``
        (no redundant slots: launch with ``--ep-num-redundant-experts 0`` and ``--ep-size`` equal
        to the instance's ``ep``; physical slot ``p`` is on EP rank ``p // (P / ep)``).
    """
    m = instance.model
    p2l = np.asarray(placement.phy2log)
    num_physical = p2l.shape[1]
    rows = np.tile(np.arange(num_physical) % m.num_experts, (m.num_layers, 1))
    decoder = [i for i, layer in enumerate(m.moe_layers) if layer < m.num_layers]
    rows[[m.moe_layers[i] for i in decoder]] = p2l[decoder]
    return {"physical_to_logical_map": rows.tolist()}


def sglang_layout_problem(instance: Instance, placement: Placement) -> str | None:
    """One line saying why SGLang's EP deployment cannot run this layout, or ``None``.

    SGLang serves an EP model as one engine per EP group: ``--tp-size`` = ``--ep-size`` = ``ep``
    (``moe_ep_rank = tp_rank // (tp_size // ep_size)``), attention data-parallel over the same
    ranks, and all of the model's layers on those ranks.  Over several nodes, node ``k`` of an
    engine runs tp ranks ``k*n .. k*n+n-1`` with ``n = tp_size / nnodes``
    (``python/sglang/srt/entrypoints/engine.py``: ``tp_size_per_node``, ``tp_rank_range``; the GPU is
    ``base_gpu_id + local * gpu_id_step`` among the visible ones).  So a layout runs under SGLang
    when ``pp = tp = cp = 1`` and every EP group is equal consecutive runs of EP ranks, one run per
    host.
    """
    par, cl = instance.parallel, instance.cluster
    if par.pp > 1:
        return (
            f"sglang: pp={par.pp}: each MoE layer's map is tuned for the GPUs of its own pipeline stage, but "
            f"SGLang's EP deployment runs every layer on one EP group of {par.ep} GPUs; export a pp=1 instance"
        )
    if par.tp > 1 or par.cp > 1:
        return (
            f"sglang: tp={par.tp} cp={par.cp}: SGLang's EP launch has one attention data-parallel rank per GPU "
            "(--tp-size = --ep-size = ep, --enable-dp-attention) and no counterpart for the instance's TP/CP ranks"
        )
    r2g = np.asarray(placement.rank2gpu)
    for gi, ranks in enumerate(par.stage_ep_groups[0]):
        hosts = [int(cl.gpu2host[int(r2g[r])]) for r in ranks]
        runs: list[list[int]] = []
        for h in hosts:
            if runs and runs[-1][0] == h:
                runs[-1][1] += 1
            else:
                runs.append([h, 1])
        if len(runs) != len({h for h, _ in runs}) or len({n for _, n in runs}) != 1:
            shown = ", ".join(f"{cl.host_name(h)}:{n}" for h, n in runs[:6]) + (" ..." if len(runs) > 6 else "")
            return (
                f"sglang: EP group {gi} runs on hosts (host:consecutive EP ranks) {shown}, but SGLang gives node k "
                "of an engine the EP ranks k*n .. k*n+n-1 (n the same on every node)"
            )
    return None


def parse_sglang_expert_location(doc: dict | str, instance: Instance) -> np.ndarray:
    """(decoder MoE layers, P) ``phy2log`` back from an SGLang expert-location document (MTP
    layers have no row, :func:`sglang_expert_location`).

    Raises
    ------
    InvalidInputError
        When the document is not what SGLang would accept for this model.
    """
    doc = _as_doc(doc, "sglang expert location")
    if set(doc) != {"physical_to_logical_map"}:
        raise InvalidInputError(
            f"sglang: expected exactly the key physical_to_logical_map (SGLang passes the keys to "
            f"init_by_mapping), found {sorted(doc)}"
        )
    m = instance.model
    rows = _int_matrix(doc["physical_to_logical_map"], "sglang: physical_to_logical_map")
    if rows.shape[0] != m.num_layers:
        raise InvalidInputError(
            f"sglang: physical_to_logical_map: expected {m.num_layers} rows (one per transformer "
            f"layer), found {rows.shape[0]}"
        )
    if rows.size and (rows.min() < 0 or rows.max() >= m.num_experts):
        raise InvalidInputError(f"sglang: physical_to_logical_map: expert ids must lie in [0, {m.num_experts})")
    if rows.shape[1] % instance.parallel.ep:
        raise InvalidInputError(
            f"sglang: physical_to_logical_map: {rows.shape[1]} physical slots do not divide over ep={instance.parallel.ep}"
        )
    return rows[[layer for layer in m.moe_layers if layer < m.num_layers]]


# ---------------------------------------------------------------------------------------------
# vLLM
# ---------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------
# Megatron-Core / TorchTitan checkpoint permutation
# ---------------------------------------------------------------------------------------------
def expert_permutation(instance: Instance, placement: Placement, stack: Literal["megatron", "torchtitan"], *,
                       keep_router: bool = False) -> dict:
    """Per MoE layer the permutation to apply offline to a ``stack`` checkpoint.

    Neither Megatron-Core nor TorchTitan reads an expert map: expert ``j`` always lives on EP rank
    ``j // (E / ep)``.  So the placement is realised by renumbering experts in the checkpoint:
    new expert ``p`` takes old expert ``layers[l][p]`` (``phy2log``), for the expert weights, the
    router weight rows and the per-expert bias together (:mod:`placement.consumers.checkpoint`).

    With ``keep_router`` the document is for the dispatch-time map instead (``apply: runtime``: the
    checkpoint moves the experts only, ``keep_router=True``, and :mod:`placement.consumers.runtime` installs the
    same document as its map, logical to physical ids): any permutation is then valid, and the
    document's ``group_preserving`` says whether it keeps groups whole (:mod:`placement.consumers.checkpoint`
    refuses a group-breaking one without ``keep_router``).  The document's ``apply`` field
    (``runtime`` or ``checkpoint``) tells :mod:`placement.consumers.checkpoint` which of the two it is.

    Raises
    ------
    InfeasibleError
        Without ``keep_router``, when the model uses group-limited routing and a layer's permutation
        moves an expert to another group (that would change which experts a token may reach).
    """
    m = instance.model
    p2l = np.asarray(placement.phy2log, dtype=np.int64)
    if keep_router:
        breaks = group_breaks(p2l, m.num_experts, m.num_groups)
    else:
        breaks = require_whole_groups(
            p2l, m, f"{stack}: the model routes within {m.groups_per_token} of {m.num_groups} expert groups, so a "
            f"checkpoint permutation must keep groups whole (or export with --keep-router for the dispatch-time "
            f"map of placement.consumers.runtime)",
        )
    return {
        "kind": PERMUTATION_KIND,
        "version": PERMUTATION_VERSION,
        "stack": stack,
        "direction": PERMUTATION_DIRECTION,
        "apply": "runtime" if keep_router else "checkpoint",
        "instance": {"name": instance.name, "sha256": instance.sha256},
        "num_layers": m.num_layers,
        **({"mtp_num_layers": m.mtp_num_layers} if m.mtp_num_layers else {}),
        **group_fields(instance, breaks),
        "experts_per_rank": instance.experts_per_rank,
        "parameter_names": {k: PARAMETER_NAMES[stack][k] for k in ("router_weight", "rows", "experts")},
        "layers": {str(layer): [int(x) for x in row] for layer, row in zip(m.moe_layers, p2l)},
    }


# ---------------------------------------------------------------------------------------------
# Slurm
# ---------------------------------------------------------------------------------------------
def slurm_hostfile_text(instance: Instance, placement: Placement) -> str:
    """The ``SLURM_HOSTFILE`` for the placement's rank -> GPU map (:func:`placement.consumers.hostfile.slurm_hostfile`)."""
    from placement.consumers.hostfile import slurm_hostfile

    return slurm_hostfile(instance, np.asarray(placement.rank2gpu))


def slurm_gpus_text(instance: Instance, placement: Placement) -> str:
    """``HOST GPU,GPU,...`` lines: per host the ``CUDA_VISIBLE_DEVICES`` its tasks set, so that
    local rank ``j`` runs on the GPU the placement gives the host's ``j``-th rank
    (:func:`placement.consumers.hostfile.cuda_visible_devices_file`; written beside the hostfile)."""
    from placement.consumers.hostfile import cuda_visible_devices_file

    return cuda_visible_devices_file(instance, np.asarray(placement.rank2gpu))


def slurm_gpus_path(hostfile_path: str | os.PathLike) -> Path:
    """Where the GPU file goes: the hostfile's path with the suffix ``.gpus``."""
    out = Path(hostfile_path)
    return out.with_suffix(".gpus") if out.suffix else out.with_name(out.name + ".gpus")


def parse_slurm_hostfile(text: str) -> list[str]:
    """Host name of each rank, in rank order (blank lines and ``#`` comments skipped)."""
    hosts = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            hosts.append(line)
    return hosts


def parse_slurm_launch(hostfile_text: str, gpus_text: str, instance: Instance) -> np.ndarray:
    """(world,) ``rank2gpu`` that a launch with these two files produces.

    Slurm gives a host's tasks ``SLURM_LOCALID`` 0, 1, ... in global-rank order; local rank ``j``
    uses the ``j``-th entry of its host's ``CUDA_VISIBLE_DEVICES``.
    """
    cl = instance.cluster
    host_ids = {cl.host_name(h): h for h in range(cl.num_domains * cl.trays_per_domain)}
    hosts = parse_slurm_hostfile(hostfile_text)
    visible: dict[str, list[int]] = {}
    for n, line in enumerate(gpus_text.splitlines(), 1):
        if not line.strip():
            continue
        name, _, devices = line.strip().partition(" ")
        try:
            visible[name] = [int(x) for x in devices.split(",")]
        except ValueError:
            raise InvalidInputError(f"gpus file: line {n}: expected 'HOST GPU,GPU,...', found {line!r}") from None
    taken: dict[str, int] = {}
    rank2gpu = []
    for r, name in enumerate(hosts):
        if name not in host_ids:
            raise InvalidInputError(f"hostfile: line {r + 1}: unknown host {name!r}")
        j = taken.get(name, 0)
        taken[name] = j + 1
        host_gpus = visible.get(name, list(range(cl.gpus_per_tray)))
        if j >= len(host_gpus):
            raise InvalidInputError(f"hostfile: host {name} runs {j + 1} ranks but has {len(host_gpus)} visible GPUs")
        rank2gpu.append(host_ids[name] * cl.gpus_per_tray + host_gpus[j])
    return np.asarray(rank2gpu, dtype=np.int64)


# ---------------------------------------------------------------------------------------------
# HybridEP / DeepEP
# ---------------------------------------------------------------------------------------------
def hybridep_rank2n(instance: Instance, placement: Placement) -> np.ndarray:
    """(world,) ``NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN`` for each global rank's EP group.

    HybridEP numbers the ranks of an EP group ``local = rank % n``, ``node = rank // n``
    (deepseek-ai/DeepEP hybrid-ep @94a9f8f, ``deep_ep/hybrid_ep_buffer.py``) and needs every node
    inside one NVLink domain; two nodes talk over RDMA, even inside one domain.  ``n`` is the
    largest such value, the gcd of the group's runs of consecutive EP ranks per domain
    (:func:`placement.core.dispatch.node_size`): a group with equal consecutive slices per domain gets
    its slice; an unequal split (8/56) runs smaller nodes (8), exactly as :func:`placement.predict.cost.evaluate`
    prices it.  Every layout is runnable this way (``n = 1`` at worst).
    """
    from placement.core.dispatch import node_size

    cl, par = instance.cluster, instance.parallel
    rank2n = np.zeros(par.world_size, dtype=np.int64)
    r2g = np.asarray(placement.rank2gpu, dtype=np.int64)
    for s in range(par.pp):
        for ranks in par.stage_ep_groups[s]:
            rank2n[ranks] = node_size(cl.gpu2domain[r2g[ranks]], "hybridep")
    return rank2n


def hybridep_small_node_groups(instance: Instance, placement: Placement) -> list[str]:
    """One line per EP group that HybridEP runs with nodes smaller than its part of a domain."""
    cl, par = instance.cluster, instance.parallel
    rank2n = hybridep_rank2n(instance, placement)
    out = []
    r2g = np.asarray(placement.rank2gpu, dtype=np.int64)
    for s in range(par.pp):
        for gi, ranks in enumerate(par.stage_ep_groups[s]):
            doms = cl.gpu2domain[r2g[ranks]]
            n = int(rank2n[ranks[0]])
            counts = np.unique(doms, return_counts=True)[1]
            if (counts != n).any():
                out.append(f"stage {s} EP group {gi}: {counts.tolist()} ranks per domain, nodes of {n}")
    return out


def hybridep_env(instance: Instance, placement: Placement, rank: int | None = None) -> dict[str, str]:
    """The environment HybridEP reads, for one global ``rank`` (or for all, when they agree).

    ``NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN`` (current DeepEP and Megatron-Core), ``USE_MNNVL``
    (1 when an NVLink domain spans several trays: fabric memory handles), ``NVLINK_DOMAIN_SIZE``
    (GPUs per NVLink domain, read by earlier HybridEP versions).

    Raises
    ------
    InfeasibleError
        ``rank`` is None and the EP groups need different values (use :func:`hybridep_env_text`,
        which chooses by rank).
    """
    rank2n = hybridep_rank2n(instance, placement)
    if rank is None:
        values = sorted(set(rank2n.tolist()))
        if len(values) > 1:
            raise InfeasibleError(
                f"hybridep: EP groups need different NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN values {values}: "
                "give a rank, or write the per-rank file"
            )
        n = values[0]
    else:
        n = int(rank2n[rank])
    cl = instance.cluster
    return {
        "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN": str(n),
        "USE_MNNVL": "1" if cl.trays_per_domain > 1 else "0",
        "NVLINK_DOMAIN_SIZE": str(cl.gpus_per_domain),
    }


_PER_RANK_LIST = "_placement_hybrid_ep_n"


def hybridep_env_text(instance: Instance, placement: Placement) -> str:
    """A POSIX ``sh`` file to source: :func:`hybridep_env` of every rank.

    When every EP group needs the same value the file is plain ``export NAME=VALUE`` lines (source
    it before the launch).  Otherwise the value is chosen from a per-rank list by the global rank
    (``RANK``, else ``SLURM_PROCID``): source it inside each task.
    """
    rank2n = hybridep_rank2n(instance, placement)
    values = sorted(set(rank2n.tolist()))
    par = instance.parallel
    head = f"# HybridEP layout for instance {instance.name} (sha256 {instance.sha256[:16]}...), written by placement export"
    env = hybridep_env(instance, placement, rank=0)
    small = hybridep_small_node_groups(instance, placement)
    if small:
        head += (f"\n# {len(small)} EP group(s) run nodes smaller than their part of an NVLink domain (RDMA between "
                 f"nodes of one domain), e.g. {small[0]}")
    if len(values) == 1:
        lines = [head, f"# every EP group (ep={par.ep}) runs {par.ep // values[0]} node(s) of {values[0]} consecutive EP ranks, "
                 "each node inside one NVLink domain"]
        lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
        return "\n".join(lines) + "\n"
    lines = [
        head,
        f"# EP groups (ep={par.ep}) hold {' or '.join(map(str, values))} consecutive EP ranks per NVLink domain, so the",
        "# value depends on the global rank: source this file inside each task, once RANK or SLURM_PROCID is set,",
        "# e.g. srun ... sh -c '. ./hybridep.env && exec python train.py ...'",
        f"{_PER_RANK_LIST}='{' '.join(map(str, rank2n.tolist()))}'",
        '_placement_rank="${RANK:-${SLURM_PROCID:?hybridep env: set RANK or SLURM_PROCID}}"',
        "export NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN=\"$(echo \"$" + _PER_RANK_LIST
        + "\" | cut -d ' ' -f \"$((_placement_rank + 1))\")\"",
        f"export USE_MNNVL={env['USE_MNNVL']}",
        f"export NVLINK_DOMAIN_SIZE={env['NVLINK_DOMAIN_SIZE']}",
        f"unset {_PER_RANK_LIST} _placement_rank",
    ]
    return "\n".join(lines) + "\n"


def parse_hybridep_env_text(text: str, rank: int) -> dict[str, str]:
    """The environment :func:`hybridep_env_text`'s file gives global ``rank``."""
    rows = text.splitlines()
    per_rank = [r for r in rows if r.startswith(f"{_PER_RANK_LIST}=")]
    if not per_rank:
        return parse_env_text(text)
    (values,) = shlex.split(per_rank[0].split("=", 1)[1])
    n_of_rank = values.split(" ")
    if not 0 <= rank < len(n_of_rank):
        raise InvalidInputError(f"env: rank {rank} is outside the file's {len(n_of_rank)} ranks")
    plain = [r for r in rows if r.startswith("export ") and "$(" not in r]
    env = parse_env_text("\n".join(plain))
    return {"NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN": n_of_rank[rank], **env}


def parse_env_text(text: str) -> dict[str, str]:
    """``NAME=VALUE`` pairs from lines ``export NAME=VALUE`` (comments and blank lines skipped)."""
    env: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)", line)
        if not m:
            raise InvalidInputError(f"env: line {n}: expected 'export NAME=VALUE', found {line!r}")
        try:
            words = shlex.split(m.group(2))
        except ValueError as exc:
            raise InvalidInputError(f"env: line {n}: {exc}") from None
        if len(words) > 1:
            raise InvalidInputError(f"env: line {n}: expected one value for {m.group(1)}, found {len(words)}")
        env[m.group(1)] = words[0] if words else ""
    return env


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------
def export_text(fmt: str, placement: Placement, instance: Instance | None, *, keep_router: bool | None = None) -> str:
    """The file contents of ``fmt`` for a placement already checked against ``instance``
    (``keep_router``: see :func:`expert_permutation`; megatron and torchtitan only; ``None``: as the
    instance's apply mode says, True for ``runtime``, the default)."""
    if fmt not in FORMATS:
        raise InvalidInputError(f"--format: expected one of {', '.join(FORMATS)}, found {fmt!r}")
    if keep_router is None:
        keep_router = fmt in ("megatron", "torchtitan") and instance is not None and instance.apply_mode == "runtime"
    if keep_router and fmt not in ("megatron", "torchtitan"):
        raise InvalidInputError(f"--keep-router: only for --format megatron or torchtitan, not {fmt}")
    if instance is None:
        if fmt not in _WITHOUT_INSTANCE:
            raise InvalidInputError(f"--instance: format {fmt} needs the instance (layer indices, hosts, domains)")
        p2l = np.asarray(placement.phy2log)
        for li, row in enumerate(p2l):  # without the instance, at least each map must be one
            if sorted(int(x) for x in row) != list(range(p2l.shape[1])):
                raise InvalidInputError(f"phy2log[{li}]: not a permutation of the {p2l.shape[1]} experts")
        return _json_text(vllm_eplb_maps(placement))
    if fmt == "sglang":
        problem = sglang_layout_problem(instance, placement)
        if problem:
            raise InfeasibleError(problem)
        return _json_text(sglang_expert_location(instance, placement))
    if fmt == "vllm":
        return _json_text(vllm_eplb_maps(placement, instance))
    if fmt == "vllm-ascend":
        return _json_text(vllm_ascend_expert_map(instance, placement))
    if fmt in ("megatron", "torchtitan"):
        return _json_text(expert_permutation(instance, placement, fmt, keep_router=keep_router))
    if fmt == "slurm":
        return slurm_hostfile_text(instance, placement)
    if fmt == "maxtext":
        from placement.consumers.maxtext import maxtext_export

        return _json_text(maxtext_export(instance, placement))
    return hybridep_env_text(instance, placement)


def load_for_export(
    placement_path: str | os.PathLike, instance_path: str | os.PathLike | None
) -> tuple[Instance | None, Placement, dict]:
    """Read the placement (and instance), check they belong together and that it is valid.

    Raises
    ------
    InvalidInputError
        On an unreadable file, an instance whose SHA-256 differs from the one the placement names,
        or a placement the checker rejects.
    """
    placement, doc = read_placement(placement_path)
    if instance_path is None:
        return None, placement, doc
    instance = read_instance(instance_path)
    require_placement_of(instance, placement, doc, placement_path, instance_path,
                         advice=": export it against the instance it was solved for")
    if "pipeline_model_parallel_layout" in doc:  # the split the solve chose (placement.predict.pipeline_split)
        from placement.core.pipeline_layout import parse_layout, with_layout

        instance = with_layout(instance, parse_layout(doc["pipeline_model_parallel_layout"]))
    return instance, placement, doc


def require_placement_of(
    instance: Instance, placement: Placement, doc: dict, placement_path: str | os.PathLike,
    instance_path: str | os.PathLike, *, advice: str = "",
) -> None:
    """Check that the placement read from ``placement_path`` (``doc``) was solved for ``instance`` and is valid.

    ``advice`` ends the SHA-256 mismatch message (what the command should be given instead).

    Raises
    ------
    InvalidInputError
        One line: the instance's SHA-256 differs from the one the placement names, or the first
        violation the checker finds (and how many more).
    """
    named = doc["instance"]
    if named["sha256"] != instance.sha256:
        raise InvalidInputError(
            f"{placement_path}: instance.sha256: the placement was made for instance {named['name']!r} "
            f"(sha256 {named['sha256'][:16]}...), but {instance_path} is {instance.name!r} "
            f"(sha256 {instance.sha256[:16]}...){advice}"
        )
    problems = check(instance, placement)
    if problems:
        more = f" (and {len(problems) - 1} more; run placement verify)" if len(problems) > 1 else ""
        raise InvalidInputError(f"{placement_path}: {problems[0]}{more}")


def export_apply(fmt: str, doc: dict, instance: Instance | None, *, apply: str | None = None,
                 keep_router: bool = False) -> str:
    """How the exported map is applied: ``apply`` when given (``keep_router``: ``runtime``), else the
    placement document's ``apply`` (what it was solved for), else the instance's (default ``runtime``).

    Raises
    ------
    InvalidInputError
        An unknown ``apply``, ``keep_router`` with ``apply="checkpoint"``, or ``keep_router`` for a
        format other than megatron or torchtitan.
    """
    from placement.core.model import APPLY_MODES, DEFAULT_APPLY

    if apply is not None and apply not in APPLY_MODES:
        raise InvalidInputError(f"--apply: expected one of {', '.join(APPLY_MODES)}, found {apply!r}")
    if keep_router:
        if fmt not in ("megatron", "torchtitan"):
            raise InvalidInputError(f"--keep-router: only for --format megatron or torchtitan, not {fmt}")
        if apply == "checkpoint":
            raise InvalidInputError("--keep-router: the keep-router permutation is for --apply runtime, not checkpoint")
        return "runtime"
    if apply is not None:
        return apply
    if doc.get("apply") in APPLY_MODES:
        return str(doc["apply"])
    return instance.apply_mode if instance is not None else DEFAULT_APPLY


def export_file(
    fmt: str,
    placement_path: str | os.PathLike,
    output_path: str | os.PathLike,
    instance_path: str | os.PathLike | None = None,
    *,
    keep_router: bool = False,
    apply: str | None = None,
) -> dict[Path, str]:
    """Check, convert and atomically write ``placement_path`` as ``fmt`` to ``output_path``.

    megatron and torchtitan write what the placement's apply mode needs (:func:`export_apply`):
    ``runtime`` a keep-router permutation (the experts move in the checkpoint, the router does not)
    that is also the map :mod:`placement.consumers.runtime` installs; ``checkpoint`` a permutation of router
    and experts together (:func:`expert_permutation`).  ``keep_router`` is the older spelling of
    ``apply="runtime"``.

    ``slurm`` also writes the per-host GPU file (:func:`slurm_gpus_path`) and the launcher script
    (:func:`placement.consumers.launch.launcher_path`, executable) beside the hostfile, and warns with
    :class:`LaunchWarning` when torchrun cannot launch the layout.  Returns ``{path: text}`` of the
    files written.  Raises ``InvalidInputError`` (exit 2) or ``InfeasibleError`` (exit 3: the stack
    cannot take this placement).
    """
    if fmt not in FORMATS:
        raise InvalidInputError(f"--format: expected one of {', '.join(FORMATS)}, found {fmt!r}")
    if instance_path is None and fmt not in _WITHOUT_INSTANCE:
        try:
            _, doc = read_placement(placement_path)
            hint = f" (the placement names instance {doc['instance']['name']!r})"
        except PlacementError:
            hint = ""
        raise InvalidInputError(f"--instance: format {fmt} needs the instance file{hint}")
    out = Path(output_path)
    if fmt == "sglang" and out.suffix != ".json":
        raise InvalidInputError(
            f"-o: {out}: SGLang reads --init-expert-location as a file only when the path ends in .json "
            "(any other string is parsed as inline JSON); name the output *.json"
        )
    instance, placement, doc = load_for_export(placement_path, instance_path)
    placement = _with_replicas(fmt, placement, doc, instance)
    mode = export_apply(fmt, doc, instance, apply=apply, keep_router=keep_router)
    files = {out: export_text(fmt, placement, instance, keep_router=mode == "runtime" and fmt in ("megatron", "torchtitan"))}
    if fmt == "slurm" and instance is not None:
        from placement.consumers.launch import launcher_path, launcher_script, torchrun_problem

        gpus = slurm_gpus_path(out)
        if gpus == out:
            raise InvalidInputError(f"-o: {out} ends in .gpus, the name of the GPU file written beside the hostfile")
        launcher = launcher_path(out)  # never equal to out: it adds ".launch.sh" to the stem
        files[gpus] = slurm_gpus_text(instance, placement)
        files[launcher] = launcher_script(instance, np.asarray(placement.rank2gpu), out.name)
        problem = torchrun_problem(instance, np.asarray(placement.rank2gpu))
        if problem is not None:
            warnings.warn(f"slurm: torchrun cannot launch this layout ({problem}); use the launcher's srun mode",
                          LaunchWarning, stacklevel=2)
    if out.is_dir():
        raise InvalidInputError(f"-o: {out} is a directory")
    if not out.parent.exists():
        raise InvalidInputError(f"-o: folder {out.parent} does not exist")
    for path, text in files.items():
        atomic_write_text(path, text)
        if path.name.endswith(".launch.sh"):
            path.chmod(path.stat().st_mode | ((path.stat().st_mode & 0o444) >> 2))  # executable where readable
    return files


# ---------------------------------------------------------------------------------------------
# Replicas (placement/formats/replicas.py)
# ---------------------------------------------------------------------------------------------
REPLICA_FORMATS = ("sglang", "vllm")


def _with_replicas(fmt: str, placement: Placement, doc: dict, instance: Instance | None) -> Placement:
    """The placement whose ``phy2log`` is the replica map (L, E + N) when ``doc`` has a ``replicas``
    block and ``fmt`` carries replicas (sglang, vllm).  The other formats write the permutation (each
    rank's first ``E / ep`` slots); a training job reads the replica block from the placement file
    (:mod:`placement.consumers.replica_runtime`).  hybridep's file is the rank layout, which replicas do not
    change: HybridEP dispatches the route's (tokens, slots) map column by column with
    ``num_of_experts_per_rank`` columns per rank (Megatron-Core 0.16.1
    ``transformer/moe/fused_a2a.py``, ``HybridEPDispatch.forward``), so a replica is one more column."""
    block = doc.get("replicas")
    if not block or not block.get("num_redundant_experts"):
        return placement
    if fmt not in REPLICA_FORMATS:
        return placement
    from placement.formats.replicas import replica_map_from_document

    if instance is None:
        raise InvalidInputError(f"--instance: {fmt} export of a placement with replicas needs the instance file")
    num_experts, ep = instance.model.num_experts, instance.parallel.ep
    from placement.formats.replicas import replica_violations

    problems = replica_violations(instance, placement, doc)
    if problems:
        raise InvalidInputError(f"placement: {problems[0]}")
    rmap = replica_map_from_document(block, num_experts, ep)
    return Placement(placement.rank2gpu, rmap.phy2log)


# ---------------------------------------------------------------------------------------------
def _json_text(doc: dict) -> str:
    # One line per innermost list keeps large maps readable and diffable.
    return _compact(doc) + "\n"


def _compact(value, indent: int = 0) -> str:
    """JSON with scalars and short rows inline: one line per layer of a map, per key of an object."""
    pad = " " * indent
    if isinstance(value, dict):
        if not value:
            return "{}"
        items = [f"{pad} {json.dumps(str(k))}: {_compact(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if _inline(value):
        return json.dumps(value, separators=(",", ":"), allow_nan=False)
    items = [pad + " " + _compact(v, indent + 1) for v in value]
    return "[\n" + ",\n".join(items) + "\n" + pad + "]"


def _inline(value) -> bool:
    """Scalars, flat lists, and lists of short flat lists (e.g. vLLM's (E, R + 1) per layer)."""
    if not isinstance(value, list):
        return not isinstance(value, dict)
    if all(not isinstance(v, (list, dict)) for v in value):
        return len(value) <= 1 or not any(isinstance(v, str) for v in value)
    return all(isinstance(v, list) and len(v) <= 4 and all(not isinstance(x, (list, dict)) for x in v) for v in value)


def _as_doc(doc: dict | str, what: str) -> dict:
    if isinstance(doc, str):
        try:
            doc = json.loads(doc)
        except json.JSONDecodeError as exc:
            raise InvalidInputError(f"{what}: malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    if not isinstance(doc, dict):
        raise InvalidInputError(f"{what}: expected a JSON object, found {type(doc).__name__}")
    return doc


def _int_matrix(rows, where: str) -> np.ndarray:
    if not isinstance(rows, list) or not rows or not all(isinstance(r, list) for r in rows):
        raise InvalidInputError(f"{where}: expected a non-empty list of rows")
    if len({len(r) for r in rows}) != 1:
        raise InvalidInputError(f"{where}: rows have different lengths")
    if not all(isinstance(x, int) and not isinstance(x, bool) for r in rows for x in r):
        raise InvalidInputError(f"{where}: expected integers")
    return np.asarray(rows, dtype=np.int64)
