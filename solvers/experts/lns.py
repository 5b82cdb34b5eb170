"""CP-SAT large-neighbourhood search from an incumbent, for layers too large for the whole model.

Each round frees a neighbourhood of experts, fixes every other expert at its incumbent class and
solves the sub-model (:func:`solvers.experts.cpsat_model.run_cpsat` with ``fixed``: only the nets
that hold a free expert and can still reach a new remote domain stay, so the model is small), with
the incumbent as a complete hint; a better answer becomes the incumbent.  Neighbourhoods, in turn:

- ``coactivation``: a seed expert (seeded rng) and the experts most co-selected with the set so far
  (:func:`solvers.experts.coarsen.coactivation_graph`), whatever their class: a clique of experts
  chosen together that the swap search cannot pull into one class a pair at a time;
- ``classes``: two classes (seeded rng), and from each the experts with the most co-selection weight
  towards the other class;
- ``triple``: the same with three classes (two where the layer has two), so that cycles of moves
  over three classes, which no swap makes, are in reach.

In group-preserving mode a neighbourhood is a set of whole expert groups (the groups of the
co-activation set's experts, or the groups holding the two classes' experts, up to
:data:`LNS_MAX_GROUPS`): the sub-model then chooses their group positions and their experts' classes
together.

The search runs only with at least :data:`LNS_MIN_DET` of deterministic time and ends after
:data:`LNS_PATIENCE` rounds in a row without an improvement.

Deterministic: every round gets the same deterministic time (the layer's budget divided by the
round count, a function of the budget only), the CP-SAT seed is the layer's seed plus the round, and
the rng is seeded; the wall clock only cuts (``wall_clock_cut`` in the facts).  The incumbent never
gets worse: a round's answer is kept only when its exact crossings are lower.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from solvers.base import SolveOptions
from solvers.experts.budget import StopCheck
from solvers.experts.coarsen import coactivation_graph
from solvers.experts.cpsat_model import run_cpsat
from solvers.experts.problem import LayerProblem, NetSet, net_crossings
from solvers.experts.tuning import DET_PER_WALL_S

__all__ = ["LNS_DET_PER_ROUND", "LNS_MIN_DET", "LNS_PATIENCE", "LNS_MAX_ROUNDS", "LNS_FREE_EXPERTS", "LNS_MAX_GROUPS", "LnsResult",
           "lns_rounds", "neighbourhood", "lns_search"]

#: Deterministic time per round the round count aims at (the rounds share the layer's budget).
LNS_DET_PER_ROUND = 0.15
#: The search runs only with at least this much deterministic time (a search phase's budget): on the
#: committed instances its rounds did not improve the swap search's local optima at small budgets,
#: and under heavy load the time they took made other layers miss the deadline (``docs/experts.md``).
LNS_MIN_DET = 1.0
#: The search ends after this many rounds in a row without an improvement.
LNS_PATIENCE = 4
#: Most rounds per search.
LNS_MAX_ROUNDS = 40
#: Experts freed per round (free mode); a layer with at most this many experts is freed whole.
LNS_FREE_EXPERTS = 20
#: Expert groups freed per round (group-preserving mode).
LNS_MAX_GROUPS = 3


_KINDS = ("coactivation", "classes", "triple")


@dataclass
class LnsResult:
    """expert2class (E,), its crossings on the nets, and deterministic facts per round."""

    expert2class: np.ndarray
    crossings: int
    facts: dict = field(default_factory=dict)


def lns_rounds(deterministic_time: float) -> int:
    """Rounds for a budget: one per :data:`LNS_DET_PER_ROUND`, at least 1, at most :data:`LNS_MAX_ROUNDS`."""
    return int(max(1, min(LNS_MAX_ROUNDS, deterministic_time // LNS_DET_PER_ROUND)))


def _grow(W: np.ndarray, seed_expert: int, size: int, allowed: np.ndarray) -> list[int]:
    """The seed and, one at a time, the allowed expert with the most weight to the set (ties: lowest id)."""
    chosen = [seed_expert]
    score = W[seed_expert].copy()
    score[~allowed] = -np.inf
    score[seed_expert] = -np.inf
    while len(chosen) < size:
        f = int(np.argmax(score))
        if not np.isfinite(score[f]):
            break
        chosen.append(f)
        score += W[f]
        score[f] = -np.inf
    return chosen


def neighbourhood(problem: LayerProblem, W: np.ndarray, incumbent: np.ndarray, kind: str,
                  rng: np.random.Generator, size: int) -> np.ndarray:
    """(E,) bool: the experts a round frees (module docstring); all of them when ``size >= E``."""
    E, C = problem.num_experts, problem.num_classes
    free = np.zeros(E, dtype=bool)
    if size >= E:  # a small layer: the whole model
        free[:] = True
    elif kind == "coactivation":
        e0 = int(rng.integers(E))
        free[_grow(W, e0, size, np.ones(E, dtype=bool))] = True
    else:
        n = 3 if kind == "triple" and C >= 3 else 2
        chosen = [int(x) for x in rng.choice(C, size=n, replace=False)]
        for mine in chosen:
            members = np.flatnonzero(incumbent == mine)
            others = np.flatnonzero(np.isin(incumbent, [c for c in chosen if c != mine]))
            pull = W[np.ix_(members, others)].sum(axis=1)
            order = members[np.lexsort((members, -pull))]
            free[order[: max(1, size // n)]] = True
    if problem.group_preserving:
        groups = np.unique(problem.expert2group[free])
        if groups.shape[0] > LNS_MAX_GROUPS:
            counts = np.bincount(problem.expert2group[free], minlength=problem.num_group_positions)[groups]
            groups = groups[np.lexsort((groups, -counts))][:LNS_MAX_GROUPS]
        if groups.shape[0] < 2:  # a second group to trade positions with
            others = np.setdiff1d(np.arange(problem.num_group_positions), groups)
            groups = np.concatenate([groups, [int(others[rng.integers(others.shape[0])])]])
        free = np.isin(problem.expert2group, groups)
    return free


def lns_search(
    problem: LayerProblem,
    nets: NetSet,
    cap: np.ndarray,
    incumbent: np.ndarray,
    *,
    deterministic_time: float,
    seed: int,
    stop: StopCheck,
    wall_factor: float = 4.0,
    options: SolveOptions | None = None,
) -> LnsResult:
    """Large-neighbourhood search from ``incumbent`` (E,) on ``nets`` within ``cap`` (module docstring).

    ``incumbent`` must meet the layer's structure and ``cap`` (it is every round's hint); the result
    is never worse than it on ``nets``.
    """
    E = problem.num_experts
    best = np.array(incumbent, dtype=np.int64)
    best_v = net_crossings(nets, best, problem.class_sig, problem.cost_mode)
    rounds = lns_rounds(deterministic_time)
    det = deterministic_time / rounds
    facts: dict = {"rounds": rounds, "deterministic_time_per_round": round(det, 4), "improved_rounds": [],
                   "start_crossings": best_v}
    if problem.num_classes < 2 or nets.num_nets == 0 or E < 2:
        facts["rounds_run"] = 0
        return LnsResult(best, best_v, facts)
    W = coactivation_graph(nets, E)
    rng = np.random.default_rng(seed)
    size = E if E <= LNS_FREE_EXPERTS else LNS_FREE_EXPERTS
    cut = False
    run_count = 0
    idle = 0
    for r in range(rounds):
        if stop():
            facts["stopped"] = "deadline"
            break
        if idle >= LNS_PATIENCE:
            facts["stopped"] = f"{LNS_PATIENCE} rounds without an improvement"
            break
        kind = _KINDS[r % len(_KINDS)]
        free = neighbourhood(problem, W, best, kind, rng, size)
        fixed = np.where(free, -1, best)
        wall = min(wall_factor * det / DET_PER_WALL_S, stop.wall_left_s())
        if wall <= 0:
            facts["stopped"] = "deadline"
            break
        run = run_cpsat(problem, nets, cap, best, deterministic_time=det, wall_limit_s=wall, seed=seed + r,
                        fixed=fixed, options=options)
        run_count += 1
        cut = cut or run.wall_clock_cut
        idle += 1
        if run.expert2class is None:
            continue
        v = net_crossings(nets, run.expert2class, problem.class_sig, problem.cost_mode)
        if v < best_v and problem.within_caps(run.expert2class, cap):
            best, best_v = run.expert2class.copy(), v
            facts["improved_rounds"].append(r)
            idle = 0
    facts.update(rounds_run=run_count, crossings=best_v, wall_clock_cut=cut)
    return LnsResult(best, best_v, facts)
