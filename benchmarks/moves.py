"""Move-aware re-placement against the unconstrained re-placement: how much of the gain a budget keeps.

For each scenario a *previous* placement (fitted on earlier routing, or the default placement) is
re-placed on a *new* instance three ways, all on the previous rank layout, all scored by the one
evaluator on the new instance's held-out window:

- ``previous``: kept as it is (0 bytes moved);
- ``unconstrained``: ``placement.solve(new, layout="fixed")``, a re-placement that ignores moves;
- ``budget``: ``placement.solve(new, previous=..., max_moved_bytes=SHARE of all expert state)``.

Every solve of a scenario (the previous one included) uses the same expert-map mode:
``--group-preserving auto`` (default) is the re-placement's default, group-preserving under
group-limited routing; ``on`` / ``off`` force it.

The gain is the previous placement's held-out predicted step time minus the re-placement's (with a
``performance`` block), else its held-out cross-domain bytes minus the re-placement's; ``kept`` is
the budget's gain over the unconstrained gain.  Moves are counted by GPU
(:func:`placement.predict.moves.count_moves`).

Usage::

    python benchmarks/moves.py [--scenarios real_c10 real_c50 dsv3_256_default dsv3_256_drift]
                               [--share 0.1] [--time-limit S] [--group-preserving auto|on|off] [--json OUT]

Instances without a ``performance`` block (the real routing ones) use DeepSeek-V3's expert size
(``3 * 7168 * 2048`` parameters).  Wall times depend on the machine's load and are not printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import sys
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

import placement  # noqa: E402
from placement.formats import atomic_write_text  # noqa: E402
from placement.core.model import Instance, Placement, Routing  # noqa: E402
from placement.predict.moves import count_moves, replica_state_bytes, total_state_bytes  # noqa: E402
from solvers.base import group_preserving_default  # noqa: E402
from solvers.default import default_placement  # noqa: E402

DSV3_EXPERT_PARAMS = 3 * 7168 * 2048
SCENARIOS = ("real_c10", "real_c50", "dsv3_256_default", "dsv3_256_drift")


def _load(name: str) -> Instance:
    return placement.load_instance(ROOT / "instances" / f"{name}.json")


def _next_window(inst: Instance) -> Instance:
    """``inst`` one generator window later: sampled = window 1, held-out = window 2 (same sizes)."""
    from placement.sources.generator import generate_routing

    gen = dict(inst.extra["generator"])
    accepted = inspect.signature(generate_routing).parameters
    params = {k: v for k, v in gen.items() if k in accepted}
    params.update(num_windows=3)
    w = generate_routing(**params)  # (3, L, dp, T, k)
    h = inst.routing.heldout_topk
    t_h = h.shape[2] if h is not None else w.shape[3]
    return dataclasses.replace(inst, name=f"{inst.name}_next", routing=Routing(w[1], w[2][:, :, :t_h]))


def scenario(name: str, time_limit_s: float, workers: int | None,
             group_preserving: bool | None = None) -> tuple[Instance, Placement, int | None]:
    """``(new instance, previous placement, expert params or None)``; the previous solve in the
    re-placement's expert-map mode (``None``: the re-placement's default, :func:`_mode`)."""
    if name.startswith("real_"):
        old = _load({"real_c10": "real_ep64_c10", "real_c50": "real_ep64_c50"}[name])
        prev = placement.solve(old, time_limit_s=time_limit_s, num_workers=workers, layout="fixed",
                               group_preserving=_mode(old, group_preserving)).placement
        return _load("real_ep64"), prev, DSV3_EXPERT_PARAMS
    base = _load("dsv3_256")
    if name == "dsv3_256_default":
        return base, default_placement(base), None
    prev = placement.solve(base, time_limit_s=time_limit_s, num_workers=workers, layout="fixed",
                           group_preserving=_mode(base, group_preserving)).placement
    return _next_window(base), prev, None


def _mode(instance: Instance, group_preserving: bool | None) -> bool:
    """The expert-map mode of every solve of a scenario: the given one, else what a re-placement takes
    by default (the instance's apply mode: free maps under ``runtime``, group-preserving under
    ``checkpoint`` and group-limited routing), so that the previous, the unconstrained and the
    budgeted solves search the same maps."""
    if group_preserving is not None:
        return group_preserving
    return group_preserving_default(instance)


def run(name: str, share: float, time_limit_s: float, workers: int | None,
        group_preserving: bool | None = None) -> dict:
    new, prev, params = scenario(name, time_limit_s, workers, group_preserving)
    gp = _mode(new, group_preserving)
    bpr = replica_state_bytes(new, params=params)
    budget = share * total_state_bytes(new, bpr)
    key = "heldout_predicted_step_time_s" if new.performance is not None else "heldout_cross_domain_bytes_per_step"
    rows = {"previous": (prev, placement.evaluate_placement(new, prev))}
    free = placement.solve(new, time_limit_s=time_limit_s, num_workers=workers, layout="fixed", group_preserving=gp)
    rows["unconstrained"] = (free.placement, free.metrics)
    kept = placement.solve(new, time_limit_s=time_limit_s, num_workers=workers, previous=prev,
                           max_moved_bytes=budget, expert_params=params, group_preserving=gp)
    rows["budget"] = (kept.placement, kept.metrics)
    out: dict = {"scenario": name, "instance": new.name, "share": share, "budget_bytes": budget, "group_preserving": gp,
                 "bytes_per_replica": bpr, "gain_key": key, "rows": {}}
    base = rows["previous"][1][key]
    for label, (plc, m) in rows.items():
        mc = count_moves(new, prev, plc, bytes_per_replica=bpr)
        out["rows"][label] = {
            "gain": base - m[key],
            key: m[key],
            "heldout_cross_domain_bytes_per_step": m["heldout_cross_domain_bytes_per_step"],
            "heldout_expert_load_max_over_mean": m["heldout_expert_load_max_over_mean"],
            "moved_share": mc.moved_replicas / mc.replicas_total,
            "moved_bytes": mc.moved_bytes,
            "moved_bytes_cross_rack": mc.cross_rack_bytes,
        }
    g_free, g_kept = out["rows"]["unconstrained"]["gain"], out["rows"]["budget"]["gain"]
    out["kept"] = g_kept / g_free if g_free > 0 else None
    out["budget_details"] = {k: v for k, v in kept.details.get("moves", {}).items() if k != "moved_replicas_per_layer"}
    return out


def _fmt(key: str, v: float) -> str:
    return f"{v:.4f} s" if key.endswith("_s") else f"{v / 1e9:,.1f} GB"


def markdown(res: dict) -> str:
    key = res["gain_key"]
    mode = "group-preserving" if res["group_preserving"] else "free maps"
    lines = [f"### {res['scenario']} ({res['instance']}, {mode}; budget {100 * res['share']:g}% of expert state, "
             f"{res['budget_bytes'] / 1e9:,.1f} GB)", "",
             f"| re-placement | {key} | gain | cross-domain (h-o) | load max/mean (h-o) | replicas moved | moved | cross-rack |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for label, r in res["rows"].items():
        lines.append(f"| {label} | {_fmt(key, r[key])} | {_fmt(key, r['gain'])} | "
                     f"{r['heldout_cross_domain_bytes_per_step'] / 1e9:,.1f} GB | "
                     f"{r['heldout_expert_load_max_over_mean']:.3f} | {100 * r['moved_share']:.1f}% | "
                     f"{r['moved_bytes'] / 1e9:,.1f} GB | {r['moved_bytes_cross_rack'] / 1e9:,.1f} GB |")
    kept = res["kept"]
    lines.append("")
    lines.append(f"kept {kept:.2f} of the unconstrained gain" if kept is not None else
                 "the unconstrained re-placement gains nothing on the held-out window")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    ap.add_argument("--share", type=float, default=0.1, help="budget as a share of all expert replicas' state")
    ap.add_argument("--time-limit", type=float, default=100.0)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--group-preserving", choices=("auto", "on", "off"), default="auto",
                    help="expert-map mode of every solve; auto: the re-placement's default")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    gp = {"auto": None, "on": True, "off": False}[args.group_preserving]
    results = []
    for name in args.scenarios:
        res = run(name, args.share, args.time_limit, args.workers, gp)
        results.append(res)
        print(markdown(res), flush=True)
        print()
    if args.json:
        atomic_write_text(args.json, json.dumps(results, indent=2, sort_keys=True, default=float) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
