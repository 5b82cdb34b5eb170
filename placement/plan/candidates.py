"""Candidate parallel layouts of a job on a cluster state, and why the others are infeasible.

A candidate is ``(tp, cp, pp, vpp, ep, dp, micro_batch)`` and its stage layer split.  Constraints
(``docs/plan.md``):

- ``tp`` divides the attention heads (and the query groups of GQA) and ``seq_len`` (sequence
  parallel); ``2 * cp`` divides ``seq_len`` (load-balanced causal context parallel);
- ``ep`` divides the experts and the ``tp * cp * dp`` ranks of a stage (expert tensor parallel 1);
- ``dp * micro_batch`` divides the global batch (every replica runs whole micro-batches);
- ``pp <= num_layers`` and a stage split exists whose every stage's layer slots (layers, +1
  embedding on the first, +MTP +1 output on the last) are divisible by ``vpp``: the split
  minimises the slowest stage's compute, then the sum of squares of the stage times (the most even);
- ``tp * cp * dp * pp <= free GPUs`` (the rest stay idle);
- the memory estimate (:mod:`placement.plan.memory`) fits the GPU's HBM less the reserve;
- the routing source has at least one token per data-parallel source in each window.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import math
import re
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from placement.core.model import InvalidInputError
from placement.predict.performance import layer_flops_per_token

if TYPE_CHECKING:  # pragma: no cover
    from placement.formats.job import Job


__all__ = [
    "Candidate",
    "CandidateSpace",
    "DEFAULT_SPACE",
    "Enumeration",
    "parse_candidates",
    "stage_split",
    "enumerate_candidates",
]


@dataclass(frozen=True, order=True)
class Candidate:
    """One parallel layout: sizes, the micro-batch and the stage layer split."""

    tp: int
    cp: int
    pp: int
    vpp: int
    ep: int
    dp: int
    micro_batch: int
    stage_layers: tuple[tuple[int, ...], ...] = field(compare=False)

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def key(self) -> str:
        """``tp1 cp1 pp16 vpp1 ep64 dp64 mb1``: unique within a plan."""
        return f"tp{self.tp} cp{self.cp} pp{self.pp} vpp{self.vpp} ep{self.ep} dp{self.dp} mb{self.micro_batch}"

    def to_dict(self) -> dict:
        return {
            "tp": self.tp, "cp": self.cp, "pp": self.pp, "vpp": self.vpp, "ep": self.ep, "dp": self.dp,
            "micro_batch": self.micro_batch, "world": self.world,
            "stage_sizes": [len(s) for s in self.stage_layers],
        }


@dataclass(frozen=True)
class CandidateSpace:
    """The sizes to try; ``None`` = every value the constraints allow (see the module docstring)."""

    tp: tuple[int, ...] | None = (1,)  # tensor-parallel communication is not in the step-time model
    cp: tuple[int, ...] | None = (1,)
    pp: tuple[int, ...] | None = tuple(range(1, 33))
    vpp: tuple[int, ...] | None = (1, 2)
    ep: tuple[int, ...] | None = None
    dp: tuple[int, ...] | None = None
    micro_batch: tuple[int, ...] | None = None  # None: the job's micro-batch list


DEFAULT_SPACE = CandidateSpace()
_DIMS = ("tp", "cp", "pp", "vpp", "ep", "dp", "mb")


def parse_candidates(spec: str, base: CandidateSpace = DEFAULT_SPACE) -> CandidateSpace:
    """``"pp=8,16 ep=32,64"`` (space- or semicolon-separated ``name=v1,v2``) restricting ``base``.

    Names: ``tp cp pp vpp ep dp mb``; values positive integers.  Raises InvalidInputError naming
    the item.
    """
    values: dict[str, tuple[int, ...]] = {}
    for item in [x for x in re.split(r"[\s;]+", spec.strip()) if x]:
        name, sep, rest = item.partition("=")
        if not sep or name not in _DIMS:
            raise InvalidInputError(f"--candidates: {item!r}: expected NAME=V1,V2 with NAME one of {' '.join(_DIMS)}")
        if name in values:
            raise InvalidInputError(f"--candidates: {name} given twice")
        try:
            vals = tuple(sorted({int(v) for v in rest.split(",")}))
        except ValueError:
            raise InvalidInputError(f"--candidates: {item!r}: expected comma-separated positive integers") from None
        if not vals or vals[0] < 1 or vals[-1] > 2**20:
            raise InvalidInputError(f"--candidates: {item!r}: expected integers in [1, 2^20]")
        values[name] = vals
    kw = {("micro_batch" if k == "mb" else k): v for k, v in values.items()}
    return CandidateSpace(**{**base.__dict__, **kw})


# ---------------------------------------------------------------------------------------------
def _layer_costs(job: Job) -> tuple[np.ndarray, float]:
    """(num_layers,) compute of each layer per token (FLOPs), and the last stage's extra (MTP + heads)."""
    m = job.model
    arch = job.performance.architecture
    moe = set(m.moe_layers)
    seq = job.seq_len
    costs = np.array([sum(layer_flops_per_token(arch, m.hidden_size, seq, m.top_k, i in moe)) for i in range(m.num_layers)])
    last = sum(layer_flops_per_token(arch, m.hidden_size, seq, m.top_k, (m.num_layers - 1) in moe))
    h = m.hidden_size
    head = 3 * 2 * (arch.mtp_num_layers * (3 * h + 2 * h * h) + h * arch.vocab_size * (arch.mtp_num_layers + 1))
    return costs, float(arch.mtp_num_layers * last + head)


