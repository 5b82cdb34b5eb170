"""Live expert migration under Megatron-Core 0.16.1's ``DistributedOptimizer``: 4 gloo processes,
EP = 2, expert data parallel = 2 (each expert's FP32 main-parameter shard and Adam moments are
split over two ranks), run by tests/stacks/test_migrate_stacks.py as ``python -m
tests.stacks.migrate_dist_job RANK WORLD PORT OUT.json DTYPES`` (``fp32,bf16``: the model
parameters' types, one after the other; with ``bf16`` (Megatron's ``Float16Module``) the optimizer
keeps FP32 main shards apart from them, with ``fp32`` the main shards are views of the weights).

Each rank builds the same ``GPTModel`` (``SequentialMLP`` experts, the ``allgather`` dispatcher),
wraps it in Megatron's ``DistributedDataParallel`` (small buckets with ``overlap_grad_reduce``, so
bucket shard boundaries cut through expert parameters) and ``get_megatron_optimizer``
(``ChainedOptimizer`` of a dense and an expert ``DistributedOptimizer`` over torch Adam), and
trains twice from the same state: ``base`` never migrates, ``moved`` migrates to
:data:`tests.stacks.migrate_jobs.NEW_MAPS_BY_POSITION` after step MIGRATE_AT.  Rank r writes the
losses, every expert's weights, FP32 main parameters and Adam moments by *logical* expert
(shards gathered over the expert-DP ranks) and the dense weights, per type, to ``OUT.json.rank{r}``.
``MIGRATE_SKIP_OPTIMIZER=1`` moves the weights only (a deliberately broken migration).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from tests.stacks.migrate_jobs import MIGRATE_AT, NEW_MAPS_BY_POSITION, NUM_EXPERTS, STEPS

EP = 2
LAYERS = (0, 1)
BUCKET_NUMEL = 1000  # elements per DDP bucket: each bucket's DP halves cut through parameters


def _maybe_skip_optimizer() -> None:
    """``MIGRATE_SKIP_OPTIMIZER=1``: weights only, neither the slots' master copies and optimizer
    state (as tests/stacks/migrate_jobs.py) nor the distributed optimizer's shards."""
    from tests.stacks import migrate_jobs

    migrate_jobs._maybe_skip_optimizer()
    if os.environ.get("MIGRATE_SKIP_OPTIMIZER") == "1":
        from placement import migrate as mg

        real = mg._shard_fields

        def no_state(params: Any, dopts: Any) -> Any:
            shards, scalars = real(params, dopts)
            for s in shards:
                s.tensors = []
            return shards, scalars

        mg._shard_fields = no_state  # type: ignore[assignment]


def _gpt(seed: int, bf16: bool) -> Any:
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from tests.stacks.tiny import DIM, FFN, cpu_patches

    torch.manual_seed(seed)
    with cpu_patches():
        config = TransformerConfig(
            num_layers=len(LAYERS), hidden_size=DIM, num_attention_heads=2, ffn_hidden_size=32,
            num_moe_experts=NUM_EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=FFN,
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            moe_router_load_balancing_type="none", gated_linear_unit=True, expert_model_parallel_size=EP,
            moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0, use_cpu_initialization=True,
            params_dtype=torch.float32, bf16=bf16, fp16=False, add_bias_linear=False,
            hidden_dropout=0.0, attention_dropout=0.0,
        )
        spec = get_gpt_layer_local_spec(num_experts=NUM_EXPERTS, moe_grouped_gemm=False)
        return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=16,
                        position_embedding_type="learned_absolute")


def _build(seed: int, rank: int, world: int, bf16: bool, sharded: bool = True) -> tuple[Any, Any, Any]:
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core import parallel_state as ps

    model = _gpt(seed, bf16)
    per_rank = NUM_EXPERTS // EP
    ep_rank = ps.get_expert_model_parallel_rank()
    with torch.no_grad():  # distinct experts per global slot, the same non-expert weights on every rank
        for layer in model.decoder.layers:
            for i, expert in enumerate(layer.mlp.experts.local_experts):
                gen = torch.Generator().manual_seed(seed * 1000 + layer.layer_number * 100 + ep_rank * per_rank + i)
                for p in expert.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    if bf16:  # as Megatron's training loop: BF16 parameters, inputs cast on the way in
        from megatron.core.transformer.module import Float16Module

        wrapped: Any = Float16Module(model.config, model)
    else:
        wrapped = model
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=sharded, overlap_grad_reduce=True, bucket_size=BUCKET_NUMEL), wrapped)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=sharded, clip_grad=0.0, bf16=bf16),
        [ddp])
    return model, ddp, opt


def _step(ddp: Any, opt: Any, step: int, rank: int, world: int) -> float:
    import torch
    import torch.distributed as dist

    from tests.stacks.tiny import cpu_patches, megatron_batch

    tokens, pos, mask, labels = megatron_batch(step * 10 + rank)
    ddp.zero_grad_buffer()
    opt.zero_grad()
    with cpu_patches():
        loss = ddp(tokens, pos, mask, labels=labels).float().mean()
        loss.backward()
        ddp.finish_grad_sync()
        opt.step()
    out = torch.tensor([loss.item()])
    dist.all_reduce(out)
    return float(out.item()) / world


