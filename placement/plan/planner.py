"""``placement.plan(...)``: enumerate, bound, prune, solve best-bound first, rank.

Schedule (deterministic; ``docs/plan.md``):

1. Enumerate the candidates (:mod:`placement.plan.candidates`) with their memory.
2. Bound each: its compute-bound step (the step-time model with no all-to-all, no data-parallel
   traffic and each MoE layer at a lower bound of its expert load) gives an upper bound on job
   tokens/s (:func:`placement.plan.bounds.tokens_per_s_bound`).
3. Phase 1, cheap scores: the ``default`` layout of every candidate and the ``segment`` rule of
   those whose EP groups fit whole in racks, round robin over the (method, EP size) groups, each in
   bound order (then key), so that every EP size of both methods is scored early (the segment
   rule's best layouts leave GPUs idle and bound below the full-width ones); rounds of ``lanes``
   items through the executor; an item whose bound is below the best score so far is skipped
   (pruned).  At most :data:`PHASE1_SHARE` of the budget: the scores give the solves a pruning
   threshold, an order and the ``default`` peer rows.
4. Phase 2, solves: ``cpsat`` for every candidate and ``segment+cpsat`` for every segment rule,
   by promise (the phase-1 score of the same layout, best first; then bound order for what phase
   1 did not reach), except that the best-scored segment candidate goes first (the segment rule's
   reference is always solved); an item whose bound is below the best predicted job tokens/s so
   far is skipped (pruned).
5. Time: each solve gets ``min(MAX_SOLVE_S, remaining / min(items left, PLANNED_SOLVES))`` of the
   plan's budget (at least the smallest useful solve, ``b_min``), each cheap score a fixed cost
   from the routing's size; ``remaining`` is counted from these planned figures, never from the
   clock; what the budget does not reach is counted as ``unsolved_budget``.  The planned figures
   fit the time limit even if the items ran one after the other, so any number of workers
   finishes in time; the wall clock is checked before each round as a safety net: a round that
   would end past the limit is not started (``deadline_hit``).
6. Each solve's work is sized by its planned budget alone (:func:`placement.api.solver_budget_s`);
   its wall clock is held by a safety net :data:`SOLVE_WALL_FACTOR` times longer (within the plan's
   limit), so that a loaded machine does not cut the rank layout's or the expert maps' work.  The
   two nets are the only ways the machine's speed can change a plan, and the output says when
   either fired (``deadline_hit``; ``counts.wall_clock_cut`` and the row's ``wall_clock_cut``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from placement.api import STARTUP_RESERVE_S
from placement.core.model import InfeasibleError, InvalidInputError
from placement.plan.bounds import load_lower_bound, tokens_per_s_bound
from placement.plan.candidates import DEFAULT_SPACE, Candidate, CandidateSpace, enumerate_candidates
from placement.plan.evaluate import Task, TaskResult, Variant, build_instance, regroup
from placement.formats.job import ClusterSpec, Job

if TYPE_CHECKING:  # pragma: no cover - the executor (multiprocessing) is imported when a plan runs
    from placement.core.executor import Executor

__all__ = ["PlanRow", "PlanResult", "plan", "MAX_SOLVE_S", "PLANNED_SOLVES", "DEFAULT_PLAN_TIME_LIMIT_S"]

MAX_SOLVE_S = 60.0  # a dsv3_1024-sized cpsat solve gains nothing measurable past ~30 s (docs/plan.md)
PLANNED_SOLVES = 8  # the solve budget is shared as if at most this many items were left
PHASE1_SHARE = 0.1  # at most this share of the budget goes to the cheap scores
DEFAULT_PLAN_TIME_LIMIT_S = 600.0
SCORING_S_PER_ID = 1e-7  # as placement.api.SCORING_S_PER_EXPERT_ID
GENERATION_S_PER_ID = 4e-6  # routing generation, per expert id of both windows (20 s for dsv3's 5.7 M ids at load 12)
ENUMERATION_S_PER_CANDIDATE = 2e-4  # enumeration, memory and bounds (12 s for dsv3's 112 k at load 12)
MAX_LANES = 64
#: A candidate solve's wall-clock safety net, in multiples of its planned budget (which sizes its
#: work): the budgets already leave room for a machine twice slower than predicted
#: (``placement.api.LOAD_HEADROOM``); the net leaves this much more, so that the rank layout's and
#: the expert maps' wall-clock limits (shares of the net) are not reached on a loaded machine and
#: the plan does not depend on the load.  A solve the net cuts is flagged ``wall_clock_cut``.
SOLVE_WALL_FACTOR = 4.0


@dataclass(frozen=True)
class PlanRow:
    """One scored placement of one candidate."""

    key: str
    candidate: Candidate
    variant: str  # cpsat | default | segment | segment+cpsat
    figures: dict  # evaluate.summary(): sampled and heldout_ predictions, bytes, loads
    memory: dict  # MemoryEstimate.to_dict() plus headroom_bytes
    gpus_used: int
    gpus_idle: int
    bound_tokens_per_s: float
    time_limit_s: float
    details: dict = field(default_factory=dict)

    @property
    def job_tokens_per_s(self) -> float:
        """Predicted job tokens/s on the sampled window: what the plan ranks by."""
        return float(self.figures["predicted_job_tokens_per_s"])

    def to_dict(self) -> dict:
        return {
            "key": self.key,
            "candidate": self.candidate.to_dict(),
            "variant": self.variant,
            "gpus_used": self.gpus_used,
            "gpus_idle": self.gpus_idle,
            "bound_job_tokens_per_s": self.bound_tokens_per_s,
            "solve_time_limit_s": self.time_limit_s,
            "figures": self.figures,
            "memory": self.memory,
            "details": self.details,
        }


@dataclass(frozen=True)
class PlanResult:
    """What :func:`plan` returns: the ranked rows, the counts, the recommendation.

    ``rows`` are sorted by predicted job tokens/s (sampled window), best first; ``by_tokens_per_gpu``
    lists their indices sorted by tokens/s per GPU.  ``recommendation`` is ``rows[0]``;
    ``segment`` and ``default`` the best rows of those peers (None when none was solved).
    ``instance`` / ``solve_result`` of the recommendation are kept for writing its files.
    """

    job: str
    cluster: str
    free_gpus: int
    time_limit_s: float
    seed: int
    counts: dict  # enumerated, feasible, infeasible (by reason), pruned, solved, unsolved_budget
    rows: tuple[PlanRow, ...]
    by_tokens_per_gpu: tuple[int, ...]
    deadline_hit: bool
    infeasible_examples: dict = field(default_factory=dict)
    instance: Any = field(default=None, repr=False, compare=False)
    variant: Any = field(default=None, repr=False, compare=False)

    @property
    def recommendation(self) -> PlanRow:
        return self.rows[0]

    def best(self, variant: str) -> PlanRow | None:
        """The best row of one variant (``cpsat``, ``default``, ``segment``, ``segment+cpsat``)."""
        for row in self.rows:
            if row.variant == variant:
                return row
        return None

    @property
    def segment(self) -> PlanRow | None:
        """The rack-segment rule's best row (with contiguous or with cpsat's expert maps)."""
        for row in self.rows:
            if row.variant.startswith("segment"):
                return row
        return None


def _check(time_limit_s: float, seed: int, lanes: int) -> None:
    if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float)) or not (
        math.isfinite(time_limit_s) and time_limit_s > 0
    ):
        raise InvalidInputError(f"time_limit_s: expected a positive, finite number of seconds, found {time_limit_s!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= 2**31 - 1:
        raise InvalidInputError(f"seed: expected an integer in [0, 2^31 - 1], found {seed!r}")
    if isinstance(lanes, bool) or not isinstance(lanes, int) or not 1 <= lanes <= MAX_LANES:
        raise InvalidInputError(f"lanes: expected an integer in [1, {MAX_LANES}], found {lanes!r}")


def base_routing(job: Job) -> tuple[np.ndarray, np.ndarray, dict]:
    """The job's base routing ``(fit, heldout, provenance)``, each (L, S, T, k)."""
    src = job.routing
    if src.kind == "generator":
        from placement.sources.generator import generate_routing

        try:
            windows = generate_routing(**src.params)
        except (TypeError, ValueError) as exc:  # the generator's own range checks
            raise InvalidInputError(f"{job.name}: routing.generator: {exc}") from None
        prov = {"base": {"function": "placement.generator.generate_routing", **src.params,
                         "fit_tokens_per_source": src.fit_tokens, "heldout_tokens_per_source": src.heldout_tokens}}
        return windows[0][:, :, : src.fit_tokens], windows[1][:, :, : src.heldout_tokens], prov
    from placement.formats import read_instance

    inst = read_instance(src.path)
    assert inst.routing.heldout_topk is not None
    return inst.routing.topk, inst.routing.heldout_topk, {"base": {"instance": inst.name, "sha256": inst.sha256}}


