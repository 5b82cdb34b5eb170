"""A small DeepSeek-V3-style MoE language model in PyTorch (needs the optional ``torch`` extra).

The router follows DeepSeek-V3 (arXiv 2412.19437, section 2.1.2) and Megatron-Core's
implementation of it (``megatron/core/transformer/moe/moe_utils.py`` of megatron-core 0.16.1:
``group_limited_topk`` and ``get_updated_expert_bias``):

- scores ``s = sigmoid(x @ W)``, one per routed expert, shape ``(tokens, E)``;
- selection runs on ``s + b`` where ``b`` is the aux-loss-free balancing bias: experts
  ``g*E/G .. (g+1)*E/G - 1`` form expert group ``g``; a group's score is the sum of its two best
  biased scores; the ``groups_per_token`` best groups are kept and the ``top_k`` best biased
  scores inside them are selected;
- the gate weights are the *unbiased* scores of the selected experts, normalised to sum to one and
  multiplied by ``route_scale`` (the bias never enters the output, only the choice);
- after each optimizer step the bias moves by ``bias_update_rate * sign(mean_load - load_e)``
  from the step's per-expert load (:meth:`MoELayer.update_bias`).

Every MoE layer also has one shared expert that every token passes through.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["MoEConfig", "group_limited_topk", "Router", "MoELayer", "MoELM"]


@dataclass(frozen=True)
class MoEConfig:
    """Shape of the model.

    ``num_layers`` transformer blocks; the first ``first_moe_layer`` use a dense FFN, the others
    a MoE FFN (DeepSeek-V3 keeps its first three layers dense).
    """

    vocab_size: int = 256  # bytes
    d_model: int = 64
    num_heads: int = 4
    num_layers: int = 6
    first_moe_layer: int = 1
    dense_hidden: int = 256
    num_experts: int = 64
    expert_hidden: int = 32
    shared_hidden: int = 64
    top_k: int = 8
    num_groups: int = 8
    groups_per_token: int = 4
    route_scale: float = 2.5  # DeepSeek-V3's routed_scaling_factor
    bias_update_rate: float = 1e-2  # DeepSeek-V3 uses 1e-3 over ~10^5 steps; 500 steps need more
    seq_len: int = 128

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_moe_layer


def group_limited_topk(
    biased_scores: torch.Tensor, top_k: int, num_groups: int, groups_per_token: int
) -> torch.Tensor:
    """DeepSeek-V3's group-limited top-k on biased scores.

    Parameters
    ----------
    biased_scores : (tokens, E) tensor
        ``sigmoid(logits) + bias``.
    top_k, num_groups, groups_per_token : int
        Experts per token, expert groups of ``E / num_groups`` contiguous ids, groups per token.

    Returns
    -------
    (tokens, top_k) int64 tensor of selected expert ids, best first.
    """
    tokens, num_experts = biased_scores.shape
    if num_groups > 1 and groups_per_token < num_groups:
        grouped = biased_scores.view(tokens, num_groups, num_experts // num_groups)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # (tokens, G)
        keep = group_scores.topk(groups_per_token, dim=-1).indices
        mask = torch.ones(tokens, num_groups, dtype=torch.bool, device=biased_scores.device)
        mask.scatter_(1, keep, False)
        biased_scores = grouped.masked_fill(mask.unsqueeze(-1), float("-inf")).view(tokens, num_experts)
    return biased_scores.topk(top_k, dim=-1).indices


class Router(nn.Module):
    """Sigmoid router with an aux-loss-free balancing bias (a buffer, not a parameter)."""

    bias: torch.Tensor

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.randn(cfg.num_experts, cfg.d_model) * cfg.d_model**-0.5)
        self.register_buffer("bias", torch.zeros(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Route ``x`` (tokens, d_model): ``(ids (tokens, top_k), gate weights (tokens, top_k))``."""
        scores = torch.sigmoid(x @ self.weight.t())
        with torch.no_grad():
            ids = group_limited_topk(scores + self.bias, self.cfg.top_k, self.cfg.num_groups, self.cfg.groups_per_token)
        weights = scores.gather(1, ids)
        weights = weights / weights.sum(dim=-1, keepdim=True) * self.cfg.route_scale
        return ids, weights