def _state(model: Any, opt: Any, live: Any) -> dict[str, list[float]]:
    """Every expert's weights and (whole, gathered from the shards) FP32 main parameter and Adam
    moments by logical id, and the dense weights; the same dict on every rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    per_rank = NUM_EXPERTS // EP
    ep_rank = ps.get_expert_model_parallel_rank()
    dopts = [o for o in opt.chained_optimizers if hasattr(o, "model_param_group_index_map")]
    mine: dict[str, Any] = {}
    for layer in model.decoder.layers:
        li = int(layer.layer_number) - 1
        for i, expert in enumerate(layer.mlp.experts.local_experts):
            logical = int(live.phy2log(li)[ep_rank * per_rank + i])
            for n, p in expert.named_parameters():
                mine[f"{li}/{logical}/{n}/w"] = (0, p.numel(), p.detach().reshape(-1).tolist())
                master = getattr(p, "main_param", None)
                if not dopts and master is not None:  # Float16OptimizerWithFloat16Params: whole FP32 copies
                    state = next(o.optimizer.state[master] for o in opt.chained_optimizers
                                 if master in o.optimizer.state)
                    parts = {"main": master, **{k: v for k, v in state.items() if v.dim()}}
                    for k, v in parts.items():
                        mine[f"{li}/{logical}/{n}/{k}@0"] = (0, p.numel(), v.reshape(-1).tolist())
                for d in dopts:
                    if p not in d.model_param_group_index_map:
                        continue
                    rng = d._get_model_param_range_map(p)["param"]
                    gi, order = d.model_param_group_index_map[p]
                    main = d.optimizer.param_groups[gi]["params"][order]
                    parts = {"main": main, **{k: v for k, v in d.optimizer.state[main].items() if v.dim()}}
                    for k, v in parts.items():
                        mine[f"{li}/{logical}/{n}/{k}@{rng.start}"] = (rng.start, p.numel(), v.reshape(-1).tolist())
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    out: dict[str, list[float]] = {}
    for part in every:
        for key, (start, numel, values) in part.items():
            name = key.split("@")[0]
            full = out.setdefault(name, [float("nan")] * numel)
            full[start:start + len(values)] = values
    for n, p in model.named_parameters():
        if ".experts." not in n:
            out[f"dense/{n}"] = p.detach().reshape(-1).tolist()
    return out


def run(rank: int, world: int, port: int, out_path: str, dtypes: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps

    from tests.stacks.megatron_cpu_optim import install_optimizer_cpu_patches
    from tests.stacks.tiny import install_cpu_patches

    install_cpu_patches()
    install_optimizer_cpu_patches()
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=EP)
    _maybe_skip_optimizer()
    from placement import migrate as mg
    from placement import runtime as rt

    identity = {k: list(range(NUM_EXPERTS)) for k in LAYERS}
    new_maps = {k: list(m) for k, m in zip(LAYERS, NEW_MAPS_BY_POSITION)}
    results: dict[str, Any] = {}
    for dtype in dtypes.split(","):
        result: dict[str, Any] = {"dtype": dtype, "layers": list(LAYERS), "new_maps": new_maps,
                                  "expert_dp": ps.get_expert_data_parallel_world_size()}
        t0 = time.perf_counter()
        for name in ("base", "moved", "interrupted"):
            model, ddp, opt = _build(7, rank, world, dtype.startswith("bf16"), dtype != "bf16-float16opt")
            live = rt.install_megatron(model, identity)
            losses = []
            for step in range(STEPS):
                losses.append(_step(ddp, opt, step, rank, world))
                if step == MIGRATE_AT and name == "moved":
                    result["report"] = mg.migrate(model, opt, new_maps, live_map=live).to_dict()
                if step == MIGRATE_AT and name == "interrupted":  # rank world-1 fails after the transfer
                    before = _state(model, opt, live)
                    real_check = mg._check_received
                    if rank == world - 1:
                        def broken(buffers: Any) -> None:
                            raise mg.MigrationError("injected: the last rank's received buffers fail their check")
                        mg._check_received = broken  # type: ignore[assignment]
                    try:
                        mg.migrate(model, opt, new_maps, live_map=live)
                    except mg.MigrationError as e:
                        result["interrupted_error"] = str(e)
                    finally:
                        mg._check_received = real_check  # type: ignore[assignment]
                    result["interrupted_unchanged"] = _state(model, opt, live) == before and all(
                        live.phy2log(k).tolist() == identity[k] for k in LAYERS)
            result[f"{name}_losses"], result[f"{name}_state"] = losses, _state(model, opt, live)
            if name == "base":  # where the shard boundaries fall: (bucket, DP rank) -> param range, per expert param
                buffers = [b for o in opt.chained_optimizers for b in getattr(o, "buffers", [])]
                layouts = []
                for layer in model.decoder.layers:
                    for expert in layer.mlp.experts.local_experts:
                        for p in expert.parameters():
                            layouts += [mg._dp_layout(b, p) for b in buffers if p in b.param_index_map]
                result["layouts"] = layouts
        result["elapsed_s"] = time.perf_counter() - t0
        results[dtype] = result
    Path(f"{out_path}.rank{rank}").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    run(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
