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

from placement.core.model import InfeasibleError, Instance, Placement
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

__all__ = ["choose_rank2gpu", "clock_cut", "solve_cpsat", "equal_slices_breaks", "step_time_check",
           "balanced_candidates"]

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
    """Under ``step_time``: the solved placement against the other candidates, in predicted step time
    at every setting of the model's uncertain terms, on the sampled window and in a drift scenario,
    and the drift-robust choice.

    The candidates, in order of preference: the solved placement; where any map is valid, the
    solved map with each domain's experts re-packed onto its GPUs by load
    (:func:`solvers.experts.balance.rebalanced_within_domains`: the same cross-domain bytes); when given, the layout's own
    expert map on the same rank layout; the solved rank layout with contiguous experts; balanced
    packings (:func:`balanced_candidates`: EPLB-style load packing of the expert maps, on the
    solved, the default and the packed rank layout) where the maps may break expert groups; the
    default placement (default layout, contiguous experts); the packed peer layout
    (:func:`solvers.packed.packed_rank2gpu`; not under ``layout`` ``fixed``) with contiguous experts.
    Each is scored by the one
    evaluator (:func:`placement.predict.cost.evaluate`) and the step-time model at the ``low``, ``mid`` and
    ``high`` settings (:func:`placement.predict.report.setting_step_models`).

    Expert maps are fitted to the sampled routing, which drifts: in the drift scenario a candidate
    keeps only the share ``kept`` (:func:`solvers.experts.windows.gain_kept`: estimated from the
    sampled windows' own drift, :data:`~solvers.experts.windows.SINGLE_WINDOW_GAIN_KEPT` with one
    window) of its step-time gain over contiguous experts (a map blind to the routing) on its own
    rank layout, per setting: ``t_drift = t_contiguous + kept * (t - t_contiguous)``.  The returned
    candidate is the max-min-regret one (:func:`placement.predict.report.max_min_regret`) in the drift
    scenario; candidates level there (with ``kept`` 0: every map on one rank layout) are decided by
    their max-min regret on the sampled window, then by the order above.  With ``kept`` 1 (one
    sampled window, or windows that agree) this is the max-min-regret choice on the sampled window;
    with ``kept`` 0 (windows whose loads say nothing of each other) the rank layout is chosen on
    what holds whatever the routing does, the expert map on it on the tokens sampled.

    Returns ``{}`` for the byte objectives; else ``predicted_step_time_s`` (mid setting, sampled) of
    what is returned, ``solved_predicted_step_time_s``, ``default_predicted_step_time_s``,
    ``layout_map_predicted_step_time_s`` (mid), ``gain_kept``, ``candidates`` (per name: step time
    per setting and worst ratio, sampled and in the drift scenario), ``choice_by_setting`` (the
    candidate each setting alone would choose in the drift scenario, then on the sampled window),
    ``choice_differs``, ``fallback_to_default`` and ``returned`` (the chosen candidate's name);
    unless the solved placement is returned, ``return_placement`` holds the placement to return
    instead (the caller pops it).  An instance without a ``performance`` block gives
    ``{"skipped": ...}``; a consumer rule a peer layout breaks leaves that layout's candidates out.
    """
    if options.objective != "step_time":
        return {}
    from placement.predict.cost import evaluate
    from placement.predict.report import max_min_regret, setting_step_models
    from solvers.kernels.drift import gain_kept
    from solvers.packed import packed_rank2gpu

    try:
        models = setting_step_models(instance)
    except ValueError:
        return {"skipped": "no performance block: step_time fell back to total"}
    gp = bool(options.group_preserving_for(instance)) and instance.model.num_groups > 1
    m = instance.model
    identity = np.tile(np.arange(m.num_experts, dtype=np.int64), (m.num_moe_layers, 1))
    solved_r2g = np.asarray(placement.rank2gpu, dtype=np.int64)
    cands: list[tuple[str, Placement]] = [("solved", placement)]
    if not gp:  # any map is valid: the solved map with each domain's experts re-packed by load
        from solvers.experts.balance import rebalanced_within_domains

        rebalanced = rebalanced_within_domains(instance, solved_r2g, placement.phy2log)
        if not np.array_equal(rebalanced, placement.phy2log):
            cands.append(("solved, rebalanced within domains", Placement(solved_r2g, rebalanced)))
    if layout_phy2log is not None and not np.array_equal(layout_phy2log, placement.phy2log):
        cands.append(("layout's expert map", Placement(solved_r2g, np.asarray(layout_phy2log, dtype=np.int64))))
    cands.append(("solved layout, contiguous experts", Placement(solved_r2g, identity)))
    rule = options.consumer in ("deepep", "hybridep")
    default_r2g = default_rank2gpu(instance)
    default_ok = not (rule and equal_slices_breaks(instance, default_r2g))
    packed_r2g = packed_rank2gpu(instance)  # not under --layout fixed, which keeps the default layout
    packed_ok = options.layout != "fixed" and not (rule and equal_slices_breaks(instance, packed_r2g))
    out: dict = {}
    if not gp:  # balanced packings break expert groups: only where any map is valid
        layouts = [("solved layout", solved_r2g)]
        if default_ok and not np.array_equal(default_r2g, solved_r2g):
            layouts.append(("default layout", default_r2g))
        if packed_ok and not any(np.array_equal(packed_r2g, r) for _, r in layouts):
            layouts.append(("packed layout", packed_r2g))
        cands.extend(balanced_candidates(instance, layouts))
    if default_ok:
        cands.append(("default placement", Placement(default_r2g, identity)))
    else:
        out["default_skipped"] = f"the default layout breaks the {options.consumer} rule"
    if packed_ok:
        cands.append(("packed layout, contiguous experts", Placement(packed_r2g, identity)))
    seen: dict[tuple[bytes, bytes], dict[str, float]] = {}

    def step_times(p: Placement) -> dict[str, float]:
        key = (np.asarray(p.rank2gpu).tobytes(), np.asarray(p.phy2log).tobytes())
        if key not in seen:
            metrics = evaluate(instance, p)
            seen[key] = {s: float(model.step_time_s(metrics, p.rank2gpu)) for s, model in models.items()}
        return seen[key]

    kept = gain_kept(instance.routing.topk, instance.routing.window_bounds(), m.num_experts)
    times: list[dict[str, float]] = []
    drift: list[dict[str, float]] = []
    for _, p in cands:
        t = step_times(p)
        ref = step_times(Placement(p.rank2gpu, identity))  # contiguous experts on the same rank layout
        times.append(t)
        drift.append({s: ref[s] + kept * (t[s] - ref[s]) for s in t})
    sampled_choice = max_min_regret(times)
    drift_choice = max_min_regret(drift)
    top = max(drift_choice.worst_ratio)
    level = [i for i, w in enumerate(drift_choice.worst_ratio) if w >= top * (1 - 1e-9)]
    best_sampled = max(sampled_choice.worst_ratio[i] for i in level)
    index = next(i for i in level if sampled_choice.worst_ratio[i] >= best_sampled * (1 - 1e-9))
    mid = "mid" if "mid" in times[0] else next(iter(times[0]))
    names = [name for name, _ in cands]
    out["solved_predicted_step_time_s"] = times[0][mid]
    for name, out_key in (("default placement", "default_predicted_step_time_s"),
                          ("layout's expert map", "layout_map_predicted_step_time_s")):
        if name in names:
            out[out_key] = times[names.index(name)][mid]
    out["gain_kept"] = kept
    out["candidates"] = {name: {"predicted_step_time_s": t, "worst_ratio": w,
                                "drift_step_time_s": d, "drift_worst_ratio": dw}
                         for name, t, w, d, dw in zip(names, times, sampled_choice.worst_ratio, drift,
                                                      drift_choice.worst_ratio)}

    def by_setting(s: str) -> int:  # the same rule on one setting alone
        one_d = max_min_regret([{s: d[s]} for d in drift])
        lv = [i for i, w in enumerate(one_d.worst_ratio) if w >= max(one_d.worst_ratio) * (1 - 1e-9)]
        return min(lv, key=lambda i: (times[i][s], i))

    out["choice_by_setting"] = {s: names[by_setting(s)] for s in times[0]}
    out["choice_differs"] = any(n != names[index] for n in out["choice_by_setting"].values())
    out["predicted_step_time_s"] = times[index][mid]
    out["returned"] = names[index]
    out["fallback_to_default"] = names[index] == "default placement"
    if index:
        out["return_placement"] = cands[index][1]
    return out


