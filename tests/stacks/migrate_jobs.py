"""Multi-process training jobs on CPU with gloo (EP = world size) that migrate experts mid-training.

Run by tests/stacks/test_migrate_stacks.py as ``python -m tests.stacks.migrate_jobs STACK RANK
WORLD PORT OUT.json`` (one process per rank, a hard timeout); each rank writes its measurements
to ``OUT.json.rank{r}`` and the test compares them.  Everything that changes global state (the
process group, Megatron's CUDA patches) lives here.

Per stack, on the stack's own modules (Megatron-Core 0.16.1 ``GPTModel`` with ``SequentialMLP``
experts and the ``allgather`` dispatcher; TorchTitan 0.3.0 ``MoE`` with ``GroupedExperts`` and its
``AllToAllTokenDispatcher`` over a CPU device mesh), four runs from the same initial state:

- ``base``: STEPS training steps under the identity map, never migrating;
- ``moved``: the same, migrating to :data:`NEW_MAPS` after step MIGRATE_AT;
- ``interrupted``: a migration that fails on rank 1 before the switch (the received-buffer check
  raises), then training goes on;
- ``resumed``: the ``moved`` run checkpointed (model, optimizer, :func:`placement.consumers.migrate.map_state`)
  after the migration, loaded into a fresh model with other weights, continued.

Expert parameters are reported by *logical* expert (slot ``p`` holds ``phy2log[p]``), so runs
with different maps compare.  ``MIGRATE_SKIP_OPTIMIZER=1`` makes the migration move weights only
(a deliberately broken migration, to show the comparison catches it).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

STEPS, MIGRATE_AT = 5, 2
NUM_EXPERTS = 8
# phy2log after the migration, per MoE layer index of each stack (both cross EP ranks and local moves)
NEW_MAPS_BY_POSITION = ([4, 2, 1, 3, 0, 5, 7, 6], [7, 6, 5, 4, 3, 2, 1, 0])


def live_map(install: Any, model: Any, maps: dict[int, list[int]]) -> Any:
    """The live map :mod:`placement.consumers.runtime` installs (an ``InstalledMap``)."""
    return install(model, maps)


def _maybe_skip_optimizer() -> None:
    if os.environ.get("MIGRATE_SKIP_OPTIMIZER") == "1":
        from placement import migrate as mg

        real = mg._slot_fields

        def weights_only(stack: str, params: Any, states: Any) -> Any:
            fields, scalars = real(stack, params, states)
            return [f for f in fields if f.kind == "weights"], scalars

        mg._slot_fields = weights_only  # type: ignore[assignment]


# ---------------------------------------------------------------------------------------------
# The stacks: build, one training step, expert state by logical id, checkpoint
# ---------------------------------------------------------------------------------------------
class MegatronJob:
    layers = (0, 1)

    def __init__(self, rank: int, world: int) -> None:
        from megatron.core import parallel_state as ps

        from tests.stacks.tiny import install_cpu_patches

        install_cpu_patches()
        ps.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
        self.rank, self.world = rank, world
        self.group = ps.get_expert_model_parallel_group()

    def build(self, seed: int) -> tuple[Any, Any]:
        import torch
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer

        from tests.stacks.tiny import DIM, FFN, _megatron_gpt_model

        model = _megatron_gpt_model(
            seed, num_layers=2, hidden=DIM, heads=2, ffn=32, vocab=64, max_seq=16, num_moe_experts=NUM_EXPERTS,
            moe_router_topk=2, moe_ffn_hidden_size=FFN, moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True, moe_router_load_balancing_type="none", gated_linear_unit=True,
        )
        per_rank = NUM_EXPERTS // self.world
        with torch.no_grad():  # distinct experts per global slot, the same non-expert weights on every rank
            for layer in model.decoder.layers:
                for i, expert in enumerate(layer.mlp.experts.local_experts):
                    gen = torch.Generator().manual_seed(seed * 1000 + layer.layer_number * 100 + self.rank * per_rank + i)
                    for p in expert.parameters():
                        p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        group = {"params": list(model.parameters()), "wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False,
                 "is_decoupled_lr": False}
        adam = torch.optim.Adam([group], lr=1e-2)
        opt = FP32Optimizer.__new__(FP32Optimizer)  # as tests/stacks/megatron_job.py: no CUDA loss scale
        MegatronOptimizer.__init__(opt, adam, OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=0.0), lambda o: None)
        opt._scale = torch.tensor([1.0])
        return model, opt

    def install(self, model: Any, maps: dict[int, list[int]]) -> Any:
        from placement import runtime as rt

        return rt.install_megatron(model, maps)

    def step(self, model: Any, opt: Any, step: int) -> float:
        import torch
        import torch.distributed as dist

        from tests.stacks.tiny import megatron_batch

        tokens, pos, mask, labels = megatron_batch(step * 10 + self.rank)
        loss = model(tokens, pos, mask, labels=labels).float().mean()
        loss.backward()
        for name, p in model.named_parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if ".experts." not in name:  # data-parallel replicas: average; experts see every rank's tokens
                dist.all_reduce(p.grad)
                p.grad /= self.world
        opt.optimizer.step()
        opt.optimizer.zero_grad()
        out = torch.tensor([loss.item()])
        dist.all_reduce(out)
        return float(out.item()) / self.world

    def expert_tensors(self, model: Any, opt: Any, maps: Any) -> dict[str, Any]:
        """``{"layer/logical/param/kind": tensor}`` of this rank's slots (kind: w, exp_avg, exp_avg_sq)."""
        per_rank = NUM_EXPERTS // self.world
        out: dict[str, Any] = {}
        for layer in model.decoder.layers:
            li = int(layer.layer_number) - 1
            for i, expert in enumerate(layer.mlp.experts.local_experts):
                logical = int(maps.phy2log(li)[self.rank * per_rank + i])
                for n, p in expert.named_parameters():
                    out[f"{li}/{logical}/{n}/w"] = p.detach().clone()
                    for k, v in opt.optimizer.state.get(p, {}).items():
                        if v.dim():
                            out[f"{li}/{logical}/{n}/{k}"] = v.clone()
        return out

    def dense_tensors(self, model: Any) -> dict[str, Any]:
        return {n: p.detach().clone() for n, p in model.named_parameters() if ".experts." not in n}

    def optimizer_state(self, opt: Any) -> Any:
        return opt.optimizer.state_dict()

    def load_optimizer_state(self, opt: Any, state: Any) -> None:
        opt.optimizer.load_state_dict(state)


