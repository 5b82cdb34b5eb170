"""Replica dispatch on TorchTitan 0.3.0 over 4 CPU processes (gloo): one MoE layer with EP=2 x TP=2,
run by tests/stacks/test_replicas_stacks.py as ``python -m tests.stacks.replicas_titan_job OUT_DIR``.

As ``tests/stacks/titan_ep_job.py``: TorchTitan's own ``MoE`` (sigmoid scores, aux-loss-free bias,
group-limited top-2, ``AllToAllTokenDispatcher``, ``GroupedExperts``), sharded by
``set_moe_sharding_config(enable_ep=True)`` and ``Module.parallelize`` on ``ParallelDims(dp_shard=2,
tp=2, ep=2)`` with the ``full_dtensor`` backend.  ``ref`` has 8 experts; ``rep`` and ``skip`` have
8 + 2 slots (:data:`MAP`), the router still choosing among 8, each slot starting from its logical
expert's weights, with :func:`placement.consumers.replica_runtime.install_torchtitan_replicas`; ``rep`` sums
the replicas' gradients over the EP mesh (``reduce_grads``), ``skip`` does not.  Five SGD steps on
the same batches; each rank writes the losses and the largest differences of the input, router and
expert gradients and of the expert weights (slot ``p`` against logical expert ``MAP[p]``).

TorchTitan's ``GroupedExperts`` casts the weights to BF16 inside its forward (``w1_EFD.bfloat16()``),
so autograd hands each slot a BF16-rounded weight gradient: a replicated expert's gradient is the
sum of its slots' rounded parts instead of one rounding of the whole, and the two jobs agree to
BF16 precision (a few 2^-8 relative), not float32's.

Live re-plan, in the same launch: ``ref_m`` is ``ref`` with SGD momentum 0.9 (per-element optimizer
state); ``replan`` is ``rep`` with that optimizer, re-planned once after step ``REPLAN_AFTER``
(``InstalledReplicas.replan``, which runs :func:`placement.consumers.migrate.migrate` over the EP group) to
:data:`REPLAN`: each rank's redundant slot drops its replica and takes an expert of the other EP
rank, so the new replicas' weights (each TP shard) and momentum buffers come over the network.
``replan_skip`` is ``replan`` without the replicas' gradient sum.  Each step records the map it ran
under, and its gradients and weights are compared slot by slot with ``ref_m``'s logical experts.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

MAP = [0, 1, 2, 3, 5, 4, 5, 6, 7, 1]  # phy2log: 8 experts + 2 replicas, 5 slots per EP rank
REPLAN = [0, 1, 2, 3, 6, 4, 5, 6, 7, 2]  # after the live re-plan: each redundant slot takes the other rank's expert
REPLAN_AFTER = 1  # the re-plan runs at the boundary after this step
MODES = ("ref", "rep", "skip", "ref_m", "replan", "replan_skip", "replan_no_state")
LAYER = 1
STEPS = 5
EXPERT_PARAMS = ("w1_EFD", "w2_EDF", "w3_EFD")


def _moe(num_slots: int) -> Any:
    import torch
    from torchtitan.models.common.config_utils import make_moe_config, make_router_config
    from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
    from torchtitan.models.common.moe_sharding import set_moe_sharding_config
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher
    from torchtitan.models.deepseek_v3.sharding import _GROUPED_EXPERTS_PARAM_LAYOUT

    from tests.stacks.tiny import DIM, FFN, NUM_EXPERTS, TOP_K

    router = make_router_config(
        dim=DIM, num_experts=NUM_EXPERTS, gate_param_init={}, top_k=TOP_K, score_func="sigmoid", route_norm=True,
        route_scale=2.5, num_expert_groups=2, num_limited_groups=1,
    )
    experts = RoutedExperts.Config(
        inner_experts=GroupedExperts.Config(dim=DIM, hidden_dim=FFN, num_experts=num_slots),
        token_dispatcher=AllToAllTokenDispatcher.Config(num_experts=num_slots, top_k=TOP_K),
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

    return Model()


def _models() -> tuple[Any, Any]:
    import torch

    from tests.stacks.tiny import NUM_EXPERTS

    ref = _moe(NUM_EXPERTS)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in sorted(ref.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        ref.layers[str(LAYER)].moe.expert_bias_E.copy_(torch.randn(NUM_EXPERTS, generator=gen) * 0.05)
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    index = torch.as_tensor(MAP)
    for name in EXPERT_PARAMS:
        key = f"layers.{LAYER}.moe.routed_experts.inner_experts.{name}"
        state[key] = state[key][index]
    rep = _moe(len(MAP))
    rep.load_state_dict(state)
    return ref, rep


def _full(t: Any) -> Any:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def run(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.distributed import utils as dist_utils

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    parallel_dims.device_type = "cpu"  # type: ignore[attr-defined]
    dist_utils.set_spmd_backend("full_dtensor")
    dims = parallel_dims.ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, ep=2, world_size=world,
                                      spmd_backend="full_dtensor")
    dims.build_mesh()
    mesh = dims.get_optional_mesh(["dp_shard", "tp"])
    ep_mesh = dims.get_optional_mesh("ep")
    dp_rank = mesh.get_coordinate()[0]
    result = {"rank": rank, **_compare(mesh, ep_mesh, dims, dp_rank)}
    dist.barrier()
    dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def _replica_spread(model: Any, opt: Any, phy2log: list[int]) -> float:
    """Largest difference between two slots of one logical expert, over the expert weights and their
    momentum buffers (0.0 exactly when every replica is bit-identical to its expert's first slot)."""
    inner = model.layers[str(LAYER)].moe.routed_experts.inner_experts
    worst = 0.0
    for name in EXPERT_PARAMS:
        p = getattr(inner, name)
        tensors = [_full(p).detach()]
        buf = opt.state.get(p, {}).get("momentum_buffer")
        if buf is not None:
            tensors.append(_full(buf))
        for t in tensors:
            for e in set(phy2log):
                slots = [i for i, x in enumerate(phy2log) if x == e]
                for i in slots[1:]:
                    worst = max(worst, float((t[i] - t[slots[0]]).abs().max()))
    return worst


def _zero_moved_momentum(model: Any, opt: Any, old: list[int], new: list[int], ep_rank: int) -> None:
    """Zero the momentum rows of this rank's slots whose logical expert changed in the re-plan."""
    import torch

    per_rank = len(MAP) // 2
    inner = model.layers[str(LAYER)].moe.routed_experts.inner_experts
    with torch.no_grad():
        for name in EXPERT_PARAMS:
            buf = opt.state[getattr(inner, name)]["momentum_buffer"]
            local = buf.to_local() if hasattr(buf, "to_local") else buf
            for i in range(per_rank):
                if old[ep_rank * per_rank + i] != new[ep_rank * per_rank + i]:
                    local[i].zero_()


def _compare(mesh: Any, ep_mesh: Any, dims: Any, dp_rank: int) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from placement import replica_runtime as rr
    from tests.stacks.tiny import DIM, NUM_EXPERTS

    result: dict[str, Any] = {}
    try:
        runs: dict[str, dict[str, Any]] = {}
        for mode in MODES:
            ref, rep = _models()
            model = ref if mode.startswith("ref") else rep
            model.layers[str(LAYER)].moe.parallelize(dims)
            installed = None
            if not mode.startswith("ref"):
                installed = rr.install_torchtitan_replicas(model, {LAYER: MAP}, NUM_EXPERTS,
                                                           ep_rank=ep_mesh.get_local_rank(), ep=2)
            momentum = 0.9 if mode == "ref_m" or mode.startswith("replan") else 0.0
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum, foreach=False)
            out: dict[str, list[Any]] = {"losses": [], "grads": [], "weights": [], "maps": [], "spread": []}
            current = list(MAP) if installed is not None else list(range(NUM_EXPERTS))
            for step in range(STEPS):
                gen = torch.Generator().manual_seed(100 * step + dp_rank)  # each data-parallel rank its own batch
                x_local, y_local = torch.randn(2, 6, DIM, generator=gen), torch.randn(2, 6, DIM, generator=gen)
                x = DTensor.from_local(x_local, mesh, [Shard(0), Replicate()], run_check=False).requires_grad_(True)
                y = DTensor.from_local(y_local, mesh, [Shard(0), Replicate()], run_check=False)
                opt.zero_grad()
                loss = ((model.layers[str(LAYER)].moe(x) - y) ** 2).mean()
                loss.backward()
                if installed is not None and mode in ("rep", "replan", "replan_no_state"):
                    installed.reduce_grads(group=ep_mesh.get_group())
                grads = {n.rsplit(".", 1)[-1]: _full(p.grad).detach().clone() for n, p in model.named_parameters()}
                grads["input"] = _full(x.grad).detach().clone()
                opt.step()
                out["losses"].append(_full(loss).item())
                out["grads"].append(grads)
                out["maps"].append(list(current))
                out["weights"].append({n.rsplit(".", 1)[-1]: _full(p).detach().clone()
                                       for n, p in model.named_parameters() if n.rsplit(".", 1)[-1] in EXPERT_PARAMS})
                out["spread"].append(_replica_spread(model, opt, current))
                if installed is not None and mode.startswith("replan") and step == REPLAN_AFTER:
                    opt.zero_grad()
                    report = installed.replan({LAYER: REPLAN}, opt, group=ep_mesh.get_group())
                    old, current = current, [int(x) for x in installed.phy2log(LAYER)]
                    if mode == "replan_no_state":  # the moved slots' momentum lost: what migrate must avoid
                        _zero_moved_momentum(model, opt, old, current, ep_mesh.get_local_rank())
                    result[f"{mode}_report"] = {"moved_replicas": report.moved_replicas, "map": current,
                                                "received_bytes": report.received_bytes,
                                                "spread_after": _replica_spread(model, opt, current)}
            runs[mode] = out
        for mode, base in (("rep", "ref"), ("skip", "ref"), ("replan", "ref_m"), ("replan_skip", "ref_m"),
                           ("replan_no_state", "ref_m")):
            a, b = runs[base], runs[mode]
            loss = max(abs(u - v) for u, v in zip(a["losses"], b["losses"]))
            grad = weight = 0.0
            for ga, gb, m in zip(a["grads"], b["grads"], b["maps"]):
                index = torch.as_tensor(m)
                for key, want in ga.items():
                    got = gb[key]
                    want = want[index] if key in EXPERT_PARAMS else want
                    grad = max(grad, float((got - want).abs().max()))
            for wa, wb, m in zip(a["weights"], b["weights"], b["maps"]):
                index = torch.as_tensor(m)
                for key, want in wa.items():
                    weight = max(weight, float((wb[key] - want[index]).abs().max()))
            result[mode] = {"loss": loss, "grad": grad, "weight": weight, "replica_spread": max(b["spread"])}
        result["steps"] = len(runs["ref"]["losses"])
    except Exception as exc:  # recorded: the test shows it
        import traceback

        result["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"
    return result


def main(out_dir: str, world: int = 4) -> int:
    import multiprocessing
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torchtitan.models.common.moe  # noqa: F401  (imported before the fork)

    from tests.stacks.tiny import free_port

    torch.set_num_threads(1)
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
