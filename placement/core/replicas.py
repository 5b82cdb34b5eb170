"""Redundant expert slots ("replicas") of hot experts: the data model and two simple replica rules.

A layer with ``E`` logical experts and ``N`` redundant slots has ``P = E + N`` physical slots,
``P / ep`` on every EP rank: physical slot ``p`` sits on EP rank ``p // (P / ep)``, as SGLang
(``python/sglang/srt/eplb/expert_location.py``, 0.5.23: ``num_physical_experts % ep_size == 0``)
and vLLM (``vllm/distributed/eplb/eplb_state.py``) lay them out.  The placement's permutation keeps
its meaning: EP rank ``r``'s first ``E / ep`` slots hold the experts ``Placement.phy2log`` gives it,
in that order, and its last ``N / ep`` slots hold the replicas.

Maps (the names say their direction, as DeepSeek's EPLB names them):

- ``phy2log`` (L, P): logical expert id of each physical slot.
- ``log2phy`` (L, E, R + 1): the physical slots of each logical expert in ascending order, padded
  with -1 (``R = N``, the most replicas one expert can have).
- ``logcnt`` (L, E): slots of each logical expert (1 + its replicas).
- ``token_share`` (L, P): the share of its logical expert's tokens each slot receives.

Token split (what :mod:`placement.consumers.replica_runtime` implements): static, by arrival order.  On each
source rank and micro-batch, the ``j``-th token routed to logical expert ``e`` (in token index
order) goes to replica ``j mod logcnt[e]``: every replica gets ``1 / logcnt[e]`` of ``e``'s tokens,
within one token per source and micro-batch, with no communication and no host synchronisation.
A least-loaded split per micro-batch (UltraEP, LLEP) needs the global counts first (one more
collective per layer) and is not built here.

Memory per extra slot: the slot is a full expert: weights, a gradient buffer and (in this
runtime, where a replica is an ordinary parameter) its own optimizer state, sharded over the
expert-data-parallel ranks by Megatron-Core's DistributedOptimizer
(:func:`extra_slot_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import numpy as np

from placement.core.model import InvalidInputError

__all__ = [
    "ReplicaMap",
    "ReplicaRule",
    "REPLICA_RULES",
    "DEFAULT_REPLICA_RULE",
    "check_redundant_experts",
    "check_rule_inputs",
    "physical_map",
    "hottest_on_busiest_rank",
    "eplb_replicate",
    "replicate_counts",
    "replicate",
    "expert_loads",
    "rank_loads",
    "load_max_over_mean",
    "extra_slot_bytes",
    "WEIGHT_BYTES_PER_PARAM",
    "GRAD_BYTES_PER_PARAM",
    "OPTIMIZER_BYTES_PER_PARAM",
]

ReplicaRule = Literal["search", "hottest", "eplb"]
REPLICA_RULES: tuple[ReplicaRule, ...] = ("search", "hottest", "eplb")
#: The rule ``placement solve --redundant-experts`` uses unless told otherwise
#: (``search``: :mod:`solvers.replica_search`, never worse than the two simple rules on the evaluator).
DEFAULT_REPLICA_RULE: ReplicaRule = "search"

WEIGHT_BYTES_PER_PARAM = 2  # BF16 weights
GRAD_BYTES_PER_PARAM = 4  # FP32 main_grad (Megatron-Core DDP's grad buffer)
OPTIMIZER_BYTES_PER_PARAM = 12  # FP32 master weight + Adam's two moments


def check_redundant_experts(num_experts: int, ep: int, redundant_experts: object) -> int:
    """``redundant_experts`` checked: an int ``N >= 0`` with ``(num_experts + N) % ep == 0``.

    Raises
    ------
    InvalidInputError
        One line naming ``redundant_experts`` (SGLang asserts the same divisibility).
    """
    n = redundant_experts
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise InvalidInputError(f"redundant_experts: expected a non-negative integer, found {n!r}")
    n = int(n)
    if (num_experts + n) % ep:
        raise InvalidInputError(
            f"redundant_experts: {num_experts} experts + {n} redundant slots = {num_experts + n} physical slots do "
            f"not divide over ep={ep} (SGLang's expert_location.py asserts num_physical_experts % ep_size == 0)"
        )
    if n > num_experts * 64:
        raise InvalidInputError(f"redundant_experts: {n} is more than 64 replicas per expert")
    return n


@dataclass(frozen=True)
class ReplicaMap:
    """Per MoE layer, the logical expert of each of ``P = E + N`` physical slots.

    ``phy2log``: (L, P) int64; ``num_experts``: ``E``; ``ep``: EP ranks (slot ``p`` on rank
    ``p // (P / ep)``).  Construct with :func:`physical_map` or check with :meth:`problems`.
    """

    phy2log: np.ndarray
    num_experts: int
    ep: int

    def __post_init__(self) -> None:
        a = np.array(self.phy2log, dtype=np.int64)
        a.setflags(write=False)
        object.__setattr__(self, "phy2log", a)

    @property
    def num_layers(self) -> int:
        return int(self.phy2log.shape[0])

    @property
    def num_physical(self) -> int:
        return int(self.phy2log.shape[1])

    @property
    def num_redundant(self) -> int:
        return self.num_physical - self.num_experts

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.ep

    @cached_property
    def logcnt(self) -> np.ndarray:
        """(L, E) slots of each logical expert."""
        out = np.zeros((self.num_layers, self.num_experts), dtype=np.int64)
        for li in range(self.num_layers):
            out[li] = np.bincount(self.phy2log[li], minlength=self.num_experts)[: self.num_experts]
        return out

    @cached_property
    def log2phy(self) -> np.ndarray:
        """(L, E, N + 1) physical slots of each logical expert, ascending, padded with -1."""
        out = np.full((self.num_layers, self.num_experts, self.num_redundant + 1), -1, dtype=np.int64)
        for li in range(self.num_layers):
            order = np.argsort(self.phy2log[li], kind="stable")  # slots grouped by expert, ascending
            experts = self.phy2log[li][order]
            starts = np.searchsorted(experts, np.arange(self.num_experts))
            out[li, experts, np.arange(self.num_physical) - starts[experts]] = order
        return out

    @cached_property
    def token_share(self) -> np.ndarray:
        """(L, P) share of its logical expert's tokens each physical slot receives (``1 / logcnt``)."""
        rows = np.arange(self.num_layers)[:, None]
        return 1.0 / self.logcnt[rows, self.phy2log]

    @property
    def slot2rank(self) -> np.ndarray:
        """(P,) EP rank of each physical slot."""
        return np.arange(self.num_physical) // self.slots_per_rank

    def problems(self, base_phy2log: np.ndarray | None = None) -> list[str]:
        """Every way this map breaks the rules, one line each (empty: valid).

        ``base_phy2log`` (L, E): the placement's permutation, which the first ``E / ep`` slots of
        every rank must repeat.
        """
        out: list[str] = []
        p2l, e, ep = self.phy2log, self.num_experts, self.ep
        if p2l.ndim != 2:
            return [f"replicas.phy2log: expected (layers, slots), found shape {p2l.shape}"]
        if ep < 1 or self.num_physical % ep:
            return [f"replicas.phy2log: {self.num_physical} slots do not divide over ep={ep}"]
        if self.num_physical < e:
            return [f"replicas.phy2log: {self.num_physical} slots, fewer than the {e} experts"]
        if p2l.size and (p2l.min() < 0 or p2l.max() >= e):
            return [f"replicas.phy2log: expert ids must lie in [0, {e})"]
        missing = np.argwhere(self.logcnt == 0)
        if len(missing):
            li, ex = (int(x) for x in missing[0])
            out.append(f"replicas.phy2log[{li}]: expert {ex} has no slot ({len(missing)} such (layer, expert) pairs)")
        spr, epr = self.slots_per_rank, e // ep if e % ep == 0 else 0
        by_rank = p2l.reshape(self.num_layers, ep, spr)
        for li in range(self.num_layers):
            for r in range(ep):
                held = by_rank[li, r]
                if len(set(held.tolist())) != spr:
                    out.append(f"replicas.phy2log[{li}]: EP rank {r} holds expert "
                               f"{int(np.argmax(np.bincount(held)))} twice (a replica must sit on another rank)")
                    break
        if base_phy2log is not None:
            base = np.asarray(base_phy2log, dtype=np.int64)
            if base.shape != (self.num_layers, e) or not epr:
                out.append(f"replicas.phy2log: shape {p2l.shape} does not extend the placement's phy2log {base.shape}")
            else:
                head = by_rank[:, :, :epr].reshape(self.num_layers, e)
                bad = np.argwhere(head != base)
                if len(bad):
                    li, p = (int(x) for x in bad[0])
                    out.append(
                        f"replicas.phy2log[{li}]: slot {(p // epr) * spr + p % epr} holds expert {int(head[li, p])}, "
                        f"but the placement's phy2log[{li}][{p}] is {int(base[li, p])} (each rank's first "
                        f"{epr} slots repeat the placement's map)"
                    )
        return out


def physical_map(base_phy2log: np.ndarray, extra: np.ndarray, ep: int) -> ReplicaMap:
    """The :class:`ReplicaMap` of a permutation plus the replicas each rank holds.

    Parameters
    ----------
    base_phy2log : (L, E) the placement's permutation.
    extra : (L, ep, N / ep) logical expert of each redundant slot of each EP rank.
    ep : EP ranks.
    """
    base = np.asarray(base_phy2log, dtype=np.int64)
    extra = np.asarray(extra, dtype=np.int64)
    num_layers, e = base.shape
    rows = np.concatenate([base.reshape(num_layers, ep, e // ep), extra.reshape(num_layers, ep, -1)], axis=2)
    return ReplicaMap(rows.reshape(num_layers, -1), e, ep)


# ---------------------------------------------------------------------------------------------
# Loads
# ---------------------------------------------------------------------------------------------
def expert_loads(topk: np.ndarray, num_experts: int) -> np.ndarray:
    """(L, E) tokens routed to each logical expert: ``topk`` (L, sources, tokens, k), every source."""
    t = np.asarray(topk)
    out = np.zeros((t.shape[0], num_experts), dtype=np.float64)
    for li in range(t.shape[0]):
        out[li] = np.bincount(t[li].reshape(-1), minlength=num_experts)[:num_experts]
    return out


def rank_loads(rmap: ReplicaMap, loads: np.ndarray) -> np.ndarray:
    """(L, ep) tokens per EP rank under the static split: slot ``p`` gets ``token_share[p]`` of its
    expert's ``loads`` (L, E)."""
    rows = np.arange(rmap.num_layers)[:, None]
    per_slot = np.asarray(loads, dtype=np.float64)[rows, rmap.phy2log] * rmap.token_share
    return per_slot.reshape(rmap.num_layers, rmap.ep, rmap.slots_per_rank).sum(axis=2)


def load_max_over_mean(rmap: ReplicaMap, loads: np.ndarray) -> float:
    """Mean over layers of the busiest EP rank's tokens over the mean rank's."""
    r = rank_loads(rmap, loads)
    mean = r.mean(axis=1)
    return float(np.mean(np.where(mean > 0, r.max(axis=1) / np.where(mean > 0, mean, 1.0), 1.0)))


# ---------------------------------------------------------------------------------------------
# Replica rules
# ---------------------------------------------------------------------------------------------
def check_rule_inputs(base: np.ndarray, loads: np.ndarray, ep: int, n: int) -> tuple[int, int]:
    """``(E, N / ep)`` after checking a replica rule's inputs: ``base`` (L, E), ``loads`` (L, E), ``n``
    redundant slots a multiple of ``ep`` that a rank can hold (one line naming the field otherwise)."""
    num_layers, e = base.shape
    check_redundant_experts(e, ep, n)
    if e % ep or n % ep:
        raise InvalidInputError(f"redundant_experts: {n} redundant slots must split evenly over ep={ep} "
                                f"beside {e} experts (a multiple of ep)")
    if (e + n) // ep > e:
        raise InvalidInputError(f"redundant_experts: {(e + n) // ep} slots per EP rank but only {e} experts "
                                "(a rank holds each expert at most once)")
    if loads.shape != (num_layers, e):
        raise InvalidInputError(f"loads: expected shape {(num_layers, e)}, found {loads.shape}")
    return e, n // ep


def hottest_on_busiest_rank(base_phy2log: np.ndarray, loads: np.ndarray, ep: int, redundant_experts: int,
                            rank2domain: np.ndarray | None = None) -> ReplicaMap:
    """This project's first replica rule: relieve the busiest EP rank, replicas inside its domain first.

    Per layer and per redundant slot: find the EP rank with the most tokens (under the static
    split); take its expert with the most tokens per slot whose extra replica fits on a rank with
    a free redundant slot without making that rank as busy as the busiest one, preferring ranks in
    the busiest rank's NVLink domain (``rank2domain`` (ep,), None: one domain) so the extra
    dispatch traffic stays on NVLink, then the lightest.  When no replica relieves the busiest
    rank (a load already balanced), the slot still has to hold an expert (every rank has ``N / ep``
    of them): the lightest open rank takes the expert that adds the fewest tokens to it.  Ties go
    to the lowest id (deterministic).

    Parameters
    ----------
    base_phy2log : (L, E) the placement's permutation.
    loads : (L, E) tokens per logical expert on the window the solver sees.
    ep : EP ranks; ``redundant_experts`` must be a multiple of it.
    rank2domain : (ep,) NVLink domain of each EP rank (of the stage's first EP group).
    """
    base = np.asarray(base_phy2log, dtype=np.int64)
    w = np.asarray(loads, dtype=np.float64)
    e, per_rank = check_rule_inputs(base, w, ep, redundant_experts)
    dom = np.zeros(ep, dtype=np.int64) if rank2domain is None else np.asarray(rank2domain, dtype=np.int64)
    epr = e // ep
    extra = np.zeros((base.shape[0], ep, per_rank), dtype=np.int64)
    for li in range(base.shape[0]):
        held = [set(base[li, r * epr:(r + 1) * epr].tolist()) for r in range(ep)]
        cnt = np.ones(e, dtype=np.int64)
        free = np.full(ep, per_rank, dtype=np.int64)
        for _ in range(redundant_experts):
            share = w[li] / cnt
            rank_load = np.array([sum(share[x] for x in held[r]) for r in range(ep)])
            busiest = int(np.argmax(rank_load))
            choice = None
            for x in sorted(held[busiest], key=lambda x: (-share[x], x)):
                added = w[li, x] / (cnt[x] + 1)
                targets = sorted((r for r in range(ep) if free[r] > 0 and x not in held[r]),
                                 key=lambda r: (dom[r] != dom[busiest], rank_load[r], r))
                r_ok = next((r for r in targets if rank_load[r] + added < rank_load[busiest]), None)
                if r_ok is not None:  # the replica lowers the busiest rank and makes no rank busier than it was
                    choice = (int(x), r_ok)
                    break
            if choice is None:  # nothing relieves the busiest rank: the lightest open rank takes the coldest
                r = min((r for r in range(ep) if free[r] > 0), key=lambda r: (rank_load[r], r))
                x = min((y for y in range(e) if y not in held[r]), key=lambda y: (w[li, y] / (cnt[y] + 1), y))
                choice = (int(x), r)
            x, r = choice
            extra[li, r, per_rank - free[r]] = x
            free[r] -= 1
            held[r].add(x)
            cnt[x] += 1
    return physical_map(base, extra, ep)


def replicate_counts(loads: np.ndarray, redundant_experts: int, max_count: int | None = None) -> np.ndarray:
    """(E,) slots per expert by EPLB's ``replicate_experts`` rule: ``N`` times, one more replica to
    the expert with the highest load per replica (lowest id on ties).  ``loads``: (E,);
    ``max_count``: at most this many slots per expert (one per EP rank; EPLB has no cap)."""
    w = np.asarray(loads, dtype=np.float64)
    cnt = np.ones(len(w), dtype=np.int64)
    cap = np.inf if max_count is None else max_count
    for _ in range(int(redundant_experts)):
        per = np.where(cnt < cap, w / cnt, -np.inf)
        cnt[int(np.argmax(per))] += 1
    return cnt


def eplb_replicate(base_phy2log: np.ndarray, loads: np.ndarray, ep: int, redundant_experts: int) -> ReplicaMap:
    """The peer: DeepSeek EPLB's rule (deepseek-ai/EPLB ``eplb.py``), written from its description.

    ``replicate_experts``: ``N`` times, give one more replica to the expert with the highest load per
    replica (capped here at one slot per EP rank: a second copy on one rank adds no capacity).  Then,
    as EPLB's ``balanced_packing`` packs physical experts heaviest first into the lightest GPU that
    still has room, the redundant slots (load ``w / cnt`` each) go, most-replicated expert first and
    then heaviest first, to the lightest EP rank with a free redundant slot that does not hold that
    expert (when every such rank holds it, one placed replica moves to make room).  EPLB also
    re-packs every expert; here the placement's permutation is kept, as the cross-rack search chose
    it, and only the redundant slots are packed.
    """
    base = np.asarray(base_phy2log, dtype=np.int64)
    w = np.asarray(loads, dtype=np.float64)
    e, per_rank = check_rule_inputs(base, w, ep, redundant_experts)
    epr = e // ep
    extra = np.zeros((base.shape[0], ep, per_rank), dtype=np.int64)
    for li in range(base.shape[0]):
        cnt = replicate_counts(w[li], redundant_experts, max_count=ep)
        held = [set(base[li, r * epr:(r + 1) * epr].tolist()) for r in range(ep)]
        share = w[li] / cnt
        rank_load = np.array([sum(share[x] for x in held[r]) for r in range(ep)])
        free = np.full(ep, per_rank, dtype=np.int64)
        # most-replicated experts first (they need the most distinct ranks), then heaviest first
        order = sorted(range(e), key=lambda x: (-int(cnt[x]), -share[x], x))
        todo = [x for x in order for _ in range(int(cnt[x]) - 1)]
        for x in todo:  # balanced packing of the redundant slots
            open_ranks = [r for r in range(ep) if free[r] > 0 and int(x) not in held[r]]
            if not open_ranks and _make_room(int(x), held, free, extra[li], per_rank, rank_load, share):
                open_ranks = [r for r in range(ep) if free[r] > 0 and int(x) not in held[r]]
            if not open_ranks:  # every open rank holds x already: give the slot to the heaviest expert that fits
                open_ranks = [r for r in range(ep) if free[r] > 0]
                x = next(y for y in np.argsort(-share, kind="stable") if any(int(y) not in held[r] for r in open_ranks))
                open_ranks = [r for r in open_ranks if int(x) not in held[r]]
            r = min(open_ranks, key=lambda r: (rank_load[r], r))
            extra[li, r, per_rank - free[r]] = int(x)
            free[r] -= 1
            held[r].add(int(x))
            rank_load[r] += share[x]
    return physical_map(base, extra, ep)


def _make_room(x: int, held: list[set[int]], free: np.ndarray, extra: np.ndarray, per_rank: int,
               rank_load: np.ndarray, share: np.ndarray) -> bool:
    """Move one placed replica ``y`` from a full rank ``q`` without ``x`` to an open rank that lacks
    ``y`` (which then holds ``x``), freeing a slot on ``q`` for ``x``; False when no such move exists."""
    ep = len(held)
    open_ranks = [r for r in range(ep) if free[r] > 0]
    for q in sorted(range(ep), key=lambda r: (rank_load[r], r)):
        if x in held[q] or free[q] > 0:
            continue
        for j in range(per_rank):
            y = int(extra[q, j])
            target = next((r for r in open_ranks if y not in held[r]), None)
            if target is None:
                continue
            extra[target, per_rank - free[target]] = y
            free[target] -= 1
            held[target].add(y)
            rank_load[target] += share[y]
            held[q].discard(y)
            rank_load[q] -= share[y]
            extra[q, j:-1] = extra[q, j + 1:].copy()  # keep q's placed replicas first, its free slot last
            free[q] += 1
            return True
    return False


def replicate(rule: ReplicaRule, base_phy2log: np.ndarray, loads: np.ndarray, ep: int, redundant_experts: int,
              rank2domain: np.ndarray | None = None) -> ReplicaMap:
    """Run one of :data:`REPLICA_RULES` (``hottest``: :func:`hottest_on_busiest_rank`; ``eplb``:
    :func:`eplb_replicate`)."""
    if rule == "hottest":
        return hottest_on_busiest_rank(base_phy2log, loads, ep, redundant_experts, rank2domain)
    if rule == "eplb":
        return eplb_replicate(base_phy2log, loads, ep, redundant_experts)
    if rule == "search":
        raise InvalidInputError("replica_rule: search prices whole placements and needs the instance "
                                "(solvers.replica_search.search_replicas); here only hottest or eplb")
    raise InvalidInputError(f"replica_rule: expected one of {', '.join(REPLICA_RULES)}, found {rule!r}")


def extra_slot_bytes(expert_params: int, expert_dp: int = 1, *, sharded_optimizer: bool = True) -> float:
    """Bytes one redundant slot costs on its GPU: BF16 weights (2 B/param), the FP32 gradient
    buffer (4 B/param) and the FP32 master weight plus Adam moments (12 B/param), the latter
    divided over the ``expert_dp`` expert-data-parallel ranks when the optimizer is sharded
    (Megatron-Core's DistributedOptimizer)."""
    if expert_params < 0 or expert_dp < 1:
        raise InvalidInputError(f"expert_params, expert_dp: expected >= 0 and >= 1, found {expert_params}, {expert_dp}")
    opt = OPTIMIZER_BYTES_PER_PARAM / (expert_dp if sharded_optimizer else 1)
    return float(expert_params * (WEIGHT_BYTES_PER_PARAM + GRAD_BYTES_PER_PARAM + opt))
