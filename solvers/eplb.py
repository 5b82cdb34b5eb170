"""DeepSeek EPLB's hierarchical balanced packing, applied within each EP group (a peer, not ours).

DeepSeek's Expert-Parallelism Load Balancer (``rebalance_experts(weight[L, E], num_replicas,
num_groups, num_nodes, num_gpus)``, published with DeepSeek-V3) balances expert load; locality
comes only from keeping whole expert groups on one node.  Implemented here from its published
description (no code copied):

Step 1, groups to nodes: the expert groups, heaviest first, each into the lightest node that still
has room for it, so that every node ends with the same number of groups ("balanced packing").
Step 2, redundant replicas of the heaviest experts: skipped, ``num_replicas = num_experts``, since
training stacks (Megatron-Core, TorchTitan) hold exactly ``E / ep`` experts per rank.
Step 3, experts to GPUs inside each node: balanced packing again, heaviest expert first into the
lightest GPU of its node that still has a free slot, equal counts per GPU.

Mapping onto this package's problem
-----------------------------------
- The rank layout is the default one (:func:`solvers.default.default_rank2gpu`).
- EPLB's "nodes" are the NVLink domains an EP group touches and its "GPUs" are the group's GPUs.
  All EP groups of a pipeline stage share one expert map per layer (expert-data-parallel replicas
  must), so with several EP groups per stage the nodes are the classes of EP ranks that sit in the
  same domain in *every* group of the stage (with one EP group per stage, exactly its domains).
- Load of an expert = its (token, expert) pairs among the layer's sampled tokens
  (``instance.routing.topk``), over all sources of the stage.
- Unequal nodes.  EPLB needs the same number of GPUs per node.  When a group's domains hold unequal
  numbers of its GPUs, the packing is made capacity-proportional: a node's room is its slots
  (GPUs x experts per GPU), "lightest" means lowest load per slot, and a whole expert group goes to
  the lightest node with room for all of it.  This gives each node ``slots / group size`` whole
  groups, EPLB's equal counts when the nodes are equal.  When a node's slots are not a multiple of
  the group size, the groups that fit nowhere whole (the lightest ones, as they come last) are
  split: their experts, heaviest first, go to the lightest node with a free slot.  (EPLB itself
  falls back to its global policy, one balanced packing over all GPUs that ignores nodes, whenever
  ``num_groups % num_nodes != 0``; splitting only the leftover groups keeps more locality, so this
  peer is at least as strong as the published rule on cross-domain bytes.)  A model without
  group-limited routing (``num_groups = 1``) thus gets one split group: load-balanced experts with
  no locality, what EPLB's global policy gives it.
- The resulting expert maps are in general *not* group-preserving (Step 3 mixes groups on GPUs), so
  under group-limited routing they are valid for serving (SGLang, vLLM) but not as a training
  checkpoint permutation; :func:`solve_eplb` reports this in ``SolveResult.group_preserving``
  (computed from the maps by :func:`solvers.kernels.keeps_expert_groups`).
"""

from __future__ import annotations

import numpy as np

from placement.core.model import Instance, Placement
from solvers.base import SolveOptions, SolveResult, heuristic_result
from solvers.default import default_rank2gpu
from solvers.kernels import keeps_expert_groups
from solvers.kernels.balanced import (  # the packing itself is a shared kernel (ours uses it too)
    balanced_packing,
    balanced_phy2log,
    expert_loads,
    hierarchical_packing,
    pack_within_nodes,
    stage_rank_nodes,
)
from solvers.registry import register

__all__ = [
    "balanced_packing",
    "stage_rank_nodes",
    "expert_loads",
    "hierarchical_packing",
    "pack_within_nodes",
    "eplb_phy2log",
    "solve_eplb",
]


def eplb_phy2log(instance: Instance, rank2gpu: np.ndarray) -> np.ndarray:
    """(num_moe_layers, E) EPLB's expert map of every MoE layer for the rank layout ``rank2gpu``
    (:func:`solvers.kernels.balanced.balanced_phy2log`)."""
    return balanced_phy2log(instance, rank2gpu)


@register("eplb")
def solve_eplb(instance: Instance, options: SolveOptions) -> SolveResult:
    """DeepSeek EPLB's hierarchical balanced packing on the default rank layout (no search).

    ``options`` are not used: it needs no time limit (milliseconds per layer), and as a peer it does
    not honour consumer or group-preservation requests; the result says whether its maps happen to
    be group-preserving.
    """
    rank2gpu = default_rank2gpu(instance)
    placement = Placement(rank2gpu, eplb_phy2log(instance, rank2gpu))
    return heuristic_result(instance, placement, "eplb", params={"layout": "default", "num_replicas": "num_experts"},
                            group_preserving=keeps_expert_groups(placement.phy2log, instance.model.experts_per_group))
