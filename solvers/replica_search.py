"""The replica search (``--replica-rule search``): which experts get the ``N`` redundant slots, and where.

Per MoE layer, with the permutation the cross-rack search chose kept (each EP rank's first ``E / ep``
slots), a local search from the better simple rule and, on small layers, a CP-SAT model place
``N / ep`` redundant slots on every EP rank, minimising the busiest EP rank's tokens under the
runtime's static split (expert ``e`` with ``c_e`` slots gives each ``w_e / c_e``); the evaluator then
prices every candidate map, and the search keeps per layer the candidate with the lower priced time
(the GPU load's expert compute against the layer's all-to-all, the larger, both from
:func:`placement.predict.cost.evaluate` and the step-time model), and finally whichever of the combined
map, its own, ``hottest``'s and ``eplb``'s predicts the faster step on the sampled window.  One more
candidate keeps every replica inside its expert's home node (the dispatcher's node,
:mod:`placement.core.dispatch`; :func:`in_node_start` then :func:`local_search` restricted to the node):
a token then reaches no node it did not reach before, so the cross-rack bytes stay the
permutation's while the GPU load evens out inside each node (the replication UltraEP keeps inside
one NVLink domain).  So on the
evaluator it is never worse than either simple rule at the same ``N`` (tested on tiny layers).

The model, per layer (``w_e`` the expert's tokens on the sampled window, ``scale = lcm(1..K)`` so
every share is an integer); it runs when (experts considered) x ``ep`` x ``K`` <= ``SMALL_LAYER``,
else the layer keeps :func:`local_search`'s answer (which also hints the model):

- ``u[e, k]`` (exactly one per expert): ``e`` has ``k`` slots, ``1 <= k <= K = min(ep, N + 1, 8)``
  (more only if the hint uses more);
- ``x[e, r]``: a redundant slot of rank ``r`` (which does not already hold ``e``) holds ``e``;
  ``sum_e x[e, r] = N / ep``;
- ``z[e, r, k]``: ``x[e, r]`` and ``e`` has ``k`` slots: ``sum_k z[e, r, k] = x[e, r]``,
  ``z[e, r, k] => u[e, k]``, ``sum_r z[e, r, k] = (k - 1) u[e, k]``;
- ``load_r = sum_{e on r} sum_k u[e, k] w_e scale / k + sum_{e, k} z[e, r, k] w_e scale / k <= T``,
  ``ep T >= sum_e w_e scale``; minimise ``T``.

Experts considered for replicas: the ``N + ep`` heaviest and every expert the hint replicates; with
all experts considered and ``K = min(ep, N + 1)`` the model covers every map: the layer is exact
when CP-SAT proves it optimal, and CP-SAT's bound is a bound of the layer.  CP-SAT runs one worker,
a fixed seed and a deterministic time limit per layer (``max_deterministic_time``), so the same
input gives the same map.  The reported lower bound is valid for the full problem: the largest of
the mean rank load, CP-SAT's bound when its model covers every map, and, per rank, the least load
its own experts can reach with ``N`` replicas spent on them alone (separable and convex: greedy is
exact).

Dispatcher rule: HybridEP sees a replica as one more column of the routing map on its rank
(Megatron-Core 0.16.1 ``megatron/core/transformer/moe/fused_a2a.py``, ``HybridEPDispatch.forward``
with ``num_of_experts_per_rank`` columns per rank), and the node rule (:mod:`placement.core.dispatch`)
depends only on the rank layout, which replicas do not change: every map here is one HybridEP runs.

Moving the permutation with the replicas: :func:`joint_search` (primary-expert swaps priced with the
replicas, alternated with this search; never worse on the sampled window, but on dsv3_256 at N = 64
its sampled gain did not carry to the held-out window, so ``solve`` does not call it).  Not built:
the outer cross-rack search seeing replicas, and a time term for the all-to-all inside the CP-SAT
model (it enters through the evaluator's per-layer choice).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import lcm
from typing import TYPE_CHECKING

import numpy as np

from placement.core.model import Instance, InvalidInputError, Placement
from placement.core.replicas import ReplicaMap, check_rule_inputs, expert_loads, physical_map, rank_loads, replicate

if TYPE_CHECKING:  # pragma: no cover
    from placement.predict.cost import Window

__all__ = ["SearchInfo", "search_replicas", "search_layer", "load_lower_bound", "priced_step_s", "JointInfo",
           "joint_search", "swap_primaries"]

MAX_COUNT = 8  # slots per expert the model considers beyond the hint (K)
DETERMINISTIC_TIME_PER_LAYER = 1.0  # CP-SAT's deterministic time units per layer
SMALL_LAYER = 4096  # CP-SAT runs when (experts considered) x ep x K is at most this


@dataclass
class SearchInfo:
    """What :func:`search_replicas` found: the chosen map's origin, per layer the busiest rank's
    tokens over the mean (``load``), its lower bound (``bound``), whether CP-SAT proved it optimal for
    the full layer (``exact``), and the predicted sampled step seconds of each whole candidate."""

    chosen: str = "search"
    layer_source: list[str] = field(default_factory=list)
    load: list[float] = field(default_factory=list)
    bound: list[float] = field(default_factory=list)
    exact: list[bool] = field(default_factory=list)
    step_s: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "chosen": self.chosen,
            "layers_from": {k: self.layer_source.count(k) for k in sorted(set(self.layer_source))},
            "rank_load_max_over_mean_mean": float(np.mean(self.load)) if self.load else 1.0,
            "rank_load_lower_bound_mean": float(np.mean(self.bound)) if self.bound else 1.0,
            "exact_layers": int(sum(self.exact)),
            "sampled_step_s": dict(self.step_s),
        }


def load_lower_bound(base_row: np.ndarray, w: np.ndarray, ep: int, redundant_experts: int) -> float:
    """A lower bound on the busiest EP rank's tokens with ``redundant_experts`` slots (one layer).

    The mean ``sum(w) / ep``, and per rank the least its own experts can weigh when all ``N``
    replicas go to them (at most ``ep`` slots per expert): greedy on ``w_e / c_e``.
    """
    w = np.asarray(w, dtype=np.float64)
    e = len(w)
    epr = e // ep
    best = float(w.sum()) / ep
    for r in range(ep):
        ws = w[np.asarray(base_row[r * epr:(r + 1) * epr], dtype=np.int64)]
        cnt = np.ones(len(ws))
        for _ in range(min(redundant_experts, len(ws) * (ep - 1))):
            gain = np.where(cnt < ep, ws / cnt - ws / (cnt + 1), -1.0)
            cnt[int(np.argmax(gain))] += 1
        best = max(best, float((ws / cnt).sum()))
    return best


def in_node_start(base_row: np.ndarray, w: np.ndarray, ep: int, per_rank: int, same_node: np.ndarray) -> np.ndarray | None:
    """(ep, per_rank) redundant slots that each hold an expert of another rank of the slot's own
    dispatcher node (``same_node`` (ep, ep) bool), round by round the one with the most tokens per
    slot (lowest id on ties); None when some rank's node has too few other experts."""
    base = np.asarray(base_row, dtype=np.int64)
    w = np.asarray(w, dtype=np.float64)
    e = len(base)
    epr = e // ep
    home = np.empty(e, dtype=np.int64)
    home[base] = np.arange(e) // epr
    cnt = np.ones(e)
    extra = np.zeros((ep, per_rank), dtype=np.int64)
    for j in range(per_rank):
        for q in range(ep):
            ok = same_node[home, q] & (home != q)
            ok[extra[q, :j]] = False
            if not ok.any():
                return None
            score = np.where(ok, w / cnt, -np.inf)
            x = int(np.argmax(score))
            extra[q, j] = x
            cnt[x] += 1
    return extra


