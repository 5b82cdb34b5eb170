"""Dispatch-time expert map for training: the router stays logical, tokens go to physical slots.

The offline checkpoint permutation (:mod:`placement.consumers.checkpoint`) renumbers the router together
with the experts, which is exact only when each expert group stays in one block of slots
(group-limited routing scores groups over contiguous ids).  This module instead keeps the router
choosing **logical** experts, so group-limited routing, the aux-loss-free bias and the balancing
counters stay untouched and in logical order, and remaps each chosen expert to the **physical**
slot that holds it, between the router and the token dispatcher.  The expert weights are stored in
physical order: permute the checkpoint with ``keep_router=True``
(``apply_permutation(..., keep_router=True)``, :func:`placement.consumers.checkpoint.permute_dcp`), so
slot ``p`` holds logical expert ``phy2log[p]``.  Any permutation is then valid for training,
group-preserving or not.

The live map
------------
:func:`install_megatron` and :func:`install_torchtitan` return an :class:`InstalledMap`.  At
install it builds, per MoE layer, two int64 index tensors on the device of the layer's parameters,
``phy2log`` (E,) and ``log2phy`` (E,); the hooks read only these tensors (no Python data, no
host-to-device copy, no stream sync per call), so they are legal inside CUDA-graph capture.
:meth:`InstalledMap.update` writes a new map into the **same** tensors (``Tensor.copy_``): a
captured graph replays with the new map.  :meth:`InstalledMap.phy2log` (one layer) and :meth:`InstalledMap.maps` (all) read the current
map back;
:meth:`InstalledMap.tensors` hands out the live tensors; :meth:`InstalledMap.remove` removes the
hooks.  Install after the model is on its device and parallelized (the tensors do not follow a
later ``model.to(...)``); a model still on the ``meta`` device is refused.

``placement.consumers.migrate.migrate`` (live re-placement at a step boundary) builds on this object: it
moves the expert weights and optimizer state between EP ranks, then calls
``installed.update(new_maps)``; :meth:`InstalledMap.layers` says which layers this process holds.

Hooks (torch is imported lazily)
--------------------------------
- Megatron-Core (read against 0.16.1, core_v0.19.0 and main: ``megatron/core/transformer/moe/
  moe_layer.py``, ``router.py``, ``multi_token_prediction.py``, ``moe/router_trace.py``): the map
  wraps each ``MoELayer``'s ``route`` method (an instance attribute; every caller in those
  versions, ``MoELayer.forward``, ``TransformerLayer`` and ``fine_grained_callables``, calls
  ``mlp.route``).  ``route`` calls the router, whose ``TopKRouter.forward`` returns
  ``(probs, routing_map)``, both (tokens, E) in logical order, after it has updated
  ``local_tokens_per_expert`` (the aux-loss-free counter) and computed the aux losses; the
  wrapper returns their columns in physical order, ``probs[:, phy2log]``, which is what the
  dispatcher and the experts (stored in physical order) consume.  Forward hooks on the router
  module (Megatron-LM's ``RouterTracer``, registered inside ``train()`` after the user installed
  the map, and :class:`placement.sources.importers.recorder.RouterRecorder`) therefore see **logical**
  ids whatever the order of registration.  Under ``cuda_graph_scope=moe_router`` the graph
  captures the router (logical) and the wrapper remaps the replayed outputs.
  Layers are found by their global position: a decoder layer's ``layer_number - 1`` (global
  across pipeline stages and virtual-pipeline chunks; pass the list of model chunks), and the MoE
  layer of multi-token-prediction layer ``j`` (module ``mtp.layers.{j}``) as ``num_layers + j``,
  whatever its inner ``layer_number`` (0.16.1 numbers it ``num_layers + j + 1``, core_v0.19.0 and
  main ``j + 1``).
- TorchTitan (read against 0.3.0 and main, ``torchtitan/models/common/moe.py``,
  ``models/deepseek_v3/mtp.py``, ``protocols/module.py``): a forward pre-hook on each
  ``MoE.routed_experts``.  ``MoE.forward`` adds the logical counts to ``tokens_per_expert_E``
  (its bias update reads them) before calling ``routed_experts(x, scores, expert_ids,
  num_tokens_per_expert)``; the hook maps ``expert_ids`` to ``log2phy[expert_ids]`` and the
  counts to physical order, ``counts[phy2log]``.  Under tensor or context parallelism these
  arguments are DTensors (``Module.parallelize`` wraps ``forward``, so pre-hooks run before the
  DTensor-to-local conversion): the hook maps the local shards and keeps the placements (ids:
  sharded on tokens or replicated; counts: replicated or partial sums).  Decoder MoE modules are
  ``layers.{i}.moe``; main's MTP modules ``mtp_layers.{j}.moe`` are layer ``num_layers + j``.

Expert parallelism needs nothing more: both stacks give EP rank ``r`` the slots
``r * E / ep ...``, so the physical order is the placement.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from placement.core.model import InvalidInputError
from placement.core.permutation import check_permutation, inverse_permutation, read_expert_permutation

__all__ = ["ExpertMap", "InstalledMap", "expert_map", "install_megatron", "install_torchtitan", "megatron_moe_layers", "remove"]


@dataclass(frozen=True)
class ExpertMap:
    """One MoE layer's map: ``phy2log`` (E,) and its inverse ``log2phy`` (E,)."""

    layer: int
    phy2log: tuple[int, ...]

    @property
    def log2phy(self) -> tuple[int, ...]:
        return tuple(int(x) for x in inverse_permutation(self.phy2log))


