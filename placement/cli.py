"""The command line: a thin layer over :mod:`placement.api`.

``main(argv) -> int`` is the only place that prints or exits.  Exit codes: 0 success, 2 invalid
input, 3 infeasible, 1 anything else; errors are one line on stderr, never a traceback.

``placement solve`` and signals: ``--time-limit`` bounds the whole command from process start
(interpreter start-up, loading and scoring included) within the margin measured in the README.
A SIGINT or SIGTERM during the solve makes the solver return the best placement found so far; it
is checked, scored and written atomically to ``-o`` and the command exits 0 (with one line on
stderr saying it was interrupted).  Without ``-o``, or when the signal arrives before the solve
(while loading) or a second time, nothing is written and the command exits 130 (SIGINT) or 143
(SIGTERM).  So exit 0 always means: the output file is complete and valid.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, NoReturn, Sequence

from placement.api import Interrupted, SignalStop
from placement.core.model import InvalidInputError, PlacementError
from placement.core.progress import Progress
from placement.core.progress import progress as progress_bar

if TYPE_CHECKING:
    from placement.predict.calibration import Calibration
    from placement.core.model import Instance
    from solvers.base import SolveResult

__all__ = [
    "main",
    "entry",
    "EXIT_OK",
    "EXIT_ERROR",
    "EXIT_INVALID",
    "EXIT_INFEASIBLE",
    "EXIT_SIGINT",
    "EXIT_SIGTERM",
]

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_INVALID = 2
EXIT_INFEASIBLE = 3
EXIT_SIGINT = 128 + signal.SIGINT  # 130: interrupted, nothing written
EXIT_SIGTERM = 128 + signal.SIGTERM  # 143: terminated, nothing written


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2
        raise InvalidInputError(f"{self.prog}: {message}")


def _gb(x: float) -> str:
    """Bytes in decimal units (kB = 10^3 B ... TB = 10^12 B), four significant figures."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:,.4g} {unit}"
    return f"{x:.0f} B"


def _summary_lines(title: str, m: dict) -> list[str]:
    has_held = "heldout_cross_domain_bytes_per_step" in m
    lines = [f"{title}  (cost mode {m['cost_mode']}, per optimizer step)"]

    def row(label: str, key: str, fmt: Callable[[float], str]) -> None:
        held = f"   held-out {fmt(m['heldout_' + key])}" if has_held else ""
        lines.append(f"  {label:<38}{fmt(m[key]):>16}{held}")

    row("cross-domain all-to-all bytes", "cross_domain_bytes_per_step", _gb)
    row("busiest NIC (one direction)", "max_gpu_cross_domain_bytes_per_step", _gb)
    row("intra-domain (NVLink) bytes", "intra_domain_bytes_per_step", _gb)
    row("remote domains per token", "remote_domains_per_token", lambda v: f"{v:.3f}")
    row("remote experts per token", "remote_experts_per_token", lambda v: f"{v:.3f}")
    row("expert load max/mean (worst layer)", "expert_load_max_over_mean", lambda v: f"{v:.3f}")
    if "expert_load_lasting_max_over_mean" in m:  # sampling noise removed (placement.predict.imbalance)
        row("  lasting (noise removed, priced)", "expert_load_lasting_max_over_mean", lambda v: f"{v:.3f}")
    row("all-to-all time, slowest stage", "alltoall_time_s_per_step", lambda v: f"{v:.2f} s")
    if "predicted_step_time_s" in m:  # the instance has a performance block
        for label, key, fmt in _PREDICTED_ROWS:
            row(label, key, fmt)
        for label, key, fmt in _BAND_ROWS:
            if f"{key}_{_SETTINGS[0]}" in m:
                held = f"   held-out {_band(m, 'heldout_' + key, fmt)}" if has_held else ""
                lines.append(f"  {label:<38}{_band(m, key, fmt):>16}{held}")
    return lines


# The step-time model's settings of its uncertain terms (placement.predict.performance.SETTINGS) and the
# band rows: label, report key without prefix and setting suffix, format.
_SETTINGS = ("low", "mid", "high")
_BAND_ROWS: list[tuple[str, str, Callable[[float], str]]] = [
    ("predicted step s, low/mid/high", "predicted_step_time_s", lambda v: f"{v:.4g}"),
    ("predicted TFLOP/s/GPU, low/mid/high", "predicted_tflops_per_gpu", lambda v: f"{v:,.1f}"),
]


def _band(m: dict, key: str, fmt: Callable[[float], str]) -> str:
    """``low / mid / high`` of ``key`` (the report's ``{key}_{setting}`` values)."""
    return " / ".join(fmt(m[f"{key}_{s}"]) for s in _SETTINGS)


# Predicted step time rows (placement.predict.performance): label, report key without prefix, format.
_PREDICTED_ROWS: list[tuple[str, str, Callable[[float], str]]] = [
    ("predicted step time", "predicted_step_time_s", lambda v: f"{v:.4g} s"),
    ("predicted tokens/s per GPU", "predicted_tokens_per_s_per_gpu", lambda v: f"{v:,.0f}"),
    ("predicted TFLOP/s per GPU", "predicted_tflops_per_gpu", lambda v: f"{v:,.1f}"),
    ("predicted exposed all-to-all", "predicted_exposed_alltoall_s_per_step", lambda v: f"{v:.4g} s"),
    ("predicted pipeline bubble share", "predicted_bubble_share", lambda v: f"{v:.3f}"),
]


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from placement.api import evaluate_placement, load_instance, load_placement
    from solvers.default import default_placement

    instance = load_instance(args.instance)
    if args.placement == "default":
        placement = default_placement(instance)
        title = f"{instance.name}: default layout"
    else:
        placement = load_placement(instance, args.placement)
        title = f"{instance.name}: {args.placement}"
    t0 = time.perf_counter()
    metrics = evaluate_placement(instance, placement)
    elapsed = time.perf_counter() - t0
    if args.json:
        print(json.dumps(metrics, sort_keys=True))
    else:
        print("\n".join(_summary_lines(title, metrics)))
        print(f"  (evaluated in {elapsed:.2f} s)")
    return EXIT_OK


