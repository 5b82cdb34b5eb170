"""Starts that see co-activation: a multilevel coarsening of the experts by co-selection, and
Mt-KaHyPar's partition (when the ``peers`` extra is installed), each turned into a valid class map.

The swap search (:mod:`solvers.experts.swap`) moves one pair of experts at a time from starts that
the linear proxy (:func:`solvers.experts.problem.linear_costs`, each expert's affinity to the
sources' domains) sets up; it cannot see that a clique of experts chosen together should move as one.
Both starts here do.

Multilevel coarsening (:func:`coarsen_start`, the default start, no extra needed):

1. The co-selection graph of the fit nets (:func:`coactivation_graph`): edge ``(e, f)`` weighs
   ``sum_n w_n / (k_n - 1)`` over the nets ``n`` holding both (the clique expansion that keeps every
   net's total weight).
2. Heavy-edge matching, level by level (:func:`matching_levels`): nodes by their heaviest edge,
   each taking its heaviest unmatched neighbour (ties: lowest ids), then the leftovers in id order,
   so every node of a level has the same size ``2^l``; down to the largest power of two dividing every class capacity
   (at most :data:`MAX_COARSE_SIZE`).
3. The coarsest nodes go to classes by the exact counts kernel (:func:`solvers.kernels.assign_to_counts`,
   each class receives ``capacity / size`` nodes) on the summed linear proxy.
4. Uncoarsening: at every level the exact swap kernel (:class:`solvers.kernels.NetSwapSearch`) runs on
   the *coarse nets* (each net's experts mapped to their nodes; ``per_domain`` nets keep each node
   once, so a coarse net's crossings are exactly its experts'), with the load caps on the nodes'
   summed loads; a swap of two equal-size nodes keeps every class count.
5. The expert-level map is made valid (:func:`to_valid_map`): kept when it meets the structure and
   the caps, else the nearest map that does (an assignment that charges each expert for leaving its
   class, with the load prices of :func:`solvers.experts.greedy.capped_greedy`; in group-preserving
   mode its two-level assignment keeps expert groups whole).

Mt-KaHyPar (:func:`kahypar_start`): the fit nets as a hypergraph over the experts plus one fixed
vertex per class (a net's first pin is its source's class; with several EP groups per stage that is
the first class in the source's domain, an upper bound on the cost as in :mod:`solvers.kahypar`),
connectivity-minus-one objective, exact class capacities, the ``DETERMINISTIC`` preset, one thread
and ``mtkahypar.set_seed(seed)``; over-full blocks repaired, then :func:`to_valid_map`.

Both are deterministic: no clock, no unseeded randomness.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from solvers.experts.greedy import capped_greedy
from solvers.experts.problem import LayerProblem, NetSet, is_structurally_valid, linear_costs
from solvers.kernels import NetSwapSearch, assign_to_counts

__all__ = ["MAX_COARSE_SIZE", "coactivation_graph", "matching_levels", "coarse_nets", "coarsen_start",
           "to_valid_map", "kahypar_available", "kahypar_start"]

#: Largest coarse node (experts); also bounded by the largest power of two dividing every class capacity.
MAX_COARSE_SIZE = 16
#: Swaps per uncoarsening level (deterministic: a count, never seconds).
COARSE_MAX_SWAPS = 200
#: Levels with more nodes than this are projected without refinement: the expert-level swap search
#: that follows every start does that work.  On 4 dsv3_ep256 layers (free mode) refining every level
#: cut the polished start's fit crossings 0.3% more than refining up to 32 nodes, for 3.2x the time.
COARSE_MAX_REFINED_NODES = 32


def coactivation_graph(nets: NetSet, num_experts: int) -> np.ndarray:
    """(E, E) float64 symmetric co-selection weights, ``W[e, f] = sum_n w_n / (k - 1)`` over nets
    holding both ``e`` and ``f`` (zero diagonal).

    Examples
    --------
    >>> nets = NetSet.aggregate(np.array([[0, 1, 2], [0, 1, 3]]), np.zeros(2, int), np.zeros(2, int))
    >>> coactivation_graph(nets, 4)[0].tolist()
    [0.0, 1.0, 0.5, 0.5]
    """
    E = num_experts
    W = np.zeros((E, E), dtype=np.float64)
    n, k = nets.experts.shape
    if n == 0 or k < 2:
        return W
    w = nets.weight.astype(np.float64) / (k - 1)
    for i in range(k):
        for j in range(i + 1, k):
            a, b = nets.experts[:, i], nets.experts[:, j]
            W += np.bincount(a * E + b, weights=w, minlength=E * E).reshape(E, E)
    W = W + W.T
    np.fill_diagonal(W, 0.0)
    return W


def _match(W: np.ndarray) -> np.ndarray:
    """(V,) pair index of every node by heavy-edge matching; ``V`` must be even.

    Nodes are visited by their heaviest edge, heaviest first (ties: lowest id); an unmatched node
    takes its heaviest unmatched neighbour (ties: lowest id); nodes left without a neighbour of
    positive weight are paired in id order.  Pair ids are numbered in order of each pair's lowest node.
    """
    V = W.shape[0]
    mate = np.full(V, -1, dtype=np.int64)
    free = np.ones(V, dtype=bool)
    for u in np.lexsort((np.arange(V), -W.max(axis=1))).tolist():
        if not free[u]:
            continue
        free[u] = False
        row = np.where(free, W[u], 0.0)
        v = int(np.argmax(row))
        if row[v] <= 0:
            free[u] = True
            continue
        free[v] = False
        mate[u], mate[v] = v, u
    left = np.flatnonzero(mate < 0)
    for a, b in zip(left[0::2], left[1::2]):
        mate[a], mate[b] = b, a
    pair = np.full(V, -1, dtype=np.int64)
    nxt = 0
    for v in range(V):
        if pair[v] < 0:
            pair[v] = pair[mate[v]] = nxt
            nxt += 1
    return pair


def matching_levels(W: np.ndarray, levels: int) -> list[np.ndarray]:
    """Heavy-edge matchings of the co-selection graph ``W`` (E, E), ``levels`` times.

    Returns ``[expert2node at level 1, ..., at level L]``, each (E,) int64: at level ``l`` every node
    holds ``2^l`` experts.  ``E`` must be divisible by ``2^levels``.
    """
    E = W.shape[0]
    if E % (2 ** levels):
        raise ValueError(f"{E} experts cannot be halved {levels} times")
    out: list[np.ndarray] = []
    e2v = np.arange(E, dtype=np.int64)
    Wv = W
    for _ in range(levels):
        V = Wv.shape[0]
        pair = _match(Wv)
        H = V // 2  # W of the pairs: sum over their members (no BLAS: it contends for cores under load)
        Wv = np.bincount((pair[:, None] * H + pair[None, :]).reshape(-1), weights=Wv.reshape(-1),
                         minlength=H * H).reshape(H, H)
        np.fill_diagonal(Wv, 0.0)
        e2v = pair[e2v]
        out.append(e2v.copy())
    return out


def coarse_nets(nets: NetSet, e2v: np.ndarray, num_nodes: int, cost_mode: str) -> NetSet:
    """The nets with experts replaced by their nodes, padded with the id ``num_nodes``, aggregated.

    ``per_domain``: a node appears once per net (its experts share a class, so a net's distinct remote
    domains do not change); repeats become the pad.  ``per_pair``: repeats are kept (each expert is a
    pair).  The pad always sits in the net's own source domain (see :func:`coarsen_start`).
    """
    ex = np.sort(e2v[nets.experts], axis=1)
    if cost_mode == "per_domain" and ex.shape[1] > 1:
        dup = np.zeros_like(ex, dtype=bool)
        dup[:, 1:] = ex[:, 1:] == ex[:, :-1]
        ex = np.sort(np.where(dup, num_nodes, ex), axis=1)
    if ex.shape[0] == 0:
        return NetSet(ex, nets.group, nets.src, nets.weight)
    keys = np.column_stack([nets.group, nets.src, ex])
    uniq, inv = np.unique(keys, axis=0, return_inverse=True)
    weight = np.bincount(inv.reshape(-1), weights=nets.weight, minlength=uniq.shape[0]).astype(np.int64)
    return NetSet(np.ascontiguousarray(uniq[:, 2:]), np.ascontiguousarray(uniq[:, 0]),
                  np.ascontiguousarray(uniq[:, 1]), weight)


def _refine_level(problem: LayerProblem, nets: NetSet, e2v: np.ndarray, num_nodes: int, v2c: np.ndarray,
                  cap: np.ndarray) -> np.ndarray:
    """Best-improvement swaps of equal-size nodes on the level's coarse nets (exact crossings)."""
    C = problem.num_classes
    cn = coarse_nets(nets, e2v, num_nodes, problem.cost_mode)
    if cn.num_nets == 0:
        return v2c
    # classes 0..C-1 as seen from each net, plus a pad class C that is each net's own source domain
    ncd = np.vstack([problem.class_sig[:, cn.group], cn.src[None, :]])
    G = problem.num_ep_groups
    load = np.zeros((G, num_nodes + 1), dtype=np.int64)
    for g in range(G):
        load[g, :num_nodes] = np.bincount(e2v, weights=problem.load[g], minlength=num_nodes).astype(np.int64)
    label = np.zeros(num_nodes + 1, dtype=np.int64)
    label[num_nodes] = 1  # the pad never swaps
    kernel = NetSwapSearch(cn.experts, ncd, cn.src, cn.weight, num_items=num_nodes + 1,
                           num_domains=problem.num_domains, cost_mode=problem.cost_mode, load=load, swap_label=label)
    ext = np.concatenate([v2c, [C]]).astype(np.int64)
    loads = np.zeros((G, C + 1), dtype=np.int64)
    for g in range(G):
        loads[g] = np.bincount(ext, weights=load[g], minlength=C + 1).astype(np.int64)
    big = np.iinfo(np.int64).max // 4
    cap_ext = np.hstack([np.maximum(cap, loads[:, :C]), np.full((G, 1), big, dtype=np.int64)])
    kernel.run_swaps(ext, loads, cap_ext, COARSE_MAX_SWAPS)
    return ext[:num_nodes]


