"""Peak memory of ``placement import`` on about 1 GB of Megatron router traces.

Generates DeepSeek-V3-like traces (256 experts, top-8, 4,096 tokens per router call) for a
dp=8 x pp=2 job with 8 MoE layers and 4 micro-batches per step, as Megatron-LM's tracer writes
them (``router_trace_rank{r}.jsonl``, one JSON record per call), then runs ``placement import`` in a
child process and prints its peak resident memory next to a baseline measured in the same run: a
child that starts the interpreter and imports the CLI and the importers.  The traces are streamed
(the scan keeps a byte offset per record, the second pass parses only records holding kept
tokens), so the import's peak stays near the baseline plus the largest record and the kept ids,
however large the traces are.

    python benchmarks/import_memory.py [--gb 1.0] [--keep DIR]

Prints ratios against the baseline; wall times are indicative (2-core machine shared with other
jobs).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

E, K, TOKENS, DP, PP, MICRO, MOE_PER_STAGE = 256, 8, 4096, 8, 2, 4, 4


def _sections(folder: Path) -> list[str]:
    layers = PP * MOE_PER_STAGE
    model = {"name": "dsv3-like", "num_layers": layers, "moe_layers": list(range(layers)), "num_experts": E,
             "top_k": K, "num_groups": 8, "groups_per_token": 8, "hidden_size": 7168,
             "dispatch_bytes_per_token": 7392, "combine_bytes_per_token": 14336}
    parallel = {"tp": 1, "cp": 1, "ep": 8, "dp": DP, "pp": PP, "order": "tp-cp-ep-dp-pp",
                "stage_layers": [list(range(s * MOE_PER_STAGE, (s + 1) * MOE_PER_STAGE)) for s in range(PP)],
                "seq_len": TOKENS, "micro_batch": 1, "global_batch": DP * MICRO}
    cluster = {"num_domains": 1, "trays_per_domain": 4, "gpus_per_tray": 4, "nvlink_gbps": 900.0,
               "scaleout_gbps": 100.0}
    args = []
    for key, doc in (("model", model), ("parallel", parallel), ("cluster", cluster)):
        (folder / f"{key}.json").write_text(json.dumps(doc))
        args += [f"--{key}", str(folder / f"{key}.json")]
    return args


def generate(folder: Path, target_bytes: int) -> tuple[list[str], int]:
    """Write traces of about ``target_bytes``; returns the files and their total size."""
    rng = np.random.default_rng(0)
    pool = np.sort(rng.random((64, TOKENS, E), dtype=np.float32).argsort(axis=-1)[..., :K], axis=-1)
    record_bytes = len(json.dumps(pool[0].tolist())) + 120
    steps = max(2, round(target_bytes / (record_bytes * DP * PP * MICRO * MOE_PER_STAGE)))
    paths, total = [], 0
    folder.mkdir(parents=True, exist_ok=True)
    for pp in range(PP):
        for d in range(DP):
            rank = d + DP * pp
            path = folder / f"router_trace_rank{rank}.jsonl"
            with path.open("w") as fh:
                for step in range(steps):
                    for _ in range(MICRO):
                        for local in range(MOE_PER_STAGE):
                            top = pool[int(rng.integers(64))]
                            fh.write(json.dumps({"step": step, "stage": "pre_dispatch", "block": "decoder",
                                                 "layer": local, "rank": rank, "num_tokens": TOKENS, "topk": K,
                                                 "top_indices": top.tolist()}) + "\n")
            total += path.stat().st_size
            paths.append(str(path))
    return paths, total


def peak_rss_mb(argv: list[str]) -> tuple[float, float]:
    """(peak RSS in MB, wall s) of a child process running ``argv``."""
    t0 = time.monotonic()
    # a fresh intermediate process per measurement, so RUSAGE_CHILDREN holds only that child
    code = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)")
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"failed: {' '.join(argv)}\n{out.stderr}")
    return int(out.stdout.strip().splitlines()[-1]) / 1024, time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0, help="trace size to generate, in 10^9 bytes")
    ap.add_argument("--keep", help="generate into (and keep) this folder instead of a temporary one")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="import-memory-") as tmp:
        folder = Path(args.keep) if args.keep else Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        sections = _sections(folder)
        t0 = time.monotonic()
        paths, total = generate(folder / "traces", int(args.gb * 1e9)) if not (folder / "traces").exists() else (
            sorted(str(p) for p in (folder / "traces").iterdir()), sum(p.stat().st_size for p in (folder / "traces").iterdir()))
        gen_s = time.monotonic() - t0
        base_mb, base_s = peak_rss_mb([sys.executable, "-c", "import placement.cli, placement.sources.importers, placement.sources.importers.megatron"])
        out = folder / "imported.json"
        imp_mb, imp_s = peak_rss_mb([sys.executable, "-c", "import sys; from placement.cli import main; sys.exit(main(sys.argv[1:]))",
                                     "import", "--from", "megatron", *paths, *sections, "-o", str(out)])
        records = sum(1 for p in paths for _ in open(p, "rb"))
        print(f"traces: {total / 1e9:.3f} GB in {len(paths)} files, {records:,} records "
              f"(generated in {gen_s:.0f} s)")
        print(f"baseline (interpreter + imports): peak RSS {base_mb:8.1f} MB ({base_s:.1f} s)")
        print(f"placement import --from megatron: peak RSS {imp_mb:8.1f} MB ({imp_s:.1f} s), "
              f"{imp_mb / base_mb:.2f}x the baseline; the traces are {total / 1e6 / imp_mb:.1f}x that peak")
        print(f"wrote {out} ({out.with_suffix('.npz').stat().st_size / 1e6:.2f} MB npz)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
