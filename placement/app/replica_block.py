"""The replica step of a solve: the ``replicas`` block of a placement file, chosen and priced.

:func:`replicas_block` chooses ``N`` redundant expert slots per MoE layer for a solved permutation
(``search``: :mod:`solvers.replica_search`; ``hottest`` or ``eplb``: :mod:`placement.core.replicas`)
and prices them with the one evaluator (:func:`priced_figures`); the block's format is
:mod:`placement.formats.replicas`.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np

from placement.core.model import Instance, InvalidInputError, Placement
from placement.core.replicas import ReplicaMap, check_redundant_experts, expert_loads
from placement.formats.replicas import replica_metrics, replicas_document

__all__ = ["replicas_block", "priced_figures", "PRICED_KEYS", "AUTO", "choose_redundant_experts", "check_memory_budget"]


AUTO = "auto"
AUTO_SLOTS_PER_GPU = (0, 1, 2)  # the counts ``redundant_experts="auto"`` prices: N = 0, EP, 2 x EP


def _rule_map(instance: Instance, placement: Placement, n: int, rule: str, seed: int) -> tuple[ReplicaMap, dict | None]:
    """``rule``'s map with ``n`` redundant slots per MoE layer and, for ``search``, what it found."""
    from placement.core.replicas import ReplicaRule, replicate

    m, par, cl = instance.model, instance.parallel, instance.cluster
    if rule == "search":
        from solvers.replica_search import search_replicas

        rmap, info = search_replicas(instance, placement, n, seed=seed)
        return rmap, info.to_dict()
    loads = expert_loads(instance.routing.topk, m.num_experts)
    stage = np.asarray(instance.moe_layer2stage)
    base = np.asarray(placement.phy2log, dtype=np.int64)
    rows = np.zeros((m.num_moe_layers, m.num_experts + n), dtype=np.int64)
    r2g = np.asarray(placement.rank2gpu, dtype=np.int64)
    for s in np.unique(stage):
        layers = np.flatnonzero(stage == s)
        rank2domain = cl.gpu2domain[r2g[par.stage_ep_groups[int(s)][0]]]
        rows[layers] = replicate(cast(ReplicaRule, rule), base[layers], loads[layers], par.ep, n, rank2domain).phy2log
    return ReplicaMap(rows, m.num_experts, par.ep), None


def check_memory_budget(budget_bytes: object, instance: Instance | None = None,
                        redundant_experts: object = AUTO) -> float | None:
    """``replica_memory_budget_bytes`` checked: None or a non-negative, finite number (one-line error).

    With ``instance`` and a fixed count ``redundant_experts``, also refuse the count when its
    redundant slots take more bytes per GPU than the budget (``auto`` skips such counts instead).
    """
    import math

    b = budget_bytes
    if b is None:
        return None
    if isinstance(b, bool) or not isinstance(b, (int, float, np.integer, np.floating)) or not (math.isfinite(b) and b >= 0):
        raise InvalidInputError(f"replica_memory_budget_bytes: expected a non-negative, finite number of bytes, found {b!r}")
    n = redundant_experts
    if instance is not None and isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n > 0:
        from placement.predict.replica_cost import expert_params_or_none, memory_bytes_per_gpu_for_count

        mem = memory_bytes_per_gpu_for_count(instance, int(n), expert_params_or_none(instance))
        if math.isnan(mem) or mem > b:
            why = "the expert size is unknown" if math.isnan(mem) else f"they take {mem:.6g} bytes per GPU"
            raise InvalidInputError(f"redundant_experts: {n} redundant slots do not fit replica_memory_budget_bytes="
                                    f"{b:.6g} ({why})")
    return float(b)


def choose_redundant_experts(instance: Instance, placement: Placement, rule: str = "search", *, seed: int = 0,
                             memory_budget_bytes: float | None = None) -> tuple[int, ReplicaMap, dict | None, dict]:
    """``redundant_experts="auto"``: the count among ``N = 0, ep, 2 x ep`` whose map predicts the fastest step.

    Each count the memory budget allows (``memory_budget_bytes`` per GPU for the redundant slots,
    :func:`placement.predict.replica_cost.memory_bytes_per_gpu_for_count`; None: no budget, as the instance
    carries no HBM size) gets ``rule``'s map, which the one evaluator prices on the sampled window
    (:func:`solvers.replica_search.priced_step_s`, as the replica search chooses among its
    candidates); the lowest priced step wins, the smaller count on ties, so ``N = 0`` when no
    replica pays.  A count ``E + N`` does not divide over ``ep``, or any ``N > 0`` at ``ep = 1``
    (a replica must sit on another rank), is skipped with the reason.

    Returns
    -------
    ``(N, map, search info or None, record)``; ``record``: ``chosen_redundant_experts``, ``window``
    and per candidate ``redundant_experts``, ``memory_bytes_per_gpu`` (None when the expert size is
    unknown), and ``sampled_step_s`` (what the choice reads) and ``heldout_step_s`` (the same price
    on the held-out window, scored only, when the instance has one), or ``skipped`` (why).

    Raises
    ------
    InvalidInputError
        ``memory_budget_bytes`` not a non-negative finite number.
    """
    import math

    from placement.predict.replica_cost import expert_params_or_none, memory_bytes_per_gpu_for_count
    from solvers.replica_search import priced_step_s

    b = check_memory_budget(memory_budget_bytes)
    m, ep = instance.model, instance.parallel.ep
    params = expert_params_or_none(instance)
    candidates: list[dict[str, Any]] = []
    best: tuple[float, int, ReplicaMap, dict | None] | None = None
    for per_gpu in AUTO_SLOTS_PER_GPU:
        n = per_gpu * ep
        mem = memory_bytes_per_gpu_for_count(instance, n, params)
        row: dict[str, Any] = {"redundant_experts": n, "memory_bytes_per_gpu": None if math.isnan(mem) else mem}
        candidates.append(row)
        if n and ep == 1:
            row["skipped"] = "ep = 1: a replica must sit on another EP rank"
            continue
        if (m.num_experts + n) % ep:
            row["skipped"] = f"{m.num_experts} experts + {n} slots do not divide over ep={ep}"
            continue
        if b is not None and n and (math.isnan(mem) or mem > b):
            row["skipped"] = ("the expert size is unknown, so the memory budget cannot be checked" if math.isnan(mem)
                              else f"{mem:.6g} bytes per GPU exceed the budget of {b:.6g}")
            continue
        rmap, info = _rule_map(instance, placement, n, rule, seed)
        step = priced_step_s(instance, placement, rmap)[0]
        row["sampled_step_s"] = step
        if instance.routing.heldout_topk is not None:  # scored only: the choice reads the sampled window
            row["heldout_step_s"] = priced_step_s(instance, placement, rmap, window="heldout")[0]
        if best is None or step < best[0]:  # counts ascend: ties keep the smaller
            best = (step, n, rmap, info)
    assert best is not None  # N = 0 is never skipped
    record = {"chosen_redundant_experts": best[1], "window": "sampled", "candidates": candidates}
    return best[1], best[2], best[3], record