def _progress_printer(bar: Progress) -> Callable[[str], None] | None:
    """One-line messages above ``bar`` when it is drawn (a terminal, no ``--quiet``), else None."""
    if not bar.active:
        return None

    def show(msg: str) -> None:
        bar.write(f"[placement] {msg}")

    return show


_QUIET_HELP = "no progress bar or messages on stderr (they appear only on a terminal; output files never change)"


def _check_output_path(path: str) -> None:
    """Refuse an output path that cannot be written before spending the time limit on a solve."""
    out = Path(path)
    if out.is_dir():
        raise InvalidInputError(f"--output: {out} is a directory")
    folder = out.parent
    if not folder.is_dir():
        raise InvalidInputError(f"--output: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InvalidInputError(f"--output: folder {folder} is not writable")


def _cmd_solve(args: argparse.Namespace, started_at: float, stop: SignalStop) -> int:
    from placement.api import FINISH_RESERVE_S, load_instance, result_document, solve
    from placement.predict.report import report
    from placement.formats import write_placement
    from solvers.default import default_placement

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
    t0 = time.monotonic()
    baseline = report(instance, default_placement(instance))
    scoring_s = time.monotonic() - t0
    stop.armed = True  # from here a first signal asks for the best placement so far
    try:
        with progress_bar(instance.model.num_moe_layers, "solve: expert maps", "layer", quiet=args.quiet) as bar:
            messages = _progress_printer(bar)
            if messages is not None:
                left_s = args.time_limit - (time.monotonic() - started_at)
                messages(f"solving {instance.name} with {args.solver}: {left_s:.1f} s left of the {args.time_limit:g} s limit")
            result = solve(
                instance,
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
                finish_reserve_s=FINISH_RESERVE_S + 1.5 * scoring_s,
                **moves_kwargs,
                fit=args.fit,
                redundant_experts=args.redundant_experts,
                replica_rule=args.replica_rule,
                replica_memory_budget_bytes=None if args.replica_memory_budget is None else args.replica_memory_budget * 1e9,
                pipeline_split=not args.keep_pipeline_layout,
            )
    except PlacementError:
        if stop.event.is_set():  # the failure follows the signal (e.g. it also killed worker processes)
            raise Interrupted(stop.signum or signal.SIGINT) from None
        raise
    doc = result_document(instance, result)
    if allocation is not None:  # which hosts the placement was solved for
        doc["solve"]["details"]["allocation"] = {"hosts": allocation, "gpus": int(instance.cluster.available.sum())}
    interrupted = stop.event.is_set()
    signame = signal.Signals(stop.signum).name if stop.signum is not None else "a signal"
    if args.output:
        write_placement(args.output, doc)
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
            "default_metrics": baseline,
        }
        if "moves" in result.details:
            out["moves"] = result.details["moves"]
        check = result.details.get("step_time_check") or {}
        if "choice_by_setting" in check:
            out["step_time_choice"] = {k: check[k] for k in ("returned", "choice_by_setting", "choice_differs")}
        print(json.dumps(out, sort_keys=True))
        return EXIT_OK
    m, b = result.metrics, baseline
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


def _allocation(args: argparse.Namespace) -> str | None:
    """The host list of ``--allocation``: as given, or ``SLURM_JOB_NODELIST`` for ``slurm``."""
    if args.allocation is None:
        return None
    if args.allocation == "slurm":
        value = os.environ.get("SLURM_JOB_NODELIST", "").strip()
        if not value:
            raise InvalidInputError("--allocation slurm: SLURM_JOB_NODELIST is not set (not inside a Slurm job?)")
        return value
    return str(args.allocation)


def _cmd_cluster(args: argparse.Namespace) -> int:
    """``placement cluster``: the cluster file from the scheduler (placement/sources/discovery/)."""
    from placement.sources.discovery import cluster_from_kubernetes, cluster_from_nvidia_smi, cluster_from_slurm, write_cluster

    _check_output_path(args.output)
    links = {"nvlink_gbps": args.nvlink_gbps, "scaleout_gbps": args.scaleout_gbps, "gpu_hbm_gb": args.gpu_hbm_gb}
    if args.hbm_reserve_gb is not None:
        links["hbm_reserve_gb"] = args.hbm_reserve_gb
    name = args.name or args.source
    for flag, value in (("--nvlink-gbps", args.nvlink_gbps), ("--scaleout-gbps", args.scaleout_gbps),
                        ("--gpu-hbm-gb", args.gpu_hbm_gb)):
        if not (math.isfinite(value) and value > 0):
            raise InvalidInputError(f"{flag}: expected a positive number, found {value}")
    import warnings

    from placement.sources.discovery import DiscoveryWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DiscoveryWarning)
        if args.source == "slurm":
            doc = cluster_from_slurm(args.inputs, name=name, gpus_per_node=args.gpus_per_node,
                                     allow_not_responding=args.allow_not_responding, skip_unready=args.skip_unready, **links)
        elif args.source == "kubernetes":
            doc = cluster_from_kubernetes(args.inputs, name=name, down_taints=args.down_taint or (),
                                          skip_unready=args.skip_unready, **links)
        else:
            doc = cluster_from_nvidia_smi(args.inputs, name=name, skip_unready=args.skip_unready, **links)
    for w in caught:  # one line per host left out or with unusable GPUs
        if issubclass(w.category, DiscoveryWarning):
            print(f"placement: warning: {_one_line(str(w.message))}", file=sys.stderr)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    write_cluster(args.output, doc)
    print(f"{doc['description']}\n  wrote {args.output}")
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


