"""Side by side against the peers: every committed instance, one run, one evaluator.

For each instance the same evaluator (:func:`placement.predict.report.report`) scores

- ``default``: ranks on the available GPUs in sorted order, experts contiguous;
- ``packed``: a careful engineer's layout, whole EP groups packed into racks (:mod:`solvers.packed`);
- ``eplb``: DeepSeek EPLB's hierarchical balanced packing on the default layout (:mod:`solvers.eplb`);
- ``kahypar``: Mt-KaHyPar per layer, then within-domain balancing (:mod:`solvers.kahypar`; needs the
  ``peers`` extra);
- ours, the registered solver ``cpsat`` at ``--time-limit`` seconds (skipped with a note while it is
  not registered);
- the best lower bound available: our solver's proved bound (``SolveResult.bound_bytes``, a bound
  over its own search space), else ``n/a``.

Usage::

    python benchmarks/peers.py [--instances NAME|PATH ...] [--time-limit S] [--json OUT]
                               [--peers default,packed,eplb,kahypar] [--ours-checkpoint]

Ours runs in its default mode, ``apply`` ``runtime`` (free maps applied at dispatch time, the
freedom ``eplb`` and ``kahypar`` take).  ``--ours-checkpoint`` adds a row of ours with ``apply``
``checkpoint`` (group-preserving maps under group-limited routing), which separates the cost of the
checkpoint-permutation rule from the solver's own gap.  Predicted TFLOP/s are given at the step-time
model's low, mid and high settings, with a check that ours predicts at least every peer at each.

It prints a Markdown table per instance (cross-domain bytes per step on the sampled and held-out
tokens, the ratio to the best peer on held-out tokens, the busiest NIC and the expert load max/mean
on held-out tokens, the solver's wall time) and the issue's target check, and writes the same as
JSON.  Every solver runs through :func:`placement.solve` with the same ``time_limit_s`` (its
budget covers the whole call: solving, checking and scoring), and the wall time is that call's.
Timings depend on the machine's load, recorded with every row.
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
from placement.formats import atomic_write_text, read_instance  # noqa: E402
from placement.core.model import Instance, PlacementError  # noqa: E402
from solvers.base import default_workers  # noqa: E402

__all__ = ["PEERS", "OURS", "TARGET_RATIO", "TARGET_BOUND_GAP", "TARGET_TIME_FACTOR", "run_instance", "target_check",
           "tflops_check", "markdown_table", "main"]

PEERS: tuple[str, ...] = ("default", "packed", "eplb", "kahypar")
OURS = "cpsat"
TARGET_RATIO = 0.90  # ours held-out cross-domain bytes <= 0.90 x the best peer's ...
TARGET_BOUND_GAP = 0.03  # ... or ours within 3% of a proved bound (sampled tokens, ours' search space)
TARGET_TIME_FACTOR = 2.0  # ours wall time <= 2 x the best peer's
SCHEMA_VERSION = 1

# The scalar metrics kept per row (and their held-out twins); per-stage arrays are kept too.
_SCALARS = (
    "cross_domain_bytes_per_step",
    "intra_domain_bytes_per_step",
    "max_gpu_cross_domain_bytes_per_step",
    "expert_load_max_over_mean",
    "remote_domains_per_token",
    "remote_experts_per_token",
    "alltoall_time_s_per_step",
    "cross_domain_bytes_per_stage",
    "predicted_step_time_s",
    "predicted_tflops_per_gpu",
    *(f"predicted_{k}_{setting}" for k in ("step_time_s", "tflops_per_gpu") for setting in ("low", "mid", "high")),
)
SETTINGS = ("low", "mid", "high")  # the step-time model's settings (placement.predict.performance.SETTINGS)


def _load(name_or_path: str) -> Instance:
    path = Path(name_or_path)
    if path.suffix != ".json":
        path = ROOT / "instances" / f"{name_or_path}.json"
    return read_instance(path)


def _committed_instances() -> list[str]:
    """The committed instance files (job and cluster files, which carry a ``kind``, are not instances)."""
    return sorted(p.stem for p in (ROOT / "instances").glob("*.json")
                  if "kind" not in json.loads(p.read_text(encoding="utf-8")))


def _compute_bound(instance: Instance, result: "placement.SolveResult") -> dict[str, float]:
    """Held-out compute-bound TFLOP/s per GPU at each setting: the step with its communication removed.

    The same step-time model's ``compute_bound_step_time_s`` (slowest stage's compute, expert load
    included, with the pipeline bubble), so the limit moves with the placement's expert balance and
    pipeline split but not with its bytes.
    """
    from placement.predict.cost import evaluate
    from placement.predict.report import setting_step_models
    from placement.core.pipeline_layout import with_layout

    if instance.performance is None or instance.routing.heldout_topk is None:
        return {}
    pl = result.placement
    inst = with_layout(instance, pl.pipeline_layout) if pl.pipeline_layout else instance
    held = evaluate(inst, pl, window="heldout")
    out = {}
    for setting, model in setting_step_models(inst).items():
        pred = model.predict_metrics(held, pl.rank2gpu)
        out[f"heldout_compute_bound_tflops_per_gpu_{setting}"] = float(
            pred.tflops_per_gpu * pred.step_time_s / pred.compute_bound_step_time_s)
    return out


def _run_solver(instance: Instance, name: str, time_limit_s: float, seed: int, workers: int, *,
                label: str | None = None, apply: str | None = None, pipeline_split: bool = True) -> dict:
    """One row: solve, check, score.  A solver that cannot run gives a row with ``skipped`` set.

    ``label`` names a variant row (ours with ``apply`` forced); the plain row of ours (its default
    mode) is the one the targets are checked on.
    """
    row: dict = {"solver": name, "label": label or name, "time_limit_s": time_limit_s,
                 "load_average_before": os.getloadavg()[0]}
    if label is not None:
        row["variant"] = {"apply": apply}
    if name not in placement.solver_names():
        row["skipped"] = f"solver {name!r} is not registered yet"
        return row
    t0 = time.monotonic()
    try:
        result = placement.solve(instance, solver=name, time_limit_s=time_limit_s, seed=seed, num_workers=workers,
                                 apply=apply if name == OURS else None, started_at=t0, pipeline_split=pipeline_split)
    except PlacementError as exc:
        row["skipped"] = f"{type(exc).__name__}: {exc}"
        return row
    row["wall_s"] = time.monotonic() - t0
    row["load_average_after"] = os.getloadavg()[0]
    metrics = result.metrics  # the evaluator's report on both windows, after solve()'s own check
    keys = [k for base in _SCALARS for k in (base, "heldout_" + base)]
    row["metrics"] = {k: metrics[k] for k in keys if k in metrics}
    row["metrics"].update(_compute_bound(instance, result))
    row["metrics"]["heldout_small_node_ep_groups"] = metrics.get("heldout_small_node_ep_groups", 0)
    from placement.core.pipeline_layout import instance_chunks, render_layout

    row["pipeline_layout"] = render_layout(result.placement.pipeline_layout or instance_chunks(instance))
    row.update(
        status=result.status,
        objective_bytes=result.objective_bytes,
        bound_bytes=result.bound_bytes,
        partial_bound_bytes=result.details.get("partial_bound_bytes"),
        layers_without_bound=result.details.get("layers_without_bound"),
        group_preserving=bool(result.group_preserving),
        consumer=result.consumer,
        params=result.params,
    )
    return row


def target_check(rows: list[dict]) -> dict:
    """Ours against the best peer (lowest held-out cross-domain bytes) on the issue's three targets.

    Returns
    -------
    ``{"best_peer", "ratio", "ratio_ok", "load_ours", "load_best_peer", "load_ok", "wall_ours_s",
    "wall_best_peer_s", "time_ok", "met"}``; ``{"best_peer": ..., "met": None, "note": ...}`` when
    ours did not run.
    """
    scored = [r for r in rows if "metrics" in r]
    peers = [r for r in scored if r["solver"] in PEERS]
    if not peers:
        return {"best_peer": None, "met": None, "note": "no peer ran"}
    best = min(peers, key=lambda r: r["metrics"]["heldout_cross_domain_bytes_per_step"])
    out: dict = {"best_peer": best["solver"]}
    ours = next((r for r in scored if r["solver"] == OURS and "variant" not in r), None)
    if ours is None:
        out.update(met=None, note=f"ours ({OURS}) did not run")
        return out
    held_best = best["metrics"]["heldout_cross_domain_bytes_per_step"]
    held_ours = ours["metrics"]["heldout_cross_domain_bytes_per_step"]
    ratio = held_ours / held_best if held_best > 0 else (1.0 if held_ours == 0 else float("inf"))
    load_ours = ours["metrics"]["heldout_expert_load_max_over_mean"]
    load_best = best["metrics"]["heldout_expert_load_max_over_mean"]
    bound = ours.get("bound_bytes")
    bound_gap = None
    if bound is not None and ours.get("objective_bytes"):
        bound_gap = max(0.0, (ours["objective_bytes"] - bound) / ours["objective_bytes"])
    out.update(
        ratio=ratio,
        bound_gap=bound_gap,
        ratio_ok=bool(ratio <= TARGET_RATIO or (held_best == 0 and held_ours == 0)
                      or (bound_gap is not None and bound_gap <= TARGET_BOUND_GAP)),
        load_ours=load_ours,
        load_best_peer=load_best,
        load_ok=bool(load_ours <= load_best + 1e-9),
        wall_ours_s=ours["wall_s"],
        wall_best_peer_s=best["wall_s"],
        time_ok=bool(ours["wall_s"] <= TARGET_TIME_FACTOR * best["wall_s"]),
    )
    out["met"] = bool(out["ratio_ok"] and out["load_ok"] and out["time_ok"])
    return out


def tflops_check(rows: list[dict]) -> dict:
    """Ours (default mode) against every peer in predicted held-out TFLOP/s per GPU at each setting.

    Returns ``{"met": bool | None, "settings": {setting: {"ours", "best_peer", "best_peer_tflops", "ok"}}}``;
    ``met`` None when ours did not run or the instance has no performance block.
    """
    scored = [r for r in rows if "metrics" in r]
    ours = next((r for r in scored if r["solver"] == OURS and "variant" not in r), None)
    peers = [r for r in scored if r["solver"] in PEERS]
    key = "heldout_predicted_tflops_per_gpu_{}"
    if ours is None or not peers or key.format(SETTINGS[0]) not in ours["metrics"]:
        return {"met": None, "settings": {}}
    out: dict = {"settings": {}}
    for setting in SETTINGS:
        k = key.format(setting)
        best = max(peers, key=lambda r, k=k: r["metrics"][k])
        mine = ours["metrics"][k]
        out["settings"][setting] = {"ours": mine, "best_peer": best["solver"], "best_peer_tflops": best["metrics"][k],
                                    "ok": bool(mine >= best["metrics"][k] * (1 - 1e-9))}
    out["met"] = all(v["ok"] for v in out["settings"].values())
    return out


def run_instance(instance: Instance, *, peers: Sequence[str], time_limit_s: float, peer_time_limit_s: float,
                 seed: int, workers: int, ours_checkpoint: bool = False, progress=None,
                 pipeline_split: bool = True) -> dict:
    """Every peer and ours on one instance; rows, ratios to the best peer, bound, target checks.

    Ours runs in its default mode (``apply`` runtime: free maps, the freedom ``eplb`` and ``kahypar``
    take).  With ``ours_checkpoint`` (and a group-limited model) ours also runs with ``apply``
    ``checkpoint`` (group-preserving maps), as an extra row: what the checkpoint-permutation rule costs.
    ``pipeline_split`` False keeps the instance's pipeline layout (its recipe's) for every row;
    True lets each solve choose its split (:func:`placement.solve`'s ``pipeline_split``).
    """
    runs: list[tuple[str, float, str | None, str | None]] = [(n, peer_time_limit_s, None, None) for n in peers]
    runs.append((OURS, time_limit_s, None, None))
    if ours_checkpoint and instance.model.group_limited:
        runs.append((OURS, time_limit_s, f"{OURS}, apply checkpoint", "checkpoint"))
    rows = []
    for name, limit, label, apply in runs:
        shown = label or name
        if progress:
            progress(f"{instance.name}: {shown} ...")
        row = _run_solver(instance, name, limit, seed, workers, label=label, apply=apply,
                          pipeline_split=pipeline_split)
        if progress:
            if "skipped" in row:
                progress(f"{instance.name}: {shown} skipped ({row['skipped']})")
            else:
                progress(f"{instance.name}: {shown} done in {row['wall_s']:.1f} s")
        rows.append(row)
    peer_rows = [r for r in rows if r["solver"] in PEERS and "metrics" in r]
    best_held = min((r["metrics"]["heldout_cross_domain_bytes_per_step"] for r in peer_rows), default=None)
    default_held = next((r["metrics"]["heldout_cross_domain_bytes_per_step"] for r in peer_rows
                         if r["solver"] == "default"), None)
    for r in rows:
        if "metrics" in r and best_held:
            r["ratio_to_best_peer"] = r["metrics"]["heldout_cross_domain_bytes_per_step"] / best_held
        if "metrics" in r and default_held:
            r["ratio_to_default"] = r["metrics"]["heldout_cross_domain_bytes_per_step"] / default_held
    ours = next((r for r in rows if r["solver"] == OURS and "variant" not in r and "metrics" in r), None)
    bound = None
    scope = (f"{OURS}'s proved bound on the sampled tokens over its own search space (its rank layout; "
             "group-preserving maps when it was; its load caps): not a bound on peers that search elsewhere")
    if ours is not None and ours.get("bound_bytes") is not None:
        bound = {"bytes": ours["bound_bytes"], "partial": False, "source": scope}
    elif ours is not None and ours.get("partial_bound_bytes") is not None:
        bound = {"bytes": ours["partial_bound_bytes"], "partial": True,
                 "source": scope + f"; {ours.get('layers_without_bound')} layer(s) without a bound count 0"}
    return {
        "instance": instance.name,
        "sha256": instance.sha256,
        "cost_mode": instance.cost_mode,
        "rows": rows,
        "bound": bound,
        "target": target_check(rows),
        "tflops_target": tflops_check(rows),
    }


def _bytes(x: float) -> str:
    """Decimal units (kB = 10^3 B ... TB = 10^12 B), four significant figures."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:,.4g} {unit}"
    return f"{x:.0f} B"


def _tflops(x: float | None) -> str:
    """Predicted TFLOP/s per GPU (placement.predict.performance), n/a without a performance block."""
    return "n/a" if x is None else f"{x:,.0f}"


def _band(m: dict) -> str:
    """Held-out predicted TFLOP/s per GPU at the low, mid and high settings (or the plain figure)."""
    if f"heldout_predicted_tflops_per_gpu_{SETTINGS[0]}" not in m:
        return _tflops(m.get("heldout_predicted_tflops_per_gpu"))
    return " / ".join(_tflops(m[f"heldout_predicted_tflops_per_gpu_{s}"]) for s in SETTINGS)


def _limit(m: dict) -> str:
    """Held-out compute-bound TFLOP/s per GPU (no communication) at the low, mid and high settings."""
    if f"heldout_compute_bound_tflops_per_gpu_{SETTINGS[0]}" not in m:
        return "n/a"
    return " / ".join(_tflops(m[f"heldout_compute_bound_tflops_per_gpu_{s}"]) for s in SETTINGS)


def _gap(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def markdown_table(result: dict) -> str:
    """The instance's table (bytes per optimizer step, decimal units) and its target line."""
    head = (
        "| solver | cross-domain bytes/step, sampled | held-out | ratio to best peer (held-out) "
        "| busiest NIC bytes/step (held-out) | expert load max/mean (held-out) | wall s | group-preserving "
        "| predicted TFLOP/s per GPU (held-out), low / mid / high | compute-bound limit, low / mid / high "
        "| small HybridEP nodes (EP groups) |\n"
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |"
    )
    lines = [f"**{result['instance']}** ({result['cost_mode']})", "", head]
    for r in result["rows"]:
        name = r["label"] + (f" ({r['time_limit_s']:g} s limit)" if r["solver"] == OURS else "")
        if "metrics" not in r:
            lines.append(f"| {name} | skipped: {r['skipped']} | | | | | | | | | |")
            continue
        m = r["metrics"]
        lines.append(
            f"| {name} | {_bytes(m['cross_domain_bytes_per_step'])} | {_bytes(m['heldout_cross_domain_bytes_per_step'])} "
            f"| {r.get('ratio_to_best_peer', float('nan')):.3f} | {_bytes(m['heldout_max_gpu_cross_domain_bytes_per_step'])} "
            f"| {m['heldout_expert_load_max_over_mean']:.3f} | {r['wall_s']:.1f} | {'yes' if r['group_preserving'] else 'no'} "
            f"| {_band(m)} | {_limit(m)} | {m.get('heldout_small_node_ep_groups', 0)} |"
        )
    bound = result["bound"]
    if bound is None or (bound["partial"] and bound["bytes"] == 0):
        lines.append("| lower bound | n/a | | | | | | | | | |")
    else:
        what = "ours, its search space" + (", layers without one count 0" if bound["partial"] else "")
        lines.append(f"| lower bound ({what}) | {_bytes(bound['bytes'])} | | | | | | | | | |")
    t = result["target"]
    if t.get("met") is None:
        lines.append(f"\ntarget: not checked ({t.get('note')}); best peer on held-out tokens: {t['best_peer']}")
    else:
        lines.append(
            f"\ntarget vs best peer `{t['best_peer']}`: held-out ratio {t['ratio']:.3f} (<= {TARGET_RATIO}, or "
            f"within {TARGET_BOUND_GAP:.0%} of the bound (gap {_gap(t.get('bound_gap'))}): "
            f"{'yes' if t['ratio_ok'] else 'NO'}); load {t['load_ours']:.3f} vs {t['load_best_peer']:.3f} "
            f"({'yes' if t['load_ok'] else 'NO'}); wall {t['wall_ours_s']:.1f} s vs {t['wall_best_peer_s']:.1f} s "
            f"(<= {TARGET_TIME_FACTOR:g}x: {'yes' if t['time_ok'] else 'NO'})"
        )
    tt = result.get("tflops_target") or {}
    if tt.get("met") is not None:
        parts = [f"{s} {v['ours']:,.0f} vs {v['best_peer']} {v['best_peer_tflops']:,.0f} ({'yes' if v['ok'] else 'NO'})"
                 for s, v in tt["settings"].items()]
        lines.append(f"TFLOP/s target (ours >= every peer, held-out, each setting): {'; '.join(parts)}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/peers.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--instances", nargs="+", default=None,
                        help="instance names (in instances/) or paths; default: every committed instance")
    parser.add_argument("--time-limit", type=float, default=60.0, help=f"seconds for ours ({OURS}); default 60")
    parser.add_argument("--peer-time-limit", type=float, default=3600.0,
                        help="seconds for each peer (only kahypar uses it); default 3600")
    parser.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated peers; default {','.join(PEERS)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=None, help="threads/processes per solver; default: all cores")
    parser.add_argument("--json", default=None, help="write the results as JSON to this file")
    parser.add_argument("--ours-checkpoint", action="store_true",
                        help="also run ours with --apply checkpoint (group-preserving maps; group-limited models), as "
                             "an extra row")
    parser.add_argument("--keep-pipeline-layout", action="store_true",
                        help="keep each instance's pipeline layout (its recipe's) for every row instead of letting each "
                             "solve choose its split")
    args = parser.parse_args(argv)
    peers = tuple(p for p in args.peers.split(",") if p)
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        print(f"--peers: unknown peer(s) {unknown} (choose from {', '.join(PEERS)})", file=sys.stderr)
        return 2
    workers = args.workers or default_workers()
    names = args.instances or _committed_instances()

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    started = time.time()
    results = []
    for name in names:
        try:
            instance = _load(name)
        except PlacementError as exc:
            print(str(exc), file=sys.stderr)
            return getattr(exc, "exit_code", 1)
        res = run_instance(instance, peers=peers, time_limit_s=args.time_limit,
                           peer_time_limit_s=args.peer_time_limit, seed=args.seed, workers=workers,
                           ours_checkpoint=args.ours_checkpoint, progress=progress,
                           pipeline_split=not args.keep_pipeline_layout)
        results.append(res)
        print(markdown_table(res) + "\n", flush=True)
    cores = default_workers()
    print(f"(wall times measured with {workers} worker(s) on {cores} core(s); load average "
          f"{os.getloadavg()[0]:.1f} at the end; every row's load is in the JSON)")
    if args.json:
        doc = {
            "schema_version": SCHEMA_VERSION,
            "command": "python benchmarks/peers.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "started_unix_s": started,
            "workers": workers,
            "cores": cores,
            "time_limit_s": args.time_limit,
            "seed": args.seed,
            "target": {"ratio": TARGET_RATIO, "bound_gap": TARGET_BOUND_GAP, "time_factor": TARGET_TIME_FACTOR},
            "instances": results,
        }
        atomic_write_text(args.json, json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