def replicas_block(instance: Instance, placement: Placement, redundant_experts: int | str, rule: str = "search",
                   *, seed: int = 0, memory_budget_bytes: float | None = None) -> dict:
    """The ``replicas`` block for ``placement``: ``redundant_experts`` slots per MoE layer chosen by
    ``rule`` on the sampled window (the held-out window is only scored), per pipeline stage with the
    NVLink domains of the stage's first EP group; ``search`` (:mod:`solvers.replica_search`) also
    records what it found under ``search``.  ``priced`` holds the evaluator's figures with the
    replicas (:func:`priced_figures`).  ``redundant_experts="auto"``: the count is chosen by
    :func:`choose_redundant_experts` (within ``memory_budget_bytes`` per GPU) and recorded under
    ``search.auto``, the priced sampled step of every candidate count beside the chosen one (the
    block then may have ``num_redundant_experts = 0``: the permutation alone).

    Raises
    ------
    InvalidInputError
        ``redundant_experts`` that ``E + N`` and ``ep`` do not allow, or an unknown rule.
    """
    from placement.core.replicas import REPLICA_RULES

    if placement.pipeline_layout:  # score with the layout the placement runs (as placement.predict.cost.report does)
        from placement.core.pipeline_layout import with_layout

        instance = with_layout(instance, placement.pipeline_layout)
    m, par = instance.model, instance.parallel
    auto = isinstance(redundant_experts, str) and redundant_experts == AUTO
    n = 0 if auto else check_redundant_experts(m.num_experts, par.ep, redundant_experts)
    if rule not in REPLICA_RULES:
        raise InvalidInputError(f"replica_rule: expected one of {', '.join(REPLICA_RULES)}, found {rule!r}")
    record = None
    if auto:
        n, rmap, search, record = choose_redundant_experts(instance, placement, rule, seed=seed,
                                                           memory_budget_bytes=memory_budget_bytes)
    else:
        rmap, search = _rule_map(instance, placement, n, rule, seed)
    try:
        from placement.core.movecount import expert_params

        params: int | None = expert_params(instance)
    except InvalidInputError:
        params = None
    doc = replicas_document(rmap, rule, replica_metrics(instance, rmap, params))
    if record is not None:
        search = {**(search or {}), "auto": record}
    if search is not None:
        doc["search"] = search
    doc["priced"] = priced_figures(instance, placement, rmap)
    return doc


PRICED_KEYS = ("predicted_tflops_per_gpu_low", "predicted_tflops_per_gpu_mid", "predicted_tflops_per_gpu_high",
               "cross_domain_bytes_per_step", "expert_load_lasting_max_over_mean", "replica_memory_bytes_per_gpu",
               "replica_grad_nvlink_bytes_per_step", "replica_grad_nic_bytes_per_step")


def priced_figures(instance: Instance, placement: Placement, rmap: ReplicaMap) -> dict[str, float]:
    """The evaluator's figures with ``rmap`` (:func:`placement.predict.cost.report` with ``replicas=``), sampled
    and held out (``heldout_`` prefix): TFLOP/s per GPU at each setting (with a performance block),
    cross-domain bytes, the lasting load, memory and gradient-sum bytes of the replicas."""
    from placement.predict.report import report
    from placement.predict.replica_cost import expert_params_or_none

    rep = report(instance, placement, replicas=rmap)
    out = {f"{pre}{k}": float(rep[f"{pre}{k}"]) for pre in ("", "heldout_") for k in PRICED_KEYS if f"{pre}{k}" in rep}
    if expert_params_or_none(instance) is None:  # the expert size, hence memory and gradient bytes, unknown
        out = {k: v for k, v in out.items() if "replica_" not in k}
    return out
