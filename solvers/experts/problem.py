"""One MoE layer's expert-placement problem for a fixed rank layout, and its exact cost.

A layer's stage has one or more EP groups that share its expert map; EP ranks with the same domain
signature form a *class* (:func:`solvers.kernels.domain_classes`), and the cross-domain cost of a
map depends only on which class each expert sits in.  Inside this package costs are *crossings*
(sampled tokens times remote domains, or remote experts, in the cost mode): integers, so CP-SAT
sees exact integer weights; bytes are crossings times :attr:`LayerProblem.bytes_per_crossing`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numpy as np

from placement.predict.cost import LayoutIndex
from placement.core.model import Instance, InvalidInputError, SolverError
from solvers.experts.tuning import VALIDATION_FRACTION
from solvers.kernels import bytes_per_crossing, domain_classes, net_crossings_of

__all__ = ["NetSet", "LayerProblem", "build_layer_problem", "net_crossings", "linear_costs", "net_pairs",
           "group2type_of", "is_structurally_valid", "unique_rows_inverse", "sample_nets"]


#: How a layer with several routing windows is fitted (:mod:`solvers.experts.windows`).
FITS: tuple[str, ...] = ("robust", "mean", "latest")


@dataclass(frozen=True)
class NetSet:
    """Aggregated nets of one layer: tokens with the same EP group, source domain and expert set.

    experts : (N, k) int64, the distinct expert ids of each net, sorted.
    group : (N,) int64, EP group (within the stage) of the net's source.
    src : (N,) int64, local domain index of the net's source GPU.
    weight : (N,) int64, how many sampled tokens the net stands for.
    """

    experts: np.ndarray
    group: np.ndarray
    src: np.ndarray
    weight: np.ndarray

    @property
    def num_nets(self) -> int:
        return int(self.weight.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.weight.sum())

    @staticmethod
    def aggregate(experts: np.ndarray, group: np.ndarray, src: np.ndarray) -> NetSet:
        """Aggregate tokens ``(T, k)`` with their group and source into weighted nets (sorted keys)."""
        experts = np.sort(np.asarray(experts, dtype=np.int64), axis=1)
        if experts.shape[0] == 0:
            k = experts.shape[1]
            z = np.zeros(0, dtype=np.int64)
            return NetSet(np.zeros((0, k), dtype=np.int64), z, z.copy(), z.copy())
        keys = np.column_stack([group, src, experts]).astype(np.int64)
        uniq, counts = _unique_rows(keys)
        return NetSet(
            experts=np.ascontiguousarray(uniq[:, 2:]),
            group=np.ascontiguousarray(uniq[:, 0]),
            src=np.ascontiguousarray(uniq[:, 1]),
            weight=counts.astype(np.int64),
        )


def _row_codes(keys: np.ndarray) -> np.ndarray | None:
    """(R,) one mixed-radix int64 code per non-negative int64 row, ordered as the rows are
    (lexicographically), or None when the rows do not fit 62 bits."""
    if keys.shape[0] == 0 or keys.min() < 0:
        return None
    radix = keys.max(axis=0) + 1  # (W,) per column
    if float(np.sum(np.log2(radix.astype(np.float64)))) >= 62:
        return None
    code = np.zeros(keys.shape[0], dtype=np.int64)
    for j in range(keys.shape[1]):  # most significant first: lexicographic order of the rows
        code = code * int(radix[j]) + keys[:, j]
    return code


def _unique_rows(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(keys, axis=0, return_counts=True)`` for int64 rows, the same rows in the same
    (lexicographic) order; when rows fit one int64 code, a 1-D unique on the codes (several times
    faster than the row sort on 10^5 tokens)."""
    code = _row_codes(keys)
    if code is None:
        return np.unique(keys, axis=0, return_counts=True)
    _, first, counts = np.unique(code, return_index=True, return_counts=True)
    return keys[first], counts


