"""Per-layer work that scales: a 64-expert wide-EP instance with about 85k distinct expert sets per layer.

The instance (built here from :data:`SPEC` by the project's seeded generator, so it needs no
committed file): 64 experts, top-8, 8 expert groups with 4 per token, one EP-64 group over 4 NVLink
domains of 16 GPUs, 4 MoE layers, 64 sources x 2,048 sampled tokens (131,072 per layer, about 85k
distinct expert sets, 110k nets counting the source domain) and 512 held-out tokens per source.

Each run is ``placement solve --layout fixed --time-limit S`` in a subprocess (the CLI, so the file
it writes is what is compared), optionally next to ``--hog N`` busy-loop processes (two on the
2-core project machine give a load average of about 4 with the solve's two workers).  Printed per
run: wall seconds, held-out cross-domain bytes over the default map's (same evaluator, same run),
per layer the status, the chosen candidate, whether the clock or a stop ended any of its work
(``stopped_early``) and what its search saw (``search_nets``); then whether every run wrote the same
bytes.  Timings depend on the machine's load; the load average is printed with every run.

Usage::

    python benchmarks/wide_ep.py [--time-limit 60] [--runs 2] [--hog 2] [--seed 0] [--write DIR]
                                 [--group-preserving auto|on|off] [--json OUT]
    python benchmarks/wide_ep.py --layer-sizes 3000,10000,40000,all [--group-preserving off] [--write DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

from placement.predict.report import report  # noqa: E402
from placement.formats import atomic_write_text, read_instance, write_instance  # noqa: E402
from placement.sources.instances import InstanceSpec, build  # noqa: E402
from solvers.default import default_placement  # noqa: E402

__all__ = ["SPEC", "main"]

SPEC = InstanceSpec(
    name="wide_ep64_85k",
    description=(
        "Synthetic wide EP at scale: 64 experts, top-8, 8 groups / 4 per token, one EP-64 group over 4 "
        "NVLink domains of 16 GPUs, 64 sources x 2,048 sampled tokens (about 85k distinct expert sets per layer)."
    ),
    model_name="synthetic-64e",
    num_layers=5,
    first_moe_layer=1,
    num_experts=64,
    top_k=8,
    num_groups=8,
    groups_per_token=4,
    hidden_size=7168,
    tp=1,
    cp=1,
    ep=64,
    dp=64,
    pp=1,
    stage_sizes=(5,),
    seq_len=4096,
    micro_batch=1,
    global_batch=1024,
    num_domains=4,
    trays_per_domain=4,
    gpus_per_tray=4,
    trays_down=0,
    tokens_per_source=2048,
    heldout_tokens_per_source=512,
    seed=85,
)


def _load() -> float:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # pragma: no cover
        return float("nan")


def _cpu_s() -> float:
    """CPU seconds (user + system) of this process's waited-for children so far."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _solve(path: Path, out: Path, time_limit_s: float, seed: int, group_preserving: str) -> tuple[int, float, str]:
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", "from placement.cli import entry; entry()", "solve", str(path), "--layout", "fixed",
         "--time-limit", str(time_limit_s), "--seed", str(seed), "--group-preserving", group_preserving,
         "-o", str(out)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
    )
    return proc.returncode, time.monotonic() - t0, proc.stderr


def _layer_rows(doc: dict) -> list[dict]:
    return [{"layer": d["layer"], "status": d["status"], "chosen": d["chosen"],
             "stopped_early": d.get("stopped_early", "fallback_reason" in d),
             "search_nets": d.get("search_nets"), "fallback_reason": d.get("fallback_reason")}
            for d in doc["solve"]["details"]["layers"]]


