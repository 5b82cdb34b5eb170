"""Megatron-Core 0.16.1 on 4 CPU processes (gloo): the alltoall dispatcher with EP=4, and VPP chunks.

Run by tests/stacks/test_runtime_megatron.py as ``python -m tests.stacks.megatron_ep_job OUT_DIR``
(hard timeout): the process imports the stack once and forks one worker per rank (each initialises
its own gloo rank), which writes ``OUT_DIR/rank{RANK}.json``.  The alltoall dispatcher's CUDA-only
calls (its DtoH side stream, ``maybe_move_tensor_to_cpu`` keeping CPU splits as tensors where it
returns numpy for GPU ones) are patched for CPU.

Part 1 (TP1 PP1 EP4 DP4, ``moe_token_dispatcher_type="alltoall"``, SequentialMLP, 8 experts in 2
groups, sigmoid scores with the aux-loss-free bias): the unplaced model ``U`` and the placed model
``P``, whose experts are the global expert set permuted in memory by
``placement.consumers.checkpoint.apply_permutation(..., keep_router=True)`` with a group-breaking map and
then cut into EP ranks as Megatron does (EP rank ``r`` holds slots ``2r, 2r + 1``), with the map
installed.  Each rank feeds its own batch; the job measures losses, dense and expert gradients
(expert gradients gathered over EP and permuted), the aux-loss-free counters, the ids the
project's recorder sees, and tensors built from Python data by the hooks.

Part 2 (TP1 PP2 VPP2 EP2 DP2): each rank builds its two model chunks (Megatron's own layer
offsets: PP rank 0 holds global layers 0 and 2, rank 1 layers 1 and 3), installs one map per
global layer on the chunk list with ``strict=False`` and checks that each chunk's ``route`` returns
the logical routing's columns in the order of its own global layer's map.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

NUM_LAYERS = 2
MAPS = {0: [5, 0, 7, 2, 1, 6, 3, 4], 1: [3, 6, 0, 5, 7, 1, 4, 2]}  # phy2log, both break the 2 groups
VPP_MAPS = {0: [1, 0, 2, 3, 4, 5, 6, 7], 1: [7, 6, 5, 4, 3, 2, 1, 0], 2: [2, 3, 0, 1, 6, 7, 4, 5],
            3: [4, 5, 6, 7, 0, 1, 2, 3]}


class _Stream:
    """Stands in for ``torch.cuda.Stream`` on CPU: the alltoall dispatcher's DtoH side stream."""

    def wait_stream(self, *_args, **_kwargs):  # type: ignore[no-untyped-def]
        return None

    def record_event(self, *_args, **_kwargs):  # type: ignore[no-untyped-def]
        return self

    def synchronize(self) -> None:
        return None


def _install_alltoall_patches() -> None:
    import contextlib

    import torch
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    stream = _Stream()
    torch.cuda.Stream = lambda *a, **k: stream  # type: ignore[assignment,misc]
    torch.cuda.current_stream = lambda *a, **k: stream  # type: ignore[assignment]
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]

    def to_host(tensor, as_numpy=False, record_stream=False):  # type: ignore[no-untyped-def]
        # what moe_utils.maybe_move_tensor_to_cpu gives for a GPU tensor: numpy splits on request
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.numpy()
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = to_host
    token_dispatcher.maybe_move_tensor_to_cpu = to_host


def _config(**extra):  # type: ignore[no-untyped-def]
    import torch
    from megatron.core.transformer import TransformerConfig

    from tests.stacks.tiny import DIM, FFN, NUM_EXPERTS, TOP_K

    return TransformerConfig(
        hidden_size=DIM, num_attention_heads=2, ffn_hidden_size=32, use_cpu_initialization=True,
        params_dtype=torch.float32, bf16=False, fp16=False, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, num_moe_experts=NUM_EXPERTS, moe_router_topk=TOP_K, moe_ffn_hidden_size=FFN,
        moe_router_num_groups=2, moe_router_group_topk=1, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        gated_linear_unit=True, **extra,
    )


