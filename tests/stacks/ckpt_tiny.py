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


def megatron_cpu_setup(port: int) -> None:
    """One-process gloo group and the small patches Megatron-Core 0.16.1 needs on a machine without CUDA.

    ``torch.cuda.current_device`` (buffers are created on it), ``torch.cuda.synchronize``, the CUDA
    RNG tracker's ``fork`` (used around expert initialisation) and ``moe_utils.te_general_gemm``
    (referenced by the router's GEMM even without TransformerEngine).  Call it in a child process
    only: it changes global state.
    """
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe import moe_utils

    tp_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()  # type: ignore[method-assign,assignment]
    moe_utils.te_general_gemm = None  # type: ignore[attr-defined]
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)


def megatron_gpt(seed: int, *, groups: int | None = 2) -> Any:
    """A 2-layer Megatron-Core ``GPTModel`` with MoE in both layers (local spec, SequentialMLP).

    Sigmoid scores with the aux-loss-free expert bias, top-2 over 1 of 2 groups, float32, the
    ``allgather`` dispatcher (the ``alltoall`` one creates CUDA streams), learned positions (RoPE
    asks for a CUDA device).
    """
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=2, hidden_size=DIM, num_attention_heads=2, ffn_hidden_size=32, moe_ffn_hidden_size=FFN,
        num_moe_experts=NUM_EXPERTS, moe_router_topk=TOP_K, moe_router_num_groups=groups,
        moe_router_group_topk=1 if groups else None, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather", use_cpu_initialization=True, params_dtype=torch.float32,
        gated_linear_unit=True, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        bf16=False, fp16=False,
    )
    model = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=NUM_EXPERTS, moe_grouped_gemm=False),
        vocab_size=64, max_sequence_length=16, position_embedding_type="learned_absolute",
    )
    with torch.no_grad():
        for layer in model.decoder.layers:
            layer.mlp.router.expert_bias.copy_(torch.randn(NUM_EXPERTS) * 0.05)
    return model


def megatron_batch(seed: int, seq: int = 8, batch: int = 2) -> tuple[Any, Any, Any, Any]:
    """(tokens, position ids, causal mask (True = masked), labels)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 64, (batch, seq), generator=gen)
    labels = torch.randint(0, 64, (batch, seq), generator=gen)
    pos = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1).view(1, 1, seq, seq)
    return tokens, pos, mask, labels
