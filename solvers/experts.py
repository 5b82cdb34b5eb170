"""The expert placer: every MoE layer's expert map for a FIXED rank layout (DESIGN.md section 7).

Once ``rank2gpu`` is fixed, every layer is an independent problem.  A layer's stage has one or more
EP groups that share its expert map; EP ranks with the same *domain signature* (the NVLink domain
of that EP rank in every EP group of the stage) form a **class**, and the cross-domain cost of a map
depends only on which class each expert sits in.  A stage whose EP groups each lie in one domain has
one class: every map costs 0 there and the layer is only balanced.  Otherwise, per layer:

Step 1, experts -> classes (the cross-domain part), on the *fit* tokens:
    a. a greedy: a linear proxy cost (exact for ``per_pair``) solved as an assignment problem with
       exact class capacities, with Lagrangian prices on the per-class load caps;
    b. a swap search with exact incremental deltas (:class:`SwapSearch`) from the greedy, the
       default map, the map the rank layout was scored with, and in free mode a start that keeps
       the model's expert groups whole;
    c. the layer's search.  Group-preserving mode (whole expert groups on blocks of ``E/G``
       contiguous slots, experts only inside their group): :func:`group_search`, a branch and bound
       over group -> block-type assignments whose bounds are exact for whole blocks, with swap-search
       restarts from the most promising assignments and CP-SAT on the small subproblems.  Free mode:
       the CP-SAT model (:func:`build_cpsat_model`: ``x[e, c]`` expert in class; ``per_domain``
       ``y[n, d] >= x[e, c]`` for every expert of aggregated net ``n`` and class remote in ``d``,
       minimise ``sum w_n y[n, d]``; ``per_pair`` linear in ``x``; capacities; load caps; a complete
       hint) when its deterministic budget fits the model's size, else a seeded iterated local search.
Step 2, experts -> GPUs inside each class (and block): longest-processing-time packing plus swaps
    to bring every EP group's expert load max/mean toward :data:`GPU_LOAD_TOLERANCE` (met wherever
    the class and group structure allow it).  Cost is unaffected (it depends only on classes).
Step 3, guard against fitting the sample: each source's sampled tokens are split by index into a
    fit part (the first 3/4) and a validation part (the last 1/4, the "later" tokens).  The default
    map, the swap search's and the search's maps are judged on the validation part; if an optimised
    one wins, the search runs again on all sampled tokens from it (its bound is then a bound on the
    sampled objective) and its map is kept only if still no worse than the default on the
    validation part.  If the default wins, the layer keeps the default's classes (rebalanced).

Load caps: each class carries at most ``(1 + tol)`` times its proportional share of every EP group's
(token, expert) pairs; ``tol`` starts at :data:`CLASS_LOAD_TOLERANCE` (free mode) or
:data:`CLASS_LOAD_TOLERANCE_GROUP_PRESERVING` and is doubled, and reported,
only while no map meets it (never beyond the default map's own excess, which always fits).  Bounds
are over the maps within the caps plus the default map.

What CP-SAT does and does not do here (measured, dsv3_1024 and qwen3_256 under load): on full layer
models (25k-500k net links) single-worker CP-SAT returned its hint unchanged with bounds at 0-40% of
the objective, and on a 32-expert split-group subproblem it neither improved nor beat the
enumeration bound in 8 deterministic seconds; on small models (the tests' instances, tiny) it proves
optimality.  So it runs where its budget fits the model (:data:`CPSAT_DET_PER_LINK`,
:data:`SUBPROBLEM_MAX_FREE_EXPERTS`), and the budget goes to restarts elsewhere.

Units: inside this module costs are *crossings* (sampled tokens times remote domains, or remote
experts, in the cost mode): integers, so CP-SAT sees exact integer weights.  Bytes come from one
conversion, :attr:`LayerProblem.bytes_per_crossing` (the evaluator's real tokens per sampled token
times ``2 * (dispatch + combine)``), and :func:`place_experts` checks every layer against the
evaluator.

Determinism: nothing reads the clock to decide anything except the safety nets.  CP-SAT runs single
threaded with ``max_deterministic_time`` (a budget derived from the time limit, see
:func:`deterministic_budget`) and a fixed ``random_seed``; ``max_time_in_seconds`` is a safety net
only (``wall_clock_cut`` in the details when it fires); swap searches, restarts and iterated local
search count moves, never seconds.  Layers run in a process pool (spawned, one CP-SAT worker each)
and are gathered in layer order, so the same instance, seed, time limit and worker count give the
same placement.  At the deadline or a stop request, layers not yet solved keep the default map.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from functools import cached_property
from multiprocessing import get_context
from typing import Callable, Sequence

import numpy as np
from scipy import sparse
from scipy.optimize import linear_sum_assignment

from placement.cost import LayoutIndex, evaluate
from placement.model import InfeasibleError, Instance, InvalidInputError, Placement, SolverError
from solvers.base import SolveOptions

__all__ = [
    "CLASS_LOAD_TOLERANCE",
    "CLASS_LOAD_TOLERANCE_GROUP_PRESERVING",
    "GPU_LOAD_TOLERANCE",
    "VALIDATION_FRACTION",
    "DET_PER_WALL_S",
    "CPSAT_DET_PER_LINK",
    "MAX_GROUP_ASSIGNMENTS",
    "MAX_REFINED_ASSIGNMENTS",
    "SUBPROBLEM_MAX_FREE_EXPERTS",
    "POOL_MIN_PAIRS",
    "NetSet",
    "LayerProblem",
    "LayerBudget",
    "LayerOutcome",
    "ExpertPlan",
    "GreedyDomains",
    "GroupSearchResult",
    "CpsatModel",
    "CpsatRun",
    "build_layer_problem",
    "net_crossings",
    "layer_domain_cost",
    "linear_costs",
    "assign_classes",
    "greedy_expert_domains",
    "SwapSearch",
    "iterated_local_search",
    "num_group_assignments",
    "group_search",
    "balance_ranks",
    "rank_load_ratio",
    "rank_load_floor",
    "build_cpsat_model",
    "run_cpsat",
    "solve_layer",
    "place_experts",
    "deterministic_budget",
]

log = logging.getLogger(__name__)

#: A class's load may exceed its proportional share of each EP group's (token, expert) pairs by this
#: fraction in free mode: the GPU target's, so a class at its cap can still be balanced to the target
#: inside (relaxed per layer, and reported, only when no map meets it).  On qwen3_256, 0.05 instead
#: cost 8% more bytes for no better held-out balance.
CLASS_LOAD_TOLERANCE = 0.10
#: The same in group-preserving mode, tighter: there per-GPU balance is set by whole groups' loads
#: and by which experts of a split group share a few ranks, and a looser class cap lets heavy
#: experts pile into split blocks (dsv3_1024, default layout: 0.10 saved 0.6% of bytes and raised
#: the worst max/mean from 1.54 to 1.71).
CLASS_LOAD_TOLERANCE_GROUP_PRESERVING = 0.05
#: Target for every EP group's expert load max/mean per GPU after step 2 (met where routing allows).
GPU_LOAD_TOLERANCE = 1.10
#: Share of each source's sampled tokens (the last ones) held back to validate candidates.
VALIDATION_FRACTION = 0.25
#: CP-SAT deterministic-time units per wall second of one worker (model building included), calibrated
#: on the project machine with ``python benchmarks/solve_bench.py --calibrate``: 0.62-0.88 at load
#: average 0.8, about 0.2 at load 6-8 (two cores shared by several jobs).  The loaded value is used, so
#: a busy machine still fits the limit.  Budgets are set in deterministic time so results do not
#: depend on the load; this ratio only converts the user's wall-clock limit into such a budget.
DET_PER_WALL_S = 0.2
#: Wall seconds charged per layer for everything that is not CP-SAT (greedy, local search,
#: balancing, bookkeeping), per 10,000 aggregated nets; used only to size the CP-SAT budget.
_OVERHEAD_S_PER_10K_NETS = 0.8
#: Share of the time limit (less the fixed reserve) planned for CP-SAT; the rest is slack.
_CPSAT_SHARE = 0.6
#: Fixed wall seconds kept for process start-up, the final evaluation and writing.
_FIXED_OVERHEAD_S = 6.0
#: Sampled (token, expert) pairs on straddling layers from which a process pool pays for its start.
POOL_MIN_PAIRS = 200_000
#: Local-search limits (deterministic: counted in swaps, never in seconds).
_MAX_SWAPS = 400
_MAX_GROUP_ROUNDS = 8


# =============================================================================================
# Problem data
# =============================================================================================
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
        uniq, counts = np.unique(keys, axis=0, return_counts=True)
        return NetSet(
            experts=np.ascontiguousarray(uniq[:, 2:]),
            group=np.ascontiguousarray(uniq[:, 0]),
            src=np.ascontiguousarray(uniq[:, 1]),
            weight=counts.astype(np.int64),
        )


@dataclass(frozen=True)
class LayerProblem:
    """One MoE layer's expert-placement problem for a fixed rank layout.

    Shapes: ``E`` experts, ``C`` classes, ``G`` EP groups in the stage, ``D`` domains the stage
    touches (local indices), ``B`` group blocks (group-preserving mode).

    layer : MoE layer index (position in ``model.moe_layers``).
    stage : its pipeline stage.
    cost_mode : ``per_domain`` or ``per_pair``.
    experts_per_rank : slots per EP rank.
    domains : (D,) global NVLink domain id of each local domain index.
    rank2class : (ep,) class of each EP rank.
    class_sig : (C, G) local domain of class ``c`` in EP group ``g``.
    class_capacity : (C,) expert slots of each class.
    load : (G, E) int64 (token, expert) pairs from EP group ``g``'s sources on expert ``e`` (all
        sampled tokens).
    bytes_per_crossing : fabric bytes per step of one crossing of one sampled token.
    nets_fit, nets_val, nets_all : the fit part, the validation part (empty if no split) and all
        sampled tokens, aggregated.
    group_preserving : whole expert groups move between blocks; experts only inside their group.
    expert_group_size : ``E / num_groups`` (contiguous logical ids per group, slots per block).
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
    def num_blocks(self) -> int:
        return self.num_experts // self.expert_group_size

    @cached_property
    def block_class_count(self) -> np.ndarray:
        """(B, C) slots of class ``c`` in group block ``b``."""
        s2c = self.slot2class.reshape(self.num_blocks, self.expert_group_size)
        out = np.zeros((self.num_blocks, self.num_classes), dtype=np.int64)
        for b in range(self.num_blocks):
            out[b] = np.bincount(s2c[b], minlength=self.num_classes)
        return out

    @cached_property
    def block_types(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(block2type (B,), type_count (T, C), type_mult (T,))``: blocks with equal class make-up."""
        bcc = self.block_class_count
        types, block2type, mult = np.unique(bcc, axis=0, return_inverse=True, return_counts=True)
        return block2type.reshape(-1).astype(np.int64), types.astype(np.int64), mult.astype(np.int64)

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


def build_layer_problem(
    instance: Instance,
    rank2gpu: np.ndarray,
    layer: int,
    *,
    group_preserving: bool,
    validation_fraction: float = VALIDATION_FRACTION,
    layout: LayoutIndex | None = None,
) -> LayerProblem:
    """Collect one layer's classes, nets and loads for ``rank2gpu``.

    Parameters
    ----------
    instance : the problem (solver view is enough: only ``routing.topk`` is read).
    rank2gpu : (world,) GPU of each global rank.
    layer : MoE layer index.
    group_preserving : restrict to group-preserving maps (requires ``num_groups > 1``).
    validation_fraction : share of each source's sampled tokens (the last ones) held back; 0 = none.
    layout : a precomputed :class:`placement.cost.LayoutIndex` for ``rank2gpu``.
    """
    model, par, cl = instance.model, instance.parallel, instance.cluster
    topk = np.asarray(instance.routing.topk[layer], dtype=np.int64)  # (dp, T, k)
    dp, T, k = topk.shape
    if layout is None or layout.src_rank.shape[2] != T:
        layout = LayoutIndex(instance, rank2gpu, T)
    s = int(instance.moe_layer2stage[layer])
    group_dom = layout.group_domain[s]  # (G, ep) global domain of each EP rank of each group
    domains = np.unique(group_dom)
    local = np.full(cl.num_domains, -1, dtype=np.int64)
    local[domains] = np.arange(domains.shape[0])
    sig_by_rank = local[group_dom].T  # (ep, G)
    class_sig, rank2class = np.unique(sig_by_rank, axis=0, return_inverse=True)
    rank2class = rank2class.reshape(-1).astype(np.int64)
    epr = instance.experts_per_rank
    capacity = np.bincount(rank2class, minlength=class_sig.shape[0]) * epr

    src_rank = layout.src_rank[s]  # (dp, T)
    src_group = layout.rank2group[src_rank]
    src_dom = local[cl.gpu2domain[layout.rank2gpu[src_rank]]]
    if (src_dom < 0).any():  # pragma: no cover - sources are ranks of the stage's EP groups
        raise SolverError(f"layer {layer}: a source GPU lies outside its stage's EP groups")
    G = class_sig.shape[1]
    load = np.zeros((G, model.num_experts), dtype=np.int64)
    for g in range(G):
        sel = src_group == g
        load[g] = np.bincount(topk[sel].reshape(-1), minlength=model.num_experts)

    n_val = int(math.floor(T * validation_fraction)) if validation_fraction > 0 else 0
    t_index = np.broadcast_to(np.arange(T)[None, :], (dp, T))
    is_val = t_index >= T - n_val

    def nets(mask: np.ndarray) -> NetSet:
        return NetSet.aggregate(topk[mask], src_group[mask], src_dom[mask])

    all_mask = np.ones((dp, T), dtype=bool)
    none_mask = np.zeros((dp, T), dtype=bool)
    if class_sig.shape[0] == 1:  # trivial: every map costs 0, no nets needed
        nets_all = nets_fit = nets_val = nets(none_mask)
    elif n_val > 0:
        nets_all = nets(all_mask)
        nets_fit, nets_val = nets(~is_val), nets(is_val)
    else:
        nets_all = nets(all_mask)
        nets_fit, nets_val = nets_all, nets(none_mask)
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
        class_sig=class_sig.astype(np.int64),
        class_capacity=capacity.astype(np.int64),
        load=load,
        bytes_per_crossing=float(par.tokens_per_dp_rank_per_step / T * model.roundtrip_bytes_per_copy),
        nets_fit=nets_fit,
        nets_val=nets_val,
        nets_all=nets_all,
        group_preserving=group_preserving,
        expert_group_size=gs,
    )


# =============================================================================================
# Exact cost of a class map
# =============================================================================================
def _net_domains(nets: NetSet, expert2class: np.ndarray, class_sig: np.ndarray) -> np.ndarray:
    """(N, k) local domain of each expert of each net, seen from the net's EP group."""
    return class_sig[expert2class[nets.experts], nets.group[:, None]]


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
    dom = _net_domains(nets, expert2class, class_sig)
    remote = dom != nets.src[:, None]
    if cost_mode == "per_pair":
        return int((remote.sum(axis=1) * nets.weight).sum())
    d = np.sort(dom, axis=1)
    first = np.ones_like(d, dtype=bool)
    first[:, 1:] = d[:, 1:] != d[:, :-1]
    return int(((first & (d != nets.src[:, None])).sum(axis=1) * nets.weight).sum())


def layer_domain_cost(
    instance: Instance,
    rank2gpu: np.ndarray,
    layer_index: int,
    expert2eprank: np.ndarray,
    *,
    layout: LayoutIndex | None = None,
    window: str = "sampled",
) -> float:
    """Cross-domain bytes per step of one layer's expert map (exactly as :func:`placement.cost.evaluate`).

    Parameters
    ----------
    instance : the problem.
    rank2gpu : (world,) GPU of each global rank.
    layer_index : MoE layer index.
    expert2eprank : (E,) EP rank hosting each logical expert in this layer.
    layout : a precomputed :class:`~placement.cost.LayoutIndex` for ``rank2gpu`` (fast in loops).
    window : ``sampled`` or ``heldout`` (the latter only with the full instance).

    Returns
    -------
    float bytes per optimizer step (dispatch + combine, forward and backward, every micro-batch).
    """
    topk = instance.routing.topk if window == "sampled" else instance.routing.heldout_topk
    if topk is None:
        raise InvalidInputError("routing.heldout_topk: no held-out window in this instance view")
    tok = np.asarray(topk[layer_index], dtype=np.int64)  # (dp, T, k)
    dp, T, k = tok.shape
    if layout is None or layout.src_rank.shape[2] != T:
        layout = LayoutIndex(instance, rank2gpu, T)
    g2d = instance.cluster.gpu2domain
    s = int(instance.moe_layer2stage[layer_index])
    src_rank = layout.src_rank[s]
    src_dom = g2d[layout.rank2gpu[src_rank]]  # (dp, T)
    src_group = layout.rank2group[src_rank]
    eprank = np.asarray(expert2eprank, dtype=np.int64)[tok]  # (dp, T, k)
    tgt_dom = layout.group_domain[s][src_group[..., None], eprank]
    remote = tgt_dom != src_dom[..., None]
    if instance.cost_mode == "per_pair":
        crossings = int(remote.sum())
    else:
        d = np.sort(tgt_dom, axis=-1)
        first = np.ones_like(d, dtype=bool)
        first[..., 1:] = d[..., 1:] != d[..., :-1]
        crossings = int((first & (d != src_dom[..., None])).sum())
    weight = instance.parallel.tokens_per_dp_rank_per_step / T
    return float(crossings * weight * instance.model.roundtrip_bytes_per_copy)


# =============================================================================================
# Step 1a: a fast greedy (linear proxy + assignment), with Lagrangian prices for the load caps
# =============================================================================================
def _pairs(nets: NetSet) -> tuple[np.ndarray, np.ndarray]:
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
    pn, pe = _pairs(nets)
    g, s, w = nets.group[pn], nets.src[pn], nets.weight[pn].astype(np.float64)
    for c in range(C):
        out[:, c] = np.bincount(pe, weights=w * (problem.class_sig[c, g] != s), minlength=E)
    return out


def _assign_counts(cost: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, float]:
    """Min-cost assignment of ``n`` items to classes with exact ``counts`` (sum = n).

    Returns ``(item2class (n,), total cost)``.  Two classes: sorting by the cost difference is exact;
    more: a linear assignment over the slots.
    """
    n, C = cost.shape
    nz = np.flatnonzero(counts)
    if nz.shape[0] == 1:
        item2class = np.full(n, nz[0], dtype=np.int64)
    elif nz.shape[0] == 2:
        a, b = nz
        order = np.argsort(cost[:, a] - cost[:, b], kind="stable")
        item2class = np.full(n, b, dtype=np.int64)
        item2class[order[: counts[a]]] = a
    else:
        slot_class = np.repeat(np.arange(C), counts)
        rows, cols = linear_sum_assignment(cost[:, slot_class])
        item2class = np.empty(n, dtype=np.int64)
        item2class[rows] = slot_class[cols]
    return item2class, float(cost[np.arange(n), item2class].sum())


def assign_classes(problem: LayerProblem, cost: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Min-cost expert -> class map for a linear cost ``(E, C)`` under the layer's structure.

    Free mode: exact class capacities.  Group-preserving mode: each expert group takes the class
    make-up of one block type (types used as often as there are blocks of that type), experts
    choosing classes inside their group; solved exactly as a two-level assignment.

    Returns ``(expert2class (E,), group2type (num_groups,) or None)``.
    """
    if not problem.group_preserving:
        e2c, _ = _assign_counts(cost, problem.class_capacity)
        return e2c, None
    gs = problem.expert_group_size
    nblk = problem.num_blocks
    block2type, type_count, _ = problem.block_types
    T = type_count.shape[0]
    sub = np.zeros((nblk, T))
    sub_maps: dict[tuple[int, int], np.ndarray] = {}
    for p in range(nblk):
        rows = cost[p * gs : (p + 1) * gs]
        for t in range(T):
            m, v = _assign_counts(rows, type_count[t])
            sub[p, t], sub_maps[p, t] = v, m
    gi, bi = linear_sum_assignment(sub[:, block2type])
    group2type = np.empty(nblk, dtype=np.int64)
    group2type[gi] = block2type[bi]
    e2c = np.concatenate([sub_maps[p, int(group2type[p])] for p in range(nblk)])
    return e2c, group2type


def _group2type_of(problem: LayerProblem, expert2class: np.ndarray) -> np.ndarray | None:
    """Block type each expert group occupies under a group-preserving class map (None in free mode)."""
    if not problem.group_preserving:
        return None
    _, type_count, _ = problem.block_types
    gs = problem.expert_group_size
    out = np.empty(problem.num_blocks, dtype=np.int64)
    for p in range(problem.num_blocks):
        cnt = np.bincount(expert2class[p * gs : (p + 1) * gs], minlength=problem.num_classes)
        match = np.flatnonzero((type_count == cnt[None, :]).all(axis=1))
        if match.shape[0] != 1:
            raise SolverError(f"layer {problem.layer}: expert group {p} fits no block type")
        out[p] = match[0]
    return out


def _is_structurally_valid(problem: LayerProblem, expert2class: np.ndarray) -> bool:
    if not np.array_equal(np.bincount(expert2class, minlength=problem.num_classes), problem.class_capacity):
        return False
    if problem.group_preserving:
        try:
            g2t = _group2type_of(problem, expert2class)
        except SolverError:
            return False
        _, _, mult = problem.block_types
        return bool(np.array_equal(np.bincount(g2t, minlength=mult.shape[0]), mult))
    return True


def _capped_greedy(problem: LayerProblem, cost: np.ndarray, cap: np.ndarray, iterations: int = 30) -> np.ndarray | None:
    """A class map within the load caps: the assignment oracle with Lagrangian load prices.

    Prices rise on classes over their cap until the map fits (subgradient steps); among the maps that
    fit, the one with the smallest proxy cost is returned (None if none fits).
    """
    load = problem.load.astype(np.float64)  # (G, E)
    share = np.maximum(problem.load_share(), 1.0)
    spread = float(np.abs(cost - cost.mean(axis=1, keepdims=True)).mean()) + 1e-9
    unit = spread / max(float(load.mean()), 1e-9)  # proxy crossings per pair
    lam = np.zeros_like(share)
    best, best_cost = None, math.inf
    for it in range(iterations):
        adj = cost + (lam.T @ load).T  # (E, C)
        e2c, _ = assign_classes(problem, adj)
        excess = problem.class_loads(e2c) - cap
        if (excess <= 0).all():
            val = float(cost[np.arange(problem.num_experts), e2c].sum())
            if val < best_cost:
                best, best_cost = e2c, val
            if it == 0:
                break
            lam *= 0.7  # feasible: try cheaper prices
        else:
            lam += unit * (2.0 ** (it / 4.0)) * np.maximum(excess, 0) / share
    return best


@dataclass(frozen=True)
class GreedyDomains:
    """Result of :func:`greedy_expert_domains`.

    expert2class : (E,) class of each expert; classes are the problem's (``problem.class_sig``).
    expert2eprank : (E,) an EP rank for each expert (balanced inside its class).
    crossings : the map's crossings on the nets it was fitted to.
    cost_bytes : the same in bytes per step.
    """

    expert2class: np.ndarray
    expert2eprank: np.ndarray
    crossings: int
    cost_bytes: float


def greedy_expert_domains(
    problem: LayerProblem,
    *,
    nets: NetSet | None = None,
    load_tolerance: float | None = None,
    local_search: bool = False,
) -> GreedyDomains:
    """Fast expert -> domain (class) map of one layer: the proxy assignment, optionally polished.

    Cheap enough to call thousands of times when scoring rank layouts: one assignment (a sort for two
    classes, else a 256 x 256 linear assignment) on top of a ``bincount``.

    Parameters
    ----------
    problem : from :func:`build_layer_problem`.
    nets : the tokens to fit (default: all sampled tokens).
    load_tolerance : cap each class's load at ``(1 + tol)`` times its share (None: no load cap).
    local_search : polish with exact swap moves (slower, ~10-100 ms).

    Returns
    -------
    GreedyDomains
    """
    nets = problem.nets_all if nets is None else nets
    if problem.trivial:
        e2c = np.zeros(problem.num_experts, dtype=np.int64)
    else:
        cost = linear_costs(problem, nets)
        e2c = None
        if load_tolerance is not None:
            e2c = _capped_greedy(problem, cost, problem.load_cap(load_tolerance))
        if e2c is None:
            e2c, _ = assign_classes(problem, cost)
        if local_search:
            cap = None if load_tolerance is None else problem.load_cap(load_tolerance)
            e2c = SwapSearch(problem, nets).run(e2c, cap)
    slots = balance_ranks(problem, e2c)
    crossings = net_crossings(nets, e2c, problem.class_sig, problem.cost_mode)
    return GreedyDomains(
        expert2class=e2c,
        expert2eprank=slots // problem.experts_per_rank,
        crossings=crossings,
        cost_bytes=crossings * problem.bytes_per_crossing,
    )


# =============================================================================================
# Step 1b: local search with exact incremental swap deltas
# =============================================================================================
class SwapSearch:
    """Best-improvement swap search on the exact crossings of one layer's nets.

    A swap exchanges the classes of two experts ``e`` (class ``a``) and ``f`` (class ``b``).  Its exact
    delta is ``M[e, b] + M[f, a] - R_b[e, f] - R_a[f, e]``, where ``M[e, c]`` is the exact delta of moving
    ``e`` alone to ``c`` and ``R_c[e, f]`` sums, over the nets holding both ``e`` and ``f``, ``e``'s part of
    ``M[e, c]``: such nets keep their domain counts under the swap, so their delta is exactly 0.
    After a swap only the nets holding ``e`` or ``f`` change; ``M`` and ``R`` are updated from them alone.

    Moves: free mode, any two experts of different classes; group-preserving mode, two experts of
    the same expert group, plus whole-group moves between block types (:meth:`run`).
    """

    def __init__(self, problem: LayerProblem, nets: NetSet):
        self.p = problem
        self.nets = nets
        self.E, self.C, self.D = problem.num_experts, problem.num_classes, problem.num_domains
        N, k = nets.experts.shape
        self.k = k
        self.per_domain = problem.cost_mode == "per_domain"
        # (C, N, k) domain each expert of each net would be in, per class
        self.ndom = np.repeat(problem.class_sig[:, nets.group][:, :, None], k, axis=2)
        self.w = nets.weight.astype(np.int64)
        # nets holding each expert (CSR over experts)
        flat = nets.experts.reshape(-1)
        order = np.argsort(flat, kind="stable")
        self.e_ptr = np.concatenate([[0], np.cumsum(np.bincount(flat, minlength=self.E))])
        self.e_nets = (order // max(k, 1)).astype(np.int64)

    # ---- exact evaluation ------------------------------------------------------------------
    def cost(self, e2c: np.ndarray) -> int:
        return net_crossings(self.nets, e2c, self.p.class_sig, self.p.cost_mode)

    def _parts(self, rows: np.ndarray, e2c: np.ndarray, cnt: np.ndarray) -> np.ndarray:
        """(len(rows), k, C) each (net, expert) pair's part of that expert's exact move delta."""
        ex = self.nets.experts[rows]  # (m, k)
        src = self.nets.src[rows][:, None]
        w = self.w[rows][:, None]
        cur = e2c[ex]
        da = np.take_along_axis(self.ndom[:, rows, :], cur[None, :, :], axis=0)[0]  # (m, k)
        out = np.zeros(ex.shape + (self.C,), dtype=np.int64)
        if self.per_domain:
            cr = cnt[rows]
            leave = (np.take_along_axis(cr, da, axis=1) == 1) & (da != src)
            for c in range(self.C):
                dc = self.ndom[c, rows]
                enter = (np.take_along_axis(cr, dc, axis=1) == 0) & (dc != src)
                out[:, :, c] = np.where(dc == da, 0, w * (enter.astype(np.int64) - leave))
        else:
            for c in range(self.C):
                dc = self.ndom[c, rows]
                out[:, :, c] = w * ((dc != src).astype(np.int64) - (da != src))
        return out

    def _counts(self, rows: np.ndarray, e2c: np.ndarray) -> np.ndarray:
        ex = self.nets.experts[rows]
        da = np.take_along_axis(self.ndom[:, rows, :], e2c[ex][None, :, :], axis=0)[0]
        m = rows.shape[0]
        return np.bincount((np.arange(m)[:, None] * self.D + da).reshape(-1), minlength=m * self.D).reshape(m, self.D)

    def _init_state(self, e2c: np.ndarray) -> None:
        N = self.nets.num_nets
        rows = np.arange(N)
        self.cnt = self._counts(rows, e2c)
        self.parts = self._parts(rows, e2c, self.cnt)  # (N, k, C)
        ex = self.nets.experts
        self.M = np.stack([np.bincount(ex.reshape(-1), weights=self.parts[:, :, c].reshape(-1), minlength=self.E)
                           for c in range(self.C)], axis=1)
        self.R = None
        if self.per_domain:
            self.R = np.zeros((self.C, self.E, self.E))
            ii = np.broadcast_to(ex[:, :, None], (N, self.k, self.k)).reshape(-1)
            jj = np.broadcast_to(ex[:, None, :], (N, self.k, self.k)).reshape(-1)
            for c in range(self.C):
                vals = np.broadcast_to(self.parts[:, :, c][:, :, None], (N, self.k, self.k)).reshape(-1)
                self.R[c] = np.bincount(ii * self.E + jj, weights=vals, minlength=self.E * self.E).reshape(self.E, self.E)

    def _apply(self, e2c: np.ndarray, e: int, f: int) -> None:
        rows = np.union1d(self.e_nets[self.e_ptr[e]: self.e_ptr[e + 1]], self.e_nets[self.e_ptr[f]: self.e_ptr[f + 1]])
        e2c[e], e2c[f] = e2c[f], e2c[e]
        if rows.size == 0:
            return
        self.cnt[rows] = self._counts(rows, e2c)
        new = self._parts(rows, e2c, self.cnt)
        diff = new - self.parts[rows]
        self.parts[rows] = new
        ex = self.nets.experts[rows]
        m = rows.shape[0]
        for c in range(self.C):
            self.M[:, c] += np.bincount(ex.reshape(-1), weights=diff[:, :, c].reshape(-1), minlength=self.E)
        if self.R is not None:
            flat = (ex[:, :, None] * self.E + ex[:, None, :]).reshape(-1)
            for c in range(self.C):
                vals = np.broadcast_to(diff[:, :, c][:, :, None], (m, self.k, self.k)).reshape(-1)
                if vals.any():
                    self.R[c] += np.bincount(flat, weights=vals, minlength=self.E * self.E).reshape(self.E, self.E)

    # ---- the search --------------------------------------------------------------------------
    def run(
        self,
        e2c: np.ndarray,
        cap: np.ndarray | None,
        *,
        max_swaps: int = _MAX_SWAPS,
        group_rounds: int = _MAX_GROUP_ROUNDS,
    ) -> np.ndarray:
        """Improve ``e2c`` until no improving move fits ``cap`` (G, C) or the swap budget is spent."""
        e2c = np.array(e2c, dtype=np.int64)
        if self.nets.num_nets == 0 or self.C < 2:
            return e2c
        loads = self.p.class_loads(e2c)
        cap_eff = None if cap is None else np.maximum(cap, loads)  # never worsen a class already over
        swaps = 0
        for _ in range(max(1, group_rounds)):
            self._init_state(e2c)
            while swaps < max_swaps:
                best = self._best_swap(e2c, loads, cap_eff)
                if best is None:
                    break
                e, f = best
                a, b = e2c[e], e2c[f]
                d = self.p.load[:, f] - self.p.load[:, e]
                loads[:, a] += d
                loads[:, b] -= d
                self._apply(e2c, e, f)
                swaps += 1
            if not self.p.group_preserving or not self._group_move(e2c, loads, cap_eff):
                break
            loads = self.p.class_loads(e2c)
        return e2c

    def _best_swap(self, e2c: np.ndarray, loads: np.ndarray, cap: np.ndarray | None) -> tuple[int, int] | None:
        M, R = self.M, self.R
        members = [np.flatnonzero(e2c == c) for c in range(self.C)]
        e2g = self.p.expert2group
        best_val, best = -0.5, None  # integer deltas: accept <= -1
        for a in range(self.C):
            for b in range(a + 1, self.C):
                Ea, Eb = members[a], members[b]
                if Ea.size == 0 or Eb.size == 0:
                    continue
                delta = M[Ea, b][:, None] + M[Eb, a][None, :]
                if R is not None:
                    delta = delta - R[b][np.ix_(Ea, Eb)] - R[a][np.ix_(Eb, Ea)].T
                ok = np.ones(delta.shape, dtype=bool)
                if self.p.group_preserving:
                    ok &= e2g[Ea][:, None] == e2g[Eb][None, :]
                if cap is not None:
                    for g in range(self.p.num_ep_groups):
                        d = self.p.load[g, Eb][None, :] - self.p.load[g, Ea][:, None]  # a gains f, loses e
                        ok &= (loads[g, a] + d <= cap[g, a]) & (loads[g, b] - d <= cap[g, b])
                delta = np.where(ok, delta, 0)
                i = int(np.argmin(delta))
                v = delta.flat[i]
                if v < best_val:
                    best_val = v
                    best = (int(Ea[i // Eb.size]), int(Eb[i % Eb.size]))
        return best

    def _group_move(self, e2c: np.ndarray, loads: np.ndarray, cap: np.ndarray | None) -> bool:
        """Best exchange of block types between two expert groups (in place); True if one improved."""
        g2t = _group2type_of(self.p, e2c)
        _, type_count, _ = self.p.block_types
        gs = self.p.expert_group_size
        M = self.M
        base = self.cost(e2c)
        best_val, best_map = base, None
        nblk = self.p.num_blocks
        for p in range(nblk):
            for q in range(p + 1, nblk):
                if g2t[p] == g2t[q]:
                    continue
                cand = e2c.copy()
                for grp, t in ((p, g2t[q]), (q, g2t[p])):
                    sl = slice(grp * gs, (grp + 1) * gs)
                    cand[sl], _ = _assign_counts(M[sl], type_count[t])
                if cap is not None and (self.p.class_loads(cand) > cap).any():
                    continue
                v = self.cost(cand)
                if v < best_val:
                    best_val, best_map = v, cand
        if best_map is None:
            return False
        e2c[:] = best_map
        return True


# =============================================================================================
# Step 2: experts -> GPUs inside each class (and block)
# =============================================================================================
def _block_assignment(problem: LayerProblem, expert2class: np.ndarray) -> np.ndarray:
    """(B,) expert group placed on each block: groups keep their own block when its type fits."""
    g2t = _group2type_of(problem, expert2class)
    block2type, _, _ = problem.block_types
    nblk = problem.num_blocks
    block2group = np.full(nblk, -1, dtype=np.int64)
    placed = np.zeros(nblk, dtype=bool)
    for p in range(nblk):
        if block2type[p] == g2t[p]:
            block2group[p], placed[p] = p, True
    for p in range(nblk):
        if placed[p]:
            continue
        free = np.flatnonzero((block2group == -1) & (block2type == g2t[p]))
        block2group[free[0]], placed[p] = p, True
    return block2group


def _bins(problem: LayerProblem, expert2class: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Sets of slots and the experts that must fill them: per class, and per block in
    group-preserving mode (a group's experts stay in its block)."""
    s2c = problem.slot2class
    bins: list[tuple[np.ndarray, np.ndarray]] = []
    if problem.group_preserving:
        gs = problem.expert_group_size
        b2g = _block_assignment(problem, expert2class)
        for b in range(problem.num_blocks):
            grp = b2g[b]
            for c in range(problem.num_classes):
                slots = np.arange(b * gs, (b + 1) * gs)
                slots = slots[s2c[slots] == c]
                experts = np.arange(grp * gs, (grp + 1) * gs)
                experts = experts[expert2class[experts] == c]
                if slots.size:
                    bins.append((slots, experts))
    else:
        for c in range(problem.num_classes):
            bins.append((np.flatnonzero(s2c == c), np.flatnonzero(expert2class == c)))
    return bins


def rank_load_floor(problem: LayerProblem, expert2class: np.ndarray) -> float:
    """A lower bound on the expert load max/mean any balancing can reach for ``expert2class``.

    In each bin (:func:`_bins`) some EP rank carries at least the bin's load over its ranks, and
    at least the bin's heaviest expert; over the EP group's mean per rank, worst group.  When this
    exceeds :data:`GPU_LOAD_TOLERANCE`, the routing (and the class or group structure) is what stops
    the balance, not the packing.
    """
    epr, ep = problem.experts_per_rank, problem.ep
    total = problem.load.sum(axis=1).astype(np.float64)
    mean = np.where(total > 0, total / ep, 1.0)
    out = 1.0
    for slots, experts in _bins(problem, expert2class):
        n_ranks = np.unique(slots // epr).shape[0]
        if experts.size == 0:
            continue
        ld = problem.load[:, experts].astype(np.float64)  # (G, n)
        floor = np.maximum(ld.sum(axis=1) / max(slots.size / epr, n_ranks), ld.max(axis=1)) / mean
        out = max(out, float(floor.max()))
    return out


def balance_ranks(problem: LayerProblem, expert2class: np.ndarray, *, max_swaps: int = 2000) -> np.ndarray:
    """Experts -> slots inside their class (and block), balancing expert load per GPU.

    Longest-processing-time packing (heaviest expert first onto the least loaded EP rank of its bin
    with a free slot), then swaps of two experts of one bin that lower the busiest rank's load.  Load
    is each EP group's (token, expert) pairs over that group's mean per rank, the evaluator's
    max/mean, maximised over the stage's EP groups.

    Returns
    -------
    (E,) physical slot of each expert (slot ``p`` on EP rank ``p // experts_per_rank``); experts of a
    rank fill its slots in ascending expert id.
    """
    E, epr, ep = problem.num_experts, problem.experts_per_rank, problem.ep
    total = problem.load.sum(axis=1).astype(np.float64)
    mean = np.where(total > 0, total / ep, 1.0)  # (G,)
    norm = problem.load / mean[:, None]  # (G, E)
    weight = norm.sum(axis=0)
    bins = _bins(problem, expert2class)
    rank_load = np.zeros((problem.num_ep_groups, ep))
    expert2rank = np.full(E, -1, dtype=np.int64)
    bin_of = np.full(E, -1, dtype=np.int64)
    for bi, (slots, experts) in enumerate(bins):
        ranks, free = np.unique(slots // epr, return_counts=True)
        order = experts[np.lexsort((experts, -weight[experts]))]
        for e in order:
            avail = np.flatnonzero(free > 0)
            score = (rank_load[:, ranks[avail]] + norm[:, e : e + 1]).max(axis=0)
            j = avail[int(np.argmin(score))]
            expert2rank[e] = ranks[j]
            free[j] -= 1
            rank_load[:, ranks[j]] += norm[:, e]
        bin_of[experts] = bi
    # Swaps inside a bin that lower the busiest rank.
    for _ in range(max_swaps):
        score = rank_load.max(axis=0)
        r = int(np.argmax(score))
        on_r = np.flatnonzero(expert2rank == r)
        best, best_val = None, score[r] - 1e-9
        for e in on_r:
            others = np.flatnonzero((bin_of == bin_of[e]) & (expert2rank != r))
            if others.size == 0:
                continue
            d = norm[:, others] - norm[:, e : e + 1]  # r gains f, loses e
            new_r = (rank_load[:, r : r + 1] + d).max(axis=0)
            new_o = (rank_load[:, expert2rank[others]] - d).max(axis=0)
            val = np.maximum(new_r, new_o)
            i = int(np.argmin(val))
            if val[i] < best_val:
                best_val, best = val[i], (int(e), int(others[i]))
        if best is None:
            break
        e, f = best
        re, rf = expert2rank[e], expert2rank[f]
        rank_load[:, re] += norm[:, f] - norm[:, e]
        rank_load[:, rf] += norm[:, e] - norm[:, f]
        expert2rank[e], expert2rank[f] = rf, re
    # Slots: a rank's experts, ascending, into its slots (which the bins guarantee exist).
    expert2slot = np.empty(E, dtype=np.int64)
    for bi, (slots, experts) in enumerate(bins):
        for r in np.unique(slots // epr):
            mine = np.sort(experts[expert2rank[experts] == r])
            expert2slot[mine] = np.sort(slots[slots // epr == r])
    return expert2slot


def rank_load_ratio(problem: LayerProblem, expert2slot: np.ndarray) -> float:
    """Expert load max/mean per GPU, worst EP group of the stage (the evaluator's definition)."""
    r = expert2slot // problem.experts_per_rank
    out = 1.0
    for g in range(problem.num_ep_groups):
        per_rank = np.bincount(r, weights=problem.load[g], minlength=problem.ep)
        if per_rank.mean() > 0:
            out = max(out, float(per_rank.max() / per_rank.mean()))
    return out


# =============================================================================================
# Step 1c: the CP-SAT model (one function per variable/constraint family)
# =============================================================================================
def _allowed_classes(problem: LayerProblem, fixed: np.ndarray, group2type: np.ndarray | None) -> list[list[int]]:
    """Classes each expert may take: its fixed class, its group's block type's classes, or any."""
    C = problem.num_classes
    out: list[list[int]] = []
    type_count = problem.block_types[1] if group2type is not None else None
    for e in range(problem.num_experts):
        if fixed[e] >= 0:
            out.append([int(fixed[e])])
        elif group2type is not None:
            t = int(group2type[e // problem.expert_group_size])
            out.append([c for c in range(C) if type_count[t, c] > 0])
        else:
            out.append(list(range(C)))
    return out


def _add_assignment(m, problem: LayerProblem, allowed: list[list[int]]) -> dict:
    """x[e, c] for every free expert and allowed class; each free expert in exactly one class."""
    x = {}
    for e, cls in enumerate(allowed):
        if len(cls) == 1:
            continue  # fixed: a constant, no variable
        for c in cls:
            x[e, c] = m.new_bool_var(f"x_{e}_{c}")
        m.add_exactly_one(x[e, c] for c in cls)
    return x


def _add_capacity(m, problem: LayerProblem, x: dict, allowed: list[list[int]], group2type: np.ndarray | None) -> None:
    """Class capacities, or with a fixed group -> type map each group's class make-up."""
    if group2type is not None:
        type_count = problem.block_types[1]
        gs = problem.expert_group_size
        for p in range(problem.num_blocks):
            for c in range(problem.num_classes):
                terms = [x[e, c] for e in range(p * gs, (p + 1) * gs) if (e, c) in x]
                fixed_here = sum(1 for e in range(p * gs, (p + 1) * gs) if allowed[e] == [c])
                need = int(type_count[group2type[p], c]) - fixed_here
                if terms:
                    m.add(sum(terms) == need)
        return
    for c in range(problem.num_classes):
        terms = [x[e, c] for e in range(problem.num_experts) if (e, c) in x]
        fixed_here = sum(1 for cls in allowed if cls == [c])
        if terms:
            m.add(sum(terms) == int(problem.class_capacity[c]) - fixed_here)


def _add_load_caps(m, problem: LayerProblem, x: dict, allowed: list[list[int]], cap: np.ndarray) -> None:
    """Each class's pairs within its cap, per EP group (fixed experts count as constants)."""
    for g in range(problem.num_ep_groups):
        ld = problem.load[g]
        for c in range(problem.num_classes):
            fixed_load = int(sum(int(ld[e]) for e, cls in enumerate(allowed) if cls == [c]))
            free = [e for e in range(problem.num_experts) if (e, c) in x and ld[e]]
            room = int(cap[g, c]) - fixed_load
            free_cap = int(problem.class_capacity[c]) - sum(1 for cls in allowed if cls == [c])
            if int(np.sort(ld[free])[::-1][:max(free_cap, 0)].sum()) <= room:
                continue  # cannot bind
            m.add(sum(int(ld[e]) * x[e, c] for e in free) <= room)


def _add_group_blocks(m, problem: LayerProblem, x: dict) -> dict:
    """Group-preserving structure: each expert group takes one block type's class make-up."""
    _, type_count, mult = problem.block_types
    gs = problem.expert_group_size
    z = {}
    for p in range(problem.num_blocks):
        for t in range(type_count.shape[0]):
            z[p, t] = m.new_bool_var(f"z_{p}_{t}")
        m.add_exactly_one(z[p, t] for t in range(type_count.shape[0]))
    for t in range(type_count.shape[0]):
        m.add(sum(z[p, t] for p in range(problem.num_blocks)) == int(mult[t]))
    for p in range(problem.num_blocks):
        for c in range(problem.num_classes):
            m.add(
                sum(x[e, c] for e in range(p * gs, (p + 1) * gs))
                == sum(int(type_count[t, c]) * z[p, t] for t in range(type_count.shape[0]))
            )
    return z


def _reduce_nets(problem: LayerProblem, nets: NetSet, allowed: list[list[int]]) -> tuple[int, list[tuple[int, tuple]]]:
    """per_domain nets as ``(constant crossings, [(weight, links) ...])``, aggregated.

    ``links`` are ``(e, c, d)``: free expert ``e`` in class ``c`` puts the net in remote domain ``d``.  A
    remote domain already reached by a fixed expert is a constant; a net that can reach no further
    remote domain through a free expert contributes only its constant.  Identical reduced nets
    (same links) are merged by adding their weights.
    """
    sig = problem.class_sig
    constant = 0
    merged: dict[tuple, int] = {}
    for n in range(nets.num_nets):
        g, s, w = int(nets.group[n]), int(nets.src[n]), int(nets.weight[n])
        forced = set()
        free = []
        for e in nets.experts[n]:
            cls = allowed[int(e)]
            if len(cls) == 1:
                d = int(sig[cls[0], g])
                if d != s:
                    forced.add(d)
            else:
                free.append(int(e))
        constant += w * len(forced)
        links = tuple(sorted((e, c, int(sig[c, g])) for e in free for c in allowed[e]
                             if int(sig[c, g]) != s and int(sig[c, g]) not in forced))
        if links:
            merged[links] = merged.get(links, 0) + w
    return constant, [(w, links) for links, w in sorted(merged.items())]


@dataclass
class CpsatModel:
    """A built model and its variable dicts (keys are tuples, names carry the indices).

    The model's objective plus ``objective_offset`` is the crossings on the nets.
    """

    model: object
    x: dict  # (e, c) -> bool: free expert e sits in class c
    y: dict  # (n, d) -> bool: reduced net n reaches remote local domain d (per_domain only)
    z: dict  # (p, t) -> bool: expert group p sits on a block of type t (group-preserving, free types)
    allowed: list
    objective_offset: int = 0


def build_cpsat_model(
    problem: LayerProblem,
    nets: NetSet,
    cap: np.ndarray | None,
    hint: np.ndarray | None,
    *,
    fixed: np.ndarray | None = None,
    group2type: np.ndarray | None = None,
) -> CpsatModel:
    """The CP-SAT model of one layer's experts -> classes problem on ``nets``.

    Parameters
    ----------
    problem, nets : the layer and the tokens to fit.
    cap : (G, C) class load caps (None: no load constraint).
    hint : (E,) a complete map handed over as a complete hint (``x``, ``y`` and ``z`` derived).
    fixed : (E,) class of each expert fixed in advance, -1 where free (default: all free).
    group2type : (num_groups,) block type of each expert group, fixed (group-preserving
        subproblems; default: decided by the model through ``z``).

    The objective is in crossings (integer net weights) less ``objective_offset``; multiply by
    ``problem.bytes_per_crossing`` for bytes.
    """
    from ortools.sat.python import cp_model

    fixed = np.full(problem.num_experts, -1, dtype=np.int64) if fixed is None else np.asarray(fixed)
    allowed = _allowed_classes(problem, fixed, group2type)
    m = cp_model.CpModel()
    x = _add_assignment(m, problem, allowed)
    z: dict = {}
    if problem.group_preserving and group2type is None:
        for e, cls in enumerate(allowed):  # the z-model needs every x; fixed ones become constants
            for c in range(problem.num_classes):
                if (e, c) not in x:
                    x[e, c] = m.new_constant(int(cls == [c]))
        z = _add_group_blocks(m, problem, x)
    else:
        _add_capacity(m, problem, x, allowed, group2type)
    if cap is not None:
        _add_load_caps(m, problem, x, allowed, cap)
    y: dict = {}
    offset = 0
    if problem.cost_mode == "per_domain":
        offset, reduced = _reduce_nets(problem, nets, allowed)
        terms = []
        for n, (w, links) in enumerate(reduced):
            for e, c, d in links:
                if (n, d) not in y:
                    y[n, d] = m.new_bool_var(f"y_{n}_{d}")
                    terms.append(w * y[n, d])
                m.add_implication(x[e, c], y[n, d])
        m.minimize(sum(terms) if terms else 0)
    else:
        lin = linear_costs(problem, nets).astype(np.int64)
        offset = int(sum(int(lin[e, cls[0]]) for e, cls in enumerate(allowed) if len(cls) == 1))
        m.minimize(sum(int(lin[e, c]) * v for (e, c), v in x.items() if lin[e, c] and len(allowed[e]) > 1))
    built = CpsatModel(m, x, y, z, allowed, offset)
    if hint is not None:
        _add_hints(built, problem, nets, hint)
    return built


def _add_hints(built: CpsatModel, problem: LayerProblem, nets: NetSet, hint: np.ndarray) -> None:
    """A complete hint: every x, y and z from the class map ``hint`` (E,)."""
    m = built.model
    for (e, c), v in built.x.items():
        if len(built.allowed[e]) > 1:
            m.add_hint(v, bool(hint[e] == c))
    if built.y:
        # y[n, d] is 1 when some link (e, c, d) of reduced net n has hint[e] == c.
        _, reduced = _reduce_nets(problem, nets, built.allowed)
        for n, (_, links) in enumerate(reduced):
            on = {d for e, c, d in links if hint[e] == c}
            for d in {d for _, _, d in links}:
                m.add_hint(built.y[n, d], d in on)
    if built.z:
        g2t = _group2type_of(problem, hint)
        for (p, t), v in built.z.items():
            m.add_hint(v, bool(g2t[p] == t))


@dataclass(frozen=True)
class CpsatRun:
    """What one CP-SAT call returned (deterministic fields only)."""

    status: str  # OPTIMAL, FEASIBLE, INFEASIBLE, UNKNOWN, MODEL_INVALID
    expert2class: np.ndarray | None
    objective: int | None  # crossings
    bound: int | None  # proved lower bound, crossings (ceil of CP-SAT's best bound)
    deterministic_time: float
    wall_clock_cut: bool  # the safety-net wall limit stopped it (result may differ between runs)
    wall_s: float


def run_cpsat(
    problem: LayerProblem,
    nets: NetSet,
    cap: np.ndarray | None,
    hint: np.ndarray | None,
    *,
    deterministic_time: float,
    wall_limit_s: float,
    seed: int,
    fixed: np.ndarray | None = None,
    group2type: np.ndarray | None = None,
) -> CpsatRun:
    """Build and solve a layer's model (or a subproblem) single-threaded under a deterministic budget.

    ``max_deterministic_time`` bounds the work (reproducible), ``max_time_in_seconds`` is a safety
    net only, ``random_seed`` is fixed, presolve probing gets at most a tenth of the budget, and the
    search log goes to this module's logger.  Objective and bound are in crossings on ``nets``.
    """
    from ortools.sat.python import cp_model

    t0 = time.monotonic()
    built = build_cpsat_model(problem, nets, cap, hint, fixed=fixed, group2type=group2type)
    solver = cp_model.CpSolver()
    prm = solver.parameters
    prm.num_workers = 1
    prm.random_seed = int(seed) % (2**31 - 1)
    prm.max_deterministic_time = float(max(deterministic_time, 1e-3))
    prm.presolve_probing_deterministic_time_limit = float(max(0.1 * deterministic_time, 1e-3))
    wall_left = max(0.05, wall_limit_s - (time.monotonic() - t0))
    prm.max_time_in_seconds = float(wall_left)
    if log.isEnabledFor(logging.DEBUG):
        prm.log_search_progress = True
        prm.log_to_stdout = False
        solver.log_callback = lambda line: log.debug("layer %d: %s", problem.layer, line)
    opts = _WORKER.get("options")  # set only when solving in the caller's process
    if opts is not None:
        from solvers.base import call_on_stop

        prm.catch_sigint_signal = False  # the caller owns SIGINT
        with call_on_stop(opts, solver.stop_search):
            status = solver.solve(built.model)
    else:
        status = solver.solve(built.model)
    name = solver.status_name(status)
    wall = time.monotonic() - t0
    cut = bool(
        status not in (cp_model.OPTIMAL, cp_model.INFEASIBLE)
        and solver.wall_time >= wall_left * 0.98
        and solver.deterministic_time < prm.max_deterministic_time * 0.98
    )
    if status == cp_model.MODEL_INVALID:
        raise SolverError(f"layer {problem.layer}: CP-SAT rejected the model ({built.model.validate()})")
    off = built.objective_offset
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        e2c = np.empty(problem.num_experts, dtype=np.int64)
        for e, cls in enumerate(built.allowed):
            if len(cls) == 1:
                e2c[e] = cls[0]
            else:
                e2c[e] = next(c for c in cls if solver.boolean_value(built.x[e, c]))
        obj = int(round(solver.objective_value)) + off
        bound = int(math.ceil(solver.best_objective_bound - 1e-6)) + off
        return CpsatRun(name, e2c, obj, min(max(bound, 0), obj), solver.deterministic_time, cut, wall)
    if status == cp_model.INFEASIBLE:
        return CpsatRun(name, None, None, None, solver.deterministic_time, cut, wall)
    bound = int(math.ceil(solver.best_objective_bound - 1e-6)) + off if math.isfinite(solver.best_objective_bound) else None
    return CpsatRun(name, None, None, None if bound is None else max(bound, 0), solver.deterministic_time, cut, wall)


# =============================================================================================
# Group-preserving mode: group-level branch and bound (exact over whole groups, CP-SAT inside)
# =============================================================================================
#: Most group -> block-type assignments enumerated per layer (beyond it, the free-mode path with
#: group-preserving moves).  dsv3_ep256's 20,160 took ~5 s per enumeration for a ~30% gap.
MAX_GROUP_ASSIGNMENTS = 3000
#: CP-SAT gets an assignment's subproblem only when at most this many experts are free in it.  On
#: larger ones (e.g. a 32-expert group split 16/16 over two domains, a few hundred reduced nets)
#: single-worker CP-SAT neither improved the local search nor beat the enumeration bound in 8
#: deterministic seconds (measured on dsv3_1024), so the budget goes to restarts instead.
SUBPROBLEM_MAX_FREE_EXPERTS = 20
#: Assignments whose split-group bound is computed (lowest forced crossings first); the others keep
#: their forced crossings as bound.
MAX_REFINED_ASSIGNMENTS = 300


def _multiset_permutations(mult: np.ndarray) -> np.ndarray:
    """(A, sum(mult)) every arrangement of type ``t`` repeated ``mult[t]`` times, lexicographic."""
    out: list[list[int]] = []
    left = [int(m) for m in mult]
    cur: list[int] = []
    n = sum(left)

    def rec() -> None:
        if len(cur) == n:
            out.append(list(cur))
            return
        for t in range(len(left)):
            if left[t]:
                left[t] -= 1
                cur.append(t)
                rec()
                cur.pop()
                left[t] += 1

    rec()
    return np.array(out, dtype=np.int64).reshape(len(out), n)


def num_group_assignments(problem: LayerProblem) -> int:
    """How many group -> block-type assignments a group-preserving layer has (multinomial)."""
    _, _, mult = problem.block_types
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
    info: dict


def _forced_costs(problem: LayerProblem, nets: NetSet, assign: np.ndarray, chunk: int = 512) -> np.ndarray:
    """(A,) crossings forced by the whole-type groups of every assignment (vectorised in chunks).

    A net of EP group ``g`` pays for domain ``d`` (not its source) as soon as it touches a group whose
    whole type lies in ``d`` for ``g``: ``touch (N, P) @ mask (P, A) > 0``.
    """
    _, type_count, _ = problem.block_types
    whole = (type_count > 0).sum(axis=1) == 1
    whole_class = type_count.argmax(axis=1)
    N, k = nets.experts.shape
    P = problem.num_blocks
    touch = np.zeros((N, P), dtype=np.float32)
    touch[np.repeat(np.arange(N), k), problem.expert2group[nets.experts.reshape(-1)]] = 1.0
    w = nets.weight.astype(np.float64)
    out = np.zeros(assign.shape[0])
    for g in range(problem.num_ep_groups):
        sel = nets.group == g
        tg, wg, sg = touch[sel], w[sel], nets.src[sel]
        for d in range(problem.num_domains):
            wd = wg * (sg != d)
            for lo in range(0, assign.shape[0], chunk):
                types = assign[lo: lo + chunk]  # (a, P)
                mask = (whole[types] & (problem.class_sig[whole_class[types], g] == d)).astype(np.float32)
                if not mask.any():
                    continue
                out[lo: lo + chunk] += wd @ ((tg @ mask.T) > 0)
    return out


def _split_bound(problem: LayerProblem, nets: NetSet, types: np.ndarray) -> tuple[float, np.ndarray]:
    """Lower bound of one assignment and the (E,) class map attaining its relaxation.

    Whole types fix their groups' classes (the crossings they force are exact).  For experts of
    groups on split types, a ``per_domain`` net pays at least the average over its split experts of
    "this expert opens a remote domain not yet forced" (an average is at most the maximum, which is
    at most the OR); this is minimised exactly per group with its type's class counts (load caps
    relaxed).  ``per_pair`` is linear: the bound is the exact optimum without load caps.
    """
    _, type_count, _ = problem.block_types
    gs, P, E, C, D = problem.expert_group_size, problem.num_blocks, problem.num_experts, problem.num_classes, problem.num_domains
    whole = (type_count > 0).sum(axis=1) == 1
    whole_class = type_count.argmax(axis=1)
    sig = problem.class_sig
    e2g = problem.expert2group
    if problem.cost_mode == "per_pair":
        lin = linear_costs(problem, nets)
        e2c = np.empty(E, dtype=np.int64)
        total = 0.0
        for p in range(P):
            sl = slice(p * gs, (p + 1) * gs)
            e2c[sl], v = _assign_counts(lin[sl], type_count[types[p]])
            total += v
        return total, e2c
    N, k = nets.experts.shape
    pn, pe = _pairs(nets)
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
        for p in range(P):
            if not whole[types[p]]:
                sl = slice(p * gs, (p + 1) * gs)
                e2c[sl], v = _assign_counts(cost[sl], type_count[types[p]])
                total += v
    return total, e2c


def _assignment_bounds(problem: LayerProblem, nets: NetSet, assign: np.ndarray, ub: float,
                       max_refine: int = MAX_REFINED_ASSIGNMENTS) -> tuple[np.ndarray, dict]:
    """Lower bounds of all assignments: the forced crossings for all of them, refined by
    :func:`_split_bound` for at most ``max_refine`` of those still below ``ub`` (lowest first).
    An unrefined assignment keeps its forced crossings, still a valid (weaker) bound.

    Returns ``(lb (A,), maps {a: (E,) relaxation map}`` for the refined ones).
    """
    if problem.cost_mode == "per_pair":
        lb = np.zeros(assign.shape[0])
        maps = {}
        for a in range(assign.shape[0]):
            lb[a], maps[a] = _split_bound(problem, nets, assign[a])
        return lb, maps
    lb = _forced_costs(problem, nets, assign)
    maps: dict[int, np.ndarray] = {}
    for a in np.argsort(lb, kind="stable")[:max_refine]:
        if lb[a] >= ub:
            break
        lb[a], maps[int(a)] = _split_bound(problem, nets, assign[a])
    return lb, maps


def group_search(
    problem: LayerProblem,
    nets: NetSet,
    cap: np.ndarray,
    incumbent: np.ndarray,
    *,
    deterministic_time: float,
    seed: int,
    deadline: float,
    restarts: int = 4,
) -> GroupSearchResult | None:
    """Branch and bound over group -> block-type assignments (group-preserving layers).

    1. Every assignment gets the lower bound of :func:`_assignment_bounds`.
    2. The ``restarts`` most promising ones (lowest bound, below the incumbent) seed the swap search.
    3. In increasing bound order, while the bound is below the best map found and budget remains,
       CP-SAT solves the assignment's subproblem (whole groups fixed, split groups' experts free,
       load caps on) and replaces its bound by the proved one (or finds a better map).
    The result's bound is the minimum over assignments of their bounds (never above the best map):
    proved optimal when the two meet.  Returns None when there are too many assignments.
    """
    if num_group_assignments(problem) > MAX_GROUP_ASSIGNMENTS:
        return None
    _, type_count, mult = problem.block_types
    assign = _multiset_permutations(mult)
    sig, mode = problem.class_sig, problem.cost_mode

    def cost(m: np.ndarray) -> int:
        return net_crossings(nets, m, sig, mode)

    best, ub = np.array(incumbent, dtype=np.int64), cost(incumbent)
    lb, maps = _assignment_bounds(problem, nets, assign, ub)
    order = np.argsort(lb, kind="stable")
    search = SwapSearch(problem, nets)
    tried = 0
    for a in order[: 10 * restarts]:
        if tried >= restarts or lb[a] >= ub or int(a) not in maps or _stop_now(deadline):
            break
        start = maps[int(a)]
        if (problem.class_loads(start) > cap).any():
            continue
        tried += 1
        m = search.run(start, cap)
        v = cost(m)
        if v < ub:
            best, ub = m, v
    exact = np.zeros(len(lb), dtype=bool)
    det_left = float(deterministic_time)
    calls = proved_calls = skipped_large = 0
    g2t_best = _group2type_of(problem, best)
    for a in order:
        if lb[a] >= ub or det_left <= 1e-3 or _stop_now(deadline):
            break
        types = assign[a]
        whole = (type_count[types] > 0).sum(axis=1) == 1
        fixed = np.where(whole[problem.expert2group], type_count[types].argmax(axis=1)[problem.expert2group], -1)
        if int((fixed < 0).sum()) > SUBPROBLEM_MAX_FREE_EXPERTS or int(a) not in maps:
            skipped_large += 1
            continue
        hint = best if np.array_equal(g2t_best, types) else maps[int(a)]
        if (problem.class_loads(hint) > cap).any():
            hint = None
        det = min(det_left, max(0.25, deterministic_time / 6.0))
        r = run_cpsat(problem, nets, cap, hint, deterministic_time=det, wall_limit_s=max(0.1, deadline - time.monotonic()),
                      seed=seed + int(a), fixed=fixed, group2type=types)
        det_left -= min(det, r.deterministic_time)
        calls += 1
        if r.status == "INFEASIBLE":
            lb[a], exact[a] = math.inf, True
            proved_calls += 1
            continue
        if r.bound is not None:
            lb[a] = max(lb[a], r.bound)
        if r.expert2class is not None:
            v = cost(r.expert2class)
            if v < ub:
                best, ub = r.expert2class, v
                g2t_best = types.copy()
        if r.status == "OPTIMAL":
            exact[a] = True
            proved_calls += 1
    bound = int(min(ub, math.ceil(float(np.min(lb)) - 1e-6)))
    info = {
        "assignments": int(len(lb)),
        "below_incumbent": int((lb < ub).sum()),
        "restarts": tried,
        "cpsat_subproblems": calls,
        "cpsat_subproblems_proved": proved_calls,
        "cpsat_subproblems_too_large": skipped_large,
        "deterministic_time": round(float(deterministic_time) - det_left, 3),
    }
    return GroupSearchResult(best, ub, bound, info)


# =============================================================================================
# One layer, end to end
# =============================================================================================
@dataclass(frozen=True)
class LayerBudget:
    """How much one layer may spend.  Deterministic fields decide the result; the wall-clock ones
    are a safety net only.

    deterministic_time : CP-SAT deterministic-time budget of the layer (both phases together).
    seed : CP-SAT ``random_seed`` of the layer.
    deadline : ``time.monotonic()`` instant after which the layer returns its best at once.
    wall_factor : a CP-SAT call may run ``wall_factor * budget / DET_PER_WALL_S`` wall seconds.
    """

    deterministic_time: float
    seed: int
    deadline: float
    wall_factor: float = 4.0


@dataclass
class LayerOutcome:
    """One layer's answer.

    expert2slot : (E,) physical slot of each logical expert.
    crossings : on all sampled tokens.  bound : a proved lower bound on ``crossings`` over the
    search space (maps within the load caps, and the default), or None.
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


def _tolerance_ladder(problem: LayerProblem, cost: np.ndarray, base: float) -> tuple[float, np.ndarray | None]:
    """The smallest load tolerance (base, 2 base, 4 base, ...) with a feasible greedy map.

    Never looser than the default map's own excess, which is always feasible.  Returns
    ``(tol, greedy map or None when only the default map fits)``.
    """
    default_tol = problem.load_excess(problem.default_expert2class)
    tol = base
    while tol < default_tol:
        e2c = _capped_greedy(problem, cost, problem.load_cap(tol))
        if e2c is not None:
            return tol, e2c
        tol *= 2.0
    tol = max(base, default_tol)
    e2c = _capped_greedy(problem, cost, problem.load_cap(tol))
    return tol, e2c


def _start_maps(problem: LayerProblem, cap: np.ndarray, first: np.ndarray | None) -> list[tuple[str, np.ndarray]]:
    """Starting points for the local search, in a fixed order: the greedy, then the default map."""
    starts: list[tuple[str, np.ndarray]] = []
    if first is not None:
        starts.append(("greedy", first))
    d = problem.default_expert2class
    if (problem.class_loads(d) <= cap).all():
        starts.append(("default", d))
    return starts


def _group_structured_start(problem: LayerProblem, cost: np.ndarray, cap: np.ndarray, groups: int) -> np.ndarray | None:
    """A free-mode start that keeps the model's expert groups whole where capacity allows."""
    if groups <= 1 or problem.num_experts % groups:
        return None
    gs = problem.num_experts // groups
    gp = dataclasses.replace(problem, group_preserving=True, expert_group_size=gs)
    return _capped_greedy(gp, cost, cap)


#: CP-SAT needs about this much deterministic time per (net, expert, remote class) link of a full
#: model to return more than its hint; with less, the model is not built (measured: dsv3 and qwen3
#: layers of 25k-260k links returned the hint unchanged at 0.2-3 deterministic seconds).
CPSAT_DET_PER_LINK = 2e-5


def _model_links(problem: LayerProblem, nets: NetSet) -> int:
    """Size of the full CP-SAT model: (net, expert, remote class) links, or (expert, class) terms."""
    if problem.cost_mode == "per_pair":
        return problem.num_experts * problem.num_classes
    remote = (problem.class_sig[:, nets.group] != nets.src[None, :]).sum(axis=0)  # (N,) remote classes
    return int((remote * nets.experts.shape[1]).sum())


def iterated_local_search(
    problem: LayerProblem,
    nets: NetSet,
    cap: np.ndarray,
    start: np.ndarray,
    *,
    iterations: int,
    seed: int,
    deadline: float,
    kick: int = 6,
) -> np.ndarray:
    """Iterated local search: ``kick`` random feasible swaps of the best map, then :class:`SwapSearch`;
    keep the result if it is better.  Seeded, with a fixed iteration count: deterministic.
    """
    rng = np.random.default_rng(seed)
    search = SwapSearch(problem, nets)
    best = search.run(start, cap)
    best_v = search.cost(best)
    e2g = problem.expert2group
    for _ in range(iterations):
        if _stop_now(deadline):
            break
        cur = best.copy()
        loads = problem.class_loads(cur)
        for _ in range(kick):
            e = int(rng.integers(problem.num_experts))
            others = np.flatnonzero((cur != cur[e]) & ((e2g == e2g[e]) if problem.group_preserving else True))
            if others.size == 0:
                continue
            f = int(others[rng.integers(others.size)])
            a, b = cur[e], cur[f]
            d = problem.load[:, f] - problem.load[:, e]
            if ((loads[:, a] + d) > np.maximum(cap[:, a], loads[:, a])).any() or ((loads[:, b] - d) > np.maximum(cap[:, b], loads[:, b])).any():
                continue
            cur[e], cur[f] = b, a
            loads[:, a] += d
            loads[:, b] -= d
        cand = search.run(cur, cap)
        v = search.cost(cand)
        if v < best_v:
            best, best_v = cand, v
    return best


def _restarts_for(det: float) -> int:
    """Local-search restarts the group search may make: 2, plus one per 0.1 of deterministic budget
    (the budget is deterministic, so the count is too), at most 12."""
    return int(min(12, 2 + det / 0.1))


def solve_layer(
    problem: LayerProblem,
    budget: LayerBudget,
    *,
    model_groups: int = 1,
    class_tolerance: float = CLASS_LOAD_TOLERANCE,
    hint_phy2log: np.ndarray | None = None,
) -> LayerOutcome:
    """Steps 1-3 of the module docstring for one layer.

    Parameters
    ----------
    problem : from :func:`build_layer_problem`.
    budget : deterministic CP-SAT budget, seed and the wall-clock safety net.
    model_groups : the model's expert groups (a group-structured starting point in free mode).
    class_tolerance : the load tolerance the ladder starts from.
    hint_phy2log : (E,) a map of this layer to start from as well (used if it meets the caps and,
        in group-preserving mode, preserves groups).

    Notes
    -----
    Search: free mode, the full CP-SAT model; group-preserving mode, :func:`group_search` (which
    uses CP-SAT on subproblems) when the layer has at most :data:`MAX_GROUP_ASSIGNMENTS` group
    assignments, else the full model with ``z`` variables.
    """
    t_start = time.monotonic()
    E = problem.num_experts
    sig, mode = problem.class_sig, problem.cost_mode
    details: dict = {
        "layer": problem.layer,
        "stage": problem.stage,
        "class_domains": [[int(d) for d in problem.domains[row]] for row in sig],
        "class_capacity": [int(c) for c in problem.class_capacity],
    }
    if problem.trivial:
        slots = balance_ranks(problem, np.zeros(E, dtype=np.int64))
        details.update(status="trivial", chosen="balanced", objective_crossings=0, bound_crossings=0,
                       load_max_over_mean=round(rank_load_ratio(problem, slots), 6),
                       load_max_over_mean_floor=round(rank_load_floor(problem, np.zeros(E, dtype=np.int64)), 6))
        return LayerOutcome(problem.layer, slots, 0, 0, True, details, time.monotonic() - t_start)

    fit, val, every = problem.nets_fit, problem.nets_val, problem.nets_all
    has_val = val.num_nets > 0

    def score(m: np.ndarray, nets: NetSet) -> int:
        return net_crossings(nets, m, sig, mode)

    def late() -> bool:
        return _stop_now(budget.deadline)

    use_groups = problem.group_preserving and num_group_assignments(problem) <= MAX_GROUP_ASSIGNMENTS
    details["search"] = "group_search" if use_groups else "cpsat_or_ils"
    runs: dict[str, dict] = {}

    def search(nets: NetSet, incumbent: np.ndarray, det: float, key: str) -> tuple[np.ndarray | None, int | None, bool]:
        """(map or None, bound or None, proved) from the layer's search on ``nets``."""
        if late():
            runs[key] = {"status": "SKIPPED", "reason": "deadline"}
            return None, None, False
        if use_groups:
            r = group_search(problem, nets, cap, incumbent, deterministic_time=det, seed=budget.seed,
                             deadline=budget.deadline, restarts=_restarts_for(det))
            runs[key] = {"status": "OPTIMAL" if r.bound >= r.crossings else "FEASIBLE",
                         "objective_crossings": r.crossings, "bound_crossings": r.bound, **r.info}
            return r.best, r.bound, r.bound >= r.crossings
        links = _model_links(problem, nets)
        if det < CPSAT_DET_PER_LINK * links:
            iters = _restarts_for(det)
            m = iterated_local_search(problem, nets, cap, incumbent, iterations=iters, seed=budget.seed,
                                      deadline=budget.deadline)
            runs[key] = {"status": "SKIPPED", "reason": f"budget {det:.3g} below the model's need "
                         f"({links} links)", "iterated_local_search": iters}
            return m, None, False
        wall = min(budget.wall_factor * det / DET_PER_WALL_S, budget.deadline - time.monotonic())
        r = run_cpsat(problem, nets, cap, incumbent, deterministic_time=det, wall_limit_s=wall, seed=budget.seed)
        runs[key] = {"status": r.status, "objective_crossings": r.objective, "bound_crossings": r.bound,
                     "deterministic_time": round(min(r.deterministic_time, det), 3), "wall_clock_cut": r.wall_clock_cut}
        m = r.expert2class
        if m is not None and score(m, nets) > score(incumbent, nets):  # pragma: no cover - hint kept
            m = incumbent
        if m is not None and r.status != "OPTIMAL":
            m = SwapSearch(problem, nets).run(m, cap)
        return m, r.bound, r.status == "OPTIMAL"

    # Step 1a: the load tolerance and the starts (fitted on the fit part).
    cost_fit = linear_costs(problem, fit)
    tol, greedy = _tolerance_ladder(problem, cost_fit, class_tolerance)
    cap = problem.load_cap(tol)
    default = problem.default_expert2class
    default_ok = bool((problem.class_loads(default) <= cap).all())
    starts = _start_maps(problem, cap, greedy)
    if not problem.group_preserving:
        gstart = _group_structured_start(problem, cost_fit, cap, model_groups)
        if gstart is not None:
            starts.append(("group_structured", gstart))
    if hint_phy2log is not None and np.array_equal(np.sort(hint_phy2log), np.arange(E)):
        h = np.empty(E, dtype=np.int64)
        h[np.asarray(hint_phy2log, dtype=np.int64)] = problem.slot2class  # expert at slot p: p's class
        if _is_structurally_valid(problem, h) and (problem.class_loads(h) <= cap).all():
            starts.append(("layout_hint", h))
    if not starts:  # pragma: no cover - the ladder ends at the default's excess, which fits
        raise SolverError(f"layer {problem.layer}: no map meets the load caps")
    # Step 1b: local search from every start; keep the best on the fit part.
    ls_fit = SwapSearch(problem, fit)
    polished = [(name, ls_fit.run(m, cap)) for name, m in starts]
    names = [n for n, _ in polished]
    ls_name, ls_map = min(polished, key=lambda nm: (score(nm[1], fit), names.index(nm[0])))
    details["local_search_start"] = ls_name
    candidates: dict[str, np.ndarray] = {"default": default, "local_search": ls_map}
    # Step 1c: the search on the fit part (all of the budget when there is no validation part).
    det_fit = budget.deterministic_time * (0.5 if has_val else 1.0)
    m_fit, bound_fit, proved_fit = search(fit, ls_map, det_fit, "fit")
    if m_fit is not None and score(m_fit, fit) < score(ls_map, fit):
        candidates["search"] = m_fit
    order = list(candidates)
    table = {n: {"fit": score(m, fit), "validation": score(m, val), "all": score(m, every)} for n, m in candidates.items()}
    details["candidates"] = table

    # Step 3: choose on the validation part; refit on all tokens.
    bound: int | None
    if has_val:
        winner = min(order, key=lambda n: (table[n]["validation"], table[n]["fit"], order.index(n)))
        final_name, final = winner, candidates[winner]
        hint_name = winner
        if winner == "default" and not default_ok:
            hint_name = min((n for n in order if n != "default"), key=lambda n: (table[n]["all"], order.index(n)))
        m_all, bound, proved = search(every, candidates[hint_name], budget.deterministic_time - det_fit, "all")
        if winner != "default" and m_all is not None and score(m_all, every) < score(final, every):
            if score(m_all, val) <= table["default"]["validation"]:
                final_name, final = "refit_all", m_all
            else:
                details["refit_rejected"] = "worse than the default on the validation part"
    else:
        winner = min(order, key=lambda n: (table[n]["all"], order.index(n)))
        final_name, final, bound, proved = winner, candidates[winner], bound_fit, proved_fit
    details["validation_winner"] = winner
    details["runs"] = runs
    crossings = score(final, every)
    if problem.cost_mode == "per_pair":
        from solvers.bounds import per_pair_class_bound

        lp = per_pair_class_bound(problem, every, cap)
        details["transport_lp_bound_crossings"] = None if lp.bound is None else round(lp.bound, 6)
        if lp.bound is not None:
            bound = max(bound if bound is not None else 0, int(math.ceil(lp.bound - 1e-6)))
    if bound is not None:
        # The search space is the maps within the caps plus the default map itself.
        if not default_ok:
            bound = min(bound, table["default"]["all"])
        bound = min(bound, crossings)
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
        validation_crossings=score(final, val),
        default_validation_crossings=table["default"]["validation"],
        load_max_over_mean=round(rank_load_ratio(problem, slots), 6),
        load_max_over_mean_floor=round(rank_load_floor(problem, final), 6),
    )
    return LayerOutcome(problem.layer, slots, crossings, bound, proved, details, time.monotonic() - t_start)


# =============================================================================================
# All layers: budgets, the process pool, the plan
# =============================================================================================
@dataclass(frozen=True)
class ExpertPlan:
    """The expert maps of every MoE layer for one rank layout.

    phy2log : (num_moe_layers, num_experts) logical expert of each physical slot.
    objective_bytes : the evaluator's ``cross_domain_bytes_per_step`` on the sampled tokens (the
        instance's cost mode) of ``Placement(rank2gpu, phy2log)``.
    bound_bytes : sum of the per-layer proved lower bounds (bytes per step) for this rank layout, if
        every layer has one.
    details : ``{"layers": [per-layer dict, ...], ...}`` (status, objective, bound, candidate scores
        on the fit / validation / all tokens, chosen candidate, load tolerance, CP-SAT runs).
    """

    phy2log: np.ndarray
    objective_bytes: float
    bound_bytes: float | None
    details: dict = field(default_factory=dict)

    @property
    def proved(self) -> bool:
        return all(d.get("status") in ("optimal", "trivial") for d in self.details.get("layers", []))


def _stage_classes(layout: LayoutIndex, stage: int) -> int:
    """Number of classes of a stage: distinct domain signatures of its EP ranks over its EP groups."""
    return int(np.unique(layout.group_domain[stage].T, axis=0).shape[0])


def _layer_weight(instance: Instance, layout: LayoutIndex, layer: int) -> tuple[float, float]:
    """``(weight, pairs)`` of a layer, known without building it: its sampled (token, expert) pairs
    (0 for a trivial layer), and those times its classes beyond the first (its relative difficulty)."""
    C = _stage_classes(layout, int(instance.moe_layer2stage[layer]))
    dp, T, k = instance.routing.topk.shape[1:]
    pairs = float(dp * T * k) if C > 1 else 0.0
    return pairs * (C - 1), pairs


def deterministic_budget(time_limit_s: float, num_workers: int, weights: Sequence[float],
                         pairs: Sequence[float] | None = None) -> list[float]:
    """CP-SAT deterministic time per layer from the user's wall-clock limit (deterministic).

    Of the limit less a fixed reserve, :data:`_CPSAT_SHARE` is meant for CP-SAT (the rest is slack for
    a loaded machine); the estimated non-CP-SAT work (greedy, local search, enumeration, balancing:
    :data:`_OVERHEAD_S_PER_10K_NETS` per 10,000 sampled tokens of top-8, scaled by ``pairs``) comes
    off that, and what is left, times the workers and :data:`DET_PER_WALL_S`, is shared in
    proportion to ``weights``.  It depends only on its arguments, never on the clock, so the same
    limit gives the same budgets, and results, on a busy or an idle machine.
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.sum() <= 0:
        return [0.0] * len(w)
    workers = max(1, int(num_workers))
    tokens_equiv = (np.asarray(pairs, dtype=np.float64) if pairs is not None else w) / 8.0
    overhead = _OVERHEAD_S_PER_10K_NETS * float(tokens_equiv.sum()) / 1e4 / workers
    wall = max(0.0, (time_limit_s - _FIXED_OVERHEAD_S) * _CPSAT_SHARE - overhead)
    total = wall * workers * DET_PER_WALL_S
    return [float(x) for x in total * w / w.sum()]


# Per-process state of the layer workers: the instance and layout are sent once per process (through
# the pool initializer), not once per layer.
_WORKER: dict = {}


def _init_pool_worker(*args) -> None:
    """Pool initializer: leave SIGINT/SIGTERM to the parent (it stops the solve and kills us)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _init_worker(*args)


def _stop_now(deadline: float) -> bool:
    """The deadline has passed, or (in the calling process) the caller asked to stop."""
    if time.monotonic() >= deadline:
        return True
    opts = _WORKER.get("options")
    return bool(opts is not None and opts.should_stop())


def _init_worker(instance: Instance, rank2gpu: np.ndarray, group_preserving: bool, validation_fraction: float) -> None:
    _WORKER.clear()
    _WORKER.update(
        instance=instance,
        rank2gpu=rank2gpu,
        layout=LayoutIndex(instance, rank2gpu, instance.routing.tokens_per_source),
        group_preserving=group_preserving,
        validation_fraction=validation_fraction,
    )


def _worker_problem(layer: int) -> LayerProblem:
    w = _WORKER
    return build_layer_problem(w["instance"], w["rank2gpu"], layer, group_preserving=w["group_preserving"],
                               validation_fraction=w["validation_fraction"], layout=w["layout"])


def _solve_layer_task(args: tuple) -> LayerOutcome:
    layer, budget, model_groups, tol, hint_row = args
    if _stop_now(budget.deadline):
        return _default_outcome(layer, "stopped before the layer started", hint_row)
    problem = _worker_problem(layer)
    return solve_layer(problem, budget, model_groups=model_groups, class_tolerance=tol, hint_phy2log=hint_row)


def _default_outcome(layer: int, reason: str, hint_row: np.ndarray | None = None) -> LayerOutcome:
    """The map of a layer left unsolved at a stop or the deadline, with no work at all.

    The map the rank layout was scored with (``hint_row``) when there is a valid one: the layout
    was chosen with it, and on a layout other than the default the identity map was never scored
    (a cut that fell back to the identity made the slowest stage slower than the default layout's
    in one measured run).  Otherwise the default (identity) map.  Crossings come from the evaluator.
    """
    model = _WORKER["instance"].model
    E = model.num_experts
    row, chosen = np.arange(E, dtype=np.int64), "default"
    if hint_row is not None and _valid_map(np.asarray(hint_row, dtype=np.int64), model, _WORKER["group_preserving"]):
        row = np.empty(E, dtype=np.int64)  # hint_row is phy2log (slot -> expert); invert it
        row[np.asarray(hint_row, dtype=np.int64)] = np.arange(E, dtype=np.int64)
        chosen = "layout_hint"
    details = {"layer": layer, "status": "heuristic", "chosen": chosen, "fallback_reason": reason,
               "objective_crossings": None, "bound_crossings": None}
    return LayerOutcome(layer, row, -1, None, False, details)


def _valid_map(row: np.ndarray, model, group_preserving: bool) -> bool:
    """``row`` (a phy2log row) is a permutation of the experts and, when required, keeps groups whole."""
    E = model.num_experts
    if row.shape != (E,) or not np.array_equal(np.sort(row), np.arange(E)):
        return False
    if not group_preserving:
        return True
    size = model.experts_per_group
    blocks = (row // size).reshape(-1, size)
    return bool((blocks == blocks[:, :1]).all())


def _spawn_can_start() -> bool:
    """Whether "spawn" children can re-create ``__main__``: not when it was read from stdin or ``-c``
    (its ``__file__`` is not a file).  There a child dies in its preparation and the parent can block
    writing the task payload to it, so such callers are served in-process."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or getattr(main, "__spec__", None) is not None:
        return True  # interactive (spawn does not re-run it) or ``python -m``
    return os.path.isfile(path)


def _run_pool(tasks: list, workers: int, deadline: float, init_args: tuple, finished: Callable, outcomes: dict,
              options: SolveOptions) -> None:
    """Run layer tasks in a pool of ``workers`` spawned processes until done, the deadline or a stop.

    The parent polls :meth:`SolveOptions.should_stop` while it waits.  At the deadline or a stop our
    own workers (which ignore SIGINT/SIGTERM) are killed and the unsolved layers keep the default
    map; if the pool breaks, the remaining layers are solved in this process.
    """
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn"),
                               initializer=_init_pool_worker, initargs=init_args)
    futures = {pool.submit(_solve_layer_task, task): task[0] for task in tasks}
    pending = set(futures)
    reason = None
    try:
        while pending:
            done, pending = wait(pending, timeout=0.1, return_when=FIRST_COMPLETED)
            for fut in sorted(done, key=lambda f: futures[f]):
                finished(fut.result())
            if pending and (time.monotonic() >= deadline or options.should_stop()):
                reason = "stop requested" if options.stop_requested() else "deadline reached"
                break
    except BrokenProcessPool as exc:
        # A worker died (killed from outside, out of memory, an unguarded __main__ under "spawn").
        log.warning("expert placement: the process pool broke (%s); solving the rest in-process", exc)
        pool.shutdown(wait=False, cancel_futures=True)
        for task in tasks:
            if task[0] not in outcomes:
                finished(_solve_layer_task(task))
        return
    if reason is None:
        pool.shutdown(wait=True)
        return
    log.warning("expert placement: %s with %d layers unsolved; they keep the layout's map (else the default)",
                reason, sum(1 for t in tasks if t[0] not in outcomes))
    for proc in list(getattr(pool, "_processes", {}).values()):  # our own workers, by object
        proc.kill()
    pool.shutdown(wait=False, cancel_futures=True)
    for task in tasks:
        if task[0] not in outcomes:
            finished(_default_outcome(task[0], reason, task[4]))


def place_experts(
    instance: Instance,
    rank2gpu: np.ndarray,
    options: SolveOptions,
    *,
    deadline: float,
    layers: Sequence[int] | None = None,
    validation_fraction: float = VALIDATION_FRACTION,
    class_tolerance: float | None = None,
    deterministic_time: float | None = None,
    hint_phy2log: np.ndarray | None = None,
    use_pool: bool | None = None,
) -> ExpertPlan:
    """Optimise every MoE layer's expert map for a FIXED rank layout ``rank2gpu``.

    Parameters
    ----------
    instance : the problem (the solver view; the held-out window is never read).
    rank2gpu : (world,) GPU of each global rank.
    options : seed, workers (processes), group preservation, progress callback.
    deadline : ``time.monotonic()`` instant by which to return (safety net; the work itself is sized
        by a deterministic budget from ``options.time_limit_s``).
    layers : MoE layers to optimise (default all); the others keep the default (identity) map.
    validation_fraction : share of each source's last sampled tokens held back to choose between
        candidates (0 disables the guard: every candidate is fitted and judged on all tokens).
    class_tolerance : starting per-class load tolerance (default: :data:`CLASS_LOAD_TOLERANCE`, or
        :data:`CLASS_LOAD_TOLERANCE_GROUP_PRESERVING` for group-preserving maps).
    deterministic_time : total CP-SAT deterministic budget (default: from the time limit).
    hint_phy2log : (num_moe_layers, num_experts) an expert map to start from as well (e.g. the one the
        rank layout was scored with); used where it meets the load caps.
    use_pool : solve layers in a process pool (``None``: when the instance has at least
        :data:`POOL_MIN_PAIRS` sampled (token, expert) pairs on straddling layers and more than one
        worker; starting processes costs seconds).  The maps do not depend on it.

    Returns
    -------
    ExpertPlan
    """
    t0 = time.monotonic()
    model = instance.model
    L, E = model.num_moe_layers, model.num_experts
    rank2gpu = np.asarray(rank2gpu, dtype=np.int64)
    if rank2gpu.shape != (instance.parallel.world_size,):
        raise InvalidInputError(f"rank2gpu: expected {instance.parallel.world_size} ranks, found shape {rank2gpu.shape}")
    if E % instance.parallel.ep:
        raise InfeasibleError(f"model.num_experts: {E} experts do not fill {instance.parallel.ep} EP ranks evenly")
    gp = bool(options.group_preserving_for(instance)) and model.num_groups > 1
    if class_tolerance is None:
        class_tolerance = CLASS_LOAD_TOLERANCE_GROUP_PRESERVING if gp else CLASS_LOAD_TOLERANCE
    todo = list(range(L)) if layers is None else sorted({int(x) for x in layers})
    for li in todo:
        if not 0 <= li < L:
            raise InvalidInputError(f"layers: MoE layer {li} does not exist (the model has {L})")
    layout = LayoutIndex(instance, rank2gpu, instance.routing.tokens_per_source)
    weights, pairs = zip(*[_layer_weight(instance, layout, li) for li in todo]) if todo else ((), ())
    if deterministic_time is None:
        dets = deterministic_budget(options.time_limit_s, options.num_workers, weights, pairs)
    else:
        w = np.asarray(weights) if sum(weights) > 0 else np.ones(len(todo))
        dets = [float(deterministic_time * x / w.sum()) for x in w]
    budgets = {li: LayerBudget(d, (options.seed * 1_000_003 + li) % (2**31 - 1), deadline) for li, d in zip(todo, dets)}
    weight_of = dict(zip(todo, weights))
    outcomes: dict[int, LayerOutcome] = {}
    done = 0

    def finished(o: LayerOutcome) -> None:
        nonlocal done
        done += 1
        outcomes[o.layer] = o
        d = o.details
        options.report(f"layer {o.layer + 1}/{L}: {d['status']}, {d['chosen']}, "
                       f"{d['objective_crossings']} crossings (bound {o.bound}), {o.wall_s:.1f} s  [{done}/{len(todo)}]")

    if hint_phy2log is not None:
        hint_phy2log = np.asarray(hint_phy2log, dtype=np.int64)
        if hint_phy2log.shape != (L, E):
            raise InvalidInputError(f"hint_phy2log: expected shape {(L, E)}, found {hint_phy2log.shape}")

    def task(li: int) -> tuple:
        hint = None if hint_phy2log is None else hint_phy2log[li]
        return (li, budgets[li], model.num_groups, class_tolerance, hint)

    _init_worker(instance, rank2gpu, gp, validation_fraction)  # this process: trivial layers, 1 worker
    _WORKER["options"] = options  # stop requests reach the in-process work (and CP-SAT) directly
    try:
        hard = [li for li in todo if weight_of[li] > 0]
        for li in todo:
            if weight_of[li] == 0:
                finished(_solve_layer_task(task(li)))
        # Heaviest layers first, so the pool's last tasks are short.
        hard.sort(key=lambda li: (-weight_of[li], li))
        tasks = [task(li) for li in hard]
        workers = max(1, min(int(options.num_workers), len(tasks)))
        if use_pool is None:
            use_pool = sum(pairs) >= POOL_MIN_PAIRS
        if use_pool and workers > 1 and not _spawn_can_start():
            log.warning("expert placement: worker processes cannot re-import this __main__ (stdin or -c); "
                        "solving in this process")
            use_pool = False
        if workers == 1 or not use_pool:
            for t in tasks:
                finished(_solve_layer_task(t))
        else:
            _run_pool(tasks, workers, deadline, (instance, rank2gpu, gp, validation_fraction), finished, outcomes,
                      options)
    finally:
        _WORKER.clear()
    bytes_per_crossing = float(instance.parallel.tokens_per_dp_rank_per_step / instance.routing.tokens_per_source
                               * model.roundtrip_bytes_per_copy)
    phy2log = np.tile(np.arange(E, dtype=np.int64), (L, 1))
    for li, o in outcomes.items():
        phy2log[li, o.expert2slot] = np.arange(E)
    placement = Placement(rank2gpu, phy2log)
    metrics = evaluate(instance, placement, window="sampled", layout=layout)
    for li in todo:  # layers left at the default map: their cost from the evaluator
        o = outcomes[li]
        if o.crossings < 0:
            o.crossings = int(round(metrics.cross_domain_bytes_per_layer[li] / bytes_per_crossing))
            o.details["objective_crossings"] = o.crossings
    layer_bytes = {li: outcomes[li].crossings * bytes_per_crossing for li in todo}
    for li in todo:
        if not math.isclose(layer_bytes[li], metrics.cross_domain_bytes_per_layer[li], rel_tol=1e-9, abs_tol=1e-3):
            raise SolverError(f"layer {li}: internal cost {layer_bytes[li]} disagrees with the evaluator "
                              f"{metrics.cross_domain_bytes_per_layer[li]}")
    from solvers.bounds import sum_bounds

    bound_bytes = None
    if layers is None or len(todo) == L:
        bound_bytes = sum_bounds(None if outcomes[li].bound is None else outcomes[li].bound * bytes_per_crossing
                                 for li in todo)
    layer_details = [outcomes[li].details for li in todo]
    details = {
        "layers": layer_details,
        "group_preserving": gp,
        "validation_fraction": validation_fraction,
        "class_load_tolerance": class_tolerance,
        "gpu_load_tolerance": GPU_LOAD_TOLERANCE,
        "deterministic_time_total": round(float(sum(dets)), 6),
        "det_per_wall_s": DET_PER_WALL_S,
        # A valid bound on the total even when some layers have none (they count 0 in it).
        "partial_bound_bytes": float(sum((outcomes[li].bound or 0) * bytes_per_crossing for li in todo)),
        "layers_without_bound": sum(1 for li in todo if outcomes[li].bound is None),
        "layers_proved": sum(1 for d in layer_details if d["status"] in ("optimal", "trivial")),
        "layers_total": len(todo),
    }
    log.info("expert placement: %d layers in %.1f s", len(todo), time.monotonic() - t0)
    return ExpertPlan(phy2log=phy2log, objective_bytes=metrics.cross_domain_bytes_per_step, bound_bytes=bound_bytes,
                      details=details)