def _read_maps(layers_or_doc: Any) -> tuple[dict[int, ExpertMap], int | None]:
    """(maps, the document's ``num_layers`` or None)."""
    source: Any = layers_or_doc
    num_layers = None
    if isinstance(source, str) or "kind" in source:
        layers, doc = read_expert_permutation(source if isinstance(source, str) else dict(source))
        if isinstance(doc.get("num_layers"), int):
            num_layers = int(doc["num_layers"])
    else:
        layers = {int(k): np.asarray(v) for k, v in source.items()}
    maps = {layer: ExpertMap(layer, tuple(check_permutation(layer, perm))) for layer, perm in sorted(layers.items())}
    return maps, num_layers


def expert_map(layers_or_doc: Mapping[int, Sequence[int] | np.ndarray] | Mapping[str, Any] | str) -> dict[int, ExpertMap]:
    """``{model layer index: ExpertMap}`` from ``{layer: phy2log}`` or a permutation document / its path."""
    return _read_maps(layers_or_doc)[0]


class _Handle:
    """Undoes one installation step (a hook handle or a method override)."""

    def __init__(self, undo: Any) -> None:
        self._undo = undo

    def remove(self) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None


class InstalledMap:
    """The live expert map of one model (or one pipeline stage's model chunks).

    Holds per installed MoE layer the device tensors ``phy2log`` (E,) and ``log2phy`` (E,) that
    the hooks read.  Iterating yields the hook handles (the list the old API returned).
    """

    def __init__(self, stack: str) -> None:
        self.stack = stack
        self._tensors: dict[int, tuple[Any, Any]] = {}
        self._handles: list[Any] = []

    # -- building (install_*) ------------------------------------------------------------------
    def _add_layer(self, torch: Any, layer: int, m: ExpertMap, device: Any) -> tuple[Any, Any]:
        if layer in self._tensors:
            raise InvalidInputError(f"layer {layer}: two {self.stack} MoE modules claim this layer")
        if getattr(device, "type", None) == "meta":
            raise InvalidInputError(
                f"layer {layer}: the {self.stack} model is on the meta device; install the map after it is "
                "materialised on its device"
            )
        # Built once, here; the hooks only index with these tensors.
        p2l = torch.tensor(m.phy2log, dtype=torch.long, device=device)
        l2p = torch.tensor(m.log2phy, dtype=torch.long, device=device)
        self._tensors[layer] = (p2l, l2p)
        return p2l, l2p

    # -- the public interface ------------------------------------------------------------------
    @property
    def layers(self) -> tuple[int, ...]:
        """The model layer indices (global; MTP layers ``num_layers + j``) installed here."""
        return tuple(sorted(self._tensors))

    @property
    def handles(self) -> list[Any]:
        return list(self._handles)

    def __iter__(self) -> Any:
        return iter(list(self._handles))

    def __len__(self) -> int:
        return len(self._handles)

    def tensors(self, layer: int) -> tuple[Any, Any]:
        """The live ``(phy2log, log2phy)`` device tensors of ``layer`` (do not resize them)."""
        if layer not in self._tensors:
            raise InvalidInputError(f"layer {layer}: no expert map installed for it here (layers {list(self.layers)[:6]})")
        return self._tensors[layer]

    def phy2log(self, layer: int) -> np.ndarray:
        """(E,) int64 copy of the map ``layer``'s hook applies now (read from the device tensor)."""
        return np.asarray(self.tensors(layer)[0].detach().cpu().numpy(), dtype=np.int64)

    def log2phy(self, layer: int) -> np.ndarray:
        """(E,) int64 copy of the inverse map of ``layer``."""
        return np.asarray(self.tensors(layer)[1].detach().cpu().numpy(), dtype=np.int64)

    def maps(self) -> dict[int, np.ndarray]:
        """``{layer: (E,) phy2log}`` of every layer installed here, as the hooks apply them now
        (what a checkpoint should save beside the experts' physical order)."""
        return {layer: self.phy2log(layer) for layer in self.layers}

    def update(self, layers: Any, *, strict: bool = False) -> list[int]:
        """Replace the maps of the given layers in place (same tensors, new contents).

        Parameters
        ----------
        layers : ``{layer: phy2log}``, a permutation document, or its path
            Layers not installed here (other pipeline stages) are ignored unless ``strict``.
        strict : bool
            Every given layer must be installed here.

        Returns
        -------
        list of int
            The layers whose map changed.

        Every row is checked before any tensor is written, so a bad input leaves the old map.
        """
        import torch

        maps = expert_map(layers)
        absent = sorted(set(maps) - set(self._tensors))
        if strict and absent:
            raise InvalidInputError(f"layers {absent[:6]}: no {self.stack} MoE layer here to update")
        todo: list[tuple[int, Any, Any]] = []
        for layer, m in maps.items():
            if layer not in self._tensors:
                continue
            p2l, l2p = self._tensors[layer]
            if len(m.phy2log) != p2l.numel():
                raise InvalidInputError(f"layer {layer}: map has {len(m.phy2log)} experts, the installed one {p2l.numel()}")
            todo.append((layer, torch.tensor(m.phy2log, dtype=torch.long), torch.tensor(m.log2phy, dtype=torch.long)))
        changed = []
        with torch.no_grad():
            for layer, new_p2l, new_l2p in todo:
                p2l, l2p = self._tensors[layer]
                if not torch.equal(p2l.detach().cpu(), new_p2l):
                    changed.append(layer)
                p2l.copy_(new_p2l)
                l2p.copy_(new_l2p)
        return changed

    def remove(self) -> None:
        """Remove every hook (the model routes by the stored order again)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()


def remove(handles: InstalledMap | Sequence[Any]) -> None:
    """Remove hooks returned by :func:`install_megatron` / :func:`install_torchtitan`."""
    if isinstance(handles, InstalledMap):
        handles.remove()
        return
    for h in handles:
        h.remove()


def _param_device(torch: Any, module: Any) -> Any:
    for p in module.parameters():
        return p.device
    for b in module.buffers():
        return b.device
    return torch.device("cpu")


def _check_found(maps: Mapping[int, ExpertMap], found: set[int], strict: bool, stack: str) -> None:
    if not found:
        raise InvalidInputError(f"{stack}: the model has no MoE layer to install the expert map on")
    missing = sorted(set(maps) - found)
    if strict and missing:
        raise InvalidInputError(
            f"layers {missing[:6]}: expert maps for layers the {stack} model does not have (one pipeline stage: "
            "pass strict=False)"
        )


# ---------------------------------------------------------------------------------------------
# Megatron-Core
# ---------------------------------------------------------------------------------------------
_MC_MTP = re.compile(r"(?:^|\.)mtp\.layers\.(\d+)\.(.*)$")


def _megatron_layer(name: str, module: Any, parents: Mapping[str, Any]) -> int:
    """Global model layer index of the ``MoELayer`` ``module`` named ``name`` in its chunk."""
    config = module.router.config
    mtp = _MC_MTP.search(name)
    if mtp:
        inner = mtp.group(2)
        if re.search(r"(?:^|\.)layers\.\d+\.", inner):
            raise InvalidInputError(
                f"{name}: an MTP head with a stack of inner layers (hybrid MTP) is not supported by placement.consumers.runtime"
            )
        if getattr(config, "mtp_use_repeated_layer", False):
            raise InvalidInputError(
                f"{name}: mtp_use_repeated_layer shares one MTP layer between depths; placement.consumers.runtime maps each "
                "MTP depth's MoE layer separately and does not support it"
            )
        return int(config.num_layers) + int(mtp.group(1))
    parent = parents.get(name.rsplit(".", 1)[0]) if "." in name else None
    number = getattr(parent, "layer_number", None)
    if number is None:
        raise InvalidInputError(f"{name or 'model'}: a Megatron MoE layer outside a TransformerLayer (no layer_number)")
    return int(number) - 1


def megatron_moe_layers(model: Any) -> Iterator[tuple[int, str, Any]]:
    """``(global model layer index, module name in its chunk, MoELayer)`` for every Megatron-Core
    MoE layer of ``model`` (a module, wrappers included, or the list of model chunks one pipeline
    rank holds), in module order; an MoE layer is a module with a ``route`` method and a ``router``
    that has a ``config`` (Megatron-Core 0.16.1 ``MoELayer``).  The one walk that the expert map
    (:func:`install_megatron`) and the replica dispatch (:mod:`placement.consumers.replica_runtime`) share."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    for chunk in chunks:
        parents = dict(chunk.named_modules())
        for name, module in parents.items():
            router = getattr(module, "router", None)
            if router is None or not callable(getattr(module, "route", None)) or not hasattr(router, "config"):
                continue
            yield _megatron_layer(name, module, parents), name, module


