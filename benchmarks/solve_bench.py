"""The default layout against the solver, on every committed instance, in one run.

For each instance (``instances/*.json`` by default) and each requested rank-layout mode, the solver
(``cpsat`` unless ``--solver``) runs at ``--time-limit`` seconds; the default layout and the answer are
scored by the same evaluator (:func:`placement.predict.report.report`) in the same run:

- cross-domain all-to-all bytes per step, sampled and held-out tokens;
- the largest per-GPU scale-out bytes (busiest NIC, one direction), held-out;
- expert load max/mean per GPU (worst layer), held-out;
- solve wall time (the ``placement.solve`` call: solver, check and scoring), status, bound and gap,
  layers proved.

``--layouts optimize,fixed`` separates the two levers: ``fixed`` keeps the default rank layout, so
its row is the expert placer alone.  Timings depend on the machine's load; the load average is
recorded with every row.

``--calibrate`` measures instead CP-SAT's deterministic time per wall second on this machine (one
worker, on a straddling dsv3_1024 layer's full model), the ratio behind
``solvers.experts.DET_PER_WALL_S``.

Usage::

    python benchmarks/solve_bench.py [--instances NAME|PATH ...] [--time-limit S] [--workers N]
                                     [--layouts optimize,fixed] [--seed N] [--json OUT] [--calibrate]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

import placement  # noqa: E402
from placement.predict.report import report  # noqa: E402
from placement.formats import atomic_write_text  # noqa: E402
from solvers.default import default_placement  # noqa: E402

__all__ = ["bench_instance", "markdown_table", "calibrate", "main"]

KEYS = (
    "cross_domain_bytes_per_step",
    "heldout_cross_domain_bytes_per_step",
    "heldout_max_gpu_cross_domain_bytes_per_step",
    "heldout_expert_load_max_over_mean",
    "heldout_remote_domains_per_token",
)


def _instance_paths(names: Sequence[str] | None) -> list[Path]:
    if not names:
        return sorted((ROOT / "instances").glob("*.json"))
    out = []
    for n in names:
        p = Path(n)
        out.append(p if p.suffix == ".json" else ROOT / "instances" / f"{n}.json")
    return out


def _load() -> float:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # pragma: no cover
        return float("nan")


def bench_instance(path: Path, *, solver: str, time_limit_s: float, workers: int, seed: int, layouts: Sequence[str]) -> dict:
    """One instance: the default layout's metrics and, per layout mode, the solver's, with ratios."""
    instance = placement.load_instance(path)
    base = report(instance, default_placement(instance))
    row: dict = {"instance": instance.name, "cost_mode": instance.cost_mode,
                 "default": {k: base[k] for k in KEYS}, "runs": []}
    for layout in layouts:
        load_before = _load()
        t0 = time.monotonic()
        result = placement.solve(instance, solver=solver, time_limit_s=time_limit_s, seed=seed,
                                 num_workers=workers, layout=layout)
        wall = time.monotonic() - t0
        m = result.metrics
        layers = result.details.get("layers", [])
        run = {
            "layout": layout,
            "solver": result.solver,
            "status": result.status,
            "wall_s": round(wall, 2),
            "load_avg_before": load_before,
            "load_avg_after": _load(),
            "metrics": {k: m[k] for k in KEYS},
            "ratio_to_default": {k: (m[k] / base[k] if base[k] else None) for k in KEYS},
            "objective_bytes": result.objective_bytes,
            "bound_bytes": result.bound_bytes,
            "partial_bound_bytes": result.details.get("partial_bound_bytes"),
            "gap": result.gap,
            "layers_proved": sum(1 for d in layers if d.get("status") in ("optimal", "trivial")),
            "layers_trivial": sum(1 for d in layers if d.get("status") == "trivial"),
            "layers": len(layers),
            "group_preserving": result.group_preserving,
        }
        row["runs"].append(run)
        print(f"  {instance.name} [{layout}]: {result.status}, {wall:.1f} s, held-out ratio "
              f"{run['ratio_to_default']['heldout_cross_domain_bytes_per_step']:.3f}", file=sys.stderr, flush=True)
    return row


def _tb(x: float | None) -> str:
    """Bytes in decimal units (kB = 10^3 B ... TB = 10^12 B), four significant figures."""
    if x is None:
        return "n/a"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:,.4g} {unit}"
    return f"{x:.0f} B"


def markdown_table(rows: Sequence[dict]) -> str:
    """One line per (instance, layout mode): default vs solved and their ratios."""
    head = ("| instance | layout | default (sampled / held-out) | solved (sampled / held-out) | ratio held-out "
            "| busiest NIC default -> solved (ratio) | load max/mean default -> solved | wall s | status "
            "| layers proved | bound (gap) |")
    lines = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    for row in rows:
        d = row["default"]
        for r in row["runs"]:
            m, q = r["metrics"], r["ratio_to_default"]
            bound = r["bound_bytes"] if r["bound_bytes"] is not None else r["partial_bound_bytes"]
            btxt = "n/a" if bound is None else (
                f"{_tb(bound)} ({100 * r['gap']:.1f}%)" if r["gap"] is not None
                else f"{_tb(bound)} (partial)")
            lines.append(
                f"| {row['instance']} | {r['layout']} "
                f"| {_tb(d['cross_domain_bytes_per_step'])} / {_tb(d['heldout_cross_domain_bytes_per_step'])} "
                f"| {_tb(m['cross_domain_bytes_per_step'])} / {_tb(m['heldout_cross_domain_bytes_per_step'])} "
                f"| {q['heldout_cross_domain_bytes_per_step']:.3f} "
                f"| {_tb(d['heldout_max_gpu_cross_domain_bytes_per_step'])} -> "
                f"{_tb(m['heldout_max_gpu_cross_domain_bytes_per_step'])} "
                f"({q['heldout_max_gpu_cross_domain_bytes_per_step']:.3f}) "
                f"| {d['heldout_expert_load_max_over_mean']:.2f} -> {m['heldout_expert_load_max_over_mean']:.2f} "
                f"| {r['wall_s']:.1f} | {r['status']} | {r['layers_proved']}/{r['layers']} "
                f"({r['layers_trivial']} trivial) | {btxt} |"
            )
    return "\n".join(lines)


def calibrate(seconds: float = 5.0) -> dict:
    """CP-SAT deterministic time per wall second, one worker, on a straddling dsv3_1024 layer."""
    import numpy as np

    from solvers.default import default_rank2gpu
    from solvers.experts import build_layer_problem, capped_greedy, linear_costs, run_cpsat

    inst = placement.load_instance(ROOT / "instances" / "dsv3_1024.json").for_solver()
    r2g = default_rank2gpu(inst)
    layer = next(li for li in range(inst.model.num_moe_layers)
                 if build_layer_problem(inst, r2g, li, group_preserving=False, validation_fraction=0).num_classes > 1)
    problem = build_layer_problem(inst, r2g, layer, group_preserving=False, validation_fraction=0)
    cap = problem.load_cap(0.05)
    hint = capped_greedy(problem, linear_costs(problem, problem.nets_all), cap)
    out = []
    for det in (0.5 * seconds, seconds):
        r = run_cpsat(problem, problem.nets_all, cap, hint, deterministic_time=det, wall_limit_s=20 * det, seed=0)
        out.append({"deterministic_time": r.deterministic_time, "wall_s": r.wall_s,
                    "det_per_wall_s": r.deterministic_time / max(r.wall_s, 1e-9)})
    return {"layer": layer, "load_avg": _load(), "runs": out,
            "det_per_wall_s": float(np.median([o["det_per_wall_s"] for o in out]))}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", nargs="*", help="names (instances/NAME.json) or paths; default: all committed")
    ap.add_argument("--solver", default="cpsat")
    ap.add_argument("--time-limit", type=float, default=100.0)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layouts", default="optimize", help="comma-separated: optimize, fixed")
    ap.add_argument("--json", default=None, help="also write the results here (JSON)")
    ap.add_argument("--calibrate", action="store_true", help="measure CP-SAT deterministic time per wall second")
    args = ap.parse_args(argv)
    if args.calibrate:
        res = calibrate()
        print(json.dumps(res, indent=2))
        return 0
    from solvers.base import default_workers

    workers = args.workers or default_workers()
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    rows = []
    for path in _instance_paths(args.instances):
        print(f"{path.name} ...", file=sys.stderr, flush=True)
        rows.append(bench_instance(path, solver=args.solver, time_limit_s=args.time_limit, workers=workers,
                                   seed=args.seed, layouts=layouts))
    table = markdown_table(rows)
    print(table)
    doc = {"schema_version": 1, "solver": args.solver, "time_limit_s": args.time_limit, "workers": workers,
           "seed": args.seed, "layouts": layouts, "rows": rows, "table": table}
    if args.json:
        atomic_write_text(args.json, json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
