"""The plan's outputs: its JSON document (stable keys), the table, and the recommendation's files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from placement.formats import atomic_write_text, dumps, read_instance, write_instance, write_placement

__all__ = ["PLAN_SCHEMA_VERSION", "plan_document", "plan_table", "write_plan"]

PLAN_SCHEMA_VERSION = 1


def plan_document(result: Any, *, top: int | None = None) -> dict:
    """The plan as JSON (no wall-clock facts): counts, rows best first, rankings, recommendation."""
    rows = result.rows if top is None else result.rows[:top]
    seg, dflt = result.segment, result.best("default")
    rec = result.recommendation
    return {
        "schema_version": PLAN_SCHEMA_VERSION,
        "kind": "plan",
        "job": result.job,
        "cluster": result.cluster,
        "free_gpus": result.free_gpus,
        "time_limit_s": result.time_limit_s,
        "seed": result.seed,
        "counts": result.counts,
        "infeasible_examples": result.infeasible_examples,
        "deadline_hit": result.deadline_hit,
        "recommendation": rec.to_dict(),
        "peers": {
            "segment": None if seg is None else seg.to_dict(),
            "default": None if dflt is None else dflt.to_dict(),
        },
        "rows": [r.to_dict() for r in rows],
        "ranking_by_job_tokens_per_s": [r.key + " " + r.variant for r in rows],
        "ranking_by_tokens_per_s_per_gpu": [result.rows[j].key + " " + result.rows[j].variant
                                            for j in result.by_tokens_per_gpu if top is None or j < top],
    }


def _fmt_bytes(x: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"


def plan_table(result: Any, *, top: int = 10) -> str:
    """The best ``top`` rows as text, then the counts and the recommendation."""
    head = (f"{'layout':<36} {'placed by':<14} {'GPUs':>5} {'idle':>4} {'step s':>7} {'job tok/s':>11} "
            f"{'tok/s/GPU':>9} {'TFLOP/s/GPU':>11} {'cross-rack':>10} {'headroom':>9}")
    lines = [f"plan {result.job} on {result.cluster}: {result.free_gpus} free GPUs (sampled window; held-out in the JSON)", head]
    for r in result.rows[:top]:
        f = r.figures
        lines.append(
            f"{r.key:<36} {r.variant:<14} {r.gpus_used:>5} {r.gpus_idle:>4} {f['predicted_step_time_s']:>7.4g} "
            f"{f['predicted_job_tokens_per_s']:>11,.0f} {f['predicted_tokens_per_s_per_gpu']:>9,.0f} "
            f"{f['predicted_tflops_per_gpu']:>11,.1f} {_fmt_bytes(f['cross_domain_bytes_per_step']):>10} "
            f"{r.memory['headroom_bytes'] / 1e9:>6.1f} GB"
        )
    c = result.counts
    lines.append(
        f"candidates: {c['enumerated']} enumerated, {c['infeasible']} infeasible, {c['feasible']} feasible; "
        f"work items {c['work_items']}: {c['scored']} scored, {c['solved']} solved, {c['pruned']} pruned by bound, "
        f"{c['unsolved_budget']} left for the budget, {c['not_applicable']} not applicable"
    )
    for reason, n in c["infeasible_by_reason"].items():
        lines.append(f"  infeasible: {n} x {reason} (e.g. {result.infeasible_examples.get(reason, '')})")
    rec = result.recommendation
    f = rec.figures
    lines.append(
        f"recommendation: {rec.key} placed by {rec.variant}: {f['predicted_job_tokens_per_s']:,.0f} tokens/s "
        f"({f['heldout_predicted_job_tokens_per_s']:,.0f} held-out), {f['predicted_tflops_per_gpu']:,.1f} TFLOP/s per GPU, "
        f"{rec.gpus_used} GPUs used, {rec.gpus_idle} idle"
    )
    for name, row in (("segment rule", result.segment), ("default layout", result.best("default"))):
        if row is not None:
            g = row.figures
            ratio = f["predicted_job_tokens_per_s"] / g["predicted_job_tokens_per_s"]
            lines.append(f"  vs {name}: {row.key} ({row.variant}) {g['predicted_job_tokens_per_s']:,.0f} tokens/s, "
                         f"recommendation {ratio:.3f}x")
    if result.deadline_hit:
        lines.append("  the wall-clock deadline ended the plan early: best so far (the plan may depend on the machine's load)")
    cut = result.counts.get("wall_clock_cut", 0)
    if cut:
        lines.append(f"  the wall-clock safety net cut {cut} solve{'s' if cut > 1 else ''} short: the plan may depend on "
                     "the machine's load (rows marked wall_clock_cut in the JSON)")
    return "\n".join(lines)


def _solve_result(result: Any) -> Any:
    """The recommendation as a :class:`solvers.SolveResult` (heuristic variants get one built)."""
    from solvers.base import SolveResult

    v = result.variant
    if v.result is not None:
        return v.result
    from placement.predict.report import report

    inst = result.instance
    metrics = report(inst, v.placement)
    return SolveResult(placement=v.placement, solver=v.name, status="heuristic",
                       objective_bytes=float(metrics["cross_domain_bytes_per_step"]),
                       params={"layout": v.name, "experts": "contiguous", "seed": result.seed},
                       group_preserving=True, metrics=metrics)


def write_plan(result: Any, path: str | os.PathLike[str], *, picture: bool = True, exports: dict[str, str] | None = None) -> dict[str, Path]:
    """Write the plan JSON at ``path`` and, beside it, the recommendation's files.

    ``<stem>.instance.json`` (+ ``.npz``), ``<stem>.placement.json`` (as ``solve -o`` writes it),
    ``<stem>.png`` (``placement show``'s rack map, when matplotlib is installed and ``picture``),
    and ``exports`` ``{format: path}`` as ``placement export`` writes them.  Every file atomically;
    the plan JSON last.  Returns ``{what: path}``.
    """
    from placement.api import export_placement, result_document

    out = Path(path)
    stem = out.with_suffix("") if out.suffix == ".json" else out
    inst_path = Path(f"{stem}.instance.json")
    place_path = Path(f"{stem}.placement.json")
    written: dict[str, Path] = {}
    write_instance(result.instance, inst_path)
    written["instance"] = inst_path
    inst = read_instance(inst_path)  # its sha256 names it in the placement file
    res = _solve_result(result)
    write_placement(place_path, result_document(inst, res))
    written["placement"] = place_path
    if picture:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            pass
        else:
            from placement.app.show import draw_placement

            written["picture"] = draw_placement(inst, res.placement, Path(f"{stem}.png"), window="heldout",
                                                label=f"{result.recommendation.key} ({result.recommendation.variant})")
    for fmt, target in (exports or {}).items():
        export_placement(fmt, place_path, target, inst_path)
        written[f"export:{fmt}"] = Path(target)
    doc = plan_document(result)
    doc["files"] = {k: os.path.relpath(v, out.parent) for k, v in written.items()}
    atomic_write_text(out, dumps(doc))
    written["plan"] = out
    return written
