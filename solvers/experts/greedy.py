"""Fast expert -> class maps: a linear proxy cost solved as an assignment, with Lagrangian prices on
the per-class load caps.

The proxy (:func:`solvers.experts.problem.linear_costs`) charges every remote (token, expert) pair:
exact for ``per_pair``, an upper bound for ``per_domain``.  Free mode: one assignment with exact
class capacities (:func:`solvers.kernels.assign_to_counts`).  Group-preserving mode, constructively:
each expert group takes the class make-up of one group position's type (types used exactly as often
as there are positions of that type), its experts choosing classes inside the group; solved exactly
as a two-level assignment, so every map it returns keeps expert groups whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linear_sum_assignment

from solvers.experts.balance import balance_ranks
from solvers.experts.problem import LayerProblem, NetSet, linear_costs, net_crossings
from solvers.experts.swap import SwapSearch
from solvers.kernels import assign_to_counts

__all__ = ["assign_classes", "capped_greedy", "GreedyDomains", "greedy_expert_domains"]


def assign_classes(problem: LayerProblem, cost: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Min-cost expert -> class map for a linear cost ``(E, C)`` under the layer's structure.

    Returns ``(expert2class (E,), group2type (num_groups,) or None)`` (module docstring).
    """
    if not problem.group_preserving:
        e2c, _ = assign_to_counts(cost, problem.class_capacity)
        return e2c, None
    gs = problem.expert_group_size
    P = problem.num_group_positions
    position2type, type_count, _ = problem.position_types
    T = type_count.shape[0]
    sub = np.zeros((P, T))
    sub_maps: dict[tuple[int, int], np.ndarray] = {}
    for p in range(P):
        rows = cost[p * gs : (p + 1) * gs]
        for t in range(T):
            m, v = assign_to_counts(rows, type_count[t])
            sub[p, t], sub_maps[p, t] = v, m
    gi, bi = linear_sum_assignment(sub[:, position2type])  # expert groups onto group positions
    group2type = np.empty(P, dtype=np.int64)
    group2type[gi] = position2type[bi]
    e2c = np.concatenate([sub_maps[p, int(group2type[p])] for p in range(P)])
    return e2c, group2type


def capped_greedy(problem: LayerProblem, cost: np.ndarray, cap: np.ndarray, iterations: int = 30) -> np.ndarray | None:
    """A class map within the load caps: the assignment oracle with Lagrangian load prices.

    Prices rise on classes over their cap until the map fits (subgradient steps); among the maps that
    fit, the one with the smallest proxy cost is returned (None if none fits).
    """
    load = problem.load.astype(np.float64)  # (G, E)
    share = np.maximum(problem.load_share(), 1.0)
    spread = float(np.abs(cost - cost.mean(axis=1, keepdims=True)).mean()) + 1e-9
    unit = spread / max(float(load.mean()), 1e-9)  # proxy crossings per pair
    lam = np.zeros_like(share)
    best, best_cost = None, math.inf
    for it in range(iterations):
        adj = cost + (lam.T @ load).T  # (E, C)
        e2c, _ = assign_classes(problem, adj)
        excess = problem.class_loads(e2c) - cap
        if (excess <= 0).all():
            val = float(cost[np.arange(problem.num_experts), e2c].sum())
            if val < best_cost:
                best, best_cost = e2c, val
            if it == 0:
                break
            lam *= 0.7  # feasible: try cheaper prices
        else:
            lam += unit * (2.0 ** (it / 4.0)) * np.maximum(excess, 0) / share
    return best


@dataclass(frozen=True)
class GreedyDomains:
    """Result of :func:`greedy_expert_domains`.

    expert2class : (E,) class of each expert; classes are the problem's (``problem.class_sig``).
    expert2eprank : (E,) an EP rank for each expert (balanced inside its class).
    crossings : the map's crossings on the nets it was fitted to.
    cost_bytes : the same in bytes per step.
    """

    expert2class: np.ndarray
    expert2eprank: np.ndarray
    crossings: int
    cost_bytes: float


def greedy_expert_domains(
    problem: LayerProblem,
    *,
    nets: NetSet | None = None,
    load_tolerance: float | None = None,
    local_search: bool = False,
) -> GreedyDomains:
    """Fast expert -> domain (class) map of one layer: the proxy assignment, optionally polished.

    Cheap enough to call thousands of times when scoring rank layouts: one assignment (a sort for two
    classes, else a linear assignment over the slots) on top of a ``bincount``.

    Parameters
    ----------
    problem : from :func:`solvers.experts.problem.build_layer_problem`.
    nets : the tokens to fit (default: all sampled tokens).
    load_tolerance : cap each class's load at ``(1 + tol)`` times its share (None: no load cap).
    local_search : polish with exact swap moves (:class:`solvers.experts.swap.SwapSearch`).

    Returns
    -------
    GreedyDomains
    """
    nets = problem.nets_all if nets is None else nets
    if problem.trivial:
        e2c = np.zeros(problem.num_experts, dtype=np.int64)
    else:
        cost = linear_costs(problem, nets)
        capped = None if load_tolerance is None else capped_greedy(problem, cost, problem.load_cap(load_tolerance))
        e2c = assign_classes(problem, cost)[0] if capped is None else capped
        if local_search:
            cap = None if load_tolerance is None else problem.load_cap(load_tolerance)
            e2c = SwapSearch(problem, nets).run(e2c, cap)
    slots = balance_ranks(problem, e2c)
    crossings = net_crossings(nets, e2c, problem.class_sig, problem.cost_mode)
    return GreedyDomains(
        expert2class=e2c,
        expert2eprank=slots // problem.experts_per_rank,
        crossings=crossings,
        cost_bytes=crossings * problem.bytes_per_crossing,
    )