def _segment_fits(cluster: Any, cand: Candidate) -> bool:
    free = cluster.available_gpus
    counts = np.bincount(cluster.gpu2domain[free], minlength=cluster.num_domains)
    return int(((counts // cand.ep) * cand.ep).sum()) >= cand.world


def _smallest_world(job: Job, space: CandidateSpace) -> int | None:
    """The smallest world of the space's divisibility-feasible layouts (ignores GPUs and memory)."""
    m = job.model
    arch = job.performance.architecture
    best: int | None = None
    for mb in space.micro_batch or job.micro_batches:
        for tp in space.tp or (1,):
            if arch.num_attention_heads % tp or job.seq_len % tp:
                continue
            for cp in space.cp or (1,):
                if job.seq_len % (2 * cp):
                    continue
                for ep in space.ep or tuple(d for d in range(1, m.num_experts + 1) if m.num_experts % d == 0):
                    if m.num_experts % ep:
                        continue
                    step = ep // math.gcd(ep, tp * cp)
                    dps = space.dp or tuple(range(step, job.global_batch // mb + 1, step))
                    for dp in dps:
                        if (tp * cp * dp) % ep or job.global_batch % (dp * mb):
                            continue
                        pp = min(space.pp or (1,))
                        w = tp * cp * dp * pp
                        best = w if best is None else min(best, w)
                        break
    return best


def plan(
    job: Job,
    cluster: ClusterSpec,
    *,
    candidates: CandidateSpace | None = None,
    time_limit_s: float = DEFAULT_PLAN_TIME_LIMIT_S,
    seed: int = 0,
    executor: Executor | None = None,
    lanes: int = 2,
    prune: bool = True,
    routing: tuple[np.ndarray, np.ndarray] | None = None,
    started_at: float | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> PlanResult:
    """Choose the job's parallel layout and placement for the cluster's free GPUs.

    Parameters
    ----------
    job, cluster : from :func:`placement.plan.read_job` / :func:`placement.plan.read_cluster`.
    candidates : the sizes to try (default :data:`~placement.plan.candidates.DEFAULT_SPACE`;
        :func:`~placement.plan.candidates.parse_candidates` reads ``"pp=8,16 ep=32,64"``).
    time_limit_s : the whole plan's wall budget, shared deterministically over the solves.
    seed : every solve's seed.
    executor : where the solves run (default: a :class:`~placement.core.executor.LocalExecutor` over
        the usable cores, closed at the end); the result does not depend on it.
    lanes : items per round (solved at once); part of the schedule, so of the result.
    prune : skip items whose bound is below the best so far (False: solve every item the budget
        allows; the tests check that pruning never changes the recommendation).
    routing : ``(fit, heldout)`` base routing arrays (L, S, T, k) instead of the job's source.
    started_at : ``time.monotonic()`` instant the budget started (default: now).
    on_progress : called with ``(work items settled, work items)`` as rounds end (an item is settled
        when scored, solved, pruned or left to the budget; a
        :data:`placement.core.progress.ProgressCallback`); it only observes, the plan does not depend on it.

    Raises
    ------
    InvalidInputError
        A bad argument.
    InfeasibleError
        No candidate fits: fewer free GPUs than the smallest layout, or the model fits no
        candidate's memory.
    """
    start = time.monotonic() if started_at is None else started_at
    _check(time_limit_s, seed, lanes)
    space = candidates or DEFAULT_SPACE
    if routing is None:
        fit, held, prov = base_routing(job)
    else:
        fit, held = routing
        prov = {"base": {"arrays": "given"}}
    L, S, T, k = fit.shape
    min_tokens = min(S * T, held.shape[1] * held.shape[2])
    cl = cluster.cluster
    free = cluster.free_gpus
    enum, memory = enumerate_candidates(job, free, cluster.usable_bytes_per_gpu, space, min_tokens=min_tokens)
    if not enum.feasible:
        if enum.smallest_world is None:
            small = _smallest_world(job, space)
            need = f" (the smallest layout needs {small})" if small is not None else ""
            raise InfeasibleError(f"{cluster.name}: {free} free GPUs are fewer than the smallest layout of the candidate set{need}")
        if enum.min_memory_bytes is not None:
            raise InfeasibleError(
                f"{job.name}: the model fits no candidate's memory: the smallest estimate is "
                f"{enum.min_memory_bytes / 1e9:.1f} GB per GPU, above {cluster.usable_bytes_per_gpu / 1e9:.1f} GB "
                f"(gpu_hbm_gb {cluster.gpu_hbm_gb:g} less hbm_reserve_gb {cluster.hbm_reserve_gb:g})"
            )
        raise InfeasibleError(f"{job.name}: no candidate layout is feasible: {', '.join(enum.infeasible)}")
    loads: dict[tuple[int, int], list[float]] = {}
    bounds: dict[str, float] = {}
    for c in enum.feasible:
        if (c.dp, c.ep) not in loads:
            loads[(c.dp, c.ep)] = load_lower_bound(regroup(fit, c.dp), job.model.num_experts, c.ep)
        bounds[c.key] = tokens_per_s_bound(job, c, loads[(c.dp, c.ep)])
    # Phase 1 items: the cheap scores (default layout; segment rule with contiguous experts), by bound.
    items1: list[tuple[Candidate, str]] = []
    for c in enum.feasible:
        items1.append((c, "default"))
        if _segment_fits(cl, c):
            items1.append((c, "segment"))
    items1 = _interleaved(items1, bounds)

    ids = L * (S * T + held.shape[1] * held.shape[2]) * k
    scoring_s = SCORING_S_PER_ID * ids
    b_min = 2.0 * (STARTUP_RESERVE_S + 2.0 * (0.5 + scoring_s)) + 1.0
    overhead_s = 3.0 * scoring_s + 0.5  # the solved answer's report, pickling
    eval_s = 0.5 + 4.0 * scoring_s  # building the instance and one report (phase 1)
    remaining = (time_limit_s - STARTUP_RESERVE_S - GENERATION_S_PER_ID * ids - ENUMERATION_S_PER_CANDIDATE * enum.enumerated
                 - 4.0 * scoring_s - 1.0)
    phase1_cap = remaining * PHASE1_SHARE
    own = executor is None
    if executor is None:
        from placement.core.executor import LocalExecutor

        executor = LocalExecutor()
    ex: Executor = executor
    results: list[tuple[Candidate, str, float, TaskResult]] = []
    best = -math.inf
    pruned = unsolved = 0
    deadline_hit = False
    n_items = 2 * len(items1)  # phase 2 has one solve per phase-1 item

    def settled() -> None:
        if on_progress is not None:
            on_progress(min(n_items, len(results) + pruned + unsolved), n_items)

    def budget_for(n_left: int) -> float | None:
        if remaining - overhead_s < b_min:
            return None
        share = min(MAX_SOLVE_S, remaining / max(1, min(n_left, PLANNED_SOLVES)))
        return min(max(share, b_min), remaining - overhead_s)

    def run_round(round_items: list[tuple[Candidate, str, float]], cost_s: float) -> bool:
        """Run one round; False (and nothing run) when it would end past the wall-clock limit."""
        nonlocal best
        now = time.monotonic()
        if now + max(b for _, _, b in round_items) + cost_s > start + time_limit_s:
            return False
        # Each solve's work is sized by its planned budget b; its wall clock only by a safety net
        # SOLVE_WALL_FACTOR times longer (within the plan's limit), which a normal run never reaches.
        net_s = start + time_limit_s - now - cost_s
        tasks = [Task(job, cl, c, m, b, seed, fit, held, prov,  # type: ignore[arg-type]
                      wall_limit_s=max(b, min(SOLVE_WALL_FACTOR * b, net_s)) if b > 0 else None)
                 for c, m, b in round_items]
        for (c, m, b), res in zip(round_items, ex.map(_run, tasks)):
            results.append((c, m, b, res))
            for v in res.variants:
                best = max(best, float(v.figures["predicted_job_tokens_per_s"]))
        settled()
        return True

    scored: dict[tuple[str, str], float] = {}  # (key, phase-1 method) -> predicted job tokens/s
    try:
        # Phase 1: round robin over (method, EP size), each in bound order; an item whose bound is
        # below the best score so far is skipped (it cannot win).
        i = 0
        while i < len(items1) and not deadline_hit:
            round_items: list[tuple[Candidate, str, float]] = []
            while i < len(items1) and len(round_items) < lanes:
                cand, method = items1[i]
                if prune and bounds[cand.key] < best:
                    pruned += 1
                    i += 1
                    continue
                if phase1_cap < eval_s or remaining < eval_s:
                    unsolved += len(items1) - i
                    i = len(items1)
                    break
                phase1_cap -= eval_s
                remaining -= eval_s
                round_items.append((cand, method, 0.0))
                i += 1
            if round_items and not run_round(round_items, eval_s):
                deadline_hit = True
                unsolved += len(items1) - i + len(round_items)
                break
        for c, m, _, res in results:
            for v in res.variants:
                scored[(c.key, m)] = float(v.figures["predicted_job_tokens_per_s"])
        # Phase 2: the solves, best bound first, each skipped when its bound is below the best so
        # far; the best-bound segment candidate's solve goes first.
        # Solves by promise: the phase-1 score of the candidate's layout (best first), then bound order
        # for the candidates phase 1 did not reach; the best-scored segment candidate's solve goes first.
        by_bound = sorted(items1, key=lambda it: (-bounds[it[0].key], it[0].key, it[1]))
        items2 = [(c, "cpsat" if m == "default" else "segment+cpsat") for c, m in by_bound]
        items2.sort(key=lambda it: (-scored.get((it[0].key, "default" if it[1] == "cpsat" else "segment"), -math.inf),))
        first_segment = next((j for j, it in enumerate(items2) if it[1] == "segment+cpsat"), None)
        if first_segment is not None:
            items2.insert(0, items2.pop(first_segment))
        i = 0
        while i < len(items2) and not deadline_hit:
            round_items = []
            stop = False
            while i < len(items2) and len(round_items) < lanes:
                cand, method = items2[i]
                if prune and bounds[cand.key] < best and not (i == 0 and first_segment is not None):
                    pruned += 1
                    i += 1
                    continue
                b = budget_for(len(items2) - i)
                if b is None:
                    unsolved += len(items2) - i
                    i = len(items2)
                    stop = True
                    break
                remaining -= b + overhead_s
                round_items.append((cand, method, b))
                i += 1
            if round_items and not run_round(round_items, overhead_s):
                deadline_hit = True  # the machine is slower than planned: stop with the best so far
                unsolved += len(items2) - i + len(round_items)
                break
            if stop:
                break
    finally:
        if own:
            ex.close()
    settled()
    items = items1 + items2

    rows: list[PlanRow] = []
    variants: dict[tuple[str, str], Variant] = {}
    for c, m, b, res in results:
        est = memory[c.key]
        mem = {**est.to_dict(), "headroom_bytes": cluster.usable_bytes_per_gpu - est.total_bytes}  # type: ignore[attr-defined]
        for v in res.variants:
            details = dict(v.details)
            if m == "segment+cpsat" and first_segment is not None and (c, m) == items2[0]:
                details["segment_reference"] = True
            rows.append(PlanRow(c.key, c, v.name, v.figures, mem, c.world, free - c.world, bounds[c.key], b, details))
            variants[(c.key, v.name)] = v
    order = {"cpsat": 0, "segment+cpsat": 1, "default": 2, "segment": 3}
    rows.sort(key=lambda r: (-r.job_tokens_per_s, r.key, order.get(r.variant, 9)))
    if not rows:
        raise InfeasibleError(f"{job.name}: the time limit of {time_limit_s:g} s leaves no time to solve a candidate (each needs {b_min:.0f} s)")
    per_gpu = sorted(range(len(rows)), key=lambda j: (-rows[j].figures["predicted_tokens_per_s_per_gpu"], j))
    n_scored = sum(1 for r in results if r[1] in ("default", "segment") and r[3].variants)
    n_solved = sum(1 for r in results if r[1] in ("cpsat", "segment+cpsat") and r[3].variants)
    counts = {
        "enumerated": enum.enumerated,
        "feasible": len(enum.feasible),
        "infeasible": sum(enum.infeasible.values()),
        "infeasible_by_reason": enum.infeasible,
        "work_items": len(items),
        "scored": n_scored,
        "solved": n_solved,
        "pruned": pruned,
        "not_applicable": sum(1 for r in results if not r[3].variants),
        "unsolved_budget": unsolved,
        # solves whose wall-clock safety net ended some work (0 in a normal run; else the plan may
        # depend on the machine's load)
        "wall_clock_cut": sum(1 for r in results for v in r[3].variants if v.details.get("wall_clock_cut")),
    }
    top = rows[0]
    inst = build_instance(job, cl, top.candidate, fit, held, prov)
    return PlanResult(
        job=job.name, cluster=cluster.name, free_gpus=free, time_limit_s=float(time_limit_s), seed=seed,
        counts=counts, rows=tuple(rows), by_tokens_per_gpu=tuple(per_gpu), deadline_hit=deadline_hit,
        infeasible_examples=enum.examples, instance=inst, variant=variants[(top.key, top.variant)],
    )


def _interleaved(items: list[tuple[Candidate, str]], bounds: dict[str, float]) -> list[tuple[Candidate, str]]:
    """Phase-1 order: round robin over the (method, EP size) groups, best bound first inside each
    and groups ordered by their best bound, so that the cheap scores reach every EP size and both
    methods (the segment rule's best layouts often leave GPUs idle and bound below the full-width
    ones) before the budget runs out.  Deterministic."""
    groups: dict[tuple[str, int], list[tuple[Candidate, str]]] = {}
    for it in sorted(items, key=lambda it: (-bounds[it[0].key], it[0].key, it[1])):
        groups.setdefault((it[1], it[0].ep), []).append(it)
    queues = list(groups.values())  # in order of each group's best bound (dicts keep insertion order)
    out: list[tuple[Candidate, str]] = []
    depth = 0
    while len(out) < len(items):
        out.extend(q[depth] for q in queues if depth < len(q))
        depth += 1
    return out


def _run(task: Task) -> TaskResult:
    from placement.plan.evaluate import run_task

    return run_task(task)

