"""Per-layer lower bounds of a solved placement's rank layout, and the whole-instance gap.

Reads an instance and a placement file written by ``placement solve -o`` (its ``solve.details``
hold every layer's crossings, load tolerance and the bound the solve reported) and recomputes every
layer's bound the way the expert placer does (:func:`solvers.experts.lower_bounds.layer_lower_bound`,
the larger of it and the bound in the file, within the search space: the maps within the layer's
load caps plus the default map, never above the layer's crossings).  A layer the solve left at a
fallback map (no load tolerance in the file) gets the bound over every map with its class
capacities (no caps), which holds for any tolerance.

Prints per layer: crossings, the file's bound, the recomputed one and the gap; then the whole
instance in bytes per step (sampled tokens), and the CPU seconds the bounds took (this machine,
its load: indicative only).  Deterministic apart from that last line.

Usage::

    python benchmarks/bounds.py INSTANCE.json PLACEMENT.json [--group-preserving auto|on|off] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

from placement.formats import atomic_write_text, read_instance, read_placement  # noqa: E402
from solvers.experts import build_layer_problem, net_crossings  # noqa: E402
from solvers.experts.lower_bounds import bound_to_crossings, layer_lower_bound  # noqa: E402

__all__ = ["layer_rows", "main"]


def layer_rows(instance_path: str, placement_path: str, group_preserving: bool | None = None) -> dict:
    """Every layer's crossings and bounds for the placement's rank layout (see the module docstring).

    Returns ``{"layers": [...], "objective_bytes", "bound_bytes", "file_bound_bytes", "gap",
    "file_gap", "bound_cpu_s"}``; ``file_bound_bytes`` counts layers without a bound as 0.
    """
    inst = read_instance(instance_path)
    pl, doc = read_placement(placement_path)
    details = doc["solve"]["details"]
    gp = bool(details.get("group_preserving", False)) if group_preserving is None else group_preserving
    rows, cpu = [], 0.0
    total = bound_total = file_total = 0.0
    for li in range(inst.model.num_moe_layers):
        p = build_layer_problem(inst, pl.rank2gpu, li, group_preserving=gp)
        e2s = pl.phy2log[li].argsort()  # expert -> slot
        e2c = p.slot2class[e2s]
        crossings = net_crossings(p.nets_all, e2c, p.class_sig, p.cost_mode)
        d = details["layers"][li] if li < len(details.get("layers", [])) else {}
        file_bound = d.get("bound_crossings")
        row: dict = {"layer": li, "crossings": int(crossings), "file_bound": file_bound}
        b = 0
        if p.trivial:
            row.update(bound=0, gap=0.0)
        else:
            cap = p.load_cap(d["load_tolerance"]) if "load_tolerance" in d else None
            t0 = time.process_time()
            lb = layer_lower_bound(p, p.nets_all, cap) if p.cost_mode == "per_domain" else None
            cpu += time.process_time() - t0
            b = max(file_bound or 0, 0 if lb is None else bound_to_crossings(lb.crossings))
            if cap is not None and not p.within_caps(p.default_expert2class, cap):
                b = min(b, net_crossings(p.nets_all, p.default_expert2class, p.class_sig, p.cost_mode))
            b = min(b, crossings)
            row.update(bound=int(b), gap=round((crossings - b) / crossings, 6) if crossings else 0.0,
                       info=None if lb is None else lb.info)
        rows.append(row)
        total += crossings * p.bytes_per_crossing
        bound_total += b * p.bytes_per_crossing
        file_total += (file_bound or 0) * p.bytes_per_crossing
    return {"instance": inst.name, "group_preserving": gp, "layers": rows, "objective_bytes": total,
            "bound_bytes": bound_total, "file_bound_bytes": file_total,
            "layers_without_file_bound": sum(1 for r in rows if r["file_bound"] is None),
            "gap": (total - bound_total) / total if total else 0.0,
            "file_gap": (total - file_total) / total if total else 0.0, "bound_cpu_s": cpu}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("instance")
    ap.add_argument("placement")
    ap.add_argument("--group-preserving", choices=["auto", "on", "off"], default="auto",
                    help="auto: the mode the solve used (its details)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    gp = None if args.group_preserving == "auto" else args.group_preserving == "on"
    out = layer_rows(args.instance, args.placement, gp)
    print(f"{out['instance']} (group-preserving {out['group_preserving']}):")
    print(f"  {'layer':>5} {'crossings':>10} {'file bound':>11} {'bound':>8} {'gap':>7}")
    for r in out["layers"]:
        fb = "-" if r["file_bound"] is None else str(r["file_bound"])
        print(f"  {r['layer']:>5} {r['crossings']:>10} {fb:>11} {r['bound']:>8} {100 * r['gap']:>6.1f}%")
    print(f"  whole instance: objective {out['objective_bytes'] / 1e12:.3f} TB, bound {out['bound_bytes'] / 1e12:.3f} TB, "
          f"gap {100 * out['gap']:.1f}% (the file's bounds: {out['file_bound_bytes'] / 1e12:.3f} TB, "
          f"{out['layers_without_file_bound']} layers without one, gap {100 * out['file_gap']:.1f}%)")
    print(f"  bounds' CPU time {out['bound_cpu_s']:.1f} s (this machine, its load)")
    if args.json:
        atomic_write_text(args.json, json.dumps(out, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
