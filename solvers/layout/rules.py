"""The DeepEP/HybridEP equal-slice rule, as the layout enforces it.

DeepEP's normal kernels and HybridEP address a peer as ``rank == rdma_rank * num_nvl_ranks +
nvl_rank``: every EP group must hold the same number of consecutive EP ranks in each NVLink domain
it touches.  The layout meets it by construction (only equal shapes, parts laid out as consecutive
EP-rank slices); :func:`equal_slice_breaks` checks a given layout (the peers' layouts it starts
from) with this package's own reading of the rule.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from placement.core.model import Instance
from solvers.layout.blocks import Block, free_per_domain, layout_blocks

__all__ = ["equal_slice_breaks", "infeasible_reason", "atoms_in_ep_order", "equal_slices_possible",
           "equal_slice_footprints"]

#: Deterministic-time limit (CP-SAT's own work units, not the clock) of :func:`equal_slices_possible`.
EQUAL_SLICES_DET_LIMIT = 5.0


def equal_slice_breaks(instance: Instance, rank2gpu: np.ndarray) -> list[str]:
    """The EP groups of ``rank2gpu`` that do not hold equal consecutive slices per domain.

    Returns
    -------
    list of one line per offending EP group (empty when the rule holds).
    """
    par = instance.parallel
    dom = instance.cluster.gpu2domain[np.asarray(rank2gpu, dtype=np.int64)]
    out = []
    for s in range(par.pp):
        for gi, ranks in enumerate(par.stage_ep_groups[s]):
            d = dom[ranks]  # (ep,) domain of each EP rank
            starts = np.flatnonzero(np.r_[True, d[1:] != d[:-1]])
            lengths = np.diff(np.r_[starts, len(d)])
            if len(starts) != len(np.unique(d)) or len(np.unique(lengths)) != 1:
                out.append(f"stage {s} EP group {gi}: slices of {lengths.tolist()} EP ranks over domains "
                           f"{d[starts].tolist()}")
    return out


def atoms_in_ep_order(block: Block) -> bool:
    """True when the block's TP x CP groups are consecutive EP ranks (needed to lay a shape's parts
    out as consecutive EP-rank slices), or the block is not one EP group."""
    if block.ep_groups.shape[0] != 1 or block.atoms.shape[0] <= 1:
        return True
    eg = {int(r): k for k, r in enumerate(block.ep_groups[0])}
    return [eg[int(r)] for r in block.ranks] == list(range(block.size))


def infeasible_reason(consumer: str, blocks: Sequence[Block], free: np.ndarray, world: int, num_domains: int) -> str:
    """One line saying why no layout meets the equal-consecutive-slices rule."""
    sizes = sorted({b.size for b in blocks})
    a = blocks[0].atom_size if blocks else 1
    slices = sorted({n // m for n in sizes for m in range(1, num_domains + 1) if n % m == 0 and (n // m) % a == 0},
                    reverse=True)
    msg = (f"consumer {consumer!r}: no layout gives every EP group equal consecutive slices per NVLink domain: "
           f"an EP group of {'/'.join(map(str, sizes))} ranks may take {', '.join(map(str, slices))} GPUs in each "
           f"domain it touches (at most {num_domains} domains)")
    total = int(free.sum())
    if world == total:
        # every free GPU is needed, so every domain must be filled exactly by such slices
        reach = {0}
        for _ in range(max(1, int(free.max()) // max(1, min(slices)) + 1)):
            reach |= {r + v for r in reach for v in slices if r + v <= int(free.max())}
        bad = [int(f) for f in free if int(f) not in reach]
        if bad:
            return (msg + f", the job needs all {total} free GPUs, and {len(bad)} domain(s) with "
                    f"{sorted(set(bad))} free GPUs cannot be filled by such slices")
    return msg + f"; free GPUs per domain {free.tolist()}, the job needs {world}"


def equal_slices_possible(instance: Instance) -> bool:
    """Whether some layout of the free GPUs gives every block equal consecutive slices per domain
    (:func:`equal_slice_footprints` finds one).

    Examples
    --------
    >>> from placement.sources.instances import SPECS, build
    >>> equal_slices_possible(build(SPECS["tiny"]))
    True
    """
    return equal_slice_footprints(instance) is not None


def equal_slice_footprints(instance: Instance, *, moe_only: bool = False,
                           avoid_block: int | None = None) -> list[dict[int, int]] | None:
    """Per block, GPUs per domain of a layout with equal consecutive slices, or None when none exists.

    Each block of ``n`` ranks takes ``m`` distinct domains with ``n / m`` GPUs each (``n / m`` a
    multiple of its TP x CP group size), within every domain's free GPUs; fewest parts first
    (weighted by the block's MoE layers).  A
    small CP-SAT model, solved with one worker and a deterministic-time limit
    (:data:`EQUAL_SLICES_DET_LIMIT`), so the answer never depends on the clock (an undecided model
    counts as impossible).  The layout search under an equal-slice consumer starts from it; the
    solve that follows the instance's dispatcher asks it beforehand whether the rule can hold
    (placement.api.solve).  ``moe_only``: blocks without MoE layers (no all-to-all) take any GPUs,
    split as needed (a free layout's candidate whose MoE stages all run whole HybridEP nodes).
    ``avoid_block``: a block (index) kept in as few parts as possible first (the last stage, which
    also holds the loss and MTP, when it sets the step).
    """
    from ortools.sat.python import cp_model

    blocks = layout_blocks(instance)
    if not all(atoms_in_ep_order(b) for b in blocks):
        return None
    free = free_per_domain(instance)
    num_domains = int(free.shape[0])
    model = cp_model.CpModel()
    use: list[list] = [[] for _ in range(num_domains)]
    choice: list[list[tuple[int, list]]] = []
    parts = []
    for b in blocks:
        a = b.atoms.shape[1]
        if moe_only and len(b.moe_layers) == 0:  # whole atoms anywhere
            take = [model.new_int_var(0, int(free[d]) // a, f"b{b.index}d{d}") for d in range(num_domains)]
            model.add(sum(take) == b.size // a)
            for d, x in enumerate(take):
                use[d].append(a * x)
            choice.append([(a, take)])
            continue
        slices = [b.size // m for m in range(1, num_domains + 1) if b.size % m == 0 and (b.size // m) % a == 0]
        if not slices:
            return None
        pick = {v: model.new_bool_var(f"b{b.index}v{v}") for v in slices}
        model.add_exactly_one(pick.values())
        rows = []
        for v in slices:
            xs = [model.new_bool_var(f"b{b.index}v{v}d{d}") for d in range(num_domains)]
            model.add(sum(xs) == (b.size // v) * pick[v])
            for d, x in enumerate(xs):
                use[d].append(v * x)
            rows.append((v, xs))
            # parts, weighted by the block's MoE layers (and heavily on ``avoid_block``)
            weight = max(1, len(b.moe_layers)) * (100 if b.index == avoid_block else 1)
            parts.append(weight * (b.size // v) * pick[v])
        choice.append(rows)
    for d in range(num_domains):
        model.add(sum(use[d]) <= int(free[d]))
    model.minimize(sum(parts))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    solver.parameters.max_deterministic_time = EQUAL_SLICES_DET_LIMIT
    # The caller owns SIGINT (placement.api.SignalStop): CP-SAT's own handler, installed by default,
    # left SIGINT at its default action after the solve, so a later Ctrl-C killed the process instead
    # of asking for the best placement found so far (tests/test_interrupt.py).
    solver.parameters.catch_sigint_signal = False
    if solver.solve(model) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return [{d: v * int(solver.value(x)) for v, xs in rows for d, x in enumerate(xs) if solver.value(x)}
            for rows in choice]
