"""Pricing of redundant expert slots: the token split the runtime runs, the replicas' gradient sum, memory.

:func:`placement.predict.cost.evaluate` takes a :class:`~placement.core.replicas.ReplicaMap` (``replicas=``) and
prices it with the functions here, so every caller of the evaluator and of the step-time model
(:meth:`placement.predict.performance.StepTimeModel.predict_metrics`) sees the same figures.

Token split (what :mod:`placement.consumers.replica_runtime` runs, ``_replica_index``): static, by arrival
order.  On each source rank, the ``j``-th token routed to logical expert ``e`` (in token index
order) goes to ``log2phy[e, j mod logcnt[e]]``.  :func:`physical_topk` replays exactly that on the
window's tokens, source rank by source rank (the sender of each sampled token is
``LayoutIndex.src_rank``), so every replica receives ``1 / logcnt[e]`` of ``e``'s tokens from every
source (within one token), and the evaluator then counts bytes and loads over physical slots with
its usual node rule (:mod:`placement.core.dispatch`): a replica is one more slot on its EP rank, which is
how HybridEP sees it (one more column of the routing map, Megatron-Core 0.16.1
``megatron/core/transformer/moe/fused_a2a.py``, ``HybridEPDispatch.forward``).  The runtime restarts
its count every micro-batch; the window is replayed as one sequence per source, which differs by at
most one token per (source, expert) and micro-batch.

Gradient sum (:func:`replica_grad_time_s_per_stage`), once per step after the backward pass, as
the runtime runs it (``InstalledReplicas.reduce_grads``, :mod:`placement.consumers.replica_runtime`): each
rank sums its own slots of a replicated expert (FP32, ``expert_params x 4`` bytes) and exchanges
that partial sum point to point with every other rank holding the expert, so with ``h`` holder
GPUs each sends and receives ``(h - 1) x expert_params x 4`` bytes; on NVLink when all the
holders share an NVLink domain, else on the NIC, at the links' spec bandwidths (as the
data-parallel collectives are priced).  It is not overlapped: the runtime runs it before the
data-parallel reduction with ``overlap_grad_reduce=False`` (docs/replicas.md), so the step model
adds it exposed.

Memory (:func:`replica_memory_bytes_per_gpu`): ``N / ep`` extra slots per MoE layer on every GPU,
each :func:`placement.core.replicas.extra_slot_bytes`.
"""

from __future__ import annotations

import numpy as np

from placement.core.model import Instance, InvalidInputError
from placement.core.replicas import GRAD_BYTES_PER_PARAM, ReplicaMap, extra_slot_bytes

__all__ = [
    "physical_topk",
    "check_replica_map",
    "expert_params_or_none",
    "replica_grad_time_s_per_stage",
    "replica_grad_bytes_per_step",
    "replica_memory_bytes_per_gpu",
    "memory_bytes_per_gpu_for_count",
]


def check_replica_map(instance: Instance, rmap: ReplicaMap) -> None:
    """Refuse a map whose shape does not fit ``instance`` (one line naming ``replicas``)."""
    m, ep = instance.model, instance.parallel.ep
    if not isinstance(rmap, ReplicaMap):
        raise InvalidInputError(f"replicas: expected a placement.core.replicas.ReplicaMap, found {type(rmap).__name__}")
    if rmap.num_experts != m.num_experts or rmap.ep != ep or rmap.num_layers != m.num_moe_layers:
        raise InvalidInputError(
            f"replicas: map of {rmap.num_layers} layers x {rmap.num_experts} experts at ep={rmap.ep} does not fit the "
            f"instance ({m.num_moe_layers} MoE layers x {m.num_experts} experts at ep={ep})")
    problems = rmap.problems()
    if problems:
        raise InvalidInputError(problems[0])


def physical_topk(topk: np.ndarray, rmap: ReplicaMap, src_rank: np.ndarray) -> np.ndarray:
    """(L, dp, T, k) physical slot of every (token, expert) under the runtime's arrival-order split.

    Parameters
    ----------
    topk : (L, dp, T, k) logical expert ids of each sampled token.
    rmap : the replica map (L layers, ``E + N`` slots).
    src_rank : (L, dp, T) global rank that sends each token (``LayoutIndex.src_rank`` per layer).

    Returns
    -------
    (L, dp, T, k) int64 slot ids; with no redundant slot, each expert's only slot.
    """
    tk = np.asarray(topk, dtype=np.int64)
    num_layers, dp, tokens, k = tk.shape
    e = rmap.num_experts
    src = np.broadcast_to(np.asarray(src_rank, dtype=np.int64)[..., None], tk.shape)
    out = np.empty(tk.shape, dtype=np.int64)
    log2phy, logcnt = rmap.log2phy, rmap.logcnt
    # Token index order within a source rank: a source's tokens are one dp replica's, in t order, so
    # the flattened (dp, T, k) order is arrival order (a token never routes to one expert twice).
    for li in range(num_layers):
        ex = tk[li].reshape(-1)
        key = src[li].reshape(-1) * e + ex
        order = np.argsort(key, kind="stable")
        sk = key[order]
        starts = np.flatnonzero(np.r_[True, sk[1:] != sk[:-1]])
        run = np.repeat(starts, np.diff(np.r_[starts, len(sk)]))
        occ = np.empty_like(order)
        occ[order] = np.arange(len(sk)) - run  # j: earlier tokens of this (source, expert)
        out[li] = log2phy[li, ex, occ % logcnt[li, ex]].reshape(dp, tokens, k)
    return out


