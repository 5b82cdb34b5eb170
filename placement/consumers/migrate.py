"""Re-place experts in a running training job: move expert state between EP ranks at a step boundary.

:func:`migrate` takes the live expert map that :func:`placement.consumers.runtime.install_megatron` /
:func:`placement.consumers.runtime.install_torchtitan` installed (the router stays logical; physical slot
``p`` holds logical expert ``phy2log[p]`` and sits on EP rank ``p // experts_per_rank``) and a new
map per MoE layer.  Every logical expert whose slot changes takes its whole training state along:

* its weights (the model parameters of the slot),
* its FP32 master weights, when the optimizer keeps them apart from the model parameters
  (Megatron-Core's ``Float16OptimizerWithFloat16Params`` sets ``param.main_param``),
* its optimizer state (Adam's ``exp_avg`` and ``exp_avg_sq``, any per-element state the optimizer
  keeps for the parameter); scalar state (Adam's ``step``) is the same for every expert and is
  checked to be equal on every rank, not sent.

The maps may hold replicas (more slots than experts; :mod:`placement.consumers.replica_runtime`, whose
``InstalledReplicas.replan`` calls this with itself as the live map): a created or moved replica
takes its expert's state from one slot that holds it (:func:`plan_moves`), a dropped one is
overwritten (its replicas hold the same state).

Protocol, every rank of the job (``state_group``, default the world): weights move within each
expert-parallel group (expert-data-parallel replicas hold the same experts and move them the same
way), but all ranks agree, so the replicas switch together or not at all:

1. **Plan and agree**: each rank derives the same moves from the old and new maps, checks that its
   slots' state has the layout of every other rank's (names, shapes, dtypes) and that scalar state
   agrees (compared over the EP group); an all-reduce (MIN) of a status flag over ``state_group``.
   A failure anywhere: every rank raises :class:`MigrationError`, nothing has changed.
2. **Transfer into scratch**: every rank packs what it sends and allocates what it receives (one
   buffer per moved slot and dtype, in one global order on every rank; experts that change slot on
   the same rank are copied locally), the ranks agree that all are ready (so a rank that failed
   posts nothing and no peer waits for it), then one batch of point-to-point operations
   (``torch.distributed.batch_isend_irecv``).  Live tensors are not touched.
3. **Agree again**: received buffers are checked (finite); an all-reduce of the status flag.  A
   failure on any rank: every rank drops its scratch and raises; the old placement, weights and
   optimizer state are intact and training continues on them.
4. **Commit**: the scratch buffers are copied into the live tensors (in place: optimizer and
   hooks keep their references) and the live map switches (``live_map.update``).

Supported, and refused with a one-line :class:`MigrationError` otherwise:

* Megatron-Core 0.16.1 ``SequentialMLP`` experts (``mlp.experts.local_experts[i]``, the local
  non-TransformerEngine spec), with a plain ``torch.optim`` optimizer, Megatron's
  ``FP32Optimizer`` / ``Float16OptimizerWithFloat16Params`` (master weights through
  ``param.main_param``), the ``DistributedOptimizer`` over a torch optimizer, or a
  ``ChainedOptimizer`` of them.  Not supported: ``TEGroupedMLP`` / ``GroupedMLP`` (experts stacked
  in TransformerEngine buffers), the precision-aware / hybrid-device ``DistributedOptimizer``,
  Megatron-FSDP, FP8 parameters.
* The ``DistributedOptimizer``: an expert's FP32 main parameter (a separate shard when the model
  parameter is 16-bit, a view of the FP32 model parameter otherwise) and its Adam moments are split
  over the expert-data-parallel ranks by the DDP buckets (each bucket cut into DP-size equal
  chunks, ``_dp_layout``); the same local slot has the same split on every EP rank.  For a move
  from slot ``s`` to slot ``d``, each overlap of a range DP rank ``r1`` owns of ``s``'s parameter
  with a range DP rank ``r2`` owns of ``d``'s goes from (EP rank of ``s``, ``r1``) to (EP rank of
  ``d``, ``r2``), so a shard can change DP index as well as EP rank.  The ranks then agree and
  transfer over ``state_group`` (default: the world), weights and shards in one batch.
* TorchTitan 0.3.0 ``GroupedExperts`` (``w1_EFD``, ``w2_EDF``, ``w3_EFD``: local experts stacked
  on dim 0; DTensor parameters are read through ``to_local()``) with a ``torch.optim`` optimizer
  (TorchTitan's mixed precision keeps FP32 parameters: they are the master weights).

Call it after ``optimizer.step()`` and ``zero_grad()``: gradients are not moved.  The router, its
bias and token counters stay logical and do not move.  The map to save with each checkpoint:
:func:`map_state` / :func:`save_map`; on resume, :func:`load_map` and install it again.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from placement.core.model import InvalidInputError, PlacementError

__all__ = [
    "MAP_KIND",
    "MAP_VERSION",
    "MigrationError",
    "MigrationReport",
    "migrate",
    "plan_moves",
    "moe_layers_of",
    "map_state",
    "maps_from_state",
    "save_map",
    "load_map",
]

MAP_KIND = "placement.live_expert_map"
MAP_VERSION = 1


class MigrationError(PlacementError):
    """A migration was refused or failed before the switch; the old placement is intact (exit 1)."""


@dataclass
class MigrationReport:
    """What one rank did in one migration.

    moved_replicas_per_layer : ``{layer: logical experts of this EP group that changed EP rank}``
        (the same on every rank; the solver's move report counts the same replicas per EP group).
    local_moves : slots filled from another slot of this rank (no bytes over the network).
    sent_bytes, received_bytes : bytes this rank sent / received.
    bytes_by_kind : this rank's sent bytes split into ``weights``, ``master`` and ``optimizer``.
    transfer_s, total_s : wall time of the point-to-point batch, and of the whole call.
    """

    moved_replicas_per_layer: dict[int, int]
    local_moves: int = 0
    sent_bytes: int = 0
    received_bytes: int = 0
    bytes_by_kind: dict[str, int] = field(default_factory=dict)
    transfer_s: float = 0.0
    total_s: float = 0.0

    @property
    def moved_replicas(self) -> int:
        return int(sum(self.moved_replicas_per_layer.values()))

    def to_dict(self) -> dict[str, Any]:
        return {"moved_replicas": self.moved_replicas,
                "moved_replicas_per_layer": {str(k): v for k, v in sorted(self.moved_replicas_per_layer.items())},
                "local_moves": self.local_moves, "sent_bytes": self.sent_bytes,
                "received_bytes": self.received_bytes, "bytes_by_kind": dict(self.bytes_by_kind),
                "transfer_s": self.transfer_s, "total_s": self.total_s}


# ---------------------------------------------------------------------------------------------
# The plan: pure, from the maps alone
# ---------------------------------------------------------------------------------------------
def plan_moves(old: Sequence[int] | np.ndarray, new: Sequence[int] | np.ndarray, ep: int) -> list[tuple[int, int]]:
    """``[(src_slot, dst_slot), ...]`` for one layer: new slot ``dst`` takes the logical expert that
    old slot ``src`` holds (``new[dst] == old[src]``), for every slot whose expert changes.

    old, new : (P,) phy2log before and after, each holding every logical expert ``0 .. E-1`` at
        least once (``P = E``: a permutation; ``P > E``: replicas, :mod:`placement.consumers.replica_runtime`);
    ep : EP ranks (slot ``p`` is on rank ``p // (P / ep)``).

    With replicas an expert has several old slots: the source is one on the destination's EP rank
    when there is one (a local copy), else the lowest.  Every replica of an expert holds the same
    weights and optimizer state (the replica gradient sum), so any one is the expert's state, and a
    dropped replica's state is the state its expert keeps in its other slots.
    Sorted by ``dst``; the order every rank posts its transfers in.
    """
    old_a, new_a = np.asarray(old, dtype=np.int64).reshape(-1), np.asarray(new, dtype=np.int64).reshape(-1)
    n = old_a.shape[0]
    experts = set(old_a.tolist())
    if new_a.shape != (n,) or experts != set(range(len(experts))) or set(new_a.tolist()) != experts:
        raise InvalidInputError(f"phy2log: expected two maps of {n} slots, each holding every expert 0..E-1")
    if ep <= 0 or n % ep:
        raise InvalidInputError(f"ep: {n} experts do not split over {ep} EP ranks")
    per_rank = n // ep
    moves = []
    for p in np.flatnonzero(old_a != new_a):
        holders = np.flatnonzero(old_a == new_a[p])
        local = holders[holders // per_rank == p // per_rank]
        moves.append((int(local[0] if len(local) else holders[0]), int(p)))
    return moves


# ---------------------------------------------------------------------------------------------
# Where each local slot's state lives
# ---------------------------------------------------------------------------------------------
@dataclass
class _Field:
    """One tensor of one slot's state: ``tensor[row]`` (``row`` None: the whole tensor)."""

    kind: str  # "weights" | "master" | "optimizer"
    name: str
    tensor: Any
    row: int | None

    def view(self) -> Any:
        return self.tensor if self.row is None else self.tensor[self.row]


_TITAN_LAYER = re.compile(r"(?:.*\.)?layers\.(?P<layer>\d+)\.moe")
_TITAN_WEIGHTS = ("w1_EFD", "w2_EDF", "w3_EFD")


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def _expert_params(model: Any, layers: Sequence[int]) -> tuple[str, dict[int, list[list[tuple[str, Any, int | None]]]]]:
    """(stack, ``{layer: [slot i: [(name, parameter, row), ...]]}``) for this rank's local slots of ``layers``."""
    stack, found = _scan(model, layers)
    missing = sorted(set(layers) - set(found))
    if missing:
        raise MigrationError(f"layers {missing[:6]}: the model has no MoE layer with these indices")
    return stack, {layer: found[layer] for layer in layers}


def moe_layers_of(model: Any) -> list[int]:
    """The model layer indices of the MoE layers ``model`` holds (one pipeline stage: its own)."""
    return sorted(_scan(model, ())[1])


def _scan(model: Any, layers: Sequence[int]) -> tuple[str, dict[int, list[list[tuple[str, Any, int | None]]]]]:
    found: dict[int, list[list[tuple[str, Any, int | None]]]] = {}
    stack = ""
    for name, module in model.named_modules():
        mlp = getattr(module, "mlp", None)
        experts = getattr(mlp, "experts", None)
        if experts is not None and hasattr(module, "layer_number") and hasattr(mlp, "router"):
            kind = type(experts).__name__
            if kind != "SequentialMLP":
                raise MigrationError(f"{name}.mlp.experts: {kind} experts are not supported by migrate "
                                     "(only Megatron-Core SequentialMLP)")
            layer = int(module.layer_number) - 1
            found[layer] = [[(n, p, None) for n, p in expert.named_parameters()] for expert in experts.local_experts]
            stack = "megatron"
            continue
        routed = getattr(module, "routed_experts", None)
        if routed is not None and hasattr(module, "router"):
            inner = getattr(routed, "inner_experts", None)
            if inner is None or not all(hasattr(inner, w) for w in _TITAN_WEIGHTS):
                raise MigrationError(f"{name or 'model'}.routed_experts: not TorchTitan GroupedExperts "
                                     "(w1_EFD, w2_EDF, w3_EFD)")
            m = _TITAN_LAYER.fullmatch(name)
            if m:
                layer = int(m.group("layer"))
            elif name == "" and len(layers) == 1:
                layer = int(layers[0])
            else:
                raise MigrationError(f"{name or 'model'}: a TorchTitan MoE module whose layer index is not in its name")
            params = [(w, getattr(inner, w)) for w in _TITAN_WEIGHTS]
            rows = int(_local(params[0][1]).shape[0])
            found[layer] = [[(w, p, i) for w, p in params] for i in range(rows)]
            stack = "torchtitan"
    if not found:
        raise MigrationError("model: no MoE layer to migrate")
    return stack, found


def _optimizer_states(optimizer: Any) -> list[Any]:
    """The ``torch.optim.Optimizer`` s behind ``optimizer`` whose state is keyed by the model
    parameters (a Megatron-Core ``DistributedOptimizer`` 's are keyed by its shards: not listed,
    :func:`_distributed_optimizers`), refusing what is not supported."""
    import torch

    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    kind = type(optimizer).__name__
    if hasattr(optimizer, "chained_optimizers"):
        return [o for inner in optimizer.chained_optimizers for o in _optimizer_states(inner)]
    if _is_distributed(optimizer):
        _check_distributed(optimizer)
        return []
    if "Distributed" in kind or kind == "HybridDeviceOptimizer":
        raise MigrationError(f"optimizer: {kind} is not supported by migrate (of the sharded optimizers, only "
                             "Megatron-Core's DistributedOptimizer, with its shard maps, over a torch optimizer)")
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return [inner]
    raise MigrationError(f"optimizer: {kind} is not supported by migrate")


def _is_distributed(optimizer: Any) -> bool:
    return type(optimizer).__name__ == "DistributedOptimizer" and hasattr(optimizer, "model_param_gbuf_map")


def _distributed_optimizers(optimizer: Any) -> list[Any]:
    """The Megatron-Core ``DistributedOptimizer`` s in ``optimizer`` (itself, or in a ``ChainedOptimizer``)."""
    if hasattr(optimizer, "chained_optimizers"):
        return [o for inner in optimizer.chained_optimizers for o in _distributed_optimizers(inner)]
    return [optimizer] if _is_distributed(optimizer) else []


def _check_distributed(dopt: Any) -> None:
    import torch

    kind = type(dopt.optimizer).__name__
    if getattr(dopt, "is_stub_optimizer", False):
        return
    if getattr(dopt.ddp_config, "use_megatron_fsdp", False):
        raise MigrationError("optimizer: DistributedOptimizer over Megatron-FSDP is not supported by migrate")
    if getattr(dopt.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False) or not isinstance(
            dopt.optimizer, torch.optim.Optimizer) or kind == "HybridDeviceOptimizer":
        raise MigrationError(f"optimizer: DistributedOptimizer with {kind} (precision-aware or hybrid-device state) "
                             "is not supported by migrate")


@dataclass
class _Shards:
    """One expert parameter's distributed-optimizer state: how its flat elements split over the
    expert-data-parallel ranks, and this rank's part.

    numel : elements of the whole parameter.
    layout : ``[(dp_rank, lo, hi), ...]`` the parameter's flat range ``[lo, hi)`` each DP rank owns
        (from the bucket's shard boundaries; the same on every EP rank for the same local slot).
    tensors : ``[(kind, name, tensor), ...]`` this rank's shard (shape ``(hi - lo,)``): the FP32
        main parameter when the model parameter is 16-bit (an FP32 one's main shard is a view of
        the weights, which move anyway) and the per-element optimizer state; empty when this rank
        owns no part of the parameter.
    dp_ranks : global ranks of the parameter's data-parallel group, in group order.
    """

    name: str
    numel: int
    layout: list[tuple[int, int, int]]
    tensors: list[tuple[str, str, Any]]
    dp_ranks: list[int]


def _dp_layout(buffer: Any, param: Any) -> list[tuple[int, int, int]]:
    """``[(dp_rank, lo, hi)]``: which part of ``param`` (flat) each DP rank of ``buffer`` owns.

    Megatron-Core 0.16.1 ``DistributedOptimizer._build_model_gbuf_range``: bucket ``b`` (its
    ``offset`` in the buffer, ``grad_data.numel()`` elements) is cut into DP-size equal chunks, chunk
    ``r`` owned by DP rank ``r``; ``buffer.param_index_map[param] = (start, end, bucket)``.
    """
    start, end, bucket_id = buffer.param_index_map[param]
    bucket = buffer.buckets[bucket_id]
    size = int(buffer.data_parallel_group.size())
    chunk = int(bucket.grad_data.numel()) // size
    out = []
    for r in range(size):
        c_lo, c_hi = bucket.offset + r * chunk, bucket.offset + (r + 1) * chunk
        lo, hi = max(start, c_lo), min(end, c_hi)
        if hi > lo:
            out.append((r, lo - start, hi - start))
    return out


def _shard_fields(params: list[tuple[str, Any, int | None]], dopts: list[Any]) -> tuple[list[_Shards], list[float]]:
    """One slot's distributed-optimizer shards (one :class:`_Shards` per parameter a
    ``DistributedOptimizer`` of ``dopts`` holds) and the scalar state of this rank's shards."""
    import torch
    import torch.distributed as dist

    out: list[_Shards] = []
    scalars: list[float] = []
    for name, param, _row in params:
        owner = [(d, b) for d in dopts for b in getattr(d, "buffers", []) if param in b.param_index_map]
        if not owner:
            continue
        dopt, buffer = owner[0]
        layout = _dp_layout(buffer, param)
        tensors: list[tuple[str, str, Any]] = []
        if param in dopt.model_param_group_index_map:
            gi, order = dopt.model_param_group_index_map[param]
            main = dopt.optimizer.param_groups[gi]["params"][order]
            mine = [x for x in layout if x[0] == int(buffer.data_parallel_group.rank())]
            if len(mine) != 1 or main.numel() != mine[0][2] - mine[0][1]:
                raise MigrationError(f"{name}: the distributed optimizer's shard does not match its bucket range")
            if param.dtype != torch.float32:
                tensors.append(("master", f"{name}.main_param", main.data))
            state = dopt.optimizer.state.get(main, {})
            for key in sorted(state):
                value = state[key]
                if not isinstance(value, torch.Tensor):
                    continue
                if value.dim() == 0:
                    scalars.append(float(value.item()))
                elif value.shape == main.shape:
                    tensors.append(("optimizer", f"{name}.{key}", value))
                else:
                    raise MigrationError(f"{name}: optimizer state {key!r} of shape {tuple(value.shape)} is "
                                         "neither per element nor a scalar")
        out.append(_Shards(name, int(param.numel()), layout, tensors,
                           [int(x) for x in dist.get_process_group_ranks(buffer.data_parallel_group)]))
    return out, scalars


def _slot_fields(stack: str, params: list[tuple[str, Any, int | None]], states: list[Any]) -> tuple[list[_Field], list[float]]:
    """The fields of one slot (weights, master, per-element optimizer state) and its scalar states."""
    import torch

    fields: list[_Field] = []
    scalars: list[float] = []
    for name, param, row in params:
        if getattr(param, "_is_float8tensor", False) or type(param).__name__.startswith("Float8"):
            raise MigrationError(f"{name}: FP8 parameters are not supported by migrate")
        master = getattr(param, "main_param", None)
        fields.append(_Field("weights", name, _local(param.data), row))
        if getattr(param, "main_param_sharded", False):  # a DistributedOptimizer's: _shard_fields
            continue
        holders = [param] if master is None else [master]
        if master is not None:
            fields.append(_Field("master", f"{name}.main_param", _local(master.data), row))
        for holder in holders:
            for opt in states:
                state = opt.state.get(holder)
                if not state:
                    continue
                for key in sorted(state):
                    value = state[key]
                    if not isinstance(value, torch.Tensor):
                        continue
                    local = _local(value)
                    if local.dim() == 0 or local.numel() == 1 and local.shape != _local(holder).shape:
                        scalars.append(float(local.item()))
                    elif local.shape == _local(holder).shape:
                        fields.append(_Field("optimizer", f"{name}.{key}", local, row))
                    else:
                        raise MigrationError(f"{name}: optimizer state {key!r} of shape {tuple(local.shape)} is "
                                             "neither per element nor a scalar")
    return fields, scalars


# ---------------------------------------------------------------------------------------------
# The live map and the checkpoint entry
# ---------------------------------------------------------------------------------------------
def _as_maps(new_placement: Any) -> dict[int, np.ndarray]:
    if isinstance(new_placement, Mapping) and new_placement.get("kind") == MAP_KIND:
        return maps_from_state(new_placement)
    if isinstance(new_placement, Mapping) and new_placement and all(
            isinstance(k, (int, np.integer)) for k in new_placement):  # {layer: phy2log}, checked by plan_moves
        return {int(k): np.asarray(v, dtype=np.int64).reshape(-1) for k, v in sorted(new_placement.items())}
    from placement.consumers.runtime import expert_map

    return {layer: np.asarray(m.phy2log, dtype=np.int64) for layer, m in expert_map(new_placement).items()}


def map_state(maps: Mapping[int, Sequence[int] | np.ndarray] | Any) -> dict[str, Any]:
    """The checkpoint entry of the live map: ``{"kind", "version", "layers": {layer: phy2log}}``,
    plus ``"num_experts": E`` when the maps hold replicas (more slots than experts).

    ``maps``: ``{layer: phy2log}`` or the live map (:class:`placement.consumers.runtime.InstalledMap` or
    :class:`placement.consumers.replica_runtime.InstalledReplicas`: the layers this process holds).  Put it in
    the state dict the job saves (e.g. ``state["expert_map"] = map_state(live)``) or write it beside
    the checkpoint with :func:`save_map`.
    """
    if not isinstance(maps, Mapping):
        maps = {int(layer): maps.phy2log(layer) for layer in _live_layers(maps)}
    rows = {str(int(k)): [int(x) for x in np.asarray(v).tolist()] for k, v in sorted(maps.items())}
    out: dict[str, Any] = {"kind": MAP_KIND, "version": MAP_VERSION, "layers": rows}
    if any(len(set(row)) < len(row) for row in rows.values()):
        out["num_experts"] = 1 + max(max(row) for row in rows.values())
    return out


def maps_from_state(state: Mapping[str, Any], where: str = "expert_map") -> dict[int, np.ndarray]:
    """``{layer: phy2log}`` from :func:`map_state`'s entry (checked: kind, version, and every row a
    permutation, or with ``num_experts`` every expert ``0 .. E-1`` at least once and no other id)."""
    if not isinstance(state, Mapping) or state.get("kind") != MAP_KIND:
        raise InvalidInputError(f"{where}: kind: expected {MAP_KIND!r}")
    if state.get("version") != MAP_VERSION:
        raise InvalidInputError(f"{where}: version: expected {MAP_VERSION}, found {state.get('version')!r}")
    layers = state.get("layers")
    if not isinstance(layers, Mapping) or not layers:
        raise InvalidInputError(f"{where}: layers: expected a non-empty object of layer -> phy2log")
    num_experts = state.get("num_experts")
    if num_experts is not None and (not isinstance(num_experts, int) or isinstance(num_experts, bool)
                                    or num_experts < 1):
        raise InvalidInputError(f"{where}: num_experts: expected a positive integer, found {num_experts!r}")
    out: dict[int, np.ndarray] = {}
    for key, perm in layers.items():
        if not str(key).isdigit() or not isinstance(perm, list) or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in perm):
            raise InvalidInputError(f"{where}: layers.{key}: expected a list of expert ids under a layer index")
        if num_experts is None and sorted(perm) != list(range(len(perm))):
            raise InvalidInputError(f"{where}: layers.{key}: expected a permutation of 0..E-1 under a layer index")
        if num_experts is not None and set(perm) != set(range(num_experts)):
            raise InvalidInputError(f"{where}: layers.{key}: expected every expert 0..{num_experts - 1} at least once "
                                    "and no other id (num_experts)")
        out[int(key)] = np.asarray(perm, dtype=np.int64)
    return dict(sorted(out.items()))


def save_map(path: str | os.PathLike[str], maps: Any) -> None:
    """Write :func:`map_state` of ``maps`` to ``path`` atomically (temp file, fsync, ``os.replace``)."""
    from placement.formats import atomic_write_text

    atomic_write_text(path, json.dumps(map_state(maps), indent=1) + "\n")


def load_map(path: str | os.PathLike[str]) -> dict[int, np.ndarray]:
    """``{layer: phy2log}`` from a file :func:`save_map` wrote."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise InvalidInputError(f"{path}: not a readable expert-map file ({e})") from None
    return maps_from_state(doc, str(path))


def _live_layers(live_map: Any) -> list[int]:
    layers = getattr(live_map, "layers", None)
    if layers is None:
        raise MigrationError("live_map: expected the object install_megatron / install_torchtitan returned")
    return sorted(int(x) for x in (layers() if callable(layers) else layers))


# ---------------------------------------------------------------------------------------------
# migrate
# ---------------------------------------------------------------------------------------------
def _agree(ok: bool, group: Any) -> bool:
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item() == 1)


def _same_everywhere(values: list[int], group: Any) -> bool:
    """All ranks of ``group`` hold the same integers (compared by MIN and MAX all-reduces)."""
    import torch
    import torch.distributed as dist

    lo = torch.tensor(values, dtype=torch.int64)
    hi = lo.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    return bool(torch.equal(lo, hi))


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big")


def _check_received(buffers: list[Any]) -> None:
    """Raise if a received buffer holds a non-finite number (a torn or corrupted transfer)."""
    import torch

    for b in buffers:
        if b.is_floating_point() and not bool(torch.isfinite(b).all()):
            raise MigrationError("received expert state with non-finite values")


def migrate(model: Any, optimizer: Any, new_placement: Any, *, live_map: Any, group: Any = None,
            state_group: Any = None) -> MigrationReport:
    """Move every re-placed expert's weights, master weights and optimizer state to its new EP rank,
    then switch the live map (module docstring: protocol, what is supported).

    Parameters
    ----------
    model : torch.nn.Module
        This rank's model (Megatron-Core ``GPTModel`` or pipeline stage, or a TorchTitan decoder),
        its experts in physical order under ``live_map``.
    optimizer : the job's optimizer (torch.optim, or Megatron-Core's wrapper of one).
    new_placement : ``{layer: phy2log}`` (model layer index -> (E,) logical expert of each slot), a
        permutation document or its path, or a :func:`map_state` entry; every layer of ``live_map``.
    live_map : the :class:`placement.consumers.runtime.InstalledMap` that :func:`placement.consumers.runtime.install_megatron` /
        :func:`placement.consumers.runtime.install_torchtitan` returned (``phy2log(layer)``, ``update(maps)``).
    group : the expert-parallel process group (default: Megatron-Core's
        ``parallel_state.get_expert_model_parallel_group()``; TorchTitan: ``mesh["ep"].get_group()``).
    state_group : the ranks that agree before anything changes (all switch or none): every rank of
        the EP group and of the expert-data-parallel groups of its members, over which a
        ``DistributedOptimizer`` 's shards also move.  Default: the whole world, so every rank of
        the job calls ``migrate`` at the same step boundary (pipeline stages each with their layers).

    Returns
    -------
    MigrationReport
        This rank's transfers; ``moved_replicas_per_layer`` is the same on every rank.

    Raises
    ------
    MigrationError
        On every rank of the group, when any rank refuses or fails before the switch; the old map,
        weights and optimizer state are then unchanged everywhere.
    """
    import torch
    import torch.distributed as dist

    t_start = time.perf_counter()
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_expert_model_parallel_group()
    ep, me = dist.get_world_size(group), dist.get_rank(group)
    dopts = _distributed_optimizers(optimizer)
    # every rank agrees, not only this EP group: the expert-data-parallel replicas of a slot must all
    # switch or none (one EP group switching alone would average different experts' gradients); and
    # with a distributed optimizer a shard may go to another DP index than its owner's: the shards
    # move over state_group too
    xgroup = state_group if state_group is not None else dist.group.WORLD
    me_global = dist.get_rank()

    # 1. plan and agree
    ok, error = True, ""
    plans: dict[int, list[tuple[int, int]]] = {}
    fields: dict[int, list[list[_Field]]] = {}
    shards: dict[int, list[list[_Shards]]] = {}
    new_maps: dict[int, np.ndarray] = {}
    signature: list[int] = [-1, -1, -1]
    scalars: list[float] = []
    dp_members: list[int] = []
    try:
        new_maps = _as_maps(new_placement)
        layers = sorted(new_maps)
        stack, params = _expert_params(model, layers)
        states = _optimizer_states(optimizer)
        sig_text = [stack, str(ep), str(len(dopts))]
        shard_scalars: list[float] = []
        for layer in layers:
            try:
                old = np.asarray(live_map.phy2log(layer), dtype=np.int64).reshape(-1)
            except (KeyError, IndexError):
                raise MigrationError(f"new_placement: layer {layer} has no live map") from None
            plans[layer] = plan_moves(old, new_maps[layer], ep)
            per_rank = old.shape[0] // ep
            if len(params[layer]) != per_rank:
                raise MigrationError(f"layer {layer}: {len(params[layer])} local experts, the map gives {per_rank} per rank")
            fields[layer], shards[layer] = [], []
            for slot in params[layer]:
                f, s = _slot_fields(stack, slot, states)
                fields[layer].append(f)
                scalars += s
                sh, s = _shard_fields(slot, dopts)
                shards[layer].append(sh)
                shard_scalars += s
            sig_text.append(f"{layer}:{old.tolist()}:{new_maps[layer].tolist()}")
            sig_text += [f"{x.kind}/{x.name}/{tuple(x.view().shape)}/{x.view().dtype}" for x in fields[layer][0]]
            sig_text += [f"{x.name}/{x.numel}/{x.layout}" for sl in shards[layer] for x in sl]
            if any([(x.name, x.view().shape, x.view().dtype) for x in f] !=
                   [(x.name, x.view().shape, x.view().dtype) for x in fields[layer][0]] for f in fields[layer]):
                raise MigrationError(f"layer {layer}: local experts hold state of different layouts")
            for sl in shards[layer]:
                for x in sl:
                    dp_members = dp_members or x.dp_ranks
                    if x.dp_ranks != dp_members:
                        raise MigrationError(f"{x.name}: expert parameters of different data-parallel groups")
        lo, hi = (min(scalars), max(scalars)) if scalars else (0.0, 0.0)
        if lo != hi or not all(math.isfinite(x) for x in (lo, hi)):
            raise MigrationError(f"optimizer: scalar state differs between experts ({lo} .. {hi})")
        if shard_scalars and (min(shard_scalars) != max(shard_scalars) or scalars and shard_scalars[0] != lo):
            raise MigrationError("optimizer: scalar state differs between experts' distributed-optimizer shards")
        signature = [_digest("|".join(sig_text)), struct.unpack("<q", struct.pack("<d", lo))[0], len(scalars)]
    except Exception as e:  # every rank must reach the agreement, whatever failed
        ok, error = False, str(e) if isinstance(e, (MigrationError, InvalidInputError)) else f"{type(e).__name__}: {e}"
    agreed = _agree(ok, xgroup)
    agreed = _same_everywhere([int(x) for x in signature], group) and agreed  # pipeline stages differ
    agreed = _agree(agreed, xgroup)
    if not agreed:
        raise MigrationError(error or "migrate: another EP rank refused, or the ranks' plans or state layouts differ; "
                             "nothing moved")
    ep_members = [int(dist.get_global_rank(group, r)) for r in range(ep)]
    owner: dict[tuple[int, int], int] = {}  # (EP rank, expert-DP rank) -> global rank
    has_shards = torch.tensor([1 if any(x for layer in shards for sl in shards[layer] for x in sl) else 0])
    dist.all_reduce(has_shards, op=dist.ReduceOp.MAX, group=xgroup)  # every rank takes the same branch
    if int(has_shards.item()):
        coords: list[Any] = [None] * dist.get_world_size(xgroup)
        dist.all_gather_object(coords, (me_global, ep_members, dp_members), group=xgroup)
        dp_of = {int(g): list(d) for g, _e, d in coords}
        ep_of = {int(g): list(e) for g, e, _d in coords}
        try:
            owner = {(a, b): dp_of[ep_members[a]][b] for a in range(ep) for b in range(len(dp_members))}
            ok = all(ep_of[owner[(a, b)]] == [owner[(c, b)] for c in range(ep)] for a, b in owner)
        except (KeyError, IndexError):
            ok = False
        if not _agree(ok, xgroup):
            raise MigrationError("state_group: does not hold the EP group and the expert-data-parallel groups of its "
                                 "members, or they are not laid out as a grid; nothing moved")

    # 2. transfer into scratch
    report = MigrationReport({layer: sum(1 for s, d in plans[layer] if s // (len(new_maps[layer]) // ep)
                                         != d // (len(new_maps[layer]) // ep)) for layer in plans})
    scratch: list[tuple[list[_Field], list[Any]]] = []  # (destination fields, buffers by dtype)
    received: list[Any] = []
    ops: list[Any] = []
    sent_keep: list[Any] = []

    def post(src_fields: list[_Field], dst_fields: list[_Field], sender: int, receiver: int, local: bool) -> None:
        """Pack / receive one message per dtype: ``src_fields`` on ``sender``, ``dst_fields`` on
        ``receiver`` (global ranks; either list is empty on the rank that is not that end)."""
        template = dst_fields or src_fields
        dtypes = sorted({str(f.view().dtype) for f in template})
        for dtype_name in dtypes:
            group_fields = [i for i, f in enumerate(template) if str(f.view().dtype) == dtype_name]
            if sender == me_global:
                packed = torch.cat([src_fields[i].view().reshape(-1) for i in group_fields])
            if receiver == me_global and sender == me_global:
                scratch.append(([dst_fields[i] for i in group_fields], [packed.clone()]))
                report.local_moves += 1 if local and dtype_name == dtypes[0] else 0
            elif sender == me_global:
                sent_keep.append(packed)
                ops.append(dist.P2POp(dist.isend, packed, receiver, xgroup))
                report.sent_bytes += packed.numel() * packed.element_size()
                for i in group_fields:
                    v = src_fields[i].view()
                    kind = src_fields[i].kind
                    report.bytes_by_kind[kind] = report.bytes_by_kind.get(kind, 0) + v.numel() * v.element_size()
            else:
                numel = sum(dst_fields[i].view().numel() for i in group_fields)
                buf = torch.empty(numel, dtype=dst_fields[group_fields[0]].view().dtype)
                scratch.append(([dst_fields[i] for i in group_fields], [buf]))
                received.append(buf)
                ops.append(dist.P2POp(dist.irecv, buf, sender, xgroup))
                report.received_bytes += buf.numel() * buf.element_size()

    try:
        with torch.no_grad():
            for layer in sorted(plans):
                per_rank = len(new_maps[layer]) // ep
                for src, dst in plans[layer]:
                    src_rank, dst_rank = src // per_rank, dst // per_rank
                    # the weights (and non-sharded state): within each EP group, replica to replica
                    if me in (src_rank, dst_rank):
                        post(fields[layer][src % per_rank] if src_rank == me else [],
                             fields[layer][dst % per_rank] if dst_rank == me else [],
                             ep_members[src_rank], ep_members[dst_rank], local=True)
                    # the distributed optimizer's shards: each overlap of an owner's range on the old
                    # slot with an owner's range on the new slot, from that owner to this one
                    for s_sh, d_sh in zip(shards[layer][src % per_rank], shards[layer][dst % per_rank]):
                        for r1, lo1, hi1 in s_sh.layout:
                            for r2, lo2, hi2 in d_sh.layout:
                                a, b = max(lo1, lo2), min(hi1, hi2)
                                sender, receiver = owner[(src_rank, r1)], owner[(dst_rank, r2)]
                                if b <= a or me_global not in (sender, receiver):
                                    continue
                                post([_Field(k, n, t[a - lo1:b - lo1], None) for k, n, t in s_sh.tensors]
                                     if sender == me_global else [],
                                     [_Field(k, n, t[a - lo2:b - lo2], None) for k, n, t in d_sh.tensors]
                                     if receiver == me_global else [],
                                     sender, receiver, local=False)
        ok = True
    except Exception as e:  # as above
        ok, error = False, f"preparing the transfer: {type(e).__name__}: {e}"
    # every rank has its buffers and operations ready before any point-to-point operation is posted
    # (a rank that failed posts nothing, and no peer waits for it)
    if not _agree(ok, xgroup):
        raise MigrationError(error or "migrate: another EP rank failed preparing the transfer; nothing moved")
    try:
        t_transfer = time.perf_counter()
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        report.transfer_s = time.perf_counter() - t_transfer
        _check_received(received)
        ok, error = True, ""
    except Exception as e:  # as above
        ok, error = False, f"transfer: {e}"

    # 3. agree again, 4. commit
    if not _agree(ok, xgroup):
        raise MigrationError(error or "migrate: another EP rank failed before the switch; the old placement is kept")
    with torch.no_grad():
        for targets, (buf,) in scratch:
            offset = 0
            for target in targets:
                v = target.view()
                v.copy_(buf[offset:offset + v.numel()].view(v.shape))
                offset += v.numel()
    live_map.update({layer: new_maps[layer] for layer in sorted(new_maps)})
    report.total_s = time.perf_counter() - t_start
    return report
