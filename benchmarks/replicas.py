"""Redundant expert slots: held-out TFLOP/s with N = 0, EP and 2 x EP, ours (``search``) against DeepSeek's
replication (``eplb``) at the same N, and the memory each costs per GPU.  One run, one evaluator.

For each instance: one placement (:func:`placement.solve`, no replicas, ``--time-limit`` seconds), then
per ``N`` and rule the replica block (:func:`placement.app.replica_block.replicas_block`, chosen on the
sampled window) priced by :func:`placement.predict.report.report` with ``replicas=`` on the held-out window at
the step-time model's low / mid / high settings.  Ratios are to the same placement without replicas
(``vs N=0``) and to ``eplb`` at the same ``N`` (``vs eplb``).

Usage::

    nice python benchmarks/replicas.py [--instances dsv3_256 qwen3_256 real_ep64 ...] [--time-limit S] [--json OUT]

``real_*`` instances have no performance block (their recorded model is tiny): they are priced with
dsv3_256's block (DeepSeek-V3 architecture, GB300, MXFP8) and dispatcher ``deepep``, since their FP8
dispatch bytes are not HybridEP's BF16 (a stand-in, named in the table).  Absolute TFLOP/s move with
the compute constants (``placement calibrate``); re-run after a refit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from placement.api import solve  # noqa: E402
from placement.predict.report import report  # noqa: E402
from placement.formats import read_instance  # noqa: E402
from placement.app.replica_block import replicas_block  # noqa: E402

SETTINGS = ("low", "mid", "high")


def load(name: str):
    inst = read_instance(ROOT / "instances" / f"{name}.json")
    if inst.performance is None:  # a real_* instance: DeepSeek-V3's block from dsv3_256, DeepEP (FP8 dispatch)
        perf = read_instance(ROOT / "instances" / "dsv3_256.json").performance
        inst = dataclasses.replace(inst, performance=dataclasses.replace(perf, dispatcher="deepep"))
        inst = dataclasses.replace(inst, name=f"{inst.name} (dsv3_256's performance block, deepep)")
    return inst


def heldout(rep: dict) -> dict[str, float]:
    return {s: float(rep[f"heldout_predicted_tflops_per_gpu_{s}"]) for s in SETTINGS}


def run(name: str, time_limit_s: float, rules: tuple[str, ...]) -> list[dict]:
    inst = load(name)
    t0 = time.monotonic()
    placement = solve(inst, time_limit_s=time_limit_s).placement
    solve_s = time.monotonic() - t0
    ep = inst.parallel.ep
    base = report(inst, placement)
    rows = [{"instance": inst.name, "N": 0, "rule": "-", "tflops": heldout(base), "memory_gb": 0.0,
             "solve_s": solve_s, "replica_s": 0.0, "search": None}]
    for n in (ep, 2 * ep):
        for rule in rules:
            t0 = time.monotonic()
            try:
                block = replicas_block(inst, placement, n, rule)
            except Exception as exc:  # noqa: BLE001 - a count the layer cannot take is reported, not fatal
                rows.append({"instance": inst.name, "N": n, "rule": rule, "error": str(exc)})
                continue
            pr = block["priced"]
            rows.append({"instance": inst.name, "N": n, "rule": rule,
                         "tflops": {s: pr[f"heldout_predicted_tflops_per_gpu_{s}"] for s in SETTINGS},
                         "memory_gb": pr.get("replica_memory_bytes_per_gpu", float("nan")) / 1e9,
                         "solve_s": solve_s, "replica_s": time.monotonic() - t0, "search": block.get("search")})
    return rows


def table(rows: list[dict]) -> str:
    out = ["| instance | N | rule | held-out TFLOP/s low / mid / high | vs N=0 (mid) | vs eplb (mid) | memory per GPU (GB) |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    by = {(r["instance"], r["N"], r["rule"]): r for r in rows}
    for r in rows:
        if "error" in r:
            out.append(f"| {r['instance']} | {r['N']} | {r['rule']} | refused: {r['error']} | | | |")
            continue
        t = r["tflops"]
        zero = by[(r["instance"], 0, "-")]["tflops"]["mid"]
        peer = by.get((r["instance"], r["N"], "eplb"))
        vs_peer = f"{t['mid'] / peer['tflops']['mid']:.4f}" if peer and "tflops" in peer and r["rule"] != "eplb" else ""
        out.append(f"| {r['instance']} | {r['N']} | {r['rule']} | {t['low']:,.1f} / {t['mid']:,.1f} / {t['high']:,.1f} | "
                   f"{t['mid'] / zero:.4f} | {vs_peer} | {r['memory_gb']:.2f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", nargs="+", default=["dsv3_256", "qwen3_256", "real_ep64", "dsv3_1024"])
    ap.add_argument("--time-limit", type=float, default=60.0, help="seconds for each instance's solve")
    ap.add_argument("--rules", default="search,eplb", help="replica rules, comma-separated (default search,eplb)")
    ap.add_argument("--json", help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    rows: list[dict] = []
    for name in args.instances:
        got = run(name, args.time_limit, tuple(args.rules.split(",")))
        rows += got
        print(table(got), flush=True)
        for r in got:
            if r.get("search"):
                s = r["search"]
                print(f"  {name} N={r['N']} search: chose {s['chosen']}, layers from {s['layers_from']}, sampled rank "
                      f"load {s['rank_load_max_over_mean_mean']:.4f} (lower bound {s['rank_load_lower_bound_mean']:.4f}), "
                      f"{r['replica_s']:.1f} s", flush=True)
        print(flush=True)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