def _gpt(seed: int, config, **kwargs):  # type: ignore[no-untyped-def]
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    torch.manual_seed(seed)
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=16,
                    position_embedding_type="learned_absolute", **kwargs)


def _global_experts(local: dict, rank_slots: int, ep_group) -> dict:  # type: ignore[no-untyped-def]
    """``decoder.layers.L.mlp.experts.local_experts.E.*`` with global ``E``, gathered over EP."""
    import re

    import torch
    import torch.distributed as dist

    out = {}
    ep = dist.get_world_size(ep_group)
    for key, value in sorted(local.items()):
        m = re.fullmatch(r"(.*\.local_experts\.)(\d+)(\..*)", key)
        if not m:
            continue
        parts = [torch.empty_like(value) for _ in range(ep)]
        dist.all_gather(parts, value.contiguous(), group=ep_group)
        for r, part in enumerate(parts):
            out[f"{m.group(1)}{r * rank_slots + int(m.group(2))}{m.group(3)}"] = part
    return out


def part1(rank: int) -> dict:
    import torch
    from megatron.core import parallel_state

    from placement import checkpoint as ck
    from placement import runtime as rt
    from placement.sources.importers.recorder import RouterRecorder, megatron_routers
    from tests.stacks.tiny import NUM_EXPERTS, megatron_batch
    from tests.stacks.watch import host_tensor_watch

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=4)
    ep_group = parallel_state.get_expert_model_parallel_group()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    slots = NUM_EXPERTS // 4
    config = _config(num_layers=NUM_LAYERS, moe_token_dispatcher_type="alltoall", expert_model_parallel_size=4)
    unplaced = _gpt(0, config)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(5)  # the same bias on every rank (it is replicated)
        for layer in unplaced.decoder.layers:
            layer.mlp.router.expert_bias.copy_(torch.randn(NUM_EXPERTS, generator=gen) * 0.05)
    state = {k: v for k, v in unplaced.state_dict().items() if "_extra_state" not in k}
    # The in-memory permuted checkpoint: the global expert set, permuted, cut into EP ranks.
    moved = ck.apply_permutation(_global_experts(state, slots, ep_group), MAPS, stack="megatron", keep_router=True)
    placed = _gpt(99, config)
    new = dict(state)
    for key in list(new):
        if ".local_experts." in key:
            head, tail = key.split(".local_experts.")
            i, rest = tail.split(".", 1)
            new[key] = moved[f"{head}.local_experts.{ep_rank * slots + int(i)}.{rest}"]
    placed.load_state_dict(new, strict=False)
    installed = rt.install_megatron(placed, MAPS)

    result: dict = {"rank": rank, "ep_rank": ep_rank, "installed_layers": list(getattr(installed, "layers", []))}
    tokens, pos, mask, labels = megatron_batch(100 + rank, seq=8, batch=2)
    records = []
    losses = []
    for model in (unplaced, placed):
        rec = RouterRecorder(Path(os.environ["PLACEMENT_JOB_TMP"]) / f"r{rank}_{len(losses)}", rank=rank,
                             routers=megatron_routers(model))
        with host_tensor_watch() as calls:
            loss = model(tokens, pos, mask, labels=labels).float().mean()
            loss.backward()
        records.append([r["top_indices"] for r in rec.records])
        rec.close()
        losses.append(loss.item())
        if model is placed:
            result["host_tensor_calls"] = calls
    result["loss"] = losses[0]
    result["loss_diff"] = abs(losses[0] - losses[1])
    result["recorded_logical"] = records[0] == records[1] and bool(records[0])
    grads_u = {n: p.grad for n, p in unplaced.named_parameters()}
    grads_p = {n: p.grad for n, p in placed.named_parameters()}
    result["dense_grad_max_diff"] = max(
        (grads_p[n] - g).abs().max().item() for n, g in grads_u.items() if ".local_experts." not in n
    )
    gu = _global_experts({n: g for n, g in grads_u.items() if ".local_experts." in n}, slots, ep_group)
    gp = _global_experts({n: g for n, g in grads_p.items() if ".local_experts." in n}, slots, ep_group)
    want = ck.apply_permutation(gu, MAPS, stack="megatron", keep_router=True)
    result["expert_grad_max_diff"] = max((gp[k] - v).abs().max().item() for k, v in want.items())
    result["expert_grads_nonzero"] = sum(int(v.abs().sum().item() > 0) for v in gp.values())
    result["expert_grad_keys"] = len(want)
    result["counts_equal"] = all(
        torch.equal(a.mlp.router.local_tokens_per_expert, b.mlp.router.local_tokens_per_expert)
        for a, b in zip(unplaced.decoder.layers, placed.decoder.layers)
    )
    rt.remove(installed)
    with torch.no_grad():
        result["unhooked_loss_diff"] = abs(placed(tokens, pos, mask, labels=labels).float().mean().item() - losses[0])
    parallel_state.destroy_model_parallel()
    return result


