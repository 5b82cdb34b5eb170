"""Tiny MoE models built from each stack's own modules, on CPU: the one builder module of the stack tests.

Used by the importers' tests (tests/test_importers_stacks.py: routing recorded by the stacks' own
routers) and by the checkpoint/runtime tests (tests/stacks/test_*.py, tests/stacks/megatron_job.py).

- :func:`cpu_patches` / :func:`install_cpu_patches`: the one list of patches that lets
  megatron-core 0.16.1 build and run without CUDA (``torch.cuda.current_device`` (buffers are
  created on it), ``torch.cuda.synchronize``, the CUDA RNG tracker's ``fork`` (used around expert
  initialisation), ``moe_utils.te_general_gemm`` (referenced by the router's GEMM even without
  TransformerEngine)); scoped (a pytest process) or for good (a child process).
- :func:`init_megatron_world`: the one idempotent gloo world of one process plus Megatron's
  model-parallel state (tensor = pipeline = 1); a second call, from any test, is a no-op.
- :func:`megatron_tiny_gpt` (importers) and :func:`megatron_gpt` (checkpoints): Megatron-Core
  ``GPTModel`` with MoE, local non-TE spec, SequentialMLP, float32, the ``allgather`` dispatcher
  (the ``alltoall`` one creates CUDA streams), learned absolute positions (RoPE asks for CUDA),
  both from :func:`_megatron_gpt_model`.
- :func:`torchtitan_tiny_moe` (importers) and :func:`titan_moe` / :func:`titan_model`
  (checkpoints): TorchTitan 0.3.0's ``MoE`` (``torchtitan/models/common/moe.py``) from its config.

Versions read and tested against: :data:`TESTED_VERSIONS` (and jax 0.10.2, orbax-checkpoint 0.12.8
for test_orbax.py).  Every builder imports its stack lazily; tests call ``pytest.importorskip``
first.  Each model is built once per test session (or child process); a forward takes milliseconds.
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any, Iterator

TESTED_VERSIONS = {"torch": "2.14.1", "megatron-core": "0.16.1", "torchtitan": "0.3.0", "triton": "3.8.0"}

# Checkpoint models: two groups of four experts, top-2, routing limited to 1 of 2 groups.
NUM_EXPERTS, TOP_K, DIM, FFN = 8, 2, 16, 24  # torch._grouped_mm (bf16) wants 16-byte strides
NON_GROUP_PRESERVING = [5, 0, 7, 2, 1, 6, 3, 4]  # phy2log: every block of 4 slots mixes both groups
GROUP_PRESERVING = [6, 4, 7, 5, 1, 3, 0, 2]  # phy2log: slots 0..3 hold group 1, slots 4..7 group 0


# ---------------------------------------------------------------------------------------------
# Megatron-Core (0.16.1) on CPU with gloo
# ---------------------------------------------------------------------------------------------
def _cpu_patch_list() -> list[tuple[Any, str, Any]]:
    """(object, attribute, replacement) for every CPU patch Megatron-Core 0.16.1 needs."""
    import torch
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe import moe_utils

    patches: list[tuple[Any, str, Any]] = [
        (torch.cuda, "current_device", lambda: torch.device("cpu")),
        (torch.cuda, "synchronize", lambda *a, **k: None),
        (tp_random.CudaRNGStatesTracker, "fork", lambda self, *a, **k: contextlib.nullcontext()),
    ]
    if getattr(moe_utils, "te_general_gemm", None) is None:  # no TransformerEngine
        patches.append((moe_utils, "te_general_gemm", None))
    return patches


@contextlib.contextmanager
def cpu_patches() -> Iterator[None]:
    """The CPU patches for the duration of a ``with`` block (global state restored after it)."""
    from unittest import mock

    with contextlib.ExitStack() as stack:
        for obj, name, value in _cpu_patch_list():
            stack.enter_context(mock.patch.object(obj, name, value, create=True))
        yield


def install_cpu_patches() -> None:
    """The CPU patches for good: call it in a child process only (it changes global state)."""
    for obj, name, value in _cpu_patch_list():
        setattr(obj, name, value)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_megatron_world(port: int | None = None) -> None:
    """A one-process gloo world and Megatron's model-parallel state (TP = PP = 1); idempotent.

    The first call in a process initialises ``torch.distributed`` on ``port`` (default: a free
    port unless ``MASTER_PORT`` is set) and ``parallel_state``; later calls, from whichever test,
    change nothing.  A child process passes its own ``port``: it inherits the parent's
    ``MASTER_PORT``, which the parent's store holds.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if port is not None:
            os.environ["MASTER_PORT"] = str(port)
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