def _moves_lines(previous: str, mv: dict) -> list[str]:
    """What the re-placement moved and gained against the previous placement."""
    lines = [f"  re-placement of {previous}: {mv['moved_replicas']:,} of {mv['replicas_total']:,} expert replicas moved "
             f"({100 * mv['moved_share']:.1f}%), {_gb(mv['moved_bytes_cross_rack'])} across racks, "
             f"{_gb(mv['moved_bytes_nvlink'])} over NVLink ({_gb(mv['bytes_per_replica'])} each), "
             f"move time {mv['move_time_s']:.3g} s"]
    gain = mv.get("gain", {})
    parts = []
    if "heldout_cross_domain_bytes_per_step" in gain:
        parts.append(f"cross-domain bytes (h-o) {_gb(gain['heldout_cross_domain_bytes_per_step'])}")
    if "heldout_predicted_step_time_s" in gain:
        parts.append(f"predicted step time (h-o) {gain['heldout_predicted_step_time_s']:.4g} s")
    if parts:
        lines.append("  gain per step against the previous placement: " + ", ".join(parts))
    if mv.get("payback_steps") is not None:
        lines.append(f"  the move pays back in {mv['payback_steps']:.3g} steps (move time / step time gained)")
    elif mv.get("payback_steps_bytes") is not None:
        lines.append(f"  the move pays back in {mv['payback_steps_bytes']:.3g} steps (cross-rack bytes moved / "
                     "cross-domain bytes saved per step)")
    elif mv["moved_replicas"]:
        lines.append("  the move does not pay back: no held-out gain")
    return lines


def _footprint_lines(instance: Instance, result: SolveResult) -> list[str]:
    """Each pipeline stage's GPUs per NVLink domain: one line per stage that straddles domains."""
    from solvers.layout import stage_footprints

    feet = (result.details.get("layout") or {}).get("stage_footprints") if isinstance(result.details, dict) else None
    if feet is None:
        feet = stage_footprints(instance, result.placement.rank2gpu)
    whole = [f"s{s} d{f[0][0]}" for s, f in enumerate(feet) if len(f) == 1]
    lines = [f"  stages inside one NVLink domain: {len(whole)} of {len(feet)}" + (f" ({', '.join(whole)})" if whole else "")]
    for s, f in enumerate(feet):
        if len(f) > 1:
            lines.append(f"  stage {s} over {len(f)} domains (domain:GPUs): " + " + ".join(f"d{d}:{n}" for d, n in f))
    split = result.details.get("pipeline_layout") if isinstance(result.details, dict) else None
    if split:  # the pipeline layer split the solve chose (placement.predict.pipeline_split)
        own = split["candidates"]["instance"]
        lines.append(f"  pipeline layout: {split['chosen']} (instance's {own['layout']}; predicted step, sampled: "
                     f"{split['candidates'][split['candidate']]['predicted_step_time_s']:.4g} s against "
                     f"{own['predicted_step_time_s']:.4g} s)")
    return lines


def _cmd_export(args: argparse.Namespace) -> int:
    import warnings

    from placement.consumers.export import LaunchWarning, export_file

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LaunchWarning)
        files = export_file(args.format, args.placement, args.output, args.instance, keep_router=args.keep_router,
                            apply=args.apply)
    for w in caught:
        if issubclass(w.category, LaunchWarning):
            print(f"placement: warning: {_one_line(str(w.message))}", file=sys.stderr)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    for path, text in files.items():
        print(f"wrote {path} ({args.format}, {len(text.encode()):,} bytes)")
    return EXIT_OK


def _cmd_verify(args: argparse.Namespace) -> int:
    from placement.app.verify import verify_files

    rep = verify_files(args.instance, args.placement)
    if rep.violations:
        n = len(rep.violations)
        print(f"placement: verify: {n} violation{'s' if n != 1 else ''} in {args.placement}", file=sys.stderr)
        for message in rep.violations:
            print(message, file=sys.stderr)
        return EXIT_INVALID
    print(f"valid: {args.placement} for {args.instance} (checks: {', '.join(rep.checks)})")
    for note in rep.notes:
        print(f"  note: {note}")
    return EXIT_OK


def _cmd_show(args: argparse.Namespace) -> int:
    from placement.app.show import show_files

    out = show_files(args.placement, args.instance, args.output, window=args.window)
    print(f"wrote {out} (rack map, {out.stat().st_size:,} bytes)")
    return EXIT_OK