def install_megatron(model: Any, layers: Any, *, strict: bool = True) -> InstalledMap:
    """Install the map on every MoE layer of a Megatron-Core model, or a list of model chunks.

    Parameters
    ----------
    model : torch.nn.Module or list of torch.nn.Module
        A ``GPTModel`` (or any module holding ``TransformerLayer`` s, wrappers such as DDP or
        ``Float16Module`` included), or the list of model chunks one pipeline rank holds under
        virtual pipeline parallelism.  Layers are matched by global position (module docstring).
    layers : ``{layer: phy2log}``, a permutation document, or its path
    strict : bool
        Every map must have a layer in ``model`` (pass ``False`` for one pipeline stage: maps of
        other stages' layers are then ignored).  Every MoE layer of ``model`` must have a map
        either way (without one it would send tokens to the wrong experts).

    Returns
    -------
    InstalledMap
        The live map; ``rt.remove(result)`` or ``result.remove()`` removes the hooks.
    """
    import torch

    maps, _ = _read_maps(layers)
    installed = InstalledMap("Megatron")
    found: set[int] = set()
    try:
        for layer, name, module in megatron_moe_layers(model):
            router = module.router
            found.add(layer)
            if layer not in maps:
                raise InvalidInputError(f"layer {layer}: a Megatron MoE layer ({name}) without an expert map")
            num_experts = int(router.config.num_moe_experts)
            if len(maps[layer].phy2log) != num_experts:
                raise InvalidInputError(
                    f"layer {layer}: map has {len(maps[layer].phy2log)} experts, the router {num_experts}"
                )
            if layer in installed._tensors:
                raise InvalidInputError(f"layer {layer}: two Megatron MoE modules claim this layer ({name})")
            if "route" in vars(module):
                raise InvalidInputError(f"layer {layer}: {name} already has an expert map installed")
            p2l, _ = installed._add_layer(torch, layer, maps[layer], _param_device(torch, router))
            installed._handles.append(_override_route(module, p2l))
        _check_found(maps, found, strict, "Megatron")
    except BaseException:
        installed.remove()
        raise
    return installed


