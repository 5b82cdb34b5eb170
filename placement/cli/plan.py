"""``placement plan`` and ``placement cluster``: the job's layout for the free GPUs, the cluster file."""

from __future__ import annotations

import argparse
import json
import math
import sys

from placement.cli.common import _allocation, _check_output_path, EXIT_OK, _one_line
from placement.core.model import InvalidInputError
from placement.core.progress import progress as progress_bar


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
