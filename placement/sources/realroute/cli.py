"""Command line of :mod:`placement.sources.realroute` (``python -m placement.sources.realroute``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from placement.core import stats

if TYPE_CHECKING:
    from placement.core.model import Instance

__all__ = ["main", "stats_rows", "twin_instance"]


def _twin(inst: Instance, params: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The generator's routing for the same shape and sample size (seed 0; its defaults, or ``params``
    such as :data:`placement.sources.generator.TRAINED_MODEL_PARAMS`)."""
    from placement.sources.generator import generate_routing

    m, r = inst.model, inst.routing
    assert r.heldout_topk is not None
    t = max(r.topk.shape[2], r.heldout_topk.shape[2])
    w = generate_routing(
        seed=0,
        num_layers=m.num_moe_layers,
        num_sources=inst.parallel.dp,
        tokens_per_source=t,
        num_windows=2,
        num_experts=m.num_experts,
        top_k=m.top_k,
        num_groups=m.num_groups,
        groups_per_token=m.groups_per_token,
        **(params or {}),
    )
    return w[0][:, :, : r.topk.shape[2]], w[1][:, :, : r.heldout_topk.shape[2]]


def twin_instance(inst: Instance, params: dict | None = None) -> Instance:
    """``inst`` with the generator's routing of the same shape (:func:`_twin`), named ``{name}_generator``.

    What ``placement stats`` measures for the generator columns of the calibration tables (``params``:
    keyword arguments of ``generate_routing``, such as ``TRAINED_MODEL_PARAMS``).
    """
    import dataclasses

    from placement.core.model import Routing

    fit, held = _twin(inst, params)
    return dataclasses.replace(inst, name=f"{inst.name}_generator", routing=Routing(fit, held))


def stats_rows(outdir: str | Path) -> list[tuple[str, str, str, str]]:
    """``(statistic, real, generator twin with its defaults, twin with TRAINED_MODEL_PARAMS)`` rows for
    the instances written in ``outdir`` (empty strings where a column has no such value)."""
    from placement.formats import read_instance
    from placement.sources.generator import TRAINED_MODEL_PARAMS

    outdir = Path(outdir)
    final = read_instance(outdir / "real_ep64.json")
    early = read_instance(outdir / "real_ep64_c10.json")
    frag = read_instance(outdir / "real_pp_frag.json")
    E = final.model.num_experts
    assert final.routing.heldout_topk is not None
    twins = [_twin(final), _twin(final, TRAINED_MODEL_PARAMS)]  # (window 0, window 1) each

    def med(x: np.ndarray) -> str:
        return f"{np.median(x):.3f} [{x.min():.3f}-{x.max():.3f}]"

    def ratio(t: np.ndarray) -> np.ndarray:
        return stats.partner_share(t, E) / stats.partner_share(t, E, null=True)

    per_window = [
        ("expert load max/mean", lambda t: stats.load_max_mean(t, E)),
        ("top-8 partner share", lambda t: stats.partner_share(t, E)),
        ("same, independent routing", lambda t: stats.partner_share(t, E, null=True)),
        ("partner share / independent", ratio),
        ("source-vs-source TV", lambda t: stats.source_tv(t, E)),
        ("same, tokens shuffled", lambda t: stats.source_tv(t, E, null=True)),
    ]
    rows: list[tuple[str, str, str, str]] = []
    for label, real, synth in [("real_ep64 sampled", final.routing.topk, True),
                               ("real_pp_frag sampled", frag.routing.topk, False)]:
        for name, f in per_window:
            gen = [med(f(w0)) if synth else "" for w0, _ in twins]
            rows.append((f"{label}: {name}", med(f(real)), gen[0], gen[1]))
    drift = [
        ("load TV, 10% vs final checkpoint (gen.: window 0 vs 1)", lambda a, b: stats.load_tv(a, b, E)),
        ("top-8 partners kept, 10% vs final (gen.: window 0 vs 1)", lambda a, b: stats.partner_overlap(a, b, E)),
    ]
    for (name, pair), noise in zip(drift, ("load TV, final window 0 vs window 1 (sampling noise)",
                                           "top-8 partners kept, final window 0 vs 1")):
        gen = [med(pair(w0, w1)) for w0, w1 in twins]
        rows.append((name, med(pair(early.routing.topk, final.routing.topk)), gen[0], gen[1]))
        rows.append((noise, med(pair(final.routing.topk, final.routing.heldout_topk)), "", ""))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m placement.sources.realroute",
        description="Train the small DeepSeek-V3-style MoE on local text and write the real_* instances.",
    )
    parser.add_argument("outdir", nargs="?", default="instances")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--stats", action="store_true", help="only print the routing statistics of OUTDIR's real_* instances")
    parser.add_argument("--assemble-robust", action="store_true",
                        help="only write OUTDIR/real_robust from OUTDIR's real_ep64_c10, _c50 and real_ep64 (no training)")
    args = parser.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.assemble_robust:
        from placement.core.model import PlacementError
        from placement.sources.realroute.build import assemble_robust

        try:
            path = assemble_robust(args.outdir)
        except PlacementError as exc:
            log(f"python -m placement.sources.realroute: {exc}")
            return exc.exit_code
        log(f"wrote {path} and {path.with_suffix('.npz').name}")
        return 0
    if args.stats:
        from placement.core.model import PlacementError

        try:
            rows = stats_rows(args.outdir)
        except PlacementError as exc:
            log(f"python -m placement.sources.realroute: {exc}")
            return exc.exit_code
        w = max(len(r[0]) for r in rows)
        print(f"{'statistic (median over MoE layers [min-max])':<{w}}  {'real':<24}  {'generator, defaults':<24}  "
              "generator, TRAINED_MODEL_PARAMS (same shape)")
        for name, real, synth, fitted in rows:
            print(f"{name:<{w}}  {real:<24}  {synth:<24}  {fitted}")
        return 0
    try:
        import torch  # noqa: F401
    except ImportError:
        log("python -m placement.sources.realroute: needs torch (pip install -e '.[torch]')")
        return 1
    from placement.sources.realroute.build import build_all

    try:
        build_all(args.outdir, seed=args.seed, steps=args.steps, log=log)
    except FileNotFoundError as exc:
        log(f"python -m placement.sources.realroute: {exc}")
        return 1
    return 0
