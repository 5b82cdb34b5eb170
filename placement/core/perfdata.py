"""The data of the step-time model: GPU kinds, dispatchers, model shapes, the ``performance`` block.

Pure data classes and tables with no import from the rest of the package, so that the data model
(:mod:`placement.core.model`), the step-time model (:mod:`placement.predict.performance`) and the readers can
all hold them without an import circle.  :mod:`placement.predict.performance` re-exports every name.

GPU kinds (dense peaks, no sparsity; NVLink and NIC per GPU, one direction)
---------------------------------------------------------------------------
- H100 SXM: 989 TFLOP/s BF16, 1,979 FP8 (NVIDIA H100 datasheet, halved sparse figures), NVLink 4
  900 GB/s both directions (450 each way) in an 8-GPU HGX/DGX node, one ConnectX-7 400 Gb/s NIC
  per GPU (DGX H100 user guide): 50 GB/s.  132 SMs.
- H800: the H100's compute with NVLink cut to 400 GB/s both directions (200 each way) in 8-GPU
  nodes; DeepSeek-V3's cluster has one 400 Gb/s InfiniBand NIC per GPU (DeepSeek-V3 technical
  report, arXiv 2412.19437, section 3.1).
- B200 (HGX/DGX B200): 2,250 TFLOP/s BF16, 4,500 FP8/MXFP8, 9,000 FP4 dense (DGX B200 datasheet:
  72 PFLOPS FP8 training for 8 GPUs); NVLink 5 1.8 TB/s both directions (900 each way), 8-GPU
  domain; 8 ConnectX-7 400 Gb/s NICs (50 GB/s per GPU).  148 SMs.
- B300 (HGX/DGX B300): the same dense BF16/FP8 peaks as B200, FP4 13,500 dense; ConnectX-8
  800 Gb/s per GPU (100 GB/s); 8-GPU NVLink domain.  160 SMs (Blackwell Ultra).
- GB200 NVL72: rack 360 PFLOPS BF16 and 720 FP8 with sparsity, 1,440 FP4 -> per GPU dense 2,500
  BF16, 5,000 FP8, 10,000 FP4; 72-GPU NVLink domain at 1.8 TB/s per GPU both directions; compute
  trays carry ConnectX-7 400 Gb/s NICs (50 GB/s per GPU).  148 SMs.
- GB300 NVL72: GB200's BF16/FP8 peaks, 1,080 PFLOPS dense FP4 per rack (15,000 per GPU);
  ConnectX-8 SuperNICs 800 Gb/s (100 GB/s per GPU).  160 SMs.
- HBM bandwidth per GPU (``hbm_gbps``, the non-GEMM work of :mod:`placement.predict.compute`): H100 SXM
  and H800 3.35 TB/s (H100 datasheet), every Blackwell kind 8 TB/s (DGX B200 datasheet: 64 TB/s
  for 8 GPUs; GB200 NVL72: 576 TB/s for 72; B300 and GB300 the same per GPU).

Dispatchers (achieved all-to-all bandwidth as a fraction of the link's one-way spec)
------------------------------------------------------------------------------------
- ``deepep`` (DeepEP normal kernels, Megatron's ``flex`` dispatcher): NVLink at EP32 on NVL72
  400 GB/s dispatch and 190 GB/s combine with 24 SMs (NVIDIA's "Optimizing DeepSeek-V3 Training
  Performance on NVIDIA GB200 NVL72", NVIDIA/Megatron-LM docs/discussions, commit eb0783b, section
  2.2.1): 0.444 and 0.211 of 900 GB/s; over RDMA 43-58 GB/s of a 50 GB/s NIC (DeepEP's README,
  H800 + CX7 400 Gb/s): 0.9 (43/50 to 1.0 in the low/high settings).
- ``hybridep`` (HybridEP, ``--moe-flex-dispatcher-backend hybridep``): NVLink 479-632 GB/s dispatch
  and 448-597 GB/s combine at EP36 on NVL72 (the same write-up, section 2.5, and the Megatron-Core
  MoE report, arXiv 2603.07685): the middle 0.617 / 0.580 of 900 GB/s, the ends for the low/high
  settings; its RDMA path priced as DeepEP's.  Fewer SMs: 16.
- ``alltoall`` (NCCL all-to-all): no published all-to-all figure on these links in the sources
  above; priced as DeepEP (an assumption the ladder does not test: no ladder row uses it with
  cross-domain EP).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, Mapping

__all__ = [
    "GPU_KINDS",
    "PRECISIONS",
    "OVERLAP_MODES",
    "EXPERT_LOAD_MODES",
    "SCHEDULES",
    "DISPATCHERS",
    "CALIBRATED_GEMM_EFFICIENCY",
    "EXPERT_GEMM_EFFICIENCY",
    "GEMM_HALF_SHAPE",
    "FP8_GEMM_RATIO",
    "ELEMENTWISE_BYTES",
    "ATTENTION_EFFICIENCY",
    "LAYER_OVERHEAD_S",
    "GpuKind",
    "Dispatcher",
    "Architecture",
    "DEEPSEEK_V3",
    "QWEN3_235B_A22B",
    "Performance",
]

Precision = Literal["bf16", "fp8", "mxfp8", "nvfp4"]
PRECISIONS: tuple[str, ...] = ("bf16", "fp8", "mxfp8", "nvfp4")
OVERLAP_MODES: tuple[str, ...] = ("none", "1f1b")
EXPERT_LOAD_MODES: tuple[str, ...] = ("routing", "balanced")
SCHEDULES: tuple[str, ...] = ("1f1b",)

# Fitted by ``placement calibrate`` on every row of the ladder (placement/data/ladder.json, the
# default ``--fit``): per GPU kind a GEMM ceiling (GpuKind.gemm_efficiency: a large BF16 GEMM's
# fraction of the BF16 peak, 4 digits; this default is GB300's) and, where identified, the FP8
# ratio, and three shared values of the compute model (:mod:`placement.predict.compute`).  tests/test_calibration.py re-fits and checks them.
CALIBRATED_GEMM_EFFICIENCY = 0.9466
# Elements: a GEMM dimension of this size halves the rate.  The fit sits at its lower bound, one
# 128-wide tensor-core tile: the ladder's shapes are all large enough that the non-GEMM HBM work
# (ELEMENTWISE_BYTES) explains the small models' lower rate better than GEMM size does.
GEMM_HALF_SHAPE = 128.0
# An FP8 GEMM's share of the FP8 peak over a BF16 GEMM's of the BF16 peak: fitted per GPU kind that
# has both BF16 and FP8 rows (GpuKind.fp8_gemm_ratio); this pooled median serves the others.
FP8_GEMM_RATIO = 0.6165
# HBM bytes per element of the tensors a layer's non-GEMM work touches (placement.predict.compute: layer
# input and output, MLP intermediates), forward + backward.
ELEMENTWISE_BYTES = 28.5082
# Host launch gaps per layer and micro-batch (forward + backward), not paid by recipes that capture
# the whole iteration in one CUDA graph.
LAYER_OVERHEAD_S = 0.002568
# The attention kernel's score and value products (Transformer Engine's fused attention, cuDNN) as a
# share of the BF16 dense peak: stated, not fitted.  FlashAttention-4 (Together AI, "FlashAttention-4",
# together.ai/blog/flashattention-4) reaches 1,605 TFLOP/s BF16 on B200, "up to 1.3x faster than
# cuDNN 9.13": cuDNN at about 1,605 / 1.3 = 1,235 TFLOP/s, 0.55 of B200's 2,250 BF16 dense peak.
# The attention kernel is limited by the softmax exponentials and shared-memory traffic, not by
# the tensor cores, so it does not run at the GEMM ceiling.
ATTENTION_EFFICIENCY = 0.55
# Routed experts' grouped GEMMs over dense GEMMs of the same shape (1: the shape model prices them;
# NVIDIA's MXFP8 grouped GEMM on GB200, 2,672 of 5,000 TFLOP/s at K=7168, N=2048, sits within the
# shape model's band).
EXPERT_GEMM_EFFICIENCY = 1.0


@dataclass(frozen=True)
class GpuKind:
    """One GPU kind: dense (no sparsity) peaks per precision and its links (module docstring).

    ``nvlink_gbps`` and ``nic_gbps`` are per GPU and direction, 10^9 bytes/s; ``gemm_efficiency``
    is the GEMM ceiling fitted on the ladder for this kind: a large BF16 GEMM's fraction of the BF16
    peak (0 = the shared default); ``hbm_gbps`` the HBM bandwidth, 10^9 bytes/s.
    """

    name: str
    peak_dense_tflops: Mapping[str, float]
    nvlink_domain_gpus: int
    nvlink_gbps: float
    nic_gbps: float
    sm_count: int
    gemm_efficiency: float = 0.0
    hbm_gbps: float = 8000.0
    fp8_gemm_ratio: float = 0.0  # fitted where the ladder has both BF16 and FP8 rows (0 = pooled)


_BLACKWELL = {"bf16": 2500.0, "fp8": 5000.0, "mxfp8": 5000.0}
_HGX_BLACKWELL = {"bf16": 2250.0, "fp8": 4500.0, "mxfp8": 4500.0}
_HOPPER = {"bf16": 989.0, "fp8": 1979.0, "mxfp8": 1979.0, "nvfp4": 1979.0}
GPU_KINDS: dict[str, GpuKind] = {
    "h100": GpuKind("h100", _HOPPER, 8, 450.0, 50.0, 132, 0.5313, 3350.0),
    "h800": GpuKind("h800", _HOPPER, 8, 200.0, 50.0, 132, 0.5313, 3350.0),  # H100's ceiling: the same chip
    "b200": GpuKind("b200", {**_HGX_BLACKWELL, "nvfp4": 9000.0}, 8, 900.0, 50.0, 148, 0.6592),
    "b300": GpuKind("b300", {**_HGX_BLACKWELL, "nvfp4": 13500.0}, 8, 900.0, 100.0, 160, 0.7310),
    "gb200": GpuKind("gb200", {**_BLACKWELL, "nvfp4": 10000.0}, 72, 900.0, 50.0, 148, 0.6455, fp8_gemm_ratio=0.6322),
    "gb300": GpuKind("gb300", {**_BLACKWELL, "nvfp4": 15000.0}, 72, 900.0, 100.0, 160, 0.9466, fp8_gemm_ratio=0.6008),
}


@dataclass(frozen=True)
class Dispatcher:
    """Achieved all-to-all bandwidth of a dispatcher, as fractions of the one-way link spec.

    ``*_range`` are the (low, high) ends of the published measurements (module docstring); the
    middle value is the default.  ``comm_sms``: streaming multiprocessors its kernels occupy.
    """

    name: str
    nvlink_dispatch: float
    nvlink_combine: float
    nic: float
    comm_sms: int
    nvlink_dispatch_range: tuple[float, float]
    nvlink_combine_range: tuple[float, float]
    nic_range: tuple[float, float]


_DEEPEP = Dispatcher("deepep", 400 / 900, 190 / 900, 0.9, 24, (340 / 900, 460 / 900), (160 / 900, 220 / 900), (0.86, 1.0))
DISPATCHERS: dict[str, Dispatcher] = {
    "deepep": _DEEPEP,
    "hybridep": Dispatcher(
        "hybridep", 555.5 / 900, 522.5 / 900, 0.9, 16, (479 / 900, 632 / 900), (448 / 900, 597 / 900), (0.86, 1.0)
    ),
    "alltoall": dataclasses.replace(_DEEPEP, name="alltoall"),
}


@dataclass(frozen=True)
class Architecture:
    """What the FLOP count needs beyond :class:`~placement.core.model.MoEModel` (Megatron's names).

    ``attention`` is ``mla`` (``q_lora_rank`` 0 = no query LoRA, ``kv_lora_rank``, ``qk_head_dim``
    = the no-RoPE part, ``qk_pos_emb_head_dim`` = the RoPE part, ``v_head_dim``) or ``gqa``
    (``num_query_groups``, ``kv_channels``; MHA is ``num_query_groups = num_attention_heads``).
    """

    attention: Literal["mla", "gqa"]
    num_attention_heads: int
    ffn_hidden_size: int  # dense layers' MLP
    moe_ffn_hidden_size: int  # one routed expert
    shared_expert_ffn_hidden_size: int  # 0 = no shared expert
    vocab_size: int  # padded vocabulary
    mtp_num_layers: int = 0
    swiglu: bool = True
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_head_dim: int = 0
    qk_pos_emb_head_dim: int = 0
    v_head_dim: int = 0
    num_query_groups: int = 0
    kv_channels: int = 0


# Shapes of the committed instances' models (their Hugging Face config.json files:
# deepseek-ai/DeepSeek-V3 and Qwen/Qwen3-235B-A22B; vocabularies are already multiples of 128).
DEEPSEEK_V3 = Architecture(
    attention="mla",
    num_attention_heads=128,
    ffn_hidden_size=18432,
    moe_ffn_hidden_size=2048,
    shared_expert_ffn_hidden_size=2048,
    vocab_size=129280,
    mtp_num_layers=1,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_head_dim=128,
    qk_pos_emb_head_dim=64,
    v_head_dim=128,
)
QWEN3_235B_A22B = Architecture(
    attention="gqa",
    num_attention_heads=64,
    ffn_hidden_size=12288,
    moe_ffn_hidden_size=1536,
    shared_expert_ffn_hidden_size=0,
    vocab_size=151936,
    num_query_groups=4,
    kv_channels=128,
)


@dataclass(frozen=True)
class Performance:
    """The instance's optional ``performance`` block: how fast the job's GPUs compute and talk.

    ``peak_tflops`` 0 = the table value of ``gpu`` and ``precision``; ``gemm_efficiency`` 0 = the
    GPU kind's fitted value; ``vpp`` virtual pipeline stages per GPU; ``expert_load`` ``routing``
    (each GPU's share of the window's (token, expert) pairs) or ``balanced`` (forced-balanced
    benchmark runs, Megatron's ``--moe-router-force-load-balancing``: every GPU at the mean, up to
    the sampling spread of one micro-batch).

    Communication: ``dispatcher`` (``deepep``, ``hybridep``, ``alltoall``) sets the defaults of
    the achieved bandwidth fractions ``nvlink_dispatch_efficiency``, ``nvlink_combine_efficiency``,
    ``nic_efficiency`` and of ``comm_sms`` (each 0 = the dispatcher's value, resolved at
    construction).  ``overlap_efficiency``: the share of an overlapped transfer that really hides
    (1 = all of it up to its compute partner).  ``capacity_factor``: per-rank token capacity over
    the mean (0 = dropless); tokens over it are dropped (not computed).

    Compute (:mod:`placement.predict.compute`): ``gemm_efficiency`` is the GEMM ceiling (a large BF16
    GEMM's fraction of the BF16 peak), ``fp8_gemm_ratio`` an FP8/MXFP8/NVFP4 GEMM's share of its
    own peak relative to that (0 = the GPU kind's fitted value, else the pooled one),
    ``gemm_half_shape`` the GEMM dimension (elements) that halves the rate, ``elementwise_bytes``
    the HBM bytes of the non-GEMM work per token copy and hidden element per layer,
    ``layer_overhead_s`` host launch gaps per layer, ``expert_gemm_efficiency`` the routed
    experts' grouped GEMMs over dense GEMMs of the same shape (1 by default).
    """

    gpu: str
    precision: str
    architecture: Architecture
    gemm_efficiency: float = 0.0
    layer_overhead_s: float = 0.0  # current recipes capture the iteration in CUDA graphs; else LAYER_OVERHEAD_S
    schedule: str = "1f1b"
    vpp: int = 1
    overlap: str = "1f1b"
    expert_load: str = "routing"
    grad_reduce_bytes_per_param: float = 4.0  # FP32 gradient reduce-scatter (Megatron's default)
    param_gather_bytes_per_param: float = 2.0  # BF16 parameter all-gather
    peak_tflops: float = 0.0
    dispatcher: str = "hybridep"
    nvlink_dispatch_efficiency: float = 0.0
    nvlink_combine_efficiency: float = 0.0
    nic_efficiency: float = 0.0
    comm_sms: int = 0
    overlap_efficiency: float = 1.0
    expert_gemm_efficiency: float = EXPERT_GEMM_EFFICIENCY
    capacity_factor: float = 0.0
    gemm_half_shape: float = GEMM_HALF_SHAPE
    fp8_gemm_ratio: float = 0.0
    elementwise_bytes: float = ELEMENTWISE_BYTES

    def __post_init__(self) -> None:
        d = DISPATCHERS.get(self.dispatcher, _DEEPEP)
        defaults = {
            "nvlink_dispatch_efficiency": d.nvlink_dispatch,
            "nvlink_combine_efficiency": d.nvlink_combine,
            "nic_efficiency": d.nic,
            "comm_sms": d.comm_sms,
        }
        kind = GPU_KINDS.get(self.gpu)
        if not self.gemm_efficiency:
            defaults["gemm_efficiency"] = (kind.gemm_efficiency if kind else 0.0) or CALIBRATED_GEMM_EFFICIENCY
        if not self.fp8_gemm_ratio:
            defaults["fp8_gemm_ratio"] = (kind.fp8_gemm_ratio if kind else 0.0) or FP8_GEMM_RATIO
        for name, value in defaults.items():
            if not getattr(self, name):
                object.__setattr__(self, name, value)

    @property
    def peak_flops_per_s(self) -> float:
        tflops = self.peak_tflops or GPU_KINDS[self.gpu].peak_dense_tflops[self.precision]
        return tflops * 1e12

    @property
    def bf16_peak_flops_per_s(self) -> float:
        """The BF16 peak: attention's score and value products run in BF16 in FP8 recipes."""
        if self.peak_tflops:
            return self.peak_flops_per_s * (0.5 if self.precision in ("fp8", "mxfp8") else 1.0)
        return GPU_KINDS[self.gpu].peak_dense_tflops["bf16"] * 1e12

    @property
    def comm_sm_share(self) -> float:
        """Share of the GPU's SMs the communication kernels take while they run."""
        kind = GPU_KINDS.get(self.gpu)
        return min(1.0, self.comm_sms / kind.sm_count) if kind else 0.0
