"""One MoE layer end to end: starts, local search, the layer's search, the validation guard, balancing.

Step 1, experts -> classes (the cross-domain part), on the *fit* tokens:
    a. the greedy (:mod:`solvers.experts.greedy`) at the smallest load tolerance with a feasible map;
    b. the swap search (:class:`solvers.experts.swap.SwapSearch`) from the greedy, the default map,
       the map the rank layout was scored with, in free mode a start that keeps the model's
       expert groups whole, and the multilevel co-activation start
       (:func:`solvers.experts.coarsen.coarsen_start`); in free mode with enumerable group
       positions also the group search's map from the group-keeping start (so a free map is never
       worse on the fit part than the group-preserving search's); the best on the exact fit nets
       of the polished maps and the starts themselves;
    c. the layer's search: group-preserving mode, :func:`solvers.experts.groups.group_search`;
       free mode, the CP-SAT model (:mod:`solvers.experts.cpsat_model`) when its deterministic budget
       fits the model's size, else a seeded iterated local search and then, with a budget of at
       least ``LNS_MIN_DET``, the CP-SAT large-neighbourhood search (:func:`solvers.experts.lns.lns_search`).
Step 2, experts -> GPUs inside each class (and group position): :func:`solvers.experts.balance.balance_ranks`.
Step 3, guard against fitting the sample: each source's sampled tokens are split by index into a
    fit part (the first 3/4) and a validation part (the last 1/4).  The default map, the swap
    search's and the search's maps are judged on the validation part; if an optimised one wins, the
    search runs again on all sampled tokens from it (its bound is then a bound on the sampled
    objective) and its map is kept only if still no worse than the default on the validation part.
    If the default wins, the layer keeps the default's classes (rebalanced).  So a layer's chosen map
    is never worse than the default map on the validation part.

Load caps: each class carries at most ``(1 + tol)`` times its proportional share of every EP group's
(token, expert) pairs; ``tol`` starts at the class load tolerance and is doubled, and reported, only
while no map meets it (never beyond the default map's own excess, which always fits).  Bounds are
over the maps within the caps plus the default map.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

import numpy as np

from placement.core.model import SolverError
from solvers.base import SolveOptions
from solvers.experts.bounds import per_pair_class_bound
from solvers.experts.balance import balance_ranks, rank_load_floor, rank_load_ratio
from solvers.experts.budget import LayerBudget, StopCheck
from solvers.experts.coarsen import coarsen_start, kahypar_start
from solvers.experts.cpsat_model import run_cpsat
from solvers.experts.greedy import capped_greedy
from solvers.experts.lower_bounds import REFINE_NET_BUDGET, bound_to_crossings, layer_lower_bound
from solvers.experts.groups import group_search, num_group_assignments
from solvers.experts.lns import LNS_MIN_DET, lns_search
from solvers.experts.problem import LayerProblem, NetSet, is_structurally_valid, linear_costs, net_crossings, sample_nets
from solvers.experts.swap import SwapSearch, iterated_local_search
from solvers.experts.tuning import CLASS_LOAD_TOLERANCE, CPSAT_DET_PER_LINK, DET_PER_WALL_S, GROUP_START_SHARE, \
    MAX_GROUP_ASSIGNMENTS, USE_KAHYPAR_START
from solvers.experts.windows import part_windows, robust_search, robust_value

__all__ = ["LayerOutcome", "solve_layer"]

SearchResult = tuple["np.ndarray | None", "int | None", bool]  # (map, bound, proved)


@dataclass
class LayerOutcome:
    """One layer's answer.

    expert2slot : (E,) physical slot of each logical expert.
    crossings : on all sampled tokens (-1 until known for a layer left at a fallback map).
    bound : a proved lower bound on ``crossings`` over the search space (maps within the load caps,
        and the default), or None.
    details : JSON-serialisable, deterministic facts (no wall times).
    wall_s : wall seconds spent (not part of any output file).
    """

    layer: int
    expert2slot: np.ndarray
    crossings: int
    bound: int | None
    proved: bool
    details: dict
    wall_s: float = 0.0
    # Move-aware re-placement (solvers/experts/moves.py): the layer's candidate maps, previous first.
    move_frontier: list = field(default_factory=list)


def _tolerance_ladder(problem: LayerProblem, cost: np.ndarray, base: float) -> tuple[float, np.ndarray | None]:
    """The smallest load tolerance (base, 2 base, 4 base, ...) with a feasible greedy map.

    Never looser than the default map's own excess, which is always feasible.  Returns
    ``(tol, greedy map or None when only the default map fits)``.
    """
    default_tol = problem.load_excess(problem.default_expert2class)
    tol = base
    while tol < default_tol:
        e2c = capped_greedy(problem, cost, problem.load_cap(tol))
        if e2c is not None:
            return tol, e2c
        tol *= 2.0
    tol = max(base, default_tol)
    return tol, capped_greedy(problem, cost, problem.load_cap(tol))


def _restarts_for(det: float) -> int:
    """Local-search restarts the group search may make: 2, plus one per 0.1 of deterministic budget
    (the budget is deterministic, so the count is too), at most 12."""
    return int(min(12, 2 + det / 0.1))


def _model_links(problem: LayerProblem, nets: NetSet) -> int:
    """Size of the full CP-SAT model: (net, expert, remote class) links, or (expert, class) terms."""
    if problem.cost_mode == "per_pair":
        return problem.num_experts * problem.num_classes
    remote = (problem.class_sig[:, nets.group] != nets.src[None, :]).sum(axis=0)  # (N,) remote classes
    return int((remote * nets.experts.shape[1]).sum())


@dataclass
class _LayerSearch:
    """The search of one layer (step 1c), run on the fit part and again on all tokens; ``runs`` keeps
    each run's deterministic facts for the details."""

    problem: LayerProblem
    budget: LayerBudget
    cap: np.ndarray
    stop: StopCheck
    options: SolveOptions | None
    runs: dict = field(default_factory=dict)
    _reduced: dict = field(default_factory=dict)  # id(nets) -> (nets, the search's nets)

    def reduced(self, nets: NetSet) -> NetSet:
        """The nets the search works on: ``nets``, or when there are more than the budget's
        ``search_nets``, their seeded unbiased sample (:func:`solvers.experts.problem.sample_nets`).
        Candidates are always scored on the exact nets (:meth:`score`)."""
        limit = self.budget.search_nets
        if limit is None or nets.num_nets <= limit:
            return nets
        if id(nets) not in self._reduced:
            self._reduced[id(nets)] = (nets, sample_nets(nets, limit, self.budget.seed))
        return self._reduced[id(nets)][1]

    @property
    def use_groups(self) -> bool:
        p = self.problem
        return p.group_preserving and num_group_assignments(p) <= MAX_GROUP_ASSIGNMENTS

    @property
    def exact_groups(self) -> bool:
        """The group search enumerates exact maps only (every position type in one class): it works on
        nets aggregated by expert groups touched, so it never needs a sample."""
        if not self.use_groups:
            return False
        _, type_count, _ = self.problem.position_types
        return bool(((type_count > 0).sum(axis=1) == 1).all())

    def score(self, m: np.ndarray, nets: NetSet) -> int:
        return net_crossings(nets, m, self.problem.class_sig, self.problem.cost_mode)

    # -- several sampled windows (solvers.experts.windows); one window: score and __call__ ------
    def objective(self, m: np.ndarray, part: str) -> tuple[float, int]:
        """The fit objective of ``m`` on the ``fit`` or ``all`` part, for comparisons: (worst
        window's crossings per token under a robust fit over >= 2 windows, else 0; crossings)."""
        nets = self.problem.nets_fit if part == "fit" else self.refit_nets
        ws = part_windows(self.problem, part)
        return (robust_value(self.problem, ws, m) if ws else 0.0), self.score(m, nets)

    @property
    def refit_nets(self) -> NetSet:
        return self.problem.nets_refit if self.problem.nets_refit is not None else self.problem.nets_all

    def search_part(self, part: str, incumbent: np.ndarray, det: float, key: str) -> SearchResult:
        """The search on the ``fit`` or ``all`` part with the fit objective (robust: over its windows)."""
        ws = part_windows(self.problem, part)
        if ws:
            return robust_search(self.problem, self, ws, incumbent, det, key, self.runs)
        m, bound, proved = self(self.problem.nets_fit if part == "fit" else self.refit_nets, incumbent, det, key)
        if part == "all" and self.problem.nets_refit is not None:
            bound, proved = None, False  # a bound on the latest window, not on all sampled tokens
        return m, bound, proved

    def __call__(self, nets: NetSet, incumbent: np.ndarray, det: float, key: str) -> SearchResult:
        """(map or None, bound or None, proved) from the layer's search on ``nets``."""
        if self.stop():
            self.runs[key] = {"status": "SKIPPED", "reason": "deadline"}
            return None, None, False
        exact = nets
        nets = exact if self.exact_groups else self.reduced(exact)
        if nets is not exact:  # a sample: its bounds are estimates, not bounds
            m, _, _ = self._search(nets, incumbent, det, key)
            self.runs[key].update(sampled_nets=nets.num_nets, of_nets=exact.num_nets)
            return m, None, False
        return self._search(nets, incumbent, det, key)

    def _search(self, nets: NetSet, incumbent: np.ndarray, det: float, key: str) -> SearchResult:
        if self.use_groups:
            r = group_search(self.problem, nets, self.cap, incumbent, deterministic_time=det, seed=self.budget.seed,
                             stop=self.stop, restarts=_restarts_for(det), options=self.options)
            assert r is not None  # use_groups: few enough assignments
            self.runs[key] = {"status": "OPTIMAL" if r.bound >= r.crossings else "FEASIBLE",
                              "objective_crossings": r.crossings, "bound_crossings": r.bound, **r.info}
            return r.best, r.bound, r.bound >= r.crossings
        links = _model_links(self.problem, nets)
        if det < CPSAT_DET_PER_LINK * links:
            iters = _restarts_for(det)
            m = iterated_local_search(self.problem, nets, self.cap, incumbent, iterations=iters, seed=self.budget.seed,
                                      should_stop=self.stop)
            self.runs[key] = {"status": "SKIPPED", "reason": f"budget {det:.3g} below the model's need "
                              f"({links} links)", "iterated_local_search": iters}
            # Large-neighbourhood search (solvers.experts.lns) from the local search's map, on the budget.
            if det >= LNS_MIN_DET:
                lns = lns_search(self.problem, nets, self.cap, m, deterministic_time=det, seed=self.budget.seed,
                                 stop=self.stop, wall_factor=self.budget.wall_factor, options=self.options)
                self.runs[key]["lns"] = lns.facts
                m = lns.expert2class
            return m, None, False
        return self._cpsat(nets, incumbent, det, key)

    def _cpsat(self, nets: NetSet, incumbent: np.ndarray, det: float, key: str) -> SearchResult:
        wall = min(self.budget.wall_factor * det / DET_PER_WALL_S, self.stop.wall_left_s())
        r = run_cpsat(self.problem, nets, self.cap, incumbent, deterministic_time=det, wall_limit_s=wall,
                      seed=self.budget.seed, options=self.options)
        self.runs[key] = {"status": r.status, "objective_crossings": r.objective, "bound_crossings": r.bound,
                          "deterministic_time": round(min(r.deterministic_time, det), 3),
                          "wall_clock_cut": r.wall_clock_cut}
        m = r.expert2class
        if m is not None and self.score(m, nets) > self.score(incumbent, nets):  # pragma: no cover - hint kept
            m = incumbent
        if m is not None and r.status != "OPTIMAL":
            m = SwapSearch(self.problem, nets).run(m, self.cap)
        return m, r.bound, r.status == "OPTIMAL"