def local_search(base_row: np.ndarray, w: np.ndarray, ep: int, extra: np.ndarray, max_moves: int | None = None,
                 same_node: np.ndarray | None = None) -> np.ndarray:
    """Improve one layer's redundant slots ``extra`` (ep, N / ep) on the busiest rank's tokens.

    A move gives one redundant slot (rank ``q``, holding ``y``, ``y`` kept elsewhere) to an expert
    ``x`` of the busiest rank that ``q`` does not hold: every holder of ``x`` sheds load, every other
    holder of ``y`` takes some.  The best move by (busiest rank, sum of squared rank loads) is taken
    while it lowers that pair lexicographically (so the walk ends); deterministic.  ``same_node``
    (ep, ep) bool: only moves that put ``x`` on a rank of its home rank's dispatcher node.
    """
    base = np.asarray(base_row, dtype=np.int64)
    w = np.asarray(w, dtype=np.float64)
    e = len(base)
    epr = e // ep
    cur = np.array(extra, dtype=np.int64).reshape(ep, -1)
    per_rank = cur.shape[1]
    if per_rank == 0:
        return cur
    home = np.empty(e, dtype=np.int64)
    home[base] = np.arange(e) // epr
    q_of = np.repeat(np.arange(ep), per_rank)  # (N,) rank of each redundant slot
    budget = max_moves if max_moves is not None else 4 * cur.size + 64
    for _ in range(budget):
        hold = np.zeros((e, ep), dtype=bool)
        hold[base, np.arange(e) // epr] = True
        hold[cur.reshape(-1), q_of] = True
        cnt = hold.sum(axis=1).astype(np.float64)
        load = (hold * (w / cnt)[:, None]).sum(axis=0)
        peak, sq = float(load.max()), float((load ** 2).sum())
        top = int(np.argmax(load))
        ys = cur.reshape(-1)
        best: tuple[float, float, int, int] | None = None
        for xx in np.flatnonzero(hold[:, top]):
            ok = (ys != xx) & ~hold[xx, q_of]
            if same_node is not None:
                ok &= same_node[home[xx], q_of]
            if not ok.any():
                continue
            gain_x = w[xx] / (cnt[xx] + 1) - w[xx] / cnt[xx]
            d = hold[ys] * (w[ys] / (cnt[ys] - 1) - w[ys] / cnt[ys])[:, None]  # (N, ep) other holders of y
            d = d + hold[xx][None, :] * gain_x
            rows = np.arange(len(ys))
            d[rows, q_of] = -w[ys] / cnt[ys] + w[xx] / (cnt[xx] + 1)
            new = load[None, :] + d
            nmax = new.max(axis=1)
            nsq = (new ** 2).sum(axis=1)
            nmax[~ok] = np.inf
            k = int(np.lexsort((nsq, nmax))[0])
            cand = (float(nmax[k]), float(nsq[k]), int(xx), k)
            if best is None or cand[:2] < best[:2]:
                best = cand
        if best is None or not (best[0] < peak - 1e-9 * peak or (best[0] <= peak + 1e-9 * peak and best[1] < sq - 1e-9 * sq)):
            break
        cur.reshape(-1)[best[3]] = best[2]
    return np.sort(cur, axis=1)


def search_layer(base_row: np.ndarray, w: np.ndarray, ep: int, redundant_experts: int,
                 hint_extra: np.ndarray | None = None, *, seed: int = 0,
                 deterministic_time: float = DETERMINISTIC_TIME_PER_LAYER) -> tuple[np.ndarray, bool, float]:
    """One layer's redundant slots (module docstring): ``(extra (ep, N / ep), exact, bound_tokens)``.

    ``base_row`` (E,): the permutation; ``w`` (E,): tokens per expert; ``hint_extra`` (ep, N / ep):
    a feasible map to start from (a simple rule's), improved by :func:`local_search`.  ``exact``:
    proved optimal over all experts; ``bound_tokens``: CP-SAT's bound on the busiest rank's tokens
    when its model covers every map (every expert, ``K = min(ep, N + 1)``), else 0.
    """
    from ortools.sat.python import cp_model

    base = np.asarray(base_row, dtype=np.int64)
    e = len(base)
    per_rank = redundant_experts // ep
    epr = e // ep
    wi = np.rint(np.asarray(w, dtype=np.float64)).astype(np.int64)
    home = np.empty(e, dtype=np.int64)
    home[base] = np.arange(e) // epr
    hint = None if hint_extra is None else np.asarray(hint_extra, dtype=np.int64).reshape(ep, per_rank)
    if hint is not None:
        hint = local_search(base, w, ep, hint)
    hint_cnt = np.ones(e, dtype=np.int64)
    if hint is not None:
        hint_cnt += np.bincount(hint.reshape(-1), minlength=e)
    order = np.lexsort((np.arange(e), -wi))
    cand = set(order[: min(e, redundant_experts + ep)].tolist())
    if hint is not None:
        cand |= set(np.flatnonzero(hint_cnt > 1).tolist())
    cands = sorted(cand)
    full_k = min(ep, redundant_experts + 1)
    kmax = max(min(full_k, MAX_COUNT), int(hint_cnt.max()))
    scale = lcm(*range(1, kmax + 1))
    if hint is not None and len(cands) * ep * kmax > SMALL_LAYER:
        return hint, False, 0.0  # too large for the exact model: the local search's answer
    model = cp_model.CpModel()
    x: dict[tuple[int, int], cp_model.IntVar] = {}
    share: dict[int, cp_model.LinearExprT] = {}
    slot_load: dict[tuple[int, int], cp_model.LinearExprT] = {}
    for ex in cands:
        u = [model.new_bool_var(f"u{ex}_{k}") for k in range(1, kmax + 1)]
        model.add_exactly_one(u)
        share[ex] = sum(int(wi[ex] * scale // k) * u[k - 1] for k in range(1, kmax + 1))
        # z[r][k]: rank r holds a replica of ex and ex has k slots (k >= 2); per k, k - 1 ranks
        zk: list[list[cp_model.IntVar]] = [[] for _ in range(kmax + 1)]
        for r in range(ep):
            if r == home[ex]:
                continue
            x[ex, r] = model.new_bool_var(f"x{ex}_{r}")
            zs = {k: model.new_bool_var(f"z{ex}_{r}_{k}") for k in range(2, kmax + 1)}
            model.add(sum(zs.values()) == x[ex, r])
            for k, z in zs.items():
                zk[k].append(z)
                model.add_implication(z, u[k - 1])
            slot_load[ex, r] = sum(int(wi[ex] * scale // k) * z for k, z in zs.items())
        for k in range(2, kmax + 1):
            model.add(sum(zk[k]) == (k - 1) * u[k - 1])
        if hint is not None:
            for k in range(1, kmax + 1):
                model.add_hint(u[k - 1], int(hint_cnt[ex] == k))
    t = model.new_int_var(0, int(wi.sum() * scale), "T")
    total = int(wi.sum() * scale)
    for r in range(ep):
        terms = []
        for ex in base[r * epr:(r + 1) * epr].tolist():
            terms.append(share[ex] if ex in share else int(wi[ex] * scale))
        slots = []
        for ex in cands:
            if (ex, r) in x:
                terms.append(slot_load[ex, r])
                slots.append(x[ex, r])
                if hint is not None:
                    model.add_hint(x[ex, r], int(ex in hint[r]))
        model.add(sum(slots) == per_rank)
        model.add(sum(terms) <= t)
    model.add(ep * t >= total)  # the mean rank load
    model.minimize(t)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = int(seed)
    solver.parameters.max_deterministic_time = float(deterministic_time)
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if hint is None:
            raise InvalidInputError("redundant_experts: the replica search found no map within its time limit")
        return hint, False, 0.0
    extra = np.zeros((ep, per_rank), dtype=np.int64)
    for r in range(ep):
        held = [ex for ex in cands if (ex, r) in x and solver.value(x[ex, r])]
        extra[r] = sorted(held)
    covers = len(cands) == e and kmax >= full_k
    exact = status == cp_model.OPTIMAL and covers
    bound = float(solver.best_objective_bound) / scale if covers else 0.0
    return extra, bool(exact), bound


def priced_step_s(instance: Instance, placement: Placement, rmap: ReplicaMap | None,
                  window: Window = "sampled") -> tuple[float, np.ndarray]:
    """``(step seconds, (L,) per-layer priced seconds)`` of a replica map on one window.

    With a ``performance`` block: the step-time model's step, and per MoE layer the larger of its
    routed-expert compute at the busiest GPU's load (one step's micro-batches) and its all-to-all
    (the four transfers on their achieved links).  Without one: the mean busiest-GPU load ratio plus
    the all-to-all seconds per step, and per layer the load ratio (a unit-free score).
    """
    from placement.predict.cost import evaluate
    from placement.predict.performance import StepTimeModel, per_microbatch_load

    m = evaluate(instance, placement, window=window, replicas=rmap)
    lasting = np.asarray(m.expert_load_lasting_max_over_mean_per_layer or m.expert_load_max_over_mean_per_layer)
    if instance.performance is None:
        return float(lasting.mean() + m.alltoall_time_s_per_step), lasting
    sm = StepTimeModel(instance)
    pred = sm.predict_metrics(m, placement.rank2gpu)
    tt = sm.transfer_times_s(m.alltoall_time_s_per_layer, m.max_gpu_cross_domain_bytes_per_layer,
                             m.max_gpu_nvlink_bytes_per_layer).sum(axis=1)
    routed = float(np.max(sm._all_routed)) if len(sm._all_routed) else 0.0  # routed compute per micro-batch
    load = per_microbatch_load(lasting, sm._pairs_per_gpu, sm._ep)
    return float(pred.step_time_s), np.maximum(routed * load, tt) * sm.micro_batches


def search_replicas(instance: Instance, placement: Placement, redundant_experts: int, *, seed: int = 0,
                    deterministic_time: float = DETERMINISTIC_TIME_PER_LAYER) -> tuple[ReplicaMap, SearchInfo]:
    """The ``search`` rule's map for ``placement`` and what the search found (module docstring).

    Raises
    ------
    InvalidInputError
        ``redundant_experts`` that ``E + N`` and ``ep`` do not allow.
    """
    m, par, cl = instance.model, instance.parallel, instance.cluster
    base = np.asarray(placement.phy2log, dtype=np.int64)
    loads = expert_loads(instance.routing.topk, m.num_experts)
    check_rule_inputs(base, loads, par.ep, redundant_experts)
    if redundant_experts == 0:
        return physical_map(base, np.zeros((base.shape[0], par.ep, 0)), par.ep), SearchInfo("none")
    stage = np.asarray(instance.moe_layer2stage)
    r2g = np.asarray(placement.rank2gpu, dtype=np.int64)
    maps: dict[str, np.ndarray] = {}
    for rule in ("hottest", "eplb"):
        rows = np.zeros((m.num_moe_layers, m.num_experts + redundant_experts), dtype=np.int64)
        for s in np.unique(stage):
            layers = np.flatnonzero(stage == s)
            rank2domain = cl.gpu2domain[r2g[par.stage_ep_groups[int(s)][0]]]
            rows[layers] = replicate(rule, base[layers], loads[layers], par.ep, redundant_experts, rank2domain).phy2log
        maps[rule] = rows
    info = SearchInfo()
    spr = (m.num_experts + redundant_experts) // par.ep
    epr = m.num_experts // par.ep
    rows = np.zeros_like(maps["hottest"])
    # In-node candidate: every replica on a rank of its expert's home node (placement.core.dispatch), so a
    # token reaches no node it did not reach before: the cross-rack bytes stay the permutation's.
    from placement.predict.cost import LayoutIndex

    group_node, _ = LayoutIndex(instance, r2g, instance.routing.tokens_per_source).nodes()  # (pp, G, ep)
    same = (group_node[:, :, :, None] == group_node[:, :, None, :]).all(axis=1)  # (pp, ep, ep)
    in_node = rows.copy()
    for li in range(m.num_moe_layers):
        start_in = in_node_start(base[li], loads[li], par.ep, redundant_experts // par.ep, same[stage[li]])
        if start_in is None:
            in_node = None
            break
        extra_in = local_search(base[li], loads[li], par.ep, start_in, same_node=same[stage[li]])
        in_node[li] = physical_map(base[li:li + 1], extra_in[None], par.ep).phy2log[0]
    for li in range(m.num_moe_layers):
        cands = {k: ReplicaMap(v[li:li + 1], m.num_experts, par.ep) for k, v in maps.items()}
        peak = {k: float(rank_loads(c, loads[li:li + 1]).max()) for k, c in cands.items()}
        start = min(peak, key=lambda k: (peak[k], k))
        hint = maps[start][li].reshape(par.ep, spr)[:, epr:]
        extra, exact, cp_bound = search_layer(base[li], loads[li], par.ep, redundant_experts, hint, seed=seed,
                                              deterministic_time=deterministic_time)
        rows[li] = physical_map(base[li:li + 1], extra[None], par.ep).phy2log[0]
        mean = float(loads[li].sum()) / par.ep or 1.0
        info.load.append(float(rank_loads(ReplicaMap(rows[li:li + 1], m.num_experts, par.ep), loads[li:li + 1]).max()) / mean)
        info.bound.append(max(load_lower_bound(base[li], loads[li], par.ep, redundant_experts), cp_bound) / mean)
        info.exact.append(exact)
    maps = {"search": rows, **({"in_node": in_node} if in_node is not None else {}), **maps}
    rmaps = {k: ReplicaMap(v, m.num_experts, par.ep) for k, v in maps.items()}
    priced = {k: priced_step_s(instance, placement, r) for k, r in rmaps.items()}
    # Per layer, the candidate whose priced time is lowest (the search's own on ties).
    per_layer = np.stack([priced[k][1] for k in maps])  # (candidates, L)
    names = list(maps)
    pick = np.argmin(per_layer, axis=0)
    info.layer_source = [names[int(i)] for i in pick]
    combined = np.stack([maps[names[int(i)]][li] for li, i in enumerate(pick)])
    rmaps["combined"] = ReplicaMap(combined, m.num_experts, par.ep)
    priced["combined"] = priced_step_s(instance, placement, rmaps["combined"])
    info.step_s = {k: v[0] for k, v in priced.items()}
    order = ["combined", "search", "in_node", "hottest", "eplb"]
    best = min((k for k in order if k in priced), key=lambda k: (priced[k][0], order.index(k)))
    info.chosen = best
    if best != "combined":  # the whole map of one candidate
        info.layer_source = [best] * m.num_moe_layers
    final = rmaps[best]
    rows_final = final.phy2log
    info.load = [float(rank_loads(ReplicaMap(rows_final[li:li + 1], m.num_experts, par.ep), loads[li:li + 1]).max())
                 / (float(loads[li].sum()) / par.ep or 1.0) for li in range(m.num_moe_layers)]
    return final, info


# ---------------------------------------------------------------------------------------------
# Joint with the permutation: swaps of primary experts between EP ranks, priced with the replicas
# ---------------------------------------------------------------------------------------------
JOINT_SWAPS_PER_LAYER = 8  # load-driven swaps proposed per layer and round


@dataclass
class JointInfo:
    """What :func:`joint_search` did: per round the priced sampled step after the primary-expert
    swaps and after the replica search re-ran on the swapped permutation (None: not accepted)."""

    rounds: int = 0
    start_step_s: float = 0.0
    final_step_s: float = 0.0
    swapped_layers: int = 0
    history: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"rounds": self.rounds, "start_sampled_step_s": self.start_step_s,
                "final_sampled_step_s": self.final_step_s, "swapped_layers": self.swapped_layers,
                "history": list(self.history)}


def swap_primaries(base_row: np.ndarray, w: np.ndarray, ep: int, extra: np.ndarray,
                   label: np.ndarray | None = None, max_swaps: int = JOINT_SWAPS_PER_LAYER) -> np.ndarray:
    """One layer's permutation improved on the busiest EP rank's tokens, the replicas kept.

    A swap exchanges the slots of a primary expert ``e`` of the busiest rank ``a`` and a primary
    ``f`` of another rank ``b``: allowed when ``b`` holds no replica of ``e`` nor ``a`` one of ``f``
    (a rank holds an expert once) and, with ``label`` (E,), ``label[e] == label[f]`` (the expert
    group of group-limited routing, so a group-preserving map stays one).  Each expert keeps its
    slot count, so ``a`` trades ``w_e / c_e`` for ``w_f / c_f``.  The best swap by (busiest rank,
    sum of squared rank loads) is taken while it lowers that pair lexicographically; deterministic
    (lowest ``(e, f)`` on ties).

    Returns
    -------
    (E,) the new permutation row (``extra`` still valid on it).
    """
    row = np.array(base_row, dtype=np.int64)
    w = np.asarray(w, dtype=np.float64)
    e_n = len(row)
    epr = e_n // ep
    ex = np.asarray(extra, dtype=np.int64).reshape(ep, -1)
    held_extra = np.zeros((e_n, ep), dtype=bool)
    if ex.size:
        held_extra[ex.reshape(-1), np.repeat(np.arange(ep), ex.shape[1])] = True
    cnt = 1.0 + held_extra.sum(axis=1)
    share = w / cnt
    for _ in range(max_swaps):
        home = np.empty(e_n, dtype=np.int64)
        home[row] = np.arange(e_n) // epr
        load = np.bincount(home, weights=share, minlength=ep) + (held_extra * share[:, None]).sum(axis=0)
        peak, sq = float(load.max()), float((load ** 2).sum())
        a = int(np.argmax(load))
        best: tuple[float, float, int, int] | None = None
        for e in sorted(row[a * epr:(a + 1) * epr].tolist()):
            f = np.arange(e_n)
            ok = (home != a) & ~held_extra[e, home] & ~held_extra[f, a]
            if label is not None:
                ok &= label == label[e]
            if not ok.any():
                continue
            d = share[f] - share[e]  # a gains f, loses e; b the reverse
            new_a = load[a] + d
            new_b = load[home] - d
            rest = load.copy()
            rest[a] = -np.inf
            # busiest of the ranks other than a and b: the top two of the rest cover every b
            top2 = np.sort(rest)[-2:]
            other = np.where(load[home] >= top2[1], top2[0], top2[1])
            nmax = np.maximum(np.maximum(new_a, new_b), other)
            nsq = sq - load[a] ** 2 - load[home] ** 2 + new_a ** 2 + new_b ** 2
            nmax = np.where(ok, nmax, np.inf)
            k = int(np.lexsort((f, nsq, nmax))[0])
            if not ok[k]:
                continue
            cand = (float(nmax[k]), float(nsq[k]), int(e), int(k))
            if best is None or cand[:2] < best[:2]:
                best = cand
        if best is None or not (best[0] < peak - 1e-9 * peak or (best[0] <= peak + 1e-9 * peak and best[1] < sq - 1e-9 * sq)):
            break
        pe, pf = int(np.flatnonzero(row == best[2])[0]), int(np.flatnonzero(row == best[3])[0])
        row[pe], row[pf] = row[pf], row[pe]
    return row


def _with_rows(placement: Placement, rows: np.ndarray) -> Placement:
    import dataclasses

    return dataclasses.replace(placement, phy2log=np.asarray(rows, dtype=np.int64))


def joint_search(instance: Instance, placement: Placement, redundant_experts: int, *, seed: int = 0,
                 rounds: int = 1, deterministic_time: float = DETERMINISTIC_TIME_PER_LAYER,
                 ) -> tuple[Placement, ReplicaMap, SearchInfo, JointInfo]:
    """The replica search made joint with the permutation, by alternation on the priced step.

    Starts from :func:`search_replicas` on ``placement``.  Each round: (1) per layer
    :func:`swap_primaries` moves primary experts between EP ranks under the current replicas (the
    replica slots move with nothing; a layer's map stays valid); the evaluator prices the swapped
    permutation with the same replicas on the sampled window, each layer keeps the old or the
    swapped row by its priced time (as :func:`search_replicas` combines its candidates), and the
    combination is kept only if its whole priced step is lower.  (2) :func:`search_replicas` re-runs
    on the kept permutation; its map is kept only if the priced step is lower.  It stops after
    ``rounds`` rounds or a round that gains nothing.  So the returned pair never prices worse than
    :func:`search_replicas` alone on the sampled window, and the same input gives the same output
    (no clock: ``rounds`` is a count).

    The swaps keep the dispatcher's rules: the rank layout (``rank2gpu``, hence nodes and the
    DeepEP/HybridEP rule) does not change, every layer stays a permutation, and when every layer
    keeps the expert groups of group-limited routing whole, only experts of one group swap.

    Returns
    -------
    ``(placement, replica map, search info of the last accepted replica search, JointInfo)``.
    """
    from solvers.kernels.expert_groups import keeps_expert_groups

    m, par = instance.model, instance.parallel
    e_n, ep = m.num_experts, par.ep
    rmap, info = search_replicas(instance, placement, redundant_experts, seed=seed, deterministic_time=deterministic_time)
    best_step, best_layers = priced_step_s(instance, placement, rmap)
    joint = JointInfo(start_step_s=best_step, final_step_s=best_step)
    if redundant_experts == 0:
        return placement, rmap, info, joint
    label = None
    if m.num_groups > 1 and keeps_expert_groups(placement.phy2log, e_n // m.num_groups):
        label = np.arange(e_n) // (e_n // m.num_groups)
    loads = expert_loads(instance.routing.topk, e_n)
    epr, spr = e_n // ep, (e_n + redundant_experts) // ep
    swapped = np.zeros(m.num_moe_layers, dtype=bool)
    for rnd in range(max(0, int(rounds))):
        joint.rounds = rnd + 1
        base = np.asarray(placement.phy2log, dtype=np.int64)
        extra = rmap.phy2log.reshape(m.num_moe_layers, ep, spr)[:, :, epr:]
        rows = np.stack([swap_primaries(base[li], loads[li], ep, extra[li], label) for li in range(m.num_moe_layers)])
        entry: dict = {"round": rnd + 1, "swaps_step_s": None, "replicas_step_s": None}
        gained = False
        if not np.array_equal(rows, base):
            cand_p = _with_rows(placement, rows)
            cand_r = physical_map(rows, extra, ep)
            step, per_layer = priced_step_s(instance, cand_p, cand_r)
            pick = per_layer < best_layers  # per layer: the swapped row where it prices faster
            if pick.any() and not pick.all():
                rows = np.where(pick[:, None], rows, base)
                cand_p = _with_rows(placement, rows)
                cand_r = physical_map(rows, extra, ep)
                step, per_layer = priced_step_s(instance, cand_p, cand_r)
            if pick.any() and step < best_step:
                placement, rmap, best_step, best_layers = cand_p, cand_r, step, per_layer
                swapped |= np.any(rows != base, axis=1)
                entry["swaps_step_s"] = step
                info = _chosen_as(info, "joint_swaps")
                gained = True
        if gained:  # the replicas re-chosen for the new permutation
            r2, i2 = search_replicas(instance, placement, redundant_experts, seed=seed,
                                     deterministic_time=deterministic_time)
            step, per_layer = priced_step_s(instance, placement, r2)
            if step < best_step:
                rmap, info, best_step, best_layers = r2, i2, step, per_layer
                entry["replicas_step_s"] = step
        joint.history.append(entry)
        if not gained:
            break
    joint.final_step_s = best_step
    joint.swapped_layers = int(swapped.sum())
    return placement, rmap, info, joint


def _chosen_as(info: SearchInfo, chosen: str) -> SearchInfo:
    """``info`` with ``chosen`` naming the map's origin (the swaps kept the previous replicas)."""
    import dataclasses

    return dataclasses.replace(info, chosen=chosen, layer_source=[chosen] * len(info.layer_source))
