"""Lower bounds on a layer's cross-domain crossings for a fixed rank layout.

What is proved, and how
-----------------------
``per_pair`` with fixed sources: a token pays once per expert hosted outside its source domain, so
the cost of a map is linear in the expert -> class assignment, ``sum_e cost[e, class(e)]`` with
``cost[e, c]`` the sampled (token, e) pairs whose source domain differs from class ``c``'s domain for
the token's EP group.  With exact class capacities this is a transportation problem (experts supply
one unit each, class ``c`` demands ``capacity[c]``).  Its constraint matrix is the incidence matrix of
a bipartite graph, totally unimodular, so the LP optimum is integral and *is* the optimum over all
maps: :func:`transport_optimum` solves it exactly (:func:`solvers.kernels.assign_to_counts`).

Adding the per-class load caps (``sum_e load[g, e] x[e, c] <= cap[g, c]``) breaks total unimodularity:
:func:`per_pair_class_bound` solves that LP with HiGHS and returns its optimum as a lower bound on
every map within the caps (exact when the LP solution happens to be integral, which it reports).
Group-preserving maps are a subset of all maps, so both bounds hold for them too.

``per_domain`` has no such structure (its natural LP relaxation ``y[n, d] >= x[e, c]`` is weak): its
bounds are the search's (CP-SAT's ``best_objective_bound``, the group search's enumeration) and those
of :mod:`solvers.experts.lower_bounds` (a Lagrangian bound on every layer, a group-assignment bound on
group-preserving ones), the largest kept.  :func:`sum_bounds` adds per-layer bounds into a bound for
the whole layout (bytes), if every layer has one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import csr_matrix

from solvers.experts.problem import LayerProblem, NetSet, linear_costs
from solvers.kernels import assign_to_counts

__all__ = ["ClassBound", "transport_optimum", "transport_lp", "per_pair_class_bound", "sum_bounds"]


@dataclass(frozen=True)
class ClassBound:
    """A lower bound on a layer's crossings.

    bound : the LP optimum (crossings, float), or None if the LP could not be solved.
    integral : True when the LP's optimal solution is integral (then it is a feasible optimum).
    expert2class : (E,) the LP's solution rounded to a class per expert (when integral), else None.
    """

    bound: float | None
    integral: bool
    expert2class: np.ndarray | None


def transport_optimum(cost: np.ndarray, capacity: np.ndarray) -> tuple[float, np.ndarray]:
    """Exact min-cost expert -> class map with exact class capacities (the transportation problem).

    Parameters
    ----------
    cost : (E, C) cost of putting expert ``e`` in class ``c``.
    capacity : (C,) slots of each class, summing to ``E``.

    Returns
    -------
    ``(optimum, expert2class (E,))``.

    Examples
    --------
    >>> transport_optimum(np.array([[0., 5.], [1., 0.], [0., 2.]]), np.array([2, 1]))[0]
    0.0
    """
    e2c, total = assign_to_counts(cost, capacity)
    return total, e2c


def _lp(cost: np.ndarray, capacity: np.ndarray, load: np.ndarray | None, cap: np.ndarray | None) -> ClassBound:
    E, C = cost.shape
    nvar = E * C  # x[e, c] at e * C + c
    rows, cols, vals = [], [], []
    b_eq = []
    r = 0
    for e in range(E):  # each expert in exactly one class
        rows += [r] * C
        cols += list(range(e * C, e * C + C))
        vals += [1.0] * C
        b_eq.append(1.0)
        r += 1
    for c in range(C):  # class capacities
        rows += [r] * E
        cols += list(range(c, nvar, C))
        vals += [1.0] * E
        b_eq.append(float(capacity[c]))
        r += 1
    a_eq = csr_matrix((vals, (rows, cols)), shape=(r, nvar))
    a_ub = b_ub = None
    if load is not None and cap is not None:
        G = load.shape[0]
        urows, ucols, uvals, b_ub = [], [], [], []
        for g in range(G):
            for c in range(C):
                urows += [g * C + c] * E
                ucols += list(range(c, nvar, C))
                uvals += [float(v) for v in load[g]]
                b_ub.append(float(cap[g, c]))
        a_ub = csr_matrix((uvals, (urows, ucols)), shape=(G * C, nvar))
    # scipy accepts sparse constraint matrices here; scipy-stubs only lists dense ones.
    res = linprog(cost.reshape(-1), A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=b_eq, bounds=(0.0, 1.0),  # type: ignore[call-overload]
                  method="highs")
    if res.status != 0:
        return ClassBound(None, False, None)
    xs = res.x.reshape(E, C)
    integral = bool(np.all(np.minimum(np.abs(xs), np.abs(1.0 - xs)) < 1e-7))
    return ClassBound(float(res.fun), integral, xs.argmax(axis=1).astype(np.int64) if integral else None)


def transport_lp(cost: np.ndarray, capacity: np.ndarray, load: np.ndarray | None = None,
                 cap: np.ndarray | None = None) -> ClassBound:
    """LP optimum of the expert -> class assignment with linear ``cost`` (E, C), exact class
    ``capacity`` (C,) and, when given, per-EP-group load caps ``load (G, E) @ x[:, c] <= cap[g, c]``.

    A lower bound on every integral assignment within the caps (exact when the LP is integral).
    """
    return _lp(cost, capacity, load, cap)


def per_pair_class_bound(problem: LayerProblem, nets: NetSet, cap: np.ndarray | None) -> ClassBound:
    """Lower bound on a ``per_pair`` layer's crossings on ``nets`` over maps within ``cap``.

    Parameters
    ----------
    problem : a layer in ``per_pair`` cost mode.
    nets : the tokens.
    cap : (G, C) load caps, or None for the pure transportation problem (then the bound is exact).
    """
    if problem.cost_mode != "per_pair":
        raise ValueError("per_pair_class_bound: the layer's cost mode is not per_pair")
    cost = linear_costs(problem, nets)
    if cap is None:
        opt, e2c = transport_optimum(cost, problem.class_capacity)
        return ClassBound(opt, True, e2c)
    return _lp(cost, problem.class_capacity, problem.load, cap)


def sum_bounds(per_layer_bytes: Iterable[float | None]) -> float | None:
    """Sum of per-layer bounds (bytes), or None if any layer has none."""
    total = 0.0
    for b in per_layer_bytes:
        if b is None:
            return None
        total += float(b)
    return total