def run(*, time_limit_s: float, runs: int, hog: int, seed: int, workdir: Path, group_preserving: str = "auto") -> dict:
    path = workdir / f"{SPEC.name}.json"
    if not path.exists():
        write_instance(build(SPEC), path)
    instance = read_instance(path)
    default_heldout = report(instance, default_placement(instance))["heldout_cross_domain_bytes_per_step"]
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL) for _ in range(hog)]
    rows = []
    try:
        for r in range(runs):
            out = workdir / f"run{r}.json"
            cpu0 = _cpu_s()
            code, wall_s, err = _solve(path, out, time_limit_s, seed, group_preserving)
            row: dict = {"run": r, "exit": code, "wall_s": round(wall_s, 1), "cpu_s": round(_cpu_s() - cpu0, 1),
                         "load": _load()}
            if code == 0:
                doc = json.loads(out.read_text())
                row["heldout_ratio"] = round(doc["metrics"]["heldout_cross_domain_bytes_per_step"] / default_heldout, 4)
                row["layers"] = _layer_rows(doc)
            else:
                row["stderr"] = err[-2000:]
            rows.append(row)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    files = [workdir / f"run{r}.json" for r in range(runs)]
    same = all(f.exists() for f in files) and len({f.read_bytes() for f in files}) == 1
    return {"instance": SPEC.name, "time_limit_s": time_limit_s, "group_preserving": group_preserving,
            "hog_processes": hog, "runs": rows,
            "byte_identical": same}


def layer_sizes(path: Path, limits: Sequence[int | None], *, group_preserving: bool, layer: int = 0) -> list[dict]:
    """One layer solved in this process with its search limited to each of ``limits`` nets (None: all):
    wall and CPU seconds (this process; about the wall time on an idle machine) and crossings (the
    constants behind ``solvers.experts.search_net_limit``)."""
    from solvers.experts import LayerBudget, LayerWorker, solve_layer
    from solvers.experts.tuning import CLASS_LOAD_TOLERANCE, CLASS_LOAD_TOLERANCE_GROUP_PRESERVING

    instance = read_instance(path).for_solver()
    worker = LayerWorker(instance, default_placement(instance).rank2gpu, group_preserving, 0.25)
    tol = CLASS_LOAD_TOLERANCE_GROUP_PRESERVING if group_preserving else CLASS_LOAD_TOLERANCE
    rows = []
    for limit in limits:
        problem = worker.problem(layer)
        t0, c0 = time.monotonic(), time.process_time()
        o = solve_layer(problem, LayerBudget(0.0, 1, time.monotonic() + 1e4, search_nets=limit),
                        model_groups=instance.model.num_groups, class_tolerance=tol)
        d = o.details
        rows.append({"limit": limit, "wall_s": round(time.monotonic() - t0, 2),
                     "cpu_s": round(time.process_time() - c0, 2), "load": _load(),
                     "crossings": d["objective_crossings"], "default_crossings": d["candidates"]["default"]["all"],
                     "validation": d["validation_crossings"], "search_nets": d["search_nets"]})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--hog", type=int, default=0, help="busy-loop processes next to the solves")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--group-preserving", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--write", type=Path, help="keep the instance and the placement files in this folder")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--layer-sizes", help="instead: layer 0 in this process with the search limited to these "
                    "nets, e.g. 3000,10000,all")
    args = ap.parse_args(argv)
    if args.layer_sizes:
        with tempfile.TemporaryDirectory() as tmp:
            workdir = args.write or Path(tmp)
            workdir.mkdir(parents=True, exist_ok=True)
            path = workdir / f"{SPEC.name}.json"
            if not path.exists():
                write_instance(build(SPEC), path)
            limits = [None if x == "all" else int(x) for x in args.layer_sizes.split(",")]
            for row in layer_sizes(path, limits, group_preserving=args.group_preserving != "off"):
                print(row)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.write or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        res = run(time_limit_s=args.time_limit, runs=args.runs, hog=args.hog, seed=args.seed, workdir=workdir,
                  group_preserving=args.group_preserving)
    for row in res["runs"]:
        print(f"run {row['run']}: exit {row['exit']}, {row['wall_s']} s wall, {row.get('cpu_s')} CPU s "
              f"(the solve and its workers), load {row['load']}, "
              f"held-out bytes / default {row.get('heldout_ratio')}")
        for ly in row.get("layers", []):
            print(f"  layer {ly['layer']}: {ly['status']}, {ly['chosen']}, stopped early {ly['stopped_early']}, "
                  f"search nets {ly['search_nets']}" + (f", fallback: {ly['fallback_reason']}" if ly["fallback_reason"] else ""))
        if "stderr" in row:
            print(row["stderr"])
    print(f"byte-identical files: {res['byte_identical']}")
    if args.json:
        atomic_write_text(args.json, json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