def _coarsest_size(problem: LayerProblem) -> int:
    g = 0
    for c in problem.class_capacity:
        g = math.gcd(g, int(c))
    size = 1
    while size * 2 <= MAX_COARSE_SIZE and g % (size * 2) == 0:
        size *= 2
    return size


def to_valid_map(problem: LayerProblem, target: np.ndarray, cap: np.ndarray, cost: np.ndarray) -> np.ndarray | None:
    """``target`` (E,) if it meets the layer's structure and ``cap``; else the nearest map that does.

    Nearest: an assignment charging each expert a constant for leaving its ``target`` class plus the
    linear proxy ``cost`` (E, C), under the load prices of :func:`solvers.experts.greedy.capped_greedy`
    (group-preserving mode: expert groups kept whole); the constant is 4, then 0.5, then 0.1 times the
    largest proxy cost, until a map within the caps is found.  None when none is.
    """
    target = np.asarray(target, dtype=np.int64)
    if is_structurally_valid(problem, target) and problem.within_caps(target, cap):
        return target
    scale = float(np.abs(cost).max()) + 1.0
    away = np.ones((problem.num_experts, problem.num_classes))
    away[np.arange(problem.num_experts), target] = 0.0
    for weight in (4.0, 0.5, 0.1):  # softer pulls towards the target until the load prices can fit the caps
        m = capped_greedy(problem, cost + weight * scale * away, cap)
        if m is not None:
            return m
    return None


