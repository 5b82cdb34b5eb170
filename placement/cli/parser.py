"""The argument parser of every command (``placement --help``)."""

from __future__ import annotations

import argparse
from typing import NoReturn

from placement.cli.common import _ALLOCATION_HELP, _QUIET_HELP
from placement.core.model import InvalidInputError

__all__ = ["build_parser"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2
        raise InvalidInputError(f"{self.prog}: {message}")


def redundant_count(value: str) -> int | str:
    """``--redundant-experts``: an integer or ``auto`` (placement.app.replica_block.choose_redundant_experts)."""
    return "auto" if value == "auto" else int(value)


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
    so.add_argument("--consumer", default=None, choices=CONSUMERS,
                    help="layout rule of the dispatcher (default: the instance's performance.dispatcher, "
                         "hybridep/deepep -> its equal-slice rule, else none)")
    so.add_argument("--apply", default=None, choices=("runtime", "checkpoint"),
                    help="how the expert maps reach the job. runtime (the default, unless the instance's apply "
                         "says otherwise): mapped at dispatch time (placement.consumers.runtime hooks for Megatron-Core and "
                         "TorchTitan with a keep-router checkpoint permutation; SGLang and vLLM expert maps), any "
                         "map; checkpoint: router and experts renumbered offline, so under group-limited routing "
                         "the maps keep expert groups whole")
    so.add_argument("--group-preserving", default="auto", choices=("auto", "on", "off"),
                    help="deprecated override of the expert-map mode: auto (default) follows --apply "
                         "(group-preserving exactly with checkpoint under group-limited routing); on restricts "
                         "any solve to group-preserving maps; off = fit free maps (refused with --apply checkpoint "
                         "under group-limited routing; by default a runtime solve under group-limited routing fits "
                         "group-preserving maps, then weighs free ones)")
    so.add_argument("--free", dest="group_preserving", action="store_const", const="off",
                    help="deprecated: same as --group-preserving off (fit free maps)")
    so.add_argument("--objective", default="step_time", choices=OBJECTIVES,
                    help="step_time (default): fastest predicted step (the performance model on the evaluator's "
                         "metrics, bytes break ties; total when the instance has no performance block); total: fewest cross-domain bytes with no stage slower than the default layout's "
                         "slowest; bottleneck: the slowest stage's all-to-all time")
    so.add_argument("--layout", default=None, choices=LAYOUT_MODES,
                    help="optimize the rank -> GPU map (default), or keep the default one (fixed); with "
                         "--previous the previous rank layout is kept")
    so.add_argument("--fit", default="robust", choices=("robust", "mean", "latest"),
                    help="instances with several sampled windows (routing.window_tokens): fit the expert maps to the "
                         "worst window (robust, default), their mean, or the latest only; the guard against the "
                         "default map judges on the latest window. No effect with one window")
    so.add_argument("--keep-pipeline-layout", action="store_true",
                    help="keep the instance's pipeline layer split (default: choose it for the placement, "
                         "docs/pipeline_layout.md)")
    so.add_argument("--json", action="store_true", help="print the result as JSON")
    so.add_argument("--redundant-experts", type=redundant_count, default=0, metavar="N",
                    help="N extra expert slots per MoE layer for replicas of hot experts (N / ep per GPU; E + N must "
                         "divide over ep, as SGLang's --ep-num-redundant-experts; docs/replicas.md); auto: the one of "
                         "0, ep, 2 ep with the fastest predicted step")
    so.add_argument("--replica-memory-budget", type=float, default=None, metavar="GB",
                    help="GB per GPU the redundant slots may take: auto skips the counts over it, a fixed N over it "
                         "is refused (default: no budget)")
    so.add_argument("--replica-rule", default="search", choices=("search", "hottest", "eplb"),
                    help="how the replicas are chosen (default search: per layer CP-SAT / local search priced by the "
                         "evaluator, never worse than hottest or eplb; eplb: DeepSeek EPLB's replicate_experts)")
    so.add_argument("--allocation", metavar="HOSTS", help=_ALLOCATION_HELP)
    so.add_argument("-q", "--quiet", action="store_true", help=_QUIET_HELP)
    mv = so.add_argument_group("re-placement (docs/experts.md, 'Re-placement')")
    mv.add_argument("--previous", metavar="OLD.json",
                    help="re-place against this placement file (same instance shape), or 'default': keep its "
                         "rank layout, change expert maps only, report what moves")
    rule = mv.add_mutually_exclusive_group()
    rule.add_argument("--max-moved-bytes", metavar="B",
                      help="hard budget on the expert state moved (cross-rack plus NVLink), in bytes or as a "
                           "share of all expert replicas' state (10%%); 0 keeps the previous placement")
    rule.add_argument("--move-cost", type=float, metavar="W",
                      help="a moved byte costs W bytes of per-step all-to-all (1/N: amortised over N steps; "
                           "NVLink bytes weigh scaleout/nvlink); default 0 (moves free, ties keep experts)")
    mv.add_argument("--expert-params", type=int, metavar="N",
                    help="parameters per routed expert (default: from the instance's performance block)")
    mv.add_argument("--optimizer-state", default="sharded", choices=("sharded", "replicated"),
                    help="optimizer state sharded over an expert's replicas (distributed optimizer, default) or "
                         "held whole by each")

    from placement.consumers.export import FORMATS

    ex = sub.add_parser("export", help="write a placement in a format a training or serving stack reads")
    ex.add_argument("placement", help="placement file")
    ex.add_argument("--format", required=True, choices=FORMATS, help="target stack (docs/formats.md)")
    ex.add_argument("-o", "--output", required=True, help="output file (written atomically)")
    ex.add_argument("--instance", help="the instance file the placement was solved for (required except for vllm)")
    ex.add_argument("--apply", default=None, choices=("runtime", "checkpoint"),
                    help="megatron/torchtitan: runtime writes the keep-router permutation (the experts move in the "
                         "checkpoint, the router does not) that placement.consumers.runtime's hooks also install; checkpoint "
                         "the permutation of router and experts (group-preserving maps under group-limited routing). "
                         "Default: what the placement was solved for (its apply), else the instance's (runtime)")
    ex.add_argument("--keep-router", action="store_true",
                    help="same as --apply runtime (kept for older scripts)")

    from placement.sources.importers import DEFAULT_MAX_TOKENS_PER_SOURCE, SOURCES

    im = sub.add_parser("import", help="build an instance from recorded routing traces (README: bring your own)")
    im.add_argument("traces", nargs="+", metavar="TRACES", help="trace files of every rank")
    im.add_argument("--from", dest="source", required=True, choices=SOURCES, help="the stack that recorded them")
    im.add_argument("-o", "--output", required=True, help="instance JSON to write (with its .npz), atomically")
    im.add_argument("--base", help="instance JSON whose model, parallel and cluster sections to use")
    im.add_argument("--model", help="JSON of the model section (or an instance file); overrides --base")
    im.add_argument("--parallel", help="JSON of the parallel section (or an instance file); overrides --base")
    im.add_argument("--cluster", help="JSON of the cluster section (or an instance file); overrides --base")
    im.add_argument("--name", help="instance name (default: the base's, else 'imported')")
    im.add_argument("--cost-mode", choices=("per_domain", "per_pair"), help="default: the base's, else per_domain")
    im.add_argument("--heldout-steps", type=int, default=None, metavar="N",
                    help="last N steps (forward passes, requests) form the held-out window (default: a quarter)")
    im.add_argument("--max-tokens-per-source", type=int, default=DEFAULT_MAX_TOKENS_PER_SOURCE, metavar="N",
                    help=f"cap on tokens kept per source and window (default {DEFAULT_MAX_TOKENS_PER_SOURCE})")
    im.add_argument("--windows", type=int, default=1, metavar="N",
                    help="cut the fit steps into N time-ordered sampled windows, for solve --fit (default 1)")
    im.add_argument("-q", "--quiet", action="store_true", help=_QUIET_HELP)

    st = sub.add_parser("stats", help="routing statistics of an instance: what to check before trusting a solve")
    st.add_argument("instance", help="instance JSON file")
    st.add_argument("--distance", type=int, default=1, help="MoE-layer distance of the co-activation statistic")
    st.add_argument("--json", action="store_true", help="print every statistic as JSON")
    st.add_argument("--against", metavar="INSTANCE", help="also the drift (load TV, top-8 partners kept) against this instance")

    ve = sub.add_parser("verify", help="check a placement file against its instance; exit 2 listing every violation")
    ve.add_argument("instance", help="instance JSON file")
    ve.add_argument("placement", help="placement file")

    from placement.core.executor import EXECUTOR_NAMES
    from placement.plan import DEFAULT_PLAN_TIME_LIMIT_S

    pl = sub.add_parser("plan", help="choose the job's parallel layout and placement for the free GPUs (docs/plan.md)")
    pl.add_argument("job", help="job JSON file (model, batch, precision, routing source)")
    pl.add_argument("--cluster", required=True, help="cluster JSON file (racks, trays down, links, GPU HBM)")
    pl.add_argument("--candidates", metavar="SPEC", help="restrict the candidate set, e.g. 'pp=8,16 ep=32,64' (tp cp pp vpp ep dp mb)")
    pl.add_argument("-o", "--output", help="write the plan JSON here, and beside it the recommendation's instance, placement and rack map")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON with stable keys")
    pl.add_argument("--time-limit", type=float, default=DEFAULT_PLAN_TIME_LIMIT_S, metavar="S",
                    help=f"wall-clock budget of the whole plan (default {DEFAULT_PLAN_TIME_LIMIT_S:g})")
    pl.add_argument("--seed", type=int, default=0)
    pl.add_argument("--executor", default="local", choices=EXECUTOR_NAMES, help="where candidate solves run (default local)")
    pl.add_argument("--ray-address", default=None, metavar="ADDR", help="Ray cluster address (--executor ray)")
    pl.add_argument("--workers", type=int, default=None, help="worker processes (local) or CPUs (ray); default: the cores available")
    pl.add_argument("--export", action="append", metavar="FORMAT=PATH",
                    help="also export the recommendation as placement export writes it (repeatable; needs -o)")
    pl.add_argument("--top", type=int, default=10, help="rows of the table (default 10)")
    pl.add_argument("--allocation", metavar="HOSTS", help=_ALLOCATION_HELP)

    from placement.sources.discovery import DEFAULT_GPU_HBM_GB, DEFAULT_NVLINK_GBPS, DEFAULT_SCALEOUT_GBPS, SOURCES as CLUSTER_SOURCES

    cl = sub.add_parser("cluster", help="write a cluster file from Slurm, Kubernetes or nvidia-smi (docs/formats.md)")
    cl.add_argument("inputs", nargs="*", metavar="INPUT",
                    help="slurm: scontrol show topology output or topology.conf, and scontrol show node output (none: "
                         "run scontrol); kubernetes: kubectl get nodes -o json; nvidia-smi: nvidia-smi -q of each "
                         "host as HOST=PATH or HOST.txt")
    cl.add_argument("--from", dest="source", required=True, choices=CLUSTER_SOURCES, help="where the cluster is read")
    cl.add_argument("-o", "--output", required=True, help="cluster JSON to write (atomically)")
    cl.add_argument("--name", help="name of the cluster state (default: the source)")
    cl.add_argument("--nvlink-gbps", type=float, default=DEFAULT_NVLINK_GBPS,
                    help=f"NVLink bandwidth per GPU, 10^9 B/s (default {DEFAULT_NVLINK_GBPS:g}, GB300 NVL72)")
    cl.add_argument("--scaleout-gbps", type=float, default=DEFAULT_SCALEOUT_GBPS,
                    help=f"scale-out NIC bandwidth per GPU and direction, 10^9 B/s (default {DEFAULT_SCALEOUT_GBPS:g})")
    cl.add_argument("--gpu-hbm-gb", type=float, default=DEFAULT_GPU_HBM_GB,
                    help=f"HBM per GPU, 10^9 B (default {DEFAULT_GPU_HBM_GB:g}, GB300)")
    cl.add_argument("--hbm-reserve-gb", type=float, default=None, help="HBM per GPU kept free (default: plan's)")
    cl.add_argument("--gpus-per-node", type=int, default=None,
                    help="slurm without scontrol show node output: GPUs of every node")
    cl.add_argument("--allow-not-responding", action="store_true",
                    help="slurm: count nodes whose slurmd does not answer (NOT_RESPONDING, *) as usable")
    cl.add_argument("--down-taint", action="append", metavar="KEY",
                    help="kubernetes: a NoSchedule/NoExecute taint key that also marks a node down (repeatable)")
    cl.add_argument("--skip-unready", action="store_true",
                    help="leave out, with a one-line warning each, hosts whose NVLink domain is not known yet "
                         "(nvidia-smi: no GPU registered in the fabric; kubernetes: no nvidia.com/gpu.clique label; "
                         "slurm: in no block or leaf switch) instead of refusing them")
    pl.add_argument("-q", "--quiet", action="store_true", help=_QUIET_HELP)

    ca = sub.add_parser("calibrate", help="predict measured runs, fit the step-time model on them (docs/performance.md)")
    ca.add_argument("rows", nargs="?", default=None,
                    help="ladder file of measured runs (docs/formats.md; default: the published ladder shipped with the package)")
    ca.add_argument("--fit", default=None, metavar="NAMES",
                    help="comma-separated parameters to fit on the rows marked fit: gemm_efficiency (one ceiling per GPU "
                         "kind) and at most three of gemm_half_shape, fp8_gemm_ratio, elementwise_bytes, layer_overhead_s, "
                         "expert_gemm_efficiency, overlap_efficiency (default gemm_efficiency,fp8_gemm_ratio,"
                         "elementwise_bytes,layer_overhead_s,overlap_efficiency)")
    ca.add_argument("--cross-validate", action="store_true",
                    help="print leave-one-configuration-out and leave-one-model-family-out errors of every row "
                         "(each fit on all other rows; docs/performance.md)")
    ca.add_argument("-o", "--output", help="write the fitted performance block and every row's prediction (JSON, atomic)")
    ca.add_argument("--from-logs", nargs="+", default=None, metavar="LOG",
                    help="training logs (Megatron-LM, Megatron-Bridge, TorchTitan), one run each, as rows to predict "
                         "and fit on, after ROWS' rows when ROWS is given (docs/runlogs.md)")
    ca.add_argument("--gpu", default=None, metavar="KIND", help="--from-logs: the GPU kind the runs used (h100, gb200, ...)")
    ca.add_argument("--gpus", type=int, default=None, metavar="N",
                    help="--from-logs: GPUs of the job, for logs that do not say it (Megatron-Bridge)")
    ca.add_argument("--config", default=None, metavar="TOML",
                    help="--from-logs: TorchTitan's job configuration (a TOML file, or its launch arguments in one string)")
    ca.add_argument("--write-rows", default=None, metavar="ROWS.json",
                    help="--from-logs: write the logs' rows as a ladder file (placement calibrate ROWS.json reads it)")

    sh = sub.add_parser("show", help="draw a placement as a rack map (PNG or SVG)")
    sh.add_argument("placement", help="placement file, or 'default' (the default layout; needs -o)")
    sh.add_argument("--instance", help="the instance file the placement was solved for (required)")
    sh.add_argument("-o", "--output", help="map.png or map.svg, written atomically (default: the placement file with .png)")
    sh.add_argument("--window", default=None, choices=("heldout", "sampled"),
                    help="tokens the bytes are computed on (default heldout)")
    return parser