def _group_preserving_twin(problem: LayerProblem, model_groups: int) -> LayerProblem:
    """A free layer's problem restricted to maps that keep the model's ``model_groups`` expert groups
    whole (same classes, nets and caps)."""
    return dataclasses.replace(problem, group_preserving=True, expert_group_size=problem.num_experts // model_groups)


def _starts(problem: LayerProblem, cap: np.ndarray, greedy: np.ndarray | None, cost_fit: np.ndarray,
            model_groups: int, hint_phy2log: np.ndarray | None, seed: int = 0,
            coactivation: bool = True) -> list[tuple[str, np.ndarray]]:
    """Starting points for the local search, in a fixed order: the greedy, the default map, in free mode
    a start keeping the model's expert groups whole, the co-activation starts (with ``coactivation``),
    and the layout's map (when it fits)."""
    E = problem.num_experts
    starts: list[tuple[str, np.ndarray]] = []
    if greedy is not None:
        starts.append(("greedy", greedy))
    d = problem.default_expert2class
    if problem.within_caps(d, cap):
        starts.append(("default", d))
    if not problem.group_preserving and model_groups > 1 and E % model_groups == 0:
        gstart = capped_greedy(_group_preserving_twin(problem, model_groups), cost_fit, cap)
        if gstart is not None:
            starts.append(("group_structured", gstart))
    # Starts that see co-activation (solvers.experts.coarsen): the multilevel coarsening, and Mt-KaHyPar's
    # partition where USE_KAHYPAR_START is set and the extra is installed.
    coarse = coarsen_start(problem, problem.nets_fit, cap, cost_fit) if coactivation else None
    if coarse is not None:
        starts.append(("coarsened", coarse))
    if USE_KAHYPAR_START and coactivation:
        part = kahypar_start(problem, problem.nets_fit, cap, cost_fit, seed=seed)
        if part is not None:
            starts.append(("kahypar", part))
    if hint_phy2log is not None and np.array_equal(np.sort(hint_phy2log), np.arange(E)):
        h = np.empty(E, dtype=np.int64)
        h[np.asarray(hint_phy2log, dtype=np.int64)] = problem.slot2class  # expert at slot p: p's class
        if is_structurally_valid(problem, h) and problem.within_caps(h, cap):
            starts.append(("layout_hint", h))
    if not starts:  # pragma: no cover - the ladder ends at the default's excess, which fits
        raise SolverError(f"layer {problem.layer}: no map meets the load caps")
    return starts


def _group_search_start(search: _LayerSearch, starts: list[tuple[str, np.ndarray]], model_groups: int,
                        det_total: float, details: dict) -> float:
    """Free mode: the group search (the group-preserving mode's search) on the fit part from the
    group-structured start, within the free mode's caps, appended to ``starts`` as ``group_search``.
    Every group-preserving map is a free map, so with it among the starts a free layer's map is never
    worse on the fit part than what the group-preserving search finds.  Runs only where that start
    exists and the layer's group assignments can be enumerated; it takes ``GROUP_START_SHARE`` of
    the deterministic budget.  Returns the budget left for the layer's own search."""
    gstart = dict(starts).get("group_structured")
    p = search.problem
    if gstart is None or p.group_preserving:
        return det_total
    gp = _group_preserving_twin(p, model_groups)
    if num_group_assignments(gp) > MAX_GROUP_ASSIGNMENTS:
        return det_total
    det = det_total * GROUP_START_SHARE
    gsearch = _LayerSearch(gp, search.budget, search.cap, search.stop, search.options)
    m, _, _ = gsearch(p.nets_fit, gstart, det, "group_start")
    details["group_start"] = gsearch.runs.get("group_start", {})
    if m is not None:
        starts.append(("group_search", m))
    return det_total - det


def _best_polished(search: _LayerSearch, starts: list[tuple[str, np.ndarray]]) -> tuple[str, np.ndarray]:
    """The swap search from every start on the fit part; the best on the exact fit nets of the
    polished maps and the starts themselves (the swap search may see a sample of the nets, so a
    polished map can be worse than its start on all of them); ties: the earlier start, polished first."""
    fit = search.problem.nets_fit
    ls_fit = SwapSearch(search.problem, search.reduced(fit))
    # Anytime (issue 16): once the stop fires, the remaining starts stay as they are (valid maps).
    polished = [(name, m if search.stop() else ls_fit.run(m, search.cap, should_stop=search.stop))
                for name, m in starts]
    pool = [nm for pair in zip(polished, starts) for nm in pair]
    best = min(range(len(pool)), key=lambda i: (search.score(pool[i][1], fit), i))
    return pool[best]


def _trivial_outcome(problem: LayerProblem, details: dict, t_start: float) -> LayerOutcome:
    zeros = np.zeros(problem.num_experts, dtype=np.int64)
    slots = balance_ranks(problem, zeros)
    details.update(status="trivial", chosen="balanced", objective_crossings=0, bound_crossings=0,
                   load_max_over_mean=round(rank_load_ratio(problem, slots), 6),
                   load_max_over_mean_floor=round(rank_load_floor(problem, zeros), 6))
    return LayerOutcome(problem.layer, slots, 0, 0, True, details, time.monotonic() - t_start)


def _choose(search: _LayerSearch, candidates: dict[str, np.ndarray], table: dict, default_ok: bool,
            det_all: float, details: dict) -> tuple[str, np.ndarray, int | None, bool]:
    """Step 3 with a validation part: the winner on it, refitted on all tokens if still no worse
    than the default there.  Returns ``(name, map, bound, proved)``."""
    order = list(candidates)
    every, val = search.problem.nets_all, search.problem.nets_val
    winner = min(order, key=lambda n: (table[n]["validation"], table[n]["fit"], order.index(n)))
    final_name, final = winner, candidates[winner]
    hint_name = winner
    if winner == "default" and not default_ok:
        hint_name = min((n for n in order if n != "default"), key=lambda n: (table[n]["all"], order.index(n)))
    m_all, bound, proved = search.search_part("all", candidates[hint_name], det_all, "all")
    if winner != "default" and m_all is not None and search.objective(m_all, "all") < search.objective(final, "all"):
        if search.score(m_all, val) <= table["default"]["validation"]:
            final_name, final = "refit_all", m_all
        else:
            details["refit_rejected"] = "worse than the default on the validation part"
    details["validation_winner"] = winner
    return final_name, final, bound, proved


#: Classes (NVLink domains, or the dispatcher's nodes) above which a layer's final lower bound is not
#: computed (:func:`_final_bound`).
FINAL_BOUND_MAX_CLASSES = 8


def _final_bound(problem: LayerProblem, cap: np.ndarray, bound: int | None, crossings: int, default_ok: bool,
                 default_all: int, details: dict, stop: StopCheck | None = None) -> int | None:
    """The layer's bound: the search's, raised by the transport LP (``per_pair``) or by
    :func:`solvers.experts.lower_bounds.layer_lower_bound` (``per_domain``), within the search space
    (the maps within the caps plus the default map), never above the answer."""
    if problem.cost_mode == "per_pair":
        lp = per_pair_class_bound(problem, problem.nets_all, cap)
        details["transport_lp_bound_crossings"] = None if lp.bound is None else round(lp.bound, 6)
        if lp.bound is not None:
            bound = max(bound if bound is not None else 0, int(math.ceil(lp.bound - 1e-6)))
    if problem.num_classes > FINAL_BOUND_MAX_CLASSES:
        # A layout that HybridEP runs with small nodes has one class per node: the relaxation's cost
        # grows with the classes and is in no work budget, so it would eat the wall-clock time the
        # later steps need (and their answer would then depend on the clock).  The bound is a report.
        details["lower_bound"] = f"not computed: {problem.num_classes} classes > {FINAL_BOUND_MAX_CLASSES}"
    elif problem.cost_mode == "per_domain" and not (stop is not None and stop()):  # a bound on every layer
        # Where the search proved a bound (its group search refines the same relaxation), no refinements.
        lb = layer_lower_bound(problem, problem.nets_all, cap, stop=stop,
                               refine_net_budget=0 if bound is not None else REFINE_NET_BUDGET)
        details["lower_bound"] = lb.info
        bound = max(bound if bound is not None else 0, bound_to_crossings(lb.crossings))
    if bound is not None:
        if not default_ok:
            bound = min(bound, default_all)
        bound = min(bound, crossings)
    return bound


def solve_layer(
    problem: LayerProblem,
    budget: LayerBudget,
    *,
    model_groups: int = 1,
    class_tolerance: float = CLASS_LOAD_TOLERANCE,
    hint_phy2log: np.ndarray | None = None,
    options: SolveOptions | None = None,
) -> LayerOutcome:
    """Steps 1-3 of the module docstring for one layer.

    Parameters
    ----------
    problem : from :func:`solvers.experts.problem.build_layer_problem`.
    budget : deterministic CP-SAT budget, seed and the wall-clock safety net.
    model_groups : the model's expert groups (a group-structured starting point in free mode).
    class_tolerance : the load tolerance the ladder starts from.
    hint_phy2log : (E,) a map of this layer to start from as well (used if it meets the caps and,
        in group-preserving mode, preserves groups).
    options : the caller's options, only when solving in the caller's process (stop requests).
    """
    t_start = time.monotonic()
    details: dict = {
        "layer": problem.layer,
        "stage": problem.stage,
        "class_domains": [[int(d) for d in problem.domains[row]] for row in problem.class_sig],
        "class_capacity": [int(c) for c in problem.class_capacity],
    }
    if problem.trivial:
        return _trivial_outcome(problem, details, t_start)
    if problem.num_windows > 1:  # several sampled windows (solvers.experts.windows); absent for one
        details["fit"] = problem.fit
    fit, val, every = problem.nets_fit, problem.nets_val, problem.nets_all
    has_val = val.num_nets > 0
    # Step 1a: the load tolerance and the starts (fitted on the fit part).
    cost_fit = linear_costs(problem, fit)
    tol, greedy = _tolerance_ladder(problem, cost_fit, class_tolerance)
    cap = problem.load_cap(tol)
    search = _LayerSearch(problem, budget, cap, StopCheck(budget.deadline, options), options)
    details["search"] = "group_search" if search.use_groups else "cpsat_or_ils"
    default = problem.default_expert2class
    default_ok = problem.within_caps(default, cap)
    # The co-activation starts where the search is not the group enumeration (which tries every
    # group -> position-type assignment with swap restarts of its own).
    starts = _starts(problem, cap, greedy, cost_fit, model_groups, hint_phy2log, budget.seed,
                     coactivation=not search.use_groups)
    det_total = _group_search_start(search, starts, model_groups, budget.deterministic_time, details)
    # Step 1b: local search from every start; keep the best on the fit part.
    ls_name, ls_map = _best_polished(search, starts)
    details["local_search_start"] = ls_name
    candidates: dict[str, np.ndarray] = {"default": default, "local_search": ls_map}
    # Step 1c: the search on the fit part (all of the budget when there is no validation part).
    det_fit = det_total * (0.5 if has_val else 1.0)
    m_fit, bound_fit, proved_fit = search.search_part("fit", ls_map, det_fit, "fit")
    if m_fit is not None and search.objective(m_fit, "fit") < search.objective(ls_map, "fit"):
        candidates["search"] = m_fit
    table = {n: {"fit": search.score(m, fit), "validation": search.score(m, val), "all": search.score(m, every)}
             for n, m in candidates.items()}
    details["candidates"] = table
    # Step 3: choose on the validation part; refit on all tokens.
    if has_val:
        final_name, final, bound, proved = _choose(search, candidates, table, default_ok,
                                                   det_total - det_fit, details)
    else:
        order = list(candidates)
        winner = min(order, key=lambda n: (search.objective(candidates[n], "all"), order.index(n)))
        final_name, final, bound, proved = winner, candidates[winner], bound_fit, proved_fit
        details["validation_winner"] = winner
    details["runs"] = search.runs
    crossings = search.score(final, every)
    bound = _final_bound(problem, cap, bound, crossings, default_ok, table["default"]["all"], details, search.stop)
    proved = bound is not None and bound == crossings
    # Step 2: GPUs.
    slots = balance_ranks(problem, final)
    details.update(
        status="optimal" if proved else "feasible",
        chosen=final_name,
        load_tolerance=tol,
        load_tolerance_relaxed=bool(tol > class_tolerance),
        default_within_caps=default_ok,
        objective_crossings=crossings,
        bound_crossings=bound,
        validation_crossings=search.score(final, val),
        default_validation_crossings=table["default"]["validation"],
        load_max_over_mean=round(rank_load_ratio(problem, slots), 6),
        load_max_over_mean_floor=round(rank_load_floor(problem, final), 6),
    )
    # Scalable search (issue 16): what the search saw, and whether the clock (not the budget) ended it.
    details["search_nets"] = {"limit": budget.search_nets, "fit": search.reduced(fit).num_nets,
                              "fit_exact": fit.num_nets}
    details["stopped_early"] = bool(search.stop.fired)  # the deadline or a stop request ended some work
    return LayerOutcome(problem.layer, slots, crossings, bound, proved, details, time.monotonic() - t_start)