def coarsen_start(problem: LayerProblem, nets: NetSet, cap: np.ndarray, cost: np.ndarray) -> np.ndarray | None:
    """The multilevel start (module docstring) on ``nets``, a valid map within ``cap`` or None.

    ``cost`` is the linear proxy (E, C) on the same nets.  In group-preserving mode the coarsening
    runs as in free mode and :func:`to_valid_map` then keeps expert groups whole.  None when the class
    capacities are odd (nothing to coarsen) or there is a single class.
    """
    if problem.num_classes < 2 or nets.num_nets == 0:
        return None
    size = _coarsest_size(problem)
    if size < 2:
        return None
    free = dataclasses.replace(problem, group_preserving=False, expert_group_size=problem.num_experts) \
        if problem.group_preserving else problem
    E = problem.num_experts
    levels = matching_levels(coactivation_graph(nets, E), int(round(math.log2(size))))
    # coarsest level: nodes to classes with exact counts on the summed proxy
    e2v = levels[-1]
    V = E // size
    node_cost = np.zeros((V, problem.num_classes))
    np.add.at(node_cost, e2v, cost)
    v2c, _ = assign_to_counts(node_cost, problem.class_capacity // size)
    # uncoarsen: refine each level, project to the next finer one
    for li in range(len(levels) - 1, -1, -1):
        e2v = levels[li]
        V = E // (2 ** (li + 1))
        if V <= COARSE_MAX_REFINED_NODES:
            v2c = _refine_level(free, nets, e2v, V, v2c, cap)
        e2c = v2c[e2v]
        if li > 0:
            finer = levels[li - 1]
            v2c = np.empty(E // (2 ** li), dtype=np.int64)
            v2c[finer] = e2c
    return to_valid_map(problem, e2c, cap, cost)


def kahypar_available() -> bool:
    """Whether Mt-KaHyPar's Python API (the ``peers`` extra) can be imported."""
    try:
        import mtkahypar  # noqa: F401
    except ImportError:
        return False
    return all(hasattr(mtkahypar, n) for n in ("initialize", "set_seed", "PresetType", "Objective"))


def kahypar_start(problem: LayerProblem, nets: NetSet, cap: np.ndarray, cost: np.ndarray, *,
                  seed: int) -> np.ndarray | None:
    """Mt-KaHyPar's partition of the experts into the classes (module docstring), made valid.

    None when the extra is missing or there is a single class.
    """
    if problem.num_classes < 2 or nets.num_nets == 0 or not kahypar_available():
        return None
    from solvers.kernels.hypergraph import RUNTIME, repair_capacities
    import mtkahypar

    E, C = problem.num_experts, problem.num_classes
    sig = problem.class_sig[:, nets.group]  # (C, N)
    src_class = np.argmax(sig == nets.src[None, :], axis=0)  # first class in the source's domain
    pins = np.hstack([(E + src_class)[:, None], nets.experts]).astype(np.int64)
    weights = nets.weight.astype(np.int64)
    init = RUNTIME.initializer(1)
    presets = mtkahypar.PresetType
    ctx = init.context_from_preset(presets.DETERMINISTIC)
    ctx.set_partitioning_parameters(C, 0.0, mtkahypar.Objective.KM1)
    capacity = problem.class_capacity.astype(np.int64)
    ctx.set_individual_target_block_weights([int(c) + 1 for c in capacity])  # + its fixed class vertex
    ctx.logging = False
    mtkahypar.set_seed(int(seed))
    nv = E + C
    hg = init.create_hypergraph(ctx, nv, pins.shape[0], pins.tolist(), [1] * nv, weights.tolist())
    hg.add_fixed_vertices([-1] * E + list(range(C)), C)
    v2b = np.asarray(hg.partition(ctx).get_partition(), dtype=np.int64)
    if not (v2b[E:] == np.arange(C)).all():  # pragma: no cover - Mt-KaHyPar keeps fixed vertices
        return None
    v2b = repair_capacities(pins, weights, v2b, np.arange(E), capacity)
    return to_valid_map(problem, v2b[:E], cap, cost)