def _override_route(moe_layer: Any, p2l: Any) -> _Handle:
    original = moe_layer.route  # the bound class method

    def route(*args: Any, **kwargs: Any) -> Any:
        probs, routing_map = original(*args, **kwargs)
        return probs.index_select(-1, p2l), routing_map.index_select(-1, p2l)

    object.__setattr__(moe_layer, "route", route)

    def undo() -> None:
        if vars(moe_layer).get("route") is route:
            object.__delattr__(moe_layer, "route")

    return _Handle(undo)


# ---------------------------------------------------------------------------------------------
# TorchTitan
# ---------------------------------------------------------------------------------------------
_TITAN_WRAPPERS = re.compile(r"(?:^|\.)(?:_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)(?=\.|$)")
_TITAN_LAYER = re.compile(r"(?:.*\.)?layers\.(?P<layer>\d+)\.moe")
_TITAN_MTP = re.compile(r"(?:.*\.)?mtp_layers\.(?P<mtp>\d+)\.moe")


def _titan_num_layers(model: Any, doc_num_layers: int | None) -> int:
    if doc_num_layers is not None:
        return doc_num_layers
    layers = getattr(model, "layers", None)
    if layers is None:
        raise InvalidInputError("TorchTitan: MTP layers need num_layers: install from the exported permutation file")
    keys = sorted(int(k) for k in (layers.keys() if hasattr(layers, "keys") else range(len(layers))))
    if keys != list(range(len(keys))):
        raise InvalidInputError("TorchTitan: MTP layers on a pipeline stage: install from the exported permutation file")
    return len(keys)