def _mtp_as_decoder(d: dict, num_layers: int, back: bool = False) -> dict:
    """Rename ``mtp.layers.J.transformer_layer.`` <-> ``decoder.layers.{num_layers + J}.`` (the key
    form apply_permutation reads; the MTP MoE layer is model layer ``num_layers + J``)."""
    import re

    if back:
        def sub(m):  # type: ignore[no-untyped-def]
            j = int(m.group(1)) - num_layers
            return f"mtp.layers.{j}.transformer_layer." if j >= 0 else m.group(0)

        return {re.sub(r"^decoder\.layers\.(\d+)\.", sub, k): v for k, v in d.items()}
    return {re.sub(r"^mtp\.layers\.(\d+)\.transformer_layer\.", lambda m: f"decoder.layers.{num_layers + int(m.group(1))}.", k): v
            for k, v in d.items()}


def part3(rank: int) -> dict:
    """MTP (``mtp_num_layers=1``, its own MoE: model layer 2) over EP=4 with the alltoall dispatcher,
    with 0.16.1's inner numbering and with core_v0.19.0's (``layer_number = 1``)."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec

    from placement import checkpoint as ck
    from placement import runtime as rt
    from tests.stacks.tiny import NUM_EXPERTS, megatron_batch

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=4)
    ep_group = parallel_state.get_expert_model_parallel_group()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    slots = NUM_EXPERTS // 4
    config = _config(num_layers=NUM_LAYERS, moe_token_dispatcher_type="alltoall", expert_model_parallel_size=4,
                     mtp_num_layers=1, mtp_loss_scaling_factor=0.5)
    spec = get_gpt_layer_local_spec(num_experts=NUM_EXPERTS, moe_grouped_gemm=False)

    def build(seed):  # type: ignore[no-untyped-def]
        return _gpt(seed, config, mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False))

    maps = {**MAPS, NUM_LAYERS: [6, 7, 4, 5, 2, 3, 0, 1]}
    unplaced = build(0)
    state = {k: v for k, v in unplaced.state_dict().items() if "_extra_state" not in k}
    glob = _mtp_as_decoder(_global_experts(state, slots, ep_group), NUM_LAYERS)
    moved = _mtp_as_decoder(ck.apply_permutation(glob, maps, stack="megatron", keep_router=True), NUM_LAYERS, back=True)
    result: dict = {}
    for numbering in ("0.16.1", "core_v0.19.0"):
        placed = build(99)
        new = dict(state)
        for key in list(new):
            if ".local_experts." in key:
                head, tail = key.split(".local_experts.")
                i, rest = tail.split(".", 1)
                new[key] = moved[f"{head}.local_experts.{ep_rank * slots + int(i)}.{rest}"]
        placed.load_state_dict(new, strict=False)
        if numbering == "core_v0.19.0":
            # core_v0.19.0 multi_token_prediction.py builds the inner layer with layer_number=1
            # (MultiTokenPredictionLayer.layer_number) and transformer_layer.py keeps it for MTP
            inner = placed.mtp.layers[0].transformer_layer
            for module in inner.modules():
                if hasattr(module, "layer_number"):
                    module.layer_number = 1
        installed = rt.install_megatron(placed, maps)
        tokens, pos, mask, labels = megatron_batch(200 + rank, seq=8, batch=2)
        for model in (unplaced, placed):
            model.zero_grad(set_to_none=True)
            model(tokens, pos, mask, labels=labels).float().mean().backward()
        gu = {n: p.grad for n, p in unplaced.named_parameters() if p.grad is not None}
        gp = {n: p.grad for n, p in placed.named_parameters() if p.grad is not None}
        dense = [n for n in gu if ".local_experts." not in n]
        mtp_dense = [n for n in dense if n.startswith("mtp.")]
        eu = _mtp_as_decoder(_global_experts({n: g for n, g in gu.items() if ".local_experts." in n}, slots, ep_group),
                             NUM_LAYERS)
        ep_ = _mtp_as_decoder(_global_experts({n: g for n, g in gp.items() if ".local_experts." in n}, slots, ep_group),
                              NUM_LAYERS)
        want = ck.apply_permutation(eu, maps, stack="megatron", keep_router=True)
        result[numbering] = {
            "installed_layers": list(getattr(installed, "layers", [])),
            "dense_grad_max_diff": max((gp[n] - gu[n]).abs().max().item() for n in dense),
            "mtp_dense_grads": len(mtp_dense),
            "expert_grad_max_diff": max((ep_[k] - v).abs().max().item() for k, v in want.items()),
            "mtp_expert_grads_nonzero": sum(int(v.abs().sum().item() > 0) for k, v in ep_.items()
                                            if k.startswith(f"decoder.layers.{NUM_LAYERS}.")),
        }
        rt.remove(installed)
    parallel_state.destroy_model_parallel()
    return {"mtp": result}


def part2(rank: int) -> dict:
    import torch
    from megatron.core import parallel_state

    from placement import runtime as rt

    parallel_state.initialize_model_parallel(1, 2, virtual_pipeline_model_parallel_size=2, expert_model_parallel_size=2)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    config = _config(num_layers=4, moe_token_dispatcher_type="alltoall", expert_model_parallel_size=2,
                     pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    chunks = [
        _gpt(7, config, pre_process=(pp_rank == 0 and vp == 0), post_process=(pp_rank == 1 and vp == 1), vp_stage=vp)
        for vp in range(2)
    ]
    installed = rt.install_megatron(chunks, VPP_MAPS, strict=False)
    result: dict = {"pp_rank": pp_rank, "vpp_installed_layers": list(getattr(installed, "layers", [])),
                    "vpp_route_matches": {}}
    gen = torch.Generator().manual_seed(3)
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            hidden = torch.randn(8, 2, config.hidden_size, generator=gen)
            logical_probs, logical_map = type(layer.mlp).route(layer.mlp, hidden)
            probs, routing_map = layer.mlp.route(hidden)
            index = torch.as_tensor(VPP_MAPS[layer.layer_number - 1])
            ok = torch.equal(probs, logical_probs[:, index]) and torch.equal(routing_map, logical_map[:, index])
            result["vpp_route_matches"][str(layer.layer_number - 1)] = bool(ok)
    rt.remove(installed)
    parallel_state.destroy_model_parallel()
    return result


def run(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["PLACEMENT_JOB_TMP"] = out_dir
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state

    result: dict = {}
    for part in (part1, part2, part3):
        try:
            result.update(part(rank))
        except Exception as exc:  # recorded: the test names the part that failed
            result[f"{part.__name__}_error"] = f"{type(exc).__name__}: {exc}"[:500]
            parallel_state.destroy_model_parallel()
    dist.barrier()
    dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def main(out_dir: str, world: int = 4) -> int:
    """Import once, fork ``world`` workers, wait for them; the exit code is the first failure's."""
    import multiprocessing

    import megatron.core.models.gpt  # noqa: F401  (imported before the fork: each worker inherits it)
    import torch

    import placement.consumers.checkpoint  # noqa: F401
    from tests.stacks.tiny import free_port, install_cpu_patches

    torch.set_num_threads(1)
    install_cpu_patches()
    _install_alltoall_patches()
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
