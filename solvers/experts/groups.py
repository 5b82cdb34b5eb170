"""Group-preserving layers: a branch and bound over group -> position-type assignments.

In group-preserving mode (DeepSeek's group-limited routing, what a checkpoint permutation may do)
whole expert groups move between group positions and experts move only inside their group.  Group
positions with the same class make-up form a *type*; an *assignment* gives every expert group a type
(each type exactly as often as positions of it exist: a multiset permutation).  Maps are built from
assignments, so every map here keeps expert groups whole by construction.

1. Every assignment gets a lower bound: the crossings forced by its groups on single-class types
   (exact for them), refined by a relaxation of its split groups (:func:`_split_bound`).
2. The most promising assignments (lowest bound, below the incumbent) seed the swap search.
3. In increasing bound order, while the bound is below the best map and budget remains, CP-SAT
   solves the assignment's subproblem (whole groups fixed, split groups' experts free, load caps on)
   and replaces its bound by the proved one (or finds a better map).
The result's bound is the minimum over assignments of their bounds (never above the best map).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from solvers.base import SolveOptions
from solvers.experts.budget import StopCheck
from solvers.experts.cpsat_model import run_cpsat
from solvers.experts.problem import (LayerProblem, NetSet, group2type_of, linear_costs, net_crossings, net_pairs,
                                     unique_rows_inverse)
from solvers.experts.swap import SwapSearch
from solvers.experts.tuning import MAX_GROUP_ASSIGNMENTS, MAX_REFINED_ASSIGNMENTS, SUBPROBLEM_MAX_FREE_EXPERTS
from solvers.kernels import assign_to_counts

__all__ = ["GroupSearchResult", "num_group_assignments", "group_search", "multiset_permutations", "touch_nets"]


def multiset_permutations(mult: np.ndarray) -> np.ndarray:
    """(A, sum(mult)) every arrangement of type ``t`` repeated ``mult[t]`` times, lexicographic.

    Examples
    --------
    >>> multiset_permutations(np.array([2, 1])).tolist()
    [[0, 0, 1], [0, 1, 0], [1, 0, 0]]
    """
    out: list[list[int]] = []
    left = [int(m) for m in mult]
    n = sum(left)

    def rec(cur: list[int]) -> None:
        if len(cur) == n:
            out.append(list(cur))
            return
        for t in range(len(left)):
            if left[t]:
                left[t] -= 1
                cur.append(t)
                rec(cur)
                cur.pop()
                left[t] += 1

    rec([])
    return np.array(out, dtype=np.int64).reshape(len(out), n)


def num_group_assignments(problem: LayerProblem) -> int:
    """How many group -> position-type assignments a group-preserving layer has (multinomial)."""
    _, _, mult = problem.position_types
    total = math.factorial(int(mult.sum()))
    for m in mult:
        total //= math.factorial(int(m))
    return total


@dataclass
class GroupSearchResult:
    """best : (E,) best class map found.  crossings : its cost.  bound : proved lower bound over
    all group-preserving maps within the caps.  info : deterministic facts for the details."""

    best: np.ndarray
    crossings: int
    bound: int
    info: dict = field(default_factory=dict)


def _single_class_types(problem: LayerProblem) -> tuple[np.ndarray, np.ndarray]:
    """``(whole (T,) bool, whole_class (T,))``: types whose slots all lie in one class, and that class."""
    _, type_count, _ = problem.position_types
    return (type_count > 0).sum(axis=1) == 1, type_count.argmax(axis=1)


def _forced_costs(problem: LayerProblem, nets: NetSet, assign: np.ndarray, chunk: int = 512) -> np.ndarray:
    """(A,) crossings forced by the single-class groups of every assignment (vectorised in chunks).

    A net of EP group ``g`` pays for domain ``d`` (not its source) as soon as it touches a group whose
    whole type lies in ``d`` for ``g``: ``touch (N, P) @ mask (P, A) > 0``.
    """
    whole, whole_class = _single_class_types(problem)
    touch, t_group, t_src, w = touch_nets(problem, nets)  # exact: the cost depends on nothing else
    P = problem.num_group_positions
    bits = (1 << np.arange(P, dtype=np.int64)) if P <= 62 else None  # touch rows as bit sets (no BLAS)
    out = np.zeros(assign.shape[0])
    for g in range(problem.num_ep_groups):
        sel = t_group == g
        tg, wg, sg = touch[sel], w[sel], t_src[sel]
        tbits = None if bits is None else (tg > 0).astype(np.int64) @ bits
        for d in range(problem.num_domains):
            wd = wg * (sg != d)
            for lo in range(0, assign.shape[0], chunk):
                types = assign[lo: lo + chunk]  # (a, P)
                mask = whole[types] & (problem.class_sig[whole_class[types], g] == d)
                if not mask.any():
                    continue
                if tbits is not None and bits is not None:
                    hit = (tbits[:, None] & (mask.astype(np.int64) @ bits)[None, :]) != 0
                else:
                    hit = (tg @ mask.T.astype(np.float32)) > 0
                out[lo: lo + chunk] += wd @ hit.astype(np.float64)
    return out


def touch_nets(problem: LayerProblem, nets: NetSet) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Nets aggregated by ``(EP group, source, expert groups touched)``: what the crossings forced by
    single-class group positions depend on (an exact aggregation: ``dsv3``-like routing has at most
    ``C(G, groups_per_token)`` touch patterns per source, against up to 10^5 distinct expert sets).

    Returns ``(touch (M, P) float32 0/1, group (M,), src (M,), weight (M,) float64)``, rows sorted
    by key (deterministic).
    """
    N, k = nets.experts.shape
    P = problem.num_group_positions
    touch = np.zeros((N, P), dtype=bool)
    touch[np.repeat(np.arange(N), k), problem.expert2group[nets.experts.reshape(-1)]] = True
    if N == 0:
        return touch.astype(np.float32), nets.group, nets.src, nets.weight.astype(np.float64)
    keys = np.column_stack([nets.group, nets.src, np.packbits(touch, axis=1).astype(np.int64)])
    uniq, inverse = unique_rows_inverse(keys)
    first = np.zeros(uniq.shape[0], dtype=np.int64)
    first[inverse] = np.arange(N)  # a net of each key (they share their touch row)
    weight = np.bincount(inverse, weights=nets.weight.astype(np.float64), minlength=uniq.shape[0])
    return touch[first].astype(np.float32), uniq[:, 0], uniq[:, 1], weight


