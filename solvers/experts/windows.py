"""Fits over several time-ordered sampled windows: the split, the robust objective and its search.

An instance may hold several sampled windows (``routing.window_tokens``: routing recorded at
successive training steps or checkpoints, oldest first).  ``SolveOptions.fit`` says how a layer's
expert map is fitted to them (one window: all three are today's fit, byte for byte):

``robust`` (default)
    minimise the **worst** window's crossings per token, ``max_w c_w(m) / T_w``;
``mean``
    minimise the crossings summed over the windows (each token counts once: the mean when the
    windows have equal sizes);
``latest``
    fit the latest window only, split by index as a single window is (3/4 fit, 1/4 validation),
    its loads for the caps and the balancing.

The guard (``solvers.experts.layer``, step 3) then judges against the default map on the **latest**
window, held out from the fit: with ``robust`` and ``mean`` the fit part is every window but the
latest and the validation part is the latest; the winner on it (the default, the local search's or
the search's map) is refitted on all windows with the same objective and kept only if it is still
no worse than the default on the latest window.

The robust search (:func:`robust_search`) is a subgradient scheme on the window weights: a weighted
sum of the windows' crossings is what every search of this package minimises, and for any weights
``lambda`` on the simplex ``min_m sum_w lambda_w c_w(m) <= min_m max_w c_w(m)``.  Round 0 searches
the plain token-weighted sum (its bound is a bound on the crossings over all the part's tokens,
which the solve reports); each further round doubles the weight of the window that is worst for the
best map so far and searches again from it.  The best map by (worst window, sum) wins.  Rounds and
their budgets are deterministic (:data:`ROBUST_ROUNDS`).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from solvers.kernels.drift import FREE_FIT_MIN_GAIN_KEPT, SINGLE_WINDOW_GAIN_KEPT, gain_kept  # noqa: F401  (re-exported)
from solvers.experts.problem import FITS, LayerProblem, NetSet, net_crossings, window_parts  # noqa: F401  (re-exported)

__all__ = ["FITS", "ROBUST_ROUNDS", "SINGLE_WINDOW_GAIN_KEPT", "FREE_FIT_MIN_GAIN_KEPT", "gain_kept", "window_parts", "merge_nets", "window_costs", "robust_value",
           "part_windows", "robust_search"]

#: Rounds of the robust search: round 0 (the token-weighted sum) gets half the budget, the others
#: share the rest.
ROBUST_ROUNDS = 3
#: A window's weight is at most this multiple of the lightest one's.
ROBUST_MAX_WEIGHT = 16

SearchFn = Callable[[NetSet, np.ndarray, float, str], tuple["np.ndarray | None", "int | None", bool]]


def merge_nets(parts: Sequence[NetSet], multipliers: Sequence[int]) -> NetSet:
    """One net set standing for ``sum_w multipliers[w] * parts[w]`` (equal keys merged, sorted keys).

    With every multiplier 1 it holds the same nets and weights as aggregating the parts' tokens
    together, so its crossings are the parts' summed.
    """
    keep = [(p, int(m)) for p, m in zip(parts, multipliers) if p.num_nets > 0]
    if not keep:
        return parts[0]
    keys = np.concatenate([np.column_stack([p.group, p.src, p.experts]) for p, _ in keep]).astype(np.int64)
    weight = np.concatenate([p.weight * m for p, m in keep]).astype(np.int64)
    uniq, inverse = np.unique(keys, axis=0, return_inverse=True)
    w = np.bincount(inverse.reshape(-1), weights=weight, minlength=uniq.shape[0])
    return NetSet(
        experts=np.ascontiguousarray(uniq[:, 2:]),
        group=np.ascontiguousarray(uniq[:, 0]),
        src=np.ascontiguousarray(uniq[:, 1]),
        weight=np.rint(w).astype(np.int64),
    )


def window_costs(problem: LayerProblem, windows: Sequence[NetSet], expert2class: np.ndarray) -> np.ndarray:
    """(W,) crossings per sampled token of each window under ``expert2class``."""
    out = np.zeros(len(windows), dtype=np.float64)
    for w, nets in enumerate(windows):
        if nets.num_tokens:
            out[w] = net_crossings(nets, expert2class, problem.class_sig, problem.cost_mode) / nets.num_tokens
    return out


def robust_value(problem: LayerProblem, windows: Sequence[NetSet], expert2class: np.ndarray) -> float:
    """The robust objective: the worst window's crossings per token."""
    return float(window_costs(problem, windows, expert2class).max())


def part_windows(problem: LayerProblem, part: str) -> tuple[NetSet, ...]:
    """The windows of the ``fit`` or ``all`` part of a robust problem (empty: not a robust fit over
    two or more windows, so the part is searched as one net set)."""
    if problem.fit != "robust" or not problem.windows:
        return ()
    ws = problem.windows if part == "all" else problem.windows[: problem.fit_windows]
    return ws if len(ws) >= 2 else ()


def robust_search(
    problem: LayerProblem,
    search: SearchFn,
    windows: Sequence[NetSet],
    incumbent: np.ndarray,
    det: float,
    key: str,
    runs: dict,
) -> tuple[np.ndarray | None, int | None, bool]:
    """The robust search of the module docstring over ``windows`` (at least two).

    ``search(nets, incumbent, det, key)`` is the layer's search (step 1c); ``runs`` (the layer's
    run log) gets one entry per round, ``{key}`` for round 0 and ``{key}_robust{r}`` after it, plus
    ``{key}_robust`` with the weights and the worst window's crossings per token of every round.
    Returns ``(map, bound of round 0 on the summed crossings, proved)``; the map is never worse
    than ``incumbent`` by (worst window, sum).
    """
    weights = [1] * len(windows)
    rounds = max(1, ROBUST_ROUNDS)
    det0 = det * (0.5 if rounds > 1 else 1.0)
    det_rest = (det - det0) / (rounds - 1) if rounds > 1 else 0.0

    def rank(m: np.ndarray) -> tuple[float, float]:
        c = window_costs(problem, windows, m)
        return float(c.max()), float(c.sum())

    best, best_rank = incumbent, rank(incumbent)
    bound0: int | None = None
    proved0 = False
    log: list[dict] = []
    for r in range(rounds):
        nets = merge_nets(windows, weights)
        m, bound, proved = search(nets, best, det0 if r == 0 else det_rest, key if r == 0 else f"{key}_robust{r}")
        if r == 0:
            bound0, proved0 = bound, proved
        entry: dict = {"weights": list(weights)}
        if m is not None:
            rk = rank(m)
            entry["worst_crossings_per_token"] = round(rk[0], 9)
            if rk < best_rank:
                best, best_rank = m, rk
        log.append(entry)
        costs = window_costs(problem, windows, best)
        worst = int(np.argmax(costs))
        if r + 1 < rounds:
            if weights[worst] * 2 > ROBUST_MAX_WEIGHT * min(weights):
                break
            weights = [w * 2 if i == worst else w for i, w in enumerate(weights)]
            g = math.gcd(*weights)
            weights = [w // g for w in weights]
    runs[f"{key}_robust"] = {"rounds": log, "window_crossings_per_token":
                             [round(float(c), 9) for c in window_costs(problem, windows, best)]}
    return best, bound0, proved0
