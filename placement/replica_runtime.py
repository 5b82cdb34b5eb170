"""Replica dispatch in training: a hot expert's tokens split among its slots, its slots' gradients summed.

The model is built with ``P = E + N`` physical expert slots (Megatron-Core ``num_moe_experts = P``,
TorchTitan ``routed_experts`` with ``P`` experts) and a router over the ``E`` logical experts; slot
``p`` holds logical expert ``phy2log[p]`` (the ``replicas`` block of the placement file,
:mod:`placement.formats_replicas`), EP rank ``r`` the slots ``r * P / ep ...``.

Token split (static, by arrival order): on each rank and micro-batch, the ``j``-th token routed to
logical expert ``e`` (in token index order) goes to slot ``log2phy[e, j mod logcnt[e]]``.  Every
replica gets ``1 / logcnt[e]`` of ``e``'s tokens, within one token per rank and micro-batch.  Why
this rule: it needs no communication and no host synchronisation (a cumulative sum and two
gathers on the device, legal in a CUDA graph), it is the same function on every rank, and it
balances exactly what the token counts allow; a least-loaded split per micro-batch (UltraEP,
LLEP) needs the global counts first.  A token's output does not depend on which replica computed
it, because replicas hold identical weights.

Gradients: each replica's gradient covers only the tokens it got; :meth:`InstalledReplicas.reduce_grads`
sums the gradients of every logical expert's slots over the EP group (one all-reduce over the
replicated experts' parameters), after backward and before the data-parallel gradient reduction
and the optimizer step (Megatron-Core: before ``finish_grad_sync``, with ``overlap_grad_reduce=False``;
an overlapped bucket would start its reduce-scatter before the replica sum).  Every replica then
holds the logical expert's gradient; identical gradients, identical weights and identical
optimizer state keep them identical after every step (replicas are ordinary parameters here, so
each has its own optimizer state, sharded over the expert-data-parallel ranks by the
DistributedOptimizer).  Skipping the reduction is what breaks equality with the job without replicas.

Hooks
-----
- Megatron-Core 0.16.1 (``megatron/core/transformer/moe/moe_layer.py``, ``router.py``): the
  logical router replaces each ``MoELayer.router`` (same class, a copy of the config with
  ``num_moe_experts = E``; load its weights, ``expert_bias`` and counters after installing); the
  ``route`` method is wrapped to scatter the (tokens, E) ``probs`` and ``routing_map`` into
  (tokens, P) by the split above.  The dispatcher and the experts see physical slots only, so the
  hook is the same for every dispatcher (``alltoall``, ``allgather``, ``flex``) and every expert
  module.  The gradient sum reads per-expert parameters: ``SequentialMLP.local_experts[i]`` (the CPU
  path, tested) or ``TEGroupedMLP``'s ``linear_fc1.weight{i}`` / ``linear_fc2.weight{i}`` (TE
  grouped GEMM, one tensor per local expert; not runnable on CPU, untested).  The legacy
  ``GroupedMLP`` keeps all local experts in one ``weight1`` / ``weight2`` and is refused.
- TorchTitan 0.3.0 (``torchtitan/models/common/moe.py``): a forward pre-hook on
  ``MoE.routed_experts`` maps ``topk_expert_ids`` (logical) to physical slots by the split and the
  per-expert counts to the (P,) slot counts; ``GroupedExperts`` holds ``w1``/``w2``/``w3`` with
  experts on dim 0, which the gradient sum slices.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from placement.model import InvalidInputError
from placement.replicas import ReplicaMap

__all__ = ["InstalledReplicas", "replica_maps", "install_megatron_replicas", "install_torchtitan_replicas"]


def replica_maps(layers: Mapping[int, Sequence[int] | np.ndarray], num_experts: int) -> dict[int, np.ndarray]:
    """``{model layer: (P,) phy2log}`` checked: every logical expert ``0 .. E-1`` has a slot."""
    out: dict[int, np.ndarray] = {}
    for layer, row in sorted(layers.items()):
        p2l = np.asarray(row, dtype=np.int64).reshape(-1)
        if p2l.size < num_experts or p2l.min(initial=0) < 0 or p2l.max(initial=0) >= num_experts:
            raise InvalidInputError(f"layer {layer}: a replica map needs at least {num_experts} slots with ids in "
                                    f"[0, {num_experts})")
        missing = sorted(set(range(num_experts)) - set(p2l.tolist()))
        if missing:
            raise InvalidInputError(f"layer {layer}: experts {missing[:6]} have no slot in the replica map")
        out[int(layer)] = p2l
    return out


class InstalledReplicas:
    """The replica maps installed on one model: per layer the device tensors the hooks read and
    the per-slot parameters :meth:`reduce_grads` sums."""

    def __init__(self, stack: str, num_experts: int) -> None:
        self.stack = stack
        self.num_experts = num_experts
        self._handles: list[Any] = []
        # layer -> (phy2log numpy (P,), first local slot, [per local slot: list of (param, expert-dim index)])
        self._layers: dict[int, tuple[np.ndarray, int, list[list[tuple[Any, int | None]]]]] = {}
        self._route: dict[int, tuple[Any, Any]] = {}  # layer -> the (cnt, table_t) device tensors the hooks read

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted(self._layers))

    def phy2log(self, layer: int) -> np.ndarray:
        return self._layers[layer][0].copy()

    def remove(self) -> None:
        for undo in self._handles:
            undo()
        self._handles.clear()

    def reduce_grads(self, group: Any = None) -> None:
        """Sum the gradients of every replicated logical expert's slots over ``group`` (the EP
        group; default: Megatron-Core's expert-model-parallel group, else the world) and write the
        sum into every slot.  Reads and writes ``param.main_grad`` when present (Megatron-Core DDP),
        else ``param.grad``."""
        import torch
        import torch.distributed as dist

        if group is None and self.stack == "Megatron":
            from megatron.core import parallel_state

            group = parallel_state.get_expert_model_parallel_group()
        for layer in self.layers:
            p2l, first, slots = self._layers[layer]
            counts = np.bincount(p2l, minlength=self.num_experts)
            replicated = np.flatnonzero(counts > 1)
            if not len(replicated) or not slots:
                continue
            row = {int(e): i for i, e in enumerate(replicated)}
            grads = [_grad_of(p, dim) for p, dim in slots[0]]
            width = sum(g.numel() for g in grads)
            buf = torch.zeros(len(replicated), width, dtype=torch.float32, device=grads[0].device)
            mine = [(i, row[int(p2l[first + i])]) for i in range(len(slots)) if int(p2l[first + i]) in row]
            for i, r in mine:
                buf[r] += torch.cat([_grad_of(p, dim).reshape(-1).float() for p, dim in slots[i]])
            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(buf, group=group)
            for i, r in mine:
                offset = 0
                for p, dim in slots[i]:
                    g = _grad_of(p, dim)
                    g.copy_(buf[r, offset:offset + g.numel()].view_as(g))
                    offset += g.numel()


    def replan(self, layers: Mapping[int, Sequence[int] | np.ndarray], optimizer: Any = None, group: Any = None,
               *, copy_optimizer_state: bool = True) -> list[int]:
        """Re-plan the replicas at a step boundary: slots whose logical expert changes take that
        expert's weights and optimizer state from its current lowest slot (one all-reduce over
        ``group``, the EP group by default), and the hooks' tensors are rewritten in place.

        Only redundant slots may change (each rank's first ``E / ep`` slots keep the placement's
        permutation, which ``placement.migrate`` moves).  ``optimizer``: the torch optimizers whose
        ``state[param]`` hold each slot's moments (a Megatron-Core ``ChainedOptimizer`` of
        non-distributed optimizers, or a torch optimizer); Megatron-Core's DistributedOptimizer
        shards a slot's state by its place in the gradient buffer, which differs between slots,
        and is refused.  Returns the layers whose map changed.
        """
        import torch
        import torch.distributed as dist

        if group is None and self.stack == "Megatron":
            from megatron.core import parallel_state

            group = parallel_state.get_expert_model_parallel_group()
        inner = _torch_optimizers(optimizer)
        new = replica_maps(layers, self.num_experts)
        changed = []
        for layer in self.layers:
            if layer not in new:
                continue
            old_p2l, first, slots = self._layers[layer]
            p2l = new[layer]
            if p2l.size != old_p2l.size:
                raise InvalidInputError(f"layer {layer}: the new replica map has {p2l.size} slots, the model {old_p2l.size}")
            per_rank = len(slots) if slots else p2l.size
            redundant_per_rank = (p2l.size - self.num_experts) // (p2l.size // per_rank)
            base = np.arange(p2l.size) % per_rank < per_rank - redundant_per_rank  # each rank's permutation slots
            if np.any(p2l[base] != old_p2l[base]):
                raise InvalidInputError(f"layer {layer}: a re-plan changes only redundant slots; the permutation moves "
                                        "with placement.migrate")
            moved = np.flatnonzero(p2l != old_p2l)
            if not len(moved):
                continue
            changed.append(layer)
            needed = sorted({int(p2l[s]) for s in moved})
            source = {b: int(np.flatnonzero(old_p2l == b)[0]) for b in needed}
            parts = [[p.detach()[dim] if dim is not None else p.detach() for p, dim in slot] for slot in slots]
            states = [[_state_tensors(inner, p) for p, _ in slot] for slot in slots]
            width = sum(t.numel() for t in parts[0]) + sum(t.numel() for st in states[0] for t in st)
            buf = torch.zeros(len(needed), width, dtype=torch.float32, device=parts[0][0].device)
            for k, b in enumerate(needed):
                i = source[b] - first
                if 0 <= i < len(slots):
                    pieces = [t.reshape(-1).float() for t in parts[i]]
                    pieces += [t.reshape(-1).float() for st in states[i] for t in st]
                    buf[k] = torch.cat(pieces)
            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(buf, group=group)
            with torch.no_grad():
                for s_ in moved:
                    i = int(s_) - first
                    if not 0 <= i < len(slots):
                        continue
                    row = buf[needed.index(int(p2l[s_]))]
                    offset = 0
                    targets = parts[i] + ([t for st in states[i] for t in st] if copy_optimizer_state else [])
                    for t in targets:
                        t.copy_(row[offset:offset + t.numel()].view_as(t))
                        offset += t.numel()
                cnt, table_t = self._route[layer]
                new_cnt, new_table = _slot_table(torch, p2l, self.num_experts, cnt.device)
                cnt.copy_(new_cnt)
                table_t.copy_(new_table)
            self._layers[layer] = (p2l, first, slots)
        return changed


    def maps_from_loads(self, loads: Mapping[int, Sequence[float] | np.ndarray], rule: str = "hottest",
                        rank2domain: np.ndarray | None = None) -> dict[int, np.ndarray]:
        """New replica maps for :meth:`replan` from recent routing: per installed layer, ``loads``
        (E,) tokens per logical expert (e.g. the router's ``local_tokens_per_expert`` summed over
        the EP group since the last re-plan), the permutation kept, the redundant slots chosen by
        ``rule`` (:func:`placement.replicas.replicate`).  The same on every rank given the same loads."""
        from placement.replicas import replicate

        out: dict[int, np.ndarray] = {}
        for layer in self.layers:
            if layer not in loads:
                continue
            p2l, _, slots = self._layers[layer]
            per_rank = len(slots)
            ep = p2l.size // per_rank
            keep = per_rank - (p2l.size - self.num_experts) // ep
            base = p2l.reshape(ep, per_rank)[:, :keep].reshape(1, -1)
            w = np.asarray(loads[layer], dtype=np.float64).reshape(1, -1)
            out[layer] = replicate(rule, base, w, ep, p2l.size - self.num_experts, rank2domain).phy2log[0]  # type: ignore[arg-type]
        return out


def _torch_optimizers(optimizer: Any) -> list[Any]:
    """The torch optimizers inside a Megatron-Core (Chained) optimizer, or ``[optimizer]``."""
    if optimizer is None:
        return []
    chained = getattr(optimizer, "chained_optimizers", None)
    opts = list(chained) if chained is not None else [optimizer]
    out = []
    for o in opts:
        if hasattr(o, "model_param_group_index_map"):
            raise InvalidInputError("optimizer: Megatron-Core's DistributedOptimizer shards each slot's state by its "
                                    "place in the gradient buffer; a replica re-plan needs the non-distributed optimizer")
        out.append(getattr(o, "optimizer", o))
    return out


def _state_tensors(optimizers: list[Any], param: Any) -> list[Any]:
    """The FP32 main copy of ``param`` when the optimizer keeps one (Megatron-Core's BF16 optimizer:
    ``param.main_param``) and its tensor-valued optimizer state (Adam's moments, step), in key order."""
    main = getattr(param, "main_param", None)
    key = param if main is None else main
    out = [] if main is None else [main.detach()]
    for o in optimizers:
        state = o.state.get(key)
        if state:
            return out + [state[k] for k in sorted(state) if hasattr(state[k], "numel")]
    return out


def _grad_of(param: Any, dim_index: int | None) -> Any:
    """The gradient tensor of one expert's part of ``param`` (a view; allocated zeros when absent)."""
    import torch

    g = getattr(param, "main_grad", None)
    if g is None:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        g = param.grad
    g = _local(g)  # TorchTitan: the DTensor's local shard (this EP rank's slots), written in place
    return g if dim_index is None else g[dim_index]


def _slot_table(torch: Any, p2l: np.ndarray, num_experts: int, device: Any) -> tuple[Any, Any]:
    """(E,) slot counts and (R + 1, E) slots of each expert (ascending; padded with its first slot)."""
    rmap = ReplicaMap(p2l[None, :], num_experts, 1)
    table = rmap.log2phy[0]
    table = np.where(table < 0, table[:, :1], table)
    return (torch.tensor(rmap.logcnt[0], dtype=torch.long, device=device),
            torch.tensor(table.T.copy(), dtype=torch.long, device=device))


def _split(routing_map: Any, cnt: Any, table_t: Any) -> Any:
    """(T, E) physical slot of each (token, logical expert): the ``j``-th token of ``e`` gets
    replica ``j mod cnt[e]``; entries where ``routing_map`` is False are unused."""
    order = routing_map.long().cumsum(0) - 1
    k = order.remainder(cnt)
    return table_t.gather(0, k)


# ---------------------------------------------------------------------------------------------
# Megatron-Core
# ---------------------------------------------------------------------------------------------
def install_megatron_replicas(model: Any, layers: Mapping[int, Sequence[int] | np.ndarray], num_experts: int) -> InstalledReplicas:
    """Install replica dispatch on every MoE layer of a Megatron-Core model built with ``P`` slots.

    Parameters
    ----------
    model : a ``GPTModel`` (or a module holding ``TransformerLayer`` s, or a list of model chunks)
        whose config has ``num_moe_experts = P``.
    layers : ``{model layer: (P,) phy2log}``; layers are matched as :func:`placement.runtime.install_megatron` does.
    num_experts : ``E``, the logical experts the router chooses among.

    Returns
    -------
    InstalledReplicas
        Call :meth:`InstalledReplicas.reduce_grads` after every backward, before the DP gradient
        reduction.  The new logical routers are initialised by Megatron's own init (which draws
        from torch's random generator); load the router weights (``E`` rows) after installing.
        Install before wrapping the model in ``DistributedDataParallel`` and building the
        optimizer, so that both see the logical routers' parameters.
    """
    import torch

    from placement.runtime import _megatron_layer, _param_device

    maps = replica_maps(layers, num_experts)
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    installed = InstalledReplicas("Megatron", num_experts)
    try:
        for chunk in chunks:
            parents = dict(chunk.named_modules())
            for name, module in parents.items():
                router = getattr(module, "router", None)
                if router is None or not callable(getattr(module, "route", None)) or not hasattr(router, "config"):
                    continue
                layer = _megatron_layer(name, module, parents)
                if layer not in maps:
                    raise InvalidInputError(f"layer {layer}: a Megatron MoE layer ({name}) without a replica map")
                p2l = maps[layer]
                if int(router.config.num_moe_experts) != p2l.size:
                    raise InvalidInputError(f"layer {layer}: the model has {router.config.num_moe_experts} expert slots, "
                                            f"the replica map {p2l.size} (build the model with num_moe_experts = E + N)")
                device = _param_device(torch, router)
                installed._handles.append(_logical_router(module, num_experts, device))
                cnt, table_t = _slot_table(torch, p2l, num_experts, device)
                installed._route[layer] = (cnt, table_t)
                installed._handles.append(_wrap_route(module, cnt, table_t, p2l.size))
                local = list(module.local_expert_indices)
                installed._layers[layer] = (p2l, int(local[0]), [_megatron_slot_params(module.experts, i, layer)
                                                                 for i in range(len(local))])
    except BaseException:
        installed.remove()
        raise
    return installed


def _logical_router(moe_layer: Any, num_experts: int, device: Any) -> Any:
    old = moe_layer.router
    config = copy.copy(old.config)
    config.num_moe_experts = num_experts
    from types import SimpleNamespace

    groups = SimpleNamespace(tp=old.tp_group, cp=old.cp_group, tp_cp=old.tp_cp_group, tp_dp_cp=old.tp_dp_cp_group)
    new = type(old)(config=config, pg_collection=groups).to(device)
    if old.layer_number is not None:
        new.set_layer_number(old.layer_number)
    moe_layer.router = new

    def undo() -> None:
        moe_layer.router = old

    return undo


def _wrap_route(moe_layer: Any, cnt: Any, table_t: Any, num_physical: int) -> Any:
    original = moe_layer.route

    def route(*args: Any, **kwargs: Any) -> Any:
        probs, routing_map = original(*args, **kwargs)
        slot = _split(routing_map, cnt, table_t)
        shape = (probs.shape[0], num_physical)
        return (probs.new_zeros(shape).scatter(1, slot, probs),
                routing_map.new_zeros(shape).scatter(1, slot, routing_map))

    object.__setattr__(moe_layer, "route", route)

    def undo() -> None:
        if vars(moe_layer).get("route") is route:
            object.__delattr__(moe_layer, "route")

    return undo


def _megatron_slot_params(experts: Any, i: int, layer: int) -> list[tuple[Any, int | None]]:
    local = getattr(experts, "local_experts", None)
    if local is not None:  # SequentialMLP
        return [(p, None) for _, p in sorted(local[i].named_parameters())]
    named = dict(experts.named_parameters())
    mine = sorted(n for n in named if n.endswith((f".weight{i}", f".bias{i}")))
    if mine:  # TEGroupedMLP: one tensor per local expert
        return [(named[n], None) for n in mine]
    raise InvalidInputError(f"layer {layer}: {type(experts).__name__} keeps its local experts in shared tensors; "
                            "replica gradients need SequentialMLP or TEGroupedMLP")


# ---------------------------------------------------------------------------------------------
# TorchTitan
# ---------------------------------------------------------------------------------------------
def install_torchtitan_replicas(model: Any, layers: Mapping[int, Sequence[int] | np.ndarray], num_experts: int,
                                ep_rank: int = 0, ep: int = 1) -> InstalledReplicas:
    """Install replica dispatch on every ``MoE`` of a TorchTitan model whose router chooses among
    ``E`` experts and whose ``routed_experts`` hold ``P`` slots (``P / ep`` on this EP rank).

    Under TP (``full_dtensor``) the hook splits each rank's local shard of the ids and rebuilds the
    DTensors with their placements (the counts as (P,) partial sums or replicated, as they came).
    """
    import torch

    from placement.runtime import _TITAN_LAYER, _TITAN_WRAPPERS, _param_device

    maps = replica_maps(layers, num_experts)
    installed = InstalledReplicas("TorchTitan", num_experts)
    try:
        for raw_name, module in model.named_modules():
            experts = getattr(module, "routed_experts", None)
            if experts is None or not hasattr(module, "router"):
                continue
            m = _TITAN_LAYER.fullmatch(_TITAN_WRAPPERS.sub("", raw_name).lstrip("."))
            if m is None:
                raise InvalidInputError(f"{raw_name or 'model'}: a TorchTitan MoE module whose layer index is not in its name")
            layer = int(m.group("layer"))
            if layer not in maps:
                raise InvalidInputError(f"layer {layer}: a TorchTitan MoE layer ({raw_name}) without a replica map")
            p2l = maps[layer]
            device = _param_device(torch, experts)
            cnt, table_t = _slot_table(torch, p2l, num_experts, device)
            installed._route[layer] = (cnt, table_t)
            installed._handles.append(experts.register_forward_pre_hook(
                _titan_pre_hook(layer, cnt, table_t, num_experts, p2l.size)).remove)
            inner = experts.inner_experts
            per_rank = p2l.size // ep
            params = [p for _, p in sorted(inner.named_parameters())]
            installed._layers[layer] = (p2l, ep_rank * per_rank, [[(p, i) for p in params] for i in range(per_rank)])
    except BaseException:
        installed.remove()
        raise
    return installed


def _titan_pre_hook(layer: int, cnt: Any, table_t: Any, num_experts: int, num_physical: int) -> Any:
    import torch

    def pre_hook(_mod: Any, args: tuple) -> tuple:
        if len(args) != 4:
            raise InvalidInputError(f"layer {layer}: TorchTitan routed_experts called with {len(args)} positional "
                                    "arguments, replicas expect (x, scores, expert_ids, num_tokens_per_expert)")
        x, scores, ids, counts = args
        ids_local, counts_local = _local(ids), _local(counts)
        if any(p.is_partial() for p in getattr(ids, "placements", ())):
            raise InvalidInputError(f"layer {layer}: TorchTitan expert ids as a partial DTensor are not supported")
        if any(p.is_shard() for p in getattr(counts, "placements", ())):
            raise InvalidInputError(f"layer {layer}: TorchTitan per-expert counts sharded over experts are not supported")
        # this rank's tokens in index order (a token's k experts are distinct): the split of _split
        flat = ids_local.reshape(-1)
        onehot = torch.nn.functional.one_hot(flat, num_experts).bool()
        slot = _split(onehot, cnt, table_t).gather(1, flat[:, None]).reshape(ids_local.shape)
        # replicated counts stay whole; partial-sum counts are this rank's share, as the ids are
        slot_counts = torch.bincount(slot.reshape(-1), minlength=num_physical).to(counts_local.dtype)
        return x, scores, _like(ids, slot, ids.shape), _like(counts, slot_counts, (num_physical,))

    return pre_hook


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") and hasattr(t, "placements") else t


def _like(template: Any, local: Any, shape: Any) -> Any:
    """``local`` as a DTensor placed like ``template`` (global ``shape``), or itself for a plain tensor."""
    if not (hasattr(template, "to_local") and hasattr(template, "placements")):
        return local
    import torch
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, template.device_mesh, template.placements, run_check=False, shape=torch.Size(shape),
                              stride=tuple(local.stride()) if len(shape) == 1 else template.stride())