@lru_cache(maxsize=1024)
def _split_cached(job: Job, pp: int, vpp: int) -> tuple[tuple[int, ...], ...] | None:
    m = job.model
    L = m.num_layers
    if pp > L:
        return None
    mtp = job.performance.architecture.mtp_num_layers
    costs, extra = _layer_costs(job)
    prefix = np.concatenate([[0.0], np.cumsum(costs)])

    def ok(i: int, j: int, k: int) -> bool:  # stage k holds layers i..j-1
        slots = j - i + (1 if k == 0 else 0) + (mtp + 1 if k == pp - 1 else 0)
        return slots % vpp == 0

    def cost(i: int, j: int, k: int) -> float:
        return float(prefix[j] - prefix[i]) + (extra if k == pp - 1 else 0.0)

    inf = math.inf
    # Pass 1: the smallest achievable max stage cost.  best[k][j]: stages 0..k-1 cover layers 0..j-1.
    best = [[inf] * (L + 1) for _ in range(pp + 1)]
    best[0][0] = 0.0
    for k in range(pp):
        for j in range(k + 1, L - (pp - 1 - k) + 1):
            v = inf
            for i in range(k, j):
                if best[k][i] < inf and ok(i, j, k):
                    v = min(v, max(best[k][i], cost(i, j, k)))
            best[k + 1][j] = v
    cap = best[pp][L]
    if cap == inf:
        return None
    cap *= 1 + 1e-12
    # Pass 2: under that cap, the smallest sum of squared stage costs (the most even split).
    sq = [[inf] * (L + 1) for _ in range(pp + 1)]
    arg = [[-1] * (L + 1) for _ in range(pp + 1)]
    sq[0][0] = 0.0
    for k in range(pp):
        for j in range(k + 1, L - (pp - 1 - k) + 1):
            for i in range(k, j):
                if sq[k][i] == inf or not ok(i, j, k):
                    continue
                c = cost(i, j, k)
                if c > cap:
                    continue
                v = sq[k][i] + (c / cap) ** 2
                if v < sq[k + 1][j] * (1 - 1e-12):
                    sq[k + 1][j], arg[k + 1][j] = v, i
    bounds = [L]
    j = L
    for k in range(pp, 0, -1):
        j = arg[k][j]
        bounds.append(j)
    bounds.reverse()
    return tuple(tuple(range(a, b)) for a, b in zip(bounds[:-1], bounds[1:]))


def stage_split(job: Job, pp: int, vpp: int) -> tuple[tuple[int, ...], ...] | None:
    """The layer split over ``pp`` stages (see the module docstring), or None when none exists."""
    return _split_cached(job, pp, vpp)


# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Enumeration:
    """The feasible candidates and the counts of the others by reason."""

    feasible: tuple[Candidate, ...]
    enumerated: int
    infeasible: dict[str, int]  # reason -> count
    smallest_world: int | None  # smallest world of a candidate that passes every rule but memory and GPUs
    examples: dict[str, str]  # reason -> one candidate key that failed it
    min_memory_bytes: float | None = None  # the smallest estimate among the memory failures


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_candidates(job: Job, free_gpus: int, usable_bytes: float, space: CandidateSpace = DEFAULT_SPACE,
                         *, min_tokens: int | None = None) -> tuple[Enumeration, dict[str, object]]:
    """Every candidate of ``space`` with ``world <= free_gpus``, sorted by key, and their memory.

    Returns the :class:`Enumeration` and ``{candidate key: MemoryEstimate}`` of the feasible ones.
    ``min_tokens``: tokens per window of the routing source (fit and held-out, the smaller):
    ``dp`` above it is infeasible (a source needs a token).
    """
    from placement.plan.memory import memory_estimate
    from placement.plan.skeleton import stage_model

    m = job.model
    arch = job.performance.architecture
    seq, gb = job.seq_len, job.global_batch
    E = m.num_experts
    tps = space.tp or tuple(d for d in _divisors(arch.num_attention_heads) if d <= 64)
    cps = space.cp or tuple(d for d in _divisors(seq) if d <= 64)
    pps = space.pp or tuple(range(1, m.num_layers + 1))
    vpps = space.vpp or (1, 2, 4)
    overlap = job.performance.overlap == "1f1b"
    eps = space.ep or tuple(_divisors(E))
    mbs = space.micro_batch or job.micro_batches
    infeasible: dict[str, int] = {}
    examples: dict[str, str] = {}
    feasible: list[Candidate] = []
    memory: dict[str, object] = {}
    enumerated = 0
    smallest: int | None = None
    min_mem: float | None = None

    def no(reason: str, key: str) -> None:
        infeasible[reason] = infeasible.get(reason, 0) + 1
        examples.setdefault(reason, key)

    for mb in mbs:
        for tp in tps:
            for cp in cps:
                for pp in pps:
                    if tp * cp * pp > free_gpus:
                        continue
                    dps = space.dp or tuple(range(1, free_gpus // (tp * cp * pp) + 1))
                    for vpp in vpps:
                        split = stage_split(job, pp, vpp) if pp <= m.num_layers else None
                        for ep in eps:
                            for dp in dps:
                                world = tp * cp * dp * pp
                                if world > free_gpus:
                                    continue
                                enumerated += 1
                                key = f"tp{tp} cp{cp} pp{pp} vpp{vpp} ep{ep} dp{dp} mb{mb}"
                                if arch.num_attention_heads % tp or (arch.attention == "gqa" and arch.num_query_groups % tp):
                                    no("tp does not divide the attention heads (or query groups)", key)
                                elif seq % tp:
                                    no("tp does not divide seq_len (sequence parallel)", key)
                                elif seq % (2 * cp):
                                    no("2*cp does not divide seq_len", key)
                                elif E % ep:
                                    no("ep does not divide the experts", key)
                                elif (tp * cp * dp) % ep:
                                    no("ep does not divide tp*cp*dp", key)
                                elif gb % (dp * mb):
                                    no("dp*micro_batch does not divide the global batch", key)
                                elif pp > m.num_layers:
                                    no("pp exceeds the layers", key)
                                elif split is None:
                                    no("no stage split with layer slots divisible by vpp", key)
                                elif vpp > 1 and pp == 1:
                                    no("vpp > 1 needs pp > 1", key)
                                elif overlap and pp > 1 and vpp == 1:
                                    no("overlap 1f1b needs vpp > 1 when pp > 1 (Megatron-Core)", key)
                                elif overlap and ep == 1:
                                    no("overlap 1f1b needs ep > 1", key)
                                elif min_tokens is not None and dp > min_tokens:
                                    no("fewer routing tokens than data-parallel sources", key)
                                else:
                                    smallest = world if smallest is None else min(smallest, world)
                                    sm = stage_model(job, tp, cp, ep, pp, mb, split, vpp)
                                    est = memory_estimate(job, sm, tp=tp, cp=cp, ep=ep, dp=dp, pp=pp, vpp=vpp, micro_batch=mb)
                                    if est.total_bytes > usable_bytes:
                                        no("memory: estimate exceeds HBM less the reserve", key)
                                        min_mem = est.total_bytes if min_mem is None else min(min_mem, est.total_bytes)
                                        continue
                                    cand = Candidate(tp, cp, pp, vpp, ep, dp, mb, split)
                                    feasible.append(cand)
                                    memory[cand.key] = est
    feasible.sort(key=lambda c: c.key)
    return Enumeration(tuple(feasible), enumerated, dict(sorted(infeasible.items())), smallest,
                       dict(sorted(examples.items())), min_mem), memory
