"""The registered solver ``cpsat``: a rank layout, then every layer's expert map.

Two levels, decoupled on purpose:

1. The rank layout (which GPU runs each rank) comes from ONE call, :func:`choose_rank2gpu`: the
   rank-layout search :func:`solvers.layout.plan_layout` (issue 4), or with
   ``options.layout == "fixed"`` always the default layout (``solvers.default.default_rank2gpu``).
2. For that fixed layout, :func:`solvers.experts.place_experts` optimises every MoE layer's expert
   map (experts -> domain classes by local search, CP-SAT and, for group-preserving maps, a
   group-level branch and bound; balancing inside domains; a validation guard) in a process pool,
   starting also from the expert map the layout was scored with, and reports per-layer bounds.

Time: the layout gets :data:`solvers.layout.LAYOUT_TIME_SHARE` of the wall time left; the expert
placer sizes its deterministic work from the rest of the work budget
(:meth:`SolveOptions.resolved_work_budget_s`, never the clock), so its result depends on the
budget, not on how long the layout took.

Consumer rules, constructively and without the verifier: group-preserving maps come from the
expert placer, which builds them from group positions (whole expert groups on whole positions), and
the result's ``group_preserving`` flag is computed here from the maps
(:func:`solvers.kernels.keeps_expert_groups`); DeepEP/HybridEP's equal consecutive slices are
checked on the chosen rank layout by :func:`equal_slices_breaks` (``placement verify`` keeps its
own implementation of both rules).

The objective reported is the evaluator's ``cross_domain_bytes_per_step`` on the sampled tokens;
``status`` is ``optimal`` only if every layer's map is proved optimal for the layout (over maps within
the load caps).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Literal

import numpy as np

from placement.model import InfeasibleError, Instance, Placement
from solvers.base import SolveOptions, SolveResult
from solvers.default import default_rank2gpu
from solvers.experts import (
    DET_PER_WALL_S,
    GPU_LOAD_TOLERANCE,
    VALIDATION_FRACTION,
    place_experts,
)
from solvers.kernels import keeps_expert_groups
from solvers.registry import register

__all__ = ["choose_rank2gpu", "clock_cut", "solve_cpsat", "equal_slices_breaks", "step_time_check"]

log = logging.getLogger(__name__)


def choose_rank2gpu(
    instance: Instance, options: SolveOptions, *, deadline: float
) -> tuple[np.ndarray, dict, np.ndarray | None, bool]:
    """The rank layout: the ONE place it is decided.

    Returns ``(rank2gpu (world,), info, phy2log or None, wall_clock_cut)``; ``info`` goes into the
    result's ``details["layout"]``; ``phy2log`` is the expert map the layout was scored with (a start
    for the expert placer); ``wall_clock_cut`` says the wall clock (or a stop request) ended some of
    the layout's work (:attr:`solvers.layout.LayoutPlan.wall_clock_cut`).
    ``options.layout == "fixed"`` always gives the default layout; ``optimize`` runs the rank-layout
    search :func:`solvers.layout.plan_layout` on :data:`solvers.layout.LAYOUT_TIME_SHARE` of the time
    left (it never returns a layout its estimate scores worse than the default).
    """
    if options.moves is not None:  # re-placement: keep the previous rank layout, re-place experts only
        prev = options.moves.previous
        return (np.asarray(prev.rank2gpu, dtype=np.int64).copy(),
                {"source": "previous", "reason": "re-placement keeps the previous rank layout"},
                np.asarray(prev.phy2log, dtype=np.int64).copy(), False)
    rank2gpu = default_rank2gpu(instance)
    if options.layout == "fixed":
        return rank2gpu, {"source": "default", "reason": "layout fixed"}, None, False
    from solvers.layout import LAYOUT_TIME_SHARE, plan_layout

    now = time.monotonic()
    # plan_layout sizes its work by options.time_limit_s: hand it the work budget.
    layout_options = dataclasses.replace(options, time_limit_s=options.resolved_work_budget_s())
    plan = plan_layout(instance, layout_options, deadline=now + LAYOUT_TIME_SHARE * max(0.0, deadline - now))
    return plan.rank2gpu, {"source": "solvers.layout.plan_layout", **plan.details}, plan.phy2log, plan.wall_clock_cut


def clock_cut(details: object) -> bool:
    """Whether the expert placer's details (any depth) record work ended by the wall clock or a stop
    request: a layer's ``stopped_early``, a CP-SAT or LNS run's ``wall_clock_cut``, or a layer left
    at its fallback map (``fallback_reason``)."""
    if isinstance(details, dict):
        if details.get("stopped_early") or details.get("wall_clock_cut") or details.get("fallback_reason"):
            return True
        return any(clock_cut(v) for v in details.values())
    if isinstance(details, list):
        return any(clock_cut(v) for v in details)
    return False


def _expert_options(options: SolveOptions) -> SolveOptions:
    """The options the expert placer sizes its deterministic work by: the work budget's share left
    after the rank layout (a function of the budget alone, so the result does not depend on the clock)."""
    if options.moves is not None:  # no rank-layout search; the move candidates take a share of the work
        from solvers.experts.moves import SEARCH_SHARE

        return dataclasses.replace(options, work_budget_s=options.resolved_work_budget_s() * SEARCH_SHARE)
    if options.layout == "fixed":
        return options
    from solvers.layout import LAYOUT_TIME_SHARE

    return dataclasses.replace(options, work_budget_s=options.resolved_work_budget_s() * (1.0 - LAYOUT_TIME_SHARE))


def equal_slices_breaks(instance: Instance, rank2gpu: np.ndarray) -> list[str]:
    """EP groups whose ranks do not lie in equal consecutive slices per NVLink domain.

    DeepEP and HybridEP address peers as ``rank == rdma_rank * num_nvl_ranks + nvl_rank``: in EP-rank
    order an EP group must be runs of one domain each, every domain once, all runs of one length.
    """
    par, g2d = instance.parallel, instance.cluster.gpu2domain
    out = []
    for s in range(par.pp):
        for gi, ranks in enumerate(par.stage_ep_groups[s]):
            doms = g2d[np.asarray(rank2gpu, dtype=np.int64)[ranks]]
            starts = np.flatnonzero(np.r_[True, doms[1:] != doms[:-1]])
            lengths = np.diff(np.r_[starts, doms.shape[0]])
            run_domains = doms[starts]
            if np.unique(run_domains).shape[0] != run_domains.shape[0] or np.unique(lengths).shape[0] != 1:
                out.append(f"stage {s} EP group {gi}: domains {run_domains.tolist()} with slices {lengths.tolist()}")
    return out


def _check_consumer(instance: Instance, rank2gpu: np.ndarray, options: SolveOptions) -> None:
    if options.consumer in ("deepep", "hybridep"):
        bad = equal_slices_breaks(instance, rank2gpu)
        if bad:
            raise InfeasibleError(
                f"consumer {options.consumer}: the rank layout breaks the equal-consecutive-slices rule "
                f"({bad[0]}{'; and ' + str(len(bad) - 1) + ' more' if len(bad) > 1 else ''})"
            )


def step_time_check(instance: Instance, options: SolveOptions, placement: Placement, layout_info: dict, *,
                    layout_phy2log: np.ndarray | None = None) -> dict:
    """Under ``step_time``: the solved placement against the default placement (default layout,
    contiguous experts) and, when given, the layout's own expert map on the same rank layout, in
    predicted step time on the sampled window.

    Returns ``{}`` for the byte objectives; else the predictions (``predicted_step_time_s`` of what
    is returned, ``solved_predicted_step_time_s``, ``default_predicted_step_time_s``,
    ``layout_map_predicted_step_time_s``; evaluator-based), ``fallback_to_default`` and
    ``returned`` (``solved``, ``default placement`` or ``layout's expert map``); unless the solved
    placement is returned, ``return_placement`` holds the placement to return instead (the caller
    pops it).  An instance without a ``performance`` block gives ``{"skipped": ...}``; a consumer
    rule the default layout breaks leaves the default out.
    """
    if options.objective != "step_time":
        return {}
    from placement.cost import evaluate
    from placement.performance import StepTimeModel

    try:
        model = StepTimeModel(instance)
    except ValueError:
        return {"skipped": "no performance block: step_time fell back to total"}
    def step_s(p: Placement) -> float:
        return float(model.step_time_s(evaluate(instance, p), p.rank2gpu))

    solved_s = step_s(placement)
    out: dict = {"solved_predicted_step_time_s": solved_s}
    options_: list[tuple[float, int, str, Placement]] = [(solved_s, 0, "solved", placement)]
    default_r2g = default_rank2gpu(instance)
    if options.consumer in ("deepep", "hybridep") and equal_slices_breaks(instance, default_r2g):
        out["default_skipped"] = f"the default layout breaks the {options.consumer} rule"
    else:
        m = instance.model
        identity = np.tile(np.arange(m.num_experts, dtype=np.int64), (m.num_moe_layers, 1))
        default_placement = Placement(default_r2g, identity)
        check = layout_info.get("evaluator_check") or {}
        default_s = check.get("default_predicted_step_time_s")  # the layout's own evaluation of it
        if default_s is None:
            default_s = step_s(default_placement)
        out["default_predicted_step_time_s"] = float(default_s)
        options_.append((float(default_s), 2, "default placement", default_placement))
    if layout_phy2log is not None and not np.array_equal(layout_phy2log, placement.phy2log):
        layout_placement = Placement(placement.rank2gpu, np.asarray(layout_phy2log, dtype=np.int64))
        layout_s = step_s(layout_placement)
        out["layout_map_predicted_step_time_s"] = layout_s
        options_.append((layout_s, 1, "layout's expert map", layout_placement))
    # strictly faster beats the solved maps (a relative tolerance keeps ties with the solved)
    best = min(options_, key=lambda o: (o[0] * (1 + 1e-9) + 1e-12 if o[1] else o[0], o[1]))
    out["predicted_step_time_s"] = best[0]
    out["returned"] = best[2]
    out["fallback_to_default"] = best[2] == "default placement"
    if best[1]:
        out["return_placement"] = best[3]
    return out


@register("cpsat")
def solve_cpsat(instance: Instance, options: SolveOptions) -> SolveResult:
    """Rank layout from :func:`choose_rank2gpu`, expert maps from :func:`place_experts`."""
    deadline = options.resolved_deadline()
    t0 = time.monotonic()
    rank2gpu, layout_info, layout_phy2log, layout_cut = choose_rank2gpu(instance, options, deadline=deadline)
    _check_consumer(instance, rank2gpu, options)
    gp = bool(options.group_preserving_for(instance))
    if options.objective == "bottleneck":
        log.warning("cpsat: the expert maps minimise total cross-domain bytes; --objective %s only "
                    "steers the rank layout", options.objective)
    expert_options = _expert_options(options)
    expert_deadline = deadline
    if options.objective == "step_time":  # keep the wall time of the step-time check's evaluator runs
        from solvers.layout.plan import EVAL_S_PER_EXPERT_ID

        check_s = 3 * EVAL_S_PER_EXPERT_ID * float(np.prod(instance.routing.topk.shape))
        expert_deadline = max(time.monotonic(), deadline - check_s)
    move_plan = None
    if options.moves is not None:  # move-aware re-placement (solvers/experts/moves.py)
        from solvers.experts.moves import build_plan_for

        move_plan = build_plan_for(instance, rank2gpu, options.moves)
    plan = place_experts(instance, rank2gpu, expert_options, deadline=expert_deadline, hint_phy2log=layout_phy2log,
                         moves=move_plan)
    placement = Placement(rank2gpu, plan.phy2log)
    status: Literal["optimal", "feasible"] = "optimal" if plan.proved else "feasible"
    objective_bytes, bound_bytes = plan.objective_bytes, plan.bound_bytes
    if options.moves is not None:
        from solvers.experts.moves import previous_check

        step_check = previous_check(instance, options, placement, move_plan)
    else:
        step_check = step_time_check(instance, options, placement, layout_info, layout_phy2log=layout_phy2log)
    if "return_placement" in step_check:
        from placement.cost import evaluate

        placement = step_check.pop("return_placement")
        status = "feasible"
        objective_bytes = float(evaluate(instance, placement).cross_domain_bytes_per_step)
        if bound_bytes is not None:  # a bound over the layout's maps and the returned placement
            bound_bytes = min(bound_bytes, objective_bytes)
        log.warning("cpsat: the solved expert maps predict a slower step than %s; returning it "
                    "(details['step_time_check'])", step_check["returned"])
    params = {
        "layout": options.layout,
        "layout_source": layout_info["source"],
        "consumer": options.consumer,
        "group_preserving": gp,
        "objective": options.objective,
        "num_workers": int(options.num_workers),
        "seed": int(options.seed),
        "time_limit_s": float(options.time_limit_s),
        "expert_work_budget_s": float(expert_options.resolved_work_budget_s()),  # the expert placer's work budget
        "class_load_tolerance": plan.details["class_load_tolerance"],
        "gpu_load_tolerance": GPU_LOAD_TOLERANCE,
        "validation_fraction": VALIDATION_FRACTION,
        "det_per_wall_s": DET_PER_WALL_S,
        "deterministic_time_total": plan.details["deterministic_time_total"],
        "cpsat_workers_per_layer": 1,
    }
    details = {
        "layout": layout_info,
        "expert_objective": "total",
        **plan.details,
    }
    if step_check:
        details["step_time_check"] = step_check
    log.info("cpsat: %s in %.1f s", status, time.monotonic() - t0)
    return SolveResult(
        placement=placement,
        solver="cpsat",
        status=status,
        objective_bytes=objective_bytes,
        bound_bytes=bound_bytes,
        params=params,
        details=details,
        group_preserving=keeps_expert_groups(placement.phy2log, instance.model.experts_per_group),
        consumer=options.consumer,
        wall_clock_cut=bool(layout_cut or clock_cut(plan.details.get("layers", []))),
    )
