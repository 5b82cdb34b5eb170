"""A careful engineer's layout: whole EP groups packed into racks first, the rest spread greedily.

This is the peer a cluster operator gets without an optimizer: ask the scheduler for topology-aware
allocation (Slurm's block topology plugin, one block per NVLink rack) so that each EP group lands in
one rack when a rack has room for it, then place what is left with as few racks per group as
possible.  Experts stay contiguous (``phy2log`` is the identity): only the rank layout changes.

Algorithm
---------
The EP groups (for DeepSeek-V3 on ``dsv3_*`` one EP group is one pipeline stage of 64 ranks) are
taken in (stage, group) order.

1. Whole groups: each group goes into the rack with the fewest free GPUs among those with at least
   ``ep`` free (best fit; ties: lower rack id), on that rack's lowest-numbered free GPUs.  Once no
   rack has room for a whole group, no later group (all have ``ep`` ranks) fits either.
2. The rest: for each leftover group in order, while it still needs GPUs, take the best-fit rack
   for what remains if one has enough free GPUs, otherwise all free GPUs of the rack with the most
   free GPUs (ties: lower rack id); this keeps each group in as few racks as the leftovers allow.

Inside a group, EP ranks go onto its GPUs in sorted GPU order (domain, tray, GPU), so each rack
holds a run of consecutive EP ranks (DeepEP's layout rule then holds whenever the slices happen to
be equal; the peer does not enforce it).
"""

from __future__ import annotations

import numpy as np

from placement.core.model import Instance, Placement
from solvers.base import SolveOptions, SolveResult, heuristic_result
from solvers.default import default_rank2gpu
from solvers.registry import register

__all__ = ["packed_rank2gpu", "packed_placement", "solve_packed"]


def _best_fit(free_count: np.ndarray, need: int) -> int | None:
    """Rack with the fewest free GPUs among those with at least ``need`` (lowest id on ties)."""
    fits = np.flatnonzero(free_count >= need)
    if len(fits) == 0:
        return None
    return int(fits[np.argmin(free_count[fits])])


def packed_rank2gpu(instance: Instance) -> np.ndarray:
    """(world,) GPU of each global rank under the careful engineer's packing (see module notes).

    Raises
    ------
    InfeasibleError
        When the job needs more GPUs than are available.
    """
    default_rank2gpu(instance)  # raises InfeasibleError with the shared message when too few GPUs
    par, cl = instance.parallel, instance.cluster
    ep = par.ep
    free: list[list[int]] = [[] for _ in range(cl.num_domains)]  # free GPU ids per rack, sorted
    for g in cl.available_gpus:
        free[int(cl.gpu2domain[g])].append(int(g))
    groups = par.stage_ep_groups.reshape(-1, ep)  # (pp * G, ep) global ranks in EP-rank order
    rank2gpu = np.full(par.world_size, -1, dtype=np.int64)

    def take(rack: int, n: int) -> list[int]:
        got, free[rack] = free[rack][:n], free[rack][n:]
        return got

    def counts() -> np.ndarray:
        return np.array([len(f) for f in free], dtype=np.int64)

    leftover: list[np.ndarray] = []
    for ranks in groups:  # 1. whole groups, best fit
        rack = _best_fit(counts(), ep)
        if rack is None:
            leftover.append(ranks)
            continue
        rank2gpu[ranks] = take(rack, ep)
    for ranks in leftover:  # 2. the rest, as few racks per group as possible
        gpus: list[int] = []
        while len(gpus) < ep:
            need = ep - len(gpus)
            c = counts()
            rack = _best_fit(c, need)
            if rack is None:
                rack = int(np.argmax(c))  # first maximum: lowest id on ties
            gpus += take(rack, need)
        rank2gpu[ranks] = sorted(gpus)
    return rank2gpu


def packed_placement(instance: Instance) -> Placement:
    """The packed rank layout with contiguous experts (identity ``phy2log``)."""
    m = instance.model
    return Placement(packed_rank2gpu(instance), np.tile(np.arange(m.num_experts), (m.num_moe_layers, 1)))


@register("packed")
def solve_packed(instance: Instance, options: SolveOptions) -> SolveResult:
    """The careful engineer's layout (no search; ``options`` are not used)."""
    return heuristic_result(instance, packed_placement(instance), "packed", group_preserving=True,
                            params={"layout": "packed", "experts": "contiguous"})