def _megatron_gpt_model(
    seed: int, *, num_layers: int, hidden: int, heads: int, ffn: int, vocab: int, max_seq: int, **moe: Any
) -> Any:
    """A Megatron-Core MoE ``GPTModel`` on CPU (the world initialised, built under the patches).

    ``moe``: further ``TransformerConfig`` fields (``num_moe_experts``, ``moe_router_topk``, ...).
    """
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    init_megatron_world()
    torch.manual_seed(seed)
    with cpu_patches():
        with contextlib.suppress(Exception):
            model_parallel_cuda_manual_seed(seed)
        config = TransformerConfig(
            num_layers=num_layers, hidden_size=hidden, num_attention_heads=heads, ffn_hidden_size=ffn,
            moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0, use_cpu_initialization=True,
            params_dtype=torch.float32, bf16=False, fp16=False, add_bias_linear=False, hidden_dropout=0.0,
            attention_dropout=0.0, **moe,
        )
        spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
        return GPTModel(
            config=config, transformer_layer_spec=spec, vocab_size=vocab, max_sequence_length=max_seq,
            position_embedding_type="learned_absolute",
        )


def causal_inputs(batch: int, seq: int) -> tuple[Any, Any]:
    """(position ids (batch, seq), causal mask (1, 1, seq, seq), True = masked)."""
    import torch

    pos = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1).view(1, 1, seq, seq)
    return pos, mask


def megatron_tiny_gpt(num_layers: int = 4, num_experts: int = 8, top_k: int = 2, hidden: int = 32, seed: int = 0) -> Any:
    """(model, forward) of a tiny Megatron-Core MoE GPT (softmax top-k); ``forward(tokens)`` runs under the patches.

    ``tokens``: (batch, seq) int64 token ids, ids < 128, seq <= 64; returns the logits.
    """
    import torch

    model = _megatron_gpt_model(
        seed, num_layers=num_layers, hidden=hidden, heads=4, ffn=2 * hidden, vocab=128, max_seq=64,
        num_moe_experts=num_experts, moe_router_topk=top_k, moe_ffn_hidden_size=hidden,
        gradient_accumulation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False,
    )
    model.eval()

    def forward(tokens: Any) -> Any:
        pos, mask = causal_inputs(*tokens.shape)
        with cpu_patches(), torch.no_grad():
            return model(tokens, pos, mask)

    return model, forward


def megatron_gpt(seed: int, *, groups: int | None = 2) -> Any:
    """A 2-layer Megatron-Core ``GPTModel`` with MoE in both layers, for the checkpoint tests.

    Sigmoid scores with the aux-loss-free expert bias (set to small random values), top-2 over 1
    of 2 groups, gated linear units.  Run it in a process where :func:`install_cpu_patches` ran.
    """
    import torch

    model = _megatron_gpt_model(
        seed, num_layers=2, hidden=DIM, heads=2, ffn=32, vocab=64, max_seq=16,
        num_moe_experts=NUM_EXPERTS, moe_router_topk=TOP_K, moe_ffn_hidden_size=FFN, moe_router_num_groups=groups,
        moe_router_group_topk=1 if groups else None, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_load_balancing_type="none", gated_linear_unit=True,
    )
    with torch.no_grad():
        for layer in model.decoder.layers:
            layer.mlp.router.expert_bias.copy_(torch.randn(NUM_EXPERTS) * 0.05)
    return model