def _per_group_assignment(problem: LayerProblem, cost: np.ndarray, types: np.ndarray, e2c: np.ndarray,
                          only_split: bool) -> float:
    """Experts of each group (only split-type groups if ``only_split``) into their type's classes,
    exactly, by ``cost`` (E, C); fills ``e2c`` in place and returns the total cost."""
    _, type_count, _ = problem.position_types
    whole, _ = _single_class_types(problem)
    gs = problem.expert_group_size
    total = 0.0
    for p in range(problem.num_group_positions):
        if only_split and whole[types[p]]:
            continue
        sl = slice(p * gs, (p + 1) * gs)
        e2c[sl], v = assign_to_counts(cost[sl], type_count[types[p]])
        total += v
    return total


def _split_bound(problem: LayerProblem, nets: NetSet, types: np.ndarray) -> tuple[float, np.ndarray]:
    """Lower bound of one assignment and the (E,) class map attaining its relaxation.

    Single-class types fix their groups' classes (the crossings they force are exact).  For experts of
    groups on split types, a ``per_domain`` net pays at least the average over its split experts of
    "this expert opens a remote domain not yet forced" (an average is at most the maximum, which is
    at most the OR); this is minimised exactly per group with its type's class counts (load caps
    relaxed).  ``per_pair`` is linear: the bound is the exact optimum without load caps.
    """
    E, C, D = problem.num_experts, problem.num_classes, problem.num_domains
    whole, whole_class = _single_class_types(problem)
    sig, e2g = problem.class_sig, problem.expert2group
    if problem.cost_mode == "per_pair":
        e2c = np.empty(E, dtype=np.int64)
        total = _per_group_assignment(problem, linear_costs(problem, nets), types, e2c, only_split=False)
        return total, e2c
    N = nets.num_nets
    pn, pe = net_pairs(nets)
    w = nets.weight.astype(np.float64)
    e2c = np.where(whole[types[e2g]], whole_class[types[e2g]], -1).astype(np.int64)
    known = e2c[pe] >= 0
    forced = np.zeros((N, D), dtype=bool)
    forced[pn[known], sig[e2c[pe[known]], nets.group[pn[known]]]] = True
    forced[np.arange(N), nets.src] = False
    total = float((forced.sum(axis=1) * w).sum())
    split_pair = ~known
    if split_pair.any():
        spn, spe = pn[split_pair], pe[split_pair]
        ns = np.bincount(spn, minlength=N)
        frac = w[spn] / ns[spn]
        cost = np.zeros((E, C))
        for c in range(C):
            dc = sig[c, nets.group[spn]]
            pay = (dc != nets.src[spn]) & ~forced[spn, dc]
            cost[:, c] = np.bincount(spe, weights=frac * pay, minlength=E)
        total += _per_group_assignment(problem, cost, types, e2c, only_split=True)
    return total, e2c