def _cmd_plan(args: argparse.Namespace, started_at: float) -> int:
    """``placement plan``: the job's layout for the free GPUs (placement/plan/)."""
    from placement.core.executor import make_executor
    from placement.plan import parse_candidates, plan, plan_document, plan_table, read_cluster, read_job, write_plan

    if not (math.isfinite(args.time_limit) and args.time_limit > 0):
        raise InvalidInputError(f"--time-limit: expected a positive number of seconds, found {args.time_limit}")
    if args.seed < 0:
        raise InvalidInputError(f"--seed: expected a non-negative integer, found {args.seed}")
    if args.output:
        _check_output_path(args.output)
    exports: dict[str, str] = {}
    for item in args.export or []:
        fmt, sep, target = item.partition("=")
        if not sep or not target:
            raise InvalidInputError(f"--export: expected FORMAT=PATH, found {item!r}")
        from placement.consumers.export import FORMATS

        if fmt not in FORMATS:
            raise InvalidInputError(f"--export: expected a format among {', '.join(FORMATS)}, found {fmt!r}")
        _check_output_path(target)
        exports[fmt] = target
    if exports and not args.output:
        raise InvalidInputError("--export: needs -o (the placement file it exports is written beside the plan)")
    if args.ray_address and args.executor != "ray":
        raise InvalidInputError("--ray-address: only with --executor ray")
    job = read_job(args.job)
    cluster = read_cluster(args.cluster)
    allocation = _allocation(args)
    if allocation is not None:
        import dataclasses

        from placement.api import allocate_cluster

        cluster = dataclasses.replace(cluster, cluster=allocate_cluster(cluster.cluster, allocation))
    space = parse_candidates(args.candidates) if args.candidates else None
    executor = make_executor(args.executor, workers=args.workers, address=args.ray_address)
    try:
        with progress_bar(None, "plan: candidates", "item", quiet=args.quiet) as bar:
            result = plan(job, cluster, candidates=space, time_limit_s=args.time_limit, seed=args.seed,
                          executor=executor, started_at=started_at, on_progress=bar.report)
    finally:
        executor.close()
    if args.output:
        written = write_plan(result, args.output, exports=exports)
    if args.json:
        print(json.dumps(plan_document(result), indent=1, sort_keys=True))
    else:
        print(plan_table(result, top=args.top))
        if args.output:
            print("wrote " + ", ".join(str(p) for p in written.values()))
    return EXIT_OK


def _cmd_import(args: argparse.Namespace) -> int:
    from placement.api import import_routing, save_instance

    _check_output_path(args.output)
    with progress_bar(None, "import: traces read", "B", quiet=args.quiet, unit_scale=True) as bar:
        instance = import_routing(
            args.source,
            args.traces,
            base=args.base,
            model=args.model,
            parallel=args.parallel,
            cluster=args.cluster,
            name=args.name,
            cost_mode=args.cost_mode,
            heldout_steps=args.heldout_steps,
            max_tokens_per_source=args.max_tokens_per_source,
            windows=args.windows,
            on_progress=bar.report,
        )
    save_instance(instance, args.output)
    windows = instance.extra["generator"]["windows"]
    r = instance.routing
    assert r.heldout_topk is not None
    if "sampled" in windows:  # --windows N > 1
        fit_text = " + ".join(f"{w['tokens_per_source']} ({len(w['steps'])} steps)" for w in windows["sampled"])
        fit_text = f"{len(windows['sampled'])} sampled windows of {fit_text} tokens/source"
    else:
        fit_text = f"fit {r.topk.shape[2]} tokens/source ({len(windows['fit']['steps'])} steps)"
    print(
        f"{instance.name}: {instance.model.num_moe_layers} MoE layers x {instance.parallel.dp} sources; "
        f"{fit_text}, "
        f"held-out {r.heldout_topk.shape[2]} tokens/source ({len(windows['heldout']['steps'])} steps)"
    )
    print(f"  wrote {args.output} and {Path(args.output).with_suffix('.npz')}")
    return EXIT_OK


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from placement.api import calibrate
    from placement.formats import atomic_write_bytes

    from placement.predict.calibration import DEFAULT_FIT, format_table

    fit = [f for f in args.fit.split(",") if f] if args.fit else list(DEFAULT_FIT)
    if not args.from_logs:
        for flag in ("gpu", "gpus", "config", "write_rows"):
            if getattr(args, flag) is not None:
                raise InvalidInputError(f"--{flag.replace('_', '-')}: only with --from-logs")
    if args.cross_validate:
        if args.from_logs:
            raise InvalidInputError("--cross-validate: not with --from-logs (write the rows with --write-rows, then "
                                    "cross-validate that file)")
        from placement.predict.calibration import cross_validate, default_ladder_path, format_cross_validation, read_ladder

        cv = cross_validate(read_ladder(args.rows or default_ladder_path()), fit)
        print(format_cross_validation(cv))
        if args.output:
            atomic_write_bytes(args.output, (json.dumps(cv.to_dict(), indent=1, sort_keys=True) + "\n").encode())
            print(f"wrote {args.output}")
        return EXIT_OK
    cal = _calibrate_from_logs(args, fit) if args.from_logs else calibrate(args.rows, fit)

    print(format_table(cal))
    if args.output:
        doc = cal.to_dict()
        atomic_write_bytes(args.output, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())
        print(f"wrote {args.output}")
    return EXIT_OK


def _calibrate_from_logs(args: argparse.Namespace, fit: list[str]) -> Calibration:
    """``placement calibrate --from-logs``: one ladder row per training log (docs/runlogs.md),
    after the rows of ``ROWS`` when it is given; ``--write-rows`` keeps them as a ladder file."""
    from placement.predict.calibration import calibrate as calibrate_rows, ladder_rows, read_ladder
    from placement.formats import atomic_write_bytes
    from placement.sources.runlogs import rows_document, rows_from_logs

    if args.gpu is None:
        raise InvalidInputError("--gpu: required with --from-logs (a training log does not say the GPU kind)")
    log_rows = rows_from_logs(args.from_logs, args.gpu, gpus=args.gpus, config=args.config)
    doc = rows_document(log_rows)
    rows = ladder_rows(doc, "--from-logs")
    if args.rows is not None:
        ladder = read_ladder(args.rows)
        taken = {r.name for r in ladder}
        clash = [r.name for r in rows if r.name in taken]
        if clash:
            raise InvalidInputError(f"--from-logs: a log's row name {clash[0]!r} is also a row of {args.rows} (rename the log)")
        rows = ladder + rows
    for row in log_rows:
        print(f"{row['name']}: {row['family']} on {row['gpus']} {row['gpu']}, {row['note']}")
    cal = calibrate_rows(rows, fit)
    if args.write_rows:
        atomic_write_bytes(args.write_rows, (json.dumps(doc, indent=1) + "\n").encode())
        print(f"wrote {args.write_rows}")
    return cal