def megatron_batch(seed: int, seq: int = 8, batch: int = 2) -> tuple[Any, Any, Any, Any]:
    """(tokens, position ids, causal mask (True = masked), labels), each (batch, seq) but the mask."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 64, (batch, seq), generator=gen)
    labels = torch.randint(0, 64, (batch, seq), generator=gen)
    pos, mask = causal_inputs(batch, seq)
    return tokens, pos, mask, labels


# ---------------------------------------------------------------------------------------------
# TorchTitan (torchtitan/models/common/moe.py, 0.3.0)
# ---------------------------------------------------------------------------------------------
def torchtitan_tiny_moe(dim: int = 16, num_experts: int = 8, top_k: int = 2, seed: int = 0) -> Any:
    """TorchTitan's MoE module with its TokenChoiceTopKRouter (softmax scores), initialised, on CPU."""
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
    module = cfg.build()  # parameters start as torch.empty
    with torch.no_grad():
        for p in module.parameters():
            torch.nn.init.normal_(p, std=0.2)
    module.eval()
    return module


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
# The file `placement export --keep-router` writes, for the checkpoint models' shape
# ---------------------------------------------------------------------------------------------
def keep_router_export(tmp: "os.PathLike[str] | str", stack: str, moe_layers: tuple[int, ...],
                       maps: "list[list[int]]") -> Any:
    """Run ``placement export --format STACK --keep-router`` on a placement file with expert maps
    ``maps`` (phy2log per MoE layer, group-breaking ones allowed) for an instance shaped like the
    checkpoint models (:data:`NUM_EXPERTS` experts in 2 groups, top-2 within 1 group, MoE layers
    ``moe_layers`` of ``max(moe_layers) + 1``; EP 2 on 4 GPUs), through the command line's own
    entry point.  Returns the path of the permutation file it wrote."""
    import dataclasses
    from pathlib import Path

    import numpy as np

    from placement.cli import main as cli_main
    from placement.formats import placement_document, read_instance, write_instance, write_placement
    from placement.core.model import MoEModel, ParallelLayout, Placement, Routing
    from solvers.default import default_rank2gpu
    from tests.conftest import random_instance

    tmp = Path(tmp)
    rng = np.random.default_rng(0)
    num_layers = max(moe_layers) + 1
    inst = random_instance(rng, num_experts=NUM_EXPERTS, top_k=TOP_K, ep=2, dp=2, pp=1, num_domains=2,
                           trays_per_domain=1, gpus_per_tray=2, tokens=8, moe_layers=len(moe_layers), num_groups=2,
                           groups_per_token=1)
    model: MoEModel = dataclasses.replace(inst.model, num_layers=num_layers, moe_layers=tuple(moe_layers))
    par: ParallelLayout = dataclasses.replace(inst.parallel, stage_layers=(tuple(range(num_layers)),))

    def window() -> Any:  # top-2 inside one group of 4, as the models route
        shape = (len(moe_layers), 2, 8)
        group = rng.integers(0, 2, size=shape + (1,))
        within = np.sort(np.argsort(rng.random(shape + (4,)), axis=-1)[..., :TOP_K], axis=-1)
        return within + 4 * group

    inst = dataclasses.replace(inst, model=model, parallel=par, routing=Routing(window(), window()))
    write_instance(inst, tmp / "instance.json")
    inst = read_instance(tmp / "instance.json")
    placement = Placement(default_rank2gpu(inst), np.asarray(maps, dtype=np.int64))
    write_placement(tmp / "placement.json", placement_document(inst, placement, solver="test"))
    out = tmp / f"{stack}_keep_router.json"
    code = cli_main(["export", "--format", stack, "--keep-router", "--instance", str(tmp / "instance.json"),
                     "-o", str(out), str(tmp / "placement.json")])
    if code != 0:
        raise RuntimeError(f"placement export --keep-router exited {code}")
    return out
