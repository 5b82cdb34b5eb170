"""Local search on a layer's exact crossings: swaps with exact deltas, whole-group moves, and
a seeded iterated local search.

The swaps and their deltas are the kernel :class:`solvers.kernels.NetSwapSearch` (items = experts,
classes = the layer's domain classes); this module adds the layer's structure.  Free mode: any two
experts of different classes swap.  Group-preserving mode: two experts of the same expert group,
plus *group moves*, exchanging the position types of two expert groups (each group then re-places
its experts inside its new type by the exact assignment on the current move deltas).
"""

from __future__ import annotations

from collections.abc import Iterator

from typing import Callable

import numpy as np

from solvers.experts.problem import LayerProblem, NetSet, group2type_of
from solvers.experts.tuning import MAX_GROUP_ROUNDS, MAX_SWAPS
from solvers.kernels import NetSwapSearch, assign_to_counts

__all__ = ["SwapSearch", "iterated_local_search"]


class SwapSearch:
    """Best-improvement swap search on the exact crossings of one layer's nets (module docstring)."""

    def __init__(self, problem: LayerProblem, nets: NetSet):
        self.p = problem
        self.nets = nets
        self.kernel = NetSwapSearch(
            nets.experts, problem.class_sig[:, nets.group], nets.src, nets.weight,
            num_items=problem.num_experts, num_domains=problem.num_domains, cost_mode=problem.cost_mode,
            load=problem.load, swap_label=problem.expert2group if problem.group_preserving else None,
        )

    def cost(self, e2c: np.ndarray) -> int:
        """Exact crossings of the nets under ``e2c``."""
        return self.kernel.cost(e2c)

    def run(
        self,
        e2c: np.ndarray,
        cap: np.ndarray | None,
        *,
        max_swaps: int = MAX_SWAPS,
        group_rounds: int = MAX_GROUP_ROUNDS,
        should_stop: Callable[[], bool] | None = None,
    ) -> np.ndarray:
        """Improve ``e2c`` until no improving move fits ``cap`` (G, C), the swap budget is spent or
        ``should_stop()`` says so (then the map reached so far).

        A class already over its cap may not get worse (its cap is raised to its load).
        """
        e2c = np.array(e2c, dtype=np.int64)
        if self.nets.num_nets == 0 or self.p.num_classes < 2:
            return e2c
        loads = self.p.class_loads(e2c)
        cap_eff = None if cap is None else np.maximum(cap, loads)  # never worsen a class already over
        swaps = 0
        for _ in range(max(1, group_rounds)):
            swaps += self.kernel.run_swaps(e2c, loads, cap_eff, max_swaps - swaps, should_stop)
            if should_stop is not None and should_stop():
                break
            if not self.p.group_preserving or not self._group_move(e2c, cap_eff):
                break
            loads = self.p.class_loads(e2c)
        return e2c

    def _group_move(self, e2c: np.ndarray, cap: np.ndarray | None) -> bool:
        """Best exchange of position types between two expert groups (in place); True if one improved."""
        best_val, best_map = self.cost(e2c), None
        for cand in group_exchanges(self.p, e2c, self.kernel.M, cap):
            v = self.cost(cand)
            if v < best_val:
                best_val, best_map = v, cand
        if best_map is None:
            return False
        e2c[:] = best_map
        return True


def group_exchanges(problem: LayerProblem, e2c: np.ndarray, M: np.ndarray, cap: np.ndarray | None) -> Iterator[np.ndarray]:
    """Group-preserving maps one exchange away from ``e2c`` (E,): for every pair of expert groups
    on different position types, in order, the two swap types and each is re-placed inside its new
    type by the exact assignment on the move deltas ``M`` (E, C); those within ``cap`` (when
    given) are yielded, each a new array."""
    g2t = group2type_of(problem, e2c)
    assert g2t is not None  # group-preserving mode
    _, type_count, _ = problem.position_types
    gs, P = problem.expert_group_size, problem.num_group_positions
    for p in range(P):
        for q in range(p + 1, P):
            if g2t[p] == g2t[q]:
                continue
            cand = e2c.copy()
            for grp, t in ((p, g2t[q]), (q, g2t[p])):
                sl = slice(grp * gs, (grp + 1) * gs)
                cand[sl], _ = assign_to_counts(M[sl], type_count[t])
            if cap is not None and (problem.class_loads(cand) > cap).any():
                continue
            yield cand


def _kick(problem: LayerProblem, cur: np.ndarray, cap: np.ndarray, rng: np.random.Generator, kick: int) -> None:
    """``kick`` random swaps of ``cur`` (in place) that keep every class within its cap (or no worse)."""
    e2g = problem.expert2group
    loads = problem.class_loads(cur)
    for _ in range(kick):
        e = int(rng.integers(problem.num_experts))
        others = np.flatnonzero((cur != cur[e]) & ((e2g == e2g[e]) if problem.group_preserving else True))
        if others.size == 0:
            continue
        f = int(others[rng.integers(others.size)])
        a, b = cur[e], cur[f]
        d = problem.load[:, f] - problem.load[:, e]
        if ((loads[:, a] + d) > np.maximum(cap[:, a], loads[:, a])).any() or \
                ((loads[:, b] - d) > np.maximum(cap[:, b], loads[:, b])).any():
            continue
        cur[e], cur[f] = b, a
        loads[:, a] += d
        loads[:, b] -= d


def iterated_local_search(
    problem: LayerProblem,
    nets: NetSet,
    cap: np.ndarray,
    start: np.ndarray,
    *,
    iterations: int,
    seed: int,
    should_stop: Callable[[], bool],
    kick: int = 6,
) -> np.ndarray:
    """Iterated local search: ``kick`` random feasible swaps of the best map, then :class:`SwapSearch`;
    keep the result if it is better.  Seeded, with a fixed iteration count: deterministic (unless
    ``should_stop`` ends it early).
    """
    rng = np.random.default_rng(seed)
    search = SwapSearch(problem, nets)
    best = search.run(start, cap)
    best_v = search.cost(best)
    for _ in range(iterations):
        if should_stop():
            break
        cur = best.copy()
        _kick(problem, cur, cap, rng, kick)
        cand = search.run(cur, cap, should_stop=should_stop)
        v = search.cost(cand)
        if v < best_v:
            best, best_v = cand, v
    return best
