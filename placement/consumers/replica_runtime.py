"""Replica dispatch in training: a hot expert's tokens split among its slots, its slots' gradients summed.

The model is built with ``P = E + N`` physical expert slots (Megatron-Core ``num_moe_experts = P``,
TorchTitan ``routed_experts`` with ``P`` experts) and a router over the ``E`` logical experts; slot
``p`` holds logical expert ``phy2log[p]`` (the ``replicas`` block of the placement file,
:mod:`placement.formats.replicas`), EP rank ``r`` the slots ``r * P / ep ...``.

Token split (static, by arrival order): on each rank and micro-batch, the ``j``-th token routed to
logical expert ``e`` (in token index order) goes to slot ``log2phy[e, j mod logcnt[e]]``.  Every
replica gets ``1 / logcnt[e]`` of ``e``'s tokens, within one token per rank and micro-batch.  Why
this rule: it needs no communication and no host synchronisation (a cumulative sum and two
gathers on the device, legal in a CUDA graph), it is the same function on every rank, and it
balances exactly what the token counts allow; a least-loaded split per micro-batch (UltraEP,
LLEP) needs the global counts first.  A token's output does not depend on which replica computed
it, because replicas hold identical weights.

Gradients: each replica's gradient covers only the tokens it got; :meth:`InstalledReplicas.reduce_grads`
sums the gradients of every logical expert's slots among the EP ranks that hold it (point-to-point
exchanges of each holder's partial sum, added in rank order), after backward and before the data-parallel gradient reduction
and the optimizer step (Megatron-Core: before ``finish_grad_sync``, with ``overlap_grad_reduce=False``;
an overlapped bucket would start its reduce-scatter before the replica sum).  Every replica then
holds the logical expert's gradient; identical gradients, identical weights and identical
optimizer state keep them identical after every step (replicas are ordinary parameters here, so
each has its own optimizer state, sharded over the expert-data-parallel ranks by the
DistributedOptimizer).  Skipping the reduction is what breaks equality with the job without replicas.

Live re-plan: :meth:`InstalledReplicas.replan` at a step boundary creates, drops and moves slots
through :func:`placement.consumers.migrate.migrate` (weights, master weights, Adam moments, the
DistributedOptimizer's shards), with this object as the live map; the routing hooks count each
layer's tokens per logical expert (:meth:`InstalledReplicas.take_counts`), from which
:func:`replica_plan` chooses the next maps, and :class:`placement.plan.controller.ReplicaController`
re-plans from a window of recent steps.

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

from placement.core.model import InvalidInputError
from placement.core.replicas import ReplicaMap

__all__ = ["InstalledReplicas", "replica_maps", "replica_plan", "install_megatron_replicas", "install_torchtitan_replicas"]


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
        self._seen: dict[int, Any] = {}  # layer -> (E,) tokens routed to each logical expert since take_counts
        self._model: Any = None  # what replan hands to placement.consumers.migrate.migrate

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
        """Sum the gradients of every replicated logical expert's slots among the EP ranks that hold
        it and write the sum into every slot.  ``group`` is the EP group (default: Megatron-Core's
        expert-model-parallel group, else the world).  Reads and writes ``param.main_grad`` when
        present (Megatron-Core DDP), else ``param.grad``.

        Per layer, each rank first sums its own slots of an expert (FP32), then exchanges that
        partial sum point to point with every other holder of the expert (``isend``/``irecv``
        inside the EP group; ranks that hold no slot of it take no part and move no byte), and every
        holder adds the partial sums in ascending rank order, so all replicas get bit-identical
        gradients.  Per replicated expert held on ``h`` ranks each holder sends and receives
        ``(h - 1) x expert_params x 4`` bytes: what :mod:`placement.predict.replica_cost` prices.
        """
        import torch
        import torch.distributed as dist

        if group is None and self.stack == "Megatron":
            from megatron.core import parallel_state

            group = parallel_state.get_expert_model_parallel_group()
        distributed = dist.is_available() and dist.is_initialized()
        for layer in self.layers:
            p2l, first, slots = self._layers[layer]
            counts = np.bincount(p2l, minlength=self.num_experts)
            if not (counts > 1).any() or not slots:
                continue
            per_rank = len(slots)
            me = first // per_rank  # this rank's index in the EP group
            partial: dict[int, Any] = {}  # expert -> this rank's FP32 sum of its slots' gradients
            local: dict[int, list[int]] = {}  # expert -> its local slots
            for i in range(per_rank):
                e = int(p2l[first + i])
                if counts[e] < 2:
                    continue
                flat = torch.cat([_grad_of(p, dim).reshape(-1).float() for p, dim in slots[i]])
                partial[e] = flat if e not in partial else partial[e] + flat
                local.setdefault(e, []).append(i)
            holders = {e: sorted({int(x) // per_rank for x in np.flatnonzero(p2l == e)}) for e in partial}
            received: dict[tuple[int, int], Any] = {}
            if distributed:
                ops = []
                for e in sorted(partial):  # the same order on every holder: sends and receives match
                    for h in holders[e]:
                        if h == me:
                            continue
                        peer = h if group is None else dist.get_global_rank(group, h)
                        buf = torch.empty_like(partial[e])
                        received[(e, h)] = buf
                        ops.append(dist.P2POp(dist.isend, partial[e], peer))
                        ops.append(dist.P2POp(dist.irecv, buf, peer))
                if ops:  # one batch: NCCL needs the pairs grouped, gloo matches them in order
                    for req in dist.batch_isend_irecv(ops):
                        req.wait()
            for e in sorted(partial):
                total: Any = None
                for h in holders[e]:
                    part = partial[e] if h == me else received.get((e, h))
                    if part is None:  # not distributed: a single process holds every slot
                        continue
                    total = part.clone() if total is None else total + part
                for i in local[e]:
                    offset = 0
                    for p, dim in slots[i]:
                        g = _grad_of(p, dim)
                        g.copy_(total[offset:offset + g.numel()].view_as(g))
                        offset += g.numel()

    def update(self, layers: Mapping[int, Sequence[int] | np.ndarray]) -> list[int]:
        """Point the hooks at new maps (in place: the same device tensors); ``{layer: (P,) phy2log}``,
        layers not installed here are ignored.  Moves no state: :meth:`replan` moves the state and
        then calls this (it is the live map's ``update`` that :func:`placement.consumers.migrate.migrate` commits).
        Every map is checked before any is written.  Returns the layers whose map changed."""
        import torch

        new = replica_maps(layers, self.num_experts)
        for layer, p2l in new.items():
            if layer in self._layers and p2l.size != self._layers[layer][0].size:
                raise InvalidInputError(f"layer {layer}: the new replica map has {p2l.size} slots, the model "
                                        f"{self._layers[layer][0].size}")
        changed = []
        with torch.no_grad():
            for layer, p2l in new.items():
                if layer not in self._layers:
                    continue
                old_p2l, first, slots = self._layers[layer]
                if np.array_equal(p2l, old_p2l):
                    continue
                changed.append(layer)
                cnt, table_t = self._route[layer]
                new_cnt, new_table = _slot_table(torch, p2l, self.num_experts, cnt.device)
                cnt.copy_(new_cnt)
                table_t.copy_(new_table)
                self._layers[layer] = (p2l, first, slots)
        return changed

    def replan(self, layers: Mapping[int, Sequence[int] | np.ndarray], optimizer: Any, group: Any = None,
               state_group: Any = None) -> Any:
        """Re-plan the replicas at a step boundary (after ``optimizer.step()`` and ``zero_grad``):
        create, drop and move slots, keeping every logical expert's training state.

        A thin call of :func:`placement.consumers.migrate.migrate` with this object as the live map: every
        slot whose logical expert changes takes that expert's weights, FP32 master weights and
        per-element optimizer state (Adam's moments) from one slot that holds it now
        (:func:`placement.consumers.migrate.plan_moves`: on its own EP rank when one does, else the lowest),
        including the DistributedOptimizer's shards, which are cut over the expert-data-parallel
        ranks by each slot's place in the gradient buffer and may change DP index as well as EP
        rank.  A dropped replica needs nothing folded back: every replica of an expert got the same
        summed gradient every step (:meth:`reduce_grads`), so its weights and moments equal those the
        expert keeps in its other slots.  All ranks switch or none (``migrate``'s agreement); on a
        :class:`placement.consumers.migrate.MigrationError` the old maps and state are intact.

        Parameters
        ----------
        layers : ``{model layer: (P,) phy2log}``, every logical expert at least once per layer; the
            base permutation may change too.
        optimizer : the job's optimizer (what :func:`placement.consumers.migrate.migrate` takes).
        group, state_group : as :func:`placement.consumers.migrate.migrate` (default: Megatron-Core's EP group,
            and the world).

        Returns
        -------
        placement.consumers.migrate.MigrationReport
        """
        from placement.consumers.migrate import migrate

        if self._model is None:
            raise InvalidInputError("replan: this InstalledReplicas has no model (install it with "
                                    "install_megatron_replicas / install_torchtitan_replicas)")
        if group is None and self.stack != "Megatron":
            raise InvalidInputError("group: a TorchTitan re-plan needs the EP process group (mesh['ep'].get_group())")
        maps = replica_maps({k: v for k, v in layers.items() if int(k) in self._layers}, self.num_experts)
        return migrate(self._model, optimizer, maps, live_map=self, group=group, state_group=state_group)

    def take_counts(self, *, on_device: bool = False) -> dict[int, Any]:
        """``{layer: (E,) tokens this rank routed to each logical expert}`` since the last call
        (every micro-batch's forward adds to it), and reset to zero.  numpy int64 arrays, or with
        ``on_device`` copies of the device tensors (no host synchronisation: what a per-step caller
        such as :class:`placement.plan.controller.ReplicaController` keeps)."""
        out: dict[int, Any] = {}
        for layer in self.layers:
            seen = self._seen.get(layer)
            if seen is None:
                continue
            out[layer] = seen.detach().clone() if on_device else seen.detach().cpu().numpy().astype(np.int64)
            seen.zero_()
        return out

    def maps_from_loads(self, loads: Mapping[int, Sequence[float] | np.ndarray], rule: str = "hottest",
                        rank2domain: np.ndarray | None = None) -> dict[int, np.ndarray]:
        """New replica maps for :meth:`replan` from recent routing: per installed layer in ``loads``
        (``(E,)`` tokens per logical expert, e.g. :meth:`take_counts` summed over the job and a
        window of recent steps), :func:`replica_plan` of its current map.  The same on every rank
        given the same loads."""
        out: dict[int, np.ndarray] = {}
        for layer in self.layers:
            if layer not in loads:
                continue
            p2l, _, slots = self._layers[layer]
            out[layer] = replica_plan(p2l, loads[layer], self.num_experts, p2l.size // len(slots), rule, rank2domain)
        return out


def replica_plan(phy2log: Sequence[int] | np.ndarray, loads: Sequence[float] | np.ndarray, num_experts: int, ep: int,
                 rule: str = "hottest", rank2domain: np.ndarray | None = None) -> np.ndarray:
    """One layer's new ``(P,)`` map: each EP rank's first ``E / ep`` slots keep ``phy2log``'s
    permutation, the ``N = P - E`` redundant slots go where ``rule`` (:func:`placement.core.replicas.replicate`:
    ``hottest`` or ``eplb``) puts them for ``loads`` ``(E,)`` tokens per logical expert."""
    from placement.core.replicas import replicate

    p2l = np.asarray(phy2log, dtype=np.int64).reshape(-1)
    w = np.asarray(loads, dtype=np.float64).reshape(1, -1)
    if w.shape[1] != num_experts or p2l.size % ep or (p2l.size - num_experts) % ep:
        raise InvalidInputError(f"loads: expected {num_experts} logical experts and a map of slots split evenly "
                                f"over {ep} EP ranks")
    per_rank = p2l.size // ep
    keep = per_rank - (p2l.size - num_experts) // ep
    base = p2l.reshape(ep, per_rank)[:, :keep].reshape(1, -1)
    out = replicate(rule, base, w, ep, p2l.size - num_experts, rank2domain)  # type: ignore[arg-type]
    return np.asarray(out.phy2log[0], dtype=np.int64)


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
    layers : ``{model layer: (P,) phy2log}``; layers are matched as :func:`placement.consumers.runtime.install_megatron` does.
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

    from placement.consumers.runtime import _param_device, megatron_moe_layers

    maps = replica_maps(layers, num_experts)
    installed = InstalledReplicas("Megatron", num_experts)
    installed._model = model[0] if isinstance(model, (list, tuple)) and len(model) == 1 else model
    try:
        for layer, name, module in megatron_moe_layers(model):
            router = module.router
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
            installed._seen[layer] = torch.zeros(num_experts, dtype=torch.long, device=device)
            installed._handles.append(_wrap_route(module, cnt, table_t, p2l.size, installed._seen[layer]))
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


def _wrap_route(moe_layer: Any, cnt: Any, table_t: Any, num_physical: int, seen: Any) -> Any:
    original = moe_layer.route

    def route(*args: Any, **kwargs: Any) -> Any:
        probs, routing_map = original(*args, **kwargs)
        seen.add_(routing_map.detach().sum(0))
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

    from placement.consumers.runtime import _TITAN_LAYER, _TITAN_WRAPPERS, _param_device

    maps = replica_maps(layers, num_experts)
    installed = InstalledReplicas("TorchTitan", num_experts)
    installed._model = model
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
            installed._seen[layer] = torch.zeros(num_experts, dtype=torch.long, device=device)
            installed._handles.append(experts.register_forward_pre_hook(
                _titan_pre_hook(layer, cnt, table_t, num_experts, p2l.size, installed._seen[layer])).remove)
            inner = experts.inner_experts
            per_rank = p2l.size // ep
            params = [p for _, p in sorted(inner.named_parameters())]
            installed._layers[layer] = (p2l, ep_rank * per_rank, [[(p, i) for p in params] for i in range(per_rank)])
    except BaseException:
        installed.remove()
        raise
    return installed


def _titan_pre_hook(layer: int, cnt: Any, table_t: Any, num_experts: int, num_physical: int, seen: Any) -> Any:
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
        seen.add_(torch.bincount(flat.detach(), minlength=num_experts))
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
