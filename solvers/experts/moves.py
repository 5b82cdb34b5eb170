"""Move-aware re-placement: per-layer candidate maps between the previous map and the solved one,
and their allocation over layers under a moved-bytes budget or a move-cost weight.

The accounting (bytes per replica, moves counted by GPU) is :mod:`placement.core.movecount`; this module is
the search side.

Per layer (in the layer's worker, after :func:`solvers.experts.layer.solve_layer`):

* **Move prices.** :class:`LayerMoves` holds, for every expert ``e`` and EP rank ``r``, how many of
  ``e``'s replicas (one per EP group) would move across racks and over NVLink if ``e`` sat on
  ``r``, counted by GPU from the previous placement (0 on the previous rank).  For a class ``c`` the
  price is the cheapest rank of the class, ``L[e, c] = min_r (cross[e, r] + w * nvlink[e, r])``
  (``w`` = 1 under a bytes budget, ``scaleout_gbps / nvlink_gbps`` under a move cost): staying in
  the previous class is a linear bonus, which the swap deltas take exactly
  (:class:`MoveSwapKernel`: ``M[e, c] += L[e, c] - L[e, class(e)]``).
* **Candidates.** The previous map; the solved map (balanced as the solver did, and re-slotted to
  keep experts on their previous GPU); and swap searches on all sampled tokens minimising
  ``crossings + lambda * L`` from the previous map and from the solved map, for a fixed ladder of
  ``lambda`` (multiples of the solved map's crossings saved per moved replica, and the move cost's
  own price).  Group-preserving layers swap only inside expert groups, so every candidate keeps
  groups whole; from a free previous map (``apply`` runtime takes any map) these searches start at
  its nearest group-preserving map (:func:`group_preserving_start`), and only the previous map and
  its rebalanced variants stay free (their bins are per class, :func:`keeps_group_types`).
* **Previous GPUs first.** :func:`keep_previous_slots` turns a class map into slots: an expert
  whose previous slot lies in its bin (class, and group position) keeps that slot; the others fill
  the vacated slots heaviest first onto the least-loaded rank (:func:`solvers.kernels.lpt_pack`).
  In group-preserving mode an expert group keeps its previous position when the type fits.

Over layers (:func:`allocate_moves`, in the calling process, deterministic):

* ``max_moved_bytes``: a multiple-choice knapsack solved greedily: each layer's candidates on the
  lower convex hull of (moved replicas, crossings), steps taken in order of crossings saved per
  moved replica (ties: lower layer) while they fit the budget, then single upgrades that still fit.
  A zero budget keeps every layer's previous map exactly.
* ``move_cost``: per layer, the candidate with the lowest ``crossings * bytes_per_crossing + W *
  (cross-rack + w * NVLink moved bytes)`` (ties: fewer moves, the previous map first).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from placement.core.model import Instance, Placement
from solvers.experts.balance import _improve_by_swaps, rank_load_ratio
from solvers.experts.problem import LayerProblem, NetSet, group2type_of, net_crossings
from solvers.experts.tuning import MAX_SWAPS
from solvers.kernels import NetSwapSearch, lpt_pack

__all__ = ["MOVE_RESERVE_SHARE", "cheap_frontier", "SEARCH_SHARE", "REBALANCE_SWAPS", "StepCurrency", "build_plan_for", "previous_check", "LayerMoves", "MoveCandidate", "MovePlan", "MoveSwapKernel", "build_move_plan", "keep_previous_slots", "keeps_group_types", "group_preserving_start",
           "move_frontier", "allocate_moves", "LAMBDA_LADDER"]

# Multiples of the solved map's crossings saved per moved (weighted) replica tried as move prices.
LAMBDA_LADDER = (0.25, 1.0, 4.0)
# Share of the expert placer's work budget its search keeps under a re-placement; the rest is left
# for the move candidates (swap searches and balancing on every layer, not counted by the budget).
SEARCH_SHARE = 0.6
# Share of the expert placer's wall time kept back, under a re-placement, for the cheap candidates
# (:func:`cheap_frontier`) of layers the deadline leaves unsolved.
MOVE_RESERVE_SHARE = 0.15
# Balancing swaps (each moves two experts inside a bin) tried on the cheaper candidates.
REBALANCE_SWAPS = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class LayerMoves:
    """One layer's move prices (picklable: it travels with the layer's task).

    prev_expert2slot : (E,) slot of each expert in the previous placement.
    cross : (E, ep) int64, replicas of ``e`` that move across racks if ``e`` sits on EP rank ``r``.
    nvlink : (E, ep) int64, the same over NVLink.
    nvlink_weight : ``w``, the weight of an NVLink move against a cross-rack one.
    price : crossings per weighted replica under a move cost (None under a budget).
    """

    prev_expert2slot: np.ndarray
    cross: np.ndarray
    nvlink: np.ndarray
    nvlink_weight: float
    price: float | None

    def weighted(self) -> np.ndarray:
        """(E, ep) weighted replicas moved, ``cross + w * nvlink``."""
        return self.cross + self.nvlink_weight * self.nvlink


@dataclass(frozen=True)
class MoveCandidate:
    """A candidate map of one layer.  expert2slot : (E,); replicas moved by kind; crossings on all sampled tokens."""

    name: str
    expert2slot: np.ndarray
    crossings: int
    cross: int
    nvlink: int
    load: float = 1.0  # expert load max/mean on the sampled tokens (the evaluator's definition)

    @property
    def replicas(self) -> int:
        return self.cross + self.nvlink


@dataclass(frozen=True)
class MovePlan:
    """The move request as the expert placer sees it: per-layer prices and the rule.

    layers : MoE layer -> :class:`LayerMoves`.
    max_moved_replicas : the budget in replicas (``floor(max_moved_bytes / bytes_per_replica)``), or None.
    move_cost : ``W`` (None under a budget).
    bytes_per_replica : state bytes per replica.
    """

    layers: dict[int, LayerMoves]
    max_moved_replicas: int | None
    move_cost: float | None
    bytes_per_replica: float


def build_move_plan(instance: Instance, rank2gpu: np.ndarray, previous: Placement, *, bytes_per_replica: float,
                    max_moved_bytes: float | None, move_cost: float | None) -> MovePlan:
    """Per-layer move prices for a solve on ``rank2gpu`` re-placing ``previous`` (counted by GPU)."""
    from placement.core.movecount import replica_gpus

    par, cl = instance.parallel, instance.cluster
    dom = cl.gpu2domain
    prev_gpu = replica_gpus(instance, previous)  # (L, G, E)
    groups = par.stage_ep_groups  # (pp, G, ep)
    r2g = np.asarray(rank2gpu, dtype=np.int64)
    epr = instance.experts_per_rank
    E = instance.model.num_experts
    w = 1.0 if move_cost is None else float(cl.scaleout_gbps) / float(cl.nvlink_gbps)
    bpc = None
    if move_cost is not None:
        from solvers.kernels import bytes_per_crossing

        bpc = bytes_per_crossing(instance, instance.routing.tokens_per_source)
    layers: dict[int, LayerMoves] = {}
    for li, s in enumerate(np.asarray(instance.moe_layer2stage, dtype=np.int64)):
        new_gpu = r2g[groups[s]]  # (G, ep)
        old = prev_gpu[li]  # (G, E)
        moved = old[:, :, None] != new_gpu[:, None, :]  # (G, E, ep)
        far = dom[old][:, :, None] != dom[new_gpu][:, None, :]
        prev_slots = np.empty(E, dtype=np.int64)
        prev_slots[np.asarray(previous.phy2log[li], dtype=np.int64)] = np.arange(E)
        price = None if move_cost is None else float(move_cost) * bytes_per_replica / float(bpc or 1.0)
        layers[li] = LayerMoves(prev_slots, (moved & far).sum(axis=0).astype(np.int64),
                                (moved & ~far).sum(axis=0).astype(np.int64), w, price)
        assert prev_slots.shape[0] == E and epr > 0
    budget = None
    if max_moved_bytes is not None:
        budget = int(np.floor(max_moved_bytes / bytes_per_replica + 1e-9)) if bytes_per_replica > 0 else 0
    return MovePlan(layers, budget, move_cost, float(bytes_per_replica))


class MoveSwapKernel(NetSwapSearch):
    """:class:`solvers.kernels.NetSwapSearch` plus a linear cost ``linear[e, c]`` of item ``e`` in class ``c``.

    The linear part of a move's delta is ``linear[e, c] - linear[e, class(e)]``; it is kept inside
    ``M``, so swap deltas (and their ties) are exact for crossings plus the linear cost.
    """

    def __init__(self, *args: object, linear: np.ndarray, **kwargs: object):
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.linear = np.asarray(linear, dtype=np.float64)

    def _linear_part(self, e2c: np.ndarray, items: np.ndarray) -> np.ndarray:
        lin = self.linear[items]
        return lin - lin[np.arange(items.shape[0]), e2c[items]][:, None]

    def init_state(self, e2c: np.ndarray) -> None:
        super().init_state(e2c)
        self.M = self.M + self._linear_part(e2c, np.arange(self.E))

    def apply(self, e2c: np.ndarray, e: int, f: int) -> None:
        items = np.array([e, f], dtype=np.int64)
        self.M[items] -= self._linear_part(e2c, items)
        super().apply(e2c, e, f)
        self.M[items] += self._linear_part(e2c, items)

    def total(self, e2c: np.ndarray) -> float:
        """Crossings plus the linear cost of ``e2c``."""
        return float(self.cost(e2c)) + float(self.linear[np.arange(self.E), e2c].sum())


def _class_prices(problem: LayerProblem, lm: LayerMoves) -> np.ndarray:
    """(E, C) weighted replicas moved if ``e`` sits in class ``c`` on its cheapest rank."""
    wt = lm.weighted()  # (E, ep)
    out = np.empty((problem.num_experts, problem.num_classes))
    for c in range(problem.num_classes):
        out[:, c] = wt[:, problem.rank2class == c].min(axis=1)
    return out


def keeps_group_types(problem: LayerProblem, expert2class: np.ndarray) -> bool:
    """Whether every expert group's class make-up is that of a group position (always True in free
    mode).  A free previous map (``apply`` runtime takes any map) may break it; on a layout whose
    classes are small HybridEP nodes (:mod:`placement.core.dispatch`) a single swap of two experts of
    different groups does."""
    if not problem.group_preserving:
        return True
    _, type_count, _ = problem.position_types
    gs = problem.expert_group_size
    cnt = np.stack([np.bincount(expert2class[p * gs:(p + 1) * gs], minlength=problem.num_classes)
                    for p in range(problem.num_group_positions)])  # (P, C)
    return bool(((cnt[:, None, :] == type_count[None, :, :]).all(axis=2).sum(axis=1) == 1).all())


def group_preserving_start(problem: LayerProblem, expert2class: np.ndarray, prices: np.ndarray) -> np.ndarray:
    """(E,) the group-preserving class map nearest ``expert2class`` in move prices: ``expert2class``
    itself when it keeps groups whole (and in free mode); else each expert group on one group position
    (a min-cost assignment of groups to positions) with its experts on that position's classes (a
    min-cost assignment inside the group), both on ``prices`` (E, C), the replicas moved if an
    expert sits in a class (:func:`_class_prices`).

    The searches of :func:`move_frontier` in group-preserving mode start here from a free previous
    map: they keep groups whole, so they need a start that does."""
    if keeps_group_types(problem, expert2class):
        return np.asarray(expert2class, dtype=np.int64).copy()
    from scipy.optimize import linear_sum_assignment

    from solvers.kernels import assign_to_counts

    gs, P = problem.expert_group_size, problem.num_group_positions
    counts = problem.position_class_count  # (P, C)
    cost = np.empty((P, P))
    inner: dict[tuple[int, int], np.ndarray] = {}
    for g in range(P):
        for p in range(P):
            inner[g, p], cost[g, p] = assign_to_counts(prices[g * gs:(g + 1) * gs], counts[p], method="slots")
    rows, cols = linear_sum_assignment(cost)
    out = np.empty(problem.num_experts, dtype=np.int64)
    for g, p in zip(rows.tolist(), cols.tolist()):
        out[g * gs:(g + 1) * gs] = inner[g, p]
    return out


def _bins(problem: LayerProblem, expert2class: np.ndarray, prev_slots: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Slots and the experts that must fill them: per class, and per group position in group-preserving
    mode, where an expert group keeps its previous position when that position's type fits."""
    s2c = problem.slot2class
    if not problem.group_preserving or not keeps_group_types(problem, expert2class):
        # free mode, or a map that breaks expert groups (a free previous map, which apply runtime
        # takes, and its rebalanced variants): per class only
        return [(np.flatnonzero(s2c == c), np.flatnonzero(expert2class == c)) for c in range(problem.num_classes)]
    gs = problem.expert_group_size
    P = problem.num_group_positions
    g2t = group2type_of(problem, expert2class)
    assert g2t is not None  # group-preserving mode
    position2type, _, _ = problem.position_types
    p2g = np.full(P, -1, dtype=np.int64)
    placed = np.zeros(P, dtype=bool)
    for grp in range(P):  # the previous position first
        p = int(prev_slots[grp * gs]) // gs
        if p2g[p] == -1 and position2type[p] == g2t[grp]:
            p2g[p], placed[grp] = grp, True
    for grp in range(P):
        if not placed[grp]:
            free = np.flatnonzero((p2g == -1) & (position2type == g2t[grp]))
            p2g[free[0]], placed[grp] = grp, True
    out: list[tuple[np.ndarray, np.ndarray]] = []
    for p in range(P):
        grp = p2g[p]
        slots_p = np.arange(p * gs, (p + 1) * gs)
        experts_g = np.arange(grp * gs, (grp + 1) * gs)
        for c in range(problem.num_classes):
            slots = slots_p[s2c[slots_p] == c]
            if slots.size:
                out.append((slots, experts_g[expert2class[experts_g] == c]))
    return out