def balanced_candidates(instance: Instance, layouts: list[tuple[str, np.ndarray]]) -> list[tuple[str, Placement]]:
    """Cheap load-balanced expert maps for each named rank layout: per layer, whole expert groups
    packed onto the NVLink domains by load, then experts onto the EP ranks by load
    (:func:`solvers.kernels.balanced_phy2log`, EPLB's hierarchical packing).  Named
    ``balanced packing, <layout name>``; any map (they may break expert groups)."""
    from solvers.kernels import balanced_phy2log

    return [(f"balanced packing, {name}", Placement(np.asarray(r2g, dtype=np.int64), balanced_phy2log(instance, r2g)))
            for name, r2g in layouts]


@register("cpsat")
def solve_cpsat(instance: Instance, options: SolveOptions) -> SolveResult:
    """Rank layout from :func:`choose_rank2gpu`, expert maps from :func:`place_experts`."""
    deadline = options.resolved_deadline()
    t0 = time.monotonic()
    rank2gpu, layout_info, layout_phy2log, layout_cut = choose_rank2gpu(instance, options, deadline=deadline)
    _check_consumer(instance, rank2gpu, options)
    gp = bool(options.fit_groups_whole(instance))
    if options.objective == "bottleneck":
        log.warning("cpsat: the expert maps minimise total cross-domain bytes; --objective %s only "
                    "steers the rank layout", options.objective)
    expert_options = _expert_options(options)
    expert_deadline = deadline
    if options.objective == "step_time":  # keep the wall time of the step-time check's evaluator runs
        from solvers.layout.plan import EVAL_S_PER_EXPERT_ID

        # up to ten candidates, each evaluated once (the settings reuse its metrics), and building
        # the in-domain rebalanced candidate (about three evaluator runs: 1.1 s on dsv3_1024)
        check_s = 13 * EVAL_S_PER_EXPERT_ID * float(np.prod(instance.routing.topk.shape))
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
        from placement.predict.cost import evaluate

        placement = step_check.pop("return_placement")
        status = "feasible"
        objective_bytes = float(evaluate(instance, placement).cross_domain_bytes_per_step)
        if bound_bytes is not None:  # a bound over the layout's maps and the returned placement
            bound_bytes = min(bound_bytes, objective_bytes)
        log.info("cpsat: %s is the robust choice over the step-time model's settings; returning it "
                 "(details['step_time_check'])", step_check["returned"])
    params = {
        "layout": options.layout,
        "layout_source": layout_info["source"],
        "consumer": options.consumer,
        "group_preserving": bool(options.group_preserving_for(instance)),
        "fit_groups_whole": gp,
        "apply": options.apply_for(instance),
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
