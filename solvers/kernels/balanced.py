"""Load-balanced expert maps: EPLB-style hierarchical balanced packing (arrays in, arrays out).

DeepSeek's Expert-Parallelism Load Balancer packs whole expert groups onto nodes by load, then
experts onto the node's GPUs by load (equal counts per GPU, no replicas here).  The peer
:mod:`solvers.eplb` runs it on the default rank layout; ours (:func:`solvers.cpsat.step_time_check`)
adds it, on the solved and the default layout, to the candidates the step-time objective ranks
(cheap balanced starts).  The unequal-node rule and the split of leftover groups are described in
:mod:`solvers.eplb`.
"""

from __future__ import annotations

import numpy as np

from placement.core.model import Instance, InvalidInputError
from solvers.kernels.classes import domain_classes
from solvers.kernels.packing import lpt_pack

__all__ = [
    "balanced_packing",
    "stage_rank_nodes",
    "expert_loads",
    "hierarchical_packing",
    "pack_within_nodes",
    "balanced_phy2log",
]


def balanced_packing(weights: np.ndarray, capacities: np.ndarray) -> np.ndarray:
    """Pack weighted items into packs of fixed item counts, balancing the packs' weight.

    Items go heaviest first (ties: lower index first) into the pack with the lowest weight per unit
    of capacity among the packs that still have room (ties: lower pack index).  With equal
    capacities this is EPLB's ``balanced_packing`` (and classic LPT with a cardinality limit).

    Parameters
    ----------
    weights : (n,) non-negative item weights (e.g. token counts of experts).
    capacities : (m,) positive int, how many items each pack holds; ``sum >= n``.

    Returns
    -------
    (n,) int64 pack index of each item; pack ``j`` receives at most ``capacities[j]`` items.

    Raises
    ------
    InvalidInputError
        When the packs cannot hold the items or a weight is negative.

    Examples
    --------
    >>> balanced_packing(np.array([5, 4, 3, 2, 1, 1]), np.array([3, 3])).tolist()
    [0, 1, 1, 0, 0, 1]
    """
    w = np.asarray(weights, dtype=np.float64)
    cap = np.asarray(capacities, dtype=np.int64)
    if w.ndim != 1 or cap.ndim != 1:
        raise InvalidInputError("balanced_packing: weights and capacities must be 1-D")
    if (w < 0).any():
        raise InvalidInputError("balanced_packing: weights must be non-negative")
    if (cap < 0).any() or int(cap.sum()) < len(w):
        raise InvalidInputError(f"balanced_packing: {len(w)} items do not fit packs of sizes {cap.tolist()}")
    pack_of, _ = lpt_pack(w, cap, rule="per_capacity")  # the shared LPT kernel, EPLB's pack rule
    return pack_of


def stage_rank_nodes(instance: Instance, rank2gpu: np.ndarray, stage: int) -> np.ndarray:
    """EPLB's "nodes" for one pipeline stage: EP ranks grouped by the dispatcher's node in every EP group.

    Two EP ranks share a node when, in each EP group of the stage, they sit in the same node of the
    dispatcher (:mod:`placement.core.dispatch`; the same NVLink domain under an equal-slice layout).  With one EP group per stage the nodes are exactly the domains the group touches.

    Parameters
    ----------
    instance : the problem.
    rank2gpu : (world,) GPU of each global rank.
    stage : pipeline stage index.

    Returns
    -------
    (ep,) int64 node of each EP rank, numbered by first appearance in EP-rank order.
    """
    from placement.core.dispatch import node_labels, node_rule

    groups = instance.parallel.stage_ep_groups[stage]  # (G, ep) global ranks
    domains = instance.cluster.gpu2domain[np.asarray(rank2gpu, dtype=np.int64)[groups]]  # (G, ep)
    # the dispatcher's nodes (placement.core.dispatch): the domains under an equal-slice layout
    return domain_classes(node_labels(domains, node_rule(instance))[0], numbering="first_appearance")[1]


def expert_loads(topk: np.ndarray, num_experts: int) -> np.ndarray:
    """(num_moe_layers, num_experts) (token, expert) pair counts per layer.

    Parameters
    ----------
    topk : (num_moe_layers, dp, tokens_per_source, top_k) expert ids of the sampled tokens.
    num_experts : E.
    """
    num_layers = topk.shape[0]
    flat = topk.reshape(num_layers, -1).astype(np.int64)
    offs = np.arange(num_layers, dtype=np.int64)[:, None] * num_experts
    return np.bincount((flat + offs).reshape(-1), minlength=num_layers * num_experts).reshape(num_layers, num_experts)


