"""Predicted step time and delivered model TFLOP/s per GPU of a placement (pure, no I/O).

Training is measured in delivered model TFLOP/s per GPU, not in bytes.  This module turns the
evaluator's report of a placement (:class:`placement.cost.Metrics`: per MoE layer the all-to-all
time of its busiest NIC or NVLink port, and its busiest GPU's share of (token, expert) pairs) into
the time of one optimizer step, with the instance's optional ``performance`` block
(:class:`Performance`).  It never counts bytes itself: every all-to-all second comes from
``Metrics.alltoall_time_s_per_layer``.

The model, per optimizer step
-----------------------------
Model FLOPs are counted as Megatron-Core counts them for the TFLOP/s it reports
(``num_floating_point_operations`` in ``megatron/training/training.py`` of NVIDIA/Megatron-LM,
read at commit 001b00c; the function is in the training scripts, not in the ``megatron-core``
package): per token ``3 x 2 x`` (forward, weight gradient, data gradient; 2 FLOPs per
multiply-add) the GEMMs of

- attention: MLA ``q_lora*(h + n*(d_qk + d_rope) + 1) + kv_lora*(h + n*(d_qk + d_v) + 1)
  + h*d_rope + n*d_v*h + s*n*(d_qk + d_rope)/2 + s*n*d_v/2`` (the last two terms are the score and
  value products of the causal mask, half of the square), or GQA/MHA
  ``h*(q + 2*kv) + q*s + q*h`` with ``q = n*d``, ``kv = groups*d``;
- MLPs: ``h * ffn * f`` per dense layer, ``h * (moe_ffn * top_k + shared_ffn) * f`` per MoE layer,
  ``f = 3`` with SwiGLU (else 2);
- MTP layers: each is one more transformer layer (MoE when the last layer is) plus
  ``3h + 2h^2`` (its norms and projection);
- the output layer: ``h * vocab`` for the main head and each MTP head.

Reported TFLOP/s per GPU = model FLOPs of a global batch / step time / GPUs of the job; tokens/s
per GPU = tokens of a global batch / step time / GPUs.

Time of one micro-batch on one GPU, layer ``l`` (forward = 1/3 of the FLOPs, backward 2/3):

- compute ``c_l = (F_dense_l + F_routed_l * load_l) / (peak * gemm_efficiency) + layer_overhead_s``:
  ``F_dense`` is attention, dense MLP and shared expert, ``F_routed`` the routed experts at the mean
  load, ``load_l`` the busiest GPU's (token, expert) pairs over the EP group's mean in that layer
  (``Metrics.expert_load_max_over_mean_per_layer``; 1 with ``expert_load: balanced``): the layer
  waits for its busiest GPU.  The first stage adds nothing for the embedding (a lookup; Megatron
  counts no FLOPs for it); the last stage adds the output layer(s) and the MTP layers (priced with
  the last MoE layer's load and all-to-all time).
- all-to-all ``a_l = Metrics.alltoall_time_s_per_layer[l] / micro_batches``, split over the four
  transfers in proportion to their bytes per copy (``MoEModel.transfer_bytes_per_copy``): forward
  ``a_f`` (dispatch + combine), backward ``a_b`` (their gradients).
- overlap ``none``: ``sigma_l = c_l + a_l``.  Overlap ``1f1b`` (Megatron-Core's EP all-to-all
  overlap of a forward and a backward micro-batch in the 1F1B steady state, DualPipe's pairing):
  one micro-batch's forward all-to-all hides behind another's backward compute and vice versa, up to
  that compute's length: ``tau_l = c_l + max(0, a_f - c_b) + max(0, a_b - c_f)``.

Pipeline: 1F1B with ``vpp`` virtual stages per GPU and ``m`` micro-batches per step.  The steady
state runs at the slowest stage's pace and the warm-up/cool-down bubble has no partner micro-batch
to overlap with::

    T_pipeline = m * max_s tau_s + (pp - 1) / vpp * max_s sigma_s

with ``tau_s = sum of tau_l`` and ``sigma_s = sum of sigma_l`` over the stage's layers (``tau = sigma``
without overlap: the textbook ``(m + (pp - 1)/vpp) * t``).

Data-parallel gradients (Megatron's distributed optimizer): reduce-scatter of the gradients and
all-gather of the parameters, dense parameters over their ``dp * cp`` replicas and expert
parameters over their ``tp * cp * dp / ep`` replicas, each ``bytes * (n - 1) / n`` per GPU at the
bus bandwidth (NCCL's ring model), on the NICs when the group spans several NVLink domains, else on
NVLink.  They share those links with the all-to-all: the reduce-scatter hides in one micro-batch's
backward compute less its all-to-all, the all-gather in one forward's; what does not fit is exposed.
Step time = ``T_pipeline`` + the slowest stage's exposed data-parallel time.

Not modelled (absorbed by the fitted efficiency): recomputation, the optimizer step, stragglers,
kernel launch gaps other than ``layer_overhead_s``.

Calibration: ``gemm_efficiency``'s default is fitted on one published point and every other
published point is predicted; :mod:`placement.calibration` holds the points and the fit, the README
the table with every error.

Scoring candidates (for solvers): build :class:`StepTimeModel` once per instance (FLOP counts,
parameter counts: microseconds to milliseconds) and call :meth:`StepTimeModel.step_time_s` on each
candidate's :class:`~placement.cost.Metrics` and ``rank2gpu``: pure numpy over the MoE layers and
the DP groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Mapping, Sequence

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from placement.cost import Metrics
    from placement.model import Instance

__all__ = [
    "GPU_KINDS",
    "PRECISIONS",
    "OVERLAP_MODES",
    "EXPERT_LOAD_MODES",
    "SCHEDULES",
    "CALIBRATED_GEMM_EFFICIENCY",
    "GpuKind",
    "Architecture",
    "DEEPSEEK_V3",
    "QWEN3_235B_A22B",
    "Performance",
    "Prediction",
    "StepTimeModel",
    "model_flops_per_token",
    "layer_flops_per_token",
    "stage_slots",
    "predict",
    "prediction_keys",
]

Precision = Literal["bf16", "fp8", "mxfp8", "nvfp4"]
PRECISIONS: tuple[str, ...] = ("bf16", "fp8", "mxfp8", "nvfp4")
OVERLAP_MODES: tuple[str, ...] = ("none", "1f1b")
EXPERT_LOAD_MODES: tuple[str, ...] = ("routing", "balanced")
SCHEDULES: tuple[str, ...] = ("1f1b",)

# Fitted by placement.calibration.fit_gemm_efficiency() on the GB300 MXFP8 256-GPU point (see the
# README's calibration table); tests/test_performance.py re-fits it and checks this constant.
CALIBRATED_GEMM_EFFICIENCY = 0.3697


@dataclass(frozen=True)
class GpuKind:
    """A GPU's dense (no sparsity) peak tensor-core throughput per precision, TFLOP/s.

    Sources (docs/formats.md): NVIDIA's GB200 NVL72 and GB300 NVL72 specifications give rack
    figures with sparsity (FP8 720 PFLOPS, BF16 360 PFLOPS for 72 GPUs on both; FP4 1,440 PFLOPS on
    GB200, 1,080 PFLOPS dense on GB300); halved and divided by 72.
    """

    name: str
    peak_dense_tflops: Mapping[str, float]


GPU_KINDS: dict[str, GpuKind] = {
    "gb200": GpuKind("gb200", {"bf16": 2500.0, "fp8": 5000.0, "mxfp8": 5000.0, "nvfp4": 10000.0}),
    "gb300": GpuKind("gb300", {"bf16": 2500.0, "fp8": 5000.0, "mxfp8": 5000.0, "nvfp4": 15000.0}),
}


@dataclass(frozen=True)
class Architecture:
    """What the FLOP count needs beyond :class:`~placement.model.MoEModel` (Megatron's names).

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
    """The instance's optional ``performance`` block: how fast the job's GPUs compute.

    ``peak_tflops`` 0 = the table value of ``gpu`` and ``precision``; ``vpp`` virtual pipeline
    stages per GPU; ``expert_load`` ``routing`` (each GPU's share of the window's (token, expert)
    pairs) or ``balanced`` (forced-balanced benchmark runs, Megatron's
    ``--moe-router-force-load-balancing``: every GPU at the mean).
    """

    gpu: str
    precision: str
    architecture: Architecture
    gemm_efficiency: float = CALIBRATED_GEMM_EFFICIENCY
    layer_overhead_s: float = 0.0
    schedule: str = "1f1b"
    vpp: int = 1
    overlap: str = "1f1b"
    expert_load: str = "routing"
    grad_reduce_bytes_per_param: float = 4.0  # FP32 gradient reduce-scatter (Megatron's default)
    param_gather_bytes_per_param: float = 2.0  # BF16 parameter all-gather
    peak_tflops: float = 0.0

    @property
    def peak_flops_per_s(self) -> float:
        tflops = self.peak_tflops or GPU_KINDS[self.gpu].peak_dense_tflops[self.precision]
        return tflops * 1e12


# ---------------------------------------------------------------------------------------------
# FLOPs and parameters
# ---------------------------------------------------------------------------------------------
def _ffn_factor(arch: Architecture) -> int:
    return 3 if arch.swiglu else 2


def attention_flops_per_token(arch: Architecture, hidden_size: int, seq_len: int) -> float:
    """Forward + backward FLOPs of one attention layer per token, as Megatron counts them."""
    h, n, s = hidden_size, arch.num_attention_heads, seq_len
    if arch.attention == "mla":
        dq = arch.qk_head_dim + arch.qk_pos_emb_head_dim
        if arch.q_lora_rank == 0:
            q_term = h * n * dq
        else:
            q_term = arch.q_lora_rank * (h + n * dq + 1)
        terms = (
            q_term
            + arch.kv_lora_rank * (h + n * (arch.qk_head_dim + arch.v_head_dim) + 1)
            + h * arch.qk_pos_emb_head_dim
            + n * arch.v_head_dim * h
            + s * n * dq / 2
            + s * n * arch.v_head_dim / 2
        )
    else:
        q = arch.kv_channels * n
        kv = arch.kv_channels * arch.num_query_groups
        terms = h * (q + 2 * kv) + q * s / 2 * 2 + q * h
    return 3 * 2 * float(terms)


def layer_flops_per_token(
    arch: Architecture, hidden_size: int, seq_len: int, top_k: int, moe: bool
) -> tuple[float, float]:
    """``(dense, routed)`` forward + backward FLOPs per token of one transformer layer.

    ``dense`` = attention + dense MLP (or shared expert); ``routed`` = the ``top_k`` routed experts
    (0 for a dense layer).
    """
    f = _ffn_factor(arch)
    attn = attention_flops_per_token(arch, hidden_size, seq_len)
    if not moe:
        return attn + 3 * 2 * hidden_size * arch.ffn_hidden_size * f, 0.0
    shared = 3 * 2 * hidden_size * arch.shared_expert_ffn_hidden_size * f
    routed = 3 * 2 * hidden_size * arch.moe_ffn_hidden_size * top_k * f
    return attn + shared, float(routed)


def _head_flops_per_token(arch: Architecture, hidden_size: int) -> float:
    """Output layer(s) and the MTP layers' norms and projections (not their transformer layers)."""
    h = hidden_size
    return 3 * 2 * (arch.mtp_num_layers * (3 * h + 2 * h * h) + h * arch.vocab_size * (arch.mtp_num_layers + 1))


def model_flops_per_token(instance: Instance) -> float:
    """Megatron-Core's model FLOPs per token (forward + backward) of the instance's model."""
    perf = _require(instance)
    arch, m, par = perf.architecture, instance.model, instance.parallel
    moe = set(m.moe_layers)
    total = 0.0
    for layer in range(m.num_layers):
        d, r = layer_flops_per_token(arch, m.hidden_size, par.seq_len, m.top_k, layer in moe)
        total += d + r
    last_moe = (m.num_layers - 1) in moe
    d, r = layer_flops_per_token(arch, m.hidden_size, par.seq_len, m.top_k, last_moe)
    total += arch.mtp_num_layers * (d + r)
    return total + _head_flops_per_token(arch, m.hidden_size)


def _attention_params(arch: Architecture, h: int) -> float:
    n = arch.num_attention_heads
    if arch.attention == "mla":
        dq = arch.qk_head_dim + arch.qk_pos_emb_head_dim
        q = h * n * dq if arch.q_lora_rank == 0 else arch.q_lora_rank * (h + n * dq)
        kv = h * (arch.kv_lora_rank + arch.qk_pos_emb_head_dim) + arch.kv_lora_rank * n * (arch.qk_head_dim + arch.v_head_dim)
        return float(q + kv + n * arch.v_head_dim * h)
    d = arch.kv_channels
    return float(h * d * (n + 2 * arch.num_query_groups) + n * d * h)


def stage_slots(instance: Instance, perf: Performance | None = None) -> list[int]:
    """(pp,) layer slots of each stage, which ``vpp`` must divide.

    A stage's transformer layers, plus one slot for the embedding on the first stage and, on the
    last, the MTP layers and one slot for the output layer (the entries ``E``, ``m`` and ``L`` of
    Megatron's ``pipeline_model_parallel_layout``).
    """
    perf = perf or _require(instance)
    slots = [len(s) for s in instance.parallel.stage_layers]
    slots[0] += 1
    slots[-1] += perf.architecture.mtp_num_layers + 1
    return slots


def _require(instance: Instance) -> Performance:
    perf = getattr(instance, "performance", None)
    if perf is None:
        raise ValueError(f"instance {instance.name!r} has no performance block")
    return perf


# ---------------------------------------------------------------------------------------------
# The prediction
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prediction:
    """Predicted figures of one optimizer step (one routing window)."""

    step_time_s: float
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float
    exposed_alltoall_s_per_step: float  # all-to-all not hidden behind compute, slowest stage
    bubble_share: float  # pipeline warm-up/cool-down over the step time
    exposed_dp_s_per_step: float  # data-parallel reduce-scatter/all-gather not hidden
    compute_bound_step_time_s: float  # the same step without any communication
    stage_time_s_per_microbatch: list[float] = field(default_factory=list)  # (pp,) tau_s

    def to_dict(self, prefix: str = "") -> dict[str, float | list[float]]:
        return {
            f"{prefix}predicted_step_time_s": self.step_time_s,
            f"{prefix}predicted_tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            f"{prefix}predicted_tflops_per_gpu": self.tflops_per_gpu,
            f"{prefix}predicted_exposed_alltoall_s_per_step": self.exposed_alltoall_s_per_step,
            f"{prefix}predicted_bubble_share": self.bubble_share,
            f"{prefix}predicted_exposed_dp_s_per_step": self.exposed_dp_s_per_step,
        }


def prediction_keys(prefix: str = "") -> list[str]:
    """The report keys :meth:`Prediction.to_dict` writes (stable)."""
    return [
        f"{prefix}predicted_{k}"
        for k in (
            "step_time_s",
            "tokens_per_s_per_gpu",
            "tflops_per_gpu",
            "exposed_alltoall_s_per_step",
            "bubble_share",
            "exposed_dp_s_per_step",
        )
    ]


class StepTimeModel:
    """Everything about an instance that does not depend on the placement, computed once.

    Parameters
    ----------
    instance : an instance with a ``performance`` block.

    Notes
    -----
    :meth:`step_time_s` is the cheap score a solver can rank candidates by: it reads only the
    per-layer lists of a :class:`~placement.cost.Metrics` and, for the data-parallel groups, the
    candidate's ``rank2gpu``.
    """

    def __init__(self, instance: Instance):
        perf = _require(instance)
        self.instance = instance
        self.perf = perf
        m, par, cl = instance.model, instance.parallel, instance.cluster
        arch = perf.architecture
        self.micro_batches = par.micro_batches_per_step
        tokens_mb = par.micro_batch * par.seq_len / (par.tp * par.cp)  # tokens per GPU per micro-batch
        rate = perf.peak_flops_per_s * perf.gemm_efficiency
        moe_pos = {layer: i for i, layer in enumerate(m.moe_layers)}
        last_moe = (m.num_layers - 1) in moe_pos
        # Per stage: list of (dense_s, routed_mean_s, moe_index or -1) per layer, per micro-batch.
        dense_s: list[list[float]] = []
        routed_s: list[list[float]] = []
        moe_idx: list[list[int]] = []
        for s, layers in enumerate(par.stage_layers):
            ds, rs, mi = [], [], []
            for layer in layers:
                d, r = layer_flops_per_token(arch, m.hidden_size, par.seq_len, m.top_k, layer in moe_pos)
                ds.append(d * tokens_mb / rate)
                rs.append(r * tokens_mb / rate)
                mi.append(moe_pos.get(layer, -1))
            if s == par.pp - 1:
                d, r = layer_flops_per_token(arch, m.hidden_size, par.seq_len, m.top_k, last_moe)
                mtp_idx = (m.num_moe_layers - 1) if last_moe else -1
                for _ in range(arch.mtp_num_layers):
                    ds.append(d * tokens_mb / rate)
                    rs.append(r * tokens_mb / rate)
                    mi.append(mtp_idx)
                # Output layer(s) and MTP projections: compute without an all-to-all.
                ds.append(_head_flops_per_token(arch, m.hidden_size) * tokens_mb / rate)
                rs.append(0.0)
                mi.append(-2)
            dense_s.append(ds)
            routed_s.append(rs)
            moe_idx.append(mi)
        self._dense = [np.array(x) for x in dense_s]
        self._routed = [np.array(x) for x in routed_s]
        self._moe_idx = [np.array(x, dtype=np.int64) for x in moe_idx]
        self._overhead = [np.where(np.array(x) == -2, 0.0, perf.layer_overhead_s) for x in moe_idx]
        tb = m.transfer_bytes_per_copy
        self._fwd_share = (tb["forward_dispatch"] + tb["forward_combine"]) / m.roundtrip_bytes_per_copy
        # Data-parallel parameters per GPU of each stage: dense (over dp*cp) and expert (over edp).
        h = m.hidden_size
        f = _ffn_factor(arch)
        attn_p = _attention_params(arch, h)
        dense_p = np.zeros(par.pp)
        expert_p = np.zeros(par.pp)
        for s, layers in enumerate(par.stage_layers):
            for layer in layers:
                if layer in moe_pos:
                    dense_p[s] += attn_p + h * arch.shared_expert_ffn_hidden_size * f + h * m.num_experts
                    expert_p[s] += instance.experts_per_rank * h * arch.moe_ffn_hidden_size * f
                else:
                    dense_p[s] += attn_p + h * arch.ffn_hidden_size * f
        dense_p[0] += arch.vocab_size * h
        mtp_layer = attn_p + (h * arch.shared_expert_ffn_hidden_size * f + h * m.num_experts if last_moe else h * arch.ffn_hidden_size * f)
        dense_p[-1] += arch.vocab_size * h + arch.mtp_num_layers * (mtp_layer + 2 * h * h)
        if last_moe:
            expert_p[-1] += arch.mtp_num_layers * instance.experts_per_rank * h * arch.moe_ffn_hidden_size * f
        self.dense_params_per_gpu = dense_p / par.tp
        self.expert_params_per_gpu = expert_p
        self._bytes_per_param = perf.grad_reduce_bytes_per_param + perf.param_gather_bytes_per_param
        self._rs_share = perf.grad_reduce_bytes_per_param / self._bytes_per_param if self._bytes_per_param else 0.5
        self._nic_bps = cl.scaleout_gbps * 1e9
        self._nvl_bps = cl.nvlink_gbps * 1e9
        self.flops_per_token = model_flops_per_token(instance)
        self.tokens_per_step = par.global_batch * par.seq_len
        self.world = par.world_size
        # Data-parallel groups: (pp, groups, members) global ranks, dense then expert.
        coords = par.rank_coords
        self._dense_groups = self._dense_dp_groups(coords)
        self._expert_groups = self._expert_dp_groups()

    # -- data-parallel groups ----------------------------------------------------------------
    def _dense_dp_groups(self, coords: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Per stage, (tp, dp * cp) ranks: each row shares its tensor-parallel index."""
        par = self.instance.parallel
        out = []
        for s in range(par.pp):
            ranks = np.flatnonzero(coords["pp"] == s)
            key = coords["tp"][ranks]
            order = np.argsort(key, kind="stable")
            out.append(ranks[order].reshape(par.tp, -1))
        return out

    def _expert_dp_groups(self) -> list[np.ndarray]:
        """Per stage, (ep, edp) ranks holding the same EP rank in every EP group (expert-DP)."""
        groups = self.instance.parallel.stage_ep_groups  # (pp, G, ep)
        return [np.ascontiguousarray(groups[s].T) for s in range(groups.shape[0])]

    def _dp_time_s(self, rank2gpu: np.ndarray | None) -> np.ndarray:
        """(pp,) reduce-scatter + all-gather seconds per GPU of each stage, and the NIC flag."""
        par = self.instance.parallel
        g2d = self.instance.cluster.gpu2domain
        out = np.zeros(par.pp)
        for s in range(par.pp):
            t = 0.0
            for groups, params in ((self._dense_groups[s], self.dense_params_per_gpu[s]), (self._expert_groups[s], self.expert_params_per_gpu[s])):
                n = groups.shape[1]
                if n <= 1 or params == 0:
                    continue
                if rank2gpu is None:
                    spans = True
                else:
                    doms = g2d[np.asarray(rank2gpu)[groups]]
                    spans = bool(np.any(doms.min(axis=1) != doms.max(axis=1)))
                bw = self._nic_bps if spans else self._nvl_bps
                t += params * self._bytes_per_param * (n - 1) / n / bw
            out[s] = t
        return out

    # -- the score ---------------------------------------------------------------------------
    def predict(
        self,
        alltoall_time_s_per_layer: Sequence[float],
        expert_load_max_over_mean_per_layer: Sequence[float],
        rank2gpu: np.ndarray | None = None,
        *,
        communication: bool = True,
    ) -> Prediction:
        """The prediction from the evaluator's per-MoE-layer lists (see the module docstring).

        Parameters
        ----------
        alltoall_time_s_per_layer : (num_moe_layers,) ``Metrics.alltoall_time_s_per_layer``.
        expert_load_max_over_mean_per_layer : (num_moe_layers,) the same Metrics' load ratios.
        rank2gpu : (world,) the placement's rank -> GPU map, for the data-parallel groups' links;
            ``None`` prices every group on the NICs.
        communication : False gives the compute-bound step (no all-to-all, no DP traffic).
        """
        perf, m = self.perf, self.micro_batches
        a2a = np.asarray(alltoall_time_s_per_layer, dtype=np.float64) / m
        if perf.expert_load == "balanced":
            load = np.ones(len(a2a))
        else:
            load = np.asarray(expert_load_max_over_mean_per_layer, dtype=np.float64)
        pp = len(self._dense)
        tau = np.zeros(pp)
        sigma = np.zeros(pp)
        comp = np.zeros(pp)
        fwd_free = np.zeros(pp)
        bwd_free = np.zeros(pp)
        for s in range(pp):
            idx = self._moe_idx[s]
            is_moe = idx >= 0
            lo = np.where(is_moe, load[np.maximum(idx, 0)] if len(load) else 1.0, 1.0)
            c = self._dense[s] + self._routed[s] * lo + self._overhead[s]
            a = np.where(is_moe, a2a[np.maximum(idx, 0)] if len(a2a) else 0.0, 0.0) if communication else np.zeros_like(c)
            c_f, c_b = c / 3.0, 2.0 * c / 3.0
            a_f, a_b = a * self._fwd_share, a * (1.0 - self._fwd_share)
            if perf.overlap == "1f1b":
                t = c + np.maximum(0.0, a_f - c_b) + np.maximum(0.0, a_b - c_f)
            else:
                t = c + a
            tau[s] = t.sum()
            sigma[s] = (c + a).sum()
            comp[s] = c.sum()
            fwd_free[s] = max(0.0, float((c_f - a_f).sum()))
            bwd_free[s] = max(0.0, float((c_b - a_b).sum()))
        bubble_units = (pp - 1) / perf.vpp
        pipeline = m * tau.max() + bubble_units * sigma.max()
        if communication:
            dp = self._dp_time_s(rank2gpu)
            rs, ag = dp * self._rs_share, dp * (1.0 - self._rs_share)
            exposed_dp = np.maximum(0.0, rs - bwd_free) + np.maximum(0.0, ag - fwd_free)
        else:
            exposed_dp = np.zeros(pp)
        step = float(pipeline + exposed_dp.max())
        s_tau = int(np.argmax(tau))
        s_sigma = int(np.argmax(sigma))
        exposed_a2a = m * (tau[s_tau] - comp[s_tau]) + bubble_units * (sigma[s_sigma] - comp[s_sigma])
        compute_bound = float((m + bubble_units) * comp.max())
        return Prediction(
            step_time_s=step,
            tokens_per_s_per_gpu=self.tokens_per_step / step / self.world,
            tflops_per_gpu=self.flops_per_token * self.tokens_per_step / step / self.world / 1e12,
            exposed_alltoall_s_per_step=float(exposed_a2a),
            bubble_share=float(bubble_units * sigma.max() / step),
            exposed_dp_s_per_step=float(exposed_dp.max()),
            compute_bound_step_time_s=compute_bound,
            stage_time_s_per_microbatch=[float(x) for x in tau],
        )

    def predict_metrics(self, metrics: Metrics, rank2gpu: np.ndarray | None = None) -> Prediction:
        """:meth:`predict` on a :class:`~placement.cost.Metrics`."""
        return self.predict(metrics.alltoall_time_s_per_layer, metrics.expert_load_max_over_mean_per_layer, rank2gpu)

    def step_time_s(self, metrics: Metrics, rank2gpu: np.ndarray | None = None) -> float:
        """Predicted seconds of one optimizer step: the score to rank candidate placements by."""
        return self.predict_metrics(metrics, rank2gpu).step_time_s


def predict(instance: Instance, metrics: Metrics, rank2gpu: np.ndarray | None = None) -> Prediction:
    """One-off prediction (builds the :class:`StepTimeModel`; reuse that in loops)."""
    return StepTimeModel(instance).predict_metrics(metrics, rank2gpu)



# TEMPORARY (branch obj): a minimal stand-in for the perf branch's performance_settings, so that the
# band and the max-min-regret choice can run before it lands; the lead drops this at merge.
SETTINGS = ("low", "mid", "high")


def performance_settings(perf: Performance) -> dict[str, Performance]:
    """The three settings of the uncertain terms: ``low`` (no overlap, GEMMs 10% slower), ``mid``
    (``perf`` itself) and ``high`` (GEMMs 10% faster)."""
    from dataclasses import replace

    return {
        "low": replace(perf, gemm_efficiency=perf.gemm_efficiency * 0.9, overlap="none"),
        "mid": perf,
        "high": replace(perf, gemm_efficiency=perf.gemm_efficiency * 1.1),
    }
