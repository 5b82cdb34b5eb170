"""Tiny real MoE models of the training stacks, run on CPU, for tests that need the stacks' own code.

- :func:`megatron_tiny_gpt`: a Megatron-Core GPTModel with MoE (local non-TE spec, float32,
  ``allgather`` dispatcher, learned absolute positions, gloo world of one), with the small patches
  that make megatron-core 0.16.1 run without CUDA (``torch.cuda.current_device``/``synchronize``,
  the CUDA RNG tracker's ``fork``, ``moe_utils.te_general_gemm``, a NameError without
  TransformerEngine).
- :func:`torchtitan_tiny_moe`: TorchTitan 0.3.0's ``MoE`` module (``torchtitan/models/common/moe.py``)
  built from its config, parameters initialised (they start as ``torch.empty``).

Both are built once per test session by the callers' fixtures; each forward takes milliseconds.
Kept in one module so that other tests (checkpoints) can share the builders.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

TESTED_VERSIONS = {"torch": "2.14.1", "megatron-core": "0.16.1", "torchtitan": "0.3.0", "triton": "3.8.0"}


def _init_gloo_world() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)


@contextlib.contextmanager
def _cpu_patches() -> Any:
    """Patches that let megatron-core 0.16.1 build and run a tiny MoE model on CPU."""
    import torch
    from unittest import mock

    from megatron.core.tensor_parallel import random as mc_random
    from megatron.core.transformer.moe import moe_utils

    tracker = mc_random.get_cuda_rng_tracker()
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(torch.cuda, "current_device", lambda: "cpu"))
        stack.enter_context(mock.patch.object(torch.cuda, "synchronize", lambda *a, **k: None))
        stack.enter_context(mock.patch.object(type(tracker), "fork", lambda self, *a, **k: contextlib.nullcontext()))
        if not hasattr(moe_utils, "te_general_gemm"):
            stack.enter_context(mock.patch.object(moe_utils, "te_general_gemm", None, create=True))
        yield


def megatron_tiny_gpt(num_layers: int = 4, num_experts: int = 8, top_k: int = 2, hidden: int = 32, seed: int = 0) -> Any:
    """(model, forward) of a tiny Megatron-Core MoE GPT; ``forward(tokens)`` runs under the patches.

    ``tokens``: (batch, seq) int64 token ids; returns the logits.
    """
    import torch
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    _init_gloo_world()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    torch.manual_seed(seed)
    with _cpu_patches():
        with contextlib.suppress(Exception):
            model_parallel_cuda_manual_seed(seed)
        config = TransformerConfig(
            num_layers=num_layers,
            hidden_size=hidden,
            num_attention_heads=4,
            ffn_hidden_size=2 * hidden,
            num_moe_experts=num_experts,
            moe_router_topk=top_k,
            moe_ffn_hidden_size=hidden,
            moe_token_dispatcher_type="allgather",
            moe_aux_loss_coeff=0.0,
            use_cpu_initialization=True,
            params_dtype=torch.float32,
            bf16=False,
            fp16=False,
            add_bias_linear=False,
            gradient_accumulation_fusion=False,
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
            masked_softmax_fusion=False,
            persist_layer_norm=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        )
        spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False)
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=128,
            max_sequence_length=64,
            position_embedding_type="learned_absolute",
        )
    model.eval()

    def forward(tokens: Any) -> Any:
        b, s = tokens.shape
        position_ids = torch.arange(s).unsqueeze(0).expand(b, s)
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s)
        with _cpu_patches(), torch.no_grad():
            return model(tokens, position_ids, mask)

    return model, forward


def torchtitan_tiny_moe(dim: int = 16, num_experts: int = 8, top_k: int = 2, seed: int = 0) -> Any:
    """TorchTitan 0.3.0's MoE module with its TokenChoiceTopKRouter, initialised, on CPU."""
    import torch
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    cfg = MoE.Config(
        num_experts=num_experts,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=dim, hidden_dim=2 * dim, num_experts=num_experts),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=num_experts, top_k=top_k),
        ),
        router=TokenChoiceTopKRouter.Config(
            num_experts=num_experts,
            gate=Linear.Config(in_features=dim, out_features=num_experts),
            top_k=top_k,
            score_func="softmax",
        ),
        load_balance_coeff=None,
    )
    torch.manual_seed(seed)
    module = cfg.build()
    with torch.no_grad():
        for p in module.parameters():
            torch.nn.init.normal_(p, std=0.2)
    module.eval()
    return module
