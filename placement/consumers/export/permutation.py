"""Megatron-Core / TorchTitan: the per-MoE-layer expert permutation applied offline to a checkpoint
(:mod:`placement.consumers.checkpoint`), or installed as the dispatch-time map
(:mod:`placement.consumers.runtime`).  Its reader is :func:`placement.core.permutation.parse_expert_permutation`."""

from __future__ import annotations

from typing import Literal

import numpy as np

from placement.core.checker import group_breaks
from placement.core.model import Instance, Placement
from placement.core.permutation import (
    PARAMETER_NAMES,
    PERMUTATION_DIRECTION,
    PERMUTATION_KIND,
    PERMUTATION_VERSION,
    group_fields,
    require_whole_groups,
)


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
