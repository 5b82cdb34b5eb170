"""The command line: a thin layer over :mod:`placement.api`.

``main(argv) -> int`` is the only place that prints or exits.  Exit codes: 0 success, 2 invalid
input, 3 infeasible, 1 anything else; errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Sequence

from placement.model import InvalidInputError, PlacementError

__all__ = ["main", "entry", "EXIT_OK", "EXIT_ERROR", "EXIT_INVALID", "EXIT_INFEASIBLE"]

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_INVALID = 2
EXIT_INFEASIBLE = 3


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
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

    def row(label: str, key: str, fmt) -> None:
        held = f"   held-out {fmt(m['heldout_' + key])}" if has_held else ""
        lines.append(f"  {label:<38}{fmt(m[key]):>16}{held}")

    row("cross-domain all-to-all bytes", "cross_domain_bytes_per_step", _gb)
    row("busiest NIC (one direction)", "max_gpu_cross_domain_bytes_per_step", _gb)
    row("intra-domain (NVLink) bytes", "intra_domain_bytes_per_step", _gb)
    row("remote domains per token", "remote_domains_per_token", lambda v: f"{v:.3f}")
    row("remote experts per token", "remote_experts_per_token", lambda v: f"{v:.3f}")
    row("expert load max/mean (worst layer)", "expert_load_max_over_mean", lambda v: f"{v:.3f}")
    row("all-to-all time, slowest stage", "alltoall_time_s_per_step", lambda v: f"{v:.2f} s")
    return lines


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


def _progress_printer():
    if not sys.stderr.isatty():
        return None

    def show(msg: str) -> None:
        print(f"[placement] {msg}", file=sys.stderr, flush=True)

    return show


def _cmd_solve(args: argparse.Namespace, started_at: float) -> int:
    from placement.api import load_instance, result_document, solve
    from placement.cost import report
    from placement.formats import write_placement
    from solvers.default import default_placement

    instance = load_instance(args.instance)
    result = solve(
        instance,
        solver=args.solver,
        time_limit_s=args.time_limit,
        seed=args.seed,
        num_workers=args.workers,
        consumer=args.consumer,
        group_preserving={"auto": None, "on": True, "off": False}[args.group_preserving],
        objective=args.objective,
        layout=args.layout,
        progress=_progress_printer(),
        started_at=started_at,
    )
    doc = result_document(instance, result)
    if args.output:
        write_placement(args.output, doc)
    baseline = report(instance, default_placement(instance))
    if args.json:
        out = {
            "solver": result.solver,
            "status": result.status,
            "objective_bytes": result.objective_bytes,
            "bound_bytes": result.bound_bytes,
            "gap": result.gap,
            "wall_s": result.wall_s,
            "output": args.output,
            "metrics": result.metrics,
            "default_metrics": baseline,
        }
        print(json.dumps(out, sort_keys=True))
        return EXIT_OK
    m, b = result.metrics, baseline
    print(f"{instance.name}: solver {result.solver}, status {result.status}, {result.wall_s:.1f} s wall")
    if result.bound_bytes is not None:
        print(f"  objective {_gb(result.objective_bytes)}, bound {_gb(result.bound_bytes)}, gap {100 * (result.gap or 0):.1f}%")
    print(f"  {'per optimizer step':<38}{'default':>16}{'solved':>16}{'ratio':>8}")
    for label, key, fmt in [
        ("cross-domain bytes (sampled)", "cross_domain_bytes_per_step", _gb),
        ("cross-domain bytes (held-out)", "heldout_cross_domain_bytes_per_step", _gb),
        ("busiest NIC bytes (held-out)", "heldout_max_gpu_cross_domain_bytes_per_step", _gb),
        ("remote domains/token (held-out)", "heldout_remote_domains_per_token", lambda v: f"{v:.3f}"),
        ("expert load max/mean (held-out)", "heldout_expert_load_max_over_mean", lambda v: f"{v:.3f}"),
        ("all-to-all s, slowest stage (h-o)", "heldout_alltoall_time_s_per_step", lambda v: f"{v:.2f}"),
    ]:
        ratio = m[key] / b[key] if b[key] else float("nan")
        print(f"  {label:<38}{fmt(b[key]):>16}{fmt(m[key]):>16}{ratio:>8.3f}")
    if args.output:
        print(f"  wrote {args.output}")
    return EXIT_OK


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
    so.add_argument("--consumer", default="none", choices=CONSUMERS, help="layout rule of the dispatcher")
    so.add_argument("--group-preserving", default="auto", choices=("auto", "on", "off"),
                    help="only group-preserving expert permutations (auto: when routing is group-limited)")
    so.add_argument("--objective", default="total", choices=OBJECTIVES,
                    help="total cross-domain bytes, or the bottleneck (slowest stage's busiest NIC)")
    so.add_argument("--layout", default="optimize", choices=LAYOUT_MODES,
                    help="optimize the rank -> GPU map, or keep the default one (fixed)")
    so.add_argument("--json", action="store_true", help="print the result as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    started_at = time.monotonic()
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
            return _cmd_solve(args, started_at)
        raise InvalidInputError(f"unknown command {args.command!r}")  # pragma: no cover
    except PlacementError as exc:
        print(f"placement: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("placement: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return EXIT_ERROR
    except MemoryError:
        print("placement: error: out of memory", file=sys.stderr)
        return EXIT_ERROR
    except Exception as exc:  # noqa: BLE001 - the CLI never shows a traceback
        print(f"placement: error: internal: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_ERROR


def entry() -> None:
    sys.exit(main())