def install_torchtitan(model: Any, layers: Any, *, strict: bool = True) -> InstalledMap:
    """Install the map on every ``MoE`` module of a TorchTitan model (or a single ``MoE``).

    Parameters
    ----------
    model : torch.nn.Module
        A TorchTitan decoder (MoE modules named ``layers.{i}.moe``, ``i`` the model's layer index;
        MTP modules ``mtp_layers.{j}.moe``, layer ``num_layers + j``), parallelized or not, or one
        ``MoE`` module (then ``layers`` must hold exactly one map).
    layers : ``{layer: phy2log}``, a permutation document, or its path
    strict : bool
        As for :func:`install_megatron`.

    Returns
    -------
    InstalledMap
        The live map.
    """
    import torch

    maps, doc_num_layers = _read_maps(layers)
    installed = InstalledMap("TorchTitan")
    found: set[int] = set()
    try:
        for raw_name, module in model.named_modules():
            experts = getattr(module, "routed_experts", None)
            if experts is None or not hasattr(module, "router"):
                continue
            name = _TITAN_WRAPPERS.sub("", raw_name).lstrip(".")
            m, mtp = _TITAN_LAYER.fullmatch(name), _TITAN_MTP.fullmatch(name)
            if mtp:
                layer = _titan_num_layers(model, doc_num_layers) + int(mtp.group("mtp"))
            elif m:
                layer = int(m.group("layer"))
            elif name == "" and len(maps) == 1:
                layer = next(iter(maps))
            else:
                raise InvalidInputError(f"{raw_name or 'model'}: a TorchTitan MoE module whose layer index is not in its name")
            found.add(layer)
            if layer not in maps:
                raise InvalidInputError(f"layer {layer}: a TorchTitan MoE layer ({raw_name}) without an expert map")
            p2l, l2p = installed._add_layer(torch, layer, maps[layer], _param_device(torch, experts))
            installed._handles.append(experts.register_forward_pre_hook(_titan_pre_hook(layer, p2l, l2p)))
        _check_found(maps, found, strict, "TorchTitan")
    except BaseException:
        installed.remove()
        raise
    return installed


def _titan_pre_hook(layer: int, p2l: Any, l2p: Any) -> Any:
    def pre_hook(_mod: Any, args: tuple) -> tuple:
        if len(args) != 4:
            raise InvalidInputError(
                f"layer {layer}: TorchTitan routed_experts called with {len(args)} positional arguments, the map "
                "expects (x, scores, expert_ids, num_tokens_per_expert)"
            )
        x, scores, expert_ids, counts = args
        return x, scores, _lookup(layer, l2p, expert_ids), _select(layer, counts, p2l)

    return pre_hook


def _dtensor_parts(t: Any) -> tuple[Any, Any] | None:
    """(local tensor, rebuild(local) -> DTensor) of a DTensor, None for a plain tensor."""
    to_local = getattr(t, "to_local", None)
    if to_local is None or not hasattr(t, "placements"):
        return None
    from torch.distributed.tensor import DTensor

    mesh, placements, shape, stride = t.device_mesh, t.placements, t.shape, t.stride()

    def rebuild(local: Any) -> Any:
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)

    return to_local(), rebuild


def _lookup(layer: int, l2p: Any, ids: Any) -> Any:
    """``log2phy[ids]``, elementwise, for a tensor or a DTensor (any sharding but partial)."""
    parts = _dtensor_parts(ids)
    if parts is None:
        return l2p[ids]
    local, rebuild = parts
    if any(p.is_partial() for p in ids.placements):
        raise InvalidInputError(f"layer {layer}: TorchTitan expert ids as a partial DTensor are not supported")
    return rebuild(l2p[local])


def _select(layer: int, counts: Any, p2l: Any) -> Any:
    """``counts[phy2log]`` along the expert dim, for a tensor or a replicated / partial-sum DTensor."""
    parts = _dtensor_parts(counts)
    if parts is None:
        return counts.index_select(0, p2l)
    local, rebuild = parts
    if any(p.is_shard() for p in counts.placements):
        raise InvalidInputError(f"layer {layer}: TorchTitan per-expert counts sharded over experts are not supported")
    return rebuild(local.index_select(0, p2l))