def expert_params_or_none(instance: Instance) -> int | None:
    """Parameters of one routed expert (:func:`placement.core.movecount.expert_params`), None when unknown."""
    from placement.core.movecount import expert_params

    try:
        return expert_params(instance)
    except InvalidInputError:
        return None


def _replica_groups(instance: Instance, rmap: ReplicaMap, rank2gpu: np.ndarray):
    """Yield ``(layer, stage, gpus (G, c), one_domain (G,))`` per replicated (layer, expert)."""
    par, cl = instance.parallel, instance.cluster
    groups = par.stage_ep_groups  # (pp, G, ep)
    gpus_of = np.asarray(rank2gpu, dtype=np.int64)[groups]  # (pp, G, ep)
    stage = np.asarray(instance.moe_layer2stage)
    slot2rank = rmap.slot2rank
    for li in range(rmap.num_layers):
        s = int(stage[li])
        for ex in np.flatnonzero(rmap.logcnt[li] > 1):
            slots = rmap.log2phy[li, ex, : rmap.logcnt[li, ex]]
            g = gpus_of[s][:, slot2rank[slots]]  # (G, c)
            doms = cl.gpu2domain[g]
            yield li, s, g, (doms == doms[:, :1]).all(axis=1)


def replica_grad_time_s_per_stage(instance: Instance, rmap: ReplicaMap, rank2gpu: np.ndarray,
                                  expert_params: int | None) -> list[float]:
    """(pp,) seconds per step of the replicas' gradient sum on each stage's busiest GPU (spec links).

    Per replicated (layer, expert) held on ``h`` GPUs of an EP group: each holder sends (and
    receives) its partial sum of ``expert_params x 4`` bytes to the ``h - 1`` others, over NVLink
    (``cluster.nvlink_gbps``) when they share a domain, else over the NIC (``cluster.scaleout_gbps``).
    Each GPU sums its reductions over its stage's layers; the stage takes its busiest GPU.
    Zeros when ``expert_params`` is None (size unknown) or nothing is replicated.
    """
    par, cl = instance.parallel, instance.cluster
    out = np.zeros(par.pp)
    if not expert_params or rmap.num_redundant == 0:
        return [0.0] * par.pp
    size = float(expert_params) * GRAD_BYTES_PER_PARAM
    per_gpu = np.zeros((par.pp, cl.num_gpus))
    for _li, s, g, inside in _replica_groups(instance, rmap, rank2gpu):
        bps = np.where(inside, cl.nvlink_gbps, cl.scaleout_gbps) * 1e9  # (G,)
        for row in range(g.shape[0]):
            holders = np.unique(g[row])  # two slots on one GPU are summed locally
            per_gpu[s, holders] += size * (holders.size - 1) / bps[row]
    out = per_gpu.max(axis=1)
    return [float(x) for x in out]


def replica_grad_bytes_per_step(instance: Instance, rmap: ReplicaMap, rank2gpu: np.ndarray,
                                expert_params: int | None) -> tuple[float, float]:
    """``(nvlink_bytes, nic_bytes)`` the replicas' gradient sums send per step, all GPUs together."""
    if not expert_params or rmap.num_redundant == 0:
        return 0.0, 0.0
    size = float(expert_params) * GRAD_BYTES_PER_PARAM
    nvl = nic = 0.0
    for _li, _s, g, inside in _replica_groups(instance, rmap, rank2gpu):
        for row in range(g.shape[0]):
            h = np.unique(g[row]).size
            sent = size * h * (h - 1)  # every holder to every other
            if inside[row]:
                nvl += sent
            else:
                nic += sent
    return nvl, nic


def replica_memory_bytes_per_gpu(instance: Instance, rmap: ReplicaMap, expert_params: int | None) -> float:
    """Bytes the redundant slots add to the fullest GPU: its stage's replicated MoE layers x ``N / ep``
    slots x :func:`placement.core.replicas.extra_slot_bytes` (optimizer share over expert-DP); NaN when
    the expert size is unknown."""
    if rmap.num_redundant == 0:
        return 0.0
    if not expert_params:
        return float("nan")
    par = instance.parallel
    layers = np.bincount(np.asarray(instance.moe_layer2stage), minlength=par.pp).max()
    per_slot = extra_slot_bytes(expert_params, par.ep_groups_per_stage)
    return float(layers * (rmap.num_redundant // par.ep) * per_slot)


def memory_bytes_per_gpu_for_count(instance: Instance, redundant_experts: int, expert_params: int | None) -> float:
    """Bytes ``redundant_experts`` slots per MoE layer add to the fullest GPU, before any map is chosen:
    the same figure as :func:`replica_memory_bytes_per_gpu` (which depends on the count only); NaN
    when the expert size is unknown and the count is positive."""
    if redundant_experts == 0:
        return 0.0
    if not expert_params:
        return float("nan")
    par = instance.parallel
    layers = np.bincount(np.asarray(instance.moe_layer2stage), minlength=par.pp).max()
    return float(layers * (redundant_experts // par.ep) * extra_slot_bytes(expert_params, par.ep_groups_per_stage))
