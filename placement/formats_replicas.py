"""The placement file's optional ``replicas`` block: redundant expert slots (:mod:`placement.replicas`).

::

    "replicas": {
      "num_redundant_experts": 64,          # N extra slots per MoE layer (SGLang's --ep-num-redundant-experts)
      "rule": "hottest",                    # how the replicas were chosen (placement.replicas.REPLICA_RULES)
      "token_split": "arrival_round_robin", # the j-th token of expert e on a source goes to replica j mod logcnt[e]
      "phy2log": [[...], ...],              # (MoE layers, E + N): slot p on EP rank p // ((E + N) / ep)
      "metrics": {...}                      # optional: rank-load max/mean, bytes per extra slot
    }

Each EP rank's first ``E / ep`` slots repeat the placement's ``phy2log`` (the permutation keeps its
meaning for every consumer that does not read replicas); its last ``N / ep`` slots are replicas.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np

from placement.model import Instance, InvalidInputError, Placement
from placement.replicas import REPLICA_RULES, ReplicaMap, check_redundant_experts, expert_loads, load_max_over_mean
from placement.schema import Any_, Int, List, Obj, Str, validate

__all__ = [
    "REPLICAS_SPEC",
    "TOKEN_SPLITS",
    "replicas_document",
    "replica_map_from_document",
    "replica_metrics",
    "replica_violations",
    "replicas_block",
    "priced_figures",
    "PRICED_KEYS",
    "AUTO",
    "choose_redundant_experts",
    "check_memory_budget",
]

TOKEN_SPLITS = ("arrival_round_robin",)
MAX_SLOTS = 2**40

REPLICAS_SPEC = Obj(
    "Redundant expert slots: per MoE layer the logical expert of each of num_experts + num_redundant_experts "
    "physical slots; each EP rank's first num_experts/ep slots repeat phy2log, its last num_redundant_experts/ep "
    "slots are replicas.",
    {
        "num_redundant_experts": Int("Extra expert slots per MoE layer (SGLang --ep-num-redundant-experts).", 0,
                                     MAX_SLOTS),
        "rule": Str("How the replicas were chosen.", REPLICA_RULES),
        "token_split": Str("How an expert's tokens are split among its slots: the j-th token routed to expert e on "
                           "a source rank goes to slot j mod logcnt[e] (placement.replica_runtime).", TOKEN_SPLITS),
        "phy2log": List(
            "Per MoE layer, the logical expert of each physical slot; slot p on EP rank p // ((E + N) / ep).",
            List("One layer's map.", Int("Expert id.", 0, MAX_SLOTS)),
        ),
        "metrics": Any_("Rank-load max/mean on the sampled and held-out windows, bytes per extra slot."),
        "search": Any_("What the search rule found (placement.replica_search.SearchInfo): which candidate each "
                       "layer took, the rank-load lower bound, the sampled step seconds of each candidate."),
        "priced": Any_("The evaluator's figures with these replicas (placement.cost.report(..., replicas=)): "
                       "predicted TFLOP/s per GPU, memory per GPU, the replicas' gradient sum."),
    },
    optional=frozenset({"metrics", "search", "priced"}),
)


def replica_metrics(instance: Instance, rmap: ReplicaMap, expert_params: int | None = None) -> dict[str, Any]:
    """Mean over MoE layers of the busiest EP rank's tokens over the mean, sampled and held out, with
    these replicas (``*_with_replicas``) and without (the permutation alone)."""
    from placement.replicas import physical_map

    m, par = instance.model, instance.parallel
    none = physical_map(rmap.phy2log.reshape(rmap.num_layers, par.ep, -1)[:, :, : m.num_experts // par.ep]
                        .reshape(rmap.num_layers, m.num_experts), np.zeros((rmap.num_layers, par.ep, 0)), par.ep)
    out: dict[str, Any] = {}
    windows = [("sampled", instance.routing.topk), ("heldout", instance.routing.heldout_topk)]
    for name, topk in windows:
        if topk is None:
            continue
        loads = expert_loads(topk, m.num_experts)
        out[f"{name}_rank_load_max_over_mean"] = load_max_over_mean(none, loads)
        out[f"{name}_rank_load_max_over_mean_with_replicas"] = load_max_over_mean(rmap, loads)
    if expert_params is not None:
        from placement.replicas import extra_slot_bytes

        out["bytes_per_extra_slot"] = extra_slot_bytes(expert_params, par.ep_groups_per_stage)
        out["extra_slots_per_gpu"] = rmap.num_redundant // par.ep
    return out


def replicas_document(rmap: ReplicaMap, rule: str, metrics: dict | None = None) -> dict[str, Any]:
    """The ``replicas`` block of a placement document."""
    doc: dict[str, Any] = {
        "num_redundant_experts": rmap.num_redundant,
        "rule": rule,
        "token_split": TOKEN_SPLITS[0],
        "phy2log": [[int(x) for x in row] for row in rmap.phy2log],
    }
    if metrics:
        doc["metrics"] = metrics
    return doc


def replica_map_from_document(block: dict, num_experts: int, ep: int, where: str = "placement") -> ReplicaMap:
    """The :class:`ReplicaMap` of a ``replicas`` block (structure checked; rules: :func:`replica_violations`).

    Raises
    ------
    InvalidInputError
        One line naming ``replicas.<field>``.
    """
    validate(block, REPLICAS_SPEC, where, "replicas")
    n = block["num_redundant_experts"]
    try:
        check_redundant_experts(num_experts, ep, n)
    except InvalidInputError as exc:
        raise InvalidInputError(f"{where}: replicas.{exc}") from None
    rows = block["phy2log"]
    width = num_experts + n
    bad = next((i for i, r in enumerate(rows) if len(r) != width), None)
    if bad is not None:
        raise InvalidInputError(f"{where}: replicas.phy2log[{bad}]: expected {width} slots (num_experts + "
                                f"num_redundant_experts), found {len(rows[bad])}")
    return ReplicaMap(np.array(rows, dtype=np.int64).reshape(len(rows), width), num_experts, ep)


def replica_violations(instance: Instance, placement: Placement, doc: dict) -> list[str]:
    """Every rule the document's ``replicas`` block breaks (empty when it has none or it is valid)."""
    block = doc.get("replicas")
    if block is None:
        return []
    m, ep = instance.model, instance.parallel.ep
    try:
        rmap = replica_map_from_document(block, m.num_experts, ep, "")
    except InvalidInputError as exc:
        return [str(exc).lstrip(": ")]
    if rmap.num_layers != m.num_moe_layers:
        return [f"replicas.phy2log: {rmap.num_layers} layers, the model has {m.num_moe_layers} MoE layers"]
    return [v if v.startswith("replicas.") else f"replicas: {v}" for v in rmap.problems(placement.phy2log)]


