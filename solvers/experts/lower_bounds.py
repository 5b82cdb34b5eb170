"""Lower bounds on every layer's ``per_domain`` crossings, in free and group-preserving mode.

A ``per_domain`` net (weight ``w``, EP group ``g``, source domain ``s``, expert set ``S``) pays
``w`` once per remote domain ``d != s`` that holds one of its experts: an OR over its experts.  The
bounds here hold for every map with the layer's exact class capacities (so for every map within
the load caps, and for the default map), and in group-preserving mode for every group-preserving
map; :func:`layer_lower_bound` picks the one that applies (the group-assignment bound where the
assignments can be enumerated, else the Lagrangian bound).

Lagrangian bound (both modes, :func:`lagrangian_bound`)
    ``[S touches d] >= sum_e lam[n, e, d] [e in d]`` for any weights ``lam[n, ., d]`` on the
    simplex over the net's experts (a maximum is at least any average).  With ``lam`` fixed the
    cost is linear in the expert -> class map, and its minimum over exact class capacities is a
    transportation problem solved exactly (:func:`solvers.kernels.assign_to_counts`), once more with
    the load caps as an LP (:mod:`solvers.experts.bounds`).  Every ``lam`` gives a bound; a
    counted number of multiplicative-weights steps on the supergradient moves weight onto the
    experts the last minimiser put in each domain, and the best value is kept.  Its supremum over ``lam`` is the LP relaxation ``y[n, d] >= x[e, c]``, which is
    weak here (an LP spreads every expert thinly over the classes); HiGHS on that LP took 40-155 s
    per ``dsv3_1024`` layer for the same value, so it is not used.

Group-assignment bound (group-preserving mode, :func:`group_assignment_bound`)
    Every group-preserving map gives each expert group a position type (an *assignment*, see
    :mod:`solvers.experts.groups`).  For one assignment, a net touching an expert group on a type
    whose classes all lie in one domain ``d`` (seen from the net's EP group) certainly touches
    ``d``; a net touching a group on a split type touches one domain of that type's set, so each
    such set not met by the forced domains or the source needs one more remote domain, and a
    family of pairwise disjoint unmet sets needs one each (a hitting set is at least a packing).
    Or, per domain ``d``: a net touching a split group ``p`` avoids ``d`` only if its experts of
    ``p`` all sit in the type's slots outside ``d``, so of the weight touching ``p`` with ``d``
    neither forced nor the source, all but what fits there (:func:`_avoid_weights`) pays for ``d``;
    the larger of the two totals counts.  Nets are aggregated by (EP group, source, expert groups touched), so this runs on every
    assignment at once; the lowest ones are then raised by the split-group relaxation of
    :func:`solvers.experts.groups._split_bound`.  The bound is the minimum over all assignments.
    Layers with more than :data:`MAX_BOUND_ASSIGNMENTS` assignments get the Lagrangian bound only.

Budgets are counted in work units (assignments times aggregated nets, dual steps, refinements),
never in seconds, so the same layer gives the same bound on a busy or an idle machine; a deadline
ends the dual steps or the refinements early (still a bound) or the enumeration (then no group
bound), and is reported.  No matrix products: BLAS threads spin on a busy machine (they cost 4x
the CPU here), so products are vector by matrix.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from solvers.experts.bounds import transport_lp
from solvers.experts.groups import _split_bound, multiset_permutations, num_group_assignments
from solvers.experts.problem import LayerProblem, NetSet, net_pairs
from solvers.kernels import assign_to_counts

__all__ = [
    "LowerBound",
    "lagrangian_bound",
    "group_assignment_bound",
    "layer_lower_bound",
    "bound_to_crossings",
    "LAGRANGIAN_STEPS",
    "LAGRANGIAN_STEP",
    "LAGRANGIAN_WORK",
    "MAX_BOUND_ASSIGNMENTS",
    "REFINE_NET_BUDGET",
]

#: Dual steps of the Lagrangian bound (each one transportation solve on ``E x C``): on a
#: ``dsv3_1024`` layer 40 steps reach 1,762 crossings of the LP relaxation's 1,792 (HiGHS, 155 s).
LAGRANGIAN_STEPS = 40
#: Multiplicative-weights step of the Lagrangian bound (0.5 beat 1, 2 and 4 on that layer).
LAGRANGIAN_STEP = 0.5
#: Most group -> position-type assignments the group-assignment bound enumerates.
MAX_BOUND_ASSIGNMENTS = 60_000
#: Work of the Lagrangian bound per layer, in (pair, domain) weight updates: its steps are
#: ``min(LAGRANGIAN_STEPS, LAGRANGIAN_WORK // (pairs * domains))``, at least one.
LAGRANGIAN_WORK = 2_000_000
#: Split-group refinements of the group-assignment bound: at most this many (assignment, net)
#: evaluations per layer (12 assignments of a ``dsv3`` layer's 8,192 nets).  On a ``dsv3_ep256``
#: layer they raise the bound 0.5% (16,544 -> 16,628 crossings) for about 15% more CPU time.
REFINE_NET_BUDGET = 100_000
#: Assignments handled per vectorised chunk.
_CHUNK = 1024


@dataclass(frozen=True)
class LowerBound:
    """A lower bound on a layer's crossings and how it was obtained.

    crossings : float, the bound (round up with :func:`bound_to_crossings` for an integer one).
    info : deterministic facts for the details (every bound computed, in crossings).
    """

    crossings: float
    info: dict = field(default_factory=dict)


def bound_to_crossings(value: float) -> int:
    """The integer bound implied by a float one (crossings are integers), with a tolerance for sums."""
    return int(math.ceil(value - 1e-7 * max(1.0, abs(value))))


# ---------------------------------------------------------------------------------------------
# The Lagrangian bound
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _PairDomains:
    """Every (net, expert) pair with every remote domain of its net.

    pair_net, pair_expert : (P,) the pair's net and expert.
    remote : (P, D) bool, domain ``d`` is remote for the pair's net.
    dom_of_class : (P, C) local domain of class ``c`` seen from the pair's net's EP group.
    weight : (P,) float, the pair's net weight.
    """

    pair_net: np.ndarray
    pair_expert: np.ndarray
    remote: np.ndarray
    dom_of_class: np.ndarray
    weight: np.ndarray


def _pair_domains(problem: LayerProblem, nets: NetSet) -> _PairDomains:
    pn, pe = net_pairs(nets)
    D = problem.num_domains
    remote = np.ones((pn.shape[0], D), dtype=bool)
    remote[np.arange(pn.shape[0]), nets.src[pn]] = False
    dom = problem.class_sig[:, nets.group[pn]].T  # (P, C)
    return _PairDomains(pn, pe, remote, dom, nets.weight[pn].astype(np.float64))


def _class_costs(problem: LayerProblem, pd: _PairDomains, lam: np.ndarray) -> np.ndarray:
    """(E, C) linear costs of the relaxation for weights ``lam`` (P, D)."""
    E, C = problem.num_experts, problem.num_classes
    rows = np.arange(pd.pair_net.shape[0])
    out = np.zeros((E, C))
    for c in range(C):
        d = pd.dom_of_class[:, c]
        v = pd.weight * lam[rows, d] * pd.remote[rows, d]
        out[:, c] = np.bincount(pd.pair_expert, weights=v, minlength=E)
    return out


def lagrangian_bound(problem: LayerProblem, nets: NetSet, cap: np.ndarray | None = None, *,
                     steps: int | None = None, stop: Callable[[], bool] | None = None) -> LowerBound:
    """Lagrangian lower bound on ``per_domain`` crossings of ``nets`` (module docstring).

    Parameters
    ----------
    problem : a ``per_domain`` layer.
    nets : the tokens the bound is about.
    cap : (G, C) load caps: the best weights are evaluated once more with them (an LP on ``E x C``),
        a bound over the maps within the caps only.  None: over every map.
    steps : dual steps; None: from :data:`LAGRANGIAN_WORK` and the layer's size (deterministic).
    stop : called after every step; True ends the steps (the best value so far is still a bound).

    Returns
    -------
    :class:`LowerBound` over every map with exact class capacities (or within ``cap``).
    """
    if problem.cost_mode != "per_domain":
        raise ValueError("lagrangian_bound: the layer's cost mode is not per_domain")
    if nets.num_nets == 0 or problem.trivial:
        return LowerBound(0.0, {"lagrangian_crossings": 0.0, "lagrangian_steps": 0})
    pd = _pair_domains(problem, nets)
    k = np.bincount(pd.pair_net, minlength=nets.num_nets).astype(np.float64)  # experts per net
    P, D = pd.remote.shape
    rows = np.arange(P)
    if steps is None:
        steps = int(min(LAGRANGIAN_STEPS, max(1, LAGRANGIAN_WORK // max(1, P * D))))
    log_lam = np.log(np.repeat((1.0 / k)[:, None], D, axis=1)[pd.pair_net])  # (P, D), uniform start
    best_val, best_lam, best_step, cut = -math.inf, np.exp(log_lam), 0, False
    done = 0
    for t in range(max(1, int(steps))):
        done = t + 1
        lam = np.exp(log_lam)
        for d in range(D):  # each (net, domain) on its simplex
            lam[:, d] /= np.bincount(pd.pair_net, weights=lam[:, d], minlength=nets.num_nets)[pd.pair_net]
        e2c, val = assign_to_counts(_class_costs(problem, pd, lam), problem.class_capacity)
        if val > best_val + 1e-9:
            best_val, best_lam, best_step = val, lam, t
        if stop is not None and stop():
            cut = True
            break
        # Multiplicative weights on the supergradient: more weight on the experts the minimiser
        # put in each domain, step LAGRANGIAN_STEP / sqrt(t + 1).
        hit = np.zeros((P, D))
        hit[rows, pd.dom_of_class[rows, e2c[pd.pair_expert]]] = 1.0
        log_lam = np.log(lam) + LAGRANGIAN_STEP / math.sqrt(t + 1.0) * hit
    info: dict = {"lagrangian_crossings": round(float(best_val), 6), "lagrangian_steps": done,
                  "lagrangian_best_step": int(best_step)}
    if cut:
        info["lagrangian_cut"] = "deadline"
    value = float(best_val)
    if cap is not None:
        lp = transport_lp(_class_costs(problem, pd, best_lam), problem.class_capacity, problem.load, cap)
        info["lagrangian_capped_crossings"] = None if lp.bound is None else round(lp.bound, 6)
        if lp.bound is not None:
            value = max(value, lp.bound)
    return LowerBound(value, info)


# ---------------------------------------------------------------------------------------------
# The group-assignment bound
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _GroupNets:
    """Nets aggregated by (EP group, source, expert groups touched): touch (M, P) bool, group (M,),
    src (M,), weight (M,) float."""

    touch: np.ndarray
    group: np.ndarray
    src: np.ndarray
    weight: np.ndarray


def _bits(rows: np.ndarray) -> np.ndarray:
    """(n,) int64 bit mask of each boolean row of ``rows`` (n, P), P <= 62."""
    return (rows.astype(np.int64) << np.arange(rows.shape[1], dtype=np.int64)[None, :]).sum(axis=1)


def _group_nets(problem: LayerProblem, nets: NetSet) -> _GroupNets:
    N, k = nets.experts.shape
    P = problem.num_group_positions
    touch = np.zeros((N, P), dtype=bool)
    touch[np.repeat(np.arange(N), k), problem.expert2group[nets.experts.reshape(-1)]] = True
    # one int64 key per net: (EP group, source, touched bits), P <= 62 (checked by the caller)
    key = (nets.group * problem.num_domains + nets.src) * (1 << P) + _bits(touch)
    if P > 62 or int(key.max(initial=0)) >= 1 << 62:  # pragma: no cover - the caller refuses P > 62
        raise ValueError("_group_nets: too many group positions for int64 keys")
    uniq, first, inv = np.unique(key, return_index=True, return_inverse=True)
    w = np.bincount(inv.reshape(-1), weights=nets.weight.astype(np.float64), minlength=uniq.shape[0])
    return _GroupNets(touch[first], nets.group[first], nets.src[first], w)


def _type_domains(problem: LayerProblem) -> np.ndarray:
    """(G, T, D) bool: local domains holding slots of position type ``t``, seen from EP group ``g``."""
    _, type_count, _ = problem.position_types
    G, T, D = problem.num_ep_groups, type_count.shape[0], problem.num_domains
    out = np.zeros((G, T, D), dtype=bool)
    for g in range(G):
        for t in range(T):
            out[g, t, problem.class_sig[type_count[t] > 0, g]] = True
    return out


def _avoid_weights(problem: LayerProblem, nets: NetSet) -> np.ndarray:
    """(G, P, T, D) most net weight of EP group ``g`` (sources outside ``d``) touching expert group
    ``p`` that can avoid domain ``d`` when ``p`` lies on position type ``t``.

    Only ``n_out`` slots of type ``t`` lie outside ``d``; a net avoids ``d`` only if its ``m`` experts
    of ``p`` all sit there, and ``[S_p within Q] <= (1/m) sum_{e in S_p} [e in Q]``, so the avoiding
    weight is at most the ``n_out`` largest ``h[e] = sum over nets with e of w / m`` over ``e`` in ``p``.
    """
    _, type_count, _ = problem.position_types
    G, P, T, D = problem.num_ep_groups, problem.num_group_positions, type_count.shape[0], problem.num_domains
    gs, E = problem.expert_group_size, problem.num_experts
    pn, pe = net_pairs(nets)
    pos = problem.expert2group[pe]
    m = np.zeros((nets.num_nets, P))
    np.add.at(m, (pn, pos), 1.0)
    frac = nets.weight[pn] / m[pn, pos]
    out = np.zeros((G, P, T, D))
    for g in range(G):
        for d in range(D):
            sel = (nets.group[pn] == g) & (nets.src[pn] != d)
            h = np.bincount(pe[sel], weights=frac[sel], minlength=E).reshape(P, gs)
            h = -np.sort(-h, axis=1)  # each group's experts, largest first
            top = np.concatenate([np.zeros((P, 1)), np.cumsum(h, axis=1)], axis=1)  # (P, gs + 1)
            for t in range(T):
                n_out = int(type_count[t][problem.class_sig[:, g] != d].sum())
                out[g, :, t, d] = top[:, n_out]
    return out


def _disjoint_families(sets: np.ndarray, limit: int = 64) -> list[tuple[int, ...]]:
    """Families (of size >= 2) of pairwise disjoint rows of ``sets`` (n, D) bool, at most ``limit``."""
    n = sets.shape[0]
    out: list[tuple[int, ...]] = []
    for size in range(2, n + 1):
        found = False
        for fam in itertools.combinations(range(n), size):
            if all(not (sets[a] & sets[b]).any() for a, b in itertools.combinations(fam, 2)):
                out.append(fam)
                found = True
                if len(out) >= limit:
                    return out
        if not found:
            break
    return out


def _forced_and_unmet(problem: LayerProblem, gn: _GroupNets, assign: np.ndarray,
                      avoid: np.ndarray | None = None, stop: Callable[[], bool] | None = None) -> np.ndarray | None:
    """(A,) per assignment: the forced remote domains, plus the larger of two lower bounds on the
    domains split groups add (summed over nets): the packing of unmet split sets, and per domain
    ``d`` the largest over split groups ``p`` of "weight touching ``p`` with ``d`` neither forced nor
    the source, less what can avoid ``d``" (``avoid``, from :func:`_avoid_weights`).

    Expert groups touched and groups on a type are bit masks (at most 62 group positions), so a net
    meets a set of groups when the AND of the masks is non-zero.  None when ``stop`` (polled between
    chunks) says so: a minimum over part of the assignments is no bound.
    """
    tdom = _type_domains(problem)  # (G, T, D)
    A = assign.shape[0]
    D = problem.num_domains
    out = np.zeros(A)
    for g in range(problem.num_ep_groups):
        sel = gn.group == g
        if not sel.any():
            continue
        tb, wg, sg = _bits(gn.touch[sel])[:, None], gn.weight[sel], gn.src[sel]
        wtouch = (gn.touch[sel] * wg[:, None]).T  # (P, m)
        single = tdom[g].sum(axis=1) == 1  # (T,) types on one domain (for this EP group)
        single_dom = tdom[g].argmax(axis=1)
        split = np.flatnonzero(~single)
        families = _disjoint_families(tdom[g, split]) if split.shape[0] > 1 else []
        for lo in range(0, A, _CHUNK):
            if stop is not None and stop():
                return None
            types = assign[lo: lo + _CHUNK]  # (a, P)
            a = types.shape[0]
            covered = []  # per domain (m, a): forced by a single-domain type, or the source
            forced_count = np.zeros((sg.shape[0], a))
            for d in range(D):
                f = (tb & _bits(single[types] & (single_dom[types] == d))[None, :]) != 0
                forced_count += f & (sg[:, None] != d)
                covered.append(f | (sg[:, None] == d))
            unmet = []
            for t in split:
                on_t = (tb & _bits(types == t)[None, :]) != 0  # (m, a) touches a group on type t
                met = np.zeros_like(on_t)
                for dt in np.flatnonzero(tdom[g, t]):
                    met |= covered[int(dt)]
                unmet.append(on_t & ~met)
            extra = np.zeros((sg.shape[0], a))
            if unmet:
                extra = np.maximum(extra, np.any(unmet, axis=0))
                for fam in families:
                    extra = np.maximum(extra, len(fam) * np.all([unmet[i] for i in fam], axis=0))
            by_domain = np.zeros(a)
            if avoid is not None and split.shape[0]:
                best = np.zeros((D, a))  # per domain, the largest excess over split groups
                for d in range(D):
                    on_d = [t for t in split if tdom[g, t, d]]
                    if not on_d:
                        continue
                    unc = ~covered[d]
                    # (P, a) weight touching p with d uncovered (row by row: a matrix product here
                    # would start BLAS threads, which spin on a busy machine)
                    reach = np.stack([wtouch[p] @ unc for p in range(wtouch.shape[0])])
                    for t in on_d:
                        excess = np.where(types.T == t, reach - avoid[g, :, t, d][:, None], 0.0)  # (P, a)
                        best[d] = np.maximum(best[d], excess.max(axis=0))
                by_domain = best.sum(axis=0)
            out[lo: lo + a] += wg @ forced_count + np.maximum(wg @ extra, by_domain)
    return out


@functools.lru_cache(maxsize=8)
def _assignments(mult: tuple[int, ...]) -> np.ndarray:
    """(A, P) every group -> position-type assignment for type multiplicities ``mult`` (read-only,
    cached: the layers of a stage share their position types)."""
    out = multiset_permutations(np.array(mult, dtype=np.int64))
    out.setflags(write=False)
    return out


def group_assignment_bound(problem: LayerProblem, nets: NetSet, *, refine_net_budget: int = REFINE_NET_BUDGET,
                           stop: Callable[[], bool] | None = None) -> LowerBound | None:
    """Lower bound on ``per_domain`` crossings of ``nets`` over every group-preserving map
    (module docstring), or None when the layer has more than :data:`MAX_BOUND_ASSIGNMENTS` assignments
    (or more than 62 group positions) or ``stop`` ended the enumeration.

    Parameters
    ----------
    problem : a group-preserving ``per_domain`` layer.
    nets : the tokens the bound is about.
    refine_net_budget : split-group refinements, in (assignment, net) evaluations.
    stop : polled between chunks of assignments (True: None, no bound) and between refinements
        (True ends them: the bound stays valid, only weaker).
    """
    if not problem.group_preserving or problem.cost_mode != "per_domain":
        raise ValueError("group_assignment_bound: needs a group-preserving per_domain layer")
    n_assign = num_group_assignments(problem)
    if n_assign > MAX_BOUND_ASSIGNMENTS or problem.num_group_positions > 62:  # 62: bit masks in int64
        return None
    if nets.num_nets == 0 or problem.trivial:
        return LowerBound(0.0, {"assignment_crossings": 0.0, "assignments": n_assign})
    assign = _assignments(tuple(int(m) for m in problem.position_types[2]))
    gn = _group_nets(problem, nets)
    lb_or_none = _forced_and_unmet(problem, gn, assign, _avoid_weights(problem, nets), stop)
    if lb_or_none is None:
        return None
    lb = lb_or_none
    first = float(lb.min())
    order = np.argsort(lb, kind="stable")
    max_refine = max(0, int(refine_net_budget) // max(1, nets.num_nets))
    refined, best_refined, cut = 0, math.inf, False
    for a in order:
        if lb[a] >= best_refined:  # every other assignment is at least this high already
            break
        if refined >= max_refine:
            break
        if stop is not None and stop():
            cut = True
            break
        v, _ = _split_bound(problem, nets, assign[a])
        lb[a] = max(lb[a], v)
        best_refined = min(best_refined, lb[a])
        refined += 1
    value = float(lb.min())
    info: dict = {"assignments": n_assign, "aggregated_nets": int(gn.weight.shape[0]),
            "assignment_forced_crossings": round(first, 6), "assignment_refined": refined,
            "assignment_crossings": round(value, 6)}
    if cut:
        info["assignment_refine_cut"] = "deadline"
    return LowerBound(value, info)


# ---------------------------------------------------------------------------------------------
# The layer's bound
# ---------------------------------------------------------------------------------------------
def layer_lower_bound(problem: LayerProblem, nets: NetSet, cap: np.ndarray | None = None, *,
                      refine_net_budget: int = REFINE_NET_BUDGET,
                      stop: Callable[[], bool] | None = None) -> LowerBound:
    """A lower bound on a ``per_domain`` layer's crossings of ``nets``.

    Group-preserving layers with at most :data:`MAX_BOUND_ASSIGNMENTS` assignments: the
    group-assignment bound (on the committed instances 2.6-3x the Lagrangian one, which is then
    not computed); other layers: the Lagrangian bound with the load caps.  Over every map within
    ``cap`` (every map with exact capacities when None); in group-preserving mode over every
    group-preserving map within ``cap``.  The caller adds the default map (a bound over the caps'
    maps is lowered to the default's cost when the default exceeds the caps).

    Parameters
    ----------
    problem, nets, cap : the layer, the tokens, the (G, C) load caps or None.
    refine_net_budget : split-group refinements of the group-assignment bound.
    stop : called between steps and refinements; True ends them (the bound stays valid).
    """
    if problem.cost_mode != "per_domain":
        raise ValueError("layer_lower_bound: the layer's cost mode is not per_domain")
    if problem.trivial or nets.num_nets == 0:
        return LowerBound(0.0, {})
    info: dict = {}
    if problem.group_preserving:
        gb = group_assignment_bound(problem, nets, refine_net_budget=refine_net_budget, stop=stop)
        if gb is not None:  # far above the Lagrangian bound wherever both were measured: that one is skipped
            info.update(gb.info)
            info["lower_bound_crossings"] = round(gb.crossings, 6)
            return LowerBound(gb.crossings, info)
        n_assign = num_group_assignments(problem)
        info["assignments"] = n_assign
        info["assignment_skipped"] = (f"more than {MAX_BOUND_ASSIGNMENTS} assignments" if n_assign > MAX_BOUND_ASSIGNMENTS
                                      or problem.num_group_positions > 62 else "deadline")
    lag = lagrangian_bound(problem, nets, cap, stop=stop)
    value = lag.crossings
    info.update(lag.info)
    info["lower_bound_crossings"] = round(value, 6)
    return LowerBound(value, info)
