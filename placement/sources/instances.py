"""The committed instances, built from specs by one seeded command.

Regenerate them all, byte for byte::

    python -m placement.sources.instances instances/

Every instance's routing comes from :func:`placement.sources.generator.generate_routing` (window 0 is the
fit window, window 1 the held-out window) and its unavailable trays from a seeded draw.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from placement.formats import write_instance
from placement.core.pipeline_layout import parse_layout, stage_decoder_layers, validate_chunks
from placement.sources.generator import TRAINED_MODEL_PARAMS, generate_routing
from placement.predict.performance import DEEPSEEK_V3, QWEN3_235B_A22B, Architecture, Performance
from placement.core.model import (
    Cluster,
    Instance,
    MoEModel,
    ParallelLayout,
    Routing,
    combine_bytes_bf16,
    dispatch_bytes_fp8,
)

__all__ = ["InstanceSpec", "SPECS", "build", "build_all", "main"]


@dataclass(frozen=True)
class InstanceSpec:
    name: str
    description: str
    # model
    model_name: str
    num_layers: int
    first_moe_layer: int
    num_experts: int
    top_k: int
    num_groups: int
    groups_per_token: int
    hidden_size: int
    # layout
    tp: int
    cp: int
    ep: int
    dp: int
    pp: int
    stage_sizes: tuple[int, ...]  # layers per pipeline stage
    seq_len: int
    micro_batch: int
    global_batch: int
    # cluster
    num_domains: int
    trays_per_domain: int
    gpus_per_tray: int
    trays_down: int  # scattered over the racks by a seeded draw
    # routing sample
    tokens_per_source: int
    # The held-out window holds four times the sampled tokens: at the sampled window's size its own
    # sampling noise moved the predicted TFLOP/s of one placement by about 0.3 % (one standard
    # deviation), as much as the differences between placements it is there to rank.
    heldout_tokens_per_source: int
    seed: int
    cost_mode: str = "per_domain"
    nvlink_gbps: float = 900.0  # NVLink 5: 1.8 TB/s per GPU counting both directions = 900 GB/s each way
    scaleout_gbps: float = 100.0  # 800 Gb/s NIC per GPU = 100 GB/s each way (full duplex)
    source_mix_concentration: float | None = None
    performance: Performance | None = None  # the step-time block (placement.predict.performance)
    routing_params: tuple[tuple[str, float], ...] = ()  # generate_routing arguments (skew, drift, ...)
    # MoE layers of multi-token prediction (layer indices num_layers + j, on the last stage); their
    # routing is generated as the layers after the decoder's last.  0: the MTP layers (if the
    # performance block counts any) are not placed.
    mtp_moe_layers: int = 0
    # Megatron-Core's pipeline_model_parallel_layout (placement.core.pipeline_layout); "" for none.  When
    # given, stage_sizes must be each pipeline rank's decoder-layer count under it.
    pipeline_layout: str = ""


# The generator's arguments per model shape: TRAINED_MODEL_PARAMS (fitted on the trained model's 64
# experts) re-fitted on each committed shape so that the sampled routing's expert load max/mean, its
# co-activation lift (placement.core.stats.realism_stats) and the fit-to-held-out load drift are within 20%
# of the trained model's (docs/real_routing.md, "The committed synthetic instances";
# tests/test_instances.py checks it).  More experts spread the same skew over a longer tail, so
# the 256- and 128-expert shapes need a weaker topic logit and a larger per-window drift.
_DSV3_ROUTING = tuple({**TRAINED_MODEL_PARAMS, "skew": 0.27, "topic_strength": 2.6, "drift": 0.95}.items())
_QWEN3_ROUTING = tuple({**TRAINED_MODEL_PARAMS, "skew": 0.35, "topic_strength": 2.6, "drift": 0.95}.items())
_TINY_ROUTING = tuple({**TRAINED_MODEL_PARAMS, "topic_strength": 15.0, "drift": 0.7}.items())

# GB300 NVL72, MXFP8 GEMMs, HybridEP, 1F1B with the all-to-all overlapped (Megatron-Core's
# combined 1F1B, which needs vpp > 1 when pp > 1: the stage splits give every stage the same layer
# slots, as Megatron-Bridge's DeepSeek-V3 layouts do), the calibrated efficiencies.
_DSV3_GB300 = Performance(gpu="gb300", precision="mxfp8", architecture=DEEPSEEK_V3)
_TINY_ARCH = Architecture(
    attention="gqa",
    num_attention_heads=4,
    ffn_hidden_size=512,
    moe_ffn_hidden_size=128,
    shared_expert_ffn_hidden_size=128,
    vocab_size=1024,
    mtp_num_layers=1,
    num_query_groups=2,
    kv_channels=64,
)

SPECS: dict[str, InstanceSpec] = {
    s.name: s
    for s in [
        InstanceSpec(
            name="dsv3_1024",
            description=(
                "DeepSeek-V3 671B pre-training on 15 GB200/GB300 NVL72 racks (1,080 GPUs, 14 trays "
                "down, 1,024 free): TP1 CP1 PP16 EP64 DP64, seq 4096, micro-batch 1, global batch 8192."
            ),
            model_name="DeepSeek-V3",
            num_layers=61,
            first_moe_layer=3,
            num_experts=256,
            top_k=8,
            num_groups=8,
            groups_per_token=4,
            hidden_size=7168,
            tp=1,
            cp=1,
            ep=64,
            dp=64,
            pp=16,
            stage_sizes=(4,) * 15 + (1,),
            # Megatron-Bridge's DeepSeek-V3 PP16 layout ([E+4] | [4]x14 | [1+mtp+loss],
            # src/megatron/bridge/recipes/deepseek/deepseek_v3.py at 05d003fb), each rank's layers
            # split over the instance's two virtual stages.
            pipeline_layout="Ett|(tt|)*14,t|(tt|)*15,mL",
            seq_len=4096,
            micro_batch=1,
            global_batch=8192,
            num_domains=15,
            trays_per_domain=18,
            gpus_per_tray=4,
            trays_down=14,
            tokens_per_source=128,
            heldout_tokens_per_source=512,
            seed=1024,
            routing_params=_DSV3_ROUTING,
            performance=dataclasses.replace(_DSV3_GB300, vpp=2),
        ),
        InstanceSpec(
            name="dsv3_256",
            description=(
                "DeepSeek-V3 on 4 NVL72 racks (288 GPUs, 8 trays down unevenly, 256 free): "
                "TP1 CP1 PP4 EP64 DP64."
            ),
            model_name="DeepSeek-V3",
            num_layers=61,
            first_moe_layer=3,
            num_experts=256,
            top_k=8,
            num_groups=8,
            groups_per_token=4,
            hidden_size=7168,
            tp=1,
            cp=1,
            ep=64,
            dp=64,
            pp=4,
            stage_sizes=(16, 16, 16, 13),
            # Megatron-Bridge's DeepSeek-V3 layout for PP4 VPP4 (the same file and commit).
            pipeline_layout="Et*4|(t*4|)*14,tmL",
            seq_len=4096,
            micro_batch=1,
            global_batch=2048,
            num_domains=4,
            trays_per_domain=18,
            gpus_per_tray=4,
            trays_down=8,
            tokens_per_source=128,
            heldout_tokens_per_source=512,
            seed=256,
            routing_params=_DSV3_ROUTING,
            performance=dataclasses.replace(_DSV3_GB300, vpp=4),
        ),
        InstanceSpec(
            name="dsv3_ep256",
            description=(
                "DeepSeek-V3 with an EP group wider than a rack: EP256 DP256 PP1 on 5 NVL72 racks "
                "(360 GPUs, 10 trays down, 320 free)."
            ),
            model_name="DeepSeek-V3",
            num_layers=61,
            first_moe_layer=3,
            num_experts=256,
            top_k=8,
            num_groups=8,
            groups_per_token=4,
            hidden_size=7168,
            tp=1,
            cp=1,
            ep=256,
            dp=256,
            pp=1,
            stage_sizes=(61,),
            seq_len=4096,
            micro_batch=1,
            global_batch=2048,
            num_domains=5,
            trays_per_domain=18,
            gpus_per_tray=4,
            trays_down=10,
            tokens_per_source=32,
            heldout_tokens_per_source=128,
            seed=2560,
            routing_params=_DSV3_ROUTING,
            performance=_DSV3_GB300,
        ),
        InstanceSpec(
            name="qwen3_256",
            description=(
                "A Qwen3-235B-A22B-like model without group-limited routing (128 experts, top-8, 94 "
                "MoE layers) on 4 NVL72 racks (256 free): TP1 CP1 PP4 EP32 DP64, two EP groups per stage."
            ),
            model_name="Qwen3-235B-A22B-like",
            num_layers=94,
            first_moe_layer=0,
            num_experts=128,
            top_k=8,
            num_groups=1,
            groups_per_token=1,
            hidden_size=4096,
            tp=1,
            cp=1,
            ep=32,
            dp=64,
            pp=4,
            stage_sizes=(23, 24, 24, 23),
            seq_len=4096,
            micro_batch=1,
            global_batch=2048,
            num_domains=4,
            trays_per_domain=18,
            gpus_per_tray=4,
            trays_down=8,
            tokens_per_source=96,
            heldout_tokens_per_source=384,
            seed=128,
            routing_params=_QWEN3_ROUTING,
            performance=Performance(gpu="gb300", precision="mxfp8", architecture=QWEN3_235B_A22B, vpp=4),
        ),
        InstanceSpec(
            name="tiny",
            description=(
                "A tiny group-limited MoE for tests: 16 experts in 4 groups, top-4 of 2 groups, 3 MoE "
                "layers; 5 domains of 2 trays x 2 GPUs, one tray down; TP1 CP1 PP2 EP8 DP8."
            ),
            model_name="tiny-moe",
            num_layers=4,
            first_moe_layer=1,
            num_experts=16,
            top_k=4,
            num_groups=4,
            groups_per_token=2,
            hidden_size=256,
            tp=1,
            cp=1,
            ep=8,
            dp=8,
            pp=2,
            stage_sizes=(2, 2),
            seq_len=512,
            micro_batch=1,
            global_batch=32,
            num_domains=5,
            trays_per_domain=2,
            gpus_per_tray=2,
            trays_down=1,
            tokens_per_source=32,
            heldout_tokens_per_source=128,
            seed=7,
            routing_params=_TINY_ROUTING,
            performance=Performance(gpu="gb200", precision="bf16", architecture=_TINY_ARCH, overlap="none"),
        ),
    ]
}


def _unavailable_trays(spec: InstanceSpec) -> list[tuple[int, int]]:
    """A seeded, uneven scatter of down trays over the racks (as a busy scheduler sees them)."""
    rng = np.random.default_rng(spec.seed + 1)
    n_trays = spec.num_domains * spec.trays_per_domain
    hosts = np.sort(rng.choice(n_trays, size=spec.trays_down, replace=False))
    return [(int(h) // spec.trays_per_domain, int(h) % spec.trays_per_domain) for h in hosts]


def build(spec: InstanceSpec) -> Instance:
    """Build the in-memory instance of ``spec`` (routing generated, trays drawn)."""
    moe_layers = tuple(range(spec.first_moe_layer, spec.num_layers + spec.mtp_moe_layers))
    if spec.performance is not None and spec.mtp_moe_layers:
        assert spec.performance.architecture.mtp_num_layers == spec.mtp_moe_layers, spec.name
    assert sum(spec.stage_sizes) == spec.num_layers and len(spec.stage_sizes) == spec.pp
    bounds = np.cumsum((0,) + spec.stage_sizes)
    stage_layers = tuple(tuple(range(int(a), int(b))) for a, b in zip(bounds[:-1], bounds[1:]))
    chunks: tuple[str, ...] = ()
    if spec.pipeline_layout:
        chunks = parse_layout(spec.pipeline_layout)
        mtp = spec.performance.architecture.mtp_num_layers if spec.performance is not None else spec.mtp_moe_layers
        validate_chunks(chunks, spec.pp, spec.num_layers, mtp)
        stage_layers = stage_decoder_layers(chunks, spec.pp)
        assert tuple(len(s) for s in stage_layers) == spec.stage_sizes, spec.name
    model = MoEModel(
        name=spec.model_name,
        num_layers=spec.num_layers,
        moe_layers=moe_layers,
        num_experts=spec.num_experts,
        top_k=spec.top_k,
        num_groups=spec.num_groups,
        groups_per_token=spec.groups_per_token,
        hidden_size=spec.hidden_size,
        # HybridEP dispatches in BF16 (Megatron-Core's fused_a2a.py refuses FP8 there); DeepEP in FP8.
        dispatch_bytes_per_token=(
            combine_bytes_bf16(spec.hidden_size)
            if spec.performance is not None and spec.performance.dispatcher == "hybridep"
            else dispatch_bytes_fp8(spec.hidden_size)
        ),
        combine_bytes_per_token=combine_bytes_bf16(spec.hidden_size),
        mtp_num_layers=spec.mtp_moe_layers,
    )
    parallel = ParallelLayout(
        tp=spec.tp,
        cp=spec.cp,
        ep=spec.ep,
        dp=spec.dp,
        pp=spec.pp,
        order="tp-cp-ep-dp-pp",
        stage_layers=stage_layers,
        seq_len=spec.seq_len,
        micro_batch=spec.micro_batch,
        global_batch=spec.global_batch,
        pipeline_layout=chunks,
    )
    available = np.ones(spec.num_domains * spec.trays_per_domain * spec.gpus_per_tray, dtype=bool)
    for d, t in _unavailable_trays(spec):
        h = d * spec.trays_per_domain + t
        available[h * spec.gpus_per_tray : (h + 1) * spec.gpus_per_tray] = False
    cluster = Cluster(
        num_domains=spec.num_domains,
        trays_per_domain=spec.trays_per_domain,
        gpus_per_tray=spec.gpus_per_tray,
        available=available,
        nvlink_gbps=spec.nvlink_gbps,
        scaleout_gbps=spec.scaleout_gbps,
    )
    gen_params: dict[str, Any] = dict(
        seed=spec.seed,
        num_layers=len(moe_layers),
        num_sources=spec.dp,
        tokens_per_source=spec.tokens_per_source,
        num_windows=2,
        num_experts=spec.num_experts,
        top_k=spec.top_k,
        num_groups=spec.num_groups,
        groups_per_token=spec.groups_per_token,
    )
    gen_params.update(dict(spec.routing_params))
    if spec.source_mix_concentration is not None:
        gen_params["source_mix_concentration"] = spec.source_mix_concentration
    # The fit window (window 0) and the held-out window (window 1) are drawn with their own token
    # counts: the window parameters (and their drift) do not depend on the count, and the held-out
    # window is large enough that its own sampling noise stays below the differences it ranks.
    topk = generate_routing(**gen_params)[0]
    held = generate_routing(**{**gen_params, "tokens_per_source": spec.heldout_tokens_per_source})[1]
    return Instance(
        name=spec.name,
        model=model,
        parallel=parallel,
        cluster=cluster,
        routing=Routing(topk, held),
        cost_mode=spec.cost_mode,  # type: ignore[arg-type]
        description=spec.description,
        performance=spec.performance,
        extra={
            "generator": {
                "function": "placement.generator.generate_routing",
                "window_fit": 0,
                "window_heldout": 1,
                "fit_tokens_per_source": spec.tokens_per_source,
                "heldout_tokens_per_source": spec.heldout_tokens_per_source,
                **gen_params,
            }
        },
    )


def build_all(outdir: str | Path, names: list[str] | None = None) -> list[Path]:
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    written = []
    for name in names or list(SPECS):
        path = outdir / f"{name}.json"
        write_instance(build(SPECS[name]), path)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m placement.sources.instances", description=__doc__.split("\n")[0])
    parser.add_argument("outdir", nargs="?", default="instances")
    parser.add_argument("--only", nargs="*", choices=sorted(SPECS), help="build only these")
    args = parser.parse_args(argv)
    for path in build_all(args.outdir, args.only):
        print(f"wrote {path} and {path.with_suffix('.npz').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