def unique_rows_inverse(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(keys, axis=0, return_inverse=True)`` for int64 rows ``(R, W)``: ``(unique rows
    (U, W) sorted, inverse (R,))``, by one int64 code per row when the rows fit one."""
    code = _row_codes(keys)
    if code is None:
        uniq, inverse = np.unique(keys, axis=0, return_inverse=True)
        return uniq, inverse.reshape(-1)
    _, first, inverse = np.unique(code, return_index=True, return_inverse=True)
    return keys[first], inverse.reshape(-1)


@dataclass(frozen=True)
class LayerProblem:
    """One MoE layer's expert-placement problem for a fixed rank layout.

    Shapes: ``E`` experts, ``C`` classes, ``G`` EP groups in the stage, ``D`` domains the stage
    touches (local indices), ``P`` group positions (group-preserving mode).

    layer : MoE layer index (position in ``model.moe_layers``).
    stage : its pipeline stage.
    cost_mode : ``per_domain`` or ``per_pair``.
    experts_per_rank : slots per EP rank.
    domains : (D,) global NVLink domain id of each local domain index.
    rank2class : (ep,) class of each EP rank.
    class_sig : (C, G) local domain of class ``c`` in EP group ``g``.
    class_capacity : (C,) expert slots of each class.
    load : (G, E) int64 (token, expert) pairs from EP group ``g``'s sources on expert ``e`` (all
        sampled tokens; with ``fit="latest"`` and several windows, the latest window's).
    bytes_per_crossing : fabric bytes per step of one crossing of one sampled token.
    nets_fit, nets_val, nets_all : the fit part, the validation part (empty if no split) and all
        sampled tokens, aggregated.
    group_preserving : whole expert groups move between group positions; experts only inside their
        group.
    expert_group_size : ``E / num_groups`` (contiguous logical ids per expert group, slots per
        group position).
    """

    layer: int
    stage: int
    cost_mode: str
    num_experts: int
    experts_per_rank: int
    domains: np.ndarray
    rank2class: np.ndarray
    class_sig: np.ndarray
    class_capacity: np.ndarray
    load: np.ndarray
    bytes_per_crossing: float
    nets_fit: NetSet
    nets_val: NetSet
    nets_all: NetSet
    group_preserving: bool
    expert_group_size: int
    # ---- several sampled windows (SolveOptions.fit; solvers.experts.windows) ---------------
    #: ``mean``, ``robust`` or ``latest``: how the fit weighs the sampled windows.
    fit: str = "mean"
    #: robust fit over several windows: each sampled window's nets, oldest first (else empty).
    windows: tuple[NetSet, ...] = ()
    #: how many of ``windows`` (the oldest) form the fit part; the rest is the validation part.
    fit_windows: int = 0
    #: the nets the refit searches when they are not ``nets_all`` (``latest``: the latest window).
    nets_refit: NetSet | None = None
    #: sampled windows of the instance (``routing.window_tokens``; 1 = one window).
    num_windows: int = 1

    # ---- derived structure -----------------------------------------------------------------
    @property
    def num_classes(self) -> int:
        return int(self.class_sig.shape[0])

    @property
    def num_ep_groups(self) -> int:
        return int(self.class_sig.shape[1])

    @property
    def num_domains(self) -> int:
        return int(self.domains.shape[0])

    @property
    def ep(self) -> int:
        return int(self.rank2class.shape[0])

    @cached_property
    def slot2class(self) -> np.ndarray:
        """(E,) class of each physical slot."""
        return np.repeat(self.rank2class, self.experts_per_rank)

    @property
    def trivial(self) -> bool:
        """True when every map costs the same (one class: each EP group lies in one domain)."""
        return self.num_classes == 1

    @property
    def num_group_positions(self) -> int:
        """P: group positions (``E / expert_group_size``; 1 in free mode)."""
        return self.num_experts // self.expert_group_size

    @cached_property
    def position_class_count(self) -> np.ndarray:
        """(P, C) slots of class ``c`` in group position ``p``."""
        P = self.num_group_positions
        s2c = self.slot2class.reshape(P, self.expert_group_size)
        out = np.zeros((P, self.num_classes), dtype=np.int64)
        for p in range(P):
            out[p] = np.bincount(s2c[p], minlength=self.num_classes)
        return out

    @cached_property
    def position_types(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(position2type (P,), type_count (T, C), type_mult (T,))``: positions with equal class make-up."""
        types, position2type, mult = np.unique(self.position_class_count, axis=0, return_inverse=True,
                                               return_counts=True)
        return position2type.reshape(-1).astype(np.int64), types.astype(np.int64), mult.astype(np.int64)

    @cached_property
    def expert2group(self) -> np.ndarray:
        """(E,) expert group of each logical expert."""
        return np.arange(self.num_experts) // self.expert_group_size

    @property
    def default_expert2class(self) -> np.ndarray:
        """(E,) class of each expert under the default (identity) map."""
        return self.slot2class.copy()

    def load_share(self) -> np.ndarray:
        """(G, C) each class's proportional share of each EP group's pairs (float)."""
        total = self.load.sum(axis=1).astype(np.float64)  # (G,)
        frac = self.class_capacity / self.num_experts  # slots share == ranks share
        return total[:, None] * frac[None, :]

    def class_loads(self, expert2class: np.ndarray) -> np.ndarray:
        """(G, C) pairs each class carries under ``expert2class``."""
        out = np.zeros((self.num_ep_groups, self.num_classes), dtype=np.int64)
        for g in range(self.num_ep_groups):
            out[g] = np.bincount(expert2class, weights=self.load[g], minlength=self.num_classes).astype(np.int64)
        return out

    def load_excess(self, expert2class: np.ndarray) -> float:
        """Smallest tolerance ``tol`` for which every class is within ``(1+tol)`` of its share."""
        share = self.load_share()
        loads = self.class_loads(expert2class)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(share > 0, loads / np.where(share > 0, share, 1.0), 0.0)
        return float(max(0.0, ratio.max() - 1.0))

    def load_cap(self, tol: float) -> np.ndarray:
        """(G, C) int64 largest pair count a class may carry at tolerance ``tol``."""
        # A tiny epsilon keeps a map whose excess was measured as exactly ``tol`` feasible.
        return np.floor(self.load_share() * (1.0 + tol) + 1e-6).astype(np.int64)

    def within_caps(self, expert2class: np.ndarray, cap: np.ndarray) -> bool:
        """Whether every class's load under ``expert2class`` is within ``cap`` (G, C)."""
        return bool((self.class_loads(expert2class) <= cap).all())


def build_layer_problem(
    instance: Instance,
    rank2gpu: np.ndarray,
    layer: int,
    *,
    group_preserving: bool,
    validation_fraction: float = VALIDATION_FRACTION,
    layout: LayoutIndex | None = None,
    fit: str = "mean",
) -> LayerProblem:
    """Collect one layer's classes, nets and loads for ``rank2gpu``.

    Parameters
    ----------
    instance : the problem (solver view is enough: only ``routing.topk`` is read).
    rank2gpu : (world,) GPU of each global rank.
    layer : MoE layer index.
    group_preserving : restrict to group-preserving maps (requires ``num_groups > 1``).
    validation_fraction : share of each source's sampled tokens (the last ones) held back; 0 = none.
    layout : a precomputed :class:`placement.predict.cost.LayoutIndex` for ``rank2gpu``.
    fit : how several sampled windows (``routing.window_tokens``) are used
        (:func:`window_parts`); with one window every value gives today's
        problem.
    """
    model = instance.model
    topk = np.asarray(instance.routing.topk[layer], dtype=np.int64)  # (dp, T, k)
    dp, T, k = topk.shape
    if layout is None or layout.src_rank.shape[2] != T:
        layout = LayoutIndex(instance, rank2gpu, T)
    s = int(instance.moe_layer2stage[layer])
    # (G, ep) the dispatcher's node of each EP rank of each group (placement.core.dispatch): its domain
    # under an equal-slice layout or ``per_pair``, a smaller node where HybridEP/DeepEP runs one
    group_dom = layout.group_node[s]
    domains = np.unique(group_dom)
    local = np.full(int(domains.max()) + 1, -1, dtype=np.int64)
    local[domains] = np.arange(domains.shape[0])
    class_sig, rank2class = domain_classes(local[group_dom])
    epr = instance.experts_per_rank
    capacity = np.bincount(rank2class, minlength=class_sig.shape[0]) * epr

    src_rank = layout.src_rank[s]  # (dp, T)
    src_group = layout.rank2group[src_rank]
    src_dom = local[group_dom[src_group, layout.rank2eprank[src_rank]]]
    if (src_dom < 0).any():  # pragma: no cover - sources are ranks of the stage's EP groups
        raise SolverError(f"layer {layer}: a source GPU lies outside its stage's EP groups")
    G = class_sig.shape[1]
    # -- several sampled windows (solvers.experts.windows): ``latest`` balances the latest alone --
    bounds_w = instance.routing.window_bounds()
    lo, hi = bounds_w[-1] if fit == "latest" else (0, T)
    load = np.zeros((G, model.num_experts), dtype=np.int64)
    for g in range(G):
        sel = src_group[:, lo:hi] == g
        load[g] = np.bincount(topk[:, lo:hi][sel].reshape(-1), minlength=model.num_experts)
    trivial = class_sig.shape[0] == 1
    extra: dict = {}
    if len(bounds_w) >= 2 and not trivial:
        nets_fit, nets_val, nets_all, extra = window_parts(topk, src_group, src_dom, bounds_w, fit,
                                                           validation_fraction)
        extra["num_windows"] = len(bounds_w)
    else:
        nets_fit, nets_val, nets_all = _split_nets(topk, src_group, src_dom, validation_fraction, trivial=trivial)
    gs = model.experts_per_group if group_preserving else model.num_experts
    if group_preserving and model.num_groups <= 1:
        raise InvalidInputError("group_preserving: the model has no expert groups (num_groups is 1)")
    return LayerProblem(
        layer=layer,
        stage=s,
        cost_mode=instance.cost_mode,
        num_experts=model.num_experts,
        experts_per_rank=epr,
        domains=domains.astype(np.int64),
        rank2class=rank2class,
        class_sig=class_sig,
        class_capacity=capacity.astype(np.int64),
        load=load,
        bytes_per_crossing=bytes_per_crossing(instance, T),
        nets_fit=nets_fit,
        nets_val=nets_val,
        nets_all=nets_all,
        group_preserving=group_preserving,
        expert_group_size=gs,
        fit=fit,
        **extra,
    )


def _split_nets(topk: np.ndarray, src_group: np.ndarray, src_dom: np.ndarray, validation_fraction: float, *,
                trivial: bool) -> tuple[NetSet, NetSet, NetSet]:
    """``(fit, validation, all)`` nets: each source's last ``validation_fraction`` of tokens validate."""
    dp, T, _ = topk.shape
    n_val = int(math.floor(T * validation_fraction)) if validation_fraction > 0 else 0
    is_val = np.broadcast_to(np.arange(T)[None, :], (dp, T)) >= T - n_val

    def nets(mask: np.ndarray) -> NetSet:
        return NetSet.aggregate(topk[mask], src_group[mask], src_dom[mask])

    if trivial:  # every map costs 0, no nets needed
        none = nets(np.zeros((dp, T), dtype=bool))
        return none, none, none
    nets_all = nets(np.ones((dp, T), dtype=bool))
    if n_val > 0:
        return nets(~is_val), nets(is_val), nets_all
    return nets_all, nets(np.zeros((dp, T), dtype=bool)), nets_all


def window_parts(
    topk: np.ndarray,
    src_group: np.ndarray,
    src_dom: np.ndarray,
    bounds: Sequence[tuple[int, int]],
    fit: str,
    validation_fraction: float,
) -> tuple[NetSet, NetSet, NetSet, dict]:
    """``(nets_fit, nets_val, nets_all, extra LayerProblem fields)`` of a layer with >= 2 windows.

    Parameters
    ----------
    topk : (dp, T, k) the layer's sampled expert ids, windows one after another along axis 1.
    src_group, src_dom : (dp, T) EP group and local source domain of every token.
    bounds : ``(start, stop)`` of each window along axis 1, oldest first (at least two).
    fit : ``robust``, ``mean`` or ``latest``.
    validation_fraction : 0 disables the guard (no validation part); otherwise, with ``robust`` and
        ``mean`` the latest window validates, with ``latest`` its last ``validation_fraction``.
    """
    if fit not in FITS:
        raise ValueError(f"fit: expected one of {', '.join(FITS)}, found {fit!r}")
    dp, T, _ = topk.shape
    cols = np.arange(T)

    def nets(mask_cols: np.ndarray) -> NetSet:
        mask = np.broadcast_to(mask_cols[None, :], (dp, T))
        return NetSet.aggregate(topk[mask], src_group[mask], src_dom[mask])

    nets_all = nets(np.ones(T, dtype=bool))
    if fit == "latest":
        a, b = bounds[-1]
        fit_l, val_l, all_l = _split_nets(topk[:, a:b], src_group[:, a:b], src_dom[:, a:b], validation_fraction,
                                          trivial=False)
        return fit_l, val_l, nets_all, {"nets_refit": all_l}
    per_window = tuple(nets((cols >= a) & (cols < b)) for a, b in bounds)
    extra: dict = {}
    if validation_fraction > 0:
        last = bounds[-1][0]
        fit_nets, val_nets = nets(cols < last), per_window[-1]
        n_fit = len(bounds) - 1
    else:
        fit_nets, val_nets = nets_all, nets(np.zeros(T, dtype=bool))
        n_fit = len(bounds)
    if fit == "robust":
        extra = {"windows": per_window, "fit_windows": n_fit}
    return fit_nets, val_nets, nets_all, extra


def sample_nets(nets: NetSet, max_nets: int, seed: int) -> NetSet:
    """At most about ``max_nets`` nets whose weights estimate every map's crossings without bias.

    Threshold sampling: with the smallest integer threshold ``tau`` for which the expected number
    of kept nets ``sum(min(1, w / tau))`` is at most ``max_nets``, a net of weight ``w >= tau`` is
    kept as it is, and a lighter one is kept with probability ``w / tau`` and then weighs ``tau``
    (its expected weight is ``w``).  Crossings are linear in the weights, so the sample's crossings
    of any fixed map are an unbiased estimate of the nets' own, and weights stay integers.  The
    draw is seeded (one uniform per net, in the nets' sorted order): the same nets and seed give the
    same sample.  Returns ``nets`` itself when it has at most ``max_nets`` nets.

    Examples
    --------
    >>> nets = NetSet.aggregate(np.array([[0, 1]] * 5 + [[0, 2], [1, 2], [2, 3]]), np.zeros(8, int), np.zeros(8, int))
    >>> s = sample_nets(nets, 2, seed=0)
    >>> s.num_nets <= nets.num_nets and int(s.weight.max()) == 5
    True
    """
    n = nets.num_nets
    if n <= max(1, int(max_nets)):
        return nets
    w = nets.weight.astype(np.float64)
    hi = max(int(w.max()) + 1, int(math.ceil(w.sum() / max(1, int(max_nets)))))  # tau = hi always fits
    lo = 1
    while lo < hi:  # smallest integer tau with sum(min(1, w / tau)) <= max_nets
        mid = (lo + hi) // 2
        if np.minimum(1.0, w / mid).sum() <= max_nets:
            hi = mid
        else:
            lo = mid + 1
    tau = lo
    u = np.random.default_rng(seed).random(n)
    keep = (w >= tau) | (u * tau < w)
    weight = np.where(w >= tau, nets.weight, tau).astype(np.int64)
    return NetSet(
        experts=np.ascontiguousarray(nets.experts[keep]),
        group=np.ascontiguousarray(nets.group[keep]),
        src=np.ascontiguousarray(nets.src[keep]),
        weight=np.ascontiguousarray(weight[keep]),
    )


def net_crossings(nets: NetSet, expert2class: np.ndarray, class_sig: np.ndarray, cost_mode: str) -> int:
    """Crossings (integer) of ``nets`` under ``expert2class``.

    ``per_domain``: each net pays its weight once per distinct remote domain of its experts;
    ``per_pair``: once per expert outside its source domain.

    Examples
    --------
    >>> nets = NetSet.aggregate(np.array([[0, 1], [2, 3]]), np.array([0, 0]), np.array([0, 1]))
    >>> sig = np.array([[0], [1]])          # class 0 is domain 0, class 1 is domain 1
    >>> net_crossings(nets, np.array([0, 1, 1, 0]), sig, "per_domain")
    2
    >>> net_crossings(nets, np.array([1, 1, 0, 0]), sig, "per_pair")
    4
    """
    if nets.num_nets == 0:
        return 0
    dom = class_sig[expert2class[nets.experts], nets.group[:, None]]  # (N, k) seen from the net's EP group
    return net_crossings_of(dom, nets.src, nets.weight, cost_mode)


def net_pairs(nets: NetSet) -> tuple[np.ndarray, np.ndarray]:
    """(P,) net index and (P,) expert of every (net, expert) incidence, net-major."""
    n, k = nets.experts.shape
    return np.repeat(np.arange(n), k), nets.experts.reshape(-1)


def linear_costs(problem: LayerProblem, nets: NetSet) -> np.ndarray:
    """(E, C) crossings if each expert alone paid per remote (token, expert) pair.

    Exact for ``per_pair``; for ``per_domain`` an upper-bounding proxy (a token with several experts
    in one remote domain pays once there, not once per expert).
    """
    E, C = problem.num_experts, problem.num_classes
    out = np.zeros((E, C), dtype=np.float64)
    if nets.num_nets == 0:
        return out
    pn, pe = net_pairs(nets)
    g, s, w = nets.group[pn], nets.src[pn], nets.weight[pn].astype(np.float64)
    for c in range(C):
        out[:, c] = np.bincount(pe, weights=w * (problem.class_sig[c, g] != s), minlength=E)
    return out


def group2type_of(problem: LayerProblem, expert2class: np.ndarray) -> np.ndarray | None:
    """(num_groups,) position type each expert group occupies under a group-preserving class map
    (None in free mode).

    Raises
    ------
    SolverError
        When an expert group's class make-up is that of no group position.
    """
    if not problem.group_preserving:
        return None
    _, type_count, _ = problem.position_types
    gs = problem.expert_group_size
    out = np.empty(problem.num_group_positions, dtype=np.int64)
    for p in range(problem.num_group_positions):
        cnt = np.bincount(expert2class[p * gs : (p + 1) * gs], minlength=problem.num_classes)
        match = np.flatnonzero((type_count == cnt[None, :]).all(axis=1))
        if match.shape[0] != 1:
            raise SolverError(f"layer {problem.layer}: expert group {p} fits no group position type")
        out[p] = match[0]
    return out


def is_structurally_valid(problem: LayerProblem, expert2class: np.ndarray) -> bool:
    """Exact class capacities and, in group-preserving mode, each position type taken as often as it exists."""
    if not np.array_equal(np.bincount(expert2class, minlength=problem.num_classes), problem.class_capacity):
        return False
    if problem.group_preserving:
        try:
            g2t = group2type_of(problem, expert2class)
        except SolverError:
            return False
        assert g2t is not None  # group-preserving mode
        _, _, mult = problem.position_types
        return bool(np.array_equal(np.bincount(g2t, minlength=mult.shape[0]), mult))
    return True