AUTO = "auto"
AUTO_SLOTS_PER_GPU = (0, 1, 2)  # the counts ``redundant_experts="auto"`` prices: N = 0, EP, 2 x EP


def _rule_map(instance: Instance, placement: Placement, n: int, rule: str, seed: int) -> tuple[ReplicaMap, dict | None]:
    """``rule``'s map with ``n`` redundant slots per MoE layer and, for ``search``, what it found."""
    from placement.replicas import ReplicaRule, replicate

    m, par, cl = instance.model, instance.parallel, instance.cluster
    if rule == "search":
        from placement.replica_search import search_replicas

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
        from placement.replica_cost import expert_params_or_none, memory_bytes_per_gpu_for_count

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
    :func:`placement.replica_cost.memory_bytes_per_gpu_for_count`; None: no budget, as the instance
    carries no HBM size) gets ``rule``'s map, which the one evaluator prices on the sampled window
    (:func:`placement.replica_search.priced_step_s`, as the replica search chooses among its
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

    from placement.replica_cost import expert_params_or_none, memory_bytes_per_gpu_for_count
    from placement.replica_search import priced_step_s

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
    NVLink domains of the stage's first EP group; ``search`` (:mod:`placement.replica_search`) also
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
    from placement.replicas import REPLICA_RULES

    if placement.pipeline_layout:  # score with the layout the placement runs (as placement.cost.report does)
        from placement.pipeline_layout import with_layout

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
        from placement.movecount import expert_params

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
    """The evaluator's figures with ``rmap`` (:func:`placement.cost.report` with ``replicas=``), sampled
    and held out (``heldout_`` prefix): TFLOP/s per GPU at each setting (with a performance block),
    cross-domain bytes, the lasting load, memory and gradient-sum bytes of the replicas."""
    from placement.cost import report
    from placement.replica_cost import expert_params_or_none

    rep = report(instance, placement, replicas=rmap)
    out = {f"{pre}{k}": float(rep[f"{pre}{k}"]) for pre in ("", "heldout_") for k in PRICED_KEYS if f"{pre}{k}" in rep}
    if expert_params_or_none(instance) is None:  # the expert size, hence memory and gradient bytes, unknown
        out = {k: v for k, v in out.items() if "replica_" not in k}
    return out
