"""Experts -> GPUs inside each class (and group position): balancing expert load per GPU.

The class map fixes the cross-domain cost; inside a *bin* (the slots of one class, and in
group-preserving mode of one group position, with the experts that must fill them) any arrangement
costs the same, so experts are arranged for load balance: longest-processing-time packing
(:func:`solvers.kernels.lpt_pack`, heaviest expert onto the EP rank whose busiest EP group stays
lowest), then swaps of two experts of one bin that lower the busiest rank.  Load is each EP group's
(token, expert) pairs over that group's mean per rank, the evaluator's max/mean, maximised over the
stage's EP groups.
"""

from __future__ import annotations

import numpy as np

from placement.core.model import Instance
from solvers.experts.problem import LayerProblem, group2type_of
from solvers.kernels import lpt_pack

__all__ = ["balance_ranks", "rank_load_ratio", "rank_load_floor", "layer_bins", "rebalanced_within_domains"]


def _position_assignment(problem: LayerProblem, expert2class: np.ndarray) -> np.ndarray:
    """(P,) expert group placed on each group position: groups keep their own position when its type fits."""
    g2t = group2type_of(problem, expert2class)
    assert g2t is not None  # group-preserving mode
    position2type, _, _ = problem.position_types
    P = problem.num_group_positions
    position2group = np.full(P, -1, dtype=np.int64)
    placed = np.zeros(P, dtype=bool)
    for p in range(P):
        if position2type[p] == g2t[p]:
            position2group[p], placed[p] = p, True
    for p in range(P):
        if placed[p]:
            continue
        free = np.flatnonzero((position2group == -1) & (position2type == g2t[p]))
        position2group[free[0]], placed[p] = p, True
    return position2group