class _SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoELayer(nn.Module):
    """Routed experts (SwiGLU, stacked weights) plus one shared expert."""

    step_load: torch.Tensor

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = Router(cfg)
        E, d, h = cfg.num_experts, cfg.d_model, cfg.expert_hidden
        self.w1 = nn.Parameter(torch.randn(E, d, h) * d**-0.5)
        self.w3 = nn.Parameter(torch.randn(E, d, h) * d**-0.5)
        self.w2 = nn.Parameter(torch.randn(E, h, d) * h**-0.5 / 4)
        self.shared = _SwiGLU(d, cfg.shared_hidden)
        self.register_buffer("step_load", torch.zeros(E))
        self.last_ids: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        ids, weights = self.router(flat)
        self.last_ids = ids
        if self.training:
            self.step_load += torch.bincount(ids.reshape(-1), minlength=self.cfg.num_experts).to(self.step_load.dtype)
        out = self.shared(flat)
        # Dispatch as one padded batch per expert: (E, capacity, d) -> three batched matmuls.
        E, k = self.cfg.num_experts, self.cfg.top_k
        expert_of = ids.reshape(-1)
        token_of = torch.arange(flat.shape[0], device=x.device).repeat_interleave(k)
        order = torch.argsort(expert_of, stable=True)
        counts = torch.bincount(expert_of, minlength=E)
        starts = torch.cumsum(counts, 0) - counts
        sorted_expert = expert_of[order]
        slot = torch.arange(order.numel(), device=x.device) - starts[sorted_expert]
        capacity = int(counts.max())
        buf = flat.new_zeros(E, capacity, flat.shape[1])
        buf[sorted_expert, slot] = flat[token_of[order]]
        hidden = F.silu(torch.bmm(buf, self.w1)) * torch.bmm(buf, self.w3)
        y = torch.bmm(hidden, self.w2)[sorted_expert, slot] * weights.reshape(-1)[order].unsqueeze(-1)
        routed = torch.zeros_like(flat).index_add_(0, token_of[order], y)
        return (out + routed).reshape(shape)

    @torch.no_grad()
    def update_bias(self) -> None:
        """Aux-loss-free balancing: move the bias toward the mean load, then clear the step's load."""
        load = self.step_load
        offset = load.mean() - load
        self.router.bias += torch.sign(offset) * self.cfg.bias_update_rate
        self.step_load.zero_()


class _Block(nn.Module):
    def __init__(self, cfg: MoEConfig, moe: bool) -> None:
        super().__init__()
        self.cfg = cfg
        self.norm1 = nn.RMSNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.norm2 = nn.RMSNorm(cfg.d_model)
        self.ffn: nn.Module = MoELayer(cfg) if moe else _SwiGLU(cfg.d_model, cfg.dense_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        H = self.cfg.num_heads
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, H, d // H).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(B, T, d))
        return x + self.ffn(self.norm2(x))


class MoELM(nn.Module):
    """Byte-level causal language model: embedding, blocks, output head."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Parameter(torch.randn(cfg.seq_len, cfg.d_model) * 0.02)
        self.blocks = nn.ModuleList(_Block(cfg, i >= cfg.first_moe_layer) for i in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    @property
    def moe_layers(self) -> list[MoELayer]:
        return [b.ffn for b in self.blocks if isinstance(b.ffn, MoELayer)]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, vocab) of ``tokens`` (B, T) int64."""
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    @torch.no_grad()
    def route(self, tokens: torch.Tensor) -> torch.Tensor:
        """Top-k ids of every token at every MoE layer: (num_moe_layers, B*T, top_k) int64."""
        was = self.training
        self.eval()
        self(tokens)
        self.train(was)
        return torch.stack([m.last_ids for m in self.moe_layers if m.last_ids is not None])