def _assignment_bounds(problem: LayerProblem, nets: NetSet, assign: np.ndarray, ub: float,
                       max_refine: int = MAX_REFINED_ASSIGNMENTS,
                       cap: np.ndarray | None = None) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """Lower bounds of all assignments: the forced crossings for all of them, refined by
    :func:`_split_bound` for at most ``max_refine`` of those still below ``ub`` (lowest first).
    An unrefined assignment keeps its forced crossings, still a valid (weaker) bound.  An assignment
    with every group on a single-class type has one map, whose crossings are its forced ones
    (exact, no refinement needed); with ``cap`` (G, C) given, such a map over the caps is outside the
    search space (bound infinite).

    Returns ``(lb (A,), maps {a: (E,) relaxation map}`` for the refined ones).
    """
    maps: dict[int, np.ndarray] = {}
    if problem.cost_mode == "per_pair":
        lb = np.zeros(assign.shape[0])
        for a in range(assign.shape[0]):
            lb[a], maps[a] = _split_bound(problem, nets, assign[a])
        return lb, maps
    lb = _forced_costs(problem, nets, assign)
    whole, whole_class = _single_class_types(problem)
    all_whole = whole[assign].all(axis=1)  # (A,) assignments fixing every expert's class
    if cap is not None:  # scalable search (issue 16): exact, no refinement needed for these
        for i in np.flatnonzero(all_whole):
            m = whole_class[assign[i]][problem.expert2group]
            if (problem.class_loads(m) > cap).any():
                lb[i] = math.inf
            else:
                maps[int(i)] = m
    refined = 0
    for a in np.argsort(lb, kind="stable"):
        if lb[a] >= ub or refined >= max_refine:
            break
        if cap is not None and all_whole[a]:
            continue
        refined += 1
        lb[a], maps[int(a)] = _split_bound(problem, nets, assign[a])
    return lb, maps


@dataclass
class _Incumbent:
    """The best map of a group search so far and its crossings."""

    best: np.ndarray
    ub: int


def _restarts(problem: LayerProblem, nets: NetSet, cap: np.ndarray, inc: _Incumbent, lb: np.ndarray,
              maps: dict[int, np.ndarray], order: np.ndarray, restarts: int, stop: StopCheck) -> int:
    """Swap-search restarts from the relaxation maps of the most promising assignments; returns how many."""
    search = SwapSearch(problem, nets)
    # Every type in one class: the maps are the enumerated assignments, exact; no swap or group move
    # leads anywhere the enumeration has not scored (issue 16: skip the search on 10^5 nets).
    exact = bool(_single_class_types(problem)[0].all())
    tried = 0
    for a in order[: 10 * restarts]:
        if tried >= restarts or lb[a] >= inc.ub or int(a) not in maps or stop():
            break
        start = maps[int(a)]
        if (problem.class_loads(start) > cap).any():
            continue
        tried += 1
        m = start if exact else search.run(start, cap, should_stop=stop)
        v = net_crossings(nets, m, problem.class_sig, problem.cost_mode)
        if v < inc.ub:
            inc.best, inc.ub = m, v
    return tried