def hierarchical_packing(
    load: np.ndarray, num_groups: int, rank2node: np.ndarray, experts_per_rank: int
) -> np.ndarray:
    """One layer of EPLB's hierarchical packing without replicas (see the module notes).

    Parameters
    ----------
    load : (E,) load of each logical expert (token-expert pairs).
    num_groups : expert groups of ``E / num_groups`` contiguous ids (1 = no groups).
    rank2node : (ep,) node of each EP rank (:func:`stage_rank_nodes`).
    experts_per_rank : slots per EP rank; ``ep * experts_per_rank == E``.

    Returns
    -------
    (E,) int64 ``phy2log``: logical expert of each physical slot; slot ``p`` is on EP rank
    ``p // experts_per_rank``; each rank's experts are in increasing id order.
    """
    load = np.asarray(load, dtype=np.float64)
    rank2node = np.asarray(rank2node, dtype=np.int64)
    num_experts = len(load)
    ep = len(rank2node)
    if ep * experts_per_rank != num_experts or num_experts % num_groups:
        raise InvalidInputError(
            f"hierarchical_packing: {num_experts} experts do not fill {ep} ranks x {experts_per_rank} slots "
            f"in {num_groups} equal groups"
        )
    num_nodes = int(rank2node.max()) + 1
    node_slots = np.bincount(rank2node, minlength=num_nodes) * experts_per_rank  # (nodes,)
    group_size = num_experts // num_groups
    group_load = load.reshape(num_groups, group_size).sum(axis=1)

    # Step 1: groups to nodes (capacity-proportional balanced packing; leftover groups split).
    expert2node = np.full(num_experts, -1, dtype=np.int64)
    node_load = np.zeros(num_nodes)
    node_free = node_slots.copy()
    scale = node_slots.astype(np.float64)
    split: list[int] = []
    for g in np.argsort(-group_load, kind="stable"):
        key = np.where(node_free >= group_size, node_load / scale, np.inf)
        n = int(np.argmin(key))
        if not np.isfinite(key[n]):
            split.append(int(g))
            continue
        expert2node[g * group_size : (g + 1) * group_size] = n
        node_load[n] += group_load[g]
        node_free[n] -= group_size
    if split:
        loose = np.concatenate([np.arange(g * group_size, (g + 1) * group_size) for g in split])
        for e in loose[np.argsort(-load[loose], kind="stable")]:
            key = np.where(node_free > 0, node_load / scale, np.inf)
            n = int(np.argmin(key))
            expert2node[e] = n
            node_load[n] += load[e]
            node_free[n] -= 1

    # Step 2 (replicas of the heaviest experts) is the identity: num_replicas == num_experts.

    # Step 3: experts to GPUs (EP ranks) inside each node, equal counts.
    return pack_within_nodes(load, expert2node, rank2node, experts_per_rank)


def pack_within_nodes(
    load: np.ndarray, expert2node: np.ndarray, rank2node: np.ndarray, experts_per_rank: int
) -> np.ndarray:
    """Experts to EP ranks inside each node by balanced packing (EPLB's Step 3; LPT by load).

    Parameters
    ----------
    load : (E,) load of each logical expert.
    expert2node : (E,) node of each expert; node ``n`` must receive exactly
        ``experts_per_rank * (rank2node == n).sum()`` experts.
    rank2node : (ep,) node of each EP rank.
    experts_per_rank : slots per EP rank.

    Returns
    -------
    (E,) int64 ``phy2log``; each rank's experts in increasing id order.

    Raises
    ------
    InvalidInputError
        When a node receives a different number of experts than it has slots.
    """
    load = np.asarray(load, dtype=np.float64)
    expert2node = np.asarray(expert2node, dtype=np.int64)
    rank2node = np.asarray(rank2node, dtype=np.int64)
    num_experts = len(load)
    if not np.isin(expert2node, rank2node).all():
        raise InvalidInputError("pack_within_nodes: an expert is on a node without EP ranks")
    expert2rank = np.empty(num_experts, dtype=np.int64)
    for n in np.unique(rank2node):
        experts = np.flatnonzero(expert2node == n)
        ranks = np.flatnonzero(rank2node == n)
        if len(experts) != len(ranks) * experts_per_rank:
            raise InvalidInputError(
                f"pack_within_nodes: node {int(n)} got {len(experts)} experts for {len(ranks) * experts_per_rank} slots"
            )
        packs = balanced_packing(load[experts], np.full(len(ranks), experts_per_rank))
        expert2rank[experts] = ranks[packs]
    # Slots: each rank's experts in increasing id order.
    return np.lexsort((np.arange(num_experts), expert2rank)).astype(np.int64)


def balanced_phy2log(instance: Instance, rank2gpu: np.ndarray) -> np.ndarray:
    """(num_moe_layers, E) the hierarchical balanced packing of every MoE layer for the rank layout
    ``rank2gpu`` (loads: the sampled tokens' (token, expert) pairs; nodes: :func:`stage_rank_nodes`)."""
    m = instance.model
    loads = expert_loads(instance.routing.topk, m.num_experts)
    stage_of = instance.moe_layer2stage
    nodes = {int(s): stage_rank_nodes(instance, rank2gpu, int(s)) for s in np.unique(stage_of)}
    return np.stack(
        [
            hierarchical_packing(loads[li], m.num_groups, nodes[int(stage_of[li])], instance.experts_per_rank)
            for li in range(m.num_moe_layers)
        ]
    )
