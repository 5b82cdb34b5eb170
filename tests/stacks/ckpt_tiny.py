"""Tiny MoE models built from each stack's own modules, on CPU, for the checkpoint and runtime tests.

Versions read and tested against: megatron-core 0.16.1, torchtitan 0.3.0, jax 0.10.2,
orbax-checkpoint 0.12.8 (torch 2.14).  Every builder imports its stack lazily; tests call
``pytest.importorskip`` first.
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any

# Two-group, four-expert-per-group models: 8 experts, top-2, routing limited to 1 of 2 groups.
NUM_EXPERTS, TOP_K, DIM, FFN = 8, 2, 16, 24  # torch._grouped_mm (bf16) wants 16-byte strides
NON_GROUP_PRESERVING = [5, 0, 7, 2, 1, 6, 3, 4]  # phy2log: every block of 4 slots mixes both groups
GROUP_PRESERVING = [6, 4, 7, 5, 1, 3, 0, 2]  # phy2log: slots 0..3 hold group 1, slots 4..7 group 0


# ---------------------------------------------------------------------------------------------
# TorchTitan (torchtitan/models/common/moe.py, 0.3.0)
# ---------------------------------------------------------------------------------------------
def titan_moe(seed: int, *, groups: int | None = 2, limited: int | None = 1, bias_step: bool = True) -> Any:
    """A TorchTitan ``MoE`` (sigmoid scores, aux-loss-free bias, group-limited top-2), float32 CPU."""
    import torch
    from torchtitan.models.common.config_utils import make_moe_config, make_router_config
    from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    router = make_router_config(
        dim=DIM, num_experts=NUM_EXPERTS, gate_param_init={}, top_k=TOP_K, score_func="sigmoid",
        route_norm=True, route_scale=2.5, num_expert_groups=groups, num_limited_groups=limited,
    )
    experts = RoutedExperts.Config(
        inner_experts=GroupedExperts.Config(dim=DIM, hidden_dim=FFN, num_experts=NUM_EXPERTS),
        token_dispatcher=LocalTokenDispatcher.Config(num_experts=NUM_EXPERTS, top_k=TOP_K),
    )
    moe = make_moe_config(num_experts=NUM_EXPERTS, router=router, routed_experts=experts).build()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(moe.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        moe.expert_bias_E.copy_(torch.randn(NUM_EXPERTS, generator=gen) * 0.05)
        moe.tokens_per_expert_E.zero_()
    return moe


def titan_model(seed: int) -> Any:
    """Two TorchTitan MoE layers under the names a TorchTitan decoder gives them (``layers.{i}.moe``)."""
    import torch

    class Block(torch.nn.Module):
        def __init__(self, moe: Any) -> None:
            super().__init__()
            self.moe = moe

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleDict({"1": Block(titan_moe(seed)), "3": Block(titan_moe(seed + 1))})

        def forward(self, x: Any) -> Any:
            for key in ("1", "3"):
                x = x + self.layers[key].moe(x)
            return x

    return Model()


# ---------------------------------------------------------------------------------------------
# Megatron-Core (0.16.1) on CPU with gloo
# ---------------------------------------------------------------------------------------------
def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