class TitanJob:
    layers = (1, 3)

    def __init__(self, rank: int, world: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torchtitan.distributed.utils import set_spmd_backend

        set_spmd_backend("dtensor")  # plain functional collectives (the spmd_types backend wants a typed mesh)
        self.mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
        self.rank, self.world = rank, world
        self.group = self.mesh.get_group()

    def build(self, seed: int) -> tuple[Any, Any]:
        import torch
        from torchtitan.models.common.config_utils import make_moe_config, make_router_config
        from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
        from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

        from tests.stacks.tiny import DIM, FFN

        per_rank = NUM_EXPERTS // self.world

        def moe(layer: int) -> Any:
            router = make_router_config(dim=DIM, num_experts=NUM_EXPERTS, gate_param_init={}, top_k=2,
                                        score_func="sigmoid", route_norm=True, route_scale=2.5)
            experts = RoutedExperts.Config(
                inner_experts=GroupedExperts.Config(dim=DIM, hidden_dim=FFN, num_experts=per_rank),
                token_dispatcher=AllToAllTokenDispatcher.Config(num_experts=NUM_EXPERTS, top_k=2),
            )
            m = make_moe_config(num_experts=NUM_EXPERTS, router=router, routed_experts=experts).build()
            m.routed_experts.token_dispatcher.wire_meshes(ep_mesh=self.mesh)
            gen = torch.Generator().manual_seed(seed * 100 + layer)
            with torch.no_grad():
                for name, p in sorted(m.named_parameters()):
                    full = torch.randn((NUM_EXPERTS,) + tuple(p.shape[1:]) if "inner_experts" in name else p.shape,
                                       generator=gen) * 0.3
                    p.copy_(full[self.rank * per_rank:(self.rank + 1) * per_rank] if "inner_experts" in name else full)
                m.expert_bias_E.zero_()
                m.tokens_per_expert_E.zero_()
            return m

        class Block(torch.nn.Module):
            def __init__(self, m: Any) -> None:
                super().__init__()
                self.moe = m

        class Model(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.layers = torch.nn.ModuleDict({str(k): Block(moe(k)) for k in TitanJob.layers})

            def forward(self, x: Any) -> Any:
                for k in TitanJob.layers:
                    x = x + self.layers[str(k)].moe(x)
                return x

        model = Model()
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)

    def install(self, model: Any, maps: dict[int, list[int]]) -> Any:
        from placement import runtime as rt

        return rt.install_torchtitan(model, maps)

    def step(self, model: Any, opt: Any, step: int) -> float:
        import torch
        import torch.distributed as dist

        from tests.stacks.tiny import DIM

        gen = torch.Generator().manual_seed(step * 10 + self.rank)
        x, y = torch.randn(2, 6, DIM, generator=gen), torch.randn(2, 6, DIM, generator=gen)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        for name, p in model.named_parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if "inner_experts" not in name:
                dist.all_reduce(p.grad)
                p.grad /= self.world
        opt.step()
        opt.zero_grad()
        out = torch.tensor([loss.item()])
        dist.all_reduce(out)
        return float(out.item()) / self.world

    def expert_tensors(self, model: Any, opt: Any, maps: Any) -> dict[str, Any]:
        per_rank = NUM_EXPERTS // self.world
        out: dict[str, Any] = {}
        for k in self.layers:
            inner = model.layers[str(k)].moe.routed_experts.inner_experts
            for w in ("w1_EFD", "w2_EDF", "w3_EFD"):
                p = getattr(inner, w)
                state = opt.state.get(p, {})
                for i in range(per_rank):
                    logical = int(maps.phy2log(k)[self.rank * per_rank + i])
                    out[f"{k}/{logical}/{w}/w"] = p.detach()[i].clone()
                    for name, v in state.items():
                        if v.dim():
                            out[f"{k}/{logical}/{w}/{name}"] = v[i].clone()
        return out

    def dense_tensors(self, model: Any) -> dict[str, Any]:
        return {n: p.detach().clone() for n, p in model.named_parameters() if "inner_experts" not in n}

    def optimizer_state(self, opt: Any) -> Any:
        return opt.state_dict()

    def load_optimizer_state(self, opt: Any, state: Any) -> None:
        opt.load_state_dict(state)


# ---------------------------------------------------------------------------------------------
# The runs
# ---------------------------------------------------------------------------------------------
def _gathered(job: Any, model: Any, opt: Any, maps: Any) -> dict[str, list[float]]:
    """Every rank's expert state by logical id plus the dense parameters, as flat lists."""
    import torch.distributed as dist

    mine = {k: v.reshape(-1).tolist() for k, v in job.expert_tensors(model, opt, maps).items()}
    parts: list[Any] = [None] * job.world
    dist.all_gather_object(parts, mine)
    out: dict[str, list[float]] = {}
    for part in parts:
        out.update(part)
    out.update({f"dense/{k}": v.reshape(-1).tolist() for k, v in job.dense_tensors(model).items()})
    return out


def _base_instance(path: Path, world: int) -> None:
    """The job's instance file: 8 experts, top-2, MoE layers 0 and 1, EP = DP = world, one GPU per
    domain (every move crosses racks)."""
    import dataclasses

    import numpy as np

    from placement.api import save_instance
    from tests.conftest import random_instance

    inst = random_instance(np.random.default_rng(0), num_experts=NUM_EXPERTS, top_k=2, ep=world, dp=world, pp=1,
                           num_domains=world, trays_per_domain=1, gpus_per_tray=1, moe_layers=2)
    save_instance(dataclasses.replace(inst, name="migrate-job"), path)


def controller_run(job: Any, rank: int, folder: Path) -> dict[str, Any]:
    """Train under a :class:`placement.plan.controller.ReplacementController` (a cycle every 4 steps,
    recording 2) until its first decision; report it and the state after it."""
    import numpy as np
    import torch.distributed as dist

    from placement.plan.controller import ReplacementController
    from placement.core.model import Placement
    from solvers.default import default_rank2gpu

    base = folder / "instance.json"
    if rank == 0:
        _base_instance(base, job.world)
    dist.barrier()
    from placement.formats import read_instance

    inst = read_instance(base)
    model, opt = job.build(7)
    identity = {k: list(range(NUM_EXPERTS)) for k in job.layers}
    live = live_map(job.install, model, identity)
    placement = Placement(default_rank2gpu(inst), np.tile(np.arange(NUM_EXPERTS), (2, 1)))
    ctl = ReplacementController(model, opt, live, placement=placement, base=base, stack="megatron",
                                work_dir=folder / "controller", rank=rank, every_steps=4, record_steps=2,
                                time_limit_s=10.0, grace_s=60.0, payback_within_steps=1e9, group=job.group)
    entry = None
    step = 0
    while entry is None and step < 3000:
        job.step(model, opt, 0)  # the same batch every step: the held-out window routes as the recorded one
        entry = ctl.after_step(step)
        step += 1
        if entry is None and ctl._pending is not None:
            time.sleep(0.02)
    ctl.close()
    return {"entry": entry.to_dict() if entry else None, "expert_params": ctl.expert_params,
            "live_maps": {str(k): [int(x) for x in live.phy2log(k)] for k in job.layers},
            "log_lines": (folder / "controller" / "controller.jsonl").read_text().splitlines() if rank == 0 else []}


def run(stack: str, rank: int, world: int, port: int, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # the ranks share the machine's cores
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    job: Any = MegatronJob(rank, world) if stack == "megatron" else TitanJob(rank, world)
    _maybe_skip_optimizer()
    from placement import migrate as mg

    identity = {k: list(range(NUM_EXPERTS)) for k in job.layers}
    new_maps = {k: list(m) for k, m in zip(job.layers, NEW_MAPS_BY_POSITION)}
    result: dict[str, Any] = {"stack": stack, "layers": list(job.layers), "new_maps": new_maps}

    def train(name: str, *, migrate_to: dict | None = None, fail: bool = False) -> tuple[Any, Any, Any, list[float]]:
        model, opt = job.build(7)
        live = live_map(job.install, model, identity)
        losses = []
        for step in range(STEPS):
            losses.append(job.step(model, opt, step))
            if step == MIGRATE_AT and migrate_to is not None:
                before = job.expert_tensors(model, opt, live)
                if fail:  # first the ranks disagree on the new maps: refused before anything moves
                    other = {k: (list(reversed(v)) if rank == 1 else v) for k, v in migrate_to.items()}
                    try:
                        mg.migrate(model, opt, other, live_map=live, group=job.group)
                    except mg.MigrationError as e:
                        result["disagree_error"] = str(e)
                real_check = mg._check_received
                if fail and rank == 1:
                    def broken(buffers: Any) -> None:
                        raise mg.MigrationError("injected: rank 1's received buffers fail their check")
                    mg._check_received = broken  # type: ignore[assignment]
                try:
                    rep = mg.migrate(model, opt, migrate_to, live_map=live, group=job.group)
                    result[f"{name}_report"] = rep.to_dict()
                except mg.MigrationError as e:
                    result[f"{name}_error"] = str(e)
                finally:
                    mg._check_received = real_check  # type: ignore[assignment]
                after = job.expert_tensors(model, opt, live)
                result[f"{name}_unchanged_after_failure"] = bool(
                    fail and all(torch.equal(before[k], after[k]) for k in before)
                    and all(live.phy2log(k).tolist() == list(range(NUM_EXPERTS)) for k in job.layers))
        return model, opt, live, losses

    t0 = time.perf_counter()
    model, opt, live, losses = train("base")
    result["base_losses"], result["base_state"] = losses, _gathered(job, model, opt, live)
    model, opt, live, losses = train("moved", migrate_to=new_maps)
    result["moved_losses"], result["moved_state"] = losses, _gathered(job, model, opt, live)
    result["moved_live_maps"] = {str(k): [int(x) for x in live.phy2log(k)] for k in job.layers}
    result["live_map_type"] = type(live).__name__
    # checkpoint after the migration (model, optimizer, the live map), then resume in a fresh model
    with tempfile.TemporaryDirectory() as tmp:
        ck = Path(tmp) / f"rank{rank}.pt"
        current = live.maps()
        torch.save({"model": {k: v for k, v in model.state_dict().items() if "_extra_state" not in k},
                    "optimizer": job.optimizer_state(opt), "expert_map": mg.map_state(current)}, ck)
        mg.save_map(Path(tmp) / f"expert_map.rank{rank}.json", current)
        result["continued_losses"] = [job.step(model, opt, step) for step in range(STEPS, STEPS + 2)]
        result["continued_state"] = _gathered(job, model, opt, live)
        fresh, fopt = job.build(99)  # other weights: everything comes from the checkpoint
        saved = torch.load(ck, weights_only=False)
        fresh.load_state_dict(saved["model"], strict=False)
        job.load_optimizer_state(fopt, saved["optimizer"])
        maps = mg.maps_from_state(saved["expert_map"])
        sidecar = mg.load_map(Path(tmp) / f"expert_map.rank{rank}.json")
        result["sidecar_equal"] = {k: v.tolist() for k, v in maps.items()} == {k: v.tolist() for k, v in sidecar.items()}
        flive = live_map(job.install, fresh, {k: v.tolist() for k, v in maps.items()})
        result["resumed_losses"] = [job.step(fresh, fopt, step) for step in range(STEPS, STEPS + 2)]
        result["resumed_state"] = _gathered(job, fresh, fopt, flive)
    model, opt, live, losses = train("interrupted", migrate_to=new_maps, fail=True)
    result["interrupted_losses"], result["interrupted_state"] = losses, _gathered(job, model, opt, live)
    if stack == "megatron":
        result["controller"] = controller_run(job, rank, Path(out_path).parent)
    result["elapsed_s"] = time.perf_counter() - t0
    Path(f"{out_path}.rank{rank}").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    run(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
