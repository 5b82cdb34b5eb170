"""The expert search's starts side by side, per layer: fit and validation crossings after the swap search.

For each non-trivial layer of each instance (default rank layout), the load caps of the layer's
ladder, and each start (the greedy, the default map, the group-structured start in free mode, the
multilevel co-activation start, and Mt-KaHyPar's partition when the ``peers`` extra is installed),
it prints the start's fit crossings, the fit and validation crossings after
:class:`solvers.experts.SwapSearch`, and the seconds the start and the polish took (indicative: the
machine's load is printed).  Crossings are deterministic.

Usage::

    python benchmarks/starts.py [--instances real_ep64 dsv3_ep256] [--layers N] [--group-preserving]
                                [--no-kahypar]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from placement.formats import read_instance  # noqa: E402
from solvers.default import default_rank2gpu  # noqa: E402
from solvers.experts.coarsen import coarsen_start, kahypar_available, kahypar_start  # noqa: E402
from solvers.experts import capped_greedy  # noqa: E402
from solvers.experts.problem import LayerProblem, build_layer_problem, linear_costs  # noqa: E402
from solvers.experts.swap import SwapSearch  # noqa: E402
from solvers.experts.tuning import CLASS_LOAD_TOLERANCE, CLASS_LOAD_TOLERANCE_GROUP_PRESERVING  # noqa: E402


def _ladder(p: LayerProblem, cost: np.ndarray, base: float) -> tuple[float, np.ndarray | None]:
    """The layer's load tolerance as the solver sets it: base, 2 base, ... up to the default's excess."""
    default_tol = p.load_excess(p.default_expert2class)
    tol = base
    while tol < default_tol:
        e2c = capped_greedy(p, cost, p.load_cap(tol))
        if e2c is not None:
            return tol, e2c
        tol *= 2.0
    tol = max(base, default_tol)
    return tol, capped_greedy(p, cost, p.load_cap(tol))


def _plain_starts(p: LayerProblem, cap: np.ndarray, greedy: np.ndarray | None, cost: np.ndarray,
                  model_groups: int) -> dict[str, np.ndarray]:
    """The solver's starts before the co-activation ones: the greedy, the default map (within the caps)
    and, in free mode, the start keeping the model's expert groups whole."""
    out: dict[str, np.ndarray] = {}
    if greedy is not None:
        out["greedy"] = greedy
    if p.within_caps(p.default_expert2class, cap):
        out["default"] = p.default_expert2class
    E = p.num_experts
    if not p.group_preserving and model_groups > 1 and E % model_groups == 0:
        gp = dataclasses.replace(p, group_preserving=True, expert_group_size=E // model_groups)
        m = capped_greedy(gp, cost, cap)
        if m is not None:
            out["group_structured"] = m
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/starts.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--instances", nargs="+", default=["real_ep64", "dsv3_ep256"])
    parser.add_argument("--layers", type=int, default=None, help="first N MoE layers (default: all)")
    parser.add_argument("--group-preserving", action="store_true", help="group-preserving problems (default: free)")
    parser.add_argument("--no-kahypar", action="store_true", help="skip the Mt-KaHyPar start")
    args = parser.parse_args(argv)
    gp = bool(args.group_preserving)
    for name in args.instances:
        inst = read_instance(ROOT / "instances" / f"{name}.json")
        r2g = default_rank2gpu(inst)
        totals: dict[str, list[int]] = {}
        layers = range(inst.model.num_moe_layers if args.layers is None else min(args.layers, inst.model.num_moe_layers))
        print(f"{name} ({'group-preserving' if gp else 'free'}), load average {os.getloadavg()[0]:.1f}")
        for li in layers:
            p = build_layer_problem(inst, r2g, li, group_preserving=gp and inst.model.num_groups > 1)
            if p.trivial:
                continue
            fit, val = p.nets_fit, p.nets_val
            cost = linear_costs(p, fit)
            base = CLASS_LOAD_TOLERANCE_GROUP_PRESERVING if p.group_preserving else CLASS_LOAD_TOLERANCE
            tol, greedy = _ladder(p, cost, base)
            cap = p.load_cap(tol)
            starts = _plain_starts(p, cap, greedy, cost, inst.model.num_groups)
            timed: dict[str, tuple[np.ndarray, float]] = {n: (m, 0.0) for n, m in starts.items()}
            t0 = time.monotonic()
            m = coarsen_start(p, fit, cap, cost)
            if m is not None:
                timed["coarsened"] = (m, time.monotonic() - t0)
            if not args.no_kahypar and kahypar_available():
                t0 = time.monotonic()
                m = kahypar_start(p, fit, cap, cost, seed=0)
                if m is not None:
                    timed["kahypar"] = (m, time.monotonic() - t0)
            ls_fit, ls_val = SwapSearch(p, fit), SwapSearch(p, val)
            cells = []
            for n, (m, start_s) in timed.items():
                t0 = time.monotonic()
                pm = ls_fit.run(m, cap)
                polish_s = time.monotonic() - t0
                f, v = ls_fit.cost(pm), ls_val.cost(pm)
                totals.setdefault(n, [0, 0, 0])
                totals[n][0] += f
                totals[n][1] += v
                totals[n][2] += 1
                cells.append(f"{n} {ls_fit.cost(m)}->{f}/{v} ({start_s:.1f}+{polish_s:.1f} s)")
            print(f"  layer {li}: " + "; ".join(cells), flush=True)
        print(f"  sums (fit / validation, layers with the start): "
              + "; ".join(f"{n} {t[0]} / {t[1]} ({t[2]} layers)" for n, t in totals.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
