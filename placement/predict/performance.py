"""Predicted step time and delivered model TFLOP/s per GPU of a placement (pure, no I/O).

Training is measured in delivered model TFLOP/s per GPU, not in bytes.  This module turns the
evaluator's report of a placement (:class:`placement.predict.cost.Metrics`: per MoE layer the busiest GPU's
NIC and NVLink bytes, and its busiest GPU's share of (token, expert) pairs) into the time of one
optimizer step, with the instance's optional ``performance`` block (:class:`Performance`, data in
:mod:`placement.core.perfdata`, re-exported here).  It never counts bytes itself.  docs/performance.md
has the long version with every source.

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

- compute ``c_l = attn_l + mlp_l`` (:mod:`placement.predict.compute`: every GEMM at ``ceiling x peak x
  s(M) s(N) s(K)``, the attention's score/value products at ``ATTENTION_EFFICIENCY`` of the BF16
  peak, non-GEMM work at the HBM bandwidth): ``attn_l`` = attention, dense MLP or shared expert,
  plus ``layer_overhead_s``; ``mlp_l`` = the routed experts at the mean load (``E / ep`` grouped GEMMs of ``M = tokens x ep x
  top_k / E`` rows), times the busiest GPU's load of one micro-batch
  (:func:`per_microbatch_load` of ``Metrics.expert_load_lasting_max_over_mean_per_layer``, the
  window's load with its sampling noise removed by :mod:`placement.predict.imbalance`, or of the raw
  ``expert_load_max_over_mean_per_layer`` in Metrics without it; 1 with ``expert_load:
  balanced``), capped at ``capacity_factor`` when one is set (tokens over it are
  dropped).  The last stage adds the output layer(s) and the MTP layers (MTP MoE layer ``j`` priced
  with MoE layer ``num_layers + j``'s metrics when the instance has it, else the last MoE layer's).
- all-to-all: each transfer ``t`` (forward dispatch, forward combine, backward combine, backward
  dispatch) takes the slower of the busiest NIC (half the evaluator's send + receive count: a
  full-duplex link) and the busiest NVLink port at the dispatcher's achieved bandwidth
  (:meth:`StepTimeModel.transfer_times_s`).
- overlap ``none``: ``sigma_l = c_l + sum_t a_t``.  Overlap ``1f1b`` (Megatron-Core's combined
  1F1B, ``overlap_moe_expert_parallel_comm``): each transfer hides behind one compute node of the
  other micro-batch (backward combine | forward attention, forward dispatch | backward expert
  GEMMs, backward dispatch | forward expert GEMMs, forward combine | backward attention), each pair
  costing ``(1 - eta) a + max(eta a, c + f eta a)`` (``eta`` = ``overlap_efficiency``, ``f`` = the
  SM share the kernels take): ``tau_l`` is the sum of the four pairs.

Pipeline: 1F1B with ``vpp`` virtual stages per GPU and ``m`` micro-batches per step; ``m - 1``
paired slots, the first forward and the last backward unpaired, and the warm-up/cool-down bubble::

    T_pipeline = (m - 1) * max_s tau_s + (1 + (pp - 1) / vpp) * max_s sigma_s

(``tau = sigma`` without overlap: the textbook ``(m + (pp - 1)/vpp) * t``).

Data-parallel collectives (Megatron's distributed optimizer): reduce-scatter of the gradients and
all-gather of the parameters, dense over ``dp * cp`` replicas, experts over ``tp * cp * dp / ep``:
NCCL's ring on NVLink inside one domain; across ``k`` domains with ``g`` members each at least,
hierarchical, every member on its own NIC (``S (g-1)/g / nvlink + S (k-1)/(k g) / nic``).  The
reduce-scatter hides in one micro-batch's backward compute less its all-to-all, the all-gather in
one forward's; what does not fit is exposed.  Step time = ``T_pipeline`` + the slowest stage's
exposed data-parallel time.  With redundant expert slots (``Metrics.num_redundant_experts``,
:mod:`placement.predict.replica_cost`) the expert collectives move ``(E + N) / E`` of the parameters and the
replicas' gradient sum (``Metrics.replica_grad_time_s_per_stage``) is added exposed.

Not modelled (absorbed by the fitted efficiency): recomputation, the optimizer step, stragglers,
host (CPU) overhead, kernel launch gaps other than ``layer_overhead_s``.

Calibration: the GEMM ceiling (and FP8 ratio) is fitted per GPU kind on the published ladder
(:mod:`placement.predict.calibration`, ``placement calibrate``); docs/performance.md has the table with every error.
:func:`performance_settings` gives the ``low``/``mid``/``high`` variants of the uncertain terms.

Scoring candidates (for solvers): build :class:`StepTimeModel` once per instance (FLOP counts,
parameter counts: microseconds to milliseconds) and call :meth:`StepTimeModel.step_time_s` on each
candidate's :class:`~placement.predict.cost.Metrics` and ``rank2gpu``: pure numpy over the MoE layers and
the DP groups.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np

from placement.predict.flops import (  # noqa: F401  (re-exported)
    _attention_params,
    _ffn_factor,
    _loss_flops_per_token,
    _mtp_projection_flops_per_token,
    _require,
    attention_core_flops_per_token,
    attention_flops_per_token,
    layer_flops_per_token,
    model_flops_per_token,
    stage_slots,
)
from placement.predict.compute import ComputeRates, Gemm, attention_gemms, expert_gemms, mlp_gemms, mlp_width
from placement.core.pipeline_layout import legacy_chunks, p2p_bytes_per_boundary, stage_items
from placement.core.perfdata import (
    CALIBRATED_GEMM_EFFICIENCY,
    DEEPSEEK_V3,
    DISPATCHERS,
    EXPERT_GEMM_EFFICIENCY,
    EXPERT_LOAD_MODES,
    GPU_KINDS,
    OVERLAP_MODES,
    PRECISIONS,
    QWEN3_235B_A22B,
    SCHEDULES,
    Architecture,
    Dispatcher,
    GpuKind,
    Performance,
)

if TYPE_CHECKING:  # pragma: no cover
    from placement.predict.cost import Metrics
    from placement.core.model import Instance

__all__ = [
    "GPU_KINDS",
    "PRECISIONS",
    "OVERLAP_MODES",
    "EXPERT_LOAD_MODES",
    "SCHEDULES",
    "DISPATCHERS",
    "CALIBRATED_GEMM_EFFICIENCY",
    "EXPERT_GEMM_EFFICIENCY",
    "SETTINGS",
    "GpuKind",
    "Dispatcher",
    "Architecture",
    "DEEPSEEK_V3",
    "QWEN3_235B_A22B",
    "Performance",
    "Prediction",
    "StepTimeModel",
    "model_flops_per_token",
    "layer_flops_per_token",
    "stage_slots",
    "stage_items",
    "p2p_bytes_per_boundary",
    "predict",
    "prediction_keys",
    "performance_settings",
    "per_microbatch_load",
]

#: The uncertainty settings of the step-time model, slowest first (:func:`performance_settings`).
SETTINGS: tuple[str, ...] = ("low", "mid", "high")
# Relative spread of the GEMM efficiencies between the settings (from the ladder's residuals on the
# rows not fitted; docs/performance.md).
GEMM_SPREAD = 0.05
# Low setting of the overlap efficiency, as a share of the configured one.
OVERLAP_LOW_SHARE = 0.5


def performance_settings(perf: Performance) -> dict[str, Performance]:
    """The ``low``, ``mid`` and ``high`` variants of ``perf`` (keys in :data:`SETTINGS` order).

    ``mid`` is ``perf`` itself (the calibrated values).  ``low`` is pessimistic on every uncertain
    term: achieved NVLink and NIC bandwidth at the low end of the dispatcher's published range (as a
    ratio to its default, so user overrides scale the same way), the overlap efficiency halved, both
    GEMM efficiencies ``GEMM_SPREAD`` lower; ``high`` the other end, full overlap, GEMMs
    ``GEMM_SPREAD`` higher (capped at 1).  ``low`` never predicts a faster step than ``mid``, nor
    ``mid`` than ``high``, on the same placement.
    """
    d = DISPATCHERS.get(perf.dispatcher, DISPATCHERS["deepep"])

    def variant(end: int) -> Performance:
        sign = -1.0 if end == 0 else 1.0
        return dataclasses.replace(
            perf,
            nvlink_dispatch_efficiency=min(1.0, perf.nvlink_dispatch_efficiency * d.nvlink_dispatch_range[end] / d.nvlink_dispatch),
            nvlink_combine_efficiency=min(1.0, perf.nvlink_combine_efficiency * d.nvlink_combine_range[end] / d.nvlink_combine),
            nic_efficiency=min(1.0, perf.nic_efficiency * d.nic_range[end] / d.nic),
            overlap_efficiency=perf.overlap_efficiency * OVERLAP_LOW_SHARE if end == 0 else 1.0,
            gemm_efficiency=min(1.0, perf.gemm_efficiency * (1.0 + sign * GEMM_SPREAD)),
            expert_gemm_efficiency=min(1.0, perf.expert_gemm_efficiency * (1.0 + sign * GEMM_SPREAD)),
        )

    return {"low": variant(0), "mid": perf, "high": variant(1)}


def per_microbatch_load(load_over_window: np.ndarray, pairs_per_gpu: float, ep: int) -> np.ndarray:
    """Busiest GPU's load over the mean within one micro-batch, from the window's ratio.

    ``load_over_window`` should be the lasting ratio (``Metrics.expert_load_lasting_max_over_mean_per_layer``,
    :mod:`placement.predict.imbalance`): the raw sampled one already holds the sample's own noise, which this
    function would add a second time.  The evaluator gives each layer's busiest-GPU share over the
    whole window (a step's tokens).  One
    micro-batch holds ``pairs_per_gpu`` (token, expert) pairs per GPU on average, so even at the
    window's shares each GPU's count spreads around its expectation (Poisson: standard deviation
    ``sqrt(load / pairs_per_gpu)`` in units of the mean), and the busiest of ``ep`` GPUs sits about
    ``sqrt(2 ln ep)`` deviations above: ``load + sqrt(2 ln ep) * sqrt(load / pairs_per_gpu)``.  An
    estimate, not a bound: real micro-batches are a few documents, whose routing is correlated,
    which spreads them more (docs/performance.md).
    """
    load = np.asarray(load_over_window, dtype=np.float64)
    if ep <= 1 or pairs_per_gpu <= 0:
        return load
    return load + np.sqrt(2.0 * np.log(ep)) * np.sqrt(load / pairs_per_gpu)


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
    p2p_s_per_microbatch: list[float] = field(default_factory=list)  # (pp,) pipeline sends per stage

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
    performance : price with this block instead of the instance's (e.g. one of
        :func:`performance_settings`).

    Notes
    -----
    :meth:`step_time_s` is the cheap score a solver can rank candidates by: it reads only the
    per-layer lists of a :class:`~placement.predict.cost.Metrics` and, for the data-parallel groups, the
    candidate's ``rank2gpu``.
    """

    def __init__(self, instance: Instance, performance: Performance | None = None):
        perf = performance or _require(instance)
        self.instance = instance
        self.perf = perf
        m, par, cl = instance.model, instance.parallel, instance.cluster
        arch = perf.architecture
        self.micro_batches = par.micro_batches_per_step
        tokens_mb = par.micro_batch * par.seq_len / (par.tp * par.cp)  # tokens per GPU per micro-batch
        moe_pos = {layer: i for i, layer in enumerate(m.moe_layers)}
        last_moe = (m.num_layers - 1) in moe_pos
        self._tokens_mb = tokens_mb
        self._build_compute(perf)
        self._pairs_per_gpu = tokens_mb * m.top_k
        self._ep = par.ep
        # The four transfers' bytes per copy and their achieved bandwidths (bytes/s) per link.
        tb = m.transfer_bytes_per_copy
        self._nic_copy = float(m.nic_bytes_per_copy)
        order = ("forward_dispatch", "forward_combine", "backward_combine", "backward_dispatch")
        self._transfer_bytes = np.array([tb[k] for k in order], dtype=np.float64)
        nvl = cl.nvlink_gbps * 1e9
        nic = cl.scaleout_gbps * 1e9
        # Dispatch-like transfers (source -> expert): forward dispatch, backward combine.
        self._nvl_bps = nvl * np.array(
            [perf.nvlink_dispatch_efficiency, perf.nvlink_combine_efficiency, perf.nvlink_dispatch_efficiency, perf.nvlink_combine_efficiency]
        )
        self._nic_bps = nic * perf.nic_efficiency
        # Spec-priced all-to-all seconds (Metrics.alltoall_time_s_per_layer) -> achieved seconds when
        # the per-link bytes are not given: the slower of the two links' efficiencies.
        self._spec_share = self._transfer_bytes / self._transfer_bytes.sum()
        self._spec_slowdown = 1.0 / np.minimum(self._nvl_bps / nvl, perf.nic_efficiency)
        self._sm_share = perf.comm_sm_share
        # Data-parallel parameters per GPU of each stage: dense (over dp*cp) and expert (over edp).
        h = m.hidden_size
        f = _ffn_factor(arch)
        attn_p = _attention_params(arch, h)
        dense_p = np.zeros(par.pp)
        expert_p = np.zeros(par.pp)
        for s, layers in enumerate(par.stage_layers):
            for layer in layers:
                if layer >= m.num_layers:
                    continue
                if layer in moe_pos:
                    dense_p[s] += attn_p + h * arch.shared_expert_ffn_hidden_size * f + h * m.num_experts
                    expert_p[s] += instance.experts_per_rank * h * arch.moe_ffn_hidden_size * f
                else:
                    dense_p[s] += attn_p + h * arch.ffn_hidden_size * f
        e_stage, m_stage, l_stage = par.item_stage("E"), par.item_stage("m"), par.item_stage("L")
        dense_p[e_stage] += arch.vocab_size * h
        mtp_layer = attn_p + (h * arch.shared_expert_ffn_hidden_size * f + h * m.num_experts if last_moe else h * arch.ffn_hidden_size * f)
        dense_p[l_stage] += arch.vocab_size * h
        if arch.mtp_num_layers:
            dense_p[m_stage] += arch.mtp_num_layers * (mtp_layer + 2 * h * h)
            if m_stage != e_stage:  # Megatron-Core builds an embedding on an MTP stage (gpt_model.py)
                dense_p[m_stage] += arch.vocab_size * h
        if last_moe:
            expert_p[m_stage] += arch.mtp_num_layers * instance.experts_per_rank * h * arch.moe_ffn_hidden_size * f
        self.dense_params_per_gpu = dense_p / par.tp
        self.expert_params_per_gpu = expert_p
        self._bytes_per_param = perf.grad_reduce_bytes_per_param + perf.param_gather_bytes_per_param
        self._rs_share = perf.grad_reduce_bytes_per_param / self._bytes_per_param if self._bytes_per_param else 0.5
        self._dp_nic_bps = nic
        self._dp_nvl_bps = nvl
        self.flops_per_token = model_flops_per_token(instance)
        self.tokens_per_step = par.global_batch * par.seq_len
        self.world = par.world_size
        # Pipeline point-to-point: each boundary between consecutive (virtual) stages, as (sender
        # stage, receiver stage, bytes per rank per direction); the chunk after the MTP layers sends
        # the main and the MTP hidden states together (Megatron-Core's mtp_standalone).
        chunks = par.pipeline_layout or legacy_chunks(par.stage_layers, m.num_layers, arch.mtp_num_layers)
        per_boundary = p2p_bytes_per_boundary(instance)
        self._boundaries: list[tuple[int, int, float]] = []
        seen_mtp = False
        for i in range(len(chunks) - 1):
            seen_mtp = seen_mtp or "m" in chunks[i]
            a, b = i % par.pp, (i + 1) % par.pp
            if a != b:
                self._boundaries.append((a, b, per_boundary * (1 + arch.mtp_num_layers if seen_mtp else 1)))
        # (pp, ranks_per_stage) global ranks, aligned: column k holds the same (tp, cp, dp) rank.
        key = par.rank_coords
        flat = key["tp"] + par.tp * (key["cp"] + par.cp * key["dp"])
        self._stage_ranks = np.stack([np.flatnonzero(key["pp"] == st)[np.argsort(flat[key["pp"] == st], kind="stable")]
                                      for st in range(par.pp)])
        self._p2p_nic_bps = nic * perf.nic_efficiency
        self._p2p_nvl_bps = nvl
        # Data-parallel groups: (pp, groups, members) global ranks, dense then expert.
        coords = par.rank_coords
        self._dense_groups = np.stack(self._dense_dp_groups(coords))
        self._expert_groups = np.stack(self._expert_dp_groups())

    # -- compute ------------------------------------------------------------------------------
    def _build_compute(self, perf: Performance) -> None:
        """Per stage and layer: dense seconds, routed seconds at the mean load, MoE index.

        Every GEMM priced at its shape (:mod:`placement.predict.compute`); FLOPs are Megatron's count.
        """
        instance = self.instance
        m, par = instance.model, instance.parallel
        arch = perf.architecture
        rates = ComputeRates(perf)
        tokens_mb = self._tokens_mb
        h, tp = m.hidden_size, par.tp
        moe_pos = {layer: i for i, layer in enumerate(m.moe_layers)}
        last_moe = (m.num_layers - 1) in moe_pos
        core = attention_core_flops_per_token(arch, par.seq_len)
        attn_gemms = attention_gemms(arch, h, tokens_mb, tp)
        attn_s = (
            rates.scaled_s((attention_flops_per_token(arch, h, par.seq_len) - core) * tokens_mb, attn_gemms)
            + rates.attention_core_s(core * tokens_mb, par.seq_len)
            + rates.elementwise_s(tokens_mb, 2 * h, 1.0)
        )
        f = _ffn_factor(arch)
        # Non-GEMM work by the widths of the tensors it touches (placement.predict.compute.mlp_width).
        dense_layer_s = attn_s + rates.scaled_s(
            6.0 * h * arch.ffn_hidden_size * f * tokens_mb, mlp_gemms(arch, h, arch.ffn_hidden_size, tokens_mb, tp)
        ) + rates.elementwise_s(tokens_mb, mlp_width(arch, arch.ffn_hidden_size) / tp, 1.0)
        moe_dense_s = attn_s + rates.scaled_s(
            6.0 * h * arch.shared_expert_ffn_hidden_size * f * tokens_mb,
            mlp_gemms(arch, h, arch.shared_expert_ffn_hidden_size, tokens_mb, tp),
        ) + rates.elementwise_s(tokens_mb, mlp_width(arch, arch.shared_expert_ffn_hidden_size) / tp, 1.0)
        routed_layer_s = rates.scaled_s(
            6.0 * h * arch.moe_ffn_hidden_size * m.top_k * f * tokens_mb,
            expert_gemms(arch, h, tokens_mb, par.ep, m.num_experts, m.top_k),
            grouped=True,
        ) + rates.elementwise_s(tokens_mb, 2 * h + mlp_width(arch, arch.moe_ffn_hidden_size), float(m.top_k))

        def layer_s(moe: bool) -> tuple[float, float]:
            return (moe_dense_s, routed_layer_s) if moe else (dense_layer_s, 0.0)

        # Per stage: per item it holds (dense_s, routed_mean_s, moe index or -1, -2 for E and L), the
        # items where the pipeline layout puts them (placement.core.pipeline_layout.stage_items).
        dense_s: list[list[float]] = []
        routed_s: list[list[float]] = []
        moe_idx: list[list[int]] = []
        # An MTP layer's all-to-all and load: its own MoE layer when the instance has it (index
        # num_layers + j), else the last decoder MoE layer's as a stand-in.
        stand_in = (m.num_moe_layers - 1 - len(m.mtp_moe_layers)) if last_moe else -1
        mtp_projection_s = rates.scaled_s(_mtp_projection_flops_per_token(h) * tokens_mb, [Gemm(tokens_mb, h, 2 * h, 1)])
        loss_gemms = [Gemm(tokens_mb, arch.vocab_size / tp, h, arch.mtp_num_layers + 1)]
        loss_s = rates.scaled_s(_loss_flops_per_token(arch, h) * tokens_mb, loss_gemms)
        for items in stage_items(instance, arch.mtp_num_layers):
            ds, rs, mi = [], [], []
            for kind, j in items:
                if kind == "t":
                    d, r = layer_s(j in moe_pos)
                    ds.append(d)
                    rs.append(r)
                    mi.append(moe_pos.get(j, -1))
                elif kind == "m":  # one MTP layer: a transformer layer plus its norms and projection
                    own = moe_pos.get(m.num_layers + j, -1)
                    dj, rj = layer_s(last_moe) if own < 0 else layer_s(True)
                    mtp_idx = own if own >= 0 else stand_in
                    ds.append(dj + mtp_projection_s)
                    rs.append(rj if mtp_idx >= 0 else 0.0)
                    mi.append(mtp_idx)
                elif kind == "L":  # the output layer of the main head and of every MTP head
                    ds.append(loss_s)
                    rs.append(0.0)
                    mi.append(-2)
                else:  # "E": the embedding lookup has no GEMM (Megatron counts no FLOPs for it)
                    ds.append(0.0)
                    rs.append(0.0)
                    mi.append(-2)
            dense_s.append(ds)
            routed_s.append(rs)
            moe_idx.append(mi)
        self.dense_layer_s = dense_layer_s
        self.moe_layer_s = moe_dense_s + routed_layer_s
        self._dense = [np.array(x) for x in dense_s]
        self._routed = [np.array(x) for x in routed_s]
        self._moe_idx = [np.array(x, dtype=np.int64) for x in moe_idx]
        self._overhead = [np.where(np.array(x) == -2, 0.0, perf.layer_overhead_s) for x in moe_idx]
        self._all_dense = np.concatenate(self._dense)
        self._all_routed = np.concatenate(self._routed)
        self._all_idx = np.concatenate(self._moe_idx)
        self._all_overhead = np.concatenate(self._overhead)
        self._stage_of = np.repeat(np.arange(len(self._dense)), [len(x) for x in self._dense])

    def repriced(self, performance: Performance) -> "StepTimeModel":
        """A copy priced with ``performance``, which may differ from this model's block only in its
        compute and overlap values (GEMM ceiling and shape, FP8 ratio, elementwise bytes, layer
        overhead, overlap efficiency): the calibration's inner loop, without rebuilding the rest."""
        other = copy.copy(self)
        other.perf = performance
        other._build_compute(performance)
        return other

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

    def _group_time_s(self, groups: np.ndarray, params: np.ndarray, rank2gpu: np.ndarray | None) -> np.ndarray:
        """(pp,) reduce-scatter + all-gather seconds of the slowest group of each stage.

        A group inside one NVLink domain runs NCCL's ring on NVLink: ``S (n-1)/n / nvlink``.  A
        group over ``k`` domains with at least ``g`` members in each runs hierarchically: the
        NVLink part ``S (g-1)/g / nvlink``, then the inter-domain ring on a ``1/g`` shard per GPU,
        every member using its own NIC: ``S (k-1)/(k g) / nic``.  Without ``rank2gpu`` every
        member is taken to sit in its own domain (``k = n``, ``g = 1``).
        """
        pp, ngroups, n = groups.shape
        size = params * self._bytes_per_param  # (pp,)
        if n <= 1:
            return np.zeros(pp)
        if rank2gpu is None:
            k = np.full((pp, ngroups), float(n))
            g = np.ones((pp, ngroups))
        else:
            cl = self.instance.cluster
            nd = cl.num_domains
            doms = cl.gpu2domain[np.asarray(rank2gpu)[groups]]  # (pp, G, n)
            rows = np.arange(pp * ngroups).reshape(pp, ngroups, 1) * nd
            counts = np.bincount((rows + doms).reshape(-1), minlength=pp * ngroups * nd).reshape(pp, ngroups, nd)
            k = (counts > 0).sum(axis=2).astype(np.float64)
            g = np.where(counts > 0, counts, n).min(axis=2).astype(np.float64)
        inside = (n - 1) / n / self._dp_nvl_bps
        spans = (g - 1) / g / self._dp_nvl_bps + (k - 1) / (k * g) / self._dp_nic_bps
        per_byte = np.where(k <= 1, inside, spans)  # (pp, G)
        return size * per_byte.max(axis=1)

    def _dp_time_s(self, rank2gpu: np.ndarray | None, expert_scale: float = 1.0) -> np.ndarray:
        """(pp,) reduce-scatter + all-gather seconds per GPU of each stage (``expert_scale``: expert
        slots per GPU over the permutation's, ``(E + N) / E`` with redundant slots)."""
        return self._group_time_s(self._dense_groups, self.dense_params_per_gpu, rank2gpu) + self._group_time_s(
            self._expert_groups, self.expert_params_per_gpu * expert_scale, rank2gpu
        )

    def p2p_time_s(self, rank2gpu: np.ndarray | None) -> np.ndarray:
        """(pp,) seconds per micro-batch each stage spends sending pipeline activations.

        Every boundary between consecutive (virtual) stages moves :func:`p2p_bytes_per_boundary`
        forward (sender -> receiver) and its gradient backward, rank to the rank of the same
        ``(tp, cp, dp)`` coordinates; a pair inside one NVLink domain at the NVLink spec, across
        domains at the NIC's achieved bandwidth (``nic_efficiency``).  A stage is charged what it
        sends: the forward activations of its outgoing boundaries and the gradients of its
        incoming ones, at the slowest pair.  Without ``rank2gpu`` every pair crosses domains.
        """
        pp = self.instance.parallel.pp
        out = np.zeros(pp)
        if not self._boundaries:
            return out
        cross: dict[tuple[int, int], bool] = {}
        for a, b, nbytes in self._boundaries:
            pair = (min(a, b), max(a, b))
            if pair not in cross:
                if rank2gpu is None:
                    cross[pair] = True
                else:
                    doms = self.instance.cluster.gpu2domain[np.asarray(rank2gpu)[self._stage_ranks[[a, b]]]]
                    cross[pair] = bool((doms[0] != doms[1]).any())
            t = nbytes / (self._p2p_nic_bps if cross[pair] else self._p2p_nvl_bps)
            out[a] += t
            out[b] += t
        return out

    # -- the score ---------------------------------------------------------------------------
    def transfer_times_s(
        self,
        alltoall_time_s_per_layer: Sequence[float],
        nic_bytes_per_layer: Sequence[float] | None = None,
        nvlink_bytes_per_layer: Sequence[float] | None = None,
    ) -> np.ndarray:
        """(num_moe_layers, 4) seconds per micro-batch of each transfer at the achieved bandwidth.

        Columns: forward dispatch, forward combine, backward combine, backward dispatch.  With the
        busiest NIC's and NVLink port's bytes per layer (``Metrics.max_gpu_*_bytes_per_layer``)
        each transfer takes the slower link at its dispatcher's achieved bandwidth; without them,
        the spec-priced time is split by bytes and slowed by the slower link's efficiency.
        """
        m = self.micro_batches
        if nic_bytes_per_layer is not None and nvlink_bytes_per_layer is not None and len(nvlink_bytes_per_layer):
            # The evaluator's busiest NIC is already per direction: max(copies sent, copies
            # received) times the four transfers' bytes (placement.predict.cost), read back as copies.
            nic_copies = np.asarray(nic_bytes_per_layer, dtype=np.float64) / self._transfer_bytes.sum() / m
            nvl_copies = np.asarray(nvlink_bytes_per_layer, dtype=np.float64) / self._nic_copy / m
            t_nic = nic_copies[:, None] * self._transfer_bytes[None, :] / self._nic_bps
            t_nvl = nvl_copies[:, None] * self._transfer_bytes[None, :] / self._nvl_bps[None, :]
            return np.maximum(t_nic, t_nvl)
        a = np.asarray(alltoall_time_s_per_layer, dtype=np.float64) / m
        return a[:, None] * (self._spec_share * self._spec_slowdown)[None, :]

    def _pair(self, a: np.ndarray, c: np.ndarray) -> np.ndarray:
        """One transfer ``a`` overlapped with one compute node ``c`` of the other micro-batch.

        The hidden share ``eta * a`` runs beside ``c`` while its kernels take a share ``f`` of the
        SMs (``c`` slows by ``f * eta * a``); the rest ``(1 - eta) * a`` stays exposed.
        """
        eta, f = self.perf.overlap_efficiency, self._sm_share
        return (1.0 - eta) * a + np.maximum(eta * a, c + f * eta * a)

    def item_times_s(
        self,
        alltoall_time_s_per_layer: Sequence[float],
        expert_load_max_over_mean_per_layer: Sequence[float],
        *,
        communication: bool = True,
        nic_bytes_per_layer: Sequence[float] | None = None,
        nvlink_bytes_per_layer: Sequence[float] | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per item the stages hold (:func:`stage_items` order, stage by stage), per micro-batch:
        ``(tau, sigma, compute, transfers)``: seconds in a paired slot, in an unpaired one, the
        compute alone, and (items, 4) the all-to-all transfers (arguments as :meth:`predict`)."""
        perf = self.perf
        n_moe = len(expert_load_max_over_mean_per_layer)
        if communication:
            tt = self.transfer_times_s(alltoall_time_s_per_layer, nic_bytes_per_layer, nvlink_bytes_per_layer)
        else:
            tt = np.zeros((n_moe, 4))
        if perf.expert_load == "balanced":
            window = np.ones(n_moe)
        else:
            window = np.asarray(expert_load_max_over_mean_per_layer, dtype=np.float64)
        load = per_microbatch_load(window, self._pairs_per_gpu, self._ep)
        if perf.capacity_factor > 0:  # tokens over the per-rank capacity are dropped
            load = np.minimum(load, perf.capacity_factor)
        # Every layer of every stage at once (self._stage_of), summed per stage with bincount.
        idx = self._all_idx
        is_moe = idx >= 0
        safe = np.maximum(idx, 0)
        lo = np.where(is_moe, load[safe] if n_moe else 1.0, 1.0)
        attn = self._all_dense + self._all_overhead
        mlp = self._all_routed * lo
        c = attn + mlp
        t = np.where(is_moe[:, None], tt[safe] if n_moe else 0.0, 0.0)  # (layers, 4)
        a = t.sum(axis=1)
        serial = c + a
        if perf.overlap == "1f1b":
            # Megatron-Core's combined 1F1B (model_chunk_schedule_plan.py, run()): backward
            # combine | forward attention; forward dispatch | backward expert GEMMs; backward
            # dispatch | forward expert GEMMs; forward combine | backward attention.
            paired = (
                self._pair(t[:, 2], attn / 3.0)
                + self._pair(t[:, 0], 2.0 * mlp / 3.0)
                + self._pair(t[:, 3], mlp / 3.0)
                + self._pair(t[:, 1], 2.0 * attn / 3.0)
            )
            per_layer_tau = np.where(is_moe, paired, c)
        else:
            per_layer_tau = serial
        return per_layer_tau, serial, c, t

    def predict(
        self,
        alltoall_time_s_per_layer: Sequence[float],
        expert_load_max_over_mean_per_layer: Sequence[float],
        rank2gpu: np.ndarray | None = None,
        *,
        communication: bool = True,
        nic_bytes_per_layer: Sequence[float] | None = None,
        nvlink_bytes_per_layer: Sequence[float] | None = None,
        replica_grad_s_per_stage: Sequence[float] | None = None,
        expert_dp_scale: float = 1.0,
    ) -> Prediction:
        """The prediction from the evaluator's per-MoE-layer lists (see the module docstring).

        Parameters
        ----------
        alltoall_time_s_per_layer : (num_moe_layers,) ``Metrics.alltoall_time_s_per_layer``.
        expert_load_max_over_mean_per_layer : (num_moe_layers,) the same Metrics' load ratios.
        rank2gpu : (world,) the placement's rank -> GPU map, for the data-parallel groups' links;
            ``None`` prices every group as spread over one domain per member.
        communication : False gives the compute-bound step (no all-to-all, no DP traffic).
        nic_bytes_per_layer, nvlink_bytes_per_layer : (num_moe_layers,) the Metrics' busiest NIC
            and NVLink port bytes per step; with them each transfer is priced on its own link at
            its achieved bandwidth (:meth:`transfer_times_s`).
        replica_grad_s_per_stage : (pp,) the redundant slots' gradient sum per step
            (``Metrics.replica_grad_time_s_per_stage``), added exposed (:mod:`placement.predict.replica_cost`).
        expert_dp_scale : expert slots per GPU over the permutation's (``(E + N) / E``): the
            expert-data-parallel collectives move the redundant slots too.
        """
        perf, m = self.perf, self.micro_batches
        per_layer_tau, serial, c, t = self.item_times_s(
            alltoall_time_s_per_layer, expert_load_max_over_mean_per_layer, communication=communication,
            nic_bytes_per_layer=nic_bytes_per_layer, nvlink_bytes_per_layer=nvlink_bytes_per_layer,
        )
        pp = len(self._dense)

        def per_stage(x: np.ndarray) -> np.ndarray:
            return np.bincount(self._stage_of, weights=x, minlength=pp)

        tau = per_stage(per_layer_tau)
        sigma = per_stage(serial)
        tau_a2a, sigma_a2a = tau, sigma
        if communication:
            # Pipeline sends: exposed in the unpaired slots, hidden with the overlap efficiency in
            # the paired ones (Megatron-Core issues them asynchronously beside the next compute).
            p2p = self.p2p_time_s(rank2gpu)
            sigma = sigma + p2p
            tau = tau + (1.0 - perf.overlap_efficiency) * p2p if perf.overlap == "1f1b" else tau + p2p
        else:
            p2p = np.zeros(pp)
        comp = per_stage(c)
        fwd_free = np.maximum(0.0, per_stage(c / 3.0 - t[:, 0] - t[:, 1]))
        bwd_free = np.maximum(0.0, per_stage(2.0 * c / 3.0 - t[:, 2] - t[:, 3]))
        bubble_units = (pp - 1) / perf.vpp
        # m micro-batches: m - 1 paired forward/backward slots, the first forward and the last
        # backward unpaired (exposed), and the warm-up/cool-down bubble, also unpaired.
        pipeline = (m - 1) * tau.max() + (1.0 + bubble_units) * sigma.max()
        if communication:
            dp = self._dp_time_s(rank2gpu, expert_dp_scale)
            rs, ag = dp * self._rs_share, dp * (1.0 - self._rs_share)
            exposed_dp = np.maximum(0.0, rs - bwd_free) + np.maximum(0.0, ag - fwd_free)
            if replica_grad_s_per_stage is not None and len(replica_grad_s_per_stage):
                exposed_dp = exposed_dp + np.asarray(replica_grad_s_per_stage, dtype=np.float64)
        else:
            exposed_dp = np.zeros(pp)
        step = float(pipeline + exposed_dp.max())
        s_tau = int(np.argmax(tau))
        s_sigma = int(np.argmax(sigma))
        exposed_a2a = (m - 1) * (tau_a2a[s_tau] - comp[s_tau]) + (1.0 + bubble_units) * (sigma_a2a[s_sigma] - comp[s_sigma])
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
            p2p_s_per_microbatch=[float(x) for x in p2p],
        )

    def predict_metrics(self, metrics: Metrics, rank2gpu: np.ndarray | None = None) -> Prediction:
        """:meth:`predict` on a :class:`~placement.predict.cost.Metrics` (each transfer on its own link).

        The load priced is the Metrics' lasting one (``expert_load_lasting_max_over_mean_per_layer``,
        the window's sampling noise removed) when present, else the raw sampled ratio.
        """
        # The lasting load (sampling noise removed, placement.predict.imbalance) when the evaluator gave it;
        # per_microbatch_load adds the spread of one micro-batch on top.
        lasting = getattr(metrics, "expert_load_lasting_max_over_mean_per_layer", None)
        return self.predict(
            metrics.alltoall_time_s_per_layer,
            lasting or metrics.expert_load_max_over_mean_per_layer,
            rank2gpu,
            nic_bytes_per_layer=metrics.max_gpu_cross_domain_bytes_per_layer,
            nvlink_bytes_per_layer=getattr(metrics, "max_gpu_nvlink_bytes_per_layer", None),
            replica_grad_s_per_stage=getattr(metrics, "replica_grad_time_s_per_stage", None),
            expert_dp_scale=1.0 + getattr(metrics, "num_redundant_experts", 0) / self.instance.model.num_experts,
        )

    def step_time_s(self, metrics: Metrics, rank2gpu: np.ndarray | None = None) -> float:
        """Predicted seconds of one optimizer step: the score to rank candidate placements by."""
        return self.predict_metrics(metrics, rank2gpu).step_time_s


def predict(instance: Instance, metrics: Metrics, rank2gpu: np.ndarray | None = None) -> Prediction:
    """One-off prediction (builds the :class:`StepTimeModel`; reuse that in loops)."""
    return StepTimeModel(instance).predict_metrics(metrics, rank2gpu)

