"""The placement file's optional ``replicas`` block: redundant expert slots (:mod:`placement.core.replicas`).

::

    "replicas": {
      "num_redundant_experts": 64,          # N extra slots per MoE layer (SGLang's --ep-num-redundant-experts)
      "rule": "hottest",                    # how the replicas were chosen (placement.core.replicas.REPLICA_RULES)
      "token_split": "arrival_round_robin", # the j-th token of expert e on a source goes to replica j mod logcnt[e]
      "phy2log": [[...], ...],              # (MoE layers, E + N): slot p on EP rank p // ((E + N) / ep)
      "metrics": {...}                      # optional: rank-load max/mean, bytes per extra slot
    }

Each EP rank's first ``E / ep`` slots repeat the placement's ``phy2log`` (the permutation keeps its
meaning for every consumer that does not read replicas); its last ``N / ep`` slots are replicas.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from placement.core.model import Instance, InvalidInputError, Placement
from placement.core.replicas import REPLICA_RULES, ReplicaMap, check_redundant_experts, expert_loads, load_max_over_mean
from placement.formats.schema import Any_, Int, List, Obj, Str, validate

__all__ = [
    "REPLICAS_SPEC",
    "TOKEN_SPLITS",
    "replicas_document",
    "replica_map_from_document",
    "replica_metrics",
    "replica_violations",
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
                           "a source rank goes to slot j mod logcnt[e] (placement.consumers.replica_runtime).", TOKEN_SPLITS),
        "phy2log": List(
            "Per MoE layer, the logical expert of each physical slot; slot p on EP rank p // ((E + N) / ep).",
            List("One layer's map.", Int("Expert id.", 0, MAX_SLOTS)),
        ),
        "metrics": Any_("Rank-load max/mean on the sampled and held-out windows, bytes per extra slot."),
        "search": Any_("What the search rule found (solvers.replica_search.SearchInfo): which candidate each "
                       "layer took, the rank-load lower bound, the sampled step seconds of each candidate."),
        "priced": Any_("The evaluator's figures with these replicas (placement.predict.report.report(..., replicas=)): "
                       "predicted TFLOP/s per GPU, memory per GPU, the replicas' gradient sum."),
    },
    optional=frozenset({"metrics", "search", "priced"}),
)


def replica_metrics(instance: Instance, rmap: ReplicaMap, expert_params: int | None = None) -> dict[str, Any]:
    """Mean over MoE layers of the busiest EP rank's tokens over the mean, sampled and held out, with
    these replicas (``*_with_replicas``) and without (the permutation alone)."""
    from placement.core.replicas import physical_map

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
        from placement.core.replicas import extra_slot_bytes

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
