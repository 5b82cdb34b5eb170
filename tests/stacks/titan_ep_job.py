"""TorchTitan 0.3.0 on 4 CPU processes (gloo): one MoE layer parallelized with EP=2 and TP=2.

Run by tests/stacks/test_runtime_titan.py as ``python -m tests.stacks.titan_ep_job OUT_DIR`` (hard
timeout): the process imports the stack once and forks one worker per rank, which writes
``OUT_DIR/rank{RANK}.json``.

Each worker builds TorchTitan's own ``MoE`` (sigmoid scores, aux-loss-free bias, group-limited
top-2 over 1 of 2 groups, ``AllToAllTokenDispatcher``), sets its sharding with TorchTitan's
``set_moe_sharding_config(enable_ep=True)`` (DeepSeek-V3's grouped-expert layout) and calls
``Module.parallelize`` on ``ParallelDims(dp_shard=2, tp=2, ep=2)`` with the ``full_dtensor``
backend, so ``routed_experts`` receives DTensors (ids sharded over batch and TP, counts as partial
sums).  The unplaced model and the placed one (its weights permuted in memory by
``apply_permutation(..., keep_router=True)`` before parallelizing, plus the hooks) see the same
input; the job records the loss difference, the input, router and expert gradient differences
(expert gradients gathered and permuted) and the aux-loss-free counters.  CPU-only detail: the
device mesh is built on ``cpu`` (TorchTitan picks ``cuda``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

MAP = [5, 0, 7, 2, 1, 6, 3, 4]  # phy2log, breaks both groups of 4
LAYER = 1


def _moe(seed: int, maps: dict | None):  # type: ignore[no-untyped-def]
    """``layers.{LAYER}.moe`` (a TorchTitan decoder's name) with seeded weights, permuted by ``maps``."""
    import torch
    from torchtitan.models.common.config_utils import make_moe_config, make_router_config
    from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
    from torchtitan.models.common.moe_sharding import set_moe_sharding_config
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher
    from torchtitan.models.deepseek_v3.sharding import _GROUPED_EXPERTS_PARAM_LAYOUT

    from placement.consumers import checkpoint as ck
    from tests.stacks.tiny import DIM, FFN, NUM_EXPERTS, TOP_K

    router = make_router_config(
        dim=DIM, num_experts=NUM_EXPERTS, gate_param_init={}, top_k=TOP_K, score_func="sigmoid", route_norm=True,
        route_scale=2.5, num_expert_groups=2, num_limited_groups=1,
    )
    experts = RoutedExperts.Config(
        inner_experts=GroupedExperts.Config(dim=DIM, hidden_dim=FFN, num_experts=NUM_EXPERTS),
        token_dispatcher=AllToAllTokenDispatcher.Config(num_experts=NUM_EXPERTS, top_k=TOP_K),
    )
    cfg = make_moe_config(num_experts=NUM_EXPERTS, router=router, routed_experts=experts)
    set_moe_sharding_config(cfg, enable_ep=True, enable_sp=False, expert_param_layout=_GROUPED_EXPERTS_PARAM_LAYOUT)

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.moe = cfg.build()

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleDict({str(LAYER): Block()})

    model = Model()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        moe = model.layers[str(LAYER)].moe
        moe.expert_bias_E.copy_(torch.randn(NUM_EXPERTS, generator=gen) * 0.05)
        moe.tokens_per_expert_E.zero_()
    if maps is not None:
        state = {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict(ck.apply_permutation(state, maps, stack="torchtitan", keep_router=True))
    return model


def run(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torchtitan.distributed import utils as dist_utils

    from placement.consumers import runtime as rt
    from tests.stacks.tiny import DIM

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    parallel_dims.device_type = "cpu"  # type: ignore[attr-defined]
    dist_utils.set_spmd_backend("full_dtensor")
    dims = parallel_dims.ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, ep=2, world_size=world,
                                      spmd_backend="full_dtensor")
    dims.build_mesh()
    mesh = dims.get_optional_mesh(["dp_shard", "tp"])
    dp_rank = mesh.get_coordinate()[0]
    result: dict = {"rank": rank, "dp_rank": dp_rank}
    try:
        unplaced, placed = _moe(0, None), _moe(0, {LAYER: MAP})
        for model in (unplaced, placed):
            model.layers[str(LAYER)].moe.parallelize(dims)
        installed = rt.install_torchtitan(placed, {LAYER: MAP})
        gen = torch.Generator().manual_seed(10 + dp_rank)  # each data-parallel rank its own batch
        x_local, y_local = torch.randn(2, 6, DIM, generator=gen), torch.randn(2, 6, DIM, generator=gen)
        losses, grads = [], []
        for model in (unplaced, placed):
            x = DTensor.from_local(x_local.clone(), mesh, [Shard(0), Replicate()], run_check=False).requires_grad_(True)
            y = DTensor.from_local(y_local, mesh, [Shard(0), Replicate()], run_check=False)
            loss = ((model.layers[str(LAYER)].moe(x) - y) ** 2).mean()
            loss.backward()
            losses.append(loss.full_tensor().item())
            named = {n: p.grad.full_tensor() for n, p in sorted(model.named_parameters())}
            named["input"] = x.grad.full_tensor()
            grads.append(named)
        result["loss"] = losses[0]
        result["loss_diff"] = abs(losses[0] - losses[1])
        prefix = f"layers.{LAYER}.moe."
        result["input_grad_max_diff"] = (grads[1]["input"] - grads[0]["input"]).abs().max().item()
        result["router_grad_max_diff"] = (grads[1][prefix + "router.gate.weight"] - grads[0][prefix + "router.gate.weight"]).abs().max().item()
        index = torch.as_tensor(MAP)
        diffs = []
        for name in ("w1_EFD", "w2_EDF", "w3_EFD"):
            key = f"{prefix}routed_experts.inner_experts.{name}"
            diffs.append((grads[1][key] - grads[0][key][index]).abs().max().item())
        result["expert_grad_max_diff"] = max(diffs)
        counts = [m.layers[str(LAYER)].moe.tokens_per_expert_E for m in (unplaced, placed)]
        counts = [c.full_tensor() if isinstance(c, DTensor) else c for c in counts]
        result["counts_equal"] = bool(torch.equal(counts[0], counts[1]))
        rt.remove(installed)
        y = DTensor.from_local(y_local, mesh, [Shard(0), Replicate()], run_check=False)
        x = DTensor.from_local(x_local.clone(), mesh, [Shard(0), Replicate()], run_check=False)
        with torch.no_grad():
            unhooked = ((placed.layers[str(LAYER)].moe(x) - y) ** 2).mean().full_tensor().item()
        result["unhooked_loss_diff"] = abs(unhooked - losses[0])
    except Exception as exc:  # recorded: the test shows it
        result["error"] = f"{type(exc).__name__}: {exc}"[:500]
    dist.barrier()
    dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def main(out_dir: str, world: int = 4) -> int:
    """Import once, fork ``world`` workers, wait for them; the exit code is the first failure's."""
    import multiprocessing

    import torch
    import torchtitan.models.common.moe  # noqa: F401  (imported before the fork)

    import placement.consumers.checkpoint  # noqa: F401
    from tests.stacks.tiny import free_port

    torch.set_num_threads(1)
    port = free_port()
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=run, args=(r, world, port, out_dir)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return next((p.exitcode for p in procs if p.exitcode), 0) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
