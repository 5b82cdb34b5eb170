"""Compute time of a transformer layer from its GEMM shapes (pure, no I/O).

Every GEMM of a layer runs at ``ceiling x peak x s(M) s(N) s(K)``, ``s(x) = x / (x + x0)``:

- ``ceiling`` is the GPU kind's fitted ``gemm_efficiency`` (:class:`~placement.core.perfdata.GpuKind`):
  the fraction of the BF16 dense peak that a large BF16 GEMM reaches on that kind;
- ``peak`` is the dense peak of the precision; FP8, MXFP8 and NVFP4 GEMMs reach a share
  ``fp8_gemm_ratio`` of what a BF16 GEMM reaches of its own peak (one shared value, so that an
  efficiency fitted on FP8 rows is never applied unchanged to the BF16 peak);
- ``x0 = gemm_half_shape`` is one shared size (elements) at which a dimension halves the rate: small
  GEMMs (few tokens per expert, a narrow expert FFN, a small hidden size) run further from the peak.
  cuBLAS and CUTLASS grouped-GEMM measurements show this saturating shape (NVIDIA's MXFP8 grouped
  GEMM on GB200: 2,672 TFLOP/s of 5,000 at K=7168, N=2048, "Optimizing DeepSeek-V3 Training
  Performance on NVIDIA GB200 NVL72", NVIDIA/Megatron-LM ``docs/discussions``, commit eb0783b,
  section 1); no public table covers every shape and kind, so ``x0`` is fitted on the ladder.

The shapes, per GPU and micro-batch, with ``T = micro_batch x seq_len / (tp x cp)`` tokens:

- MLA: query down ``(T, q_lora, h)``, query up ``(T, n (d_qk + d_rope) / tp, q_lora)`` (or one
  ``(T, n (d_qk + d_rope) / tp, h)`` without a query LoRA), key/value down ``(T, kv_lora + d_rope,
  h)``, key/value up ``(T, n (d_qk + d_v) / tp, kv_lora)``, output ``(T, h, n d_v / tp)``;
- GQA: ``(T, (q + 2 kv) / tp, h)`` and ``(T, h, q / tp)``;
- MLP (dense, shared expert): ``(T, (f - 1) ffn / tp, h)`` and ``(T, h, ffn / tp)``;
- routed experts (expert-tensor-parallel 1): ``E / ep`` grouped GEMMs per GPU, each with ``M = T x
  ep x top_k / E`` rows at balanced load, ``N = (f - 1) moe_ffn``, ``K = h`` and back;
- output layer: ``(T, vocab / tp, h)`` per head; MTP projection ``(T, h, 2h)``;
- the attention's score and value products (Megatron's causal half): the fused attention kernel
  at ``ATTENTION_EFFICIENCY`` of the BF16 peak (:mod:`placement.core.perfdata`: cuDNN's published rate on
  B200, not the GEMM ceiling) times ``s(seq_len)^2``.

FLOPs are Megatron-Core's count (:func:`placement.predict.performance.layer_flops_per_token`); the shapes
only set the rate (the FLOP-weighted harmonic mean of the GEMMs' rates).  Non-GEMM work (norms,
activation, its FP8 quantization, router, permutation, residuals) moves ``elementwise_bytes`` bytes
of HBM per element of the tensors it touches, at the GPU kind's HBM bandwidth (``GpuKind.hbm_gbps``):
per token ``2 h`` for the attention side (the layer's input and output), :func:`mlp_width` ``/ tp``
for a dense MLP or shared expert, and ``2 h + mlp_width(moe_ffn)`` per routed copy (``top_k`` of
them: the permuted input and the expert's output, ``h`` wide, and the expert's intermediate tensors,
``(f - 1) moe_ffn`` from the up/gate GEMM and ``moe_ffn`` from the activation, which the SwiGLU
and the quantization before the down GEMM read and write).  An expert's intermediate is
``3 moe_ffn`` wide for SwiGLU: 6,144 for DeepSeek-V3 (0.86 h), 4,608 for Qwen3-235B-A22B (1.13 h),
2,304 for Qwen3-30B-A3B (1.13 h); pricing it by ``h`` alone under-charged the Qwen3 models.
"""

from __future__ import annotations

from dataclasses import dataclass

from placement.core.perfdata import ATTENTION_EFFICIENCY, GPU_KINDS, Architecture, Performance

__all__ = ["Gemm", "shape_factor", "attention_gemms", "mlp_gemms", "expert_gemms", "mlp_width", "head_gemms", "ComputeRates"]


@dataclass(frozen=True)
class Gemm:
    """``count`` GEMMs of ``(m, k) x (k, n)`` per micro-batch on one GPU, forward and backward."""

    m: float
    n: float
    k: float
    count: float = 1.0

    @property
    def flops(self) -> float:
        """Forward + backward FLOPs (3 x 2 x m x n x k per GEMM)."""
        return 6.0 * self.m * self.n * self.k * self.count


def shape_factor(x: float, half: float) -> float:
    """``x / (x + half)``: the share of the ceiling a GEMM dimension of ``x`` elements allows."""
    return x / (x + half) if half > 0 else 1.0