def keep_previous_slots(problem: LayerProblem, expert2class: np.ndarray, prev_slots: np.ndarray) -> np.ndarray:
    """(E,) slots for ``expert2class`` keeping every expert whose previous slot is in its bin there.

    The others fill the bin's vacated slots by LPT packing (heaviest first onto the rank whose
    busiest EP group stays lowest, loads counted from the experts already placed); a rank's
    arrivals take its free slots in ascending expert id.  With ``expert2class`` the previous map's
    classes this returns ``prev_slots`` itself.
    """
    E, epr = problem.num_experts, problem.experts_per_rank
    total = problem.load.sum(axis=1).astype(np.float64)
    mean = np.where(total > 0, total / problem.ep, 1.0)
    norm = problem.load / mean[:, None]  # (G, E)
    bins = _bins(problem, expert2class, prev_slots)
    out = np.full(E, -1, dtype=np.int64)
    rank_load = np.zeros((problem.num_ep_groups, problem.ep))
    arrivals: list[tuple[np.ndarray, np.ndarray]] = []
    for slots, experts in bins:
        stay = experts[np.isin(prev_slots[experts], slots)]
        out[stay] = prev_slots[stay]
        np.add.at(rank_load.T, prev_slots[stay] // epr, norm[:, stay].T)
        free = np.setdiff1d(slots, prev_slots[stay])
        arrivals.append((free, np.setdiff1d(experts, stay)))
    for free, movers in arrivals:
        if movers.size == 0:
            continue
        ranks, counts = np.unique(free // epr, return_counts=True)
        pack_of, rank_load[:, ranks] = lpt_pack(norm[:, movers], counts, initial_load=rank_load[:, ranks])
        for j, r in enumerate(ranks):
            mine = np.sort(movers[pack_of == j])
            out[mine] = np.sort(free[free // epr == r])[: mine.shape[0]]
    return out


def _candidate(problem: LayerProblem, lm: LayerMoves, name: str, slots: np.ndarray) -> MoveCandidate:
    r = slots // problem.experts_per_rank
    e = np.arange(problem.num_experts)
    crossings = net_crossings(problem.nets_all, problem.slot2class[slots], problem.class_sig, problem.cost_mode)
    return MoveCandidate(name, slots.astype(np.int64), int(crossings), int(lm.cross[e, r].sum()),
                         int(lm.nvlink[e, r].sum()), float(rank_load_ratio(problem, slots)))


def _rebalanced(problem: LayerProblem, slots: np.ndarray, prev_slots: np.ndarray, max_swaps: int) -> np.ndarray:
    """``slots`` after up to ``max_swaps`` swaps of two experts of one bin that lower the busiest rank
    (:mod:`solvers.experts.balance`); experts keep their slot when their rank does not change."""
    epr = problem.experts_per_rank
    total = problem.load.sum(axis=1).astype(np.float64)
    norm = problem.load / np.where(total > 0, total / problem.ep, 1.0)[:, None]
    e2c = problem.slot2class[slots]
    bin_of = np.full(problem.num_experts, -1, dtype=np.int64)
    for bi, (_, experts) in enumerate(_bins(problem, e2c, prev_slots)):
        bin_of[experts] = bi
    expert2rank = slots // epr
    rank_load = np.zeros((problem.num_ep_groups, problem.ep))
    np.add.at(rank_load.T, expert2rank, norm.T)
    new_rank = expert2rank.copy()
    _improve_by_swaps(norm, rank_load, new_rank, bin_of, max_swaps)
    out = slots.copy()
    for r in np.unique(new_rank[new_rank != expert2rank]):
        arrivals = np.sort(np.flatnonzero((new_rank == r) & (expert2rank != r)))
        vacated = np.sort(slots[(expert2rank == r) & (new_rank != r)])
        out[arrivals] = vacated
    return out


def _penalised_search(problem: LayerProblem, nets: NetSet, start: np.ndarray, cap: np.ndarray | None,
                      linear: np.ndarray) -> np.ndarray:
    """Swap search on ``crossings + linear`` from ``start`` (inside expert groups when group-preserving)."""
    kernel = MoveSwapKernel(
        nets.experts, problem.class_sig[:, nets.group], nets.src, nets.weight,
        num_items=problem.num_experts, num_domains=problem.num_domains, cost_mode=problem.cost_mode,
        load=problem.load, swap_label=problem.expert2group if problem.group_preserving else None, linear=linear,
    )
    e2c = np.array(start, dtype=np.int64)
    if nets.num_nets == 0 or problem.num_classes < 2:
        return e2c
    loads = problem.class_loads(e2c)
    cap_eff = None if cap is None else np.maximum(cap, loads)  # never worsen a class already over
    kernel.run_swaps(e2c, loads, cap_eff, MAX_SWAPS)
    return e2c


def _group_path(problem: LayerProblem, nets: NetSet, start: np.ndarray, cap: np.ndarray | None,
                linear: np.ndarray, max_moves: int) -> list[np.ndarray]:
    """Group-preserving layers: best-improvement exchanges of the position types of two expert groups
    on ``crossings + linear`` (each group re-placed inside its new type by the exact assignment on
    the move deltas, as :class:`solvers.experts.swap.SwapSearch` does), then swaps inside groups;
    the map after each exchange, in order (a path from ``start`` of growing moves)."""
    from solvers.experts.swap import group_exchanges

    kernel = MoveSwapKernel(
        nets.experts, problem.class_sig[:, nets.group], nets.src, nets.weight,
        num_items=problem.num_experts, num_domains=problem.num_domains, cost_mode=problem.cost_mode,
        load=problem.load, swap_label=problem.expert2group, linear=linear,
    )
    e2c = np.array(start, dtype=np.int64)
    cap_eff = None if cap is None else np.maximum(cap, problem.class_loads(e2c))
    out: list[np.ndarray] = []
    for _ in range(max_moves):
        kernel.init_state(e2c)
        best_val, best_map = kernel.total(e2c) - 0.5, None
        for cand in group_exchanges(problem, e2c, kernel.M, cap_eff):
            v = kernel.total(cand)
            if v < best_val:
                best_val, best_map = v, cand
        if best_map is None:
            break
        e2c = best_map
        loads = problem.class_loads(e2c)
        kernel.run_swaps(e2c, loads, None if cap_eff is None else np.maximum(cap_eff, loads), MAX_SWAPS)
        out.append(e2c.copy())
    return out


def move_frontier(problem: LayerProblem, solved_slots: np.ndarray, lm: LayerMoves,
                  load_tolerance: float | None) -> list[MoveCandidate]:
    """The layer's candidates (module docstring), the previous map first; duplicates dropped."""
    prev = np.asarray(lm.prev_expert2slot, dtype=np.int64)
    out = [_candidate(problem, lm, "previous", prev)]
    seen = {prev.tobytes()}

    def add(name: str, slots: np.ndarray) -> None:
        key = slots.tobytes()
        if key not in seen:
            seen.add(key)
            out.append(_candidate(problem, lm, name, slots))

    solved_slots = np.asarray(solved_slots, dtype=np.int64)
    add("solved", solved_slots)
    solved_e2c = problem.slot2class[solved_slots]
    add("solved_kept", keep_previous_slots(problem, solved_e2c, prev))
    if problem.trivial or load_tolerance is None:
        return _with_rebalanced(problem, lm, out)
    best = min(out, key=lambda c: c.crossings)
    gain = out[0].crossings - best.crossings
    L = _class_prices(problem, lm)
    # the searches keep expert groups whole in group-preserving mode: from a free previous map they
    # start at its nearest group-preserving map
    prev_e2c = group_preserving_start(problem, problem.slot2class[prev], L)
    cap = problem.load_cap(load_tolerance)
    lambdas: list[tuple[str, float]] = []
    if lm.price is not None:
        lambdas.append(("price", lm.price))
    if gain > 0:
        w_best = float(L[np.arange(problem.num_experts), problem.slot2class[best.expert2slot]].sum())
        scale = gain / max(1.0, w_best)
        lambdas += [(f"x{f:g}", scale * f) for f in LAMBDA_LADDER]
    for tag, lam in lambdas:
        for origin, start in (("previous", prev_e2c), ("solved", solved_e2c)):
            if origin == "solved" and tag not in ("price", "x1"):
                continue
            e2c = _penalised_search(problem, problem.nets_all, start, cap, lam * L)
            add(f"from_{origin}_{tag}", keep_previous_slots(problem, e2c, prev))
    if problem.group_preserving:  # whole expert groups move between positions: one exchange at a time
        for tag, lam in [("x0", 0.0)] + [(t, lam) for t, lam in lambdas if t in ("price", "x1")]:
            for i, e2c in enumerate(_group_path(problem, problem.nets_all, prev_e2c, cap, lam * L,
                                                problem.num_group_positions)):
                add(f"group_path_{tag}_{i + 1}", keep_previous_slots(problem, e2c, prev))
    return _with_rebalanced(problem, lm, out)


def cheap_frontier(problem: LayerProblem, lm: LayerMoves) -> list[MoveCandidate]:
    """The previous map and its rebalanced variants only (no search): for a layer left unsolved."""
    prev = np.asarray(lm.prev_expert2slot, dtype=np.int64)
    return _with_rebalanced(problem, lm, [_candidate(problem, lm, "previous", prev)])


def _with_rebalanced(problem: LayerProblem, lm: LayerMoves, cands: list[MoveCandidate]) -> list[MoveCandidate]:
    """``cands`` plus, for each candidate re-slotted around the previous GPUs, its rebalanced variants."""
    prev = np.asarray(lm.prev_expert2slot, dtype=np.int64)
    out = list(cands)
    seen = {c.expert2slot.tobytes() for c in cands}
    for c in cands:
        if c.name == "solved":
            continue
        for k in REBALANCE_SWAPS:
            slots = _rebalanced(problem, c.expert2slot, prev, k)
            if slots.tobytes() not in seen:
                seen.add(slots.tobytes())
                out.append(_candidate(problem, lm, f"{c.name}_rebalanced{k}", slots))
    return out


def _hull(cands: list[MoveCandidate]) -> list[MoveCandidate]:
    """The lower convex hull of (replicas, crossings) from the previous map (index 0), cheapest first."""
    pts = sorted(cands, key=lambda c: (c.replicas, c.crossings))
    pareto: list[MoveCandidate] = []
    for c in pts:
        if not pareto or c.crossings < pareto[-1].crossings:
            if pareto and c.replicas == pareto[-1].replicas:
                continue
            pareto.append(c)
    hull: list[MoveCandidate] = []
    for c in pareto:
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # b lies on or above the segment a-c: drop it
            if (b.crossings - a.crossings) * (c.replicas - a.replicas) >= (c.crossings - a.crossings) * (b.replicas - a.replicas):
                hull.pop()
            else:
                break
        hull.append(c)
    return hull


@dataclass(frozen=True)
class StepCurrency:
    """Predicted step time as the budget's currency (objective ``step_time`` with a performance block).

    A candidate of layer ``l`` enters :meth:`placement.predict.performance.StepTimeModel.predict` with its
    own expert load max/mean (exact, sampled tokens) and an all-to-all time of the previous map's
    (from the evaluator) scaled by its crossings over the previous map's.

    model : the instance's :class:`placement.predict.performance.StepTimeModel`.
    alltoall_s : (L,) the previous placement's ``alltoall_time_s_per_layer`` (sampled).
    load : (L,) its ``expert_load_max_over_mean_per_layer`` (sampled).
    rank2gpu : (world,) the rank layout.
    """

    model: object
    alltoall_s: np.ndarray
    load: np.ndarray
    rank2gpu: np.ndarray

    def step_s(self, a2a: np.ndarray, load: np.ndarray) -> float:
        return float(self.model.predict(a2a, load, self.rank2gpu).step_time_s)  # type: ignore[attr-defined]


def _pareto(cands: list[MoveCandidate]) -> list[MoveCandidate]:
    """Candidates no other beats on replicas, load and crossings at once (the previous map first)."""
    keep = []
    for i, c in enumerate(cands):
        dominated = any(
            (d.replicas <= c.replicas and d.load <= c.load and d.crossings <= c.crossings)
            and (d.replicas, d.load, d.crossings) != (c.replicas, c.load, c.crossings)
            for d in cands)
        if i == 0 or not dominated:
            keep.append(c)
    return keep


def _allocate_by_step(frontiers: dict[int, list[MoveCandidate]], budget: int,
                      step: StepCurrency) -> dict[int, MoveCandidate]:
    """Greedy on predicted step time saved per moved replica, within ``budget`` replicas.

    Lazy: entries ``(layer, candidate)`` wait in a heap with the ratio they had when priced; a popped
    entry priced before the last change is re-priced and pushed back; a fresh one is taken if it
    fits.  When the best fresh entry saves nothing, every entry is re-priced once (the slowest stage
    may have changed); the greedy ends when that saves nothing either.  Candidates are each layer's
    front on (replicas, load, crossings).  Ties: lower layer, then the candidate's order.
    """
    import heapq

    a2a, load = step.alltoall_s.astype(np.float64).copy(), step.load.astype(np.float64).copy()
    prev_cross = {li: cands[0].crossings for li, cands in frontiers.items()}

    def inputs(li: int, c: MoveCandidate) -> tuple[float, float]:
        base = step.alltoall_s[li]
        scaled = base * c.crossings / prev_cross[li] if prev_cross[li] > 0 else base
        return float(scaled), c.load

    def with_layer(li: int, c: MoveCandidate) -> float:
        a, lo = a2a.copy(), load.copy()
        a[li], lo[li] = inputs(li, c)
        return step.step_s(a, lo)

    fronts = {li: _pareto(cands) for li, cands in frontiers.items()}
    chosen = {li: cands[0] for li, cands in frontiers.items()}
    now = step.step_s(a2a, load)
    left = budget
    version = 0

    def priced() -> list[tuple[float, int, int, int]]:
        out = []
        for li, front in fronts.items():
            for j, c in enumerate(front):
                extra = c.replicas - chosen[li].replicas
                if 0 < extra <= left:
                    out.append((-(now - with_layer(li, c)) / extra, li, j, version))
        heapq.heapify(out)
        return out

    heap = priced()
    refreshed = True
    while heap:
        neg, li, j, ver = heapq.heappop(heap)
        c = fronts[li][j]
        extra = c.replicas - chosen[li].replicas
        if extra <= 0 or extra > left:
            continue
        if ver != version:
            heapq.heappush(heap, (-(now - with_layer(li, c)) / extra, li, j, version))
            continue
        if -neg <= 1e-12:
            if refreshed:
                break
            heap, refreshed = priced(), True
            continue
        chosen[li] = c
        a2a[li], load[li] = inputs(li, c)
        now = step.step_s(a2a, load)
        left -= extra
        version += 1
        refreshed = False
    return chosen


def allocate_moves(frontiers: dict[int, list[MoveCandidate]], plan: MovePlan,
                   bytes_per_crossing: float, step: StepCurrency | None = None) -> dict[int, MoveCandidate]:
    """Each layer's chosen candidate (module docstring); ``frontiers[l][0]`` is the previous map.

    ``step`` (a budget under the ``step_time`` objective): the budget buys predicted step time
    (:class:`StepCurrency`) instead of crossings.
    """
    if plan.max_moved_replicas is not None and step is not None:
        return _allocate_by_step(frontiers, plan.max_moved_replicas, step)
    if plan.max_moved_replicas is None:
        W = float(plan.move_cost or 0.0)
        out = {}
        for li, cands in frontiers.items():
            w = plan.layers[li].nvlink_weight

            def obj(c: MoveCandidate, w: float = w) -> float:
                return c.crossings * bytes_per_crossing + W * (c.cross + w * c.nvlink) * plan.bytes_per_replica

            order = {id(c): i for i, c in enumerate(cands)}
            if W == 0:  # moves are free: the solved map on ties (its balance), then fewer moves
                out[li] = min(cands, key=lambda c: (obj(c), c.name != "solved", c.replicas, order[id(c)]))
            else:
                out[li] = min(cands, key=lambda c: (obj(c), c.replicas, order[id(c)]))
        return out
    left = plan.max_moved_replicas
    chosen = {li: cands[0] for li, cands in frontiers.items()}
    assert all(c.name == "previous" and c.replicas == 0 for c in chosen.values())
    hulls = {li: _hull(cands) for li, cands in frontiers.items()}
    steps = []  # (-slope, layer, index along the hull)
    for li, h in hulls.items():
        for i in range(1, len(h)):
            d_rep, d_cross = h[i].replicas - h[i - 1].replicas, h[i - 1].crossings - h[i].crossings
            steps.append((-d_cross / d_rep, li, i))
    steps.sort()
    at = {li: 0 for li in hulls}
    blocked: set[int] = set()
    for _, li, i in steps:
        if li in blocked or at[li] != i - 1:
            continue
        extra = hulls[li][i].replicas - chosen[li].replicas
        if extra > left:
            blocked.add(li)
            continue
        left -= extra
        chosen[li], at[li] = hulls[li][i], i
    while True:  # single upgrades that still fit, best saving first (ties: lower layer)
        best: tuple[int, int, MoveCandidate] | None = None
        for li in sorted(frontiers):
            cur = chosen[li]
            for c in frontiers[li]:
                extra = c.replicas - cur.replicas
                saved = cur.crossings - c.crossings
                if saved > 0 and extra <= left and (best is None or saved > best[0]):
                    best = (saved, li, c)
        if best is None:
            break
        _, li, c = best
        left -= c.replicas - chosen[li].replicas
        chosen[li] = c
    return chosen


def build_plan_for(instance: Instance, rank2gpu: np.ndarray, request: object) -> MovePlan:
    """:func:`build_move_plan` from a :class:`placement.core.model.MoveRequest` (move cost 0 when it gives neither rule)."""
    from placement.core.model import MoveRequest
    from placement.core.movecount import replica_state_bytes

    assert isinstance(request, MoveRequest)
    bpr = replica_state_bytes(instance, params=request.expert_params, sharded_optimizer=request.sharded_optimizer)
    move_cost = request.move_cost
    if request.max_moved_bytes is None and move_cost is None:
        move_cost = 0.0
    return build_move_plan(instance, rank2gpu, request.previous, bytes_per_replica=bpr,
                           max_moved_bytes=request.max_moved_bytes, move_cost=move_cost)


def previous_check(instance: Instance, options: object, placement: Placement, plan: MovePlan | None) -> dict:
    """Under ``step_time``: the re-placement against keeping the previous placement, in predicted step
    time on the sampled window (plus, under a move cost, ``W`` times the move time: the move amortised).

    Returns ``{}`` for the byte objectives (the allocation already minimised bytes plus move cost);
    else the predictions, ``returned`` (``solved`` or ``previous placement``) and, when the previous
    placement wins (ties included: it moves nothing), ``return_placement``.
    """
    from placement.predict.cost import evaluate
    from placement.core.movecount import count_moves
    from placement.predict.performance import StepTimeModel
    from solvers.base import SolveOptions

    assert isinstance(options, SolveOptions) and options.moves is not None and plan is not None
    if options.objective != "step_time":
        return {}
    try:
        model = StepTimeModel(instance)
    except ValueError:
        return {"skipped": "no performance block: step_time fell back to total"}
    prev = options.moves.previous
    solved_s = float(model.step_time_s(evaluate(instance, placement), placement.rank2gpu))
    prev_s = float(model.step_time_s(evaluate(instance, prev), prev.rank2gpu))
    mc = count_moves(instance, prev, placement, bytes_per_replica=plan.bytes_per_replica)
    amortised_s = float(plan.move_cost or 0.0) * mc.move_time_s
    out: dict = {"solved_predicted_step_time_s": solved_s, "previous_predicted_step_time_s": prev_s,
                 "amortised_move_time_s": amortised_s}
    if mc.moved_replicas > 0 and prev_s <= solved_s + amortised_s:
        out.update(returned="previous placement", predicted_step_time_s=prev_s, fallback_to_default=False,
                   return_placement=Placement(prev.rank2gpu.copy(), prev.phy2log.copy()))
    else:
        out.update(returned="solved", predicted_step_time_s=solved_s, fallback_to_default=False)
    return out
