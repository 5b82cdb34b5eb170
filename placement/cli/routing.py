"""``placement import``, ``stats`` and ``calibrate``: recorded routing and measured runs in."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from placement.cli.common import _check_output_path, EXIT_OK
from placement.core.model import InvalidInputError
from placement.core.progress import progress as progress_bar

if TYPE_CHECKING:
    from placement.predict.calibration import Calibration


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
        from placement.api import cross_validate
        from placement.predict.calibration import format_cross_validation

        cv = cross_validate(args.rows, fit)
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
    from placement.api import calibrate, ladder_from_logs
    from placement.formats import atomic_write_bytes

    if args.gpu is None:
        raise InvalidInputError("--gpu: required with --from-logs (a training log does not say the GPU kind)")
    logs = ladder_from_logs(args.from_logs, args.gpu, gpus=args.gpus, config=args.config, ladder=args.rows,
                            where="--from-logs")
    for row in logs.log_rows:
        print(f"{row['name']}: {row['family']} on {row['gpus']} {row['gpu']}, {row['note']}")
    cal = calibrate(logs.rows, fit)
    if args.write_rows:
        atomic_write_bytes(args.write_rows, (json.dumps(logs.document, indent=1) + "\n").encode())
        print(f"wrote {args.write_rows}")
    return cal


def _cmd_stats(args: argparse.Namespace) -> int:
    from placement.api import load_instance, routing_stats

    instance = load_instance(args.instance)
    st = routing_stats(instance, distance=args.distance)
    drift = None
    if args.against is not None:
        from placement.api import routing_drift

        drift = routing_drift(instance, load_instance(args.against), where=args.against)
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
