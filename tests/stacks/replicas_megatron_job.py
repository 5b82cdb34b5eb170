"""Replica dispatch on Megatron-Core 0.16.1 over 4 CPU processes (gloo), run by
tests/stacks/test_replicas_stacks.py as ``python -m tests.stacks.replicas_megatron_job OUT_DIR``.

Two layouts, each with the ``alltoall`` dispatcher, ``SequentialMLP`` experts, Megatron's
``DistributedDataParallel`` (``overlap_grad_reduce=False``) and ``get_megatron_optimizer`` (Adam):

- ``ep4``: TP1 PP1 EP4 (DP4), the plain optimizer; 8 experts + 4 redundant slots (3 per rank);
- ``ep2_edp2``: EP2 x expert-DP 2, the ``DistributedOptimizer``; 8 experts + 2 slots (5 per rank).

Per layout three jobs of five steps on the same batches: ``ref`` (8 experts, no replicas), ``rep``
(the replica model: expert slot ``p`` starts from logical expert ``phy2log[p]``'s weights, the
dense and router weights copied from ``ref``, :func:`placement.consumers.replica_runtime.install_megatron_replicas`,
``reduce_grads`` before ``finish_grad_sync``) and ``skip`` (the same without ``reduce_grads``).
Live re-plans, :meth:`~placement.consumers.replica_runtime.InstalledReplicas.replan` (``placement.consumers.migrate``):

- ``ep4/replan``: ``rep`` whose redundant slots take other experts after step ``REPLAN_AT``
  (``REPLAN``, weights and Adam state moved); ``ep4/replan_no_state``: the same, then the moved
  slots' Adam moments zeroed (a replica created with fresh optimizer state);
- ``ep2_edp2/replan``: ``rep`` under :class:`placement.plan.controller.ReplicaController` (``hottest``,
  a re-plan every 2 steps from the last step's routing counts, so after steps 1 and 3), moving
  the DistributedOptimizer's shards; ``ep2_edp2/replan_skip``: the same without ``reduce_grads``;
  ``ep2_edp2/replan_no_state``: the same as ``replan``, then the moved slots' shards of the Adam
  moments zeroed.

Each rank writes per job and step the mean loss, every expert gradient by logical expert before the DP
reduction (the replica job's slots after the replica sum) and every expert weight by logical
expert after the step, gathered from all ranks, to ``OUT_DIR/rank{RANK}.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

STEPS = 5
NUM_LAYERS = 2
# phy2log per layout and layer (slot p on EP rank p // slots_per_rank); the base 8 experts stay in
# Megatron's order (rank r's first slots hold its contiguous experts), replicas go on other ranks
MAPS = {
    "ep4": {0: [0, 1, 5, 2, 3, 0, 4, 5, 1, 6, 7, 4], 1: [0, 1, 7, 2, 3, 6, 4, 5, 2, 6, 7, 0]},
    "ep2_edp2": {0: [0, 1, 2, 3, 5, 4, 5, 6, 7, 1], 1: [0, 1, 2, 3, 6, 4, 5, 6, 7, 2]},
}
EP = {"ep4": 4, "ep2_edp2": 2}
# the live re-plan (ep4, after step REPLAN_AT): other experts in the redundant slots (each rank's 3rd)
REPLAN_AT = 1
REPLAN = {0: [0, 1, 6, 2, 3, 7, 4, 5, 0, 6, 7, 2], 1: [0, 1, 4, 2, 3, 5, 4, 5, 1, 6, 7, 3]}
# ep2_edp2's controller: a re-plan every CONTROL_EVERY steps from the last CONTROL_WINDOW steps' routing
CONTROL_EVERY, CONTROL_WINDOW = 2, 1


def _gpt(seed: int, num_experts: int, ep: int) -> Any:
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from tests.stacks.tiny import DIM, FFN, TOP_K

    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=NUM_LAYERS, hidden_size=DIM, num_attention_heads=2, ffn_hidden_size=32,
        num_moe_experts=num_experts, moe_router_topk=TOP_K, moe_ffn_hidden_size=FFN,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_load_balancing_type="none", gated_linear_unit=True, expert_model_parallel_size=ep,
        moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.0, use_cpu_initialization=True,
        params_dtype=torch.float32, bf16=False, fp16=False, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0,
    )
    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=16,
                    position_embedding_type="learned_absolute")


def _expert_init(layer: int, logical: int, shape: Any) -> Any:
    import torch

    gen = torch.Generator().manual_seed(1000 + 100 * layer + logical)
    return torch.randn(shape, generator=gen) * 0.2


def _build(layout: str, replicas: bool) -> tuple[Any, Any, Any, Any]:
    """(model, ddp, optimizer, installed replicas or None); expert slot weights by logical expert."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from placement import replica_runtime as rr
    from tests.stacks.tiny import NUM_EXPERTS

    ep, maps = EP[layout], MAPS[layout]
    ref = _gpt(7, NUM_EXPERTS, ep)
    installed = None
    if replicas:
        model = _gpt(8, len(maps[0]), ep)
        installed = rr.install_megatron_replicas(model, maps, NUM_EXPERTS)
        dense = {k: v for k, v in ref.state_dict().items() if ".experts." not in k and "_extra_state" not in k}
        model.load_state_dict(dense, strict=False)
    else:
        model = ref
    ep_rank = ps.get_expert_model_parallel_rank()
    with torch.no_grad():
        for layer in model.decoder.layers:
            li = int(layer.layer_number) - 1
            per_rank = len(layer.mlp.experts.local_experts)
            for i, expert in enumerate(layer.mlp.experts.local_experts):
                slot = ep_rank * per_rank + i
                logical = maps[li][slot] if replicas else slot
                for n, p in sorted(expert.named_parameters()):
                    p.copy_(_expert_init(li, logical, p.shape))
    sharded = layout == "ep2_edp2"
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=sharded, overlap_grad_reduce=False, bucket_size=1000), model)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=sharded, clip_grad=0.0), [ddp])
    return model, ddp, opt, installed