def _cmd_stats(args: argparse.Namespace) -> int:
    from placement.api import load_instance, routing_stats

    instance = load_instance(args.instance)
    st = routing_stats(instance, distance=args.distance)
    drift = None
    if args.against is not None:
        from placement.core.stats import routing_drift

        other = load_instance(args.against)
        try:
            drift = routing_drift(instance, other)
        except ValueError as exc:
            raise InvalidInputError(f"{args.against}: {exc}") from None
        st["drift"] = drift
    if args.json:
        print(json.dumps(st, sort_keys=True))
        return EXIT_OK
    sm = st["summary"]
    tok = st["tokens_per_source"]

    def f(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.3f}"

    print(f"{instance.name}: routing of {st['moe_layers']} MoE layers, {st['sources']} sources, "
          f"{st['num_experts']} experts, top-{st['top_k']}")
    print(f"  tokens per source: fit {tok['fit']}, held-out {tok['heldout']}")
    print(f"  {'median over MoE layers':<44}{'value':>10}{'null':>10}")
    print(f"  {'expert load max/mean, all sources':<44}{f(sm['load_max_over_mean']):>10}"
          f"   (worst layer {f(sm['load_max_over_mean_worst'])})")
    print(f"  {'expert load max/mean, per source (mean)':<44}{f(sm['source_load_max_over_mean']):>10}")
    print(f"  {'source difference (mean pairwise TV)':<44}{f(sm['source_tv']):>10}{f(sm['source_tv_null']):>10}")
    label = f"co-activation d={st['coactivation_distance']}, top {st['coactivation_partners']} share"
    print(f"  {label:<44}{f(sm['coactivation']):>10}{f(sm['coactivation_null']):>10}")
    print(f"  {'fit vs held-out load TV (mean)':<44}{f(sm['window_tv_mean']):>10}")
    print(f"  {'fit vs held-out top-8 partners kept':<44}{f(sm['window_partner_overlap']):>10}")
    print("  (null: tokens shuffled across sources, or the later layer's tokens shuffled: independent routing)")
    if drift is not None:
        ds = drift["summary"]
        print(f"  drift against {drift['instances'][1]} (fit windows):")
        print(f"  {'load TV':<44}{f(ds['load_tv']):>10}")
        print(f"  {'top-8 partners kept':<44}{f(ds['partner_overlap']):>10}")
    return EXIT_OK


_ALLOCATION_HELP = (
    "only these hosts: a Slurm host list like 'gb[001-018,025]' (e.g. \"$SLURM_JOB_NODELIST\"), or 'slurm' for "
    "SLURM_JOB_NODELIST; host names are the cluster's (cluster.hosts from placement cluster). Never implicit"
)


def redundant_count(value: str) -> int | str:
    """``--redundant-experts``: an integer or ``auto`` (placement.formats.replicas.choose_redundant_experts)."""
    return "auto" if value == "auto" else int(value)


