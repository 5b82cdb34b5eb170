"""The default layout: what Megatron-Core runs with a sorted host file and an unpermuted checkpoint.

Ranks go onto the available GPUs in sorted order (domain, tray, GPU), so global rank ``r`` runs on
the ``r``-th available GPU; experts stay contiguous (``phy2log`` is the identity in every layer).
"""

from __future__ import annotations

import numpy as np

from placement.core.model import InfeasibleError, Instance, Placement
from solvers.base import SolveOptions, SolveResult, heuristic_result
from solvers.registry import register

__all__ = ["default_rank2gpu", "default_placement", "solve_default"]


def default_rank2gpu(instance: Instance) -> np.ndarray:
    """(world,) the ``r``-th available GPU for rank ``r``.

    Raises
    ------
    InfeasibleError
        When the job needs more GPUs than are available.
    """
    world = instance.parallel.world_size
    free = instance.cluster.available_gpus
    if world > len(free):
        raise InfeasibleError(
            f"the job needs {world} GPUs (tp*cp*dp*pp) but only {len(free)} of the cluster's "
            f"{instance.cluster.num_gpus} are available"
        )
    return free[:world].copy()


def default_placement(instance: Instance) -> Placement:
    L, E = instance.model.num_moe_layers, instance.model.num_experts
    return Placement(default_rank2gpu(instance), np.tile(np.arange(E), (L, 1)))


@register("default")
def solve_default(instance: Instance, options: SolveOptions) -> SolveResult:
    """The default layout (no search)."""
    return heuristic_result(instance, default_placement(instance), "default", group_preserving=True)
