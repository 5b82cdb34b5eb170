"""The rank layout: which physical GPU runs each rank of the job (DESIGN.md sections 2, 7 and 8).

For Megatron-Core and TorchTitan, which accept no expert map, the rank layout is the main lever:
it decides how each EP group spreads over NVLink domains and which data-parallel replica, with its
own routing statistics, sits in which domain.  :func:`plan_layout` maps the job's ranks onto the
available GPUs in four steps.

Step 1, blocks.  The ranks of a pipeline stage split into *blocks*: the smallest sets of ranks
    closed under "same TP x CP group" (the ``tp*cp`` ranks of one data-parallel replica, kept
    inside a tray, or a domain when wider than a tray) and "same EP group".  With the default order
    ``tp-cp-ep-dp-pp`` and ``tp*cp`` dividing ``ep`` a block is one EP group.  A block whose ranks
    all sit in one NVLink domain moves no byte across domains.
Step 2, footprints, jointly with the experts at domain granularity.  A block's *shape* is the
    multiset of its GPU counts per domain (tray-granular where the free GPUs allow it).  A shape is
    priced by placing experts on its parts (:func:`place_on_parts`: an assignment-problem start and
    a swap search with exact incremental deltas, the same domain-level model the expert placer
    solves per layer) for a few MoE layers spread over the model, so its price already contains
    the best expert placement found for it; a block pays that price per layer times its stage's
    MoE layers.  A MILP (:class:`FootprintModel`, HiGHS through ``scipy.optimize.milp``) then picks
    one shape per block and its domains under the domains' free-GPU capacities::

        x[b, d, v]  block b puts exactly v GPUs in domain d          (at most one v per (b, d))
        s[b, k]     block b takes shape k                              (exactly one k per b)
        sum_{d,v} v x[b,d,v] = n_b;   sum_{b,v} v x[b,d,v] <= free_d
        sum_d x[b,d,v] = sum_k mult_k(v) s[b,k]   for every part size v (links parts to shapes)

    The shapes are many (every partition of a block into tray multiples: 230 for an EP group of 64
    on 4-GPU trays), so they are priced lazily, column-generation style.  A shape is priced per MoE
    layer on a few layers spread over the model and scaled by each block's layers.  Two-part shapes
    are priced up front; any other shape enters with an estimate built from them (what lands in
    each part when the rest of the block is one domain, summed over its parts), never below two
    lower bounds (merging two parts never costs more; and the cost is at least half the sum of its
    parts' two-part prices).  After each solve, every straddling (block, shape) of the pick is
    scored *exactly* (all of the block's own MoE layers) and that exact score replaces the price in
    the next solve; the loop ends when the pick is exact everywhere (then it is optimal for the
    prices) or the work budget ends; shapes priced above the incumbent are left out.

    Objectives.  ``bottleneck`` minimises the slowest stage's all-to-all time (per layer the busier
    of its busiest NIC and its NVLink floor, summed over the stage), total bytes as a tie-breaker.
    ``total`` (the default) minimises total cross-domain bytes per step *subject to no stage being
    slower than the default layout's slowest stage*: a bytes-optimal footprint may leave a 4-GPU
    sliver of an EP group in another rack, whose few NICs then carry the stage's whole cross-rack
    traffic.  The cap is the default layout's slowest stage on this estimator (the default scored
    with its own expert maps); shapes whose time for a block (exact, priced or estimated) exceeds
    it are left out of the model, and the default's own (block, shape) entries are within it by
    construction, so the cap never makes the model infeasible.

    Candidates.  Complete layouts are scored exactly on the estimator and compete at the end: the
    ``default`` layout, ``packed`` (:func:`solvers.packed.packed_rank2gpu`, whole EP groups packed
    into racks, best fit: the careful engineer's layout), ``first_fit`` (blocks with most MoE
    layers first, each into the tightest domain that holds it, the rest split over the domains
    with most room), the MILP's pick and the pick with moved replicas (Step 3).  Their footprints
    are the MILP's warm start (HiGHS as scipy exposes it takes no starting solution, so the best of
    them is the fallback, the yardstick every pick must beat and the cutoff that prunes shapes),
    and their blocks' scores are exact entries of the model.  The default and packed layouts are
    scored before anything else, whatever the budget, so the layout returned at any limit is never
    worse than either on the estimator, under the objective in force and the cap.  (CP-SAT was
    tried first on the footprint model: with one worker it took 10-20 s to prove what HiGHS proves
    in a few, and its interleaved multi-worker mode, the deterministic one, stalled far from the
    optimum.)
Step 3, data-parallel sources.  On a straddling block, which replica runs on which side matters
    when replicas route differently.  The module *alternates*: with the experts fixed, replicas go
    to the block's parts by an assignment problem (``scipy.optimize.linear_sum_assignment``, cost =
    the replica's crossings from each part, summed over the stage's layers); then the experts are
    placed again; until neither improves.  The tokens of each replica are split into a fit part and
    a validation part (the last quarter); the moved replicas are kept only if they are no worse than
    the plain contiguous order on the validation part.  Under group-preserving expert maps a
    replica moves only inside its expert-group block (moving it elsewhere would change which slots
    of each group lie in which domain); under DeepEP/HybridEP the slices are fixed and no replica
    moves.
Step 4, concrete GPUs.  Each block's parts get whole free trays of their domain first, in tray
    order, so TP/CP groups stay inside a tray; ranks of a part take its GPUs in rank order, and
    parts are laid out as consecutive EP-rank slices (larger parts first), which is exactly the
    DeepEP/HybridEP rule ``rank == rdma_rank * num_nvl_ranks + nvl_rank`` when the shape has equal
    parts.  The result is checked with :func:`placement.checker.deepep_violations` when a consumer
    rule is asked for.

The choice.  Among the candidates within the cap, the best on the objective (bytes then time for
``total``, time then bytes for ``bottleneck``); ``details["candidates"]`` lists them all.  Then the
evaluator has the last word on time: the chosen layout with its expert map must have
``placement.cost.evaluate(...).alltoall_time_s_per_step`` no larger than the default layout's as
the ``default`` solver gives it (contiguous experts); otherwise the next candidate is checked, and
the default layout with contiguous experts always passes (``details["evaluator_check"]``).  The
estimator counts bytes exactly for a given expert map (what :mod:`placement.cost` counts;
``tests/test_layout.py`` checks it against the evaluator); its times are close but not exact
(per-block sums of per-layer maxima, the NVLink floor of the contiguous map), hence the check.  Each
EP group is scored with its own expert map, while the EP groups of one stage share one map (with the
default order and ``dp == ep``, as on the committed DeepSeek-V3 instances, a stage is one EP group).

The footprint and the expert placement are modelled *jointly at domain granularity* (every shape
is priced with its own expert placement), and the data-parallel sources and the experts of a
straddling block are *alternated* until neither improves (Step 3).

Determinism and the clock.  The layout's work is sized by a deterministic budget
(``LAYOUT_TIME_SHARE * options.time_limit_s`` predicted seconds, ``options.time_limit_s`` being the
solver's work budget, which depends on the instance's size only): every optional step (pricing a
shape, scoring a block, a MILP round, the replica alternation) is started only if its *predicted*
cost fits what is left, predicted from sizes and counts, never from the clock (:class:`_Budget`);
scoring the default and packed layouts and the evaluator's check always run and are charged to it.  HiGHS gets a node limit (deterministic) and solves each round to the end;
every other step is a pure function of its inputs (swap searches count swaps).  So the same
instance, options and seed give the same layout and the same ``details``, byte for byte, on a fast
or a busy machine.  The wall-clock deadline and stop requests are the safety net: they are polled
between steps and between the layers of every scoring (HiGHS gets the wall time left as its time
limit), steps stop early enough to leave the evaluator's check its predicted time, and the best
complete candidate so far is returned at once (after a cut the evaluator checks one candidate,
then falls back to the default layout); ``details["wall_clock_cut"]``
says when that happened (the only case where the result can depend on the clock).  ``details``
holds no wall-clock value (timings go to the log).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np
from scipy import sparse
from scipy.optimize import linear_sum_assignment

from placement.cost import Metrics
from placement.model import InfeasibleError, Instance, SolverError
from solvers.base import SolveOptions

__all__ = [
    "LayoutPlan",
    "Block",
    "PartPlacement",
    "ShapeScore",
    "FootprintModel",
    "layout_blocks",
    "place_on_parts",
    "shape_candidates",
    "BlockScorer",
    "stage_footprints",
    "estimate_layout",
    "plan_layout",
    "LAYOUT_TIME_SHARE",
]

log = logging.getLogger(__name__)

#: Swap-search limit per (EP group, layer, shape) scoring, counted in swaps (deterministic).
MAX_SWAPS = 64
#: MoE layers (spread over the model) on which a shape's price per layer is measured.
PROXY_LAYERS = 4
#: Upper bound on candidate shapes per block; beyond it the number of parts is capped.
MAX_SHAPES_PER_BLOCK = 2500
#: Share of each replica's sampled tokens (the last ones) held back to validate moved replicas.
VALIDATION_FRACTION = 0.25
#: Rounds of the replicas <-> experts alternation on a straddling block.
MAX_SOURCE_ROUNDS = 4
#: Share of the solver's work budget (``SolveOptions.time_limit_s``) and of its remaining wall time
#: that ``solvers.cpsat`` gives the rank layout (the expert placer gets the rest; with most blocks
#: inside one domain most of its layers are trivial).
LAYOUT_TIME_SHARE = 0.5
#: Share of the layout's work budget kept for the replicas <-> experts alternation.
FINISH_SHARE = 0.2
#: Predicted seconds of one expert placement on the parts of one EP group in one layer
#: (:func:`place_on_parts`): ``_SCORE_BASE_S + _SCORE_S_PER_PAIR * pairs * (parts - 1) ** 1.3``,
#: ``pairs`` the group's (token, expert) pairs.  Fitted on the committed instances (1-50 ms per
#: call; the swap search grows with the parts); used for the deterministic work budget only.
_SCORE_BASE_S = 1e-3
_SCORE_S_PER_PAIR = 1e-7
#: Predicted seconds of one footprint MILP: ``_MILP_BASE_S + _MILP_S_PER_NNZ_1_5 * nonzeros ** 1.5``
#: (HiGHS solves these models at the root node: 0.01 s at 230 nonzeros, 0.7-2.1 s at 19,500 on
#: dsv3_1024, measured on the 2-core build machine).
_MILP_BASE_S = 0.02
_MILP_S_PER_NNZ_1_5 = 8e-7
#: The min-max (``bottleneck``) model leaves HiGHS a weak LP bound: its rounds take several times
#: longer (6-13 s on dsv3_1024, against 0.7-2 s for ``total``), and vary more.
_MILP_BOTTLENECK_FACTOR = 4.0
#: Deterministic cap on the branch-and-bound nodes of one footprint MILP (HiGHS ``node_limit``).
_MILP_NODE_LIMIT = 500
#: Predicted seconds of one run of :func:`placement.cost.evaluate` per routed expert id of the
#: sampled window (the API's own scoring estimate, ``placement.api.SCORING_S_PER_EXPERT_ID``).
_EVAL_S_PER_EXPERT_ID = 1e-7
#: Weight of the tie-breaking objective relative to the first one (prices in GB and ms).
_TIE_BREAK = 1e-6
#: Scale of the MILP's prices: gigabytes and milliseconds.
_BYTES_PER_UNIT = 1e9
_SECONDS_PER_UNIT = 1e-3


# =============================================================================================
# Results
# =============================================================================================
@dataclass(frozen=True)
class LayoutPlan:
    """What :func:`plan_layout` returns.

    rank2gpu : (world,) int64, physical GPU of each global rank.
    details : JSON-serialisable, deterministic facts (no wall-clock values): per-stage footprints
        over domains, the estimated total cross-domain bytes per step and slowest-stage all-to-all
        time of every candidate (``candidates``) and of the chosen one, the stage-time cap, the
        evaluator's check, solver status, the work budget and what it paid for.
    phy2log : (num_moe_layers, num_experts) int64 expert map the layout was scored with (domain
        level: which experts sit in which domain; inside a domain the order is by expert id).  A
        valid placement together with ``rank2gpu``; the expert placer refines it.
    """

    rank2gpu: np.ndarray
    details: dict
    phy2log: np.ndarray | None = None


@dataclass(frozen=True)
class Block:
    """The smallest set of a stage's ranks closed under TP x CP groups and EP groups.

    index : position in :func:`layout_blocks`'s list.
    stage : pipeline stage.
    ranks : (n,) global ranks in layout order: atoms in order of their first EP position.
    atoms : (n_atoms, a) global ranks of each TP x CP group (one data-parallel replica of the
        stage), sub-ranks in global-rank order (the evaluator deals a replica's sampled tokens to
        them in turn).
    atom_replica : (n_atoms,) data-parallel index of each atom.
    ep_groups : (n_groups, ep) global ranks of each EP group inside the block, in EP-rank order.
    moe_layers : (m,) MoE layer positions of the stage.
    """

    index: int
    stage: int
    ranks: np.ndarray
    atoms: np.ndarray
    atom_replica: np.ndarray
    ep_groups: np.ndarray
    moe_layers: np.ndarray

    @property
    def size(self) -> int:
        return int(self.ranks.shape[0])

    @property
    def atom_size(self) -> int:
        return int(self.atoms.shape[1])


@dataclass(frozen=True)
class PartPlacement:
    """Experts of one layer on the parts (domains) of one EP group.

    expert2part : (E,) part of each logical expert.
    group2block : (G,) expert-group block of each expert group (group-preserving), else ``None``.
    crossings : sampled-token crossings in the cost mode (remote domains, or remote experts).
    nic_copies : (ep,) crossings on each EP rank's NIC, one direction (sent as a source plus an
        even share of those received by its part).
    arrivals : (P,) crossings that land in each part (they sum to ``crossings``).
    """

    expert2part: np.ndarray
    group2block: np.ndarray | None
    crossings: int
    nic_copies: np.ndarray
    arrivals: np.ndarray


@dataclass(frozen=True)
class ShapeScore:
    """One block's estimate under one footprint (bytes and seconds per optimizer step).

    total_bytes : cross-domain bytes summed over the block's EP groups and MoE layers.
    time_s : the block's all-to-all time: per layer the busier of its busiest NIC and the stage's
        NVLink floor, summed over the layers.
    layer_bytes : (m,) per MoE layer of the stage.
    layer_nic_s : (m,) busiest NIC time per MoE layer (without the NVLink floor).
    part_bytes : (P,) of ``total_bytes``, the bytes landing in each part (domain) of the block.
    part_nic_s : (P,) per part, its busiest NIC's time summed over the layers.
    """

    total_bytes: float
    time_s: float
    layer_bytes: tuple[float, ...]
    layer_nic_s: tuple[float, ...] = ()
    part_bytes: tuple[float, ...] = ()
    part_nic_s: tuple[float, ...] = ()


# =============================================================================================
# The work budget: deterministic decisions, the wall clock as a safety net
# =============================================================================================
class _Stopped(Exception):
    """The wall-clock deadline passed, or the caller asked to stop, inside a step."""


class _Budget:
    """The layout's work budget in *predicted* seconds, and the wall-clock safety net.

    Every decision to start a step (price a shape, solve a MILP round, move replicas, run the
    evaluator) is taken on predicted costs alone: functions of the instance's sizes and of counts
    of work done (:meth:`BlockScorer.predict_s`, :func:`_milp_predict_s`), never of the clock, so the
    same instance, options and seed do the same work on a fast or a busy machine.  The deadline and
    stop requests are polled between steps and between the layers of a scoring (:meth:`stopped`);
    when one ends a step, :attr:`cut` records it (the only way the result can depend on the clock).

    Parameters
    ----------
    work_s : the budget, predicted seconds.
    deadline : ``time.monotonic()`` instant of the safety net.
    options : for :meth:`SolveOptions.stop_requested`.
    finish_s : wall seconds kept before ``deadline`` for the finish (the evaluator's check): steps
        are cut that much earlier.
    """

    def __init__(self, work_s: float, deadline: float, options: SolveOptions, finish_s: float = 0.0):
        self.work_s = float(work_s)
        self.deadline = float(deadline) - max(0.0, float(finish_s))
        self.options = options
        self.charged_s = 0.0  # predicted seconds of MILP solves and evaluator runs
        self.scorers: list[BlockScorer] = []  # their expert placements count too
        self.cut = False  # the wall clock or a stop request ended a step
        self.exhausted = False  # a step was skipped because the budget could not afford it

    def spent_s(self) -> float:
        return self.charged_s + sum(sc.work_s for sc in self.scorers)

    def affords(self, predicted_s: float) -> bool:
        """True when ``predicted_s`` fits in what is left (deterministic); records when it does not."""
        ok = self.spent_s() + predicted_s <= self.work_s
        self.exhausted = self.exhausted or not ok
        return ok

    def charge(self, predicted_s: float) -> None:
        self.charged_s += float(predicted_s)

    def stopped(self) -> bool:
        """True once the deadline has passed or a stop was requested (and :attr:`cut` is set)."""
        if self.options.stop_requested() or time.monotonic() >= self.deadline:
            self.cut = True
        return self.cut

    def check(self) -> None:
        """Raise :class:`_Stopped` when :meth:`stopped`."""
        if self.stopped():
            raise _Stopped

    def wall_left_s(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


# =============================================================================================
# Step 1: blocks
# =============================================================================================
def layout_blocks(instance: Instance) -> list[Block]:
    """The blocks of every stage, stage by stage, each ordered by its first rank.

    Returns
    -------
    list of :class:`Block`; their ranks partition the world.
    """
    par = instance.parallel
    rank2stage, rank2dp = par.rank2stage, par.rank2dp
    groups = par.stage_ep_groups  # (pp, G, ep)
    l2s = instance.moe_layer2stage
    out: list[Block] = []
    for s in range(par.pp):
        stage_ranks = np.flatnonzero(rank2stage == s)
        pos = {int(r): i for i, r in enumerate(stage_ranks)}
        parent = list(range(len(stage_ranks)))

        def find(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        def union(members: Iterable[int]) -> None:
            members = [pos[int(r)] for r in members]
            root = find(members[0])
            for m in members[1:]:
                other = find(m)
                if other != root:
                    parent[other] = root

        atoms = [stage_ranks[rank2dp[stage_ranks] == j] for j in range(par.dp)]
        for atom in atoms:
            union(atom)
        for eg in groups[s]:
            union(eg)
        roots: dict[int, list[int]] = {}
        for i in range(len(stage_ranks)):
            roots.setdefault(find(i), []).append(i)
        ep_pos = {int(r): (gi, k) for gi, eg in enumerate(groups[s]) for k, r in enumerate(eg)}
        comps = sorted(roots.values(), key=lambda c: int(stage_ranks[c[0]]))
        for comp in comps:
            members = set(int(stage_ranks[i]) for i in comp)
            block_atoms = [a for a in atoms if int(a[0]) in members]
            block_atoms.sort(key=lambda a: min(ep_pos[int(r)] for r in a))
            gids = sorted({ep_pos[r][0] for r in members})
            out.append(
                Block(
                    index=len(out),
                    stage=s,
                    ranks=np.concatenate(block_atoms).astype(np.int64),
                    atoms=np.stack(block_atoms).astype(np.int64),
                    atom_replica=np.array([int(rank2dp[a[0]]) for a in block_atoms], dtype=np.int64),
                    ep_groups=np.stack([groups[s][g] for g in gids]).astype(np.int64),
                    moe_layers=np.flatnonzero(l2s == s).astype(np.int64),
                )
            )
    return out


# =============================================================================================
# Step 2a: experts on the parts of one EP group (the domain-level expert placement)
# =============================================================================================
class _Tokens:
    """Sampled tokens of one EP group in one MoE layer.

    topk : (N, k) expert ids; src : (N,) EP rank (position in the group) of the sending rank.
    """

    def __init__(self, topk: np.ndarray, src: np.ndarray, num_experts: int):
        self.topk = np.ascontiguousarray(topk, dtype=np.int64)
        self.src = np.ascontiguousarray(src, dtype=np.int64)
        n, k = self.topk.shape
        self.num_experts = num_experts
        rows = np.repeat(np.arange(n), k)
        a = sparse.csr_matrix((np.ones(n * k), (rows, self.topk.reshape(-1))), shape=(n, num_experts))
        self.At = a.T.tocsr()  # (E, N) incidence

    @property
    def n(self) -> int:
        return int(self.topk.shape[0])

    def tokens_of(self, e: int) -> np.ndarray:
        return self.At.indices[self.At.indptr[e] : self.At.indptr[e + 1]]


def _part_counts(tok: _Tokens, e2p: np.ndarray, num_parts: int) -> np.ndarray:
    """(N, P) how many of each token's experts sit in each part."""
    idx = (np.arange(tok.n)[:, None] * num_parts + e2p[tok.topk]).reshape(-1)
    return np.bincount(idx, minlength=tok.n * num_parts).reshape(tok.n, num_parts).astype(np.int32)


def _crossings(tok: _Tokens, e2p: np.ndarray, src_part: np.ndarray, num_parts: int, mode: str) -> np.ndarray:
    """(N,) crossings of each token: remote parts (``per_domain``) or remote experts (``per_pair``)."""
    if mode == "per_pair":
        return (e2p[tok.topk] != src_part[:, None]).sum(axis=1)
    cnt = _part_counts(tok, e2p, num_parts)
    present = cnt > 0
    return present.sum(axis=1) - present[np.arange(tok.n), src_part]


def _transport(affinity: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """Items -> parts maximising total affinity with exactly ``capacity[i]`` items in part ``i``.

    affinity : (n, P); capacity : (P,) summing to n.  Solved exactly as an assignment problem over
    slots (``linear_sum_assignment``); ties broken by item and part index (deterministic).
    """
    n = affinity.shape[0]
    slot2part = np.repeat(np.arange(len(capacity)), capacity)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    cost = -affinity[:, slot2part].astype(np.float64)
    rows, cols = linear_sum_assignment(cost)
    out = np.empty(n, dtype=np.int64)
    out[rows] = slot2part[cols]
    return out


def _swap_search(
    tok: _Tokens,
    e2p: np.ndarray,
    src_part: np.ndarray,
    num_parts: int,
    mode: str,
    swappable: np.ndarray,
    max_swaps: int,
) -> np.ndarray:
    """Best-improvement swaps of two experts in different parts, with exact deltas.

    ``swappable``: (E,) label; only experts with equal labels may swap (the expert group under a
    group-preserving map, else all zeros).  ``per_domain`` deltas: moving ``e`` from ``a`` to ``b``
    changes a token of ``e`` by ``-[cnt[t,a]==1 and a!=src] + [cnt[t,b]==0 and b!=src]``; a swap
    ``e<->f`` is the two moves plus a correction on tokens holding both (their counts do not change),
    ``sum (R[t,a] + R[t,b])`` over ``t`` in ``T(e) & T(f)``.  That correction is >= 0, so the two
    moves alone are a lower bound and candidates are checked in that order (branch and bound).
    """
    e2p = e2p.copy()
    E = len(e2p)
    P = num_parts
    n = tok.n
    notsrc = np.ones((n, P), dtype=bool)
    notsrc[np.arange(n), src_part] = False
    same = swappable[:, None] == swappable[None, :]
    if mode == "per_pair":
        onehot = np.zeros((n, P))
        onehot[np.arange(n), src_part] = 1.0
        use = np.asarray(tok.At @ onehot)  # (E, P) pairs of e from sources in each part
    cnt = _part_counts(tok, e2p, P) if mode == "per_domain" else None
    for _ in range(max_swaps):
        if mode == "per_domain":
            R = ((cnt == 1) & notsrc).astype(np.float64)
            Ad = ((cnt == 0) & notsrc).astype(np.float64)
            add = np.asarray(tok.At @ Ad)
            rem = np.asarray(tok.At @ R)[np.arange(E), e2p]
            D = add - rem[:, None]
        else:
            D = use[np.arange(E), e2p][:, None] - use
        M = D[:, e2p]  # M[e, f] = delta of moving e into f's part
        approx = M + M.T
        ok = same & (e2p[:, None] < e2p[None, :])
        cand = np.flatnonzero(ok & (approx < -0.5))
        if cand.size == 0:
            break
        order = cand[np.argsort(approx.reshape(-1)[cand], kind="stable")]
        best, best_pair = 0.0, None
        for flat in order:
            lb = approx.reshape(-1)[flat]
            if lb >= best - 0.5:
                break
            e, f = divmod(int(flat), E)
            exact = lb
            if mode == "per_domain":
                both = np.intersect1d(tok.tokens_of(e), tok.tokens_of(f), assume_unique=True)
                if both.size:
                    exact += float(R[both, e2p[e]].sum() + R[both, e2p[f]].sum())
            if exact < best - 0.5:
                best, best_pair = exact, (e, f)
        if best_pair is None:
            break
        e, f = best_pair
        a, b = int(e2p[e]), int(e2p[f])
        if cnt is not None:
            te, tf = tok.tokens_of(e), tok.tokens_of(f)
            cnt[te, a] -= 1
            cnt[te, b] += 1
            cnt[tf, b] -= 1
            cnt[tf, a] += 1
        e2p[e], e2p[f] = b, a
    return e2p


def place_on_parts(
    tok: _Tokens,
    part_of_ep: np.ndarray,
    num_parts: int,
    *,
    experts_per_rank: int,
    mode: str,
    group_size: int | None,
    max_swaps: int = MAX_SWAPS,
) -> PartPlacement:
    """Place one layer's experts on the parts (domains) of one EP group.

    Parameters
    ----------
    tok : the group's sampled tokens in this layer.
    part_of_ep : (ep,) part of each EP rank.
    num_parts : P, the number of parts (each holds at least one EP rank).
    experts_per_rank : slots per EP rank; slot ``p`` is on EP rank ``p // experts_per_rank``.
    mode : ``per_domain`` or ``per_pair``.
    group_size : experts per expert group when the map must be group-preserving (whole groups on
        blocks of ``group_size`` contiguous slots, experts moving only inside their group), else
        ``None``.
    max_swaps : swap-search limit.

    Returns
    -------
    PartPlacement.  Method: the ``per_pair`` optimum (an assignment problem; exact for ``per_pair``)
    as a start, then (``per_domain``) best-improvement swaps with exact deltas; group-preserving maps
    first assign groups to blocks by an assignment problem on each group's own optimum per block
    make-up, then try exchanging groups between blocks of different make-up.
    """
    E = tok.num_experts
    P = num_parts
    ep = len(part_of_ep)
    slot2part = np.repeat(part_of_ep, experts_per_rank)[:E]
    src_part = part_of_ep[tok.src]
    onehot = np.zeros((tok.n, P))
    onehot[np.arange(tok.n), src_part] = 1.0
    use = np.asarray(tok.At @ onehot)  # (E, P): (token, expert) pairs from sources in each part
    if group_size is None or group_size >= E:
        capacity = np.bincount(slot2part, minlength=P)
        e2p = _transport(use, capacity)
        g2b = None
        labels = np.zeros(E, dtype=np.int64)
        if mode == "per_domain":
            e2p = _swap_search(tok, e2p, src_part, P, mode, labels, max_swaps)
    else:
        G = E // group_size
        comp = np.stack([np.bincount(slot2part[b * group_size : (b + 1) * group_size], minlength=P) for b in range(G)])
        types, block_type = np.unique(comp, axis=0, return_inverse=True)
        block_type = block_type.reshape(-1)
        # each group's own best placement under each block make-up (per_pair proxy, exact there)
        own = np.empty((G, len(types), group_size), dtype=np.int64)
        own_val = np.empty((G, len(types)))
        for g in range(G):
            u = use[g * group_size : (g + 1) * group_size]
            for t, cap in enumerate(types):
                own[g, t] = _transport(u, cap)
                own_val[g, t] = u[np.arange(group_size), own[g, t]].sum()
        rows, cols = linear_sum_assignment(-own_val[:, block_type])
        g2b = np.empty(G, dtype=np.int64)
        g2b[rows] = cols
        labels = np.repeat(np.arange(G), group_size)

        def build(g2b_: np.ndarray) -> np.ndarray:
            return np.concatenate([own[g, block_type[g2b_[g]]] for g in range(G)])

        e2p = build(g2b)
        if mode == "per_domain" and len(types) > 1:
            e2p = _swap_search(tok, e2p, src_part, P, mode, labels, max_swaps)
            # Exchange whole groups between blocks of different make-up while it helps.  A group's
            # contribution to the (N, P) part counts is A_g @ onehot(parts of its experts), so an
            # exchange is scored exactly from four such matrices.
            notsrc = np.ones((tok.n, P), dtype=bool)
            notsrc[np.arange(tok.n), src_part] = False
            At_g = [tok.At[g * group_size : (g + 1) * group_size].T.tocsr() for g in range(G)]

            def contrib(g: int, parts: np.ndarray) -> np.ndarray:
                onehot_g = np.zeros((group_size, P))
                onehot_g[np.arange(group_size), parts] = 1.0
                return np.asarray(At_g[g] @ onehot_g)

            own_c = {(g, t): contrib(g, own[g, t]) for g in range(G) for t in range(len(types))}
            for _ in range(G):
                cur_c = [contrib(g, e2p[g * group_size : (g + 1) * group_size]) for g in range(G)]
                cnt = np.sum(cur_c, axis=0)
                cur = int(((cnt > 0) & notsrc).sum())
                best: tuple[int, tuple[int, int] | None] = (cur, None)
                for g1 in range(G):
                    for g2 in range(g1 + 1, G):
                        t1, t2 = block_type[g2b[g1]], block_type[g2b[g2]]
                        if t1 == t2:
                            continue
                        new = cnt - cur_c[g1] - cur_c[g2] + own_c[g1, t2] + own_c[g2, t1]
                        c = int(((new > 0.5) & notsrc).sum())
                        if c < best[0]:
                            best = (c, (g1, g2))
                if best[1] is None:
                    break
                g1, g2 = best[1]
                g2b[g1], g2b[g2] = g2b[g2], g2b[g1]
                for g in (g1, g2):
                    e2p[g * group_size : (g + 1) * group_size] = own[g, block_type[g2b[g]]]
                e2p = _swap_search(tok, e2p, src_part, P, mode, labels, max_swaps)
    cross = _crossings(tok, e2p, src_part, P, mode)
    nic, into = _nic_copies(tok, e2p, part_of_ep, src_part, P, mode, cross)
    return PartPlacement(expert2part=e2p, group2block=g2b, crossings=int(cross.sum()), nic_copies=nic, arrivals=into)


def _nic_copies(
    tok: _Tokens, e2p: np.ndarray, part_of_ep: np.ndarray, src_part: np.ndarray, P: int, mode: str, cross: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(ep,) copies on each EP rank's NIC: sent as a source + an even share of its part's arrivals;
    and (P,) the arrivals of each part.

    ``per_domain`` arrivals land on the group's GPUs of the remote domain evenly (the evaluator's
    model); ``per_pair`` arrivals land on the expert's GPU, approximated here by an even share.
    """
    ep = len(part_of_ep)
    sent = np.bincount(tok.src, weights=cross, minlength=ep)
    if mode == "per_pair":
        parts = e2p[tok.topk]
        remote = parts != src_part[:, None]
        into = np.bincount(parts[remote], minlength=P).astype(np.float64)
    else:
        present = _part_counts(tok, e2p, P) > 0
        present[np.arange(tok.n), src_part] = False
        into = present.sum(axis=0).astype(np.float64)
    size = np.bincount(part_of_ep, minlength=P).astype(np.float64)
    return sent + into[part_of_ep] / size[part_of_ep], into


# =============================================================================================
# Step 2b: shapes and their scores
# =============================================================================================
def shape_candidates(
    n: int, unit: int, max_part: int, max_parts: int, *, equal_only: bool = False, limit: int | None = None
) -> list[tuple[int, ...]]:
    """Multisets of part sizes for a block of ``n`` GPUs, sizes non-increasing.

    Parameters
    ----------
    n : block size in GPUs.
    unit : every part is a multiple of ``unit`` (a tray, or a TP x CP group).
    max_part : the largest part any domain can take.
    max_parts : at most this many parts (domains).
    equal_only : only equal parts (the DeepEP/HybridEP rule).
    limit : stop after ``limit + 1`` shapes (so a caller can tell that there are more than
        ``limit``); the ones with the largest parts come first.

    Examples
    --------
    >>> shape_candidates(8, 2, 8, 3)
    [(8,), (6, 2), (4, 4), (4, 2, 2)]
    >>> shape_candidates(8, 1, 8, 8, equal_only=True)
    [(8,), (4, 4), (2, 2, 2, 2), (1, 1, 1, 1, 1, 1, 1, 1)]
    """
    if n % unit:
        return []
    out: list[tuple[int, ...]] = []
    if equal_only:
        for m in range(1, n // unit + 1):
            if (n // unit) % m == 0 and m <= max_parts and n // m <= max_part:
                out.append((n // m,) * m)
        return out
    total = n // unit
    cap = max_part // unit

    class _Enough(Exception):
        pass

    def rec(rem: int, largest: int, acc: list[int]) -> None:
        if rem == 0:
            out.append(tuple(unit * x for x in acc))
            if limit is not None and len(out) > limit:
                raise _Enough
            return
        if len(acc) == max_parts:
            return
        for x in range(min(rem, largest), 0, -1):
            if x * (max_parts - len(acc)) < rem:
                break
            acc.append(x)
            rec(rem - x, x, acc)
            acc.pop()

    try:
        rec(total, cap, [])
    except _Enough:
        pass
    return out


def _slice_order(sizes: Sequence[int], align: int | None) -> list[int]:
    """Order of the parts along the EP ranks: larger parts first, unless another order puts more
    slice boundaries on multiples of ``align`` (the expert-group blocks of a group-preserving map:
    a boundary inside a block splits an expert group over two domains).

    Exact by dynamic programming over subsets for up to 12 parts (the subset fixes the boundary's
    position), else larger parts first.

    Examples
    --------
    >>> _slice_order([68, 64, 64, 56, 4], 32)   # boundaries 68, 124, 128, 192: two aligned
    [0, 3, 4, 1, 2]
    >>> _slice_order([48, 8, 4, 4], 8)
    [0, 1, 2, 3]
    """
    m = len(sizes)
    base = sorted(range(m), key=lambda i: (-sizes[i], i))
    if align is None or align <= 1 or m <= 1 or m > 12:
        return base
    rank = {i: r for r, i in enumerate(base)}
    # best[mask] = (aligned boundaries, order) over orders of the parts in ``mask`` placed first
    best: dict[int, tuple[int, tuple[int, ...]]] = {0: (0, ())}
    for mask in range(1 << m):
        if mask not in best:
            continue
        count, order = best[mask]
        pos = sum(sizes[i] for i in range(m) if mask >> i & 1)
        gain = 1 if 0 < pos < sum(sizes) and pos % align == 0 else 0
        for i in sorted(range(m), key=lambda j: rank[j]):
            if mask >> i & 1:
                continue
            nxt = mask | 1 << i
            cand = (count + gain, order + (i,))
            old = best.get(nxt)
            if old is None or cand[0] > old[0] or (cand[0] == old[0] and [rank[j] for j in cand[1]] < [rank[j] for j in old[1]]):
                best[nxt] = cand
    return list(best[(1 << m) - 1][1])


def _contiguous_atom_parts(block: Block, shape: Sequence[int], align_ranks: int | None = None) -> np.ndarray:
    """(n_atoms,) part of each atom: consecutive slices of the block's atoms (part ``i`` has
    ``shape[i]`` GPUs), in the order of :func:`_slice_order` (``align_ranks``: EP ranks per
    expert-group block, for a block that is one EP group under a group-preserving map)."""
    a = block.atom_size
    sizes = [v // a for v in shape]
    align = align_ranks // a if align_ranks and align_ranks % a == 0 else None
    out = np.empty(sum(sizes), dtype=np.int64)
    pos = 0
    for i in _slice_order(sizes, align):
        out[pos : pos + sizes[i]] = i
        pos += sizes[i]
    return out


class BlockScorer:
    """Scores blocks under footprints; caches tokens and results.

    Parameters
    ----------
    instance : the problem (solver view).
    group_preserving : expert maps keep whole expert groups on group blocks.
    tokens : ``"all"`` the sampled tokens, ``"fit"`` the first ``1 - VALIDATION_FRACTION`` of each
        replica's tokens, ``"val"`` the rest.
    """

    def __init__(self, instance: Instance, *, group_preserving: bool, tokens: str = "all"):
        self.instance = instance
        m, par = instance.model, instance.parallel
        self.mode = instance.cost_mode
        self.group_size = m.experts_per_group if (group_preserving and m.num_groups > 1) else None
        self.experts_per_rank = instance.experts_per_rank
        T = instance.routing.tokens_per_source
        cut = T - int(round(T * VALIDATION_FRACTION)) if T > 1 else T
        self.token_range = {"all": (0, T), "fit": (0, cut), "val": (cut, T)}[tokens]
        t0, t1 = self.token_range
        n_tok = max(1, t1 - t0)
        weight = par.tokens_per_dp_rank_per_step / n_tok
        self.bytes_per_crossing = weight * m.roundtrip_bytes_per_copy
        self.nic_s_per_copy = weight * m.nic_bytes_per_copy / (instance.cluster.scaleout_gbps * 1e9)
        self.nvl_s_per_copy = weight * m.nic_bytes_per_copy / (instance.cluster.nvlink_gbps * 1e9)
        self._tokens: dict[tuple[int, int, int], _Tokens] = {}
        self._scores: dict[tuple, tuple[ShapeScore, list]] = {}
        self._nvl: dict[int, float] = {}
        #: predicted seconds of the expert placements done so far (deterministic: counts only)
        self.work_s = 0.0

    # ---- the work model (deterministic) ---------------------------------------------------
    def pairs_per_group(self) -> int:
        """(token, expert) pairs of one EP group in one layer, in this scorer's token range."""
        t0, t1 = self.token_range
        par = self.instance.parallel
        per_rank = -(-(t1 - t0) // max(1, par.tp * par.cp))
        return int(par.ep * per_rank * self.instance.model.top_k)

    def predict_s(self, block: Block, num_parts: int, num_layers: int | None = None) -> float:
        """Predicted seconds of scoring ``block`` on ``num_parts`` parts over ``num_layers`` layers
        (default: all of its stage), every EP group straddling (an upper estimate)."""
        if num_parts <= 1:
            return 0.0
        layers = len(block.moe_layers) if num_layers is None else num_layers
        one = _SCORE_BASE_S + _SCORE_S_PER_PAIR * self.pairs_per_group() * (num_parts - 1) ** 1.3
        return float(block.ep_groups.shape[0] * layers * one)

    # ---- data ---------------------------------------------------------------------------
    def tokens(self, block: Block, group: int, layer: int) -> _Tokens:
        key = (block.index, group, layer)
        tok = self._tokens.get(key)
        if tok is None:
            t0, t1 = self.token_range
            topk = self.instance.routing.topk[layer]  # (dp, T, k)
            par = self.instance.parallel
            rank2dp = par.rank2dp
            eg = block.ep_groups[group]
            a = block.atom_size
            parts_topk, parts_src = [], []
            for k_ep, r in enumerate(eg):
                atom = block.atoms[np.flatnonzero((block.atoms == r).any(axis=1))[0]]
                sub = int(np.flatnonzero(atom == r)[0])
                ts = np.arange(t0, t1)
                ts = ts[ts % a == sub]
                parts_topk.append(topk[int(rank2dp[r]), ts])
                parts_src.append(np.full(len(ts), k_ep))
            tok = _Tokens(np.concatenate(parts_topk), np.concatenate(parts_src), self.instance.model.num_experts)
            self._tokens[key] = tok
        return tok

    def nvlink_floor_s(self, block: Block, layer: int) -> float:
        """NVLink time of one layer with the contiguous expert map (independent of domains).

        ``per_domain``: every distinct target GPU other than the source receives one copy over
        NVLink wherever the domains are, so this floor does not depend on the layout.
        """
        key = block.index * 100000 + layer
        if key not in self._nvl:
            worst = 0.0
            for g in range(block.ep_groups.shape[0]):
                tok = self.tokens(block, g, layer)
                tgt = np.sort(tok.topk // self.experts_per_rank, axis=1)
                first = np.ones_like(tgt, dtype=bool)
                first[:, 1:] = tgt[:, 1:] != tgt[:, :-1]
                mask = first & (tgt != tok.src[:, None])
                recv = np.bincount(tgt[mask], minlength=block.ep_groups.shape[1])
                worst = max(worst, float(recv.max()) if recv.size else 0.0)
            self._nvl[key] = worst * self.nvl_s_per_copy
        return self._nvl[key]

    # ---- scoring ------------------------------------------------------------------------
    def score(
        self,
        block: Block,
        atom2part: np.ndarray,
        *,
        layers: Sequence[int] | None = None,
        max_swaps: int = MAX_SWAPS,
        stop: Callable[[], bool] | None = None,
    ) -> tuple[ShapeScore, list]:
        """Score ``block`` with its atoms on parts ``atom2part`` (n_atoms,).

        ``layers``: only these MoE layers of the block's stage (default: all of them).  Returns the
        score and, per layer, per EP group, the :class:`PartPlacement` (``None`` for a group inside
        one part).  Every expert placement done adds its predicted seconds to :attr:`work_s`.

        Raises
        ------
        _Stopped
            ``stop()`` turned true between two layers (nothing is cached then).
        """
        layer_ids = block.moe_layers if layers is None else np.asarray(layers, dtype=np.int64)
        key = (block.index, tuple(int(x) for x in atom2part), tuple(int(x) for x in layer_ids), max_swaps)
        hit = self._scores.get(key)
        if hit is not None:
            return hit
        rank_part = {int(r): int(atom2part[i]) for i, atom in enumerate(block.atoms) for r in atom}
        total, time_s, per_layer, per_nic, placements = 0.0, 0.0, [], [], []
        arrivals = np.zeros(int(atom2part.max()) + 1)
        part_nic = np.zeros(int(atom2part.max()) + 1)  # summed over layers of each part's busiest NIC
        for layer in layer_ids:
            if stop is not None and stop():
                raise _Stopped
            layer_part_nic = np.zeros_like(part_nic)
            layer_bytes, nic_max = 0.0, 0.0
            lay: list[PartPlacement | None] = []
            for g, eg in enumerate(block.ep_groups):
                part_of_ep = np.array([rank_part[int(r)] for r in eg], dtype=np.int64)
                used = np.unique(part_of_ep)
                if len(used) == 1:
                    lay.append(None)
                    continue
                local = np.searchsorted(used, part_of_ep)
                tok = self.tokens(block, g, int(layer))
                self.work_s += _SCORE_BASE_S + _SCORE_S_PER_PAIR * tok.n * tok.topk.shape[1] * (len(used) - 1) ** 1.3
                pl = place_on_parts(
                    tok,
                    local,
                    len(used),
                    experts_per_rank=self.experts_per_rank,
                    mode=self.mode,
                    group_size=self.group_size,
                    max_swaps=max_swaps,
                )
                # map local part ids back to the block's parts
                pl = PartPlacement(used[pl.expert2part], pl.group2block, pl.crossings, pl.nic_copies, pl.arrivals)
                arrivals[used] += pl.arrivals * self.bytes_per_crossing
                lay.append(pl)
                layer_bytes += pl.crossings * self.bytes_per_crossing
                nic_max = max(nic_max, float(pl.nic_copies.max()) * self.nic_s_per_copy)
                for i, part in enumerate(used):
                    busiest = float(pl.nic_copies[local == i].max()) * self.nic_s_per_copy
                    layer_part_nic[part] = max(layer_part_nic[part], busiest)
            part_nic += layer_part_nic
            total += layer_bytes
            per_layer.append(layer_bytes)
            per_nic.append(nic_max)
            time_s += max(nic_max, self.nvlink_floor_s(block, int(layer)))
            placements.append(lay)
        score = ShapeScore(total, time_s, tuple(per_layer), tuple(per_nic), tuple(float(x) for x in arrivals),
                           tuple(float(x) for x in part_nic))
        out = (score, placements)
        self._scores[key] = out
        return out

    def score_shape(self, block: Block, shape: Sequence[int], layers: Sequence[int] | None = None) -> ShapeScore:
        """Score ``block`` under ``shape`` with contiguous slices of atoms (larger parts first)."""
        return self.score(block, self.slices(block, shape), layers=layers)[0]

    def slices(self, block: Block, shape: Sequence[int]) -> np.ndarray:
        """(n_atoms,) atom -> part for ``shape``: consecutive slices, aligned to expert-group
        blocks where the map is group-preserving (see :func:`_slice_order`)."""
        align = None
        if self.group_size is not None and block.ep_groups.shape[0] == 1:
            if self.group_size % self.experts_per_rank == 0:
                align = self.group_size // self.experts_per_rank
        return _contiguous_atom_parts(block, shape, align)

    def floor_time_s(self, block: Block) -> float:
        """The block's all-to-all time when it sits in one domain (NVLink only)."""
        return float(sum(self.nvlink_floor_s(block, int(l)) for l in block.moe_layers))


# =============================================================================================
# Step 2c: the footprint model
# =============================================================================================
class FootprintModel:
    """MILP: one shape per block and its domains, under the domains' free-GPU capacities.

    Variables (all binary but ``z``)::

        x[b, d, v]  block b puts exactly v GPUs in domain d          (at most one v per (b, d))
        s[b, k]     block b takes its k-th candidate shape            (exactly one k per b)
        z           the slowest block's time (bottleneck objective)

    Constraints: ``sum_{d,v} v x[b,d,v] = n_b``; ``sum_{b,v} v x[b,d,v] <= free_d``;
    ``sum_d x[b,d,v] = sum_k mult_k(v) s[b,k]`` for every part size ``v`` (ties the parts to the
    shape); ``z >= sum_k time[b,k] s[b,k]``; blocks with identical rows take non-decreasing shape
    indices (symmetry).  Solved with HiGHS (``scipy.optimize.milp``): on this model its LP bound
    proves optimality in about a second where CP-SAT needed 10-20 s (measured under load on the
    project machine, 16 blocks x 230 shapes x 15 domains).

    Parameters
    ----------
    sizes : (B,) GPUs of each block.
    shapes : per block, the candidate shapes (non-increasing tuples of part sizes).
    free : (D,) free GPUs per domain.
    cost : per block, per shape, bytes per step (total objective).
    time : per block, per shape, seconds per step (bottleneck objective).
    """

    def __init__(
        self,
        sizes: Sequence[int],
        shapes: Sequence[Sequence[tuple[int, ...]]],
        free: np.ndarray,
        cost: Sequence[Sequence[float]],
        time: Sequence[Sequence[float]],
    ):
        self.sizes = [int(x) for x in sizes]
        self.shapes = [list(s) for s in shapes]
        self.free = [int(x) for x in free]
        B, D = len(self.sizes), len(self.free)
        # x[b, d, v] -> column; s[b, k] -> column; z last
        self.x: dict[tuple[int, int, int], int] = {}
        self.s: dict[tuple[int, int], int] = {}
        for b in range(B):
            vals = sorted({v for sh in self.shapes[b] for v in sh})
            for d in range(D):
                for v in vals:
                    if v <= self.free[d]:
                        self.x[b, d, v] = len(self.x)
        nx = len(self.x)
        for b in range(B):
            for k in range(len(self.shapes[b])):
                self.s[b, k] = nx + len(self.s)
        self.z = nx + len(self.s)
        self.n = self.z + 1
        rows: list[dict[int, float]] = []
        lo: list[float] = []
        hi: list[float] = []

        def row(coef: dict[int, float], lower: float, upper: float) -> None:
            rows.append(coef)
            lo.append(lower)
            hi.append(upper)

        by_bd: dict[tuple[int, int], list[int]] = {}
        for (b, d, v), j in self.x.items():
            by_bd.setdefault((b, d), []).append(j)
        for cols in by_bd.values():
            row({j: 1.0 for j in cols}, 0, 1)
        for b in range(B):
            row({self.s[b, k]: 1.0 for k in range(len(self.shapes[b]))}, 1, 1)
            row({j: float(v) for (bb, d, v), j in self.x.items() if bb == b}, self.sizes[b], self.sizes[b])
            for v in sorted({v for sh in self.shapes[b] for v in sh}):
                coef = {j: 1.0 for (bb, d, vv), j in self.x.items() if bb == b and vv == v}
                for k, sh in enumerate(self.shapes[b]):
                    if sh.count(v):
                        coef[self.s[b, k]] = -float(sh.count(v))
                row(coef, 0, 0)
        for d in range(D):
            row({j: float(v) for (b, dd, v), j in self.x.items() if dd == d}, 0, self.free[d])
        self.cost = np.array([c for b in range(B) for c in cost[b]], dtype=np.float64)
        self.time = [np.asarray(t, dtype=np.float64) for t in time]
        for b in range(B):
            coef = {self.s[b, k]: float(self.time[b][k]) for k in range(len(self.shapes[b]))}
            coef[self.z] = -1.0
            row(coef, -np.inf, 0)
        # symmetry: interchangeable blocks take non-decreasing shape indices
        classes: dict[tuple, list[int]] = {}
        for b in range(B):
            key = (self.sizes[b], tuple(self.shapes[b]), tuple(cost[b]), tuple(time[b]))
            classes.setdefault(key, []).append(b)
        self.classes = [m for m in classes.values() if len(m) > 1]
        for members in self.classes:
            for b1, b2 in zip(members, members[1:]):
                coef = {self.s[b1, k]: float(k) for k in range(len(self.shapes[b1]))}
                for k in range(len(self.shapes[b2])):
                    coef[self.s[b2, k]] = coef.get(self.s[b2, k], 0.0) - float(k)
                row(coef, -np.inf, 0)
        self._rows, self._lo, self._hi = rows, lo, hi

    # ---- objective pieces ----------------------------------------------------------------------
    def _total_vec(self) -> np.ndarray:
        c = np.zeros(self.n)
        c[[self.s[key] for key in sorted(self.s)]] = self.cost
        return c

    def _z_vec(self) -> np.ndarray:
        c = np.zeros(self.n)
        c[self.z] = 1.0
        return c

    def canonical(self, assignment: Sequence[dict[int, int]]) -> list[dict[int, int]]:
        """Reorder the footprints of interchangeable blocks to respect the symmetry breaking."""
        assignment = list(assignment)
        for members in self.classes:
            shapes = self.shapes[members[0]]
            feet = sorted((assignment[b] for b in members),
                          key=lambda f: shapes.index(tuple(sorted(f.values(), reverse=True))))
            for b, f in zip(members, feet):
                assignment[b] = f
        return assignment

    def value(self, assignment: Sequence[dict[int, int]]) -> tuple[float, float]:
        """(total, bottleneck) of a complete footprint under the model's prices."""
        tot, z = 0.0, 0.0
        for b, foot in enumerate(assignment):
            k = self.shapes[b].index(tuple(sorted(foot.values(), reverse=True)))
            tot += float(self.cost[self.s[b, k] - self.s[0, 0]])
            z = max(z, float(self.time[b][k]))
        return tot, z

    @property
    def nnz(self) -> int:
        """Nonzeros of the constraint matrix (what :func:`_milp_predict_s` sizes a solve by)."""
        return int(sum(len(r) for r in self._rows))

    def solve(
        self, objective: str, *, time_limit_s: float, node_limit: int | None = None
    ) -> tuple[str, list[dict[int, int]] | None, float | None, float | None]:
        """Minimise ``objective`` (``total`` or ``bottleneck``), the other one as a tie-breaker.

        The tie-breaker enters with a weight small enough not to trade against the first objective
        (a second solve with the first objective as a constraint, or an objective cutoff from the
        warm start, slows HiGHS down by an order of magnitude on this model; the warm start is the
        fallback instead).  ``node_limit`` bounds the branch and bound deterministically;
        ``time_limit_s`` is the wall-clock safety net (HiGHS measures it on the clock).  Returns
        (status, per-block ``{domain: GPUs}``, total, bottleneck); :attr:`stopped_by` says what
        ended a solve short of a proof: ``"nodes"`` (deterministic), ``"time"`` (the clock) or
        ``None``.
        """
        from scipy.optimize import Bounds, LinearConstraint, milp

        data, ri, ci = [], [], []
        for i, coef in enumerate(self._rows):
            for j, v in coef.items():
                ri.append(i)
                ci.append(j)
                data.append(v)
        A = sparse.csr_matrix((data, (ri, ci)), shape=(len(self._rows), self.n))
        if objective == "total":
            obj = self._total_vec() + _TIE_BREAK * self._z_vec()
        else:
            obj = self._z_vec() + _TIE_BREAK * self._total_vec()
        integrality = np.ones(self.n)
        integrality[self.z] = 0
        ub = np.ones(self.n)
        ub[self.z] = np.inf
        lb = np.zeros(self.n)
        # the slowest block is at least the slowest block's fastest shape (tightens the LP bound)
        lb[self.z] = max((float(t.min()) for t in self.time if t.size), default=0.0)
        res = milp(
            obj,
            constraints=LinearConstraint(A, self._lo, self._hi),
            integrality=integrality,
            bounds=Bounds(lb, ub),
            options={"time_limit": max(0.05, time_limit_s), "presolve": True,
                     **({"node_limit": int(node_limit)} if node_limit is not None else {})},
        )
        status = {0: "OPTIMAL", 1: "LIMIT", 2: "INFEASIBLE", 3: "UNBOUNDED", 4: "ERROR"}.get(res.status, "ERROR")
        self.stopped_by: str | None = None
        if res.status == 1:
            nodes = getattr(res, "mip_node_count", None)
            self.stopped_by = "nodes" if node_limit is not None and nodes is not None and nodes >= node_limit else "time"
        if res.x is None:
            return status, None, None, None
        feet: list[dict[int, int]] = [dict() for _ in self.sizes]
        for (b, d, v), j in self.x.items():
            if res.x[j] > 0.5:
                feet[b][d] = v
        tot, z = self.value(feet)
        return ("OPTIMAL" if res.status == 0 else "FEASIBLE"), feet, tot, z


# =============================================================================================
# Warm start: first fit
# =============================================================================================
def _first_fit(blocks: Sequence[Block], free: np.ndarray, unit: int) -> list[dict[int, int]] | None:
    """Blocks with most MoE layers first: the tightest domain that holds them whole, else split
    over the domains with the most free GPUs (in multiples of ``unit``)."""
    free = free.astype(np.int64).copy()
    order = sorted(range(len(blocks)), key=lambda b: (-len(blocks[b].moe_layers), -blocks[b].size, b))
    feet: list[dict[int, int]] = [dict() for _ in blocks]
    # whole blocks first
    pending = []
    for b in order:
        n = blocks[b].size
        fits = [d for d in range(len(free)) if free[d] >= n]
        if fits:
            d = min(fits, key=lambda d: (free[d], d))
            feet[b] = {d: n}
            free[d] -= n
        else:
            pending.append(b)
    for b in pending:
        rem = blocks[b].size
        while rem > 0:
            avail = [(int(free[d] // unit * unit), d) for d in range(len(free))]
            avail = [(c, d) for c, d in avail if c > 0 and d not in feet[b]]
            if not avail:
                return None
            # the smallest domain that closes the block, else the largest
            close = [(c, d) for c, d in avail if c >= rem]
            c, d = min(close) if close else max(avail, key=lambda cd: (cd[0], -cd[1]))
            take = min(c, rem)
            feet[b][d] = take
            free[d] -= take
            rem -= take
    return feet


# =============================================================================================
# Concrete GPUs
# =============================================================================================
def _assign_gpus(instance: Instance, blocks: Sequence[Block], feet: Sequence[dict[int, int]],
                 atom2part: Sequence[np.ndarray]) -> tuple[np.ndarray, int]:
    """rank2gpu from per-block footprints and atom -> part maps (parts = footprint's domains,
    larger first, ties by domain).  Whole free trays go to parts first, in tray order; the rest is
    filled from the remaining GPUs, best fit.  Returns (rank2gpu, atoms split across trays)."""
    cl = instance.cluster
    g_per_tray = cl.gpus_per_tray
    rank2gpu = np.full(instance.parallel.world_size, -1, dtype=np.int64)
    # per domain: the parts that live there, in block order
    by_domain: dict[int, list[tuple[int, int]]] = {}
    for b, foot in enumerate(feet):
        for d in foot:
            by_domain.setdefault(d, []).append((b, d))
    part_gpus: dict[tuple[int, int], list[int]] = {}
    for d in sorted(by_domain):
        gpus = [int(g) for g in cl.available_gpus if cl.gpu2domain[g] == d]
        trays: dict[int, list[int]] = {}
        for g in gpus:
            trays.setdefault(int(cl.gpu2host[g]), []).append(g)
        full = [h for h in sorted(trays) if len(trays[h]) == g_per_tray]
        parts = by_domain[d]
        need = {p: feet[p[0]][d] for p in parts}
        got: dict[tuple[int, int], list[int]] = {p: [] for p in parts}
        # Step 1: whole trays, largest parts first (ties by block)
        for p in sorted(parts, key=lambda p: (-need[p], p[0])):
            while need[p] - len(got[p]) >= g_per_tray and full:
                got[p].extend(trays.pop(full.pop(0)))
        # Step 2: the rest, from the remaining GPUs, tray by tray, best fit
        for p in sorted(parts, key=lambda p: (-(need[p] - len(got[p])), p[0])):
            while len(got[p]) < need[p]:
                short = need[p] - len(got[p])
                hosts = sorted(trays, key=lambda h: (len(trays[h]) < short, abs(len(trays[h]) - short), h))
                if not hosts:
                    raise SolverError(f"domain {d}: footprints exceed its free GPUs")
                h = hosts[0]
                take = trays[h][:short]
                trays[h] = trays[h][short:]
                if not trays[h]:
                    del trays[h]
                got[p].extend(take)
        for p in parts:
            part_gpus[p] = sorted(got[p])
    # Inside a host, give GPUs to ranks in rank order: every GPU of a host is in one domain, so the
    # costs do not change, and a host's ranks then take its GPUs in local-rank order (Slurm).
    for b, block in enumerate(blocks):
        doms = sorted(feet[b], key=lambda d: (-feet[b][d], d))
        for i, d in enumerate(doms):
            ranks = block.atoms[atom2part[b] == i].reshape(-1)
            if len(ranks) != len(part_gpus[(b, d)]):
                raise SolverError(f"block {b}: part {i} has {len(ranks)} ranks for {len(part_gpus[(b, d)])} GPUs")
            rank2gpu[ranks] = part_gpus[(b, d)]
    host_of = cl.gpu2host[np.maximum(rank2gpu, 0)]
    for h in np.unique(host_of):
        ranks = np.flatnonzero(host_of == h)
        rank2gpu[ranks] = np.sort(rank2gpu[ranks])
    split_atoms = 0
    for block in blocks:
        for atom in block.atoms:
            if len({int(cl.gpu2host[rank2gpu[r]]) for r in atom}) > 1:
                split_atoms += 1
    return rank2gpu, split_atoms


# =============================================================================================
# Reports
# =============================================================================================
def stage_footprints(instance: Instance, rank2gpu: np.ndarray) -> list[list[list[int]]]:
    """Per pipeline stage, ``[[domain, GPUs], ...]`` sorted by GPUs (descending) then domain."""
    par = instance.parallel
    dom = instance.cluster.gpu2domain[np.asarray(rank2gpu, dtype=np.int64)]
    out = []
    for s in range(par.pp):
        counts = np.bincount(dom[par.rank2stage == s], minlength=instance.cluster.num_domains)
        nz = [[int(d), int(counts[d])] for d in np.flatnonzero(counts)]
        out.append(sorted(nz, key=lambda dc: (-dc[1], dc[0])))
    return out


def _block_feet(instance: Instance, blocks: Sequence[Block], rank2gpu: np.ndarray) -> tuple[list[dict[int, int]], list[np.ndarray]]:
    """Per block: ``{domain: GPUs}`` and (n_atoms,) part of each atom (parts: larger first)."""
    dom = instance.cluster.gpu2domain[rank2gpu]
    feet, a2ps = [], []
    for block in blocks:
        atom_dom = dom[block.atoms[:, 0]]
        if any(len(set(dom[a].tolist())) > 1 for a in block.atoms):
            raise SolverError(f"block {block.index}: a TP x CP group spans NVLink domains")
        counts = {int(d): int(c) for d, c in zip(*np.unique(dom[block.ranks], return_counts=True))}
        order = sorted(counts, key=lambda d: (-counts[d], d))
        feet.append(counts)
        a2ps.append(np.array([order.index(int(d)) for d in atom_dom], dtype=np.int64))
    return feet, a2ps


def estimate_layout(instance: Instance, rank2gpu: np.ndarray, *, group_preserving: bool,
                    scorer: BlockScorer | None = None) -> dict:
    """The estimator's view of a complete layout (with its own expert placement).

    Returns ``{"total_bytes", "slowest_stage_s", "stage_bytes", "stage_time_s", "phy2log",
    "block_scores"}``: bytes and seconds per optimizer step; ``phy2log`` (num_moe_layers, E) is the
    expert map scored; ``block_scores`` one :class:`ShapeScore` per block of :func:`layout_blocks`.
    """
    rank2gpu = np.asarray(rank2gpu, dtype=np.int64)
    blocks = layout_blocks(instance)
    scorer = scorer or BlockScorer(instance, group_preserving=group_preserving)
    feet, a2ps = _block_feet(instance, blocks, rank2gpu)
    return _summarise(instance, blocks, a2ps, scorer)


def _summarise(instance: Instance, blocks: Sequence[Block], a2ps: Sequence[np.ndarray], scorer: BlockScorer,
               stop: Callable[[], bool] | None = None) -> dict:
    """The estimate of a complete layout given as (n_atoms,) atom -> part per block (see
    :func:`estimate_layout`); ``block_scores`` adds each block's :class:`ShapeScore`.  Raises
    :class:`_Stopped` when ``stop()`` turns true between layers."""
    pp = instance.parallel.pp
    stage_bytes = [0.0] * pp
    stage_time = [0.0] * pp
    chosen: dict[int, tuple[float, int, list]] = {}  # stage -> (weight, block, placements)
    block_scores: list[ShapeScore] = []
    for block, a2p in zip(blocks, a2ps):
        sc, placements = scorer.score(block, a2p, stop=stop)
        block_scores.append(sc)
        stage_bytes[block.stage] += sc.total_bytes
        stage_time[block.stage] = max(stage_time[block.stage], sc.time_s)
        if block.stage not in chosen or sc.total_bytes > chosen[block.stage][0]:
            chosen[block.stage] = (sc.total_bytes, block.index, placements)
    phy2log = _phy2log(instance, blocks, a2ps, chosen, scorer)
    return {
        "total_bytes": float(sum(stage_bytes)),
        "slowest_stage_s": float(max(stage_time)) if stage_time else 0.0,
        "stage_bytes": [float(x) for x in stage_bytes],
        "stage_time_s": [float(x) for x in stage_time],
        "phy2log": phy2log,
        "block_scores": block_scores,
    }


def _phy2log(instance: Instance, blocks: Sequence[Block], a2ps: Sequence[np.ndarray],
             chosen: dict[int, tuple[float, int, list]], scorer: BlockScorer) -> np.ndarray:
    """One expert map per layer from the costliest block of its stage (first straddling EP group)."""
    m = instance.model
    E, epr = m.num_experts, instance.experts_per_rank
    phy2log = np.tile(np.arange(E, dtype=np.int64), (m.num_moe_layers, 1))
    for s, (_, b, placements) in chosen.items():
        block = blocks[b]
        rank_part = {int(r): int(a2ps[b][i]) for i, atom in enumerate(block.atoms) for r in atom}
        for li, layer in enumerate(block.moe_layers):
            for g, pl in enumerate(placements[li]):
                if pl is None:
                    continue
                part_of_ep = np.array([rank_part[int(r)] for r in block.ep_groups[g]], dtype=np.int64)
                slot2part = np.repeat(part_of_ep, epr)[:E]
                row = np.empty(E, dtype=np.int64)
                if pl.group2block is None:
                    for p in np.unique(slot2part):
                        row[np.flatnonzero(slot2part == p)] = np.flatnonzero(pl.expert2part == p)
                else:
                    gs = int(scorer.group_size or E)
                    for grp, blk in enumerate(pl.group2block):
                        slots = np.arange(blk * gs, (blk + 1) * gs)
                        experts = np.arange(grp * gs, (grp + 1) * gs)
                        for p in np.unique(slot2part[slots]):
                            row[slots[slot2part[slots] == p]] = experts[pl.expert2part[experts] == p]
                phy2log[int(layer)] = row
                break
    return phy2log


# =============================================================================================
# Step 3: data-parallel sources on a straddling block
# =============================================================================================
def _source_cells(block: Block, group_size: int | None, experts_per_rank: int) -> np.ndarray:
    """(n_atoms,) cell of each atom: atoms may trade places only inside a cell."""
    n_atoms = block.atoms.shape[0]
    if group_size is None or block.ep_groups.shape[0] != 1:
        return np.zeros(n_atoms, dtype=np.int64) if block.ep_groups.shape[0] == 1 else np.arange(n_atoms)
    eg = block.ep_groups[0]
    ep_pos = {int(r): k for k, r in enumerate(eg)}
    ranks_per_block = max(1, group_size // experts_per_rank)
    cells = []
    for i, atom in enumerate(block.atoms):
        blks = {ep_pos[int(r)] // ranks_per_block for r in atom}
        cells.append(blks.pop() if len(blks) == 1 else -1 - i)
    return np.array(cells, dtype=np.int64)


def _atom_costs(scorer: BlockScorer, block: Block, placements: list, P: int) -> np.ndarray:
    """(n_atoms, P) crossings of each atom's tokens if it were sourced from each part."""
    n_atoms = block.atoms.shape[0]
    atom_of_rank = {int(r): i for i, atom in enumerate(block.atoms) for r in atom}
    out = np.zeros((n_atoms, P))
    for li, layer in enumerate(block.moe_layers):
        pl = placements[li][0]
        tok = scorer.tokens(block, 0, int(layer))
        if pl is None:
            continue
        parts = pl.expert2part[tok.topk]
        cnt = np.zeros((tok.n, P), dtype=np.int32)
        np.add.at(cnt, (np.repeat(np.arange(tok.n), parts.shape[1]), parts.reshape(-1)), 1)
        if scorer.mode == "per_pair":
            per = parts.shape[1] - cnt
        else:
            present = cnt > 0
            per = present.sum(axis=1, keepdims=True) - present
        atoms = np.array([atom_of_rank[int(block.ep_groups[0][k])] for k in tok.src])
        np.add.at(out, atoms, per)
    return out


def _place_sources(scorer_fit: BlockScorer, scorer_val: BlockScorer, block: Block, a2p: np.ndarray,
                   stop: Callable[[], bool] | None = None) -> tuple[np.ndarray, dict]:
    """Alternate replicas -> parts (assignment) and experts -> parts until neither improves (at most
    :data:`MAX_SOURCE_ROUNDS` rounds).  Raises :class:`_Stopped` when ``stop()`` turns true."""
    info: dict[str, float | int | bool | None] = {"rounds": 0, "fit_before": None, "fit_after": None, "val_before": None, "val_after": None, "kept": False}
    if block.ep_groups.shape[0] != 1 or a2p.max() == 0:
        return a2p, info
    P = int(a2p.max()) + 1
    cells = _source_cells(block, scorer_fit.group_size, scorer_fit.experts_per_rank)
    base_fit, placements = scorer_fit.score(block, a2p, stop=stop)
    best, best_fit = a2p.copy(), base_fit.total_bytes
    info["fit_before"] = best_fit
    cur, cur_pl = a2p.copy(), placements
    for rnd in range(MAX_SOURCE_ROUNDS):
        cost = _atom_costs(scorer_fit, block, cur_pl, P)
        new = cur.copy()
        for c in np.unique(cells):
            idx = np.flatnonzero(cells == c)
            slots = np.sort(cur[idx])
            rows, cols = linear_sum_assignment(cost[idx][:, slots])
            new[idx[rows]] = slots[cols]
        if np.array_equal(new, cur):
            break
        sc, pl = scorer_fit.score(block, new, stop=stop)
        info["rounds"] = rnd + 1
        if sc.total_bytes >= best_fit - 1e-6:
            break
        best, best_fit = new.copy(), sc.total_bytes
        cur, cur_pl = new, pl
    info["fit_after"] = best_fit
    if np.array_equal(best, a2p):
        return a2p, info
    v0 = scorer_val.score(block, a2p, stop=stop)[0].total_bytes
    v1 = scorer_val.score(block, best, stop=stop)[0].total_bytes
    info["val_before"], info["val_after"] = v0, v1
    if v1 <= v0:
        info["kept"] = True
        return best, info
    return a2p, info


# =============================================================================================
# The planner
# =============================================================================================
def _free_per_domain(instance: Instance) -> np.ndarray:
    cl = instance.cluster
    return np.bincount(cl.gpu2domain[cl.available_gpus], minlength=cl.num_domains).astype(np.int64)


def _units(instance: Instance, blocks: Sequence[Block]) -> list[int]:
    """Part granularities to try, finest last: whole trays (when TP x CP groups fit a tray), then atoms."""
    a = blocks[0].atom_size if blocks else 1
    g = instance.cluster.gpus_per_tray
    out = []
    if a <= g and g % a == 0:
        out.append(g)
    elif a > g and a % g == 0:
        out.append(a)
    out.append(a)
    return sorted(set(out), reverse=True)


def _merge_bounds(shape: tuple[int, ...], known: dict[tuple[int, ...], tuple[float, float]],
                  memo: dict[tuple[int, ...], float]) -> float:
    """Lower bound on a shape's total bytes: the best over its one-step merges (merging never costs
    more: any expert map on the finer shape is one on the merged shape)."""
    if shape in known:
        return known[shape][0]
    if len(shape) <= 1:
        return 0.0
    if shape in memo:
        return memo[shape]
    best = 0.0
    for i in range(len(shape)):
        for j in range(i + 1, len(shape)):
            merged = tuple(sorted(shape[:i] + shape[i + 1 : j] + shape[j + 1 :] + (shape[i] + shape[j],), reverse=True))
            best = max(best, _merge_bounds(merged, known, memo))
    memo[shape] = best
    return best


@dataclass(frozen=True)
class _Candidate:
    """A complete layout scored by the estimator: its name, (world,) rank2gpu and estimate."""

    name: str
    rank2gpu: np.ndarray
    estimate: dict


def _rank_key(est: dict, objective: str) -> tuple[float, float]:
    """Bytes then time for ``total``, time then bytes for ``bottleneck``."""
    if objective == "total":
        return (est["total_bytes"], est["slowest_stage_s"])
    return (est["slowest_stage_s"], est["total_bytes"])


def _public(est: dict) -> dict:
    """The JSON-serialisable part of an estimate (no expert map, no per-block scores)."""
    return {k: est[k] for k in ("total_bytes", "slowest_stage_s", "stage_bytes", "stage_time_s")}


def _from_metrics(m: Metrics, phy2log: np.ndarray) -> dict:
    """An estimate dict from the evaluator's metrics (sampled tokens)."""
    return {
        "total_bytes": float(m.cross_domain_bytes_per_step),
        "slowest_stage_s": float(m.alltoall_time_s_per_step),
        "stage_bytes": [float(x) for x in m.cross_domain_bytes_per_stage],
        "stage_time_s": [float(x) for x in m.alltoall_time_s_per_stage],
        "phy2log": phy2log,
        "block_scores": [],
    }


def plan_layout(
    instance: Instance,
    options: SolveOptions,
    *,
    deadline: float,
    work_s: float | None = None,
) -> LayoutPlan:
    """Map the job's ranks onto the available GPUs (see the module docstring for the method).

    Parameters
    ----------
    instance : the problem (solver view).
    options : ``consumer`` (``deepep``/``hybridep``: equal consecutive slices per domain),
        ``objective`` (``total`` or ``bottleneck``), ``time_limit_s`` (the work budget, see
        ``work_s``), and ``group_preserving`` (whether the expert maps scored must keep expert
        groups whole); ``stop_event`` is polled.
    deadline : ``time.monotonic()`` instant by which to return (the safety net).
    work_s : the deterministic work budget in predicted seconds (default
        ``LAYOUT_TIME_SHARE * options.time_limit_s``): what the layout does depends on it, never on
        the clock, unless the deadline or a stop request cuts a step (``details["wall_clock_cut"]``).

    Returns
    -------
    LayoutPlan

    Raises
    ------
    InfeasibleError
        Fewer available GPUs than ranks, or a consumer rule that no layout of the free GPUs meets.
    """
    from placement.checker import deepep_violations
    from placement.cost import evaluate
    from placement.model import Placement
    from solvers.default import default_rank2gpu
    from solvers.packed import packed_rank2gpu

    t_start = time.monotonic()
    par, cl, m = instance.parallel, instance.cluster, instance.model
    default_r2g = default_rank2gpu(instance)  # raises InfeasibleError on too few GPUs
    consumer = options.consumer
    equal_only = consumer in ("deepep", "hybridep")
    objective = options.objective
    gp = options.group_preserving_for(instance)
    blocks = layout_blocks(instance)
    free = _free_per_domain(instance)
    scorer = BlockScorer(instance, group_preserving=gp)
    identity = np.tile(np.arange(m.num_experts, dtype=np.int64), (m.num_moe_layers, 1))
    eval_s = _EVAL_S_PER_EXPERT_ID * float(np.prod(instance.routing.topk.shape))
    # the evaluator's check (the default's and the pick's) runs after the steps: keep its time
    budget = _Budget(LAYOUT_TIME_SHARE * options.time_limit_s if work_s is None else work_s, deadline, options,
                     finish_s=2.0 * eval_s)
    budget.scorers.append(scorer)
    details: dict = {
        "method": "footprints by a MILP over lazily priced shapes, experts placed per shape (joint at domain "
                  "granularity); replicas <-> experts alternation on straddling blocks; default, packed and "
                  "first-fit layouts as candidates",
        "objective": objective,
        "consumer": consumer,
        "group_preserving": bool(gp),
        "blocks": len(blocks),
        "free_gpus_per_domain": [int(x) for x in free],
        "work_budget_s": round(budget.work_s, 6),
    }
    if equal_only:
        for blk in blocks:
            if blk.ep_groups.shape[0] == 1 and blk.atoms.shape[0] > 1:
                eg = {int(r): k for k, r in enumerate(blk.ep_groups[0])}
                pos = [eg[int(r)] for r in blk.ranks]
                if pos != list(range(len(pos))):
                    raise InfeasibleError(
                        f"--consumer {consumer}: with parallel.order {par.order!r} the TP x CP groups of an EP group are "
                        "not consecutive EP ranks, so no layout gives equal consecutive slices per NVLink domain"
                    )

    def rule_ok(r2g: np.ndarray) -> bool:
        return not equal_only or not deepep_violations(instance, Placement(r2g, identity))

    cands: list[_Candidate] = []
    plan: list[list[dict[int, int]]] | None = None
    infeasible_units = 0
    exact: dict[tuple[int, tuple[int, ...]], tuple[ShapeScore, np.ndarray]] = {}  # (block, shape) -> exact
    cap_s: float | None = None
    est_default: dict | None = None
    default_ok = rule_ok(default_r2g)

    def add(name: str, r2g: np.ndarray, feet: Sequence[dict[int, int]], a2ps: Sequence[np.ndarray]) -> dict:
        """Score a complete layout, keep it as a candidate, and its blocks' scores as exact entries."""
        nonlocal cap_s
        est = _summarise(instance, blocks, a2ps, scorer, stop=budget.stopped)
        cands.append(_Candidate(name, np.asarray(r2g, dtype=np.int64), est))
        if name == "default" and objective == "total":
            cap_s = est["slowest_stage_s"]
        for b, (foot, a2p) in enumerate(zip(feet, a2ps)):
            if len(foot) > 1:
                _offer_exact(exact, (b, tuple(sorted(foot.values(), reverse=True))), est["block_scores"][b], a2p,
                             cap_s, objective)
        return est

    try:
        # ---- the peers' layouts, scored first (whatever the budget): candidates, hints, and
        # (default) the cap; packed first, the stronger fallback when the clock cuts in between
        hints: list[list[dict[int, int]]] = []
        packed_r2g = packed_rank2gpu(instance)
        try:
            packed_feet, packed_a2p = _block_feet(instance, blocks, packed_r2g)
        except SolverError:  # a TP x CP group across domains: not a layout this module can score
            packed_feet = []
        if packed_feet and rule_ok(packed_r2g):
            add("packed", packed_r2g, packed_feet, packed_a2p)
            hints.append(packed_feet)
        default_feet, default_a2p = _block_feet(instance, blocks, default_r2g)
        if default_ok:
            est_default = add("default", default_r2g, default_feet, default_a2p)
            hints.insert(0, default_feet)
        # ---- candidate shapes per block, the first-fit layout, the footprint MILP ----------------
        max_free = int(free.max()) if free.size else 0
        # kept for the finish: the evaluator's check (the default's and the pick's) and the
        # replicas <-> experts alternation
        finish_s = 2.0 * eval_s
        reserve_s = finish_s + FINISH_SHARE * budget.work_s
        for unit in _units(instance, blocks):
            shapes: list[list[tuple[int, ...]]] = []
            for blk in blocks:
                unit_b = unit if blk.size % unit == 0 else blk.atom_size
                max_parts = int(np.count_nonzero(free >= unit_b))
                cand: list[tuple[int, ...]] = []
                mp = max_parts
                while True:
                    cand = shape_candidates(blk.size, unit_b, min(max_free, blk.size), mp, equal_only=equal_only,
                                            limit=MAX_SHAPES_PER_BLOCK)
                    if equal_only or len(cand) <= MAX_SHAPES_PER_BLOCK or mp <= 2:
                        break
                    mp -= 1
                if equal_only:
                    cand = [c for c in cand if all(v % blk.atom_size == 0 for v in c)]
                shapes.append(cand)
            unit_hints = list(hints)
            first = _first_fit(blocks, free, unit) if not equal_only else None
            if first is not None:
                unit_hints.insert(0, first)
                if not any(c.name == "first_fit" for c in cands):
                    a2ps = [scorer.slices(blk, tuple(sorted(f.values(), reverse=True))) for blk, f in zip(blocks, first)]
                    predicted = sum(scorer.predict_s(blk, len(f)) for blk, f in zip(blocks, first))
                    if budget.affords(predicted + reserve_s):
                        add("first_fit", _assign_gpus(instance, blocks, first, a2ps)[0], first, a2ps)
            for feet in unit_hints:
                for b, foot in enumerate(feet):
                    sh = tuple(sorted(foot.values(), reverse=True))
                    if sh not in shapes[b]:
                        shapes[b].append(sh)
            if any(not s for s in shapes):
                infeasible_units += 1
                continue
            found, status = _solve_footprints(instance, blocks, shapes, free, scorer, options, unit_hints, budget,
                                              details, exact=exact, cap_s=cap_s, reserve_s=reserve_s,
                                              finish_s=finish_s)
            details["footprint_status"] = status
            if found is not None:
                plan = found
                details["part_unit_gpus"] = unit
                break
            if status != "INFEASIBLE":
                break
            infeasible_units += 1
        if plan is not None:
            picks = []
            for name, feet in zip(("optimized", "optimized, best scored pick"), plan):
                a2ps = []
                for b, (blk, foot) in enumerate(zip(blocks, feet)):
                    sh = tuple(sorted(foot.values(), reverse=True))
                    a2ps.append(exact[b, sh][1] if (b, sh) in exact else scorer.slices(blk, sh))
                add(name, _assign_gpus(instance, blocks, feet, a2ps)[0], feet, a2ps)
                picks.append((cands[-1], feet, a2ps))
            # the better of them goes on to the replica alternation
            _, feet, a2ps = min(picks, key=lambda p: _rank_key(p[0].estimate, objective))
            # ---- data-parallel sources on straddling blocks ------------------------------------------
            straddling = [b for b in range(len(blocks)) if len(feet[b]) > 1]
            src_info: dict[str, dict] = {}
            if not equal_only and straddling:
                fit = BlockScorer(instance, group_preserving=gp, tokens="fit")
                val = BlockScorer(instance, group_preserving=gp, tokens="val")
                budget.scorers += [fit, val]
                moved = list(a2ps)
                try:
                    for b in straddling:
                        P = len(feet[b])
                        # up to MAX_SOURCE_ROUNDS + 1 scorings on the fit tokens, two on the
                        # validation ones, one on all of them
                        predicted = ((MAX_SOURCE_ROUNDS + 1) * fit.predict_s(blocks[b], P)
                                     + 2 * val.predict_s(blocks[b], P) + scorer.predict_s(blocks[b], P))
                        if not budget.affords(predicted + 2.0 * eval_s):
                            src_info[str(b)] = {"skipped": "work budget"}
                            continue
                        moved[b], info = _place_sources(fit, val, blocks[b], a2ps[b], stop=budget.stopped)
                        src_info[str(b)] = info
                except _Stopped:
                    pass
                if any(not np.array_equal(x, y) for x, y in zip(moved, a2ps)):
                    add("optimized, replicas moved", _assign_gpus(instance, blocks, feet, moved)[0], feet, moved)
            details["source_placement"] = src_info
    except _Stopped:
        pass
    if not cands and not default_ok:
        if equal_only and infeasible_units and not budget.cut:
            raise InfeasibleError(_deepep_reason(consumer, blocks, free, par.world_size, cl.num_domains))
        raise SolverError("rank layout: no footprint found for the free GPUs within the time limit")

    # ---- the choice: best on the objective, within the cap, and the evaluator's check -------------
    def within(c: _Candidate) -> bool:
        return cap_s is None or c.estimate["slowest_stage_s"] <= cap_s * (1 + 1e-9) + 1e-12

    def rank(c: _Candidate) -> tuple:
        return _rank_key(c.estimate, objective) + (-cands.index(c),)  # on a tie, the later (more refined)

    details["candidates"] = {c.name: {"total_bytes": c.estimate["total_bytes"],
                                      "slowest_stage_s": c.estimate["slowest_stage_s"], "within_cap": within(c)}
                             for c in cands}
    details["stage_time_cap_s"] = cap_s
    order = sorted((c for c in cands if within(c)), key=rank)
    chosen: _Candidate | None = None
    if default_ok and not order:  # stopped before anything was scored
        chosen = _Candidate("default, contiguous experts", default_r2g, {})
    elif default_ok:
        # The evaluator has the last word on time: the layout with its expert map must not make the
        # slowest stage slower than the default layout as the `default` solver gives it (contiguous
        # experts); candidates are checked in order, the default with contiguous experts passes.
        budget.charge(eval_s)
        default_metrics = evaluate(instance, Placement(default_r2g, identity))
        default_s = default_metrics.alltoall_time_s_per_step
        checked: list[dict] = []
        for c in order[: 1 if budget.cut else 3]:  # cut by the clock: one try, then the default
            if c.name == "default" and np.array_equal(c.estimate["phy2log"], identity):
                chosen = c
                break
            budget.charge(eval_s)
            t = evaluate(instance, Placement(c.rank2gpu, c.estimate["phy2log"])).alltoall_time_s_per_step
            checked.append({"candidate": c.name, "alltoall_time_s_per_step": t})
            if t <= default_s * (1 + 1e-9) + 1e-12:
                chosen = c
                break
        if chosen is None:
            chosen = _Candidate("default, contiguous experts", default_r2g, _from_metrics(default_metrics, identity))
        details["evaluator_check"] = {"default_alltoall_time_s_per_step": default_s, "checked": checked}
    elif order:
        chosen = order[0]
    else:
        raise SolverError("rank layout: no footprint found for the free GPUs within the time limit")
    rank2gpu, est = chosen.rank2gpu.copy(), chosen.estimate
    phy2log = est.get("phy2log", identity)
    if equal_only:
        bad = deepep_violations(instance, Placement(rank2gpu, phy2log))
        if bad:
            raise SolverError(f"rank layout broke the {consumer} rule: {bad[0]}")
    if est_default is not None:
        details["default_estimate"] = _public(est_default)
    details["chosen"] = chosen.name
    details["estimate"] = _public(est) if est else None
    details["estimated_total_bytes"] = est.get("total_bytes")
    details["estimated_slowest_stage_s"] = est.get("slowest_stage_s")
    details["stage_footprints"] = stage_footprints(instance, rank2gpu)
    details["tp_cp_groups_split_across_trays"] = _split_atoms(instance, blocks, rank2gpu)
    details["work_spent_s"] = round(budget.spent_s(), 6)
    details["work_budget_exhausted"] = bool(budget.exhausted)
    details["wall_clock_cut"] = bool(budget.cut)
    log.info("rank layout: %s chosen in %.2f s wall (%.2f of %.2f predicted seconds of work%s)", chosen.name,
             time.monotonic() - t_start, budget.spent_s(), budget.work_s, ", cut by the clock" if budget.cut else "")
    return LayoutPlan(rank2gpu=rank2gpu, details=details, phy2log=phy2log)


def _split_atoms(instance: Instance, blocks: Sequence[Block], rank2gpu: np.ndarray) -> int:
    """TP x CP groups whose ranks sit on more than one tray."""
    host = instance.cluster.gpu2host[np.asarray(rank2gpu, dtype=np.int64)]
    return int(sum(len(set(host[atom].tolist())) > 1 for blk in blocks for atom in blk.atoms))


def _deepep_reason(consumer: str, blocks: Sequence[Block], free: np.ndarray, world: int, num_domains: int) -> str:
    """One line saying why no layout meets the equal-consecutive-slices rule."""
    sizes = sorted({b.size for b in blocks})
    a = blocks[0].atom_size if blocks else 1
    slices = sorted({n // m for n in sizes for m in range(1, num_domains + 1) if n % m == 0 and (n // m) % a == 0},
                    reverse=True)
    msg = (f"--consumer {consumer}: no layout gives every EP group equal consecutive slices per NVLink domain: "
           f"an EP group of {'/'.join(map(str, sizes))} ranks may take {', '.join(map(str, slices))} GPUs in each "
           f"domain it touches (at most {num_domains} domains)")
    total = int(free.sum())
    if world == total:
        # every free GPU is needed, so every domain must be filled exactly by such slices
        reach = {0}
        for _ in range(max(1, int(free.max()) // max(1, min(slices)) + 1)):
            reach |= {r + v for r in reach for v in slices if r + v <= int(free.max())}
        bad = [int(f) for f in free if int(f) not in reach]
        if bad:
            return (msg + f", the job needs all {total} free GPUs, and {len(bad)} domain(s) with "
                    f"{sorted(set(bad))} free GPUs cannot be filled by such slices")
    return msg + f"; free GPUs per domain {free.tolist()}, the job needs {world}"


def _milp_predict_s(nnz: int, objective: str) -> float:
    """Predicted seconds of one footprint MILP with ``nnz`` nonzeros (see :data:`_MILP_S_PER_NNZ_1_5`)."""
    factor = _MILP_BOTTLENECK_FACTOR if objective == "bottleneck" else 1.0
    return factor * (_MILP_BASE_S + _MILP_S_PER_NNZ_1_5 * float(nnz) ** 1.5)


def _offer_exact(exact: dict, key: tuple[int, tuple[int, ...]], score: ShapeScore, a2p: np.ndarray,
                 cap_s: float | None, objective: str) -> None:
    """Keep the better realisation of (block, shape) in ``exact``: within the time cap first, then by
    the objective (bytes then time for ``total``, time then bytes for ``bottleneck``)."""

    def rank(sc: ShapeScore) -> tuple:
        over = cap_s is not None and sc.time_s > cap_s * (1 + 1e-9) + 1e-12
        return (over, sc.total_bytes, sc.time_s) if objective == "total" else (over, sc.time_s, sc.total_bytes)

    old = exact.get(key)
    if old is None or rank(score) < rank(old[0]):
        exact[key] = (score, np.asarray(a2p, dtype=np.int64).copy())


def _solve_footprints(
    instance: Instance,
    blocks: Sequence[Block],
    shapes: list[list[tuple[int, ...]]],
    free: np.ndarray,
    scorer: BlockScorer,
    options: SolveOptions,
    hints: list[list[dict[int, int]]],
    budget: _Budget,
    details: dict,
    *,
    exact: dict,
    cap_s: float | None,
    reserve_s: float,
    finish_s: float,
) -> tuple[list[list[dict[int, int]]] | None, str]:
    """The lazy pricing loop around :class:`FootprintModel`: ``(footprints or None, status)``.

    The footprints returned are the best complete one on the final prices and, if another, the
    best one whose straddling blocks are all scored exactly (first when the clock cut in).

    The status is the last MILP's (``OPTIMAL``, ``FEASIBLE``), ``WARM_START`` when the best hint
    won, ``INFEASIBLE`` when no footprint exists, ``STOPPED`` (deadline or stop request) or
    ``BUDGET`` (the work budget ended before any footprint was found).

    A shape's price is per MoE layer: the mean over up to :data:`PROXY_LAYERS` layers spread over
    the model (each scored on the block of its own stage) of the bytes and of the busiest NIC's
    time; a block's price is that times its MoE layers (the time per layer is raised to the
    block's NVLink floor).  Shapes not priced yet enter with an estimate built from the two-part
    prices (what lands in each part when the rest is one domain, summed over the parts; never
    below the lower bounds of :func:`lower_bound`) and, for time, the worst part's busiest NIC
    when the rest is one domain (at least the NVLink floor).  ``exact`` maps (block, shape) to the
    block's exact score over all its layers and the atom -> part map that realises it; those
    entries replace the prices.  Each round prices the shapes the model picked on estimates,
    scores every straddling (block, shape) of the pick exactly, and solves again, until its pick
    is exact everywhere (then it is optimal for the prices) or the work budget ends.

    ``cap_s`` (the ``total`` objective): shapes whose time for the block (exact, priced or
    estimated) exceeds it are left out of the model, so no stage of a pick is slower than the
    default layout's slowest stage (whose own exact entries are within it by construction).
    Shapes whose price exceeds the incumbent's total are left out too.  Blocks of one size and
    layer count are interchangeable under these prices; the symmetry breaking gives the straddling
    footprints to the last of them.  ``reserve_s``: predicted seconds kept for the caller; the
    exact scoring of a pick (which the caller would do anyway) may use all but ``finish_s`` of it.
    """
    B = len(blocks)
    per_layer: dict[tuple[int, tuple[int, ...]], tuple[float, float]] = {}  # (size, shape) -> (bytes, nic s)
    arrivals: dict[tuple[int, tuple[int, ...]], tuple[float, ...]] = {}  # (size, shape) -> bytes into each part
    part_nic: dict[tuple[int, tuple[int, ...]], tuple[float, ...]] = {}  # (size, shape) -> busiest NIC s per part
    floors = [[scorer.nvlink_floor_s(b, int(l)) for l in b.moe_layers] for b in blocks]
    floor = [float(sum(f)) for f in floors]
    nlay = [len(b.moe_layers) for b in blocks]
    objective = options.objective

    samples: dict[int, list[tuple[int, int]]] = {}
    for size in sorted({b.size for b in blocks}):
        pool = [(b.index, int(l)) for b in blocks if b.size == size for l in b.moe_layers]
        pick = np.unique(np.linspace(0, len(pool) - 1, min(PROXY_LAYERS, len(pool))).round().astype(int))
        samples[size] = [pool[int(i)] for i in pick] if pool else []

    def price_shape(size: int, sh: tuple[int, ...]) -> bool:
        """Price ``sh`` for blocks of ``size``; False when the budget cannot afford it."""
        if (size, sh) in per_layer:
            return True
        if len(sh) == 1 or not samples[size]:
            per_layer[size, sh] = (0.0, 0.0)
            arrivals[size, sh] = (0.0,) * len(sh)
            part_nic[size, sh] = (0.0,) * len(sh)
            return True
        if not budget.affords(sum(scorer.predict_s(blocks[b], len(sh), 1) for b, _ in samples[size]) + reserve_s):
            return False
        tot, nic, arr, pn = 0.0, 0.0, np.zeros(len(sh)), np.zeros(len(sh))
        for b, layer in samples[size]:
            sc = scorer.score(blocks[b], scorer.slices(blocks[b], sh), layers=[layer], stop=budget.stopped)[0]
            tot += sc.total_bytes
            nic += sc.layer_nic_s[0]
            arr += np.asarray(sc.part_bytes)
            pn += np.asarray(sc.part_nic_s)
        n = len(samples[size])
        per_layer[size, sh] = (tot / n, nic / n)
        arrivals[size, sh] = tuple(float(x) for x in arr / n)
        part_nic[size, sh] = tuple(float(x) for x in pn / n)
        return True

    def score_exact(b: int, sh: tuple[int, ...]) -> bool:
        """Score block ``b`` under ``sh`` on all its layers; False when the budget cannot afford it."""
        if (b, sh) in exact:
            return True
        if not budget.affords(scorer.predict_s(blocks[b], len(sh)) + finish_s):
            return False
        a2p = scorer.slices(blocks[b], sh)
        _offer_exact(exact, (b, sh), scorer.score(blocks[b], a2p, stop=budget.stopped)[0], a2p, cap_s, objective)
        return True

    def estimate(size: int, sh: tuple[int, ...]) -> float | None:
        """Bytes per layer of an unpriced shape: the sum over its parts of what lands in a part of
        that size when the rest of the block is one domain (from the two-part prices); exact for
        two parts, and for more parts it misses only what the parts' maps cost each other."""
        out = 0.0
        for p in sh:
            two = tuple(sorted((p, size - p), reverse=True))
            if (size, two) not in arrivals:
                return None
            out += arrivals[size, two][two.index(p)]
        return out

    def estimate_nic(size: int, sh: tuple[int, ...]) -> float | None:
        """Busiest NIC seconds per layer of an unpriced shape: the worst over its parts of that
        part's busiest NIC when the rest of the block is one domain (from the two-part prices)."""
        out = 0.0
        for p in sh:
            two = tuple(sorted((p, size - p), reverse=True))
            if (size, two) not in part_nic:
                return None
            out = max(out, part_nic[size, two][two.index(p)])
        return out

    def lower_bound(size: int, sh: tuple[int, ...], memo: dict) -> float:
        """Bytes per layer no expert map on ``sh`` beats (up to the heuristic prices).

        Two bounds: merging two parts never costs more (any map on ``sh`` is one on the merge);
        and with ``T_j`` the tokens from outside part ``j`` that touch ``j`` and ``U_j`` the tokens
        from ``j`` that leave it, the cost is ``sum_j T_j >= sum_j U_j``, while the two-part shape
        ``(p_j, n - p_j)`` costs at most ``T_j + U_j`` under the same map, so the cost is at least
        half the sum of the two-part prices of its parts.
        """
        known = {k: (v[0], 0.0) for (z, k), v in per_layer.items() if z == size}
        merge = _merge_bounds(sh, known, memo)
        halves = [per_layer.get((size, tuple(sorted((p, size - p), reverse=True)))) for p in sh]
        split = 0.0
        if all(h is not None for h in halves):
            split = 0.5 * sum(h[0] for h in halves if h is not None)
        return max(merge, split)

    def tables() -> tuple[list[list[float]], list[list[float]]]:
        """Per block, per shape: (price in bytes, price in seconds)."""
        cost, tim = [], []
        memos: dict[int, dict] = {}
        for b in range(B):
            size = blocks[b].size
            memo = memos.setdefault(size, {})
            c_row, t_row = [], []
            for sh in shapes[b]:
                hit = exact.get((b, sh))
                if hit is not None:
                    c_row.append(hit[0].total_bytes)
                    t_row.append(hit[0].time_s)
                elif (size, sh) in per_layer:
                    byt, nic = per_layer[size, sh]
                    c_row.append(byt * nlay[b])
                    t_row.append(float(sum(max(nic, f) for f in floors[b])) if len(sh) > 1 else floor[b])
                else:
                    est = estimate(size, sh)
                    lb = lower_bound(size, sh, memo)
                    c_row.append(max(lb, est if est is not None else lb) * nlay[b])
                    nic_est = estimate_nic(size, sh) if len(sh) > 1 else None
                    t_row.append(float(sum(max(nic_est, f) for f in floors[b])) if nic_est is not None else floor[b])
            cost.append(c_row)
            tim.append(t_row)
        return cost, tim

    def shape_of(foot: dict[int, int]) -> tuple[int, ...]:
        return tuple(sorted(foot.values(), reverse=True))

    def key(tb: tuple[float, float]) -> tuple[float, float]:
        return tb if objective == "total" else (tb[1], tb[0])

    class _View:
        """The model's prices now, and what follows from them for complete footprints."""

        def __init__(self) -> None:
            self.cost, self.tim = tables()
            self.ok = [[cap_s is None or self.tim[b][k] <= cap_s * (1 + 1e-9) + 1e-12 for k in range(len(shapes[b]))]
                       for b in range(B)]

        def value(self, feet: list[dict[int, int]]) -> tuple[float, float]:
            ks = [shapes[b].index(shape_of(f)) for b, f in enumerate(feet)]
            return sum(self.cost[b][k] for b, k in enumerate(ks)), max(self.tim[b][k] for b, k in enumerate(ks))

        def feasible(self, feet: list[dict[int, int]]) -> bool:
            return all(self.ok[b][shapes[b].index(shape_of(f))] for b, f in enumerate(feet))

        def best(self, cands: Sequence[tuple[list[dict[int, int]], str]]) -> tuple[list[dict[int, int]], str] | None:
            """The best feasible candidate (first on ties), ``None`` if none is feasible."""
            ok = [c for c in cands if self.feasible(c[0])]
            return min(ok, key=lambda c: key(self.value(c[0]))) if ok else None

    # every complete footprint seen: the hints, then each round's pick (with its MILP status)
    seen: list[tuple[list[dict[int, int]], str]] = [(list(f), "WARM_START") for f in hints]
    status, rounds, lazily, milp_limited = "UNKNOWN", 0, 0, None
    shapes_kept: list[int] = []
    t0 = time.monotonic()
    try:
        # Round 0: the hints' shapes, every shape under a consumer rule (they are few), and the
        # two-part split (p, n - p) for every part size p that a candidate uses, whether or not the
        # split fits the domains (a block wider than two domains has no feasible two-part shape, but
        # what lands in a part of p GPUs when the rest is one domain is what the estimates need)
        todo0: list[tuple[int, tuple[int, ...]]] = []
        for feet in hints:
            for b, foot in enumerate(feet):
                todo0.append((blocks[b].size, shape_of(foot)))
        for b in range(B):
            size = blocks[b].size
            for sh in shapes[b]:
                if options.consumer != "none":
                    todo0.append((size, sh))
            for p in sorted({v for sh in shapes[b] for v in sh if v < size}, reverse=True):
                todo0.append((size, tuple(sorted((p, size - p), reverse=True))))
        for size, sh in dict.fromkeys(todo0):
            budget.check()
            if not price_shape(size, sh):
                break
        log.info("footprints: %d shapes priced up front in %.2f s", len(per_layer), time.monotonic() - t0)

        while True:
            rounds += 1
            view = _View()
            # warm start: the best complete footprint within the cap so far; HiGHS as scipy exposes
            # it takes no starting solution, so it is the fallback, the yardstick and the cutoff
            # that prunes shapes which alone price it out
            warm = view.best(seen)
            keep = [[k for k in range(len(shapes[b])) if view.ok[b][k]] for b in range(B)]
            if warm is not None:
                wb, wt = view.value(warm[0])
                if objective == "total":
                    # a shape priced above the whole incumbent cannot be part of a better footprint
                    # (estimates miss only what parts cost each other, so they err low)
                    keep = [[k for k in keep[b] if view.cost[b][k] <= wb * (1 + 1e-9) + 1.0] for b in range(B)]
                else:  # a block slower than the incumbent's slowest makes the whole footprint slower
                    keep = [[k for k in keep[b] if view.tim[b][k] <= wt * (1 + 1e-9) + 1e-12] for b in range(B)]
            if any(not kb for kb in keep):
                status = "INFEASIBLE" if warm is None else status
                break
            model = FootprintModel(
                [b.size for b in blocks],
                [[shapes[b][k] for k in keep[b]] for b in range(B)],
                free,
                [[view.cost[b][k] / _BYTES_PER_UNIT for k in keep[b]] for b in range(B)],
                [[view.tim[b][k] / _SECONDS_PER_UNIT for k in keep[b]] for b in range(B)],
            )
            predicted = _milp_predict_s(model.nnz, objective)
            # with nothing in hand (a consumer rule the peers' layouts break) one solve is a must
            if not budget.affords(predicted + reserve_s) and warm is not None:
                break
            budget.check()
            budget.charge(predicted)
            t_round = time.monotonic()
            st, picked, _, _ = model.solve(objective, time_limit_s=budget.wall_left_s(), node_limit=_MILP_NODE_LIMIT)
            shapes_kept.append(int(sum(len(k) for k in keep)))
            log.info("footprint round %d: %s in %.2f s (%d shapes, %d nonzeros, %.2f s predicted)", rounds, st,
                     time.monotonic() - t_round, shapes_kept[-1], model.nnz, predicted)
            if model.stopped_by == "time":
                budget.cut = True  # HiGHS stopped by the clock: the pick may depend on the machine's speed
            elif model.stopped_by == "nodes":
                milp_limited = "nodes"
            if picked is None:
                status = st if warm is None else status
                break
            seen.append((picked, st))
            todo_exact = [(b, shape_of(f)) for b, f in enumerate(picked) if len(f) > 1 and (b, shape_of(f)) not in exact]
            if not todo_exact:
                break  # every straddling block of the pick is scored exactly: optimal for these prices
            if budget.cut:
                break
            # the pick's shapes priced for every block of their size, and its blocks scored exactly
            todo_price = list(dict.fromkeys((blocks[b].size, sh) for b, sh in todo_exact
                                            if (blocks[b].size, sh) not in per_layer))
            afforded = True
            for b, sh in todo_exact:  # first: it makes the pick a complete, exact candidate
                budget.check()
                afforded = afforded and score_exact(b, sh)
            for size, sh in todo_price:
                budget.check()
                afforded = afforded and price_shape(size, sh)
                lazily += int(afforded)
            if not afforded:
                break
    except _Stopped:  # the caller keeps its complete candidates; the picks so far are more
        status = "STOPPED"
    # the best footprint seen, on the final prices (exact wherever a pick was scored)
    view = _View()

    def exact_everywhere(feet: list[dict[int, int]]) -> bool:
        return all(len(f) == 1 or (b, shape_of(f)) in exact for b, f in enumerate(feet))

    # the best on the model's prices (the caller scores it exactly), and the best pick already
    # scored exactly everywhere (all the caller can afford when the clock has cut in: first then;
    # the hints are the caller's own candidates already)
    scored = [c for c in seen[len(hints):] if exact_everywhere(c[0])]
    finals = [c for c in (view.best(seen), view.best(scored)) if c is not None]
    if budget.cut:
        finals.reverse()
    finals = [c for i, c in enumerate(finals) if all(c[0] != d[0] for d in finals[:i])]
    details["footprint_rounds"] = rounds
    details["footprint_round_shapes"] = shapes_kept
    details["footprint_milp_limit"] = milp_limited
    details["shapes_per_block"] = [len(s) for s in shapes]
    details["shapes_priced"] = len(per_layer)
    details["shapes_priced_lazily"] = lazily
    details["blocks_scored_exactly"] = len(exact)
    if not finals:
        return None, ("BUDGET" if status == "UNKNOWN" else status)
    return [c[0] for c in finals], (finals[0][1] if status not in ("STOPPED", "INFEASIBLE") else status)