def _by_logical(model: Any, maps: dict, replicas: bool, grads: bool) -> dict[str, list[list[float]]]:
    """``{layer/logical/param: [values of every slot holding it]}`` gathered from every rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ep_rank = ps.get_expert_model_parallel_rank()
    mine: dict[str, list[Any]] = {}
    if ps.get_expert_data_parallel_rank() == 0:  # one expert-DP copy of each slot
        for layer in model.decoder.layers:
            li = int(layer.layer_number) - 1
            per_rank = len(layer.mlp.experts.local_experts)
            for i, expert in enumerate(layer.mlp.experts.local_experts):
                slot = ep_rank * per_rank + i
                logical = maps[li][slot] if replicas else slot
                for n, p in sorted(expert.named_parameters()):
                    t = p.main_grad if grads else p.detach()
                    mine.setdefault(f"{li}/{logical}/{n}", []).append(t.reshape(-1).tolist())
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    out: dict[str, list[list[float]]] = {}
    for part in every:
        for k, v in part.items():
            out.setdefault(k, []).extend(v)
    return out


def _dense_grads(model: Any) -> dict[str, list[float]]:
    return {n: p.main_grad.reshape(-1).tolist() for n, p in model.named_parameters()
            if ".experts." not in n and p.requires_grad}


def _forget_state(model: Any, opt: Any, before: dict, after: dict) -> int:
    """Zero the Adam moments (this rank's part: the whole tensor, or its DistributedOptimizer shard)
    of every local slot whose logical expert changed; the wrong re-plan the tests must catch.
    Returns the tensors zeroed."""
    from megatron.core import parallel_state as ps

    from placement import migrate as mg

    ep_rank = ps.get_expert_model_parallel_rank()
    states, dopts = mg._optimizer_states(opt), mg._distributed_optimizers(opt)
    zeroed = 0
    for layer in model.decoder.layers:
        li = int(layer.layer_number) - 1
        per_rank = len(layer.mlp.experts.local_experts)
        for i, expert in enumerate(layer.mlp.experts.local_experts):
            slot = ep_rank * per_rank + i
            if before[li][slot] == after[li][slot]:
                continue
            params = [(n, p, None) for n, p in expert.named_parameters()]
            fields, _ = mg._slot_fields("megatron", params, states)
            shards, _ = mg._shard_fields(params, dopts)
            tensors = [f.view() for f in fields if f.kind == "optimizer"]
            tensors += [t for sh in shards for kind, _n, t in sh.tensors if kind == "optimizer"]
            for t in tensors:
                t.zero_()
            zeroed += len(tensors)
    return zeroed


def job(layout: str, mode: str, rank: int) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from tests.stacks.tiny import megatron_batch

    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=EP[layout])
    from placement.plan.controller import ReplicaController

    model, ddp, opt, installed = _build(layout, mode != "ref")
    maps = dict(MAPS[layout])
    out: dict[str, Any] = {"losses": [], "expert_grads": [], "dense_grads": [], "weights": [], "replans": [],
                           "zeroed": 0}
    control = None
    if installed is not None and layout == "ep2_edp2" and mode.startswith("replan"):
        control = ReplicaController(installed, opt, rule="hottest", every_steps=CONTROL_EVERY,
                                    window_steps=CONTROL_WINDOW)
    for step in range(STEPS):
        tokens, pos, mask, labels = megatron_batch(step * 10 + rank)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = ddp(tokens, pos, mask, labels=labels).float().mean()
        loss.backward()
        if installed is not None and mode not in ("skip", "replan_skip"):
            installed.reduce_grads()
        out["expert_grads"].append(_by_logical(model, maps, mode != "ref", grads=True))
        out["dense_grads"].append(_dense_grads(model))
        ddp.finish_grad_sync()
        opt.step()
        total = torch.tensor([loss.item()])
        dist.all_reduce(total)
        out["losses"].append(float(total.item()) / dist.get_world_size())
        out["weights"].append(_by_logical(model, maps, mode != "ref", grads=False))
        if installed is not None and mode.startswith("replan"):
            before = {k: list(v) for k, v in maps.items()}
            if control is not None:
                entry = control.after_step(step)
                if entry is not None:
                    out["replans"].append({k: entry[k] for k in ("step", "decision", "loads", "maps", "changed")})
            elif step == REPLAN_AT:
                report = installed.replan(REPLAN, opt)
                live = {li: installed.phy2log(li).tolist() for li in installed.layers}
                out["replans"].append({"step": step, "decision": "applied", "maps": live,
                                       "changed": sorted(li for li in live if live[li] != before[li]),
                                       "moved_replicas": report.moved_replicas_per_layer})
            maps = {li: installed.phy2log(li).tolist() for li in installed.layers}
            if mode == "replan_no_state":
                out["zeroed"] += _forget_state(model, opt, before, maps)
    if installed is not None:
        installed.remove()
    ps.destroy_model_parallel()
    return out


def run(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result: dict[str, Any] = {}
    for layout in ("ep4", "ep2_edp2"):
        replans = ("replan", "replan_no_state") + (("replan_skip",) if layout == "ep2_edp2" else ())
        for mode in ("ref", "rep", "skip") + replans:
            try:
                result[f"{layout}/{mode}"] = job(layout, mode, rank)
            except Exception as exc:  # recorded: the test names the job that failed
                import traceback

                result[f"{layout}/{mode}_error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"
                from megatron.core import parallel_state as ps

                ps.destroy_model_parallel()
    dist.barrier()
    dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def main(out_dir: str, world: int = 4) -> int:
    import multiprocessing
    import warnings

    warnings.filterwarnings("ignore")
    import megatron.core.models.gpt  # noqa: F401  (imported before the fork)
    import torch

    from tests.stacks.megatron_cpu_optim import install_optimizer_cpu_patches
    from tests.stacks.megatron_ep_job import _install_alltoall_patches
    from tests.stacks.tiny import free_port, install_cpu_patches

    torch.set_num_threads(1)
    install_cpu_patches()
    install_optimizer_cpu_patches()
    _install_alltoall_patches()
    port = free_port()  # never an inherited MASTER_PORT
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=run, args=(r, world, port, out_dir)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return next((p.exitcode for p in procs if p.exitcode), 0) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