def layer_bins(problem: LayerProblem, expert2class: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Sets of slots and the experts that must fill them: per class, and per group position in
    group-preserving mode (an expert group's experts stay in its position)."""
    s2c = problem.slot2class
    bins: list[tuple[np.ndarray, np.ndarray]] = []
    if problem.group_preserving:
        gs = problem.expert_group_size
        p2g = _position_assignment(problem, expert2class)
        for p in range(problem.num_group_positions):
            grp = p2g[p]
            for c in range(problem.num_classes):
                slots = np.arange(p * gs, (p + 1) * gs)
                slots = slots[s2c[slots] == c]
                experts = np.arange(grp * gs, (grp + 1) * gs)
                experts = experts[expert2class[experts] == c]
                if slots.size:
                    bins.append((slots, experts))
    else:
        for c in range(problem.num_classes):
            bins.append((np.flatnonzero(s2c == c), np.flatnonzero(expert2class == c)))
    return bins


def _group_means(problem: LayerProblem) -> np.ndarray:
    """(G,) each EP group's mean (token, expert) pairs per EP rank (1 where the group has none)."""
    total = problem.load.sum(axis=1).astype(np.float64)
    return np.where(total > 0, total / problem.ep, 1.0)


def rank_load_floor(problem: LayerProblem, expert2class: np.ndarray) -> float:
    """A lower bound on the expert load max/mean any balancing can reach for ``expert2class``.

    In each bin some EP rank carries at least the bin's load over its ranks, and at least the bin's
    heaviest expert; over the EP group's mean per rank, worst group.
    """
    epr = problem.experts_per_rank
    mean = _group_means(problem)
    out = 1.0
    for slots, experts in layer_bins(problem, expert2class):
        n_ranks = np.unique(slots // epr).shape[0]
        if experts.size == 0:
            continue
        ld = problem.load[:, experts].astype(np.float64)  # (G, n)
        floor = np.maximum(ld.sum(axis=1) / max(slots.size / epr, n_ranks), ld.max(axis=1)) / mean
        out = max(out, float(floor.max()))
    return out


def _improve_by_swaps(norm: np.ndarray, rank_load: np.ndarray, expert2rank: np.ndarray, bin_of: np.ndarray,
                      max_swaps: int) -> None:
    """Swaps of two experts of one bin that lower the busiest rank (``rank_load``, ``expert2rank`` in place)."""
    for _ in range(max_swaps):
        score = rank_load.max(axis=0)
        r = int(np.argmax(score))
        on_r = np.flatnonzero(expert2rank == r)
        best, best_val = None, score[r] - 1e-9
        for e in on_r:
            others = np.flatnonzero((bin_of == bin_of[e]) & (expert2rank != r))
            if others.size == 0:
                continue
            d = norm[:, others] - norm[:, e : e + 1]  # r gains f, loses e
            new_r = (rank_load[:, r : r + 1] + d).max(axis=0)
            new_o = (rank_load[:, expert2rank[others]] - d).max(axis=0)
            val = np.maximum(new_r, new_o)
            i = int(np.argmin(val))
            if val[i] < best_val:
                best_val, best = val[i], (int(e), int(others[i]))
        if best is None:
            break
        e_, f_ = best
        re, rf = expert2rank[e_], expert2rank[f_]
        rank_load[:, re] += norm[:, f_] - norm[:, e_]
        rank_load[:, rf] += norm[:, e_] - norm[:, f_]
        expert2rank[e_], expert2rank[f_] = rf, re


def balance_ranks(problem: LayerProblem, expert2class: np.ndarray, *, max_swaps: int = 2000) -> np.ndarray:
    """Experts -> slots inside their class (and group position), balancing expert load per GPU.

    Returns
    -------
    (E,) physical slot of each expert (slot ``p`` on EP rank ``p // experts_per_rank``); experts of a
    rank fill its slots in ascending expert id.
    """
    E, epr = problem.num_experts, problem.experts_per_rank
    norm = problem.load / _group_means(problem)[:, None]  # (G, E)
    bins = layer_bins(problem, expert2class)
    rank_load = np.zeros((problem.num_ep_groups, problem.ep))
    expert2rank = np.full(E, -1, dtype=np.int64)
    bin_of = np.full(E, -1, dtype=np.int64)
    for bi, (slots, experts) in enumerate(bins):
        ranks, free = np.unique(slots // epr, return_counts=True)
        pack_of, rank_load[:, ranks] = lpt_pack(norm[:, experts], free, initial_load=rank_load[:, ranks])
        expert2rank[experts] = ranks[pack_of]
        bin_of[experts] = bi
    _improve_by_swaps(norm, rank_load, expert2rank, bin_of, max_swaps)
    # Slots: a rank's experts, ascending, into its slots (which the bins guarantee exist).
    expert2slot = np.empty(E, dtype=np.int64)
    for slots, experts in bins:
        for r in np.unique(slots // epr):
            mine = np.sort(experts[expert2rank[experts] == r])
            expert2slot[mine] = np.sort(slots[slots // epr == r])
    return expert2slot


def rank_load_ratio(problem: LayerProblem, expert2slot: np.ndarray) -> float:
    """Expert load max/mean per GPU, worst EP group of the stage (the evaluator's definition)."""
    r = expert2slot // problem.experts_per_rank
    out = 1.0
    for g in range(problem.num_ep_groups):
        per_rank = np.bincount(r, weights=problem.load[g], minlength=problem.ep)
        if per_rank.mean() > 0:
            out = max(out, float(per_rank.max() / per_rank.mean()))
    return out


def rebalanced_within_domains(instance: Instance, rank2gpu: np.ndarray, phy2log: np.ndarray) -> np.ndarray:
    """(num_moe_layers, E) ``phy2log`` with every expert kept in its class (the EP ranks that share
    an NVLink domain in every EP group of the stage) and each class's experts re-balanced over its
    ranks by :func:`balance_ranks` on a free-map problem (the bins are whole classes).

    Under the ``per_domain`` cost the cross-domain bytes do not change (no expert changes domain);
    the busiest GPU's load can only fall or stay, on the sampled tokens (a layer that re-balancing
    does not improve keeps its map).  The maps may split expert groups over ranks: valid where
    any map is (``apply`` ``runtime``).

    Examples
    --------
    >>> from placement.sources.instances import SPECS, build
    >>> from solvers.default import default_rank2gpu
    >>> inst = build(SPECS["tiny"])
    >>> ident = np.tile(np.arange(inst.model.num_experts), (inst.model.num_moe_layers, 1))
    >>> out = rebalanced_within_domains(inst, default_rank2gpu(inst), ident)
    >>> bool((np.sort(out, axis=1) == ident).all())
    True
    """
    from placement.predict.cost import LayoutIndex
    from solvers.experts.problem import build_layer_problem

    rank2gpu = np.asarray(rank2gpu, dtype=np.int64)
    phy2log = np.asarray(phy2log, dtype=np.int64)
    layout = LayoutIndex(instance, rank2gpu, instance.routing.topk.shape[2])
    out = np.empty_like(phy2log)
    for li in range(instance.model.num_moe_layers):
        problem = build_layer_problem(instance, rank2gpu, li, group_preserving=False, validation_fraction=0.0,
                                      layout=layout)
        expert2class = np.empty(problem.num_experts, dtype=np.int64)
        expert2class[phy2log[li]] = problem.slot2class
        slots = balance_ranks(problem, expert2class)
        # LPT with swaps is a heuristic: a layer it does not improve keeps its map.
        if rank_load_ratio(problem, slots) < rank_load_ratio(problem, np.argsort(phy2log[li])):
            out[li] = np.argsort(slots)
        else:
            out[li] = phy2log[li]
    return out
