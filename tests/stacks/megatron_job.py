"""Megatron-Core 0.16.1 on CPU, in a child process: save -> permute -> load, and the runtime map.

Run by tests/stacks/test_megatron.py as ``python -m tests.stacks.megatron_job OUT.json`` with a
hard timeout (``dist_checkpointing.save`` forks a writer and hangs without psutil); everything
that changes global state (the gloo group, the CUDA patches) lives here, under ``__main__``.
Writes a JSON of measured differences; the test asserts on them.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path


def run(out_path: str) -> None:
    import torch

    from tests.stacks.tiny import (
        GROUP_PRESERVING, NON_GROUP_PRESERVING, NUM_EXPERTS, free_port, init_megatron_world, install_cpu_patches,
        megatron_batch, megatron_gpt,
    )

    install_cpu_patches()
    init_megatron_world(free_port())
    from megatron.core import dist_checkpointing
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer

    from placement import checkpoint as ck
    from placement import runtime as rt
    from placement.core.permutation import PERMUTATION_KIND, PERMUTATION_VERSION

    def loss_of(model, seed):
        tokens, pos, mask, labels = megatron_batch(seed)
        return model(tokens, pos, mask, labels=labels).float().mean()

    def make_opt(model):
        # one param group tagged as megatron.core.optimizer's _get_param_groups tags them
        group = {"params": list(model.parameters()), "wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False,
                 "is_decoupled_lr": False}
        adam = torch.optim.Adam([group], lr=1e-2)
        # FP32Optimizer.__init__ only adds a loss-scale tensor on 'cuda'; its base init, its
        # sharded_state_dict and load_state_dict are what is exercised here
        opt = FP32Optimizer.__new__(FP32Optimizer)
        MegatronOptimizer.__init__(opt, adam, OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=0.0), lambda o: None)
        opt._scale = torch.tensor([1.0])
        return opt

    def step(model, opt, seed):
        loss_of(model, seed).backward()
        opt.optimizer.step()
        opt.optimizer.zero_grad()

    def state(model, opt):
        msd = model.sharded_state_dict()
        return {"model": msd, "optimizer": opt.sharded_state_dict(msd)}

    result: dict = {}
    model = megatron_gpt(0)
    opt = make_opt(model)
    step(model, opt, 1)  # Adam moments exist and differ per expert
    layers = {0: GROUP_PRESERVING, 1: GROUP_PRESERVING[::-1][4:] + GROUP_PRESERVING[::-1][:4]}
    doc = {"kind": PERMUTATION_KIND, "version": PERMUTATION_VERSION, "stack": "megatron", "num_experts": NUM_EXPERTS,
           "num_groups": 2, "group_limited": True, "layers": {str(k): v for k, v in layers.items()}}
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "src", Path(tmp) / "dst"
        src.mkdir()
        dist_checkpointing.save(state(model, opt), str(src))
        changed = ck.permute_dcp(src, dst, doc, stack="megatron")
        result["changed"] = changed
        loaded = megatron_gpt(123)
        lopt = make_opt(loaded)
        step(loaded, lopt, 5)  # materialise optimizer state to load into
        sd = dist_checkpointing.load(state(loaded, lopt), str(dst))
        loaded.load_state_dict(sd["model"])
        lopt.load_state_dict(sd["optimizer"])
    with torch.no_grad():
        result["loss_diff"] = abs(loss_of(loaded, 7).item() - loss_of(model, 7).item())
        result["loss"] = loss_of(model, 7).item()
    step(model, opt, 8)
    step(loaded, lopt, 8)
    want = ck.apply_permutation(
        {k: v for k, v in model.state_dict().items() if "_extra_state" not in k}, layers, stack="megatron", num_groups=2
    )
    got = loaded.state_dict()
    result["next_step_max_diff"] = max((got[k] - v).abs().max().item() for k, v in want.items())
    with torch.no_grad():
        result["loss_after_step_diff"] = abs(loss_of(loaded, 9).item() - loss_of(model, 9).item())
    # the silent case: moments left in place would give another step
    inner = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
    result["expert0_moved"] = not torch.equal(got[inner], model.state_dict()[inner])

    # the runtime map on the stack's own MoE layer: experts in a non-group-preserving physical order
    logical = megatron_gpt(11)
    physical = megatron_gpt(12)  # (a model holds process groups: no deepcopy) then the same weights
    physical.load_state_dict(logical.state_dict())
    maps = {0: NON_GROUP_PRESERVING, 1: NON_GROUP_PRESERVING[::-1]}
    moved = ck.apply_permutation(
        # clones: the state dict's tensors are the live parameters, which load_state_dict overwrites
        {k: v.clone() for k, v in physical.state_dict().items() if "_extra_state" not in k}, maps, stack="megatron",
        keep_router=True,
    )
    physical.load_state_dict(moved, strict=False)
    handles = rt.install_megatron(physical, maps)
    la, lb = loss_of(logical, 12), loss_of(physical, 12)
    la.backward()
    lb.backward()
    result["hook_loss_diff"] = abs(la.item() - lb.item())
    grads_a = {n: p.grad for n, p in logical.named_parameters()}
    grads_b = {n: p.grad for n, p in physical.named_parameters()}
    moved_grads = ck.apply_permutation(grads_a, maps, stack="megatron", keep_router=True)
    result["hook_grad_max_diff"] = max((grads_b[n] - g).abs().max().item() for n, g in moved_grads.items())
    result["hook_bias_counts_equal"] = all(
        torch.equal(a.mlp.router.local_tokens_per_expert, b.mlp.router.local_tokens_per_expert)
        for a, b in zip(logical.decoder.layers, physical.decoder.layers)
    )
    rt.remove(handles)
    with torch.no_grad():
        result["unhooked_loss_diff"] = abs(loss_of(physical, 12).item() - loss_of(logical, 12).item())

    # the exact file `placement export --format megatron --keep-router` writes, applied as users do:
    # the torch_dist checkpoint permuted with it (keep_router) and the hooks installed from it
    from tests.stacks.tiny import keep_router_export

    with tempfile.TemporaryDirectory() as tmp:
        perm = keep_router_export(tmp, "megatron", (0, 1), [NON_GROUP_PRESERVING, NON_GROUP_PRESERVING[::-1]])
        result["export_group_preserving"] = json.loads(Path(perm).read_text())["group_preserving"]
        logical = megatron_gpt(21)
        src, dst = Path(tmp) / "src", Path(tmp) / "dst"
        src.mkdir()
        dist_checkpointing.save(logical.sharded_state_dict(), str(src))
        ck.permute_dcp(src, dst, str(perm), keep_router=True)
        physical = megatron_gpt(22)  # other weights: everything must come from the checkpoint
        physical.load_state_dict(dist_checkpointing.load(physical.sharded_state_dict(), str(dst)))
        handles = rt.install_megatron(physical, str(perm))
        with torch.no_grad():
            result["export_file_hook_loss_diff"] = abs(loss_of(physical, 13).item() - loss_of(logical, 13).item())
        rt.remove(handles)
        with torch.no_grad():
            result["export_file_unhooked_loss_diff"] = abs(loss_of(physical, 13).item() - loss_of(logical, 13).item())
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    run(sys.argv[1])
