"""Command line of :mod:`placement.realroute` (``python -m placement.realroute``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from placement import stats

if TYPE_CHECKING:
    from placement.model import Instance

__all__ = ["main", "stats_rows", "twin_instance"]


def _twin(inst: Instance) -> tuple[np.ndarray, np.ndarray]:
    """The generator's routing for the same shape and sample size (its defaults, seed 0)."""
    from placement.generator import generate_routing

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
    )
    return w[0][:, :, : r.topk.shape[2]], w[1][:, :, : r.heldout_topk.shape[2]]


def twin_instance(inst: Instance) -> Instance:
    """``inst`` with the generator's routing of the same shape (:func:`_twin`), named ``{name}_generator``.

    What ``placement stats`` measures for the generator column of the calibration tables.
    """
    import dataclasses

    from placement.model import Routing

    fit, held = _twin(inst)
    return dataclasses.replace(inst, name=f"{inst.name}_generator", routing=Routing(fit, held))


def stats_rows(outdir: str | Path) -> list[tuple[str, str, str]]:
    """``(statistic, real, generator twin)`` rows for the instances written in ``outdir``."""
    from placement.formats import read_instance

    outdir = Path(outdir)
    final = read_instance(outdir / "real_ep64.json")
    early = read_instance(outdir / "real_ep64_c10.json")
    frag = read_instance(outdir / "real_pp_frag.json")
    E = final.model.num_experts
    assert final.routing.heldout_topk is not None
    twin0, twin1 = _twin(final)

    def med(x: np.ndarray) -> str:
        return f"{np.median(x):.3f} [{x.min():.3f}-{x.max():.3f}]"

    rows = []
    for label, real, synth in [
        ("real_ep64 sampled", final.routing.topk, twin0),
        ("real_pp_frag sampled", frag.routing.topk, None),
    ]:
        s_real = stats.partner_share(real, E)
        n_real = stats.partner_share(real, E, null=True)
        rows.append((f"{label}: expert load max/mean", med(stats.load_max_mean(real, E)), med(stats.load_max_mean(synth, E)) if synth is not None else ""))
        rows.append((f"{label}: top-8 partner share", med(s_real), med(stats.partner_share(synth, E)) if synth is not None else ""))
        rows.append((f"{label}: same, independent routing", med(n_real), med(stats.partner_share(synth, E, null=True)) if synth is not None else ""))
        rows.append(
            (
                f"{label}: partner share / independent",
                med(s_real / n_real),
                med(stats.partner_share(synth, E) / stats.partner_share(synth, E, null=True)) if synth is not None else "",
            )
        )
        rows.append((f"{label}: source-vs-source TV", med(stats.source_tv(real, E)), med(stats.source_tv(synth, E)) if synth is not None else ""))
        rows.append(
            (f"{label}: same, tokens shuffled", med(stats.source_tv(real, E, null=True)), med(stats.source_tv(synth, E, null=True)) if synth is not None else "")
        )
    rows.append(
        (
            "load TV, 10% vs final checkpoint (gen.: window 0 vs 1)",
            med(stats.load_tv(early.routing.topk, final.routing.topk, E)),
            med(stats.load_tv(twin0, twin1, E)),
        )
    )
    rows.append(
        (
            "load TV, final window 0 vs window 1 (sampling noise)",
            med(stats.load_tv(final.routing.topk, final.routing.heldout_topk, E)),
            "",
        )
    )
    rows.append(
        (
            "top-8 partners kept, 10% vs final (gen.: window 0 vs 1)",
            med(stats.partner_overlap(early.routing.topk, final.routing.topk, E)),
            med(stats.partner_overlap(twin0, twin1, E)),
        )
    )
    rows.append(
        (
            "top-8 partners kept, final window 0 vs 1",
            med(stats.partner_overlap(final.routing.topk, final.routing.heldout_topk, E)),
            "",
        )
    )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m placement.realroute",
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
        from placement.model import PlacementError
        from placement.realroute.build import assemble_robust

        try:
            path = assemble_robust(args.outdir)
        except PlacementError as exc:
            log(f"python -m placement.realroute: {exc}")
            return exc.exit_code
        log(f"wrote {path} and {path.with_suffix('.npz').name}")
        return 0
    if args.stats:
        from placement.model import PlacementError

        try:
            rows = stats_rows(args.outdir)
        except PlacementError as exc:
            log(f"python -m placement.realroute: {exc}")
            return exc.exit_code
        w = max(len(r[0]) for r in rows)
        print(f"{'statistic (median over MoE layers [min-max])':<{w}}  {'real':<24}  generator (same shape)")
        for name, real, synth in rows:
            print(f"{name:<{w}}  {real:<24}  {synth}")
        return 0
    try:
        import torch  # noqa: F401
    except ImportError:
        log("python -m placement.realroute: needs torch (pip install -e '.[torch]')")
        return 1
    from placement.realroute.build import build_all

    try:
        build_all(args.outdir, seed=args.seed, steps=args.steps, log=log)
    except FileNotFoundError as exc:
        log(f"python -m placement.realroute: {exc}")
        return 1
    return 0
