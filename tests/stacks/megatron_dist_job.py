"""Megatron-Core 0.16.1's distributed optimizer with EP = 2 over 2 gloo processes, with an MTP MoE layer.

Run by tests/stacks/test_megatron_dist.py as ``python -m tests.stacks.megatron_dist_job OUT.json
SHARDING_TYPE``.  Each rank builds a 2-layer MoE ``GPTModel`` plus one MTP layer (its own MoE),
wraps it in Megatron's ``DistributedDataParallel`` and ``get_megatron_optimizer``
(``ChainedOptimizer`` of a dense and an expert ``DistributedOptimizer``), takes one step, saves
with ``dist_checkpointing.save`` in the given ``distrib_optim_sharding_type``, records the bucket
layout (:func:`placement.consumers.checkpoint.write_megatron_bucket_layout`), permutes the checkpoint with
:func:`placement.consumers.checkpoint.permute_dcp` split over both ranks (``distributed=True``; experts
move across the EP ranks, the MTP layer is layer ``num_layers``), loads it into a fresh model and
optimizer, and takes a step on both.  Rank 0 writes what it measured.

CPU patches (child process only): the one list of :mod:`tests.stacks.tiny`, plus the places
Megatron's optimizer hard-codes CUDA: ``torch.tensor(..., device='cuda')`` (loss-scale and
overflow buffers), ``Tensor.type()`` checks for ``torch.cuda.FloatTensor`` and ``Tensor.cuda()``
(the ``fully_reshardable`` gather).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

NUM_LAYERS = 2
EP = 2
# phy2log per layer: decoder layers 0 and 1, and the MTP layer (model layer NUM_LAYERS); every
# one moves experts across the two EP ranks (ranks hold experts 0..3 and 4..7)
LAYERS = {0: [6, 4, 7, 5, 1, 3, 0, 2], 1: [1, 0, 3, 2, 5, 4, 7, 6], NUM_LAYERS: [4, 5, 6, 7, 3, 2, 1, 0]}


def _patch_cuda_only_calls(torch: Any) -> None:
    def on_cpu(f: Any) -> Any:
        @functools.wraps(f)
        def g(*a: Any, **k: Any) -> Any:
            if "cuda" in str(k.get("device", "")):
                k["device"] = "cpu"
            return f(*a, **k)

        return g

    for name in ("tensor", "zeros", "empty", "ones", "full"):
        setattr(torch, name, on_cpu(getattr(torch, name)))
    type_of = torch.Tensor.type

    def cuda_type(self: Any, *a: Any, **k: Any) -> Any:
        out = type_of(self, *a, **k)
        if not a and not k and isinstance(out, str) and out.startswith("torch.") and ".cuda." not in out:
            return "torch.cuda." + out[len("torch."):]
        return out

    torch.Tensor.type = cuda_type
    torch.Tensor.cuda = lambda self, *a, **k: self  # the fully_reshardable gather moves buffers to CUDA


def _model(seed: int) -> Any:
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer import TransformerConfig

    from tests.stacks.tiny import DIM, FFN, NUM_EXPERTS, TOP_K

    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=NUM_LAYERS, hidden_size=DIM, num_attention_heads=2, ffn_hidden_size=32,
        num_moe_experts=NUM_EXPERTS, moe_router_topk=TOP_K, moe_ffn_hidden_size=FFN, moe_router_num_groups=2,
        moe_router_group_topk=1, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_load_balancing_type="none", gated_linear_unit=True, expert_model_parallel_size=EP,
        moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0, use_cpu_initialization=True,
        params_dtype=torch.float32, bf16=False, fp16=False, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, mtp_num_layers=1, mtp_loss_scaling_factor=0.5,
    )
    spec = get_gpt_layer_local_spec(num_experts=NUM_EXPERTS, moe_grouped_gemm=False)
    mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=16,
                     position_embedding_type="learned_absolute", mtp_block_spec=mtp)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):  # every rank the same values (experts differ by name)
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        for name, buf in model.named_buffers():
            if name.endswith("expert_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.05)
    return model


def _wrap(model: Any) -> tuple[Any, Any]:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=False), model
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True, clip_grad=0.0, bf16=False), [ddp]
    )
    return ddp, opt


def _step(ddp: Any, opt: Any, seed: int) -> float:
    from tests.stacks.tiny import cpu_patches, megatron_batch

    tokens, pos, mask, labels = megatron_batch(seed)
    ddp.zero_grad_buffer()
    opt.zero_grad()
    with cpu_patches():
        loss = ddp(tokens, pos, mask, labels=labels).float().mean()
        loss.backward()
        ddp.finish_grad_sync()
        opt.step()
    return float(loss.item())


def _loss(ddp: Any, seed: int) -> float:
    import torch

    from tests.stacks.tiny import cpu_patches, megatron_batch

    tokens, pos, mask, labels = megatron_batch(seed)
    with cpu_patches(), torch.no_grad():
        return float(ddp(tokens, pos, mask, labels=labels).float().mean().item())


def _state(model: Any, opt: Any, sharding: str, loading: bool = False) -> dict:
    msd = model.sharded_state_dict()
    meta = {"distrib_optim_sharding_type": sharding}
    return {"model": msd, "optimizer": opt.sharded_state_dict(msd, is_loading=loading, metadata=meta)}


def _full_model_tensors(path: Path) -> dict[str, Any]:
    """Every model tensor of a torch_dist checkpoint, whole (rank 0, no process group)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = dcp.FileSystemReader(str(path)).read_metadata()
    out = {k: torch.zeros(tuple(v.size), dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
           if isinstance(v, TensorStorageMetadata) and not k.startswith(("optimizer.", "chained_"))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    return out


def _expected(a: dict[str, Any]) -> dict[str, Any]:
    """The unpermuted model's tensors with the map applied by hand (independent of placement.consumers.checkpoint)."""
    import torch

    out = {}
    for key, t in a.items():
        if key.startswith("decoder.layers.mlp.router.") or key.startswith("decoder.layers.mlp.experts.experts."):
            new = t.clone()
            for layer in range(NUM_LAYERS):
                new[layer] = t[layer][torch.tensor(LAYERS[layer])]
            out[key] = new
        elif key.startswith("mtp.layers.0.transformer_layer.mlp.router.") or key.startswith(
            "mtp.layers.0.transformer_layer.mlp.experts.experts."
        ):
            out[key] = t[torch.tensor(LAYERS[NUM_LAYERS])]
        else:
            out[key] = t
    return out


def run(rank: int, world: int, port: int, out_path: str, sharding: str, tmp: str) -> None:
    """One rank of the job (see the module docstring); rank 0 writes the JSON of measurements."""
    import torch
    import torch.distributed as dist

    from tests.stacks.tiny import install_cpu_patches, NUM_EXPERTS

    install_cpu_patches()
    _patch_cuda_only_calls(torch)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import dist_checkpointing, parallel_state

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=EP)
    from placement import checkpoint as ck
    from placement.core.permutation import PERMUTATION_KIND, PERMUTATION_VERSION

    doc = {"kind": PERMUTATION_KIND, "version": PERMUTATION_VERSION, "stack": "megatron", "num_experts": NUM_EXPERTS,
           "num_groups": 2, "group_limited": True, "layers": {str(k): v for k, v in LAYERS.items()}}
    src, dst, layout = Path(tmp) / "src", Path(tmp) / "dst", Path(tmp) / "bucket_layout.json"
    result: dict[str, Any] = {"sharding": sharding}

    model = _model(0)
    ddp, opt = _wrap(model)
    result["chained"] = len(getattr(opt, "chained_optimizers", [opt]))
    _step(ddp, opt, 1 + rank)  # Adam moments exist and differ per expert
    if rank == 0:
        src.mkdir()
    dist.barrier()
    dist_checkpointing.save(_state(model, opt, sharding), str(src))
    ck.write_megatron_bucket_layout(layout, [ddp], opt)
    keys = sorted(ck.permute_dcp(src, dst, doc, bucket_layout=layout, distributed=True))
    result["changed"] = keys

    def restored(seed: int, path: Path) -> tuple[Any, Any, Any]:
        model_ = _model(seed)  # other values: everything must come from the checkpoint
        ddp_, opt_ = _wrap(model_)
        _step(ddp_, opt_, 5)  # materialise optimizer state to load into (as the single-process job does)
        sd = dist_checkpointing.load(_state(model_, opt_, sharding, loading=True), str(path))
        with torch.no_grad():  # fp32 parameters: the main params are views of them
            model_.load_state_dict(sd["model"])
            opt_.load_state_dict(sd["optimizer"])
            for inner in opt_.chained_optimizers:  # see below: one 'step' tensor per parameter again
                for state in inner.optimizer.state.values():
                    if "step" in state:
                        state["step"] = state["step"].clone()
        return model_, ddp_, opt_

    # the reference is the unpermuted checkpoint loaded by the same code.  Megatron-Core 0.16.1's
    # load with torch's Adam (the fallback without TransformerEngine/Apex) hands the parameters of
    # an optimizer one shared 'step' tensor, which Adam then advances once per parameter, so the
    # bias correction a parameter sees depends on its position in the group (and an expert moved
    # to another EP rank changes position); restored() gives each parameter its own step again
    ref, rddp, ropt = restored(77, src)
    loaded, lddp, lopt = restored(123, dst)
    result["loss_diff"] = abs(_loss(lddp, 7) - _loss(ddp, 7))
    result["ref_loss_diff"] = abs(_loss(rddp, 7) - _loss(ddp, 7))
    for seed in (8, 9):
        _step(rddp, ropt, seed + rank)
        _step(lddp, lopt, seed + rank)
    result["loss_after_steps_diff"] = abs(_loss(lddp, 10) - _loss(rddp, 10))
    # every parameter after two steps: the loaded model's equal the unpermuted model's, mapped
    after_a, after_b = Path(tmp) / "after_a", Path(tmp) / "after_b"
    if rank == 0:
        after_a.mkdir()
        after_b.mkdir()
    dist.barrier()
    dist_checkpointing.save({"model": ref.sharded_state_dict()}, str(after_a))
    dist_checkpointing.save({"model": loaded.sharded_state_dict()}, str(after_b))
    dist.barrier()
    if rank == 0:
        a, b = _full_model_tensors(after_a), _full_model_tensors(after_b)
        want = _expected(a)
        diffs = {k: float((b[k] - v).abs().max()) for k, v in want.items()}
        result["param_max_diff"] = max(diffs.values())
        result["params_off"] = sorted(k for k, d in diffs.items() if d > 1e-6)
        result["mtp_experts_moved"] = not torch.equal(
            b["mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc1.weight"],
            a["mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc1.weight"],
        )
        result["keys"] = sorted(a)
        Path(out_path).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _spawned(rank: int, world: int, port: int, out_path: str, sharding: str, tmp: str) -> None:
    run(rank, world, port, out_path, sharding, tmp)


if __name__ == "__main__":
    import torch.multiprocessing as mp

    from tests.stacks.tiny import free_port

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_spawned, args=(EP, free_port(), sys.argv[1], sys.argv[2], tmp), nprocs=EP)
