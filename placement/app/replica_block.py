"""The replica step of a solve: the ``replicas`` block of a placement file, chosen and priced.

:func:`replicas_block` chooses ``N`` redundant expert slots per MoE layer for a solved permutation
(``search``: :mod:`solvers.replica_search`; ``hottest`` or ``eplb``: :mod:`placement.core.replicas`)
and prices them with the one evaluator (:func:`priced_figures`); the block's format is
:mod:`placement.formats.replicas`.
"""

from __future__ import annotations

import numpy as np

from placement.core.model import Instance, InvalidInputError, Placement
from placement.core.replicas import ReplicaMap, check_redundant_experts, expert_loads
from placement.formats.replicas import replica_metrics, replicas_document

__all__ = ["replicas_block", "priced_figures", "PRICED_KEYS"]


def replicas_block(instance: Instance, placement: Placement, redundant_experts: int, rule: str = "search",
                   *, seed: int = 0) -> dict:
    """The ``replicas`` block for ``placement``: ``redundant_experts`` slots per MoE layer chosen by
    ``rule`` on the sampled window (the held-out window is only scored), per pipeline stage with the
    NVLink domains of the stage's first EP group; ``search`` (:mod:`solvers.replica_search`) also
    records what it found under ``search``.  ``priced`` holds the evaluator's figures with the
    replicas (:func:`priced_figures`).

    Raises
    ------
    InvalidInputError
        ``redundant_experts`` that ``E + N`` and ``ep`` do not allow, or an unknown rule.
    """
    from placement.core.replicas import REPLICA_RULES, replicate

    if placement.pipeline_layout:  # score with the layout the placement runs (as placement.predict.cost.report does)
        from placement.core.pipeline_layout import with_layout

        instance = with_layout(instance, placement.pipeline_layout)
    m, par, cl = instance.model, instance.parallel, instance.cluster
    n = check_redundant_experts(m.num_experts, par.ep, redundant_experts)
    if rule not in REPLICA_RULES:
        raise InvalidInputError(f"replica_rule: expected one of {', '.join(REPLICA_RULES)}, found {rule!r}")
    loads = expert_loads(instance.routing.topk, m.num_experts)
    stage = np.asarray(instance.moe_layer2stage)
    base = np.asarray(placement.phy2log, dtype=np.int64)
    search = None
    if rule == "search":
        from solvers.replica_search import search_replicas

        rmap, info = search_replicas(instance, placement, n, seed=seed)
        search = info.to_dict()
    else:
        rows = np.zeros((m.num_moe_layers, m.num_experts + n), dtype=np.int64)
        r2g = np.asarray(placement.rank2gpu, dtype=np.int64)
        for s in np.unique(stage):
            layers = np.flatnonzero(stage == s)
            rank2domain = cl.gpu2domain[r2g[par.stage_ep_groups[int(s)][0]]]
            rows[layers] = replicate(rule, base[layers], loads[layers], par.ep, n, rank2domain).phy2log
        rmap = ReplicaMap(rows, m.num_experts, par.ep)
    try:
        from placement.core.movecount import expert_params

        params: int | None = expert_params(instance)
    except InvalidInputError:
        params = None
    doc = replicas_document(rmap, rule, replica_metrics(instance, rmap, params))
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