def build_parser() -> argparse.ArgumentParser:
    from solvers import CONSUMERS, LAYOUT_MODES, OBJECTIVES, SOLVERS
    from placement.api import DEFAULT_SOLVER

    parser = _Parser(prog="placement", description="Topology-aware expert placement for MoE training.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    ev = sub.add_parser("evaluate", help="score a placement (or the default layout) with the cost model")
    ev.add_argument("instance", help="instance JSON file")
    ev.add_argument("--placement", default="default", help="placement file, or 'default' (the default layout)")
    ev.add_argument("--json", action="store_true", help="print the metrics as JSON with stable keys")

    so = sub.add_parser("solve", help="optimize the placement of ranks and experts")
    so.add_argument("instance", help="instance JSON file")
    so.add_argument("-o", "--output", help="write the placement file here (atomically)")
    so.add_argument("--solver", default=DEFAULT_SOLVER, choices=sorted(SOLVERS))
    so.add_argument("--time-limit", type=float, default=100.0, metavar="S", help="wall-clock limit of the whole command (default 100)")
    so.add_argument("--seed", type=int, default=0)
    so.add_argument("--workers", type=int, default=None, help="solver workers (default: the cores available)")
    so.add_argument("--consumer", default=None, choices=CONSUMERS,
                    help="layout rule of the dispatcher (default: the instance's performance.dispatcher, "
                         "hybridep/deepep -> its equal-slice rule, else none)")
    so.add_argument("--apply", default=None, choices=("runtime", "checkpoint"),
                    help="how the expert maps reach the job. runtime (the default, unless the instance's apply "
                         "says otherwise): mapped at dispatch time (placement.consumers.runtime hooks for Megatron-Core and "
                         "TorchTitan with a keep-router checkpoint permutation; SGLang and vLLM expert maps), any "
                         "map; checkpoint: router and experts renumbered offline, so under group-limited routing "
                         "the maps keep expert groups whole")
    so.add_argument("--group-preserving", default="auto", choices=("auto", "on", "off"),
                    help="deprecated override of the expert-map mode: auto (default) follows --apply "
                         "(group-preserving exactly with checkpoint under group-limited routing); on restricts "
                         "any solve to group-preserving maps; off = fit free maps (refused with --apply checkpoint "
                         "under group-limited routing; by default a runtime solve under group-limited routing fits "
                         "group-preserving maps, then weighs free ones)")
    so.add_argument("--free", dest="group_preserving", action="store_const", const="off",
                    help="deprecated: same as --group-preserving off (fit free maps)")
    so.add_argument("--objective", default="step_time", choices=OBJECTIVES,
                    help="step_time (default): fastest predicted step (the performance model on the evaluator's "
                         "metrics, bytes break ties; total when the instance has no performance block); total: fewest cross-domain bytes with no stage slower than the default layout's "
                         "slowest; bottleneck: the slowest stage's all-to-all time")
    so.add_argument("--layout", default=None, choices=LAYOUT_MODES,
                    help="optimize the rank -> GPU map (default), or keep the default one (fixed); with "
                         "--previous the previous rank layout is kept")
    so.add_argument("--fit", default="robust", choices=("robust", "mean", "latest"),
                    help="instances with several sampled windows (routing.window_tokens): fit the expert maps to the "
                         "worst window (robust, default), their mean, or the latest only; the guard against the "
                         "default map judges on the latest window. No effect with one window")
    so.add_argument("--keep-pipeline-layout", action="store_true",
                    help="keep the instance's pipeline layer split (default: choose it for the placement, "
                         "docs/pipeline_layout.md)")
    so.add_argument("--json", action="store_true", help="print the result as JSON")
    so.add_argument("--redundant-experts", type=redundant_count, default=0, metavar="N",
                    help="N extra expert slots per MoE layer for replicas of hot experts (N / ep per GPU; E + N must "
                         "divide over ep, as SGLang's --ep-num-redundant-experts; docs/replicas.md); auto: the one of "
                         "0, ep, 2 ep with the fastest predicted step")
    so.add_argument("--replica-memory-budget", type=float, default=None, metavar="GB",
                    help="GB per GPU the redundant slots may take: auto skips the counts over it, a fixed N over it "
                         "is refused (default: no budget)")
    so.add_argument("--replica-rule", default="search", choices=("search", "hottest", "eplb"),
                    help="how the replicas are chosen (default search: per layer CP-SAT / local search priced by the "
                         "evaluator, never worse than hottest or eplb; eplb: DeepSeek EPLB's replicate_experts)")
    so.add_argument("--allocation", metavar="HOSTS", help=_ALLOCATION_HELP)
    so.add_argument("-q", "--quiet", action="store_true", help=_QUIET_HELP)
    mv = so.add_argument_group("re-placement (docs/experts.md, 'Re-placement')")
    mv.add_argument("--previous", metavar="OLD.json",
                    help="re-place against this placement file (same instance shape), or 'default': keep its "
                         "rank layout, change expert maps only, report what moves")
    rule = mv.add_mutually_exclusive_group()
    rule.add_argument("--max-moved-bytes", metavar="B",
                      help="hard budget on the expert state moved (cross-rack plus NVLink), in bytes or as a "
                           "share of all expert replicas' state (10%%); 0 keeps the previous placement")
    rule.add_argument("--move-cost", type=float, metavar="W",
                      help="a moved byte costs W bytes of per-step all-to-all (1/N: amortised over N steps; "
                           "NVLink bytes weigh scaleout/nvlink); default 0 (moves free, ties keep experts)")
    mv.add_argument("--expert-params", type=int, metavar="N",
                    help="parameters per routed expert (default: from the instance's performance block)")
    mv.add_argument("--optimizer-state", default="sharded", choices=("sharded", "replicated"),
                    help="optimizer state sharded over an expert's replicas (distributed optimizer, default) or "
                         "held whole by each")

    from placement.consumers.export import FORMATS

    ex = sub.add_parser("export", help="write a placement in a format a training or serving stack reads")
    ex.add_argument("placement", help="placement file")
    ex.add_argument("--format", required=True, choices=FORMATS, help="target stack (docs/formats.md)")
    ex.add_argument("-o", "--output", required=True, help="output file (written atomically)")
    ex.add_argument("--instance", help="the instance file the placement was solved for (required except for vllm)")
    ex.add_argument("--apply", default=None, choices=("runtime", "checkpoint"),
                    help="megatron/torchtitan: runtime writes the keep-router permutation (the experts move in the "
                         "checkpoint, the router does not) that placement.consumers.runtime's hooks also install; checkpoint "
                         "the permutation of router and experts (group-preserving maps under group-limited routing). "
                         "Default: what the placement was solved for (its apply), else the instance's (runtime)")
    ex.add_argument("--keep-router", action="store_true",
                    help="same as --apply runtime (kept for older scripts)")

    from placement.sources.importers import DEFAULT_MAX_TOKENS_PER_SOURCE, SOURCES

    im = sub.add_parser("import", help="build an instance from recorded routing traces (README: bring your own)")
    im.add_argument("traces", nargs="+", metavar="TRACES", help="trace files of every rank")
    im.add_argument("--from", dest="source", required=True, choices=SOURCES, help="the stack that recorded them")
    im.add_argument("-o", "--output", required=True, help="instance JSON to write (with its .npz), atomically")
    im.add_argument("--base", help="instance JSON whose model, parallel and cluster sections to use")
    im.add_argument("--model", help="JSON of the model section (or an instance file); overrides --base")
    im.add_argument("--parallel", help="JSON of the parallel section (or an instance file); overrides --base")
    im.add_argument("--cluster", help="JSON of the cluster section (or an instance file); overrides --base")
    im.add_argument("--name", help="instance name (default: the base's, else 'imported')")
    im.add_argument("--cost-mode", choices=("per_domain", "per_pair"), help="default: the base's, else per_domain")
    im.add_argument("--heldout-steps", type=int, default=None, metavar="N",
                    help="last N steps (forward passes, requests) form the held-out window (default: a quarter)")
    im.add_argument("--max-tokens-per-source", type=int, default=DEFAULT_MAX_TOKENS_PER_SOURCE, metavar="N",
                    help=f"cap on tokens kept per source and window (default {DEFAULT_MAX_TOKENS_PER_SOURCE})")
    im.add_argument("--windows", type=int, default=1, metavar="N",
                    help="cut the fit steps into N time-ordered sampled windows, for solve --fit (default 1)")
    im.add_argument("-q", "--quiet", action="store_true", help=_QUIET_HELP)

    st = sub.add_parser("stats", help="routing statistics of an instance: what to check before trusting a solve")
    st.add_argument("instance", help="instance JSON file")
    st.add_argument("--distance", type=int, default=1, help="MoE-layer distance of the co-activation statistic")
    st.add_argument("--json", action="store_true", help="print every statistic as JSON")
    st.add_argument("--against", metavar="INSTANCE", help="also the drift (load TV, top-8 partners kept) against this instance")

    ve = sub.add_parser("verify", help="check a placement file against its instance; exit 2 listing every violation")
    ve.add_argument("instance", help="instance JSON file")
    ve.add_argument("placement", help="placement file")

    from placement.core.executor import EXECUTOR_NAMES
    from placement.plan import DEFAULT_PLAN_TIME_LIMIT_S

    pl = sub.add_parser("plan", help="choose the job's parallel layout and placement for the free GPUs (docs/plan.md)")
    pl.add_argument("job", help="job JSON file (model, batch, precision, routing source)")
    pl.add_argument("--cluster", required=True, help="cluster JSON file (racks, trays down, links, GPU HBM)")
    pl.add_argument("--candidates", metavar="SPEC", help="restrict the candidate set, e.g. 'pp=8,16 ep=32,64' (tp cp pp vpp ep dp mb)")
    pl.add_argument("-o", "--output", help="write the plan JSON here, and beside it the recommendation's instance, placement and rack map")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON with stable keys")
    pl.add_argument("--time-limit", type=float, default=DEFAULT_PLAN_TIME_LIMIT_S, metavar="S",
                    help=f"wall-clock budget of the whole plan (default {DEFAULT_PLAN_TIME_LIMIT_S:g})")
    pl.add_argument("--seed", type=int, default=0)
    pl.add_argument("--executor", default="local", choices=EXECUTOR_NAMES, help="where candidate solves run (default local)")
    pl.add_argument("--ray-address", default=None, metavar="ADDR", help="Ray cluster address (--executor ray)")
    pl.add_argument("--workers", type=int, default=None, help="worker processes (local) or CPUs (ray); default: the cores available")
    pl.add_argument("--export", action="append", metavar="FORMAT=PATH",
                    help="also export the recommendation as placement export writes it (repeatable; needs -o)")
    pl.add_argument("--top", type=int, default=10, help="rows of the table (default 10)")
    pl.add_argument("--allocation", metavar="HOSTS", help=_ALLOCATION_HELP)

    from placement.sources.discovery import DEFAULT_GPU_HBM_GB, DEFAULT_NVLINK_GBPS, DEFAULT_SCALEOUT_GBPS, SOURCES as CLUSTER_SOURCES

    cl = sub.add_parser("cluster", help="write a cluster file from Slurm, Kubernetes or nvidia-smi (docs/formats.md)")
    cl.add_argument("inputs", nargs="*", metavar="INPUT",
                    help="slurm: scontrol show topology output or topology.conf, and scontrol show node output (none: "
                         "run scontrol); kubernetes: kubectl get nodes -o json; nvidia-smi: nvidia-smi -q of each "
                         "host as HOST=PATH or HOST.txt")
    cl.add_argument("--from", dest="source", required=True, choices=CLUSTER_SOURCES, help="where the cluster is read")
    cl.add_argument("-o", "--output", required=True, help="cluster JSON to write (atomically)")
    cl.add_argument("--name", help="name of the cluster state (default: the source)")
    cl.add_argument("--nvlink-gbps", type=float, default=DEFAULT_NVLINK_GBPS,
                    help=f"NVLink bandwidth per GPU, 10^9 B/s (default {DEFAULT_NVLINK_GBPS:g}, GB300 NVL72)")
    cl.add_argument("--scaleout-gbps", type=float, default=DEFAULT_SCALEOUT_GBPS,
                    help=f"scale-out NIC bandwidth per GPU and direction, 10^9 B/s (default {DEFAULT_SCALEOUT_GBPS:g})")
    cl.add_argument("--gpu-hbm-gb", type=float, default=DEFAULT_GPU_HBM_GB,
                    help=f"HBM per GPU, 10^9 B (default {DEFAULT_GPU_HBM_GB:g}, GB300)")
    cl.add_argument("--hbm-reserve-gb", type=float, default=None, help="HBM per GPU kept free (default: plan's)")
    cl.add_argument("--gpus-per-node", type=int, default=None,
                    help="slurm without scontrol show node output: GPUs of every node")
    cl.add_argument("--allow-not-responding", action="store_true",
                    help="slurm: count nodes whose slurmd does not answer (NOT_RESPONDING, *) as usable")
    cl.add_argument("--down-taint", action="append", metavar="KEY",
                    help="kubernetes: a NoSchedule/NoExecute taint key that also marks a node down (repeatable)")
    cl.add_argument("--skip-unready", action="store_true",
                    help="leave out, with a one-line warning each, hosts whose NVLink domain is not known yet "
                         "(nvidia-smi: no GPU registered in the fabric; kubernetes: no nvidia.com/gpu.clique label; "
                         "slurm: in no block or leaf switch) instead of refusing them")
    pl.add_argument("-q", "--quiet", action="store_true", help=_QUIET_HELP)

    ca = sub.add_parser("calibrate", help="predict measured runs, fit the step-time model on them (docs/performance.md)")
    ca.add_argument("rows", nargs="?", default=None,
                    help="ladder file of measured runs (docs/formats.md; default: the published ladder shipped with the package)")
    ca.add_argument("--fit", default=None, metavar="NAMES",
                    help="comma-separated parameters to fit on the rows marked fit: gemm_efficiency (one ceiling per GPU "
                         "kind) and at most three of gemm_half_shape, fp8_gemm_ratio, elementwise_bytes, layer_overhead_s, "
                         "expert_gemm_efficiency, overlap_efficiency (default gemm_efficiency,fp8_gemm_ratio,"
                         "elementwise_bytes,layer_overhead_s,overlap_efficiency)")
    ca.add_argument("--cross-validate", action="store_true",
                    help="print leave-one-configuration-out and leave-one-model-family-out errors of every row "
                         "(each fit on all other rows; docs/performance.md)")
    ca.add_argument("-o", "--output", help="write the fitted performance block and every row's prediction (JSON, atomic)")
    ca.add_argument("--from-logs", nargs="+", default=None, metavar="LOG",
                    help="training logs (Megatron-LM, Megatron-Bridge, TorchTitan), one run each, as rows to predict "
                         "and fit on, after ROWS' rows when ROWS is given (docs/runlogs.md)")
    ca.add_argument("--gpu", default=None, metavar="KIND", help="--from-logs: the GPU kind the runs used (h100, gb200, ...)")
    ca.add_argument("--gpus", type=int, default=None, metavar="N",
                    help="--from-logs: GPUs of the job, for logs that do not say it (Megatron-Bridge)")
    ca.add_argument("--config", default=None, metavar="TOML",
                    help="--from-logs: TorchTitan's job configuration (a TOML file, or its launch arguments in one string)")
    ca.add_argument("--write-rows", default=None, metavar="ROWS.json",
                    help="--from-logs: write the logs' rows as a ladder file (placement calibrate ROWS.json reads it)")

    sh = sub.add_parser("show", help="draw a placement as a rack map (PNG or SVG)")
    sh.add_argument("placement", help="placement file, or 'default' (the default layout; needs -o)")
    sh.add_argument("--instance", help="the instance file the placement was solved for (required)")
    sh.add_argument("-o", "--output", help="map.png or map.svg, written atomically (default: the placement file with .png)")
    sh.add_argument("--window", default=None, choices=("heldout", "sampled"),
                    help="tokens the bytes are computed on (default heldout)")
    return parser


def _one_line(message: str) -> str:
    """Escape newlines and other unprintable characters so that an error stays one line."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in message)


def _process_started_at() -> float:
    """The ``time.monotonic()`` instant this process started (Linux), else now.

    So that ``--time-limit`` also covers interpreter start-up and imports.
    """
    now = time.monotonic()
    try:
        with open("/proc/self/stat", "rb") as fh:
            stat = fh.read()
        fields = stat[stat.rindex(b")") + 2 :].split()  # fields from the 3rd (state) on
        start_s = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # the 22nd: start, ticks since boot
        age_s = time.clock_gettime(time.CLOCK_BOOTTIME) - start_s
    except (OSError, ValueError, IndexError, AttributeError):
        return now
    return now - age_s if 0.0 <= age_s < 60.0 else now


def main(argv: Sequence[str] | None = None, *, started_at: float | None = None) -> int:
    """Run the command line; returns the exit code.

    ``started_at``: the ``time.monotonic()`` instant the time limit counts from (default: now;
    the console script passes the process start).
    """
    started_at = time.monotonic() if started_at is None else started_at
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command == "evaluate":
            return _cmd_evaluate(args)
        if args.command == "solve":
            if args.seed < 0:
                raise InvalidInputError(f"--seed: expected a non-negative integer, found {args.seed}")
            if args.workers is not None and args.workers < 1:
                raise InvalidInputError(f"--workers: expected a positive integer, found {args.workers}")
            if not (math.isfinite(args.time_limit) and args.time_limit > 0):
                raise InvalidInputError(f"--time-limit: expected a positive number of seconds, found {args.time_limit}")
            with SignalStop() as stop:
                return _cmd_solve(args, started_at, stop)
        if args.command == "export":
            return _cmd_export(args)
        if args.command == "verify":
            return _cmd_verify(args)
        if args.command == "show":
            return _cmd_show(args)
        if args.command == "plan":
            return _cmd_plan(args, started_at)
        if args.command == "cluster":
            return _cmd_cluster(args)
        if args.command == "import":
            if args.heldout_steps is not None and args.heldout_steps < 1:
                raise InvalidInputError(f"--heldout-steps: expected a positive integer, found {args.heldout_steps}")
            return _cmd_import(args)
        if args.command == "calibrate":
            return _cmd_calibrate(args)
        if args.command == "stats":
            if args.distance < 1:
                raise InvalidInputError(f"--distance: expected a positive integer, found {args.distance}")
            return _cmd_stats(args)
        raise InvalidInputError(f"unknown command {args.command!r}")  # pragma: no cover
    except PlacementError as exc:
        print(f"placement: error: {_one_line(str(exc))}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:  # SIGINT outside a solve, or Interrupted from SignalStop
        signum = getattr(exc, "signum", signal.SIGINT)
        print(f"placement: interrupted by {signal.Signals(signum).name}, nothing written", file=sys.stderr)
        return 128 + signum
    except BrokenPipeError:
        return EXIT_ERROR
    except MemoryError:
        print("placement: error: out of memory", file=sys.stderr)
        return EXIT_ERROR
    except Exception as exc:  # noqa: BLE001 - the CLI never shows a traceback
        print(f"placement: error: internal: {type(exc).__name__}: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_ERROR


def entry() -> None:
    sys.exit(main(started_at=_process_started_at()))


if __name__ == "__main__":  # python -m placement.cli
    entry()
