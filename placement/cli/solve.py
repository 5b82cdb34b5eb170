"""``placement solve``: parse, call :func:`placement.api.solve`, print the comparison with the default layout."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from typing import TYPE_CHECKING

from placement.api import Interrupted, SignalStop
from placement.cli.common import _allocation, _check_output_path, EXIT_OK, EXIT_SIGINT, _progress_printer
from placement.cli.printing import _band, _BAND_ROWS, _footprint_lines, _gb, _moves_lines, _PREDICTED_ROWS, _SETTINGS
from placement.core.model import InvalidInputError, PlacementError
from placement.core.progress import progress as progress_bar

if TYPE_CHECKING:
    from placement.core.model import Instance


def _cmd_solve(args: argparse.Namespace, started_at: float, stop: SignalStop) -> int:
    from placement.api import SolveRequest, answer_reserve_s, default_layout_report, load_instance, save_result, solve

    if args.output:
        _check_output_path(args.output)
    instance = load_instance(args.instance)
    allocation = _allocation(args)
    if allocation is not None:
        from placement.api import allocate

        instance = allocate(instance, allocation)
    moves_kwargs = _move_arguments(args, instance)
    if args.group_preserving != "auto":  # the older spelling: still honoured, as an explicit override
        print(f"placement: note: --group-preserving {args.group_preserving} / --free are deprecated; say how the map "
              "is applied with --apply runtime|checkpoint", file=sys.stderr)
    # The default layout's report, for the comparison below; its time predicts the time needed
    # to score the solver's answer, which is kept back from the solver's share of the limit.
    default = default_layout_report(instance)
    stop.armed = True  # from here a first signal asks for the best placement so far
    try:
        with progress_bar(instance.model.num_moe_layers, "solve: expert maps", "layer", quiet=args.quiet) as bar:
            messages = _progress_printer(bar)
            if messages is not None:
                left_s = args.time_limit - (time.monotonic() - started_at)
                messages(f"solving {instance.name} with {args.solver}: {left_s:.1f} s left of the {args.time_limit:g} s limit")
            request = SolveRequest(
                solver=args.solver,
                time_limit_s=args.time_limit,
                seed=args.seed,
                num_workers=args.workers,
                consumer=args.consumer,
                group_preserving={"auto": None, "on": True, "off": False}[args.group_preserving],
                apply=args.apply,
                objective=args.objective,
                layout=args.layout or "optimize",
                progress=messages,
                on_progress=bar.report,
                started_at=started_at,
                stop_event=stop.event,
                finish_reserve_s=answer_reserve_s(default.scoring_s),
                **moves_kwargs,
                fit=args.fit,
                redundant_experts=args.redundant_experts,
                replica_rule=args.replica_rule,
                replica_memory_budget_bytes=None if args.replica_memory_budget is None else args.replica_memory_budget * 1e9,
                pipeline_split=not args.keep_pipeline_layout,
            )
            result = solve(instance, request)
    except PlacementError:
        if stop.event.is_set():  # the failure follows the signal (e.g. it also killed worker processes)
            raise Interrupted(stop.signum or signal.SIGINT) from None
        raise
    interrupted = stop.event.is_set()
    signame = signal.Signals(stop.signum).name if stop.signum is not None else "a signal"
    if args.output:
        save_result(instance, result, args.output, allocation=allocation)
        if interrupted:
            print(f"placement: interrupted by {signame}: wrote the best placement found so far to {args.output}",
                  file=sys.stderr)
    elif interrupted:
        print(f"placement: interrupted by {signame}: no --output given, nothing written", file=sys.stderr)
        return stop.exit_code or EXIT_SIGINT
    if args.json:
        out = {
            "solver": result.solver,
            "status": result.status,
            "objective_bytes": result.objective_bytes,
            "bound_bytes": result.bound_bytes,
            "gap": result.gap,
            "wall_s": result.wall_s,
            "interrupted": interrupted,
            "output": args.output,
            "metrics": result.metrics,
            "default_metrics": default.metrics,
        }
        if "moves" in result.details:
            out["moves"] = result.details["moves"]
        check = result.details.get("step_time_check") or {}
        if "choice_by_setting" in check:
            out["step_time_choice"] = {k: check[k] for k in ("returned", "choice_by_setting", "choice_differs")}
        print(json.dumps(out, sort_keys=True))
        return EXIT_OK
    m, b = result.metrics, default.metrics
    print(f"{instance.name}: solver {result.solver}, status {result.status}, {result.wall_s:.1f} s wall")
    apply_mode = result.params.get("apply")
    if apply_mode is not None:
        if result.params.get("group_preserving"):
            maps = "group-preserving"
        elif result.params.get("fit_groups_whole"):  # only under group-limited routing (fit_groups_whole)
            maps = "free (fitted with expert groups whole, then any map weighed)"
        else:
            maps = "free"
        print(f"  expert maps {maps}, applied at {apply_mode} "
              f"({'placement.consumers.runtime hooks, keep-router checkpoint' if apply_mode == 'runtime' else 'checkpoint renumbering'})")
        if (result.params.get("fit_groups_whole") and not result.params.get("group_preserving")
                and instance.routing.num_windows == 1):
            print("  one sampled window, so its drift is unmeasured: groups fitted whole (--free fits the "
                  "sample's co-activation, for a recent sample; record several windows to measure)")
    if result.bound_bytes is not None:
        print(f"  objective {_gb(result.objective_bytes)}, bound {_gb(result.bound_bytes)}, gap {100 * (result.gap or 0):.1f}%")
    if instance.routing.num_windows > 1:  # several sampled windows: say how the expert maps used them
        print(f"  expert fit {args.fit} over {instance.routing.num_windows} sampled windows "
              f"({' + '.join(str(t) for t in instance.routing.window_tokens or ())} tokens/source), "
              "guard on the latest; 'sampled' below = all windows")
    print(f"  {'per optimizer step':<38}{'default':>16}{'solved':>16}{'ratio':>8}")
    for label, key, fmt in [
        ("cross-domain bytes (sampled)", "cross_domain_bytes_per_step", _gb),
        ("cross-domain bytes (held-out)", "heldout_cross_domain_bytes_per_step", _gb),
        ("busiest NIC bytes (held-out)", "heldout_max_gpu_cross_domain_bytes_per_step", _gb),
        ("remote domains/token (held-out)", "heldout_remote_domains_per_token", lambda v: f"{v:.3f}"),
        ("expert load max/mean (held-out)", "heldout_expert_load_max_over_mean", lambda v: f"{v:.3f}"),
        ("  lasting, noise removed (held-out)", "heldout_expert_load_lasting_max_over_mean", lambda v: f"{v:.3f}"),
        ("all-to-all s, slowest stage (h-o)", "heldout_alltoall_time_s_per_step", lambda v: f"{v:.2f}"),
    ]:
        ratio = m[key] / b[key] if b[key] else float("nan")
        print(f"  {label:<38}{fmt(b[key]):>16}{fmt(m[key]):>16}{ratio:>8.3f}")
    if "predicted_step_time_s" in m:  # the instance has a performance block
        for prefix, window in (("", "sampled"), ("heldout_", "h-o")):
            for label, key, fmt in _PREDICTED_ROWS:
                k = prefix + key
                if k in m and k in b:
                    ratio = m[k] / b[k] if b[k] else float("nan")
                    text = f"{label.replace('predicted ', '')} ({window})"
                    print(f"  {text:<38}{fmt(b[k]):>16}{fmt(m[k]):>16}{ratio:>8.3f}")
    for label, key, fmt in _BAND_ROWS:
        k = f"heldout_{key}"
        if f"{k}_{_SETTINGS[0]}" in m and f"{k}_{_SETTINGS[0]}" in b:
            print(f"  {label.replace('predicted ', '') + ' (h-o)':<38}  default {_band(b, k, fmt)}   solved {_band(m, k, fmt)}")
    check = result.details.get("step_time_check") or {}
    if "choice_by_setting" in check:
        if check.get("choice_differs"):
            alone = ", ".join(f"{s}: {name}" for s, name in check["choice_by_setting"].items())
            print(f"  the choice differs between the model's settings (each alone: {alone}); returned "
                  f"{check['returned']}, the best worst-case ratio to each setting's fastest candidate "
                  f"({check['candidates'][check['returned']]['drift_worst_ratio']:.3f})")
        else:
            print(f"  the same choice at every setting of the model ({check['returned']})")
    print("\n".join(_footprint_lines(instance, result)))
    if "moves" in result.details:
        print("\n".join(_moves_lines(args.previous, result.details["moves"])))
    if "replicas" in result.details:  # placement/formats/replicas.py; priced under "priced", metrics above without
        rm = result.details["replicas"]["metrics"]
        auto = result.details["replicas"].get("search", {}).get("auto")
        if auto:  # --redundant-experts auto: every candidate count's priced step (sampled window)
            print("  redundant experts auto: " + ", ".join(
                f"N={c['redundant_experts']} " + (f"{c['sampled_step_s']:.6g} s" if "sampled_step_s" in c else "skipped")
                + (f" (held-out {c['heldout_step_s']:.6g} s)" if "heldout_step_s" in c else "")
                for c in auto["candidates"]) + f" predicted step; chose N={auto['chosen_redundant_experts']} on the sampled window")
        print(f"  replicas: {result.details['replicas']['num_redundant_experts']} redundant slots per MoE layer (rule {args.replica_rule}), busiest EP "
              f"rank's tokens / mean (held-out) {rm.get('heldout_rank_load_max_over_mean', float('nan')):.3f} -> "
              f"{rm.get('heldout_rank_load_max_over_mean_with_replicas', float('nan')):.3f}; the metrics above are "
              "without them")
        pr = result.details["replicas"].get("priced", {})
        if "heldout_predicted_tflops_per_gpu_mid" in pr:
            print(f"  with the replicas, held-out TFLOP/s per GPU (low / mid / high): "
                  f"{pr['heldout_predicted_tflops_per_gpu_low']:,.1f} / {pr['heldout_predicted_tflops_per_gpu_mid']:,.1f} / "
                  f"{pr['heldout_predicted_tflops_per_gpu_high']:,.1f}; "
                  f"{pr.get('replica_memory_bytes_per_gpu', float('nan')) / 1e9:.2f} GB more per GPU")
    if args.output:
        print(f"  wrote {args.output}")
    return EXIT_OK


def _move_arguments(args: argparse.Namespace, instance: Instance) -> dict:
    """The re-placement keywords of :func:`placement.api.solve` from ``--previous`` and its options."""
    if args.previous is None:
        for flag, value in (("--max-moved-bytes", args.max_moved_bytes), ("--move-cost", args.move_cost),
                            ("--expert-params", args.expert_params)):
            if value is not None:
                raise InvalidInputError(f"{flag}: needs --previous")
        return {}
    from placement.predict.moves import load_previous, parse_moved_bytes, replica_state_bytes

    if args.layout == "optimize":
        raise InvalidInputError("--layout: --previous keeps the previous rank layout (re-placing ranks would move "
                                "every expert of every moved rank); drop --layout optimize")
    if args.previous == "default":  # the default layout with contiguous experts
        from solvers.default import default_placement

        previous = default_placement(instance)
    else:
        previous = load_previous(instance, args.previous)
    sharded = args.optimizer_state == "sharded"
    out: dict = {"previous": previous, "expert_params": args.expert_params, "sharded_optimizer": sharded,
                 "move_cost": args.move_cost}
    if args.max_moved_bytes is not None:
        bpr = replica_state_bytes(instance, params=args.expert_params, sharded_optimizer=sharded)
        out["max_moved_bytes"] = parse_moved_bytes(args.max_moved_bytes, instance, bpr)
    return out