def _subproblems(problem: LayerProblem, nets: NetSet, cap: np.ndarray, inc: _Incumbent, lb: np.ndarray,
                 maps: dict[int, np.ndarray], assign: np.ndarray, order: np.ndarray, deterministic_time: float,
                 seed: int, stop: StopCheck, options: SolveOptions | None) -> dict:
    """CP-SAT on the assignments' subproblems in bound order (updates ``lb`` and ``inc``); returns facts."""
    _, type_count, _ = problem.position_types
    det_left = float(deterministic_time)
    calls = proved_calls = skipped_large = 0
    g2t_best = group2type_of(problem, inc.best)
    for a in order:
        if lb[a] >= inc.ub or det_left <= 1e-3 or stop():
            break
        types = assign[a]
        whole = (type_count[types] > 0).sum(axis=1) == 1
        fixed = np.where(whole[problem.expert2group], type_count[types].argmax(axis=1)[problem.expert2group], -1)
        if int((fixed < 0).sum()) > SUBPROBLEM_MAX_FREE_EXPERTS or int(a) not in maps:
            skipped_large += 1
            continue
        same_types = g2t_best is not None and np.array_equal(g2t_best, types)
        hint: np.ndarray | None = inc.best if same_types else maps[int(a)]
        if hint is not None and (problem.class_loads(hint) > cap).any():
            hint = None
        det = min(det_left, max(0.25, deterministic_time / 6.0))
        r = run_cpsat(problem, nets, cap, hint, deterministic_time=det, wall_limit_s=max(0.1, stop.wall_left_s()),
                      seed=seed + int(a), fixed=fixed, group2type=types, options=options)
        det_left -= min(det, r.deterministic_time)
        calls += 1
        if r.status == "INFEASIBLE":
            lb[a] = math.inf
            proved_calls += 1
            continue
        if r.bound is not None:
            lb[a] = max(lb[a], r.bound)
        if r.expert2class is not None:
            v = net_crossings(nets, r.expert2class, problem.class_sig, problem.cost_mode)
            if v < inc.ub:
                inc.best, inc.ub = r.expert2class, v
                g2t_best = types.copy()
        if r.status == "OPTIMAL":
            proved_calls += 1
    return {"cpsat_subproblems": calls, "cpsat_subproblems_proved": proved_calls,
            "cpsat_subproblems_too_large": skipped_large,
            "deterministic_time": round(float(deterministic_time) - det_left, 3)}


def group_search(
    problem: LayerProblem,
    nets: NetSet,
    cap: np.ndarray,
    incumbent: np.ndarray,
    *,
    deterministic_time: float,
    seed: int,
    stop: StopCheck,
    restarts: int = 4,
    options: SolveOptions | None = None,
) -> GroupSearchResult | None:
    """Branch and bound over group -> position-type assignments (module docstring).

    Returns None when the layer has more than :data:`~solvers.experts.tuning.MAX_GROUP_ASSIGNMENTS`
    assignments.  ``options`` relays stop requests into CP-SAT (calling process only).
    """
    if num_group_assignments(problem) > MAX_GROUP_ASSIGNMENTS:
        return None
    _, _, mult = problem.position_types
    assign = multiset_permutations(mult)
    inc = _Incumbent(np.array(incumbent, dtype=np.int64),
                     net_crossings(nets, incumbent, problem.class_sig, problem.cost_mode))
    lb, maps = _assignment_bounds(problem, nets, assign, inc.ub, cap=cap)
    order = np.argsort(lb, kind="stable")
    tried = _restarts(problem, nets, cap, inc, lb, maps, order, restarts, stop)
    facts = _subproblems(problem, nets, cap, inc, lb, maps, assign, order, deterministic_time, seed, stop, options)
    bound = int(min(inc.ub, math.ceil(float(np.min(lb)) - 1e-6)))
    info = {
        "assignments": int(len(lb)),
        "below_incumbent": int((lb < inc.ub).sum()),
        "restarts": tried,
        "cpsat_subproblems": facts["cpsat_subproblems"],
        "cpsat_subproblems_proved": facts["cpsat_subproblems_proved"],
        "cpsat_subproblems_too_large": facts["cpsat_subproblems_too_large"],
        "deterministic_time": facts["deterministic_time"],
    }
    return GroupSearchResult(inc.best, inc.ub, bound, info)
