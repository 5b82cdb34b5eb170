"""FLOPs and parameters of a model (Megatron-Core's counting), the denominator of every TFLOP/s figure.

:func:`model_flops_per_token` (the FLOPs of one token, forward and backward, as Megatron-Bridge's
performance summaries count them), per layer (:func:`layer_flops_per_token`) and per attention
kind; :func:`stage_slots` (the layer slots of each pipeline stage).  Used by the step-time model
(:mod:`placement.predict.performance`) and the calibration.
"""

from __future__ import annotations

from placement.core.model import Instance
from placement.core.perfdata import Architecture, Performance
from placement.core.pipeline_layout import stage_items


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


def attention_core_flops_per_token(arch: Architecture, seq_len: int) -> float:
    """The score and value products of :func:`attention_flops_per_token` (causal half).

    They run in BF16 (the attention kernel) even in FP8 recipes, so the model prices them at the
    BF16 peak.
    """
    n, s = arch.num_attention_heads, seq_len
    if arch.attention == "mla":
        dq = arch.qk_head_dim + arch.qk_pos_emb_head_dim
        return 3 * 2 * float(s * n * dq / 2 + s * n * arch.v_head_dim / 2)
    return 3 * 2 * float(arch.kv_channels * n * s)


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


def _mtp_projection_flops_per_token(hidden_size: int) -> float:
    """One MTP layer's norms and projection (``3h + 2h^2``), forward + backward, per token."""
    h = hidden_size
    return 3 * 2 * float(3 * h + 2 * h * h)


def _loss_flops_per_token(arch: Architecture, hidden_size: int) -> float:
    """The loss item ``L``: the output layer of the main head and of every MTP head, per token."""
    return 3 * 2 * float(hidden_size * arch.vocab_size * (arch.mtp_num_layers + 1))


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
    return [len(items) for items in stage_items(instance, perf.architecture.mtp_num_layers)]


def _require(instance: Instance) -> Performance:
    perf = getattr(instance, "performance", None)
    if perf is None:
        raise ValueError(f"instance {instance.name!r} has no performance block")
    return perf


