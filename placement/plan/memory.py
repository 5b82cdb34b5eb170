"""Memory per GPU of a candidate layout: weights, gradients, optimizer state, activations.

The formula (``docs/plan.md`` states it with its sources), per GPU of pipeline stage ``s``:

- parameters ``P_s = P_dense_s / tp + P_expert_s`` as :class:`placement.predict.performance.StepTimeModel`
  counts them (the stage's layers; the embedding on the first stage; the output layer and the MTP
  layers on the last; ``E / ep`` experts of each MoE layer);
- weights ``param_bytes * P_s`` and main gradients ``grad_bytes * P_s`` (BF16 weights, FP32
  gradients: Megatron-Core's mixed precision);
- master weights and optimizer state ``(master_param_bytes + optimizer_state_bytes) * (P_dense_s /
  tp / (dp * cp) + P_expert_s / edp)`` with the distributed optimizer (sharded over the dense
  data-parallel group ``dp * cp`` and the expert data-parallel group ``edp = tp * cp * dp / ep``),
  unsharded without it: with the defaults ``6 + 12 / d`` bytes per parameter, Megatron-LM's
  ``compute_weight_and_optimizer_memory`` (``megatron/training/theoretical_memory_usage.py``) and
  the table in Megatron-Core's distributed-optimizer guide (``18`` bytes without it);
- activations of one micro-batch and layer, per token on this GPU (``b * seq / (tp * cp)`` tokens,
  sequence parallel): ``18 h + f F`` bytes (Korthikanti et al. 2022, Table 2, the selective-
  recompute row that Megatron-LM's ``compute_activation_memory`` uses: ``18 + 4 F / h`` per
  ``s b h``, with ``f = 4``; ``f = 6`` with SwiGLU, whose first projection has two halves), with
  ``F`` the dense MLP's width or, for an MoE layer, ``shared + top_k * moe_ffn`` (balanced routed
  load) plus ``4 * top_k * h`` for the dispatched copies and the expert outputs (BF16) before the
  combine; ``recompute: full`` keeps only every layer's ``2 h`` input and one layer's full
  activations for the recompute;
- micro-batches in flight under 1F1B on stage ``s``: ``min(m, pp - s)`` (the warm-up), times
  Megatron's interleaving penalty ``1 + (pp - 1) / (pp * vpp)`` when ``vpp > 1``;
- the first stage adds the embedding's input and dropout mask ``(8 + h)`` bytes per token per
  micro-batch in flight, the last the logits ``4 (h + V)`` per token of each output head (one
  micro-batch in flight).

Peak = the largest stage total; a candidate is feasible when the peak is at most the GPU's HBM
less the cluster file's reserve.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dataclasses import dataclass

from placement.predict.performance import StepTimeModel

if TYPE_CHECKING:  # pragma: no cover
    from placement.formats.job import Job


__all__ = ["MemoryEstimate", "memory_estimate", "activation_bytes_per_token"]


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU of the candidate's most loaded stage (``stage``), by kind."""

    stage: int
    params: float  # parameters on that GPU (count, not bytes)
    weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    in_flight_microbatches: float

    @property
    def total_bytes(self) -> float:
        return self.weights_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes

    def to_dict(self) -> dict[str, float | int]:
        return {
            "stage": self.stage,
            "params": self.params,
            "weights_bytes": self.weights_bytes,
            "grads_bytes": self.grads_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "activations_bytes": self.activations_bytes,
            "in_flight_microbatches": self.in_flight_microbatches,
            "total_bytes": self.total_bytes,
        }


def activation_bytes_per_token(job: Job, moe: bool) -> float:
    """Bytes one token keeps for one layer's backward (no recompute beyond core attention)."""
    arch = job.performance.architecture
    m = job.model
    h = m.hidden_size
    f = 6.0 if arch.swiglu else 4.0
    if not moe:
        return 18.0 * h + f * arch.ffn_hidden_size
    width = arch.shared_expert_ffn_hidden_size + m.top_k * arch.moe_ffn_hidden_size
    return 18.0 * h + f * width + 4.0 * m.top_k * h


def memory_estimate(job: Job, model: StepTimeModel, *, tp: int, cp: int, ep: int, dp: int, pp: int, vpp: int,
                    micro_batch: int) -> MemoryEstimate:
    """The memory of the most loaded stage of a candidate (see the module docstring).

    Parameters
    ----------
    job : the :class:`~placement.formats.job.Job`.
    model : the candidate's step-time model (:func:`placement.plan.skeleton.stage_model`): its
        per-stage parameter counts, shapes ``(pp,)``.
    """
    tr = job.training
    m = job.model
    arch = job.performance.architecture
    par = model.instance.parallel
    moe = set(m.moe_layers)
    h = m.hidden_size
    tokens = micro_batch * job.seq_len / (tp * cp)
    micro_batches = job.global_batch // (dp * micro_batch)
    edp = tp * cp * dp // ep
    penalty = 1.0 + (pp - 1) / (pp * vpp) if vpp > 1 else 1.0
    last_moe = (m.num_layers - 1) in moe
    best: MemoryEstimate | None = None
    for s, layers in enumerate(par.stage_layers):
        dense_p = float(model.dense_params_per_gpu[s])
        expert_p = float(model.expert_params_per_gpu[s])
        params = dense_p + expert_p
        weights = tr.param_bytes * params
        grads = tr.grad_bytes * params
        opt_per = tr.master_param_bytes + tr.optimizer_state_bytes
        optimizer = opt_per * (dense_p / (dp * cp) + expert_p / edp) if tr.distributed_optimizer else opt_per * params
        per_layer = [activation_bytes_per_token(job, layer in moe) for layer in layers]
        if s == pp - 1:
            per_layer += [activation_bytes_per_token(job, last_moe)] * arch.mtp_num_layers
        if tr.recompute == "full":
            act_tok = 2.0 * h * len(per_layer)
            once = max(per_layer) * tokens
        else:
            act_tok = sum(per_layer)
            once = 0.0
        in_flight = min(micro_batches, pp - s) * penalty
        acts = act_tok * tokens * in_flight + once
        if s == 0:
            acts += (8.0 + h) * tokens * in_flight
        if s == pp - 1:
            acts += 4.0 * (h + arch.vocab_size) * tokens * (1 + arch.mtp_num_layers)
        est = MemoryEstimate(s, params, weights, grads, optimizer, acts, in_flight)
        if best is None or est.total_bytes > best.total_bytes:
            best = est
    assert best is not None
    return best