def attention_gemms(arch: Architecture, h: int, tokens: float, tp: int) -> list[Gemm]:
    """The attention's projection GEMMs (not the score/value products) of one layer."""
    n = arch.num_attention_heads
    if arch.attention == "mla":
        dq = arch.qk_head_dim + arch.qk_pos_emb_head_dim
        out = []
        if arch.q_lora_rank:
            out += [Gemm(tokens, arch.q_lora_rank, h), Gemm(tokens, n * dq / tp, arch.q_lora_rank)]
        else:
            out.append(Gemm(tokens, n * dq / tp, h))
        out += [
            Gemm(tokens, arch.kv_lora_rank + arch.qk_pos_emb_head_dim, h),
            Gemm(tokens, n * (arch.qk_head_dim + arch.v_head_dim) / tp, arch.kv_lora_rank),
            Gemm(tokens, h, n * arch.v_head_dim / tp),
        ]
        return out
    q = arch.kv_channels * n
    kv = arch.kv_channels * arch.num_query_groups
    return [Gemm(tokens, (q + 2 * kv) / tp, h), Gemm(tokens, h, q / tp)]


def mlp_gemms(arch: Architecture, h: int, ffn: int, tokens: float, tp: int) -> list[Gemm]:
    """A dense MLP (or shared expert) of hidden size ``ffn``: up (and gate) then down."""
    if ffn <= 0:
        return []
    up = (2 if arch.swiglu else 1) * ffn
    return [Gemm(tokens, up / tp, h), Gemm(tokens, h, ffn / tp)]


def expert_gemms(arch: Architecture, h: int, tokens: float, ep: int, num_experts: int, top_k: int) -> list[Gemm]:
    """The routed experts' grouped GEMMs on one GPU at balanced load (``E / ep`` experts)."""
    local = num_experts / max(ep, 1)
    rows = tokens * max(ep, 1) * top_k / num_experts
    up = (2 if arch.swiglu else 1) * arch.moe_ffn_hidden_size
    return [Gemm(rows, up, h, local), Gemm(rows, h, arch.moe_ffn_hidden_size, local)]


def mlp_width(arch: Architecture, ffn: int) -> int:
    """Elements per token of an MLP's intermediate tensors that its non-GEMM kernels read and write:
    the up (and gate) projection's output, ``(f - 1) ffn``, and the activation's output, ``ffn``."""
    return ((2 if arch.swiglu else 1) + 1) * ffn if ffn > 0 else 0


def head_gemms(arch: Architecture, h: int, tokens: float, tp: int) -> list[Gemm]:
    """Output layer(s) (main head and each MTP head) and the MTP projections."""
    out = [Gemm(tokens, arch.vocab_size / tp, h, arch.mtp_num_layers + 1)]
    if arch.mtp_num_layers:
        out.append(Gemm(tokens, h, 2 * h, arch.mtp_num_layers))
    return out


class ComputeRates:
    """Seconds for a list of GEMMs, attention products and HBM bytes under one ``performance`` block.

    Parameters
    ----------
    perf : the block: ``gemm_efficiency`` (the ceiling, fraction of the BF16 peak), ``gemm_half_shape``,
        ``fp8_gemm_ratio``, ``elementwise_bytes``, ``expert_gemm_efficiency`` (grouped over dense
        GEMMs of the same shape) and the GPU kind's HBM bandwidth.
    """

    def __init__(self, perf: Performance):
        self.perf = perf
        low_precision = perf.precision != "bf16"
        share = perf.fp8_gemm_ratio if low_precision else 1.0
        self.gemm_flops_per_s = perf.peak_flops_per_s * perf.gemm_efficiency * share
        self.attention_flops_per_s = perf.bf16_peak_flops_per_s * ATTENTION_EFFICIENCY
        self.half = perf.gemm_half_shape
        kind = GPU_KINDS.get(perf.gpu)
        self.hbm_bytes_per_s = (kind.hbm_gbps if kind else 8000.0) * 1e9

    def gemm_s(self, gemms: list[Gemm], *, grouped: bool = False) -> float:
        """Seconds of ``gemms`` (forward + backward) at their shapes' rates."""
        rate = self.gemm_flops_per_s * (self.perf.expert_gemm_efficiency if grouped else 1.0)
        x0 = self.half
        return sum(
            g.flops / (rate * shape_factor(g.m, x0) * shape_factor(g.n, x0) * shape_factor(g.k, x0)) for g in gemms
        )

    def scaled_s(self, flops: float, gemms: list[Gemm], *, grouped: bool = False) -> float:
        """Seconds of ``flops`` at the FLOP-weighted rate of ``gemms`` (Megatron's count, their shapes)."""
        total = sum(g.flops for g in gemms)
        if flops <= 0 or total <= 0:
            return 0.0
        return self.gemm_s(gemms, grouped=grouped) * flops / total

    def attention_core_s(self, flops: float, seq_len: int) -> float:
        """The score and value products at ``ATTENTION_EFFICIENCY`` of the BF16 peak times ``s(seq_len)^2``."""
        if flops <= 0:
            return 0.0
        return flops / (self.attention_flops_per_s * shape_factor(seq_len, self.half) ** 2)

    def elementwise_s(self, tokens: float, width: float, copies: float) -> float:
        """HBM seconds of the non-GEMM work of ``copies`` token copies touching ``width`` elements each."""
        return self.perf.elementwise_bytes * tokens * width * copies / self.hbm_bytes_per_s
